"""GPU telemetry through NVML: the only module in moescope that touches pynvml (nvidia-ml-py).

Every NVML call goes through `NvmlGateway.call`, which
  - initialises NVML lazily, on the first call;
  - maps "not supported", "function not found" (an older driver) and similar answers to an
    N/A value (`NA`) that prints as `N/A` and computes as NaN, warning once per missing function;
  - turns NVML_ERROR_GPU_IS_LOST into `GpuLost`, so the collector reports that GPU once, skips it
    from then on, and keeps sampling the others.

`NvmlCollector` samples, per GPU: name, uuid, memory (v2 with v1 fallback), utilization, NVLink
link count and per-link TX/RX throughput (cumulative field-value counters, rates from deltas over
NVML's own microsecond timestamps, wrap handled), PCIe TX/RX throughput, and the GPU memory of the
target process tree (NVML reports host-namespace pids). `open_nvml` returns None, after one clear
line, when there is no NVIDIA driver, and the agent runs on with the host memory signal.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pynvml

from moescope.collectors.host import MemorySignal, in_nested_pid_namespace, process_tree
from moescope.collectors.registry import CollectorConfig, register
from moescope.errors import NvmlUnavailable

if TYPE_CHECKING:  # for annotations only: no run-time dependency
    from typing_extensions import TypeIs

log = logging.getLogger("moescope.nvml")

FIELD_VALUES_MISSING = (
    "nvmlDeviceGetFieldValues missing (older driver): NVLink throughput is N/A; link count from "
    "nvmlDeviceGetNvLinkState; PCIe from nvmlDeviceGetPcieThroughput"
)
NO_DRIVER_LINE = "no NVIDIA driver: GPU telemetry off; using host memory signal"
DEFAULT_PERIOD_S = 0.2

# Field ids and enums, as pynvml names them (nvml.h values).
FI_NVLINK_LINK_COUNT = pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT  # 91, uiVal
FI_NVLINK_TX_KIB = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX  # 138, cumulative KiB, scopeId = link
FI_NVLINK_RX_KIB = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX  # 139
FI_PCIE_TX_BYTES = pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES  # 197, cumulative bytes
FI_PCIE_RX_BYTES = pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES  # 198
KIB = 1024

# Answers that mean "this value does not exist here": reported as N/A, never as an error.
_NA_CODES = {
    pynvml.NVML_ERROR_NOT_SUPPORTED: "not supported",
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: "function not found (older driver)",
    pynvml.NVML_ERROR_NO_PERMISSION: "no permission",
    pynvml.NVML_ERROR_NOT_FOUND: "not found",
    pynvml.NVML_ERROR_NO_DATA: "no data",
    pynvml.NVML_ERROR_INVALID_ARGUMENT: "invalid argument",
    pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH: "struct version not supported by this driver",
    pynvml.NVML_ERROR_INSUFFICIENT_SIZE: "insufficient size",
    pynvml.NVML_ERROR_TIMEOUT: "timeout",
    pynvml.NVML_ERROR_UNKNOWN: "unknown error",
}
# Answers after which NVML as a whole is unusable.
_FATAL_CODES = {
    pynvml.NVML_ERROR_UNINITIALIZED,
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
}


class NotAvailable:
    """A value NVML cannot give here. Prints as `N/A`, computes as NaN, is falsy; all N/A are equal."""

    __slots__ = ("reason",)

    def __init__(self, reason: str = "not available") -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return "N/A"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        # Keep width and alignment from the spec, drop the numeric type ("N/A" under "{:>8.1f}").
        width = "".join(ch for ch in spec.split(".")[0] if ch.isdigit() or ch in "<>^")
        return format("N/A", width)

    def __float__(self) -> float:
        return math.nan

    def __bool__(self) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NotAvailable)

    def __hash__(self) -> int:
        return hash(NotAvailable)

    def _nan(self, other: object) -> float:
        return math.nan

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _nan
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __pow__ = __rpow__ = _nan

    def __neg__(self) -> float:
        return math.nan

    def _false(self, other: object) -> bool:
        return False  # as NaN compares

    __lt__ = __le__ = __gt__ = __ge__ = _false


NA = NotAvailable()
MaybeInt = int | NotAvailable
MaybeFloat = float | NotAvailable
MaybeStr = str | NotAvailable


def is_na(value: object) -> TypeIs[NotAvailable]:
    """Whether `value` is N/A; a False narrows a `MaybeInt` to int (and so on) for the type checker."""
    return isinstance(value, NotAvailable)


class GpuLost(Exception):
    """Internal: NVML said NVML_ERROR_GPU_IS_LOST for this device."""


# ---------------------------------------------------------------- the gateway


class NvmlGateway:
    """The one way into NVML. `call(name, *args)` runs pynvml.<name>(*args) under the rules above."""

    def __init__(self, *, library_path: str | None = None) -> None:
        self.library_path = library_path
        self._lock = threading.Lock()
        self._initialised = False
        self._init_error: str | None = None
        self._warned: set[str] = set()
        self.na_counts: dict[str, int] = {}

    def ensure_initialised(self) -> None:
        """Initialise NVML once. Raises NvmlUnavailable (with NVML's reason) when it cannot be."""
        with self._lock:
            if self._initialised:
                return
            if self._init_error is not None:
                raise NvmlUnavailable(self._init_error)
            try:
                if self.library_path is not None:
                    # pynvml dlopens "libnvidia-ml.so.1"; a library already loaded under that
                    # soname is reused, so loading the configured file first makes pynvml use it.
                    ctypes.CDLL(self.library_path, mode=ctypes.RTLD_GLOBAL)
                pynvml.nvmlInit()
            except OSError as exc:
                self._init_error = f"NVML library not loadable: {exc}"
                raise NvmlUnavailable(self._init_error) from exc
            except pynvml.NVMLError as exc:
                self._init_error = f"NVML init failed: {exc}"
                raise NvmlUnavailable(self._init_error) from exc
            self._initialised = True

    def call(self, name: str, *args: Any, on_missing: str | None = None) -> Any:
        """pynvml.<name>(*args); NA for values that do not exist here; GpuLost; NvmlUnavailable.

        on_missing: the one warning to give if the driver lacks the function (say what replaces it).
        """
        self.ensure_initialised()
        fn: Callable[..., Any] = getattr(pynvml, name)
        try:
            return fn(*args)
        except pynvml.NVMLLibraryMismatchError:
            return self._na(name, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, on_missing)
        except pynvml.NVMLError as exc:
            code = int(exc.value)
            if code == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise GpuLost(name) from exc
            if code in _FATAL_CODES:
                raise NvmlUnavailable(f"{name}: {exc}") from exc
            return self._na(name, code, on_missing)

    def _na(self, name: str, code: int, on_missing: str | None) -> NotAvailable:
        reason = _NA_CODES.get(code, f"NVML error {code}")
        self.na_counts[name] = self.na_counts.get(name, 0) + 1
        if code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
            self.warn_once(name, on_missing or f"{name}: not in this driver's NVML (older driver); reported as N/A")
        else:
            # "Not supported" is normal on many GPUs (no NVLink, consumer boards): say it once, quietly.
            key = f"{name}:{code}"
            if key not in self._warned:
                self._warned.add(key)
                log.info("%s: %s; reported as N/A", name, reason)
        return NotAvailable(reason)

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)

    def shutdown(self) -> None:
        with self._lock:
            if self._initialised:
                self._initialised = False
                try:
                    pynvml.nvmlShutdown()
                except pynvml.NVMLError as exc:
                    log.debug("nvmlShutdown: %s", exc)


