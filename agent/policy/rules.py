"""What a policy rule can watch and do, and the per-target state machine that decides when it acts.

Three tables are fixed in code and are the only things a config file can name: SIGNALS (what the
pipeline measures), COMPARISONS and ACTIONS (what the actuator knows how to do). A config picks
among them by name, so nothing in a config can run code.

The state machine (one `RuleInstance` per rule and target: per (layer, expert) for queue rules, per
layer for routing rules, one for global signals):

    armed ──fire condition──▶ pending ──held for the window──▶ firing ──clear condition──▶ clearing
      ▲                          │ (condition breaks: back to armed)      ▲                    │
      │                          ▼                                        └── breaks ──────────┤
      └──────── cooldown over ── cooling ◀── revert done (or the action failed) ◀─held for the clear window

A NaN value (no data) leaves everything as it is: no progress, no reset, never an action.
"""

from __future__ import annotations

import enum
import itertools
import math
import operator
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from moescope.agent.phase_table import PHASE_LABELS, PHASE_ROWS

NAN = math.nan
# Times are sums of float sample periods: compare them with this slack so 30 s is 150 x 0.2 s.
TIME_EPS_S = 1e-6

# A target names what one rule instance watches: () global, (layer,) or (layer, expert).
Target = tuple[int, ...]


class TargetKind(enum.Enum):
    GLOBAL = "global"
    LAYER = "layer"
    EXPERT = "expert"


@dataclass(frozen=True, slots=True)
class SignalSpec:
    name: str
    target: TargetKind
    unit: str
    help: str


# A latency rule selects one phase of the requests' breakdown with `signal = "request_phase_p99_ms"`
# and `phase = "..."` (agent/policy/config.py); it reads that phase's own signal below.
PHASE_SIGNAL = "request_phase_p99_ms"


def phase_signal_name(phase: str) -> str:
    """The signal a `phase` key selects: request_phase_<phase>_p99_ms."""
    return f"request_phase_{phase}_p99_ms"


SIGNALS: Mapping[str, SignalSpec] = {
    s.name: s
    for s in (
        SignalSpec("step_p99_ms", TargetKind.GLOBAL, "ms", "p99 of moe.step (expert compute) latency, sliding 10 s"),
        SignalSpec("device_memory_used_ratio", TargetKind.GLOBAL, "ratio", "device memory used / total (0..1)"),
        SignalSpec("expert_queue_tokens", TargetKind.EXPERT, "tokens", "tokens waiting for one (layer, expert)"),
        SignalSpec("expert_load_gini", TargetKind.LAYER, "gini", "expert-load Gini per layer, sliding 10 s"),
        SignalSpec(
            "router_entropy_ratio", TargetKind.LAYER, "ratio", "mean token router entropy / log2(E) per layer, 10 s"
        ),
        SignalSpec("expert_load_p99_ms", TargetKind.GLOBAL, "ms", "p99 of moe.expert.load latency, sliding 10 s"),
        SignalSpec("request_p99_ms", TargetKind.GLOBAL, "ms", "p99 request latency measured by the kernel, 10 s"),
        SignalSpec("listen_overflows_per_s", TargetKind.GLOBAL, "1/s",
                   "connections refused by a full accept queue in the targets' namespaces, 10 s"),
        SignalSpec("tcp_retransmits_per_s", TargetKind.GLOBAL, "1/s",
                   "TCP data segments retransmitted on the targets' listening ports, 10 s"),
        SignalSpec("tcp_resets_per_s", TargetKind.GLOBAL, "1/s",
                   "TCP resets sent and received on the targets' listening ports, 10 s"),
        *(
            SignalSpec(phase_signal_name(phase), TargetKind.GLOBAL, "ms",
                       f"p99 of the model requests' {PHASE_LABELS[phase]} time"
                       + (" (prefill + decode)" if phase == "inference" else "") + ", sliding 10 s")
            for phase in PHASE_ROWS
        ),
        SignalSpec("request_ttft_p99_ms", TargetKind.GLOBAL, "ms",
                   "p99 time to first token of the model requests, sliding 10 s"),
        SignalSpec("request_tpot_p99_ms", TargetKind.GLOBAL, "ms",
                   "p99 time per output token of the model requests, sliding 10 s"),
    )
}

