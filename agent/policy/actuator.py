"""Control-socket client (docs/control-protocol.md, moescope-control/1) and the policy actions built on it.

Every action first reads `stats` so it never applies twice (already fp16, already penalised, already
offloaded), then sends its commands on one connection, each with a deadline. Everything here is
blocking and runs on the engine's worker threads, never on the evaluation thread.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moescope.agent.policy.audit import CommandResult
from moescope.agent.policy.rules import Intent, RuleSpec, Target
from moescope.errors import ControlError
from moescope.stats_page import PageSnapshot

if TYPE_CHECKING:
    from moescope.agent.policy.config import PolicyConfig

PROTOCOL = "moescope-control/1"
MAX_REPLY_BYTES = 64 * 1024 * 1024  # a stats reply grows with layers x experts
DTYPE_BYTES_FACTOR = {"fp32": 1.0, "bf16": 0.5, "fp16": 0.5}

Expert = tuple[int, int]


class CommandFailed(ControlError):
    """One command did not succeed; `outcome` is refused | unsupported | unreachable | timeout | protocol-error."""

    def __init__(self, message: str, *, outcome: str) -> None:
        super().__init__(message)
        self.outcome = outcome


def default_socket_paths(pid: int) -> list[Path]:
    """Where a runtime started without --control-socket listens, in the protocol's order."""
    paths = [Path(f"/run/moescope/runtime-{pid}.sock")]
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        paths.append(Path(xdg) / f"moescope-runtime-{pid}.sock")
    paths.append(Path(f"/tmp/moescope-runtime-{pid}.sock"))
    return paths


def find_control_socket(pid: int) -> Path:
    for path in default_socket_paths(pid):
        if path.is_socket():
            return path
    tried = ", ".join(str(p) for p in default_socket_paths(pid))
    raise ControlError(f"no control socket for pid {pid} (tried {tried}); pass --control-socket PATH")


# One recv's buffer: a stats reply is ~6 KB at the reference shape. recv(1 MiB) made the
# interpreter map and unmap a fresh 1 MiB buffer on every call (~200 us of a 320 us stats call).
RECV_BYTES = 1 << 16


# While a late answer is awaited, how often the wait looks at its cancel event (the agent closing).
LATE_POLL_S = 0.25


