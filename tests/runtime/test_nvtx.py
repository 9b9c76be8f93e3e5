"""NVTX instrumentation (convention moe/v1): in detail through a recording domain that implements
the `nvtx.Domain` calls the runtime makes, driven by the real batching engine; and end to end through
the real injection mechanism (moescope's injection library in a real server process, drained by
collectors/nvtx.py and parsed by collectors/moe_convention.py)."""

from __future__ import annotations

import dataclasses
import http.client
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from moescope.collectors.moe_convention import MoeConventionParser, StepEvent
from moescope.collectors.nvtx import NvtxCollector, injection_library_path
from moescope.examples.moe_runtime.batcher import Request
from moescope.examples.moe_runtime.config import ModelConfig
from moescope.examples.moe_runtime.runtime import Runtime, RuntimeOptions
from moescope.moe_nvtx import (
    MESSAGES,
    Instrumentation,
    NvtxInstrumentation,
    make_instrumentation,
)
from tests.runtime.conftest import REPO, SMALL_MODEL, _read_banner, _stop

CFG = ModelConfig(d_model=64, d_ff=128, layers=2, experts=8, n_heads=2, capacity_factor=0.75)


@dataclasses.dataclass
class Attributes:
    message: str
    category: int | None = None
    payload: Any = None


@dataclasses.dataclass
class Event:
    kind: str  # push | pop | mark
    message: str
    category: int | None
    payload: Any
    parents: tuple[str, ...]  # messages of the enclosing ranges, outermost first


class RecordingDomain:
    def __init__(self) -> None:
        self.registered: list[str] = []
        self.events: list[Event] = []
        self.stack: list[Attributes] = []

    def get_registered_string(self, string: str) -> str:
        self.registered.append(string)
        return string

    def get_event_attributes(self, message: Any = None, color: Any = None, category: Any = None,
                             payload: Any = None) -> Attributes:
        return Attributes(self.get_registered_string(message), category, payload)

    def _apply(self, attributes: Attributes | None, kwargs: dict[str, Any]) -> Attributes:
        # as nvtx.Domain: keyword arguments override (or, without attributes, make) the attributes
        if attributes is None:
            attributes = Attributes(kwargs.pop("message", ""))
        for key, value in kwargs.items():
            setattr(attributes, key, value)
        return Attributes(attributes.message, attributes.category, attributes.payload)

    def push_range(self, attributes: Attributes | None = None, **kwargs: Any) -> None:
        a = self._apply(attributes, kwargs)
        self.events.append(Event("push", a.message, a.category, a.payload, tuple(s.message for s in self.stack)))
        self.stack.append(a)

    def pop_range(self) -> None:
        a = self.stack.pop()
        self.events.append(Event("pop", a.message, a.category, None, tuple(s.message for s in self.stack)))

    def mark(self, attributes: Attributes | None = None, **kwargs: Any) -> None:
        a = self._apply(attributes, kwargs)
        self.events.append(Event("mark", a.message, a.category, a.payload, tuple(s.message for s in self.stack)))


def run_two_requests(convention: str = "v1") -> tuple[RecordingDomain, Runtime]:
    domain = RecordingDomain()
    rt = Runtime(RuntimeOptions(model=CFG, max_wait_ms=2000, capacity_experts=16, initial_resident_experts=14),
                 instrumentation=NvtxInstrumentation(domain=domain, convention=convention))
    rt.engine.start()
    try:
        requests = [Request(request_key=key, prompt_ids=rt.tokenizer.encode(p), max_tokens=3)
                    for key, p in ((11, "first request"), (12, "the second one"))]
        for r in requests:
            rt.engine.submit(r)
        for r in requests:
            assert r.done.wait(60) and r.error is None
    finally:
        rt.engine.stop()
    return domain, rt