def is_missing(value: object) -> bool:
    """True for an N/A that came from a function this driver does not have."""
    return isinstance(value, NotAvailable) and value.reason == _NA_CODES[pynvml.NVML_ERROR_FUNCTION_NOT_FOUND]


# ---------------------------------------------------------------- samples


@dataclass(frozen=True, slots=True)
class NvLinkSample:
    link: int
    supported: bool  # False: NVML gave no counter for this link (see `error`)
    tx_bytes_per_s: MaybeFloat
    rx_bytes_per_s: MaybeFloat
    tx_total_bytes: MaybeInt  # the raw cumulative counter, in bytes
    rx_total_bytes: MaybeInt
    error: str | None = None  # NVML's answer for this link's counters when not NVML_SUCCESS


@dataclass(frozen=True, slots=True)
class ProcessGpuMemory:
    pid: int  # host pid namespace
    used_bytes: MaybeInt
    kind: Literal["compute", "graphics", "compute+graphics"]


@dataclass(frozen=True, slots=True)
class GpuSample:
    index: int
    name: MaybeStr
    uuid: MaybeStr
    memory_api: Literal["v2", "v1", "none"]
    memory_total_bytes: MaybeInt
    memory_used_bytes: MaybeInt
    memory_free_bytes: MaybeInt
    memory_reserved_bytes: MaybeInt  # N/A with the v1 API
    utilization_gpu_percent: MaybeInt
    utilization_memory_percent: MaybeInt
    nvlink_link_count: MaybeInt
    nvlinks: tuple[NvLinkSample, ...]
    pcie_tx_bytes_per_s: MaybeFloat
    pcie_rx_bytes_per_s: MaybeFloat
    processes: tuple[ProcessGpuMemory, ...]
    target_memory_used_bytes: MaybeInt  # sum over the target's pids on this GPU; 0 if none; N/A if unlisted

    @property
    def memory_in_use_bytes(self) -> MaybeInt:
        """total - free: what nobody else can allocate (v2 "used" leaves out driver-reserved memory)."""
        if is_na(self.memory_total_bytes) or is_na(self.memory_free_bytes):
            return NA
        return int(self.memory_total_bytes) - int(self.memory_free_bytes)


