"""CPU per step of the agent's NVTX -> step -> outputs path at real MoE shapes, offline and A/B.

The input is real: `record` runs benchmarks/moe_scale_producer.py (the outside producer of
benchmarks/moe_scale.py, through the PyPI `nvtx` package and the injection library) at a model
shape and drains its ring with the agent's own collector into NvtxBatch arrays, saved once. Each
measured run is a fresh interpreter that replays those batches through MoeConventionParser and a
Pipeline with its real outputs (windows, Prometheus metrics, traces through the bounded processor
into OTLP-JSON files), timestamps shifted to "now" so retention and windows behave as live.

Variants:
  parse     the parser alone (CPU per step)
  nospans   parser + pipeline with no trace output (join, windows, metrics), the two parts' CPU apart
  unjoined  parser + pipeline, no requests: every step retires as its own trace (moe_scale's case)
  joined    parser + pipeline + one kernel request per `moe.request` mark, claiming its step

A/B: `--baseline-tree DIR` (e.g. `git archive HEAD | tar -x -C /tmp/base`) replays the same batches
with another checkout's code, alternating A (baseline) and B (this tree, or `--tree DIR`: e.g. a copy
with a candidate patch), medians and ratios.

    sudo .venv/bin/python -m benchmarks.step_path --shape deepseek-v3 --convention v2
    sudo .venv/bin/python -m benchmarks.step_path --baseline-tree /tmp/base --runs 5

Writes bench-results/step_path.json. CPU is time.process_time of the run (the export thread counts).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
PRODUCER = REPO / "benchmarks" / "moe_scale_producer.py"
SHAPES = {"reference": (4, 16, 2), "qwen3-30b-a3b": (48, 128, 8), "deepseek-v3": (58, 256, 8)}
CONVENTIONS = ("v1", "v2", "v2-step", "v2-compact")
VARIANTS = ("parse", "nospans", "unjoined", "joined")
NAMESPACED = ("agent", "collectors", "probes", "examples")
REQUEST_HALF_WINDOW_NS = 20_000_000  # a request spans its step's mark +-20 ms (steps are ~1 ms apart here)


# ------------------------------------------------------------------------------------- recording
DEFAULT_DRAIN_S = 0.005  # the recorder's poll period: small batches (a few steps each)

def record(*, shape: str, convention: str, steps: int, steps_per_s: float, out: Path,
           vectors: str = "set", drain_s: float = DEFAULT_DRAIN_S) -> dict[str, Any]:
    """Run one producer under the injection library and save its drained batches, the ring drained
    every ``drain_s`` (the live agent's quiet rounds are 2 s apart: ~100 reference steps a batch)."""
    from moescope.collectors.nvtx import NvtxCollector, injection_env

    layers, experts, top_k = SHAPES[shape]
    with tempfile.TemporaryDirectory(prefix="moescope-steppath-") as ring_dir:
        env = {k: v for k, v in os.environ.items() if k != "NVTX_INJECTION64_PATH"}
        env.update(injection_env())
        env["MOESCOPE_NVTX_DIR"] = ring_dir
        argv = [PYTHON, str(PRODUCER), "--layers", str(layers), "--experts", str(experts), "--top-k", str(top_k),
                "--convention", convention, "--steps-per-s", str(steps_per_s), "--duration-s", str(steps / steps_per_s),
                "--vectors", vectors]
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            ready = json.loads(proc.stdout.readline())
            batches: list[Any] = []
            collector = NvtxCollector(int(ready["pid"]), sink=batches.append, directory=Path(ring_dir))
            lines: list[str] = []
            reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
            proc.stdin.write("go\n")
            proc.stdin.flush()
            reader.start()
            deadline = time.monotonic() + steps / steps_per_s + 120
            while reader.is_alive() and time.monotonic() < deadline:
                collector.poll(time.monotonic_ns())
                time.sleep(drain_s)
            proc.stdin.close()  # the producer exits; the collector drains what is left
            while not collector.finished and time.monotonic() < deadline:
                collector.poll(time.monotonic_ns())
                time.sleep(0.005)
            stats = collector.stats()
            collector.close()
        finally:
            proc.kill()
            proc.wait()
    result = json.loads(lines[0]) if lines and lines[0].strip() else {}
    lost = sum(v for k, v in stats.items() if k.startswith("dropped"))
    if lost:
        raise SystemExit(f"the recording lost records ({lost}): record at a lower --steps-per-s")
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as f:
        pickle.dump({"shape": shape, "convention": convention, "batches": batches}, f)
    return {"steps_emitted": result.get("steps_emitted"), "batches": len(batches),
            "records": int(sum(len(b.ranges) + len(b.marks) for b in batches))}


# ------------------------------------------------------------------------------------- replaying
def pin_tree(tree: Path) -> None:
    """Import `moescope` and its mapped folders from `tree` (the editable install maps them to this
    checkout; a baseline checkout must not be mixed with it)."""
    def package(name: str, folder: Path) -> None:
        spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)

    package("moescope", tree / "moescope")
    for top in NAMESPACED:
        package(f"moescope.{top}", tree / top)


