"""Expert residency: where each expert's weights live, at which precision, and memory accounting.

Each expert's in-use weights are an immutable `ExpertHandle`. Commands build the new handle first
(the real copy happens there, outside the model's step) and then swap it into the table under the
lock; the model snapshots the table once per step, so in-flight work finishes on the old copy and
the next step uses the new one. fp32 master copies of every expert stay in host memory, so restores
and precision reverts are exact.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, TypedDict

import torch

from moescope.errors import UsageError
from moescope.examples.moe_runtime.config import PRECISIONS

HOST = "host"
TIER_DEVICE = "device"
TIER_HOST = "host"

TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class CommandError(UsageError):
    """A control command that cannot be carried out (bad argument, pool full); nothing changed."""


def torch_device(name: str) -> torch.device:
    """`cpu:N` names are logical partitions of host memory: they all compute on torch's cpu."""
    if name == "cpu" or name.startswith("cpu:"):
        return torch.device("cpu")
    return torch.device(name)


def validate_device_name(name: str) -> None:
    if name == "cpu":
        return
    kind, sep, index = name.partition(":")
    if kind not in ("cpu", "cuda") or not sep or not index.isdigit():
        raise UsageError(f"bad device name {name!r}: use cpu, cpu:N or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {name} requested but CUDA is not available")


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertHandle:
    """One expert's weights as used by the forward pass. Never mutated: replaced whole."""

    layer: int
    expert: int
    device: str  # a compute device name, or "host"
    tier: str  # "device" | "host"
    dtype: str  # "fp32" | "bf16" | "fp16"
    w1: torch.Tensor  # [d_model, d_ff]
    w3: torch.Tensor  # [d_model, d_ff]
    w2: torch.Tensor  # [d_ff, d_model]
    is_master: bool  # True when the tensors are the fp32 master copy itself (host, no extra bytes)

    @functools.cached_property
    def nbytes(self) -> int:  # the tensors never change: once per handle (`stats` sums it over all of them)
        return sum(t.numel() * t.element_size() for t in (self.w1, self.w3, self.w2))

    def describe(self) -> dict[str, str]:
        return {"device": self.device, "tier": self.tier, "dtype": self.dtype}