class ControlConnection:
    """One connection; every call is recorded in `results`, failed or not. Connects on first call.

    ``late_s``: a command that has no answer within ``timeout_s`` was sent and may still be carried
    out (a runtime converting 14,848 experts to fp16 under load takes seconds): its answer is awaited
    up to ``late_s`` longer (until ``cancel`` is set) and, when it comes, taken as the answer, the
    command counted in ``late``. 0: a timeout is final (the policy's signal reads)."""

    def __init__(self, path: Path | str, *, timeout_s: float, on_send: Callable[[], None] | None = None,
                 late_s: float = 0.0, cancel: threading.Event | None = None) -> None:
        self.path = str(path)
        self.timeout_s = timeout_s
        self.late_s = late_s
        self._cancel = cancel
        self.late = 0  # commands answered past timeout_s
        self.results: list[CommandResult] = []
        self._on_send = on_send
        self._sock: socket.socket | None = None
        self._poller: select.poll | None = None  # peer_gone's, registered on _sock (close() drops both)
        self._buf = b""
        self._next_id = 1
        self._broken: CommandFailed | None = None

    def __enter__(self) -> ControlConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._poller = None

    def peer_gone(self) -> bool:
        """Whether the runtime closed this connection (it exited, or let us go), seen without a call:
        a zero-wait poll. Not connected counts as gone."""
        sock = self._sock
        if sock is None:
            return True
        poller = self._poller
        if poller is None:  # (one poll object a connection: the policy asks 5 times a second)
            poller = self._poller = select.poll()
            poller.register(sock, select.POLLIN | select.POLLRDHUP)
        return bool(poller.poll(0))  # readable between calls: end of stream (or stray bytes: not ours)

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.path)
        except TimeoutError:
            sock.close()
            raise CommandFailed(f"connect to {self.path} timed out", outcome="timeout") from None
        except OSError as exc:
            sock.close()
            raise CommandFailed(
                f"runtime unreachable at {self.path}: {exc.strerror or exc}", outcome="unreachable"
            ) from None
        return sock

    def _read_line(self, deadline: float) -> bytes:
        assert self._sock is not None
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self._sock.settimeout(left)
            chunk = self._sock.recv(RECV_BYTES)
            if not chunk:
                raise ConnectionResetError("runtime closed the connection")
            self._buf += chunk
            if len(self._buf) > MAX_REPLY_BYTES:
                raise CommandFailed(f"reply longer than {MAX_REPLY_BYTES} bytes", outcome="protocol-error")
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _late_line(self, deadline: float) -> bytes:
        """The answer of a command past its deadline, awaited up to late_s more; TimeoutError when
        it does not come (or the wait is cancelled)."""
        late_deadline = deadline + self.late_s
        while self.late_s > 0 and not (self._cancel is not None and self._cancel.is_set()):
            now = time.monotonic()
            if now >= late_deadline:
                break
            try:
                line = self._read_line(min(late_deadline, now + LATE_POLL_S))
            except TimeoutError:
                continue
            self.late += 1
            return line
        raise TimeoutError

    def call(self, cmd: str, args: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Send one command and return its `result`; raises CommandFailed (and records it) otherwise."""
        request: dict[str, Any] = {"id": self._next_id, "cmd": cmd}
        if args:
            request["args"] = dict(args)
        self._next_id += 1
        started = time.monotonic()
        record = CommandResult(request=request, answer=None, latency_ms=0.0)
        self.results.append(record)
        try:
            if self._broken is not None:
                raise CommandFailed(f"not sent: {self._broken}", outcome=self._broken.outcome)
            if self._sock is None:
                self._sock = self._connect()
            deadline = started + self.timeout_s
            if self._on_send is not None:
                self._on_send()
            self._sock.sendall(json.dumps(request, separators=(",", ":")).encode() + b"\n")
            try:
                line = self._read_line(deadline)
            except TimeoutError:
                line = self._late_line(deadline)
            record.latency_ms = (time.monotonic() - started) * 1000.0
            try:
                answer = json.loads(line)
            except ValueError:
                raise CommandFailed(f"{cmd}: reply is not JSON: {line[:80]!r}", outcome="protocol-error") from None
            if not isinstance(answer, dict) or "ok" not in answer:
                raise CommandFailed(f"{cmd}: reply is not a protocol object: {line[:80]!r}", outcome="protocol-error")
            record.answer = answer
            if answer.get("ok") is not True:
                error = str(answer.get("error", "no error text"))
                # "unsupported: ..." (docs/control-protocol.md): the runtime cannot do this at all
                outcome = "unsupported" if error.startswith("unsupported") else "refused"
                raise CommandFailed(f"{cmd} {outcome}: {error}", outcome=outcome)
            result = answer.get("result")
            if not isinstance(result, dict):
                raise CommandFailed(f"{cmd}: reply has no result object", outcome="protocol-error")
            return result
        except CommandFailed as exc:
            record.latency_ms = (time.monotonic() - started) * 1000.0
            record.error = str(exc)
            if exc.outcome not in ("refused", "unsupported"):  # a refusal leaves the connection usable
                self._broken = exc
                self.close()
            raise
        except TimeoutError:
            record.latency_ms = (time.monotonic() - started) * 1000.0
            waited = f" (nor {self.late_s * 1000:.0f} ms later)" if self.late_s > 0 else ""
            exc2 = CommandFailed(f"{cmd}: no answer within {self.timeout_s * 1000:.0f} ms{waited}", outcome="timeout")
            record.error = str(exc2)
            self._broken = exc2
            self.close()
            raise exc2 from None
        except OSError as exc:
            record.latency_ms = (time.monotonic() - started) * 1000.0
            exc3 = CommandFailed(f"{cmd}: runtime unreachable: {exc.strerror or exc}", outcome="unreachable")
            record.error = str(exc3)
            self._broken = exc3
            self.close()
            raise exc3 from None


# The per-layer `stats` fields that say where each expert is and at which precision: they change
# only when placement does, which `placement_version` tells (docs/control-protocol.md).
PLACEMENT_FIELDS = ("device", "tier", "dtype", "precision", "offloaded")
_PER_EXPERT = ("tokens", "last_step_tokens", "queue_depth", "queue_peak", "penalty", "device", "tier", "dtype",
               "precision")
# Per-layer fields a narrowed reply may send instead: the non-zero entries as [expert, value] pairs
# (an expert left out is 0)
_SPARSE = {"queue_depth_sparse": "queue_depth", "queue_peak_sparse": "queue_peak", "penalty_sparse": "penalty"}


@functools.lru_cache(maxsize=4096)
def _expert_keys(layer: int, count: int) -> tuple[Expert, ...]:
    """The (layer, expert) keys of one layer's per-expert list: the same tuples every poll."""
    return tuple((layer, expert) for expert in range(count))


@dataclass(slots=True)
class RuntimeState:
    """The part of `stats` the policy reads: precision, residency, penalties, memory, token counts."""

    precision_default: str
    devices: list[str]
    primary_device: str
    layers: int
    experts: int
    tokens: dict[Expert, int]
    last_step_tokens: dict[Expert, int]
    queue_depth: dict[Expert, int]
    entropy_bits: dict[int, float]  # per layer, the most recent step's mean token router entropy
    penalty: dict[Expert, float]
    device: dict[Expert, str]
    tier: dict[Expert, str]
    dtype: dict[Expert, str]
    precision: dict[Expert, str]
    memory: dict[str, dict[str, float]]
    expert_bytes_fp32: int
    offloaded: dict[Expert, bool] | None = None  # optional per-layer "offloaded" list in stats
    model: str | None = None  # optional stats "model" (or config "model"): gen_ai.request.model
    # the runtime's placement_version these placement fields are from (None: it reports none, or
    # they are not held: the next narrowed poll asks for them)
    placement_version: int | None = None
    # the deepest queue_depth of the last 200-400 ms (a runtime's optional `queue_peak`: a prefill's
    # queue lasts one step, which a 200 ms poll of queue_depth sees by chance); empty: not reported
    queue_peak: dict[Expert, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_stats(cls, result: Mapping[str, Any], *, previous: RuntimeState | None = None) -> RuntimeState:
        """A state from a `stats` result. A narrowed reply (`fields`) leaves per-layer fields out:
        the placement fields are then taken from `previous` when it holds them for the same shape
        (the runtime sends them again whenever they change), the others are empty; a sparse field
        (`queue_depth_sparse`, `penalty_sparse`) fills its dense one with the experts that are not 0."""
        try:
            if result.get("protocol") != PROTOCOL:
                got = result.get("protocol")
                raise CommandFailed(f"stats: protocol {got!r}, want {PROTOCOL}", outcome="protocol-error")
            config = result["config"]
            layers, experts = int(config["layers"]), int(config["experts"])
            per: dict[str, dict[Expert, Any]] = {k: {} for k in _PER_EXPERT}
            sent: set[str] = set()
            entropy_bits: dict[int, float] = {}
            offloaded: dict[Expert, bool] | None = {}
            rows = result["layers"]
            for layer in rows:
                index = int(layer["layer"])
                if "entropy_bits" in layer:
                    entropy_bits[index] = float(layer["entropy_bits"])
                for key, table in per.items():
                    values = layer.get(key)
                    if values is None:
                        continue
                    sent.add(key)
                    # one C-level pass each: this runs every policy period, L x E values a field
                    keys = _expert_keys(index, len(values))
                    table.update(zip(keys, map(float, values) if key == "penalty" else values))
                for key, dense in _SPARSE.items():  # [expert, value] pairs: the entries that are not 0
                    pairs = layer.get(key)
                    if pairs is None:
                        continue
                    sent.add(dense)
                    ids = [pair[0] for pair in pairs]
                    if ids and (not all(type(e) is int for e in ids) or min(ids) < 0 or max(ids) >= experts):
                        raise ValueError(f"layer {index} {key}: an expert id not in 0..{experts - 1}")
                    values = map(float if dense == "penalty" else int, [pair[1] for pair in pairs])
                    per[dense].update(zip(zip(itertools.repeat(index), ids), values))
                flags = layer.get("offloaded")
                if flags is None:
                    offloaded = None  # optional: only when every layer reports it
                elif offloaded is not None:
                    offloaded.update(((index, e), bool(v)) for e, v in enumerate(flags))
            if not rows:
                offloaded = None
            version = result.get("placement_version")
            version = version if isinstance(version, int) and not isinstance(version, bool) else None
            if sent.isdisjoint(PLACEMENT_FIELDS):
                if (previous is not None and previous.placement_version is not None
                        and previous.layers == layers and previous.experts == experts):
                    for key in ("device", "tier", "dtype", "precision"):
                        per[key] = getattr(previous, key)  # never mutated: shared with the held state
                    offloaded = previous.offloaded
                else:
                    version = None  # none held: not up to date with any version
            return cls(
                precision_default=str(result["precision"]["default"]),
                devices=[str(d) for d in config["devices"]],
                primary_device=str(config["primary_device"]),
                layers=layers,
                experts=experts,
                tokens=per["tokens"],
                last_step_tokens=per["last_step_tokens"],
                queue_depth=per["queue_depth"],
                queue_peak=per["queue_peak"],
                entropy_bits=entropy_bits,
                penalty=per["penalty"],
                device=per["device"],
                tier=per["tier"],
                dtype=per["dtype"],
                precision=per["precision"],
                memory={str(d): dict(v) for d, v in result["memory"]["devices"].items()},
                expert_bytes_fp32=int(result["memory"]["expert_bytes_fp32"]),
                offloaded=offloaded,
                model=_model_name(result.get("model", config.get("model"))),
                placement_version=version,
            )
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise CommandFailed(f"stats reply missing or malformed field: {exc}", outcome="protocol-error") from None

    def with_page(self, page: PageSnapshot, *, routing: bool, queue_floor: float = 0.0) -> RuntimeState:
        """This state with a stats page's queues and penalties (tokens and entropy too with
        ``routing``): what a narrowed `stats` call would have returned while the page's version
        stands still. Queues and penalties as narrowed replies carry them: the entries not 0, and
        of the queues only those at or past ``queue_floor`` (selected in numpy: under load at
        58 x 256 nearly every expert has a peak)."""
        experts = self.experts
        floor = max(queue_floor, 1e-9)
        queue = page.queue_depth.ravel()
        busy = np.flatnonzero(queue >= floor).tolist()
        peak = page.queue_peak.ravel()
        peaked = np.flatnonzero(peak >= floor).tolist()
        penalty = page.penalty.ravel()
        penalised = penalty.nonzero()[0].tolist()
        tokens: dict[Expert, int] = {}
        entropy: dict[int, float] = {}
        if routing:
            assert len(page.tokens) == self.layers, "a page read without routing"
            keys = itertools.chain.from_iterable(_expert_keys(layer, experts) for layer in range(self.layers))
            tokens = dict(zip(keys, page.tokens.ravel().tolist()))
            entropy = dict(enumerate(page.entropy_bits.tolist()))
        return dataclasses.replace(
            self,
            queue_depth={divmod(i, experts): v for i, v in zip(busy, queue[busy].tolist())},
            queue_peak={divmod(i, experts): v for i, v in zip(peaked, peak[peaked].tolist())},
            penalty={divmod(i, experts): v for i, v in zip(penalised, penalty[penalised].tolist())},
            tokens=tokens,
            entropy_bits=entropy,
            last_step_tokens={},
        )

    def same_view(self, other: RuntimeState) -> bool:
        """Whether what the agent's spans and live view show from a state (precision and residency
        per expert, the device pools, the model) is the same in both: by placement_version where
        both carry one, else by every field."""
        if self.placement_version is None or other.placement_version is None:
            return self == other
        return (self.placement_version == other.placement_version
                and self.precision_default == other.precision_default and self.memory == other.memory
                and self.model == other.model and self.layers == other.layers and self.experts == other.experts
                and self.devices == other.devices and self.primary_device == other.primary_device)

    def offloaded_by_policy(self) -> list[Expert]:
        """Experts put on host by offload_expert: the runtime's per-expert `offloaded` flag when it
        reports one, else host experts held as a reduced-precision copy (a plain host placement
        keeps the configured precision; after set_precision the two look alike, hence the state file)."""
        if self.offloaded is not None:
            return sorted(e for e, flag in self.offloaded.items() if flag)
        return sorted(e for e, tier in self.tier.items() if tier == "host" and self.dtype[e] != self.precision[e])


def _model_name(value: object) -> str | None:
    """The runtime's model name when it reports a non-empty string, else None (not an error: optional)."""
    return value if isinstance(value, str) and value else None


@dataclass(slots=True)
class ActionOutcome:
    outcome: str
    plan: str
    commands: list[CommandResult] = field(default_factory=list)
    # fire: the action is (at least partly) in effect; revert: it is fully undone.
    done: bool = False
    context: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    ack_mono_s: float = math.nan  # monotonic time of the last answer


def describe_plan(intent: Intent, spec: RuleSpec, target: Target) -> str:
    """What the action will do, in words: the whole record in a dry run."""
    a = spec.args
    where = ""
    if len(target) == 1:
        where = f" layer {target[0]}"
    elif len(target) == 2:
        where = f" layer {target[0]} expert {target[1]}"
    fire = intent is Intent.FIRE
    match spec.action:
        case "alert":
            return "alert" if fire else "alert cleared"
        case "set_precision":
            return f"set_precision {a['precision']}" if fire else "set_precision back to the previous precision"
        case "offload_coldest":
            return (
                f"offload_expert the coldest resident experts until used_ratio < {a['target_ratio']:g}"
                if fire
                else "restore_expert each expert this rule offloaded"
            )
        case "router_penalty":
            return f"set_router_penalty{where} {abs(a['penalty']):g}" if fire else f"set_router_penalty{where} 0"
        case "migrate_hottest":
            if fire:
                return f"migrate_expert the hottest expert of{where} to the least-loaded device"
            return "migrate_expert back"
        case "prefetch_hottest":
            return f"prefetch {a['experts']} hottest host-tier experts" if fire else "nothing to undo"
    return spec.action


class Actuator:
    """Runs policy actions against one runtime. Thread-safe; each action uses its own connection.

    A command past ``timeout_s`` has its answer awaited ``late_s`` longer (ControlConnection): the
    action's outcome is then ``late`` and its effect known, so the engine's state follows what the
    runtime did. Reading "timeout" as "nothing happened" left a rule firing over a runtime that had
    reverted (a user trial: set_precision at 58 x 256 answered in 1.8 s against a 1 s timeout)."""

    def __init__(self, socket_path: Path | str, *, timeout_s: float, late_s: float = 0.0) -> None:
        self.socket_path = Path(socket_path)
        self.timeout_s = timeout_s
        self.late_s = late_s
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._last_tokens: dict[Expert, int] = {}
        self.commands_sent = 0

    @classmethod
    def for_config(cls, socket_path: Path | str, config: PolicyConfig) -> Actuator:
        """The policy file's [engine] command_timeout_ms and late_answer_ms."""
        return cls(socket_path, timeout_s=config.command_timeout_ms / 1000.0, late_s=config.late_answer_ms / 1000.0)

    def cancel_late_waits(self) -> None:
        """Stop awaiting late answers (the agent is closing): those commands end as timeouts."""
        self._cancel.set()

    def _count_send(self) -> None:
        with self._lock:
            self.commands_sent += 1

    def connect(self) -> ControlConnection:
        return ControlConnection(self.socket_path, timeout_s=self.timeout_s, on_send=self._count_send,
                                 late_s=self.late_s, cancel=self._cancel)

    def _stats(self, conn: ControlConnection) -> tuple[RuntimeState, dict[Expert, int]]:
        """Read stats; also return tokens routed per expert since the previous read (recent heat)."""
        state = RuntimeState.from_stats(conn.call("stats"))
        with self._lock:
            previous = self._last_tokens
            self._last_tokens = dict(state.tokens)
        recent = {e: max(0, int(n) - int(previous.get(e, n))) for e, n in state.tokens.items()}
        return state, recent

    def read_state(self) -> RuntimeState:
        with self.connect() as conn:
            return self._stats(conn)[0]

    def run(self, intent: Intent, spec: RuleSpec, target: Target, context: Mapping[str, Any]) -> ActionOutcome:
        """Do one action (blocking, bounded by the timeout per command). Never raises."""
        plan = describe_plan(intent, spec, target)
        with self.connect() as conn:
            try:
                state, recent = self._stats(conn)
                handler = _HANDLERS[(spec.action, intent)]
                out = handler(conn, state, recent, spec, target, dict(context))
                out.plan = out.plan or plan
            except _PartialFailure as exc:
                out = ActionOutcome(outcome=exc.outcome, plan=plan, error=str(exc), context=exc.partial_context)
                # A fire that offloaded some experts before failing is in effect: they must be restored later.
                out.done = intent is Intent.FIRE and bool(exc.partial_context.get("offloaded"))
            except CommandFailed as exc:
                out = ActionOutcome(outcome=exc.outcome, plan=plan, error=str(exc), context=dict(context))
            if conn.late and out.outcome == "ok":
                out.outcome = "late"  # done as the answers say, but past command_timeout_ms
            out.ack_mono_s = time.monotonic()
            out.commands = [_summarise_stats(c) for c in conn.results]
            return out


def _summarise_stats(result: CommandResult) -> CommandResult:
    """A stats reply grows with layers x experts: the audit keeps what the decision used, not all of it."""
    answer = result.answer
    if result.request.get("cmd") != "stats" or not answer or not isinstance(answer.get("result"), dict):
        return result
    body = answer["result"]
    config = body.get("config", {})
    summary = {
        "omitted": f"stats of {config.get('layers')} layers x {config.get('experts')} experts",
        "precision": body.get("precision"),
        "memory": body.get("memory", {}).get("devices"),
    }
    return CommandResult(
        request=result.request, answer={**answer, "result": summary}, latency_ms=result.latency_ms, error=result.error
    )


Handler = Callable[
    [ControlConnection, RuntimeState, Mapping[Expert, int], RuleSpec, Target, dict[str, Any]], ActionOutcome
]


def _fire_set_precision(
    conn: ControlConnection, state: RuntimeState, recent: Mapping[Expert, int], spec: RuleSpec, target: Target,
    ctx: dict[str, Any],
) -> ActionOutcome:
    want = spec.args["precision"]
    if state.precision_default == want:
        # Take it over (an earlier agent applied it): revert goes to revert_precision.
        return ActionOutcome("already-applied", "", done=True, context={"previous": spec.args["revert_precision"]})
    conn.call("set_precision", {"precision": want})
    return ActionOutcome("ok", "", done=True, context={"previous": state.precision_default})


def _revert_set_precision(
    conn: ControlConnection, state: RuntimeState, recent: Mapping[Expert, int], spec: RuleSpec, target: Target,
    ctx: dict[str, Any],
) -> ActionOutcome:
    previous = str(ctx.get("previous", spec.args["revert_precision"]))
    if state.precision_default == previous:
        return ActionOutcome("already-applied", f"set_precision {previous}", done=True)
    conn.call("set_precision", {"precision": previous})
    return ActionOutcome("ok", f"set_precision {previous}", done=True)


class _PartialFailure(CommandFailed):
    def __init__(self, failure: CommandFailed, partial_context: dict[str, Any]) -> None:
        super().__init__(str(failure), outcome=failure.outcome)
        self.partial_context = partial_context


def _fire_offload_coldest(
    conn: ControlConnection, state: RuntimeState, recent: Mapping[Expert, int], spec: RuleSpec, target: Target,
    ctx: dict[str, Any],
) -> ActionOutcome:
    target_ratio = float(spec.args["target_ratio"])
    budget_left = int(spec.args["max_experts"])
    offloaded: list[list[Any]] = [list(x) for x in ctx.get("offloaded", [])]
    for device, mem in sorted(state.memory.items()):
        need_bytes = float(mem["used_bytes"]) - target_ratio * float(mem["budget_bytes"])
        if need_bytes <= 0:
            continue
        resident = [e for e, d in state.device.items() if d == device and state.tier[e] == "device"]
        # Coldest first: fewest tokens since the last stats read, then in the last step, then ever.
        resident.sort(key=lambda e: (recent.get(e, 0), state.last_step_tokens[e], state.tokens[e], e))
        for layer, expert in resident:
            if need_bytes <= 0 or budget_left <= 0:
                break
            try:
                conn.call("offload_expert", {"layer": layer, "expert": expert})
            except CommandFailed as exc:
                raise _PartialFailure(exc, {"offloaded": offloaded}) from None
            offloaded.append([layer, expert, device])
            need_bytes -= state.expert_bytes_fp32 * DTYPE_BYTES_FACTOR.get(state.dtype[(layer, expert)], 1.0)
            budget_left -= 1
    if not offloaded:
        return ActionOutcome("nothing-to-do", "no device above target_ratio, or nothing resident to offload")
    return ActionOutcome("ok", "", done=True, context={"offloaded": offloaded})


def _revert_offload_coldest(
    conn: ControlConnection, state: RuntimeState, recent: Mapping[Expert, int], spec: RuleSpec, target: Target,
    ctx: dict[str, Any],
) -> ActionOutcome:
    left: list[list[Any]] = [list(x) for x in ctx.get("offloaded", [])]
    sent = 0
    while left:
        layer, expert, device = left[0]
        if state.tier.get((layer, expert)) == "host":  # restore only what is still offloaded
            try:
                args: dict[str, Any] = {"layer": layer, "expert": expert}
                if device is not None:  # None: taken over at start; the runtime knows where it was
                    args["device"] = device
                conn.call("restore_expert", args)
            except CommandFailed as exc:
                raise _PartialFailure(exc, {"offloaded": left}) from None
            sent += 1
        left.pop(0)
    return ActionOutcome("ok" if sent else "already-applied", "", done=True)


def _fire_router_penalty(
    conn: ControlConnection, state: RuntimeState, recent: Mapping[Expert, int], spec: RuleSpec, target: Target,
    ctx: dict[str, Any],
) -> ActionOutcome:
    layer, expert = target
    # The protocol subtracts a non-negative penalty; the config writes DESIGN's signed -0.3.
    penalty = abs(float(spec.args["penalty"]))
    if math.isclose(state.penalty.get((layer, expert), 0.0), penalty, abs_tol=1e-9):
        return ActionOutcome("already-applied", "", done=True)
    conn.call("set_router_penalty", {"layer": layer, "expert": expert, "penalty": penalty})
    return ActionOutcome("ok", "", done=True)


def _revert_router_penalty(
    conn: ControlConnection, state: RuntimeState, recent: Mapping[Expert, int], spec: RuleSpec, target: Target,
    ctx: dict[str, Any],
) -> ActionOutcome:
    layer, expert = target
    if state.penalty.get((layer, expert), 0.0) == 0.0:
        return ActionOutcome("already-applied", "", done=True)
    conn.call("set_router_penalty", {"layer": layer, "expert": expert, "penalty": 0.0})
    return ActionOutcome("ok", "", done=True)


def _fire_migrate_hottest(
    conn: ControlConnection, state: RuntimeState, recent: Mapping[Expert, int], spec: RuleSpec, target: Target,
    ctx: dict[str, Any],
) -> ActionOutcome:
    (layer,) = target
    if len(state.devices) < 2:
        return ActionOutcome("nothing-to-do", f"one compute device ({state.primary_device}): nowhere to move to")
    experts = [(layer, e) for e in range(state.experts)]
    hottest = max(experts, key=lambda x: (recent.get(x, 0), state.last_step_tokens[x], state.tokens[x], -x[1]))
    load = {d: 0 for d in state.devices}
    for x, d in state.device.items():
        if d in load and state.tier[x] == "device":
            load[d] += recent.get(x, 0) or state.last_step_tokens[x]
    source = state.device[hottest]
    candidates = [d for d in state.devices if d != source]
    least = min(candidates, key=lambda d: (load[d], float(state.memory.get(d, {}).get("used_ratio", 0.0)), d))
    conn.call("migrate_expert", {"layer": layer, "expert": hottest[1], "device": least})
    return ActionOutcome(
        "ok",
        f"migrate_expert layer {layer} expert {hottest[1]} {source} -> {least}",
        done=True,
        context={"expert": hottest[1], "from": source, "to": least},
    )


def _revert_migrate_hottest(
    conn: ControlConnection, state: RuntimeState, recent: Mapping[Expert, int], spec: RuleSpec, target: Target,
    ctx: dict[str, Any],
) -> ActionOutcome:
    (layer,) = target
    expert, source = int(ctx["expert"]), str(ctx["from"])
    if state.device.get((layer, expert)) == source:
        return ActionOutcome("already-applied", f"expert {expert} already on {source}", done=True)
    conn.call("migrate_expert", {"layer": layer, "expert": expert, "device": source})
    return ActionOutcome("ok", f"migrate_expert layer {layer} expert {expert} back to {source}", done=True)


def _fire_prefetch_hottest(
    conn: ControlConnection, state: RuntimeState, recent: Mapping[Expert, int], spec: RuleSpec, target: Target,
    ctx: dict[str, Any],
) -> ActionOutcome:
    if not any(t == "host" for t in state.tier.values()):
        return ActionOutcome("nothing-to-do", "every expert is resident: nothing to prefetch")
    result = conn.call("prefetch", {"count": int(spec.args["experts"])})
    if not result.get("loaded"):
        return ActionOutcome("nothing-to-do", f"prefetch loaded nothing (pool full: {result.get('skipped_pool_full')})")
    return ActionOutcome("ok", "", done=True, context={"loaded": result.get("loaded")})


_HANDLERS: Mapping[tuple[str, Intent], Handler] = {
    ("set_precision", Intent.FIRE): _fire_set_precision,
    ("set_precision", Intent.REVERT): _revert_set_precision,
    ("offload_coldest", Intent.FIRE): _fire_offload_coldest,
    ("offload_coldest", Intent.REVERT): _revert_offload_coldest,
    ("router_penalty", Intent.FIRE): _fire_router_penalty,
    ("router_penalty", Intent.REVERT): _revert_router_penalty,
    ("migrate_hottest", Intent.FIRE): _fire_migrate_hottest,
    ("migrate_hottest", Intent.REVERT): _revert_migrate_hottest,
    ("prefetch_hottest", Intent.FIRE): _fire_prefetch_hottest,
}