def test_ranges_and_marks_follow_the_v1_convention() -> None:
    domain, rt = run_two_requests("v1")
    events = domain.events
    # The fixed message set, registered once each up front; nothing registered per event.
    assert sorted(domain.registered) == sorted(MESSAGES)
    assert {e.message for e in events} <= set(MESSAGES)
    assert domain.stack == []
    assert sum(e.kind == "push" for e in events) == sum(e.kind == "pop" for e in events)

    steps = [i for i, e in enumerate(events) if e.kind == "push" and e.message == "moe.step"]
    assert len(steps) == 3  # both requests prefill together, then 2 decode steps
    first_step_tokens = len(rt.tokenizer.encode("first request")) + len(rt.tokenizer.encode("the second one"))
    assert [events[i].payload for i in steps] == [first_step_tokens, 2, 2]
    for i in steps:
        e = events[i]
        assert e.parents == () and isinstance(e.payload, int) and e.category is None
    requests = [e for e in events if e.message == "moe.request"]
    assert [(e.kind, e.payload, e.parents) for e in requests] == [("mark", k, ("moe.step",)) for k in (11, 12) * 3]

    layers = [e for e in events if e.kind == "push" and e.message == "moe.layer"]
    assert [e.category for e in layers] == [1, 2] * 3 and all(e.parents == ("moe.step",) for e in layers)
    routers = [e for e in events if e.kind == "push" and e.message == "moe.router"]
    assert [e.category for e in routers] == [1, 2] * 3
    for e in routers:
        assert e.parents == ("moe.step", "moe.layer")
        assert isinstance(e.payload, float) and 0.0 < e.payload <= math.log2(CFG.experts)

    # Per (step, layer): tokens marks sum to k x tokens; ffn payloads sum to kept assignments;
    # loads precede the ffn of the same expert and move exactly the expert's bytes.
    expert_bytes = 3 * CFG.d_model * CFG.d_ff * 4
    host_experts = {(1, 6), (1, 7)}  # 14 of 16 resident: the last two of layer 1 live on host
    step_index = -1
    layer = -1
    sums: dict[tuple[int, int], dict[str, int]] = {}
    last_load: int | None = None
    for e in events:
        if e.kind == "push" and e.message == "moe.step":
            step_index += 1
        if e.kind == "push" and e.message == "moe.layer":
            assert e.category is not None
            layer = e.category - 1
        s = sums.setdefault((step_index, layer), {"tokens": 0, "dropped": 0, "ffn": 0, "loads": 0})
        if e.message in ("moe.expert.tokens", "moe.expert.dropped"):
            assert e.kind == "mark" and e.parents == ("moe.step", "moe.layer", "moe.router")
            assert isinstance(e.payload, int) and e.payload > 0
            assert e.category is not None and 1 <= e.category <= CFG.experts
            s["tokens" if e.message == "moe.expert.tokens" else "dropped"] += e.payload
        if e.kind == "push" and e.message == "moe.expert.load":
            assert e.parents == ("moe.step", "moe.layer") and e.payload == expert_bytes
            assert e.category is not None and (layer, e.category - 1) in host_experts
            s["loads"] += 1
            last_load = e.category
        if e.kind == "push" and e.message == "moe.expert.ffn":
            assert e.parents == ("moe.step", "moe.layer") and e.payload > 0
            if last_load is not None:
                assert e.category == last_load
                last_load = None
            s["ffn"] += e.payload
    tokens_per_step = [first_step_tokens, 2, 2]
    for (step, _layer), s in sums.items():
        if step < 0 or _layer < 0:
            continue
        assert s["tokens"] == CFG.top_k * tokens_per_step[step]
        assert s["ffn"] == s["tokens"] - s["dropped"]  # overflow=drop: dropped work is not done
    stats = rt.stats.snapshot()
    assert sum(x["loads"] for x in sums.values()) == stats["counters"]["expert_loads"] > 0
    assert sum(x["dropped"] for x in sums.values()) == sum(map(sum, stats["dropped"])) > 0


def test_v2_sends_one_routing_vector_and_one_experts_range_per_layer() -> None:
    domain, rt = run_two_requests("v2")
    events = domain.events
    assert domain.stack == []
    assert not [e for e in events if e.message in ("moe.expert.tokens", "moe.expert.dropped", "moe.expert.ffn")]
    first_step_tokens = len(rt.tokenizer.encode("first request")) + len(rt.tokenizer.encode("the second one"))
    tokens_per_step = [first_step_tokens, 2, 2]
    expert_bytes = 3 * CFG.d_model * CFG.d_ff * 4
    host_experts = {(1, 6), (1, 7)}
    routing = [e for e in events if e.message == "moe.routing"]
    experts = [e for e in events if e.kind == "push" and e.message == "moe.experts"]
    times = [e for e in events if e.message == "moe.experts.time"]
    assert len(routing) == len(experts) == len(times) == 3 * CFG.layers  # per step and layer: one of each
    dropped_total = 0
    for i, (r, x, t) in enumerate(zip(routing, experts, times, strict=True)):
        step, layer = divmod(i, CFG.layers)
        assert r.kind == "mark" and r.parents == ("moe.step", "moe.layer", "moe.router") and r.category == layer + 1
        vector = np.asarray(r.payload)
        assert vector.dtype == np.int32 and vector.shape == (2 * CFG.experts,)
        tokens, dropped = vector[: CFG.experts], vector[CFG.experts:]
        assert int(tokens.sum()) == CFG.top_k * tokens_per_step[step] and (dropped <= tokens).all()
        dropped_total += int(dropped.sum())
        assert x.parents == ("moe.step", "moe.layer") and x.category == layer + 1
        assert x.payload == int((tokens - dropped).sum())  # overflow=drop: what ran
        assert t.kind == "mark" and t.parents == ("moe.step", "moe.layer", "moe.experts")
        spent = np.asarray(t.payload)
        assert spent.dtype == np.float32 and spent.shape == (CFG.experts,)
        assert ((spent > 0) == (tokens - dropped > 0)).all()  # a time for exactly the experts that ran
    loads = [e for e in events if e.kind == "push" and e.message == "moe.expert.load"]
    assert loads and all(e.parents == ("moe.step", "moe.layer", "moe.experts") for e in loads)
    assert all(e.payload == expert_bytes and (1, e.category - 1) in host_experts for e in loads if e.category)
    stats = rt.stats.snapshot()
    assert len(loads) == stats["counters"]["expert_loads"]
    assert dropped_total == sum(map(sum, stats["dropped"])) > 0