@dataclass(frozen=True, slots=True)
class NvmlSample:
    at_ns: int  # wall clock, time.time_ns()
    gpus: tuple[GpuSample, ...]
    lost_gpus: tuple[int, ...]  # indexes reported lost (this run); never sampled again
    target_pids: frozenset[int]

    def memory_signal(self) -> MemorySignal | None:
        """The fullest GPU among those the target uses (all GPUs when it uses none we can see)."""
        used_by_target = [g for g in self.gpus if any(p.pid in self.target_pids for p in g.processes)]
        candidates = used_by_target or list(self.gpus)
        best: tuple[float, GpuSample, int, int] | None = None  # (ratio, GPU, in use, total bytes)
        for gpu in candidates:
            in_use, total = gpu.memory_in_use_bytes, gpu.memory_total_bytes
            if is_na(in_use) or is_na(total) or total <= 0:
                continue
            ratio = in_use / total
            if best is None or ratio > best[0]:
                best = (ratio, gpu, in_use, total)
        if best is None:
            return None
        _, gpu, in_use_bytes, total_bytes = best
        return MemorySignal(in_use_bytes, total_bytes, "nvml", f"GPU {gpu.index} {gpu.uuid}")


# ---------------------------------------------------------------- counters


@dataclass(slots=True)
class _CounterState:
    value: int
    timestamp_us: int
    rate_per_s: MaybeFloat


class CounterRates:
    """Rates from cumulative counters over NVML's own timestamps (µs since 1970).

    Deltas are taken modulo the counter's width (32 or 64 bits, from the field's value type), so a
    wrap reads as the small step it is. A repeated timestamp means NVML has not refreshed the value:
    the previous rate stands. A timestamp that goes backwards restarts the baseline (N/A once).
    """

    def __init__(self) -> None:
        self._state: dict[tuple[int, int, int], _CounterState] = {}

    def update(
        self, key: tuple[int, int, int], value: int, timestamp_us: int, *, bits: int, scale: float
    ) -> MaybeFloat:
        prev = self._state.get(key)
        if prev is None or timestamp_us < prev.timestamp_us:
            self._state[key] = _CounterState(value, timestamp_us, NA)
            return NA
        if timestamp_us == prev.timestamp_us:
            return prev.rate_per_s
        delta = (value - prev.value) % (1 << bits)
        rate = delta * scale / ((timestamp_us - prev.timestamp_us) / 1e6)
        self._state[key] = _CounterState(value, timestamp_us, rate)
        return rate

    def forget(self, gpu_index: int) -> None:
        for key in [k for k in self._state if k[0] == gpu_index]:
            del self._state[key]


