"""Live state snapshot: what the agent knows right now, for `agent top` and `agent start --tui`.

The daemon fills one `Snapshot` (typed dataclasses below) from its pipeline, and a `StatePublisher`
writes it, atomically, as JSON to ``<state dir>/agent-<pid>.state.json`` (default state dir
``/run/moescope``; ``MOESCOPE_STATE_DIR`` overrides it). `agent top` finds the running agent(s) with
`find_agents` and reads the file with `read_snapshot`; it needs no privilege beyond reading that
file. The file is mode 0644 by default (world-readable: it carries only aggregate numbers, pids and
process names); pass ``mode=0o640`` and ``group=`` to restrict it to one group.

Conventions: every number is in the unit its field name says (``_ms``, ``_bytes``, ``_per_s``,
``_pct`` is 0..100); ``None`` means "not measured" and is shown as ``N/A`` (NaN is written as
``null``). The JSON carries ``"version": SCHEMA_VERSION``; a reader refuses a version outside
``READABLE_VERSIONS`` with a one-line error and ignores keys it does not know, so fields may be
added without a version bump.

Version 2 packs a list of numbers of at least ``PACKED_MIN_VALUES`` values (per-expert shares: at
58 layers x 256 experts they were 90 % of a 156 KB file and of its encoding time) as one object
with one key, base64 of little-endian binary:

    {"u32_micro": B64}  unsigned 32-bit integers, value = integer / 1e6 (written only when every
                        value is exactly such a number, as the shares rounded to 1e-6 are)
    {"f64": B64}        IEEE float64 (NaN where a value is not finite, as null is elsewhere)

Shorter lists stay plain JSON arrays. Version 1 files (never packed) are read as before.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import dataclasses
import json
import logging
import math
import os
import re
import select
import struct
import threading
import time
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from moescope import errors
from moescope.agent.phase_table import Phases
from moescope.procfs import name_thread, pid_exists

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)  # v1: no packed lists; an agent of the previous release is still shown
# Lists of numbers this long or longer are packed (v2); shorter ones stay readable as JSON arrays.
PACKED_MIN_VALUES = 64
PACKED_MICRO = "u32_micro"
PACKED_F64 = "f64"
_MICRO = 1e6
_U32_MAX = float(np.iinfo(np.uint32).max)
DEFAULT_STATE_DIR = "/run/moescope"
STATE_DIR_ENV = "MOESCOPE_STATE_DIR"
STATE_FILE_RE = re.compile(r"^agent-(\d+)\.state\.json$")
# Per-layer expert shares are binned to at most this many values so a 16384-expert model stays small.
MAX_EXPERT_BINS = 256

RuleState = Literal["armed", "pending", "firing", "cooling"]
RULE_STATES: tuple[str, ...] = typing.get_args(RuleState)


@dataclass(frozen=True, slots=True)
class Target:
    """A process the agent is attached to."""

    pid: int
    comm: str


@dataclass(frozen=True, slots=True)
class SourceStats:
    """One event source (ingress probe, NVTX ring, NVML sampler, ...)."""

    name: str
    events_per_s: float | None = None
    drops_total: int | None = None


@dataclass(frozen=True, slots=True)
class Header:
    agent_pid: int
    started_unix_s: float
    targets: list[Target] = field(default_factory=list)
    probes_attached: list[str] = field(default_factory=list)
    sources: list[SourceStats] = field(default_factory=list)
    dry_run: bool = False


@dataclass(frozen=True, slots=True)
class Requests:
    """Kernel-measured requests (first byte read → last byte written) over a sliding window."""

    window_s: float | None = None
    rate_per_s: float | None = None
    latency_p50_ms: float | None = None
    latency_p95_ms: float | None = None
    latency_p99_ms: float | None = None
    errors_total: int | None = None
    errors_per_s: float | None = None


@dataclass(frozen=True, slots=True)
class Network:
    """Kernel network signals on the targets' ports and namespaces over a sliding window (None:
    the netsig source is off or has not read yet)."""

    window_s: float | None = None
    listen_overflows_per_s: float | None = None
    retransmits_per_s: float | None = None
    resets_per_s: float | None = None
    listen_overflows_total: int | None = None


@dataclass(frozen=True, slots=True)
class HotExpert:
    expert: int
    share: float  # fraction of the layer's routed tokens


@dataclass(frozen=True, slots=True)
class MoeLayer:
    """Routing health of one MoE layer over the MoE window.

    ``expert_token_share[i]`` is the fraction of routed tokens that went to experts
    ``[i * experts_per_bin, (i + 1) * experts_per_bin)``; the shares sum to 1 (or the list is empty
    when no tokens were routed). Use `bin_expert_shares` to build it from per-expert counts.
    """

    layer: int
    num_experts: int
    experts_per_bin: int = 1
    expert_token_share: list[float] = field(default_factory=list)
    # the few most loaded experts, hottest first (binning can hide them; see `hottest_experts`)
    hot_experts: list[HotExpert] = field(default_factory=list)
    tokens_total: int | None = None
    entropy_bits: float | None = None
    gini: float | None = None
    capacity_drops: int | None = None
    precision: str | None = None
    # expert id (as a string: JSON keys) → precision, only where it differs from `precision`
    expert_precision: dict[str, str] = field(default_factory=dict)
    resident_device: int | None = None
    resident_host: int | None = None

    @property
    def entropy_norm(self) -> float | None:
        """Entropy divided by log2(E): 1.0 is a perfectly uniform router."""
        if self.entropy_bits is None or self.num_experts < 2:
            return None
        return self.entropy_bits / math.log2(self.num_experts)


@dataclass(frozen=True, slots=True)
class Moe:
    window_s: float | None = None
    layers: list[MoeLayer] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Rank:
    """One producer process (an expert-parallel rank) over the window: its own NVTX ring's steps."""

    pid: int
    comm: str | None = None
    steps_per_s: float | None = None
    step_p50_ms: float | None = None
    step_p99_ms: float | None = None
    tokens_per_s: float | None = None
    steps_total: int | None = None  # since the agent first saw it
    nvtx_drops_total: int | None = None  # records its ring lost, every reason; None: not known
    exited: bool = False  # the process exited while observed (its row stays until RANK_RETENTION_NS)


