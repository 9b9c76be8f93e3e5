"""CPU cost of the agent's hot path, offline: NVTX parse -> pipeline join -> spans -> export.

No kernel, no runtime: the inputs are the real input types (``moescope.collectors.moe_convention.StepEvent``
trees, ``moescope.probes.ingress.loader.IngressRecord``s and, for the parser, ``moescope.collectors.nvtx.NvtxBatch``
arrays) built for a decode workload like the reference runtime's: 4 MoE layers, 16 experts, top-2,
batches of 6 requests, 8 decode steps per request. They go through ``moescope.agent.pipeline.Pipeline`` with
the real trace pipeline (``moescope.agent.export.build_tracing``: bounded batch processor + exporter) and
real metrics. CPU is ``time.process_time`` of the worker process, so the export thread is counted.

Variants (each run is a fresh worker process):

* ``file`` — OTLP-JSON files into a temp dir (the embedded default);
* ``grpc`` — OTLP/gRPC to ``tests/otlp_receiver.py``'s receiver in a separate process;
* ``http`` — OTLP/HTTP (protobuf) to that module's HTTP receiver, in a separate process too;
* ``parse`` — NvtxBatch arrays through ``MoeConventionParser`` only (CPU per step).

Before/after: ``--baseline-tree DIR`` runs the same workload against another checkout of the code
(e.g. ``git archive HEAD | tar -x -C /tmp/base``), alternating A (baseline) and B (this tree), and
reports medians and ratios. Without it, only this tree is measured.

    .venv/bin/python benchmarks/agent_cpu.py --runs 5
    .venv/bin/python benchmarks/agent_cpu.py --baseline-tree /tmp/base --runs 5

Output: bench-results/agent_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

NUM_LAYERS = 4
NUM_EXPERTS = 16
TOP_K = 2
BATCH_REQUESTS = 6
DECODE_STEPS = 8
PID = 4242
TID = 4243
US = 1_000
MS = 1_000_000
# The reference runtime under the load generator (py-spy evidence): the rates the estimate uses.
REFERENCE_REQUESTS_PER_S = 34.0
REFERENCE_STEPS_PER_S = 20.0
REFERENCE_SPANS_PER_S = 900.0

_RECEIVER_SCRIPT = """
import sys, time
sys.path.insert(0, {tree!r})
from tests.otlp_receiver import {kind}OtlpReceiver
rx = {kind}OtlpReceiver().start()
print(rx.endpoint, flush=True)
try:
    sys.stdin.read()  # until the parent closes our stdin
finally:
    rx.stop()
"""


# ---------------------------------------------------------------------------------------- workload
def build_workload(*, batches: int, seed: int, t0_ns: int) -> list[tuple[list[Any], list[Any]]]:
    """Per batch: its steps (in end order) and its requests' kernel records (in completion order)."""
    import random

    from moescope.collectors.moe_convention import ExpertFfnEvent, ExpertLoadEvent, LayerEvent, RouterEvent, StepEvent
    from moescope.probes.ingress.loader import IngressRecord

    rng = random.Random(seed)
    out = []
    t = t0_ns
    for b in range(batches):
        keys = [100 + i for i in range(BATCH_REQUESTS)]
        steps = []
        step_t = t + 1 * MS
        for s in range(DECODE_STEPS):
            start, end = step_t, step_t + 2_500 * US
            step = StepEvent(pid=PID, tid=TID, start_ns=start, end_ns=end, tokens=BATCH_REQUESTS, requests=list(keys))
            layer_span = (end - start) // NUM_LAYERS
            for layer_index in range(NUM_LAYERS):
                l0 = start + layer_index * layer_span + 10 * US
                tokens: dict[int, int] = {}
                for _ in range(BATCH_REQUESTS):
                    for expert in rng.sample(range(NUM_EXPERTS), TOP_K):
                        tokens[expert] = tokens.get(expert, 0) + 1
                dropped = {e: c - 2 for e, c in tokens.items() if c > 2}  # capacity 2 per expert
                router = RouterEvent(layer=layer_index, start_ns=l0 + 5 * US, end_ns=l0 + 40 * US,
                                     entropy_bits=rng.uniform(2.5, 3.9), tokens=tokens, dropped=dropped)
                layer = LayerEvent(layer=layer_index, start_ns=l0, end_ns=l0 + layer_span - 20 * US,
                                   router=router, num_experts=NUM_EXPERTS)
                ft = l0 + 50 * US
                if (b + s + layer_index) % 16 == 0:  # an expert load now and then (offloaded expert)
                    expert = max(tokens, key=tokens.__getitem__)
                    layer.loads.append(
                        ExpertLoadEvent(expert=expert, start_ns=ft, end_ns=ft + 200 * US, bytes_moved=24 << 20)
                    )
                    ft += 210 * US
                for expert in sorted(tokens):
                    layer.ffns.append(ExpertFfnEvent(expert=expert, start_ns=ft, end_ns=ft + 20 * US,
                                                     tokens=tokens[expert] - dropped.get(expert, 0)))
                    ft += 25 * US
                step.layers.append(layer)
            steps.append(step)
            step_t = end + 500 * US
        records = []
        for i, key in enumerate(keys):
            start = t + i * 50 * US
            end = step_t + i * 100 * US
            records.append(IngressRecord(
                tgid=PID, tid=TID + 1, fd=key, generation=b, seq=b * BATCH_REQUESTS + i, family=2,
                peer_addr="127.0.0.1", peer_port=40000 + i, start_ns=start, first_response_ns=end - 200 * US,
                end_ns=end, bytes_in=180, bytes_out=900, flags=0,
            ))
        out.append((steps, records))
        t = step_t + 2 * MS
    return out