_VALUE_TYPE_BITS = {
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: 32,
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: 64,
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: 64,
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: 64,
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: 16,
}


def _field_int(fv: Any) -> tuple[int, int] | None:
    """(value, counter width in bits) of an integer field value; None for other types."""
    vt = int(fv.valueType)
    bits = _VALUE_TYPE_BITS.get(vt)
    if bits is None:
        return None
    raw = {
        pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: fv.value.uiVal,
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: fv.value.ulVal,
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: fv.value.ullVal,
        pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: fv.value.sllVal,
        pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: fv.value.usVal,
    }[vt]
    return int(raw) % (1 << bits), bits


# ---------------------------------------------------------------- the collector


@dataclass(slots=True)
class _Gpu:
    index: int
    handle: Any
    name: MaybeStr
    uuid: MaybeStr
    link_count: MaybeInt
    pcie_counters: bool  # PCIe byte counters via field values (else nvmlDeviceGetPcieThroughput)


class NvmlCollector:
    """Samples every GPU through one NvmlGateway. Not thread-safe: one supervisor thread drives it."""

    name = "nvml"

    def __init__(
        self,
        gateway: NvmlGateway,
        *,
        target_pid: int | None = None,
        period_s: float = DEFAULT_PERIOD_S,
        include_descendants: bool = True,
        proc_root: Path = Path("/proc"),
    ) -> None:
        self.gateway = gateway
        self.target_pid = target_pid
        self.period_s = period_s
        self.include_descendants = include_descendants
        self.proc_root = proc_root
        self._gpus: list[_Gpu] | None = None
        self._lost: list[int] = []
        self._rates = CounterRates()
        if target_pid is not None and in_nested_pid_namespace(proc_root=proc_root):
            log.warning(
                "the agent is not in the host PID namespace: NVML reports host pids, so the "
                "target's per-process GPU memory may not match (run with hostPID)"
            )

    # -- discovery

    def _discover(self) -> list[_Gpu]:
        gw = self.gateway
        count = gw.call("nvmlDeviceGetCount")
        gpus: list[_Gpu] = []
        for index in range(0 if is_na(count) else int(count)):
            try:
                handle = gw.call("nvmlDeviceGetHandleByIndex", index)
                if is_na(handle):
                    continue
                name = gw.call("nvmlDeviceGetName", handle)
                uuid = gw.call("nvmlDeviceGetUUID", handle)
                link_count = self._link_count(handle)
                pcie_counters = self._has_pcie_counters(handle)
            except GpuLost:
                self._report_lost(index, NA)
                continue
            gpus.append(_Gpu(index, handle, name, uuid, link_count, pcie_counters))
        return gpus

    def _link_count(self, handle: Any) -> MaybeInt:
        values = self.gateway.call(
            "nvmlDeviceGetFieldValues", handle, [FI_NVLINK_LINK_COUNT], on_missing=FIELD_VALUES_MISSING
        )
        if not is_na(values):
            fv = values[0]
            if int(fv.nvmlReturn) == pynvml.NVML_SUCCESS:
                parsed = _field_int(fv)
                return parsed[0] if parsed else NA
            if int(fv.nvmlReturn) == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise GpuLost("nvmlDeviceGetFieldValues")
            return 0 if int(fv.nvmlReturn) == pynvml.NVML_ERROR_NOT_SUPPORTED else NA
        # No field values (older driver): count links that answer nvmlDeviceGetNvLinkState.
        links = 0
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            state = self.gateway.call("nvmlDeviceGetNvLinkState", handle, link)
            if is_na(state):
                break
            links += 1
        return links

    def _has_pcie_counters(self, handle: Any) -> bool:
        values = self.gateway.call("nvmlDeviceGetFieldValues", handle, [FI_PCIE_TX_BYTES, FI_PCIE_RX_BYTES])
        if is_na(values):
            return False
        return all(int(fv.nvmlReturn) == pynvml.NVML_SUCCESS for fv in values)

    def _report_lost(self, index: int, name: MaybeStr) -> None:
        if index not in self._lost:
            self._lost.append(index)
            self._rates.forget(index)
            log.error("GPU %d (%s) is lost (NVML_ERROR_GPU_IS_LOST): no longer sampled; others continue", index, name)

    # -- sampling

    def target_pids(self) -> frozenset[int]:
        if self.target_pid is None:
            return frozenset()
        if self.include_descendants:
            return process_tree(self.target_pid, proc_root=self.proc_root)
        return frozenset({self.target_pid}) if (self.proc_root / str(self.target_pid)).is_dir() else frozenset()

    def collect(self) -> NvmlSample:
        if self._gpus is None:
            self._gpus = self._discover()
        pids = self.target_pids()
        samples: list[GpuSample] = []
        for gpu in list(self._gpus):
            try:
                samples.append(self._sample_gpu(gpu, pids))
            except GpuLost:
                self._report_lost(gpu.index, gpu.name)
                self._gpus.remove(gpu)
        return NvmlSample(time.time_ns(), tuple(samples), tuple(self._lost), pids)

    def _sample_gpu(self, gpu: _Gpu, pids: frozenset[int]) -> GpuSample:
        gw, h = self.gateway, gpu.handle
        memory_api: Literal["v2", "v1", "none"] = "v2"
        mem = gw.call(
            "nvmlDeviceGetMemoryInfo",
            h,
            pynvml.nvmlMemory_v2,
            on_missing="nvmlDeviceGetMemoryInfo_v2 missing (older driver): using v1; reserved memory is N/A",
        )
        if is_na(mem):
            mem = gw.call("nvmlDeviceGetMemoryInfo", h)
            memory_api = "v1"
        total: MaybeInt
        used: MaybeInt
        free: MaybeInt
        reserved: MaybeInt
        if is_na(mem):
            total = used = free = reserved = NA
            memory_api = "none"
        else:
            total, used, free = int(mem.total), int(mem.used), int(mem.free)
            reserved = int(mem.reserved) if memory_api == "v2" else NA
        util = gw.call("nvmlDeviceGetUtilizationRates", h)
        util_gpu: MaybeInt = NA if is_na(util) else int(util.gpu)
        util_mem: MaybeInt = NA if is_na(util) else int(util.memory)
        nvlinks, pcie_tx, pcie_rx = self._sample_counters(gpu)
        listed = self._processes(h)
        processes = listed or ()
        if listed is None or any(is_na(p.used_bytes) for p in processes if p.pid in pids):
            target_used: MaybeInt = NA
        else:
            # (none of the target's is N/A here: the filter is for the type checker)
            target_used = sum(p.used_bytes for p in processes if p.pid in pids and not is_na(p.used_bytes))
        return GpuSample(
            index=gpu.index,
            name=gpu.name,
            uuid=gpu.uuid,
            memory_api=memory_api,
            memory_total_bytes=total,
            memory_used_bytes=used,
            memory_free_bytes=free,
            memory_reserved_bytes=reserved,
            utilization_gpu_percent=util_gpu,
            utilization_memory_percent=util_mem,
            nvlink_link_count=gpu.link_count,
            nvlinks=nvlinks,
            pcie_tx_bytes_per_s=pcie_tx,
            pcie_rx_bytes_per_s=pcie_rx,
            processes=processes,
            target_memory_used_bytes=target_used,
        )

    def _sample_counters(self, gpu: _Gpu) -> tuple[tuple[NvLinkSample, ...], MaybeFloat, MaybeFloat]:
        """NVLink per-link and PCIe counters in one nvmlDeviceGetFieldValues call per GPU."""
        links = 0 if is_na(gpu.link_count) else int(gpu.link_count)
        request: list[tuple[int, int]] = []
        for link in range(links):
            request += [(FI_NVLINK_TX_KIB, link), (FI_NVLINK_RX_KIB, link)]
        if gpu.pcie_counters:
            request += [(FI_PCIE_TX_BYTES, 0), (FI_PCIE_RX_BYTES, 0)]
        answers: dict[tuple[int, int], tuple[MaybeFloat, MaybeInt, str | None]] = {}
        if request:
            values = self.gateway.call("nvmlDeviceGetFieldValues", gpu.handle, request)
            for i, (field_id, scope) in enumerate(request):
                answers[(field_id, scope)] = (
                    (NA, NA, values.reason) if is_na(values) else self._rate(gpu, values[i], field_id, scope)
                )
        nvlinks = []
        for link in range(links):
            tx_rate, tx_total, tx_error = answers[(FI_NVLINK_TX_KIB, link)]
            rx_rate, rx_total, rx_error = answers[(FI_NVLINK_RX_KIB, link)]
            error = tx_error or rx_error
            nvlinks.append(NvLinkSample(link, error is None, tx_rate, rx_rate, tx_total, rx_total, error))
        if gpu.pcie_counters:
            pcie_tx, pcie_rx = answers[(FI_PCIE_TX_BYTES, 0)][0], answers[(FI_PCIE_RX_BYTES, 0)][0]
        else:
            # Each call samples a byte counter over 20 ms inside the driver (KB/s; KB read as KiB).
            tx = self.gateway.call("nvmlDeviceGetPcieThroughput", gpu.handle, pynvml.NVML_PCIE_UTIL_TX_BYTES)
            rx = self.gateway.call("nvmlDeviceGetPcieThroughput", gpu.handle, pynvml.NVML_PCIE_UTIL_RX_BYTES)
            pcie_tx = NA if is_na(tx) else float(int(tx) * KIB)
            pcie_rx = NA if is_na(rx) else float(int(rx) * KIB)
        return tuple(nvlinks), pcie_tx, pcie_rx

    def _rate(self, gpu: _Gpu, fv: Any, field_id: int, scope: int) -> tuple[MaybeFloat, MaybeInt, str | None]:
        """(rate, counter in bytes, None) or (N/A, N/A, why) for one field value."""
        ret = int(fv.nvmlReturn)
        if ret == pynvml.NVML_ERROR_GPU_IS_LOST:
            raise GpuLost("nvmlDeviceGetFieldValues")
        if ret != pynvml.NVML_SUCCESS:
            return NA, NA, _NA_CODES.get(ret, f"NVML error {ret}")
        parsed = _field_int(fv)
        if parsed is None:
            return NA, NA, f"unexpected value type {int(fv.valueType)}"
        value, bits = parsed
        scale = KIB if field_id in (FI_NVLINK_TX_KIB, FI_NVLINK_RX_KIB) else 1
        rate = self._rates.update((gpu.index, field_id, scope), value, int(fv.timestamp), bits=bits, scale=scale)
        return rate, value * scale, None

    def _processes(self, handle: Any) -> tuple[ProcessGpuMemory, ...] | None:
        """Compute and graphics processes on this GPU; None when NVML gives neither list."""
        merged: dict[int, ProcessGpuMemory] = {}
        any_list = False
        for kind in ("compute", "graphics"):
            base = (
                "nvmlDeviceGetComputeRunningProcesses" if kind == "compute" else "nvmlDeviceGetGraphicsRunningProcesses"
            )
            procs = self.gateway.call(
                base + "_v3", handle, on_missing=f"{base}_v3 missing (older driver): using {base}_v2"
            )
            if is_missing(procs):
                procs = self.gateway.call(base + "_v2", handle)
            if is_na(procs):
                continue
            any_list = True
            for p in procs:
                # pynvml turns NVML_VALUE_NOT_AVAILABLE into None.
                used: MaybeInt = NA if p.usedGpuMemory is None else int(p.usedGpuMemory)
                pid = int(p.pid)
                if pid in merged:
                    # The same process in both lists: one allocation seen twice, not two.
                    prev = merged[pid]
                    both = max(float(prev.used_bytes), float(used))
                    merged[pid] = ProcessGpuMemory(pid, NA if math.isnan(both) else int(both), "compute+graphics")
                else:
                    merged[pid] = ProcessGpuMemory(pid, used, kind)
        return tuple(sorted(merged.values(), key=lambda p: p.pid)) if any_list else None

    def close(self) -> None:
        self.gateway.shutdown()