@dataclass(frozen=True, slots=True)
class Ranks:
    """Per-producer rows, sorted by pid; the live view shows them when more than one is seen."""

    window_s: float | None = None
    ranks: list[Rank] = field(default_factory=list)
    max_ranks: int | None = None  # pids with a row of their own at most
    untracked_steps: int = 0  # steps of pids past that bound (in the totals, not in a row)


@dataclass(frozen=True, slots=True)
class NvLink:
    link: int
    tx_bytes_per_s: float | None = None
    rx_bytes_per_s: float | None = None


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    name: str | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    utilization_pct: float | None = None
    nvlinks: list[NvLink] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class HostBudget:
    """The memory signal when there is no GPU: `source` says where it comes from (e.g. cgroup)."""

    source: str
    used_bytes: int | None = None
    total_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Devices:
    gpus: list[Gpu] = field(default_factory=list)
    host_budget: HostBudget | None = None


@dataclass(frozen=True, slots=True)
class RuleStatus:
    """One policy rule. `progress` is how far its condition is through its window, 0..1
    (while cooling: how far through the cooldown)."""

    name: str
    state: RuleState
    progress: float | None = None
    signal: str | None = None
    value: float | None = None
    threshold: float | None = None
    unit: str | None = None
    comparison: Literal[">", "<"] = ">"


@dataclass(frozen=True, slots=True)
class ActionRecord:
    """One audited policy action (see the policy engine's audit log for the full record)."""

    at_unix_s: float
    rule: str
    action: str
    outcome: str
    latency_ms: float | None = None
    detail: str | None = None


@dataclass(frozen=True, slots=True)
class Policy:
    rules: list[RuleStatus] = field(default_factory=list)
    recent_actions: list[ActionRecord] = field(default_factory=list)
    actions_total: int | None = None  # audit records since the engine started (recent_actions: the last few)


@dataclass(frozen=True, slots=True)
class SelfCost:
    cpu_pct: float | None = None
    rss_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    header: Header
    taken_unix_s: float
    seq: int = 0
    publish_interval_s: float | None = None
    requests: Requests = field(default_factory=Requests)
    # "where the time goes" over the request window (agent/phase_table.py); None: not published
    phases: Phases | None = None
    network: Network = field(default_factory=Network)
    moe: Moe = field(default_factory=Moe)
    ranks: Ranks = field(default_factory=Ranks)
    devices: Devices = field(default_factory=Devices)
    policy: Policy = field(default_factory=Policy)
    self_cost: SelfCost = field(default_factory=SelfCost)
    version: int = SCHEMA_VERSION