def nvtx_batches(steps: list[Any]) -> tuple[list[Any], int]:
    """The NVTX records the runtime would emit for ``steps``: one NvtxBatch per step; and the string table."""
    import numpy as np

    from moescope.collectors import moe_convention as mc
    from moescope.collectors.nvtx import (
        MARK_DTYPE,
        PAYLOAD_DOUBLE,
        PAYLOAD_I64,
        PAYLOAD_NONE,
        RANGE_DTYPE,
        NvtxBatch,
        StringTable,
    )

    strings = StringTable()
    strings.domains[1] = mc.DOMAIN
    ids = {name: i + 1 for i, name in enumerate(sorted(mc.RANGE_NAMES | mc.MARK_NAMES))}
    for name, sid in ids.items():
        strings.add_string(sid, name)
    uid = 1
    batches = []
    for step in steps:
        ranges: list[tuple[Any, ...]] = []
        marks: list[tuple[Any, ...]] = []

        def rng_row(
            name: str, parent: int, start: int, end: int, payload: int, ptype: int, category: int, depth: int
        ) -> int:
            nonlocal uid
            uid += 1
            ranges.append((uid, parent, start, end, payload, 0, step.tid, 1, ids[name], category, 0, depth, 1, ptype))
            return uid

        def mark_row(name: str, parent: int, ts: int, payload: int, category: int) -> None:
            marks.append((parent, ts, payload, step.tid, 1, ids[name], category, 0, PAYLOAD_I64))

        step_uid = rng_row(mc.STEP, 0, step.start_ns, step.end_ns, step.tokens, PAYLOAD_I64, 0, 0)
        for key in step.requests:
            mark_row(mc.REQUEST, step_uid, step.start_ns + 1, key, 0)
        for layer in step.layers:
            layer_uid = rng_row(mc.LAYER, step_uid, layer.start_ns, layer.end_ns, layer.num_experts or 0,
                                PAYLOAD_I64 if layer.num_experts else PAYLOAD_NONE, layer.layer + 1, 1)
            r = layer.router
            bits = int(np.float64(r.entropy_bits).view(np.uint64))
            router_uid = rng_row(mc.ROUTER, layer_uid, r.start_ns, r.end_ns, bits, PAYLOAD_DOUBLE, layer.layer + 1, 2)
            for expert, count in r.tokens.items():
                mark_row(mc.EXPERT_TOKENS, router_uid, r.start_ns + 1, count, expert + 1)
            for expert, count in r.dropped.items():
                mark_row(mc.EXPERT_DROPPED, router_uid, r.start_ns + 1, count, expert + 1)
            for load in layer.loads:
                rng_row(
                    mc.EXPERT_LOAD,
                    layer_uid,
                    load.start_ns,
                    load.end_ns,
                    load.bytes_moved,
                    PAYLOAD_I64,
                    load.expert + 1,
                    2,
                )
            for ffn in layer.ffns:
                rng_row(mc.EXPERT_FFN, layer_uid, ffn.start_ns, ffn.end_ns, ffn.tokens, PAYLOAD_I64, ffn.expert + 1, 2)
        ranges.sort(key=lambda row: row[3])  # completion order, as the collector pairs them
        batches.append(NvtxBatch(pid=step.pid, ranges=np.array(ranges, dtype=RANGE_DTYPE),
                                 marks=np.array(marks, dtype=MARK_DTYPE), strings=strings))
    return batches, len(steps)