def test_no_tool_attached_means_no_op_instrumentation() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVTX_INJECTION")}
    code = ("from moescope.moe_nvtx import make_instrumentation as m;"
            "print(type(m(enabled=True)).__name__, type(m(enabled=False)).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=True)
    assert out.stdout.split() == ["Instrumentation", "Instrumentation"]
    assert type(make_instrumentation(enabled=False, domain=RecordingDomain())) is Instrumentation
    assert isinstance(make_instrumentation(enabled=True, domain=RecordingDomain()), NvtxInstrumentation)


def test_captured_through_the_real_injection_library() -> None:
    ring_dir = tempfile.mkdtemp(prefix="moe-rt-nvtx-")
    env = dict(os.environ, NVTX_INJECTION64_PATH=str(injection_library_path()), MOESCOPE_NVTX_DIR=ring_dir)
    cmd = [sys.executable, "-m", "moescope.examples.moe_runtime", "--port", "0", "--control-socket",
           os.path.join(ring_dir, "c.sock"), *SMALL_MODEL, "--initial-resident-experts", "14",
           "--capacity-factor", "0.75", "--max-wait-ms", "1000"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    collector = None
    try:
        banner = _read_banner(proc, timeout_s=90)
        assert banner["nvtx"] == "active"
        port = int(banner["http port"])
        steps: list[StepEvent] = []
        parser = MoeConventionParser(sink=steps.extend)
        collector = NvtxCollector(proc.pid, sink=parser, directory=pathlib.Path(ring_dir))
        keys: list[int] = []

        def request(prompt: str) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            try:
                conn.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt, "max_tokens": 3}))
                body = json.loads(conn.getresponse().read())
                keys.append(body["request_key"])
            finally:
                conn.close()

        threads = [threading.Thread(target=request, args=(p,)) for p in ("first request", "the second one")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(keys) == 2
        for _ in range(100):  # bounded wait for the drain, not a timing assertion
            collector.poll(time.monotonic_ns())
            if len(steps) >= 3:
                break
            time.sleep(0.05)
        parsed = parser.stats()
        assert [s.tokens for s in steps] == [29, 2, 2]  # (1 + 13) + (1 + 14) prompt tokens, then decode
        assert all(sorted(s.requests) == sorted(keys) for s in steps)
        for step in steps:
            assert [layer.layer for layer in step.layers] == [0, 1]
            for layer in step.layers:
                assert layer.router is not None and 0 < (layer.router.entropy_bits or 0) <= 3.0
                assert layer.router.routed() == 2 * (step.tokens or 0)
                assert all(load.bytes_moved == 3 * 64 * 128 * 4 for load in layer.loads)
            # 14 of 16 experts resident: only layer 1's experts 6 and 7 are ever loaded.
            assert step.layers[0].loads == [] and {load.expert for load in step.layers[1].loads} <= {6, 7}
        assert sum(len(layer.loads) for s in steps for layer in s.layers) > 0
        assert sum(layer.router.over_capacity() for s in steps for layer in s.layers if layer.router) > 0
        for name in ("unknown_names", "malformed_payloads", "malformed_categories", "misplaced", "orphans"):
            assert parsed[name] == 0, (name, parsed)
        assert collector.stats()["dropped_ring_full"] == 0
    finally:
        if collector is not None:
            collector.close()
        _stop(proc)
        for name in os.listdir(ring_dir):
            os.unlink(os.path.join(ring_dir, name))
        os.rmdir(ring_dir)
