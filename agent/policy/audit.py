"""Every policy decision is one AuditRecord: appended to a JSON-lines file, kept in memory for the TUI,
counted, and handed to hooks (the pipeline's span-event and metric exporters). Audit failures are
counted and logged once; they never raise into the engine."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

# decision: what the engine decided for an intent ("fire" or "revert").
DECISIONS = ("fire", "revert", "suppressed-by-rate-limit", "suppressed-by-conflict", "dry-run")
# outcome: what came of it.
OUTCOMES = (
    "ok",  # every command acknowledged
    "alert",  # alert raised (no command)
    "cleared",  # alert cleared, or a non-reverting rule went back to armed (no command)
    "already-applied",  # the runtime's state already shows it: nothing sent
    "nothing-to-do",  # the planner found nothing to act on (e.g. no resident expert to offload)
    "refused",  # the runtime answered ok=false
    "unsupported",  # the runtime answered "unsupported: ...": it cannot do this action; not retried
    "unreachable",  # no control socket / connection refused / runtime gone
    "late",  # every command acknowledged, one or more after command_timeout_ms (within late_answer_ms)
    "timeout",  # no answer within command_timeout_ms + late_answer_ms
    "protocol-error",  # the answer was not the protocol's JSON
    "not-sent",  # dry-run or suppressed
    "internal-error",  # a bug in the agent (logged with its traceback)
)


@dataclass(slots=True)
class CommandResult:
    request: dict[str, Any]
    answer: dict[str, Any] | None
    latency_ms: float
    error: str | None = None


@dataclass(slots=True)
class AuditRecord:
    ts_unix_s: float
    t_s: float  # engine (monotonic) time of the evaluation that decided
    rule: str
    target: list[int]
    signal: str
    value: float
    comparison: str
    threshold: float  # fire threshold for a fire, clear threshold for a revert
    window: str
    window_values: list[float]
    intent: str  # fire | revert
    action: str
    decision: str
    outcome: str
    plan: str = ""  # the action in words (all a dry run or a suppressed decision has)
    commands: list[CommandResult] = field(default_factory=list)
    latency_ms: float = 0.0  # decision to the runtime's last acknowledgement
    error: str | None = None
    dry_run: bool = False

    def to_json(self) -> str:
        # asdict's text without its deep copies (~0.3 ms a record): values go to json.dumps as they are
        body = {name: getattr(self, name) for name in _RECORD_FIELDS}
        body["commands"] = [{name: getattr(c, name) for name in _COMMAND_FIELDS} for c in self.commands]
        # JSON has no NaN: no data (or no evaluation, for a take-over at start) is null.
        for key in ("value", "t_s", "latency_ms"):
            if not math.isfinite(body[key]):
                body[key] = None
        return json.dumps(body, separators=(",", ":"), allow_nan=False)

    def span_attributes(self) -> dict[str, str | float | int | bool]:
        """Flat attributes for an OTel span event named 'moe.policy.action'."""
        attrs: dict[str, str | float | int | bool] = {
            "moe.policy.rule": self.rule,
            "moe.policy.target": ",".join(str(t) for t in self.target),
            "moe.policy.signal": self.signal,
            "moe.policy.threshold": self.threshold,
            "moe.policy.intent": self.intent,
            "moe.policy.action": self.action,
            "moe.policy.decision": self.decision,
            "moe.policy.outcome": self.outcome,
            "moe.policy.latency_ms": self.latency_ms,
            "moe.policy.dry_run": self.dry_run,
        }
        if not math.isnan(self.value):
            attrs["moe.policy.value"] = self.value
        if self.commands:
            attrs["moe.policy.command"] = json.dumps([c.request for c in self.commands], separators=(",", ":"))
        if self.error:
            attrs["moe.policy.error"] = self.error
        return attrs


_RECORD_FIELDS = tuple(f.name for f in fields(AuditRecord))
_COMMAND_FIELDS = tuple(f.name for f in fields(CommandResult))

AuditHook = Callable[[AuditRecord], None]


class AuditLog:
    """Thread-safe sink for AuditRecords: file + memory ring + counters + hooks."""

    def __init__(self, *, path: Path | str | None = None, keep_records: int = 1000) -> None:
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._recent: deque[AuditRecord] = deque(maxlen=keep_records)
        self._hooks: list[AuditHook] = []
        self._counts: Counter[tuple[str, str, str]] = Counter()
        self.write_errors = 0
        self.hook_errors = 0
        self._file: IO[str] | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")

    def add_hook(self, hook: AuditHook) -> None:
        with self._lock:
            self._hooks.append(hook)

    def record(self, rec: AuditRecord) -> None:
        with self._lock:
            self._recent.append(rec)
            self._counts[(rec.rule, rec.decision, rec.outcome)] += 1
            hooks = list(self._hooks)
            if self._file is not None:
                try:
                    self._file.write(rec.to_json() + "\n")
                    self._file.flush()
                except OSError as exc:
                    self.write_errors += 1
                    if self.write_errors == 1:
                        log.warning("policy audit: cannot write %s: %s (counting further failures)", self.path, exc)
        for hook in hooks:
            try:
                hook(rec)
            except Exception as exc:  # a broken exporter hook must not stop the policy engine
                self.hook_errors += 1
                if self.hook_errors == 1:
                    log.warning("policy audit: hook %r failed: %s (counting further failures)", hook, exc)

    def recent(self, limit: int | None = None) -> list[AuditRecord]:
        with self._lock:
            items = list(self._recent)
        return items if limit is None else items[-limit:]

    def total(self) -> int:
        """Records since the start (recent() keeps the last few)."""
        with self._lock:
            return sum(self._counts.values())

    def counts(self) -> Mapping[tuple[str, str, str], int]:
        """(rule, decision, outcome) -> records: the source of the actions metric."""
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def now_unix_s() -> float:
    return time.time()