def shifted(batches: list[Any]) -> tuple[list[Any], int]:
    """The batches with every timestamp moved so the first is 1 s ago (live retention and windows)."""
    import numpy as np

    first = min(int(b.ranges["start_ns"].min()) for b in batches if len(b.ranges))
    delta = np.uint64(time.monotonic_ns() - 1_000_000_000 - first)
    for b in batches:
        for column in ("start_ns", "end_ns"):
            b.ranges[column] += delta
        b.marks["ts_ns"] += delta
    return batches, int(delta)


def requests_of(batches: list[Any]) -> list[list[Any]]:
    """Per batch, one kernel request per moe.request mark (key = fd, interval around the mark)."""
    from moescope.probes.ingress.loader import IngressRecord

    out: list[list[Any]] = []
    for b in batches:
        sid = next((i for i, s in b.strings.strings.items() if s == "moe.request"), None)
        rows = b.marks[b.marks["string_id"] == sid] if sid is not None else b.marks[:0]
        out.append([
            IngressRecord(b.pid, b.pid, int(key), 0, 0, 2, "127.0.0.1", 40000, int(ts) - REQUEST_HALF_WINDOW_NS,
                          int(ts), int(ts) + REQUEST_HALF_WINDOW_NS, 100, 100, 0)
            for key, ts in zip(rows["payload"].tolist(), rows["ts_ns"].tolist(), strict=True)
        ])
    return out


def worker(variant: str, recording: Path) -> dict[str, float]:
    with recording.open("rb") as f:
        saved = pickle.load(f)
    batches, _ = shifted(saved["batches"])
    from moescope.agent.export import build_tracing
    from moescope.agent.export.config import ExportConfig
    from moescope.agent.metrics import Metrics
    from moescope.agent.pipeline import Pipeline
    from moescope.collectors.moe_convention import MoeConventionParser

    if variant == "parse":
        parsed: list[Any] = []
        parser = MoeConventionParser(sink=parsed.extend)
        cpu0 = time.process_time()
        for batch in batches:
            parser(batch)
        cpu_s = time.process_time() - cpu0
        return {"cpu_us_per_step": cpu_s * 1e6 / max(1, len(parsed)), "steps": float(len(parsed))}
    if variant == "nospans":
        # the trace export thread is the noisiest part on a shared machine: without it, the
        # parser's and the rest of the pipeline's CPU (this thread only) apart
        bare = Pipeline(spans=None, metrics=Metrics())
        in_pipeline = [0.0]

        def timed_sink(steps: list[Any]) -> None:
            t0 = time.thread_time()
            bare.on_steps(steps)
            in_pipeline[0] += time.thread_time() - t0

        parser = MoeConventionParser(sink=timed_sink)
        cpu0 = time.thread_time()
        for batch in batches:
            parser(batch)
        cpu_s = time.thread_time() - cpu0
        n = max(1, bare.stats()["steps"])
        return {"cpu_us_per_step": cpu_s * 1e6 / n, "parse_us_per_step": (cpu_s - in_pipeline[0]) * 1e6 / n,
                "pipeline_us_per_step": in_pipeline[0] * 1e6 / n, "steps": float(n)}
    requests = requests_of(batches) if variant == "joined" else [[] for _ in batches]
    with tempfile.TemporaryDirectory(prefix="moescope-steppath-") as tmp:
        wanted: dict[str, Any] = dict(queue_spans=1 << 20, batch_spans=512, schedule_delay_ms=500,
                                      shutdown_timeout_ms=60_000, traces_dir=Path(tmp), file_max_bytes=256 << 20,
                                      files_keep=4, otlp=None)
        config = ExportConfig(**{k: v for k, v in wanted.items() if k in ExportConfig.__dataclass_fields__})
        metrics = Metrics()
        tracing = build_tracing(config, resource_attributes={"service.name": "bench"}, metrics=metrics)
        pipeline = Pipeline(spans=tracing.factory, metrics=metrics)
        parser = MoeConventionParser(sink=pipeline.on_steps)
        cpu0 = time.process_time()
        for batch, records in zip(batches, requests, strict=True):
            parser(batch)
            for request in records:
                pipeline.on_request(request)
        pipeline.signals()
        pipeline.panels()
        pipeline.flush_metrics()
        pipeline.shutdown()
        if not tracing.force_flush(300.0):
            raise SystemExit("export did not flush")
        cpu_s = time.process_time() - cpu0
        export = tracing.stats()
        tracing.shutdown(60.0)
        stats = pipeline.stats()
    steps = stats["steps"]
    if export.failed or export.dropped or not steps:
        raise SystemExit(f"the replay lost data: export {export}, steps {steps}")
    out = {"cpu_us_per_step": cpu_s * 1e6 / steps, "steps": float(steps), "spans": float(export.exported)}
    if variant == "joined":
        out["requests_joined"] = float(stats.get("requests_joined", 0))
    return out