def _copy_to(src: torch.Tensor, *, device: torch.device, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """A real copy (never a view or alias of src), so moving bytes costs what it costs. One
    `to(copy=True)` where no pinned buffer is wanted: half the per-call cost of `empty` + `copy_`
    (5.4 against 11.5 µs a 32x32 tensor on this VM), which is most of a `set_precision` over
    58 x 256 experts (three copies each)."""
    if not pin:
        return src.to(device=device, dtype=dtype, copy=True)
    dst = torch.empty(src.shape, dtype=dtype, device=device, pin_memory=True)
    dst.copy_(src)
    return dst


# One move's result as the control socket answers it ("from" is a keyword: the functional form).
MoveResult = TypedDict(
    "MoveResult",
    {"layer": int, "expert": int, "from": dict[str, str], "to": dict[str, str], "bytes_moved": int, "noop": bool},
)


class DeviceMemory(TypedDict):
    expert_bytes: int
    non_expert_bytes: int
    used_bytes: int
    budget_bytes: int
    used_ratio: float
    resident_experts: int
    capacity_experts: int


class HostMemory(TypedDict):
    master_bytes: int
    offload_bytes: int
    total_bytes: int


class MemoryReport(TypedDict):
    """`ExpertStore.memory()`: bytes per compute device, on the host, and per fp32 expert."""

    devices: dict[str, DeviceMemory]
    host: HostMemory
    expert_bytes_fp32: int


def _copy_report(report: MemoryReport) -> MemoryReport:
    """A caller's own copy of a (cached) memory report: its dicts are the caller's to change."""
    return {"devices": {name: DeviceMemory(**pool) for name, pool in report["devices"].items()},
            "host": HostMemory(**report["host"]), "expert_bytes_fp32": report["expert_bytes_fp32"]}


class ExpertStore:
    """The expert table plus per-device resident pools (capacity in experts) and accounting."""

    def __init__(
        self,
        *,
        masters: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]],
        devices: list[str],
        capacity_experts: int,
        initial_resident: int,
        precision: str,
        budget_bytes: int,
        non_expert_bytes: int,
        cache_on_load: bool,
    ) -> None:
        self._lock = threading.Lock()
        self._masters = masters
        self.layers = len(masters)
        self.experts = len(masters[0])
        self.devices = list(devices)
        self.primary = devices[0]
        self.capacity: dict[str, int] = {d: capacity_experts for d in devices}
        self.budget_bytes = budget_bytes
        self.non_expert_bytes = non_expert_bytes
        self.cache_on_load = cache_on_load
        self.default_precision = precision
        # the fp32 masters never change: their sizes are taken once (every `stats` call reports them)
        w1, w3, w2 = masters[0][0]
        self._master_sizes = (sum(t.numel() * t.element_size() for row in masters for ws in row for t in ws),
                              sum(t.numel() * 4 for t in (w1, w3, w2)))
        self._pin = torch.cuda.is_available() and any(d.startswith("cuda") for d in devices)
        self.precision = [[precision] * self.experts for _ in range(self.layers)]
        # Explicitly offloaded experts stay on host until restored (on-demand loads never cache them).
        self.offloaded = [[False] * self.experts for _ in range(self.layers)]
        self.prev_device = [[self.primary] * self.experts for _ in range(self.layers)]
        self.migrations = 0
        self.precision_changes = 0
        # Bumped (under the lock) whenever an expert's device, tier, dtype, configured precision or
        # offloaded flag may have changed: `stats` clients re-read the placement only after it moves.
        self.placement_version = 0
        self._memory_cache: tuple[tuple[object, ...], MemoryReport] | None = None
        self._counts_cache: tuple[int, dict[str, int]] | None = None
        handles: list[list[ExpertHandle]] = []
        placed = 0
        # Fill pools layer-major, device by device, up to each pool's initial share.
        for layer in range(self.layers):
            row = []
            for expert in range(self.experts):
                device_index = placed // max(1, initial_resident) if initial_resident > 0 else len(devices)
                if device_index < len(devices):
                    row.append(self._build(layer, expert, device=devices[device_index], dtype=precision))
                    placed += 1
                else:
                    row.append(self._build(layer, expert, device=HOST, dtype=precision))
            handles.append(row)
        self._handles = handles

    # ----- building handles (the real copies) -----

    def _build(self, layer: int, expert: int, *, device: str, dtype: str) -> ExpertHandle:
        w1, w3, w2 = self._masters[layer][expert]
        if device == HOST:
            if dtype == "fp32":
                return ExpertHandle(layer, expert, HOST, TIER_HOST, dtype, w1, w3, w2, True)
            tdt = TORCH_DTYPES[dtype]
            cpu = torch.device("cpu")
            c1, c3, c2 = (_copy_to(t, device=cpu, dtype=tdt, pin=self._pin) for t in (w1, w3, w2))
            return ExpertHandle(layer, expert, HOST, TIER_HOST, dtype, c1, c3, c2, False)
        tdev = torch_device(device)
        tdt = TORCH_DTYPES[dtype]
        c1, c3, c2 = (_copy_to(t, device=tdev, dtype=tdt) for t in (w1, w3, w2))
        return ExpertHandle(layer, expert, device, TIER_DEVICE, dtype, c1, c3, c2, False)

    def load_for_step(self, handle: ExpertHandle) -> tuple[ExpertHandle, int]:
        """On-demand load of a host-tier expert into the primary device for one step (a real copy).
        With cache_on_load, the copy stays resident if the expert was not explicitly offloaded and
        the pool has room. Returns the loaded handle and the bytes moved."""
        tdev = torch_device(self.primary)
        tdt = TORCH_DTYPES[handle.dtype]
        c1, c3, c2 = (_copy_to(t, device=tdev, dtype=tdt) for t in (handle.w1, handle.w3, handle.w2))
        loaded = ExpertHandle(handle.layer, handle.expert, self.primary, TIER_DEVICE, handle.dtype, c1, c3, c2, False)
        if self.cache_on_load:
            with self._lock:
                current = self._handles[handle.layer][handle.expert]
                # Only cache if no command replaced the handle meanwhile.
                if current is handle and not self.offloaded[handle.layer][handle.expert] \
                        and self._resident_count(self.primary) < self.capacity[self.primary]:
                    self._handles[handle.layer][handle.expert] = loaded
                    self.placement_version += 1
        return loaded, loaded.nbytes

    # ----- reads -----

    def snapshot(self) -> list[list[ExpertHandle]]:
        """The table as one consistent picture; the model uses it for a whole step."""
        with self._lock:
            return [list(row) for row in self._handles]

    def _resident_count(self, device: str) -> int:
        return sum(1 for row in self._handles for h in row if h.tier == TIER_DEVICE and h.device == device)

    def handle(self, layer: int, expert: int) -> ExpertHandle:
        with self._lock:
            return self._handles[layer][expert]

    def memory(self) -> MemoryReport:
        # The report moves only with the placement (and a pool's capacity): a poller asks for it five
        # times a second, and at 48 x 128 experts the pass over every handle was most of a narrowed `stats`.
        with self._lock:
            key = (self.placement_version, tuple(self.capacity.items()))
            cached = self._memory_cache
            if cached is not None and cached[0] == key:
                return _copy_report(cached[1])
            handles = [h for row in self._handles for h in row]
        resident = {device: [0, 0] for device in self.devices}  # experts, bytes
        offload_bytes = 0
        for h in handles:  # one pass (at 48 layers x 128 experts this runs on every `stats` call)
            if h.tier == TIER_DEVICE:
                pool = resident.get(h.device)
                if pool is not None:
                    pool[0] += 1
                    pool[1] += h.nbytes
            elif not h.is_master:
                offload_bytes += h.nbytes
        devices: dict[str, DeviceMemory] = {}
        for device in self.devices:
            count, expert_bytes = resident[device]
            non_expert = self.non_expert_bytes if device == self.primary else 0
            used = expert_bytes + non_expert
            devices[device] = {
                "expert_bytes": expert_bytes,
                "non_expert_bytes": non_expert,
                "used_bytes": used,
                "budget_bytes": self.budget_bytes,
                "used_ratio": round(used / self.budget_bytes, 6),
                "resident_experts": count,
                "capacity_experts": self.capacity[device],
            }
        master_bytes, expert_bytes_fp32 = self._master_sizes
        report: MemoryReport = {
            "devices": devices,
            "host": {"master_bytes": master_bytes, "offload_bytes": offload_bytes,
                     "total_bytes": master_bytes + offload_bytes},
            "expert_bytes_fp32": expert_bytes_fp32,
        }
        self._memory_cache = (key, report)  # (a change meanwhile bumped the version: the key is behind, safe)
        return _copy_report(report)

    def table(self) -> dict[str, list[list[Any]]]:
        with self._lock:
            return {
                "device": [[h.device for h in row] for row in self._handles],
                "tier": [[h.tier for h in row] for row in self._handles],
                "dtype": [[h.dtype for h in row] for row in self._handles],
                "precision": [list(row) for row in self.precision],
                "offloaded": [list(row) for row in self.offloaded],
            }

    def precision_counts(self) -> dict[str, int]:
        with self._lock:
            cached = self._counts_cache
            if cached is not None and cached[0] == self.placement_version:
                return dict(cached[1])
            counts = {p: 0 for p in PRECISIONS}
            for row in self.precision:
                for p in row:
                    counts[p] += 1
            self._counts_cache = (self.placement_version, counts)
            return dict(counts)

    # ----- commands (all-or-nothing; copies made before the swap) -----

    def check_expert(self, layer: int, expert: int) -> None:
        if not 0 <= layer < self.layers:
            raise CommandError(f"layer {layer} out of range 0..{self.layers - 1}")
        if not 0 <= expert < self.experts:
            raise CommandError(f"expert {expert} out of range 0..{self.experts - 1}")

    def _check_target(self, device: str) -> None:
        if device != HOST and device not in self.devices:
            raise CommandError(f"unknown device {device!r}: this runtime has {self.devices + [HOST]}")

    def _check_room(self, device: str, current: ExpertHandle) -> None:
        if device == HOST or (current.tier == TIER_DEVICE and current.device == device):
            return
        used = self._resident_count(device)
        if used >= self.capacity[device]:
            raise CommandError(f"device {device} resident pool full ({used}/{self.capacity[device]} experts)")

    def _move(self, layer: int, expert: int, *, device: str, dtype: str, offloaded: bool) -> MoveResult:
        self.check_expert(layer, expert)
        self._check_target(device)
        if dtype not in PRECISIONS:
            raise CommandError(f"dtype must be one of {list(PRECISIONS)}, got {dtype!r}")
        with self._lock:
            current = self._handles[layer][expert]
            if current.device == device and current.dtype == dtype:
                flag = offloaded if device == HOST else False
                if self.offloaded[layer][expert] != flag:
                    self.offloaded[layer][expert] = flag
                    self.placement_version += 1
                return {"layer": layer, "expert": expert, "from": current.describe(),
                        "to": current.describe(), "bytes_moved": 0, "noop": True}
            self._check_room(device, current)
        # The copy runs outside the lock: serving continues on the old handle meanwhile.
        new = self._build(layer, expert, device=device, dtype=dtype)
        with self._lock:
            if self._handles[layer][expert] is not current:
                raise CommandError(f"expert ({layer}, {expert}) changed concurrently; retry")
            self._check_room(device, current)
            if current.tier == TIER_DEVICE:
                self.prev_device[layer][expert] = current.device
            self._handles[layer][expert] = new
            self.offloaded[layer][expert] = offloaded
            if device != HOST:
                self.precision[layer][expert] = dtype
            self.migrations += 1
            self.placement_version += 1
        return {"layer": layer, "expert": expert, "from": current.describe(), "to": new.describe(),
                "bytes_moved": 0 if new.is_master else new.nbytes, "noop": False}

    def migrate(self, layer: int, expert: int, *, device: str, dtype: str | None) -> MoveResult:
        self.check_expert(layer, expert)
        target_dtype = dtype if dtype is not None else self.precision[layer][expert]
        return self._move(layer, expert, device=device, dtype=target_dtype, offloaded=device == HOST)

    def offload(self, layer: int, expert: int, *, dtype: str) -> MoveResult:
        return self._move(layer, expert, device=HOST, dtype=dtype, offloaded=True)

    def restore(self, layer: int, expert: int, *, device: str | None) -> MoveResult:
        self.check_expert(layer, expert)
        current = self.handle(layer, expert)
        if device is None:
            device = self.prev_device[layer][expert] if current.tier == TIER_HOST else current.device
        if device == HOST:
            raise CommandError("restore_expert needs a compute device, not 'host'")
        if current.tier == TIER_DEVICE and current.device != device:
            raise CommandError(f"expert ({layer}, {expert}) is not on host but on {current.device}; use migrate_expert")
        return self._move(layer, expert, device=device, dtype=self.precision[layer][expert], offloaded=False)

    def set_precision(self, precision: str, experts: list[tuple[int, int]] | None) -> dict[str, object]:
        if precision not in PRECISIONS:
            raise CommandError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
        targets = experts if experts is not None else [
            (layer, expert) for layer in range(self.layers) for expert in range(self.experts)]
        for layer, expert in targets:
            self.check_expert(layer, expert)
        # Build every new copy first (all-or-nothing), then swap them all under one lock.
        snapshot = self.snapshot()
        with self._lock:
            offloaded = [row[:] for row in self.offloaded]
        builds: dict[tuple[int, int], ExpertHandle | None] = {}
        for layer, expert in targets:
            current = snapshot[layer][expert]
            if current.dtype == precision or (current.tier == TIER_HOST and offloaded[layer][expert]):
                builds[(layer, expert)] = None  # offloaded copies keep their dtype until restored
            else:
                builds[(layer, expert)] = self._build(layer, expert, device=current.device, dtype=precision)
        changed = 0
        with self._lock:
            for (layer, expert), new in builds.items():
                if self.precision[layer][expert] != precision:
                    changed += 1
                self.precision[layer][expert] = precision
                if new is not None and self._handles[layer][expert] is snapshot[layer][expert]:
                    self._handles[layer][expert] = new
            if experts is None:
                self.default_precision = precision
            self.precision_changes += 1
            self.placement_version += 1
        return {"changed": changed, "precision": precision, "counts": self.precision_counts()}

    def set_capacity(self, device: str, experts: int) -> dict[str, object]:
        if device not in self.devices:
            raise CommandError(f"unknown device {device!r}: this runtime has {self.devices}")
        if experts < 0:
            raise CommandError(f"experts must be >= 0, got {experts}")
        with self._lock:
            resident = self._resident_count(device)
            if experts < resident:
                raise CommandError(
                    f"device {device} holds {resident} experts; offload some before shrinking to {experts}"
                )
            self.capacity[device] = experts
        return {"device": device, "capacity_experts": experts, "resident_experts": resident}

    def prefetch(self, *, count: int, layer: int | None, device: str | None,
                 hotness: list[list[float]], cumulative: list[list[int]]) -> dict[str, object]:
        if count < 0:
            raise CommandError(f"count must be >= 0, got {count}")
        target = device if device is not None else self.primary
        if target not in self.devices:
            raise CommandError(f"unknown device {target!r}: this runtime has {self.devices}")
        if layer is not None:
            self.check_expert(layer, 0)
        snapshot = self.snapshot()
        candidates = [
            (hotness[lyr][e], cumulative[lyr][e], lyr, e)
            for lyr in (range(self.layers) if layer is None else [layer])
            for e in range(self.experts)
            if snapshot[lyr][e].tier == TIER_HOST
        ]
        candidates.sort(key=lambda c: (-c[0], -c[1], c[2], c[3]))
        loaded: list[list[int]] = []
        bytes_moved = 0
        skipped = 0
        for _, _, lyr, e in candidates[:count]:
            try:
                result = self._move(lyr, e, device=target, dtype=self.precision[lyr][e], offloaded=False)
            except CommandError:
                skipped += 1
                continue
            loaded.append([lyr, e])
            bytes_moved += result["bytes_moved"]
        return {"loaded": loaded, "bytes_moved": bytes_moved, "skipped_pool_full": skipped, "device": target}