COMPARISONS: Mapping[str, Callable[[float, float], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
}


def fires_upward(comparison: str) -> bool:
    """True when the rule fires on high values (so it clears below its clear threshold)."""
    return comparison in (">", ">=")


@dataclass(frozen=True, slots=True)
class ArgSpec:
    kind: type
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None


@dataclass(frozen=True, slots=True)
class ActionSpec:
    name: str
    # The signal target kind this action acts on; None: any (alerts).
    target: TargetKind | None
    args: Mapping[str, ArgSpec]
    sends_commands: bool
    help: str
    revert_help: str
    # False: clearing needs no command (alerts, prefetch): the instance just goes back to armed.
    revert_sends_commands: bool = True


ACTIONS: Mapping[str, ActionSpec] = {
    a.name: a
    for a in (
        ActionSpec(
            "alert", None, {}, False, "record an alert (no command)", "record that the alert cleared", False
        ),
        ActionSpec(
            "set_precision",
            TargetKind.GLOBAL,
            {
                "precision": ArgSpec(str, "fp16", "precision to switch to", choices=("fp16", "bf16", "fp32")),
                "revert_precision": ArgSpec(
                    str,
                    "fp32",
                    "precision to go back to when the agent took over a fallback it did not see start",
                    choices=("fp16", "bf16", "fp32"),
                ),
            },
            True,
            "set_precision to `precision` unless the runtime already runs it",
            "set_precision back to what the runtime ran before",
        ),
        ActionSpec(
            "offload_coldest",
            TargetKind.GLOBAL,
            {
                "target_ratio": ArgSpec(
                    float, 0.90, "offload until device memory used/total is below this", minimum=0.0, maximum=1.0
                ),
                "max_experts": ArgSpec(int, 64, "offload at most this many experts per firing", minimum=1),
            },
            True,
            "offload the coldest resident experts (host fp16 copy) until memory is below target_ratio",
            "restore the experts this rule offloaded",
        ),
        ActionSpec(
            "router_penalty",
            TargetKind.EXPERT,
            {"penalty": ArgSpec(float, -0.3, "logit penalty added to the expert's router score", maximum=0.0)},
            True,
            "set a router logit penalty on the expert so the next-best expert takes the overflow",
            "remove the penalty",
        ),
        ActionSpec(
            "migrate_hottest",
            TargetKind.LAYER,
            {},
            True,
            "move the layer's hottest expert to the least-loaded device (protocol v1 has no replicate)",
            "move it back to where it was",
        ),
        ActionSpec(
            "prefetch_hottest",
            TargetKind.GLOBAL,
            {"experts": ArgSpec(int, 4, "prefetch this many of the hottest non-resident experts", minimum=1)},
            True,
            "prewarm: make the hottest non-resident experts resident",
            "nothing to undo (prefetched experts stay until the runtime evicts them)",
            False,
        ),
    )
}


@dataclass(frozen=True, slots=True)
class RuleSpec:
    """One validated rule. Windows are counted in evaluations (duration / sample period, rounded)."""

    name: str
    enabled: bool
    signal: str
    comparison: str
    fire: float
    window_evals: int
    window_text: str
    clear: float
    clear_window_evals: int
    clear_window_text: str
    cooldown_s: float
    action: str
    args: Mapping[str, Any]
    revert: bool
    description: str = ""
    # the comparisons, resolved once: RuleInstance.step runs for every target of a busy per-expert
    # rule every period, on a thread that runs cold (two calls a step were a third of its cost)
    _fires: Callable[[float, float], bool] = field(init=False, repr=False, compare=False)
    _clears_below: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_fires", COMPARISONS[self.comparison])
        object.__setattr__(self, "_clears_below", fires_upward(self.comparison))

    @property
    def target_kind(self) -> TargetKind:
        return SIGNALS[self.signal].target

    def fire_condition(self, value: float) -> bool:
        return self._fires(value, self.fire)

    def clear_condition(self, value: float) -> bool:
        # Strictly past the clear threshold, on the other side from firing.
        return value < self.clear if self._clears_below else value > self.clear


_FLOAT = frozenset((float,))
_TUPLE = frozenset((tuple,))
_INT = frozenset((int,))
_PAIR = frozenset((2,))


# The per-expert mappings their maker vouched for (vouch_expert_values), by identity: the newest few.
_VOUCHED: list[dict[tuple[int, int], float]] = []
VOUCHED_HELD = 2  # the period's mapping and the one before (a wake makes one and evaluates it at once)


def vouch_expert_values(values: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """``values`` itself, taken by Signals.targets as it is, without the type check of every key and
    value (``_expert_targets``): for a maker that builds the mapping from checked ints and floats and
    never changes it after (the runtime's queue signal, agent/policy/stats_source.py). The check is
    four passes over the mapping, ~1.8 ms at 58 x 256 experts on this VM, five times a second, where a
    busy runtime's queue signal holds most experts (the sticky ones at 0.0)."""
    vouched = _VOUCHED
    vouched.append(values)
    if len(vouched) > VOUCHED_HELD:
        del vouched[0]
    return values


def _vouched(values: object) -> bool:
    for held in _VOUCHED:
        if held is values:
            return True
    return False


def _expert_targets(values: dict[Any, Any]) -> bool:
    """Whether a per-expert mapping is already {(int, int): float}: one C-level pass per check (no
    bool, numpy scalar or other number slips through: each is converted by Signals.targets)."""
    return (set(map(type, values.values())) <= _FLOAT and set(map(type, values)) <= _TUPLE
            and set(map(len, values)) <= _PAIR and set(map(type, itertools.chain.from_iterable(values))) <= _INT)


@dataclass(frozen=True, slots=True)
class Signals:
    """One snapshot of the pipeline's windows, taken every sample period. NaN or a missing key: no data."""

    t_s: float  # monotonic seconds of the snapshot
    step_p99_ms: float = NAN
    device_memory_used_ratio: float = NAN
    expert_load_p99_ms: float = NAN
    request_p99_ms: float = NAN
    listen_overflows_per_s: float = NAN
    tcp_retransmits_per_s: float = NAN
    tcp_resets_per_s: float = NAN
    # the model requests' breakdown (agent/request_phases.py), one field per phase row
    request_phase_receive_p99_ms: float = NAN
    request_phase_queue_p99_ms: float = NAN
    request_phase_prefill_p99_ms: float = NAN
    request_phase_decode_p99_ms: float = NAN
    request_phase_write_p99_ms: float = NAN
    request_phase_inference_p99_ms: float = NAN
    request_phase_expert_load_p99_ms: float = NAN
    request_phase_routing_p99_ms: float = NAN
    request_ttft_p99_ms: float = NAN
    request_tpot_p99_ms: float = NAN
    expert_queue_tokens: Mapping[tuple[int, int], float] = field(default_factory=dict)
    expert_load_gini: Mapping[int, float] = field(default_factory=dict)
    router_entropy_ratio: Mapping[int, float] = field(default_factory=dict)

    def targets(self, signal: str) -> Mapping[Target, float]:
        """Every target this snapshot has a value for, as {target: value} (read only: a per-expert
        mapping already in that form, a dict of (int, int) keys and float values as the agent's
        sources make them, is returned itself rather than copied; at 58 x 256 experts a copy with
        its conversions was ~4 ms a period)."""
        value = getattr(self, signal)
        kind = SIGNALS[signal].target
        if kind is TargetKind.GLOBAL:
            return {(): float(value)}
        if kind is TargetKind.LAYER:
            return {(int(layer),): float(v) for layer, v in value.items()}
        if type(value) is dict and (_vouched(value) or _expert_targets(value)):
            return value
        return {(int(layer), int(expert)): float(v) for (layer, expert), v in value.items()}


# Signals' fields in order with their defaults (None: a fresh dict, the mapping fields' default_factory)
_SIGNAL_DEFAULTS: tuple[tuple[str, object], ...] = tuple(
    (f.name, None if f.default is MISSING else f.default) for f in fields(Signals) if f.name != "t_s")
_SIGNAL_NAMES = frozenset(name for name, _ in _SIGNAL_DEFAULTS)
_SET_FIELD = object.__setattr__


def make_signals(t_s: float, values: Mapping[str, object]) -> Signals:
    """``Signals(t_s=t_s, **values)``, made without the dataclass's generated ``__init__`` (run by
    the interpreter with keyword arguments and a setattr call per field: ~20 µs of each policy wake
    beside a busy runtime, two snapshots a wake). An unknown name is a TypeError, as there."""
    if not _SIGNAL_NAMES.issuperset(values):
        unknown = sorted(set(values) - _SIGNAL_NAMES)
        raise TypeError(f"Signals has no field {unknown[0]!r}")
    made: Signals = Signals.__new__(Signals)
    _SET_FIELD(made, "t_s", t_s)
    for name, default in _SIGNAL_DEFAULTS:
        value = values.get(name, default)
        _SET_FIELD(made, name, {} if value is None else value)
    return made


class State(enum.Enum):
    ARMED = "armed"
    PENDING = "pending"
    FIRING = "firing"
    CLEARING = "clearing"
    COOLING = "cooling"


class Intent(enum.Enum):
    FIRE = "fire"
    REVERT = "revert"


@dataclass(slots=True)
class InstanceView:
    """What the TUI shows for one rule instance."""

    rule: str
    target: Target
    state: str
    progress: float  # 0..1 toward the fire window (armed/pending) or the clear window (firing/clearing)
    last_value: float
    fire: float
    clear: float
    applied: bool
    in_flight: bool
    fired_total: int
    cooldown_left_s: float


class RuleInstance:
    """One rule watching one target. Pure logic: step() returns what to do; the engine does it."""

    def __init__(self, spec: RuleSpec, target: Target) -> None:
        self.spec = spec
        self.target = target
        self.state = State.ARMED
        self.count = 0
        self.clear_count = 0
        self.last_value = NAN
        self.last_t_s = NAN
        self.window_values: deque[float] = deque(maxlen=max(spec.window_evals, spec.clear_window_evals, 1))
        self.applied = False  # the action is in effect on the runtime (or in the dry-run's model)
        self.in_flight = False
        self.cooldown_until_s = -math.inf
        self.fired_total = 0
        self.suppressed_streak = 0  # consecutive suppressed attempts: only the first is audited
        # What a revert needs to undo the action: previous precision, offloaded experts, ...
        self.context: dict[str, Any] = {}
        self.claims: frozenset[str] | None = None  # what its action claims (the engine's, made once)

    def step(self, value: float, t_s: float) -> Intent | None:
        if value != value:  # NaN
            return None
        self.last_value = value
        self.last_t_s = t_s
        spec = self.spec
        state = self.state
        if state is not State.FIRING and state is not State.CLEARING:  # armed, pending, cooling
            if spec._fires(value, spec.fire):
                self.count += 1
                self.window_values.append(value)
            else:
                self.count = 0
                self.window_values.clear()
                self.suppressed_streak = 0
            if t_s + TIME_EPS_S < self.cooldown_until_s:
                self.state = State.COOLING
                return None
            if self.count >= self.spec.window_evals and not self.in_flight:
                self.state = State.PENDING
                return Intent.FIRE
            self.state = State.PENDING if self.count else State.ARMED
            return None
        # firing / clearing: clears strictly past the clear threshold, on the other side from firing
        if value < spec.clear if spec._clears_below else value > spec.clear:
            self.clear_count += 1
            self.window_values.append(value)
        else:
            self.clear_count = 0
            self.window_values.clear()
            self.suppressed_streak = 0
        self.state = State.CLEARING if self.clear_count else State.FIRING
        if (
            self.clear_count >= self.spec.clear_window_evals
            and t_s + TIME_EPS_S >= self.cooldown_until_s
            and not self.in_flight
        ):
            return Intent.REVERT
        return None

    def mark_fired(self, t_s: float) -> None:
        """The fire was dispatched (or recorded): now firing, cooldown starts."""
        self.state = State.FIRING
        self.fired_total += 1
        self.count = 0
        self.clear_count = 0
        self.window_values.clear()
        self.suppressed_streak = 0
        self.cooldown_until_s = t_s + self.spec.cooldown_s

    def mark_reverted(self, t_s: float) -> None:
        self.state = State.COOLING if self.spec.cooldown_s > 0 else State.ARMED
        self.applied = False
        self.count = 0
        self.clear_count = 0
        self.window_values.clear()
        self.suppressed_streak = 0
        self.context = {}
        self.cooldown_until_s = t_s + self.spec.cooldown_s

    def mark_fire_failed(self, t_s: float) -> None:
        """The fire did not take effect: re-arm only after the cooldown (no retry storm)."""
        self.state = State.COOLING
        self.applied = False
        self.count = 0
        self.clear_count = 0
        self.window_values.clear()
        self.context = {}
        self.cooldown_until_s = t_s + self.spec.cooldown_s

    def mark_revert_failed(self, t_s: float) -> None:
        """The revert did not take effect: stay firing, try again after the cooldown if still clear."""
        self.state = State.FIRING
        self.clear_count = 0
        self.window_values.clear()
        self.cooldown_until_s = t_s + self.spec.cooldown_s

    def adopt(self, context: Mapping[str, Any]) -> None:
        """The runtime already shows this action in effect (an earlier agent applied it): take it over.
        No cooldown: the clear window alone decides when to revert."""
        self.state = State.FIRING
        self.applied = True
        self.context = dict(context)

    def view(self, now_s: float) -> InstanceView:
        if self.state in (State.FIRING, State.CLEARING):
            progress = self.clear_count / self.spec.clear_window_evals
        else:
            progress = self.count / self.spec.window_evals
        return InstanceView(
            rule=self.spec.name,
            target=self.target,
            state=self.state.value,
            progress=min(1.0, progress),
            last_value=self.last_value,
            fire=self.spec.fire,
            clear=self.spec.clear,
            applied=self.applied,
            in_flight=self.in_flight,
            fired_total=self.fired_total,
            cooldown_left_s=max(0.0, self.cooldown_until_s - now_s),
        )