# ------------------------------------------------------------------------------------------ worker
def worker(variant: str, *, batches: int, endpoint: str | None) -> dict[str, float]:
    """One measured run in this process (a fresh interpreter per run)."""
    from moescope.agent.export import build_tracing
    from moescope.agent.export.config import ExportConfig, OtlpTarget
    from moescope.agent.metrics import Metrics
    from moescope.agent.pipeline import Pipeline

    t0 = time.monotonic_ns() + 60 * 1_000 * MS  # unsigned NVTX clock; retention never expires them mid-run
    workload = build_workload(batches=batches, seed=7, t0_ns=t0)
    if variant == "parse":
        from moescope.collectors.moe_convention import MoeConventionParser

        all_steps = [s for steps, _ in workload for s in steps]
        nv, n_steps = nvtx_batches(all_steps)
        parsed: list[Any] = []
        parser = MoeConventionParser(sink=parsed.extend)
        parser(nv[0])  # warm-up (imports, first-call caches)
        parsed.clear()
        cpu0 = time.process_time()
        for batch in nv:
            parser(batch)
        cpu_s = time.process_time() - cpu0
        if len(parsed) != n_steps or [(s.start_ns, len(s.layers)) for s in parsed] != [
            (s.start_ns, len(s.layers)) for s in all_steps
        ]:
            raise SystemExit(f"parser produced {len(parsed)} steps, expected {n_steps}")
        return {"cpu_us_per_step": cpu_s * 1e6 / n_steps, "steps": float(n_steps)}

    with tempfile.TemporaryDirectory(prefix="moescope-bench-") as tmp:
        common: dict[str, Any] = dict(
            queue_spans=65_536, batch_spans=512, schedule_delay_ms=500, shutdown_timeout_ms=30_000,
            traces_dir=Path(tmp), file_max_bytes=64 << 20, files_keep=8,
        )
        fields = set(ExportConfig.__dataclass_fields__)
        if variant in ("grpc", "http"):
            assert endpoint is not None
            otlp_fields = set(OtlpTarget.__dataclass_fields__)
            # Any: filtered by the fields of the tree under test (a baseline checkout may lack some).
            target_args: dict[str, Any] = dict(
                protocol="grpc" if variant == "grpc" else "http/protobuf", endpoint=endpoint, insecure=True,
                headers=(), timeout_ms=10_000
            )
            otlp = OtlpTarget(**{k: v for k, v in target_args.items() if k in otlp_fields})
        else:
            otlp = None
        config = ExportConfig(**{k: v for k, v in (common | {"otlp": otlp}).items() if k in fields})
        metrics = Metrics()
        tracing = build_tracing(
            config, resource_attributes={"service.name": "bench", "process.pid": PID}, metrics=metrics
        )
        pipeline = Pipeline(spans=tracing.factory, metrics=metrics, num_experts=NUM_EXPERTS)
        # warm-up batch: first-call costs (imports, gRPC channel) are not the steady state
        warm = build_workload(batches=1, seed=1, t0_ns=t0 - 30 * 1_000 * MS)
        for steps, records in warm:
            for step in steps:
                pipeline.on_steps([step])
            for record in records:
                pipeline.on_request(record)
        tracing.force_flush(60.0)
        before = tracing.stats().exported
        n_requests = 0
        cpu0 = time.process_time()
        for steps, records in workload:
            for step in steps:
                pipeline.on_steps([step])
            for record in records:
                pipeline.on_request(record)
                n_requests += 1
        pipeline.expire(flush=True)
        if not tracing.force_flush(120.0):
            raise SystemExit("export did not flush")
        cpu_s = time.process_time() - cpu0
        stats = tracing.stats()
        spans = stats.exported - before
        tracing.shutdown(30.0)
        if stats.failed or stats.dropped or spans <= 0:
            raise SystemExit(f"export lost spans: {stats}")
        return {
            "cpu_us_per_request": cpu_s * 1e6 / n_requests,
            "cpu_us_per_span": cpu_s * 1e6 / spans,
            "spans_per_request": spans / n_requests,
            "requests": float(n_requests),
        }


