"""A real NVTX producer for the tests: uses the `nvtx` package exactly as a serving process would,
and writes down what it emitted (with time.monotonic_ns() read around every call and the native
thread id) so the tests can compare the agent's capture with the truth.

Protocol on stdio: prints "ready" once its NVTX ring exists (its first NVTX call created it), waits
for one line on stdin, runs the mode, writes the log (--log), prints "done" and exits.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any

import nvtx

DOMAINS: tuple[str | None, ...] = ("moe", "aux", None)  # None: NVTX's default domain


def _domain(name: str | None) -> Any:
    return nvtx.get_domain(name)


def run_exact(*, threads: int, rounds: int) -> dict[str, Any]:
    """Every thread: nested push/pop in three domains, int/float payloads, int and named categories,
    marks, start/end ranges; one start/end pair crosses threads."""
    events: list[dict[str, Any]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(threads)
    cross_ids: list[tuple[int, int, int, int]] = []

    def worker(index: int) -> None:
        tid = threading.get_native_id()
        local: list[dict[str, Any]] = []
        doms = {name: _domain(name) for name in DOMAINS}
        barrier.wait()

        def call(kind: str, domain: str | None, fn: Any, **fields: Any) -> Any:
            t0 = time.monotonic_ns()
            result = fn()
            t1 = time.monotonic_ns()
            local.append({"kind": kind, "domain": domain, "tid": tid, "t0": t0, "t1": t1, **fields})
            return result

        for r in range(rounds):
            for dname in DOMAINS:
                d = doms[dname]
                outer_payload = index * 1_000_000 + r * 10 + DOMAINS.index(dname)
                inner_payload = outer_payload + 0.5
                call("push", dname, lambda: d.push_range(message="outer", payload=outer_payload),
                     message="outer", payload=outer_payload, category=0)
                call("push", dname, lambda: d.push_range(message="inner", payload=inner_payload, category=7),
                     message="inner", payload=inner_payload, category=7)
                call("mark", dname, lambda: d.mark(message="tick", payload=outer_payload + 3, category="named-cat"),
                     message="tick", payload=outer_payload + 3, category="named-cat")
                call("mark", dname, lambda: d.mark(message="plain"), message="plain", payload=None, category=0)
                call("pop", dname, d.pop_range)
                call("pop", dname, d.pop_range)
            d = doms["moe"]
            se_payload = index * 1_000_000 + r * 10 + 5
            rid = call("start", "moe", lambda: d.start_range(message="async", payload=se_payload),
                       message="async", payload=se_payload, category=0)
            local[-1]["range_id"] = rid
            call("end", "moe", lambda: d.end_range(rid), range_id=rid)
        # one range started here and ended by the main thread
        d = doms["moe"]
        cross_payload = index * 1_000_000 + 999_999
        rid = call("start", "moe", lambda: d.start_range(message="cross", payload=cross_payload),
                   message="cross", payload=cross_payload, category=0)
        local[-1]["range_id"] = rid
        with lock:
            events.extend(local)
            cross_ids.append((rid, tid, cross_payload, index))

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    d = _domain("moe")
    main_tid = threading.get_native_id()
    for rid, _tid, _payload, _index in sorted(cross_ids):
        t0 = time.monotonic_ns()
        d.end_range(rid)
        t1 = time.monotonic_ns()
        events.append({"kind": "end", "domain": "moe", "tid": main_tid, "t0": t0, "t1": t1, "range_id": rid})
    return {"events": events, "threads": threads}


def run_flood(*, threads: int, count: int, pause: bool) -> dict[str, Any]:
    """As fast as possible: push/pop pairs and marks; returns how many NVTX events were emitted.
    With pause: after half of the work, print "half" and wait for a line on stdin."""
    d = _domain("moe")
    barrier = threading.Barrier(threads + 1 if pause else threads)
    resume = threading.Event()
    emitted = [0] * threads

    def worker(index: int) -> None:
        attrs = d.get_event_attributes(message="flood", payload=index)
        mark_attrs = d.get_event_attributes(message="flood.mark", payload=1.0)
        n = 0
        for half in (0, 1):
            if half == 0 or pause:
                barrier.wait()
            if half == 1 and pause:
                resume.wait()
            for _ in range(count // 6):
                d.push_range(attrs)
                d.mark(mark_attrs)
                d.pop_range()
                n += 3
        emitted[index] = n

    if pause:
        workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        barrier.wait()  # start together
        barrier.wait()  # everyone finished the first half
        print("half", flush=True)
        sys.stdin.readline()
        resume.set()
        for w in workers:
            w.join()
        return {"emitted": sum(emitted)}

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return {"emitted": sum(emitted)}


def run_nested_flood(*, threads: int, count: int) -> dict[str, Any]:
    """As fast as possible, nested: outer(i) > inner(i) > mark(i), per thread; into a ring too
    small to hold it, so drops cut through the nesting."""
    d = _domain("moe")
    barrier = threading.Barrier(threads)
    emitted = [0] * threads

    def worker(index: int) -> None:
        outer = d.get_event_attributes(message="nest.outer", payload=0)
        inner = d.get_event_attributes(message="nest.inner", payload=0)
        mark = d.get_event_attributes(message="nest.mark", payload=0)
        barrier.wait()
        for i in range(count):
            key = index * 1_000_000_000 + i
            d.push_range(outer, payload=key)
            d.push_range(inner, payload=key)
            d.mark(mark, payload=key)
            d.pop_range()
            d.pop_range()
        emitted[index] = 5 * count

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return {"emitted": sum(emitted)}


def run_steady(*, stop: threading.Event) -> dict[str, Any]:
    """Until stdin closes: outer/inner nested ranges in a loop (for late attach)."""
    d = _domain("moe")
    outer = d.get_event_attributes(message="steady.outer")
    inner = d.get_event_attributes(message="steady.inner", payload=2)
    loops = 0
    while not stop.is_set():
        d.push_range(outer)
        d.push_range(inner)
        d.pop_range()
        d.pop_range()
        loops += 1
        if loops % 256 == 0:
            time.sleep(0.001)
    return {"loops": loops}


def run_hostile(*, count: int) -> dict[str, Any]:
    """Texts and payloads a tool must survive: huge, invalid UTF-8, schema (EXT) payloads, and an
    unbounded number of unique strings (which the producer is told never to do)."""
    import numpy as np

    d = _domain("moe")
    huge = "h" * 100_000 + "é" * 10
    d.mark(message=huge, payload=1)
    d.mark(message=b"bad \xff\xfe utf8 \xc3", payload=2)
    d.push_range(message="ext", payload=np.arange(4, dtype=np.int64))
    d.pop_range()
    d.mark(message="ext.mark", payload=np.array([1.5, 2.5]))
    for i in range(count):
        d.mark(message=f"unique-{i}", payload=i)
    thread_open = threading.Thread(target=lambda: d.push_range(message="left.open"))
    thread_open.start()
    thread_open.join()
    return {"huge_bytes": len(huge.encode()), "unique": count, "open_thread_tid": thread_open.native_id}


EXT_DTYPES: tuple[str, ...] = ("int32", "int64", "float32", "float64")
EXT_LENGTHS: tuple[int, ...] = (1, 3, 17, 256, 4096)


def run_ext(*, threads: int, rounds: int) -> dict[str, Any]:
    """numpy arrays as payloads (the `nvtx` package sends them through the payload extension): every
    dtype and length in marks and in nested range pushes, from several threads. The log keeps
    every payload in emission order per thread, as lists."""
    import numpy as np

    barrier = threading.Barrier(threads)
    sent: dict[str, list[dict[str, Any]]] = {}
    lock = threading.Lock()

    def worker(index: int) -> None:
        d = _domain("moe")
        tid = threading.get_native_id()
        local: list[dict[str, Any]] = []
        barrier.wait()
        for r in range(rounds):
            for k, dtype in enumerate(EXT_DTYPES):
                for length in EXT_LENGTHS:
                    base = index * 100_000 + r * 1000 + k * 100
                    outer = (np.arange(length) + base).astype(dtype)
                    inner = (np.arange(length) * -0.5 + base).astype(dtype)
                    d.push_range(message="ext.range", payload=outer)
                    d.mark(message="ext.mark", payload=inner)
                    d.pop_range()
                    local.append({"kind": "range", "dtype": dtype, "values": outer.tolist()})
                    local.append({"kind": "mark", "dtype": dtype, "values": inner.tolist()})
        with lock:
            sent[str(tid)] = local

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return {"sent": sent}


def run_moe(*, steps: int, layers: int, experts: int) -> dict[str, Any]:
    """The reference runtime's own instrumentation (moe/v1 convention) driven with known values,
    plus deliberate convention violations the parser must count."""
    from moescope.moe_nvtx import make_instrumentation

    ins = make_instrumentation(enabled=True)
    assert ins.active, "NVTX tool not attached"
    d = _domain("moe")
    truth: list[dict[str, Any]] = []
    for s in range(steps):
        t0 = time.monotonic_ns()
        ins.step_push(tokens=100 + s)
        ins.request_mark(request_key=7000 + s)
        ins.request_mark(request_key=8000 + s)
        step: dict[str, Any] = {"tokens": 100 + s, "requests": [7000 + s, 8000 + s], "layers": [],
                                "tid": threading.get_native_id()}
        for layer in range(layers):
            ins.layer_push(layer, experts)
            entropy = 2.5 + layer * 0.25 + s / 64
            ins.router_push(layer, entropy)
            tokens = {e: (s + layer + e) % 5 + 1 for e in range(experts)}
            dropped = {e: 1 for e in range(experts) if (s + e) % 3 == 0}
            for e in range(experts):
                ins.expert_tokens_mark(e, tokens[e])
                if e in dropped:
                    ins.expert_dropped_mark(e, dropped[e])
            ins.pop()
            loads = {e: 4096 * (e + 1) for e in range(experts) if (s + layer + e) % 4 == 0}
            for e, nbytes in loads.items():
                ins.load_push(e, nbytes)
                ins.pop()
            for e in range(experts):
                ins.ffn_push(e, tokens[e])
                ins.pop()
            ins.pop()
            step["layers"].append({"layer": layer, "entropy": entropy, "tokens": tokens, "dropped": dropped,
                                   "loads": loads, "ffns": tokens})
        if s == 1:  # violations: unknown name, malformed payload, missing category, misplaced mark
            d.mark(message="moe.bogus", payload=1)
            d.mark(message="moe.request", payload=1.5)
            d.push_range(message="moe.layer")
            d.pop_range()
            d.mark(message="moe.expert.tokens", category=1, payload=3)  # belongs in a router
        ins.pop()
        step["t0"], step["t1"] = t0, time.monotonic_ns()
        truth.append(step)
    return {"steps": truth}


def run_fork(*, go_file: str) -> dict[str, Any]:
    """fork() after NVTX use: the child gets its own ring (named by its pid) that already knows
    the strings registered before the fork; the child's events never reach the parent's ring."""
    import os

    d = _domain("moe")
    attrs = d.get_event_attributes(message="before.fork", payload=1)  # registered in the parent
    d.push_range(attrs)
    d.pop_range()
    pid = os.fork()
    if pid == 0:
        deadline = time.monotonic() + 60
        while not os.path.exists(go_file) and time.monotonic() < deadline:
            time.sleep(0.01)
        d.push_range(attrs)
        d.mark(message="in.child", payload=2)
        d.pop_range()
        os._exit(0)  # no exit handlers: the agent must notice the death and clean up
    print(f"child {pid}", flush=True)
    _, status = os.waitpid(pid, 0)
    return {"child": pid, "child_status": status}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--mode", choices=("exact", "flood", "nested-flood", "steady", "hostile", "moe", "fork", "ext"),
        required=True,
    )
    parser.add_argument("--log", required=True)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--count", type=int, default=300_000)
    parser.add_argument("--pause", action="store_true", help="flood: stop at half until a stdin line")
    args = parser.parse_args(argv)

    for name in DOMAINS:
        _domain(name)  # first NVTX calls: the ring file exists after this
    print("ready", flush=True)
    stop = threading.Event()
    if args.mode == "steady":
        print("steady", flush=True)

        def wait_stdin() -> None:
            sys.stdin.readline()
            stop.set()

        threading.Thread(target=wait_stdin, daemon=True).start()
        result = run_steady(stop=stop)
    else:
        sys.stdin.readline()
        if args.mode == "exact":
            result = run_exact(threads=args.threads, rounds=args.rounds)
        elif args.mode == "nested-flood":
            result = run_nested_flood(threads=args.threads, count=args.count)
        elif args.mode == "fork":
            result = run_fork(go_file=args.log + ".go")
        elif args.mode == "ext":
            result = run_ext(threads=args.threads, rounds=args.rounds)
        elif args.mode == "moe":
            result = run_moe(steps=args.rounds, layers=3, experts=6)
        elif args.mode == "flood":
            result = run_flood(threads=args.threads, count=args.count, pause=args.pause)
        else:
            result = run_hostile(count=args.count)
    with open(args.log, "w") as f:
        json.dump(result, f)
    print("done", flush=True)
    if args.mode == "hostile":
        sys.stdin.readline()  # stay alive so the agent can see the exited thread first
    return 0


if __name__ == "__main__":
    sys.exit(main())