def run_worker(tree: Path, variant: str, recording: Path) -> dict[str, float]:
    cmd = [PYTHON, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r}); from benchmarks import step_path as s; "
           f"from pathlib import Path; s.pin_tree(Path({str(tree)!r})); import json; "
           f"print(json.dumps(s.worker({variant!r}, Path({str(recording)!r}))))"]
    out = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"worker {variant} in {tree} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="deepseek-v3")
    parser.add_argument("--convention", choices=CONVENTIONS, default="v2")
    parser.add_argument("--steps", type=int, default=300, help="steps to record (default 300)")
    parser.add_argument("--record-steps-per-s", type=float, default=25.0, help="producer pace while recording")
    parser.add_argument("--record-drain-s", type=float, default=DEFAULT_DRAIN_S,
                        help="the recording's ring drained this often (2: batches as the live agent's quiet rounds)")
    parser.add_argument("--vectors", choices=("set", "held"), default="set",
                        help="the recording producer's vectors (moe_scale_producer.py --vectors)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated of {', '.join(VARIANTS)}")
    parser.add_argument("--runs", type=int, default=3, help="runs per side and variant (A/B alternating)")
    parser.add_argument("--baseline-tree", type=Path, help="another checkout to compare against (A)")
    parser.add_argument("--tree", type=Path, default=REPO,
                        help="the checkout measured as B (default: this one; e.g. one with a candidate patch)")
    parser.add_argument("--recording", type=Path, help="reuse a saved recording (default: record one)")
    parser.add_argument("--name", default="step_path", help="bench-results/<name>.json")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or args.runs < 1 or args.steps < 1 or not args.record_steps_per_s > 0 or not 0 < args.record_drain_s <= 10:
        print(f"step_path: bad options (variants {bad or 'ok'}; runs, steps >= 1; pace > 0; drain in (0, 10] s)",
              file=sys.stderr)
        return 2
    for option, tree in (("--baseline-tree", args.baseline_tree), ("--tree", args.tree)):
        if tree is not None and not (tree / "agent" / "join.py").is_file():
            print(f"step_path: {option} {tree} is not a moescope checkout", file=sys.stderr)
            return 2
    sys.path.insert(0, str(REPO))
    from benchmarks.common import RESULTS_DIR, alternate_ab, write_result

    held = "-held" if args.vectors == "held" else ""
    drained = f"-drain{args.record_drain_s:g}s" if args.record_drain_s != DEFAULT_DRAIN_S else ""
    recording = (args.recording
                 or RESULTS_DIR / f"step_path-{args.shape}-{args.convention}{held}{drained}.pickle").resolve()
    recorded: dict[str, Any] = {}
    if args.recording is None:
        if os.geteuid() != 0:
            print("step_path: recording needs root (the injection library's ring in a shared dir)", file=sys.stderr)
            return 3
        recorded = record(shape=args.shape, convention=args.convention, steps=args.steps,
                          steps_per_s=args.record_steps_per_s, out=recording, vectors=args.vectors,
                          drain_s=args.record_drain_s)
        print(f"recorded {recorded}", file=sys.stderr)
    results: dict[str, Any] = {}
    for variant in variants:
        def run_b(variant: str = variant) -> dict[str, float]:
            return run_worker(args.tree.resolve(), variant, recording)

        if args.baseline_tree is None:
            runs = [run_b() for _ in range(args.runs)]
            cpu = sorted(r["cpu_us_per_step"] for r in runs)
            results[variant] = {"runs": runs, "median_cpu_us_per_step": cpu[len(cpu) // 2]}
        else:
            baseline: Path = args.baseline_tree

            def run_a(variant: str = variant) -> dict[str, float]:
                return run_worker(baseline, variant, recording)

            def progress(line: str, variant: str = variant) -> None:
                print(f"{variant}: {line}", file=sys.stderr)

            ab = alternate_ab(run_a=run_a, run_b=run_b, pairs=args.runs, progress=progress)
            results[variant] = ab.to_dict()
        shown = results[variant].get("medians", results[variant].get("median_cpu_us_per_step"))
        print(f"{variant}: {json.dumps(shown)}", file=sys.stderr)
    path = write_result(args.name, {"shape": args.shape, "convention": args.convention, "recorded": recorded,
                                    "baseline_tree": str(args.baseline_tree) if args.baseline_tree else None,
                                    "tree": str(args.tree),
                                    "variants": results})
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