# ----------------------------------------------------------------------------------------------
# helpers for the producer


def bin_expert_shares(
    tokens_per_expert: Sequence[float], *, max_bins: int = MAX_EXPERT_BINS
) -> tuple[list[float], int]:
    """Turn per-expert token counts into (shares, experts_per_bin) with at most `max_bins` bins.

    The last bin may hold fewer experts. No tokens at all gives an empty list.
    """
    if max_bins < 1:
        raise ValueError("max_bins must be >= 1")
    n = len(tokens_per_expert)
    total = float(sum(tokens_per_expert))
    if n == 0 or total <= 0.0:
        return [], 1
    per_bin = max(1, math.ceil(n / max_bins))
    shares = [sum(tokens_per_expert[i : i + per_bin]) / total for i in range(0, n, per_bin)]
    return shares, per_bin


HOT_EXPERTS = 3  # hottest experts named per layer in the live view


def hottest_experts(tokens_per_expert: Sequence[float], *, k: int = HOT_EXPERTS) -> list[HotExpert]:
    """The `k` experts with the most tokens (ties: lower id first), as shares of all tokens."""
    total = float(sum(tokens_per_expert))
    if total <= 0.0 or k < 1:
        return []
    order = sorted(range(len(tokens_per_expert)), key=lambda i: (-tokens_per_expert[i], i))[:k]
    return [HotExpert(expert=i, share=tokens_per_expert[i] / total) for i in order]


class SelfCostMeter:
    """The agent's own cost: CPU % of one core (all threads) since the previous sample, and RSS."""

    def __init__(self) -> None:
        self._page_bytes = os.sysconf("SC_PAGE_SIZE")
        self._last_wall_s = time.monotonic()
        self._last_cpu_s = self._cpu_s()

    @staticmethod
    def _cpu_s() -> float:
        t = os.times()
        return t.user + t.system

    def _rss_bytes(self) -> int | None:
        try:
            with open("/proc/self/statm", "rb") as f:
                return int(f.read().split()[1]) * self._page_bytes
        except (OSError, IndexError, ValueError):
            return None

    def sample(self) -> SelfCost:
        wall_s, cpu_s = time.monotonic(), self._cpu_s()
        elapsed_s = wall_s - self._last_wall_s
        cpu_pct = (cpu_s - self._last_cpu_s) / elapsed_s * 100.0 if elapsed_s > 0 else None
        self._last_wall_s, self._last_cpu_s = wall_s, cpu_s
        return SelfCost(cpu_pct=cpu_pct, rss_bytes=self._rss_bytes())


# ----------------------------------------------------------------------------------------------
# JSON (de)serialisation


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
_PLAIN_TYPES = frozenset({int, str, bool, type(None)})