# ------------------------------------------------------------------------------------------ driver
class Receiver:
    """tests/otlp_receiver.py's gRPC (or HTTP: ``kind="Http"``) receiver in its own process (its CPU
    is not the agent's); ``endpoint`` as the exporter takes it."""

    def __init__(self, tree: Path, *, kind: str = "Grpc") -> None:
        self.proc = subprocess.Popen(
            [PYTHON, "-c", _RECEIVER_SCRIPT.format(tree=str(tree), kind=kind)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, cwd=tree, start_new_session=True,
        )
        assert self.proc.stdout is not None
        self.endpoint = self.proc.stdout.readline().strip()
        if not self.endpoint:
            self.close()
            raise SystemExit("OTLP receiver did not start")

    def close(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()


def run_worker(tree: Path, variant: str, *, batches: int, endpoint: str | None) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    argv = [str(Path(__file__).resolve()), "--worker", variant, "--batches", str(batches)]
    if endpoint:
        argv += ["--endpoint", endpoint]
    # moescope's code from `tree` itself: the editable install maps moescope.* onto this checkout
    cmd = [PYTHON, "-c", f"import runpy, sys; sys.path.insert(0, {str(REPO)!r}); "
           f"from pathlib import Path; from benchmarks.step_path import pin_tree; pin_tree(Path({str(tree)!r})); "
           f"sys.argv = {argv!r}; runpy.run_path(sys.argv[0], run_name='__main__')"]
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"worker {variant} in {tree} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per side and variant (A/B alternating)")
    parser.add_argument("--batches", type=int, default=40, help="batches of 6 requests per run")
    parser.add_argument("--variants", default="file,grpc,parse", help="of file, grpc, http, parse")
    parser.add_argument("--baseline-tree", type=Path, default=None, help="another checkout to compare against (A)")
    parser.add_argument("--name", default="agent_cpu", help="bench-results/<name>.json")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, batches=args.batches, endpoint=args.endpoint)))
        return 0
    sys.path.insert(0, str(REPO))
    from benchmarks.common import alternate_ab, write_result

    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - {"file", "grpc", "http", "parse"}
    if unknown:
        print(f"unknown variants: {sorted(unknown)}", file=sys.stderr)
        return 2
    base = args.baseline_tree.resolve() if args.baseline_tree else None
    receiver = Receiver(REPO) if "grpc" in variants else None
    http_receiver = Receiver(REPO, kind="Http") if "http" in variants else None
    results: dict[str, Any] = {}
    try:
        for variant in variants:
            serving = {"grpc": receiver, "http": http_receiver}.get(variant)
            endpoint = serving.endpoint if serving is not None else None

            def run_b(variant: str = variant, endpoint: str | None = endpoint) -> dict[str, float]:
                return run_worker(REPO, variant, batches=args.batches, endpoint=endpoint)

            if base is not None:
                def run_a(variant: str = variant, endpoint: str | None = endpoint) -> dict[str, float]:
                    return run_worker(base, variant, batches=args.batches, endpoint=endpoint)

                def progress(line: str, variant: str = variant) -> None:
                    print(f"{variant}: {line}", flush=True)

                ab = alternate_ab(run_a=run_a, run_b=run_b, pairs=args.runs, progress=progress)
                results[variant] = ab.to_dict()
            else:
                runs = []
                for i in range(args.runs):
                    runs.append(run_b())
                    print(f"{variant}: run {i + 1}/{args.runs}: {runs[-1]}", flush=True)
                results[variant] = {
                    "runs": runs,
                    "medians": {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in runs[0]},
                }
    finally:
        for each in (receiver, http_receiver):
            if each is not None:
                each.close()

    def side_medians(side: str | None) -> dict[str, dict[str, float]]:
        return {
            v: (r["medians"] if side is None else {k: m[side] for k, m in r["medians"].items()})
            for v, r in results.items()
        }

    def core_percent(medians: dict[str, dict[str, float]]) -> float:
        # this path's CPU at the reference rates: spans built + exported to files, steps parsed
        return (medians["file"]["cpu_us_per_span"] * REFERENCE_SPANS_PER_S
                + medians["parse"]["cpu_us_per_step"] * REFERENCE_STEPS_PER_S) / 1e4

    medians = side_medians("b" if base is not None else None)
    estimate: dict[str, float] = {}
    if "file" in medians and "parse" in medians:
        estimate = {
            "reference_spans_per_s": REFERENCE_SPANS_PER_S,
            "reference_steps_per_s": REFERENCE_STEPS_PER_S,
            "core_percent_file_export": core_percent(medians),
        }
        if base is not None:
            estimate["core_percent_file_export_baseline"] = core_percent(side_medians("a"))
    path = write_result(args.name, {
        "workload": {"layers": NUM_LAYERS, "experts": NUM_EXPERTS, "top_k": TOP_K, "batch_requests": BATCH_REQUESTS,
                     "decode_steps": DECODE_STEPS, "batches_per_run": args.batches},
        "baseline_tree": str(base) if base else None,
        "results": results,
        "estimate_at_reference_load": estimate,
    })
    for variant, m in medians.items():
        print(f"{variant}: " + ", ".join(f"{k} {v:.1f}" for k, v in m.items()))
    if base is not None:
        for variant, r in results.items():
            print(f"{variant} ratio B/A: " + ", ".join(f"{k} {v:.3f}" for k, v in r["ratio"].items()))
    if estimate:
        baseline = estimate.get("core_percent_file_export_baseline")
        print(
            "estimate at reference load (span + parse path only): "
            f"{estimate['core_percent_file_export']:.1f} % of one core"
            + (f" (baseline {baseline:.1f} %)" if baseline is not None else "")
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