def open_nvml(
    *,
    target_pid: int | None = None,
    period_s: float = DEFAULT_PERIOD_S,
    library_path: str | None = None,
    proc_root: Path = Path("/proc"),
) -> NvmlCollector | None:
    """An NvmlCollector, or None after one line saying GPU telemetry is off (no NVIDIA driver)."""
    gateway = NvmlGateway(library_path=library_path)
    try:
        gateway.ensure_initialised()
    except NvmlUnavailable as exc:
        log.warning("%s (%s)", NO_DRIVER_LINE, exc)
        return None
    return NvmlCollector(gateway, target_pid=target_pid, period_s=period_s, proc_root=proc_root)


def _factory(config: CollectorConfig) -> NvmlCollector:
    collector = open_nvml(
        target_pid=config.target_pid,
        period_s=config.period_s,
        library_path=config.nvml_library,
        proc_root=config.proc_root,
    )
    if collector is None:
        raise NvmlUnavailable("no NVIDIA driver")
    return collector


register("nvml", _factory, help="GPU memory, PCIe and NVLink throughput per device (NVML)", memory_signal_priority=0)


# ---------------------------------------------------------------- command line


def _mib(value: MaybeInt | MaybeFloat, digits: int = 0) -> str:
    return "N/A" if is_na(value) else f"{float(value) / (1024 * 1024):.{digits}f}"