def _to_tree(value: Any) -> Any:
    """Dataclass tree → JSON-ready tree; NaN/inf become null. (Faster than dataclasses.asdict,
    which deep-copies: this runs at the publish rate inside the agent.)"""
    cls = type(value)
    if cls in _PLAIN_TYPES:  # by exact type first: most values are these, and known dataclasses
        return value
    if cls is float:
        return value if math.isfinite(value) else None
    names = _FIELD_NAMES.get(cls)
    if names is not None:
        return {name: _to_tree(getattr(value, name)) for name in names}
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = _FIELD_NAMES.get(cls)
        if names is None:
            names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
        return {name: _to_tree(getattr(value, name)) for name in names}
    if isinstance(value, (list, tuple)):
        if value and type(value[0]) is float:
            if len(value) >= PACKED_MIN_VALUES:
                packed = _pack_floats(value)
                if packed is not None:
                    return packed
            isfinite = math.isfinite
            return [v if type(v) is float and isfinite(v) else _to_tree(v) for v in value]
        return [_to_tree(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_tree(v) for k, v in value.items()}
    return value


def _pack_floats(values: Sequence[float]) -> dict[str, str] | None:
    """A list of numbers as one packed object (see the module doc); None when it holds something
    else than numbers (then it is written as a plain list)."""
    try:
        array = np.array(values, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    if array.ndim != 1:
        return None
    with np.errstate(invalid="ignore", over="ignore"):
        micro = np.rint(array * _MICRO)
        # NaN fails the equality, inf the range check: both are written as float64
        exact = bool((micro / _MICRO == array).all()) and 0 <= micro.min() and micro.max() <= _U32_MAX
    if exact:  # shares rounded to 1e-6: half the bytes of float64, and still every value exactly
        return {PACKED_MICRO: base64.b64encode(micro.astype("<u4").tobytes()).decode("ascii")}
    array = np.where(np.isfinite(array), array, np.nan)  # as null elsewhere: not finite reads as NaN
    return {PACKED_F64: base64.b64encode(array.astype("<f8").tobytes()).decode("ascii")}


def _unpack_floats(value: dict[str, Any], where: str) -> list[float]:
    """A packed list back to floats; _FormatError (naming `where`) for anything else."""
    if len(value) != 1:
        raise _FormatError(f"{where}: expected a list of numbers or one packed object")
    ((kind, text),) = value.items()
    dtype = {PACKED_MICRO: "<u4", PACKED_F64: "<f8"}.get(kind)
    if dtype is None or not isinstance(text, str):
        raise _FormatError(f"{where}: expected a list of numbers or one packed object")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise _FormatError(f"{where}: packed {kind} is not base64") from None
    itemsize = np.dtype(dtype).itemsize
    if len(raw) % itemsize:
        raise _FormatError(f"{where}: packed {kind} is {len(raw)} bytes, not a multiple of {itemsize}")
    array = np.frombuffer(raw, dtype=dtype)
    floats = array / _MICRO if kind == PACKED_MICRO else array.astype(np.float64)
    return typing.cast(list[float], floats.tolist())


def to_dict(snapshot: Snapshot) -> dict[str, Any]:
    return typing.cast(dict[str, Any], _to_tree(snapshot))


def to_json(snapshot: Snapshot) -> str:
    return json.dumps(to_dict(snapshot), separators=(",", ":"), allow_nan=False)


class _FormatError(ValueError):
    pass


def _decode(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise _FormatError(f"{where}: null not allowed")
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _decode(arg, value, where)
            except _FormatError:
                continue
        raise _FormatError(f"{where}: unexpected {type(value).__name__}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise _FormatError(f"{where}: {value!r} not one of {typing.get_args(tp)}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if item_tp is float and isinstance(value, dict):  # v2: a long list, packed
            return _unpack_floats(value, where)
        if not isinstance(value, list):
            raise _FormatError(f"{where}: expected a list")
        if item_tp is float:
            # fast path (expert shares are most of the bytes); null is a NaN written by to_json
            if not all(v is None or type(v) is float or type(v) is int for v in value):
                raise _FormatError(f"{where}: expected a list of numbers")
            try:
                return [math.nan if v is None else float(v) for v in value]
            except OverflowError:
                raise _FormatError(f"{where}: number out of range") from None
        return [_decode(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _FormatError(f"{where}: expected an object")
        _, val_tp = typing.get_args(tp)
        return {str(k): _decode(val_tp, v, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _decode_dataclass(tp, value, where)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _FormatError(f"{where}: expected a number")
        try:
            return float(value)
        except OverflowError:  # an integer beyond float range
            raise _FormatError(f"{where}: number out of range") from None
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _FormatError(f"{where}: expected an integer")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise _FormatError(f"{where}: expected a string")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise _FormatError(f"{where}: expected true/false")
        return value
    raise _FormatError(f"{where}: unsupported type {tp!r}")


# Per dataclass: (field name, resolved type, required) — typing.get_type_hints per object was most
# of a reader's time at 58 layers (it re-resolves every annotation string on each call).
_DECODE_FIELDS: dict[type, tuple[tuple[str, Any, bool], ...]] = {}


def _decode_fields(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    fields = _DECODE_FIELDS.get(cls)
    if fields is None:
        hints = typing.get_type_hints(cls)
        fields = _DECODE_FIELDS[cls] = tuple(
            (f.name, hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls)
        )
    return fields


def _decode_dataclass(cls: type, value: Any, where: str) -> Any:
    if not isinstance(value, dict):
        raise _FormatError(f"{where}: expected an object")
    kwargs: dict[str, Any] = {}
    for name, hint, required in _decode_fields(cls):
        if name in value:
            kwargs[name] = _decode(hint, value[name], f"{where}.{name}")
        elif required:
            raise _FormatError(f"{where}: missing {name!r}")
    return cls(**kwargs)


def from_dict(data: Any) -> Snapshot:
    """JSON tree → Snapshot; raises SourceUnavailable (one line) on another version or bad shape."""
    if not isinstance(data, dict):
        raise errors.SourceUnavailable("agent state: not a JSON object")
    version = data.get("version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise errors.SourceUnavailable(
            f"agent state: schema version {version!r}, this reader understands "
            f"{' and '.join(str(v) for v in READABLE_VERSIONS)}"
        )
    data = {**data, "version": SCHEMA_VERSION}  # read as the current schema: a v1 file is a v2 one unpacked
    try:
        return typing.cast(Snapshot, _decode_dataclass(Snapshot, data, "state"))
    except _FormatError as exc:
        raise errors.SourceUnavailable(f"agent state: bad format: {errors.one_line(str(exc))}") from None



def from_json(text: str) -> Snapshot:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise errors.SourceUnavailable(f"agent state: not JSON ({exc.msg} at char {exc.pos})") from None
    except RecursionError:  # json recurses per nested array/object
        raise errors.SourceUnavailable("agent state: not JSON (nested too deeply)") from None
    except ValueError as exc:  # e.g. an integer literal over Python's digit limit
        raise errors.SourceUnavailable(f"agent state: not JSON ({errors.one_line(str(exc))})") from None
    return from_dict(data)


# ----------------------------------------------------------------------------------------------
# publisher (daemon side) and reader (`agent top` side)


def state_dir_default() -> Path:
    return Path(os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR)


def state_file_for(state_dir: Path, pid: int) -> Path:
    return state_dir / f"agent-{pid}.state.json"


class StatePublisher:
    """Writes snapshots atomically (temp file + rename in the same directory) to one state file.

    Readers never see a half-written file. `close()` removes the file so `agent top` stops
    finding an agent that has exited cleanly; a crashed agent's file is ignored because its pid
    is gone (see `find_agents`).
    """

    def __init__(
        self,
        *,
        state_dir: Path | None = None,
        pid: int | None = None,
        mode: int = 0o644,
        group: int | None = None,
    ) -> None:
        self.state_dir = state_dir if state_dir is not None else state_dir_default()
        self.path = state_file_for(self.state_dir, pid if pid is not None else os.getpid())
        # One temp name per state file, not mkstemp's random one per publish (its name generation
        # was a third of an idle agent's publish); find_agents never matches it (leading dot).
        self._tmp_path = str(self.state_dir / f".{self.path.name}.tmp")
        self._lock = threading.Lock()  # the one temp name: publishes of one publisher never overlap
        self.mode = mode
        self.group = group
        self.published = 0
        self.failures = 0
        try:
            if not self.state_dir.is_dir():
                self.state_dir.mkdir(parents=True, exist_ok=True)
                os.chmod(self.state_dir, 0o755)  # readable by `agent top` whatever our umask
        except OSError as exc:
            raise errors.SourceUnavailable(f"cannot create state dir {self.state_dir}: {exc.strerror}") from None

    def publish(self, snapshot: Snapshot) -> None:
        data = to_json(snapshot).encode()
        with self._lock:
            self._write(data)
            self.published += 1

    def _open_tmp(self) -> int:
        # O_EXCL | O_NOFOLLOW: never write through a link or into a file someone else made there
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(self._tmp_path, flags, 0o600)
        except FileExistsError:  # left by a publish that was killed mid-write: replace it
            os.unlink(self._tmp_path)
            return os.open(self._tmp_path, flags, 0o600)

    def _write(self, data: bytes) -> None:
        tmp = self._tmp_path
        fd = self._open_tmp()
        try:
            os.fchmod(fd, self.mode)
            if self.group is not None:
                os.fchown(fd, -1, self.group)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.close(fd)
            fd = -1
            os.replace(tmp, self.path)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def close(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


# inotify(7): the event mask bits and the event header the state dir's watch uses
_IN_OPEN = 0x00000020
_IN_Q_OVERFLOW = 0x00004000
_INOTIFY_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name


class StateReaders:
    """Whether anyone opened the state file lately: an inotify watch (IN_OPEN) on the state dir,
    kept to events naming the file. `agent top` opens it at every refresh, so "opened in the last
    few seconds" is "someone is watching". Any reader counts, whatever its privileges: it needs no
    write access to tell the agent it is there. The publisher's own temp file has another name."""

    def __init__(self, directory: Path, name: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = os.fsencode(name)
        self.clock = clock
        self.last_open_s: float | None = None
        self.opens = 0  # opens seen (inotify folds identical events queued back to back into one)
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise errors.SourceUnavailable(f"inotify_init1: {os.strerror(err)}")
        if libc.inotify_add_watch(fd, os.fsencode(str(directory)), _IN_OPEN) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise errors.SourceUnavailable(f"cannot watch {directory} for readers: {os.strerror(err)}")
        self._fd = fd

    def opened_within(self, seconds: float) -> bool:
        """Reads the events queued since the last call (never blocks); True when the file was opened
        in the last ``seconds``."""
        now = self.clock()
        while True:
            try:
                data = os.read(self._fd, 4096)
            except BlockingIOError:
                break
            at = 0
            while at + _INOTIFY_EVENT.size <= len(data):
                _, mask, _, length = _INOTIFY_EVENT.unpack_from(data, at)
                name = data[at + _INOTIFY_EVENT.size : at + _INOTIFY_EVENT.size + length].rstrip(b"\0")
                at += _INOTIFY_EVENT.size + length
                # an overflowed queue may have lost a reader's open: count it as one
                if mask & _IN_Q_OVERFLOW or (mask & _IN_OPEN and name == self.name):
                    self.last_open_s = now
                    self.opens += 1
        return self.seen_within(seconds)

    def seen_within(self, seconds: float) -> bool:
        """Whether an open already read was in the last ``seconds`` (no read of the watch: any
        thread may ask while the one that reads it, the publisher's, does)."""
        last = self.last_open_s
        return last is not None and self.clock() - last <= seconds

    def fileno(self) -> int:
        """The inotify descriptor: readable when an event (a reader's open) is queued."""
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class PeriodicPublisher:
    """Publishes `get_snapshot()` on a daemon thread: every `interval_s` while someone reads the
    state file (opened it in the last `reader_linger_s`: `StateReaders`), else every
    `idle_interval_s`. A snapshot costs ~1-2 ms to build and write (~3 ms on a cold wake-up beside a
    busy runtime); nobody reads most agents' files most of the time, so at 1 s this was a tenth of
    the agent's CPU at the reference load, and every 10 s still ~0.3 ms a second (30 s since). A file
    written while nobody read says so (its `publish_interval_s` is the idle one), so a reader that
    arrives then does not call it stale; from the reader's next refresh it is fresh again. Where
    the watch cannot be set up the publisher writes every interval, as it always did.

    Failures (in get_snapshot or in writing) are logged once and counted, never raised: the
    snapshot is a side channel and must not disturb the agent.
    """

    def __init__(
        self, publisher: StatePublisher, get_snapshot: Callable[[], Snapshot], *, interval_s: float = 0.25,
        idle_interval_s: float = 30.0, reader_linger_s: float = 30.0, watch_readers: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0 or idle_interval_s <= 0 or reader_linger_s <= 0:
            raise errors.UsageError("publish intervals must be > 0")
        self.publisher = publisher
        self.get_snapshot = get_snapshot
        self.interval_s = interval_s
        self.idle_interval_s = max(idle_interval_s, interval_s)
        self.reader_linger_s = reader_linger_s
        self.clock = clock
        self.readers: StateReaders | None = None
        self.watch_error: str | None = None
        if watch_readers:
            try:
                self.readers = StateReaders(publisher.state_dir, publisher.path.name, clock=clock)
            except (errors.SourceUnavailable, OSError, AttributeError) as exc:  # (AttributeError: no inotify in libc)
                self.watch_error = str(exc)
        self.idle_publishes = 0
        self._last_publish_s: float | None = None
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()  # stop() wakes a thread asleep on the readers' watch
        self._thread = threading.Thread(target=self._run, name="moescope-state", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def watched(self) -> bool:
        """Whether someone read the state file in the last ``reader_linger_s``, as this publisher's
        thread last saw the watch (no read of it here: any thread may ask); True where unwatched."""
        return self.readers is None or self.readers.seen_within(self.reader_linger_s)

    def due(self) -> float | None:
        """The publish interval to write now with (the file's `publish_interval_s`), or None when
        nothing is due: every interval while read (or unwatched), every idle interval otherwise."""
        if self.readers is None or self.readers.opened_within(self.reader_linger_s):
            return self.interval_s
        idle_due = self._idle_due_s()
        if idle_due is None or self.clock() >= idle_due:
            return self.idle_interval_s
        return None

    def _idle_due_s(self) -> float | None:
        """When the next publish is due while nobody reads (None: nothing published yet); half an
        interval early, so a period's timer landing just short of it does not wait a whole period."""
        last = self._last_publish_s
        return None if last is None else last + self.idle_interval_s - self.interval_s / 2

    def publish_once(self) -> bool:
        """One period: publish if due; True when it wrote."""
        interval = self.due()
        if interval is None:
            return False
        try:
            snapshot = self.get_snapshot()
            if snapshot.publish_interval_s != interval:  # readers judge staleness by it
                snapshot = dataclasses.replace(snapshot, publish_interval_s=interval)
            self.publisher.publish(snapshot)
            self._last_publish_s = self.clock()
            self.idle_publishes += interval != self.interval_s
            return True
        except Exception as exc:  # why: a failing side channel is counted, never fatal
            if self.publisher.failures == 0:
                log.warning("state snapshot not published: %s", exc)
            self.publisher.failures += 1
            return False

    def wait_s(self) -> float:
        """How long the thread may sleep now: an interval while the file is read (or unwatched),
        else until the idle publish is due (a reader's open wakes it earlier: ``_run``)."""
        readers, idle_due = self.readers, self._idle_due_s()
        if readers is None or idle_due is None or readers.opened_within(self.reader_linger_s):
            return self.interval_s
        return max(self.interval_s, idle_due - self.clock())

    def _run(self) -> None:
        name_thread("ms-state")
        readers = self.readers
        while not self._stop.is_set():
            self.publish_once()
            timeout_s = self.wait_s()
            if readers is None or timeout_s <= self.interval_s:
                self._stop.wait(timeout_s)
                continue
            # nobody reads: asleep until the idle publish, or until someone opens the file (the
            # inotify descriptor turns readable), or stop() (the wake pipe): one wake-up every ~30 s
            # instead of every interval (each costs ~0.3 ms of CPU on the VMs here)
            select.select([readers.fileno(), self._wake_r], [], [], timeout_s)

    def stop(self, *, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")  # (a pipe with room: never blocks)
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if not self._thread.is_alive() and self._wake_w >= 0:  # (else the thread may still select on them)
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1
        if self.readers is not None:
            self.readers.close()
        self.publisher.close()


@dataclass(frozen=True, slots=True)
class AgentFile:
    pid: int
    path: Path


def find_agents(state_dir: Path) -> list[AgentFile]:
    """Running agents' state files in `state_dir`, newest first; files of dead pids are ignored."""
    try:
        names = os.listdir(state_dir)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise errors.SourceUnavailable(f"cannot list state dir {state_dir}: {exc.strerror}") from None
    found: list[tuple[float, AgentFile]] = []
    for name in names:
        m = STATE_FILE_RE.match(name)
        if not m:
            continue
        pid = int(m.group(1))
        path = state_dir / name
        try:
            mtime = path.stat().st_mtime
        except OSError:
            continue
        if pid_exists(pid):
            found.append((mtime, AgentFile(pid=pid, path=path)))
    found.sort(key=lambda item: (-item[0], item[1].pid))
    return [agent for _, agent in found]


def read_snapshot(path: Path) -> Snapshot:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise errors.SourceUnavailable(f"{path}: agent state: not UTF-8 (byte {exc.start})") from None
    except FileNotFoundError:
        raise errors.SourceUnavailable(f"agent state file {path} not found (agent not running?)") from None
    except OSError as exc:
        raise errors.SourceUnavailable(f"cannot read agent state file {path}: {exc.strerror}") from None
    try:
        return from_json(text)
    except errors.SourceUnavailable as exc:
        raise errors.SourceUnavailable(f"{path}: {exc}") from None
