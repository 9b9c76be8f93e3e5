"""Helpers for policy tests: synthetic Signals series for one rule, fed to the real engine."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from moescope.agent.policy.audit import AuditLog, AuditRecord
from moescope.agent.policy.engine import PolicyEngine
from moescope.agent.policy.rules import RuleSpec, Signals, Target, TargetKind, fires_upward
from moescope.examples.moe_runtime.control import ControlClient

PERIOD_S = 0.2
REPO = Path(__file__).resolve().parents[2]


class EngineKeys(TypedDict, total=False):
    """PolicyConfig's engine-wide settings, to override as keyword arguments."""

    sample_period_ms: int
    max_actions: int
    rate_window_s: float
    command_timeout_ms: float
    max_targets: int
    late_answer_ms: float


class SignalValues(TypedDict, total=False):
    """Signals' values (every field but t_s), to pass as keyword arguments."""

    step_p99_ms: float
    device_memory_used_ratio: float
    expert_load_p99_ms: float
    request_p99_ms: float
    request_phase_inference_p99_ms: float
    request_phase_expert_load_p99_ms: float
    expert_queue_tokens: Mapping[tuple[int, int], float]
    expert_load_gini: Mapping[int, float]
    router_entropy_ratio: Mapping[int, float]


def target_for(spec: RuleSpec) -> Target:
    return {TargetKind.GLOBAL: (), TargetKind.LAYER: (1,), TargetKind.EXPERT: (1, 3)}[spec.target_kind]


def signals_for(spec: RuleSpec, t_s: float, value: float, target: Target | None = None) -> Signals:
    target = target_for(spec) if target is None else target
    kind = spec.target_kind
    # Any: the rule names its signal (a string), so which field it sets is known at run time only.
    values: dict[str, Any]
    if kind is TargetKind.GLOBAL:
        values = {spec.signal: value}
    elif kind is TargetKind.LAYER:
        values = {spec.signal: {target[0]: value}}
    else:
        values = {spec.signal: {(target[0], target[1]): value}}
    return Signals(t_s=t_s, **values)


@dataclass
class Levels:
    """Values for a rule: firing, in the dead band (neither fires nor clears), past the clear threshold,
    and just either side of the fire threshold."""

    hi: float
    mid: float
    lo: float
    just_over: float
    just_under: float


def levels(spec: RuleSpec) -> Levels:
    up = 1.0 if fires_upward(spec.comparison) else -1.0
    band = abs(spec.fire - spec.clear)
    eps = band / 100.0
    return Levels(
        hi=spec.fire + up * band,
        mid=(spec.fire + spec.clear) / 2.0,
        lo=spec.clear - up * band,
        just_over=spec.fire + up * eps,
        just_under=spec.fire - up * eps,
    )


@dataclass
class Feeder:
    """Feeds one rule's signal to an engine at the sample period and keeps the clock."""

    engine: PolicyEngine
    spec: RuleSpec
    t_s: float = 1000.0
    fed: int = 0
    # Wait for in-flight commands after each evaluation, as real 200 ms periods would: keeps the
    # synthetic clock from outrunning the runtime's answers.
    sync: bool = False
    targets: list[Target] = field(default_factory=list)

    def feed(self, values: Iterable[float], target: Target | None = None) -> None:
        for value in values:
            self.engine.evaluate(signals_for(self.spec, self.t_s, value, target))
            if self.sync:
                assert self.engine.wait_idle(60.0), "action still in flight after 60 s"
            self.t_s = round(self.t_s + PERIOD_S, 9)
            self.fed += 1

    def skip_to(self, t_s: float) -> None:
        self.t_s = t_s


def records(audit: AuditLog, *, rule: str | None = None, intent: str | None = None) -> list[AuditRecord]:
    return [
        r
        for r in audit.recent()
        if (rule is None or r.rule == rule) and (intent is None or r.intent == intent)
    ]


@dataclass
class RuntimeProc:
    proc: subprocess.Popen[str]
    socket_path: str
    http_port: int
    workdir: Path

    def call(self, cmd: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        with ControlClient(self.socket_path, timeout_s=30.0) as client:
            return client.call(cmd, args)

    def stats(self) -> dict[str, Any]:
        return self.call("stats")

    def complete(self, prompt: str, *, max_tokens: int = 4) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=60)
        try:
            conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": max_tokens}))
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200, resp.status
        finally:
            conn.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


StartRuntime = Callable[..., RuntimeProc]


class ControlProxy:
    """A control socket in front of a real runtime's: ``answer(request)`` may answer a request itself
    (a reply object) or pass it on (None); ``rewrite(request, reply)`` edits what the runtime replied.
    Stands in for runtimes that differ from the reference one (older, hostile, broken)."""

    def __init__(self, path: Path, upstream: str, *,
                 answer: Callable[[dict[str, Any]], dict[str, Any] | None] = lambda request: None,
                 rewrite: Callable[[dict[str, Any], dict[str, Any]], None] = lambda request, reply: None) -> None:
        self.upstream, self.answer, self.rewrite = upstream, answer, rewrite
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(path))
        self._server.listen(4)
        self._server.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            with conn, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as up:
                up.connect(self.upstream)
                up_reader = up.makefile("rb")
                for line in conn.makefile("rb"):
                    request = json.loads(line)
                    reply = self.answer(request)
                    if reply is None:
                        up.sendall(line)
                        reply = json.loads(up_reader.readline())
                        self.rewrite(request, reply)
                    conn.sendall(json.dumps(reply).encode() + b"\n")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._server.close()