def format_sample(sample: NvmlSample) -> list[str]:
    """Human-readable lines: one per GPU, then one per NVLink and per process on it."""
    lines: list[str] = []
    for g in sample.gpus:
        lines.append(
            f"GPU {g.index} {g.name} {g.uuid}: mem {_mib(g.memory_in_use_bytes)}/{_mib(g.memory_total_bytes)} MiB "
            f"(used {_mib(g.memory_used_bytes)}, reserved {_mib(g.memory_reserved_bytes)}, api {g.memory_api}) "
            f"util gpu {g.utilization_gpu_percent}% mem {g.utilization_memory_percent}% "
            f"pcie tx {_mib(g.pcie_tx_bytes_per_s, 1)} rx {_mib(g.pcie_rx_bytes_per_s, 1)} MiB/s "
            f"nvlinks {g.nvlink_link_count} target {_mib(g.target_memory_used_bytes)} MiB"
        )
        for link in g.nvlinks:
            state = "" if link.supported else f" ({link.error})"
            lines.append(
                f"  nvlink {link.link}: tx {_mib(link.tx_bytes_per_s, 1)} rx {_mib(link.rx_bytes_per_s, 1)} "
                f"MiB/s{state}"
            )
        for p in g.processes:
            lines.append(f"  pid {p.pid} ({p.kind}): {_mib(p.used_bytes)} MiB")
    for index in sample.lost_gpus:
        lines.append(f"GPU {index}: lost")
    return lines


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moescope.collectors.nvml", description="Print NVML samples.")
    parser.add_argument("--pid", type=int, default=None, help="target process (its tree's GPU memory is shown)")
    parser.add_argument("--seconds", type=float, default=3.0, help="how long to sample")
    parser.add_argument("--period-ms", type=int, default=int(DEFAULT_PERIOD_S * 1000))
    parser.add_argument("--nvml-library", default=None, help="path to libnvidia-ml.so.1 (default: the loader's)")
    parser.add_argument("--require", action="store_true", help="exit 9 when NVML is unavailable")
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.INFO, format="nvml: %(levelname)s: %(message)s")
    collector = open_nvml(target_pid=args.pid, period_s=args.period_ms / 1000, library_path=args.nvml_library)
    if collector is None:
        return NvmlUnavailable.exit_code if args.require else 0
    try:
        deadline = time.monotonic() + args.seconds
        n = 0
        while True:
            sample = collector.collect()
            n += 1
            print(f"--- sample {n}")
            for line in format_sample(sample):
                print(line)
            signal = sample.memory_signal()
            print(f"memory signal: {signal}")
            if time.monotonic() + collector.period_s > deadline:
                break
            time.sleep(collector.period_s)
        print(f"samples: {n}, gpus: {len(sample.gpus)}, lost: {list(sample.lost_gpus)}")
        return 0
    finally:
        collector.close()


if __name__ == "__main__":
    sys.exit(main())
