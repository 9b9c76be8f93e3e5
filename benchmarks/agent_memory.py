"""Where the agent's resident memory goes at MoE scale (issue #15's RSS bar): RSS by start-up phase
and over the stepping window, per-mapping totals from /proc/PID/smaps, and optionally the largest
Python allocation sites (tracemalloc) and glibc's malloc_info, taken inside the agent.

Producers are benchmarks/moe_scale.py's (same shapes, conventions, pacing and ring directory on
/dev/shm); the agent is `agent start --pid ... --no-policy`, run through a small wrapper that can
turn tracemalloc on and, on SIGUSR1, writes the top allocation sites and malloc_info to files.

    sudo .venv/bin/python -m benchmarks.agent_memory --shape deepseek-v3 --convention v2-compact \
        --vectors held --producers 8 --steps-per-s 25 --duration-s 15 [--tracemalloc] [--json-out FILE]

Reported (JSON, and one summary line): VmHWM/VmRSS/RssAnon/RssFile/RssShmem sampled every 100 ms
with the agent's stderr phase lines (probe loaded, rings attached) marked; the largest smaps
mappings at the end of the window; Pss beside Rss, since a producer's ring pages are shared with
the producer and Rss counts each of them whole in both processes. Exit status: 0, 2 bad options,
3 not root, 4 a run could not be carried out. Numbers, not bars: the bar is read off moe_scale.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, RESULTS_DIR
from benchmarks.moe_scale import (
    CONVENTIONS,
    SHAPES,
    START_TIMEOUT_S,
    BenchError,
    Config,
    cpu_s,
    nvtx_env_from_agent,
    parse_json_line,
    producer_argv,
    stop,
)
from moescope.collectors.nvtx import INJECTION_ENV, RING_DIR_ENV
from moescope.examples.moe_runtime.launch import LaunchError, LineReader

SAMPLE_PERIOD_S = 0.1
DUMP_WAIT_ROUNDS = 240  # x 0.5 s: a tracemalloc snapshot of a busy agent takes seconds
STATUS_KEYS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem", "Threads")
# Runs the agent's CLI; with MOESCOPE_MEM_TRACEMALLOC=N keeps N frames per allocation. SIGUSR1
# writes the top sites (tracemalloc) and glibc's malloc_info to MOESCOPE_MEM_DUMP_DIR.
WRAPPER = r"""
import ctypes, os, runpy, signal, sys, tracemalloc
frames = int(os.environ.get("MOESCOPE_MEM_TRACEMALLOC", "0"))
dump_dir = os.environ["MOESCOPE_MEM_DUMP_DIR"]
if frames:
    tracemalloc.start(frames)
count = [0]
def dump(_signum, _frame):
    count[0] += 1
    base = os.path.join(dump_dir, f"dump{count[0]}")
    if tracemalloc.is_tracing():
        snapshot = tracemalloc.take_snapshot()
        snapshot.dump(base + ".tracemalloc.snapshot")  # the whole of it, to group offline (Snapshot.load)
        with open(base + ".tracemalloc.txt", "w") as out:
            current, peak = tracemalloc.get_traced_memory()
            out.write(f"traced current {current} peak {peak}\n")
            for stat in snapshot.statistics("traceback")[:40]:
                out.write(f"{stat.size} bytes in {stat.count} blocks\n")
                for line in stat.traceback.format()[-2 * frames:]:
                    out.write(f"    {line}\n")
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_info"):
        libc.fopen.restype = ctypes.c_void_p
        stream = libc.fopen((base + ".malloc_info.xml").encode(), b"w")
        libc.malloc_info(0, ctypes.c_void_p(stream))
        libc.fclose(ctypes.c_void_p(stream))
    census(base + ".arrays.txt")
    if hasattr(libc, "mallinfo2"):
        class MallInfo2(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                "keepcost")]
        libc.mallinfo2.restype = MallInfo2
        info = libc.mallinfo2()
        with open(base + ".mallinfo2.txt", "w") as out:
            for name, _ in MallInfo2._fields_:
                out.write(f"{name} {getattr(info, name)}\n")
    open(base + ".done", "w").close()
def census(path):
    # numpy arrays reachable from GC-tracked containers, by the type of the holder and the array's
    # shape: who keeps the memory (arrays are not GC-tracked themselves)
    import gc, collections
    try:
        import numpy as np
    except ImportError:
        return
    seen = {}
    holders = collections.Counter()
    shapes = collections.Counter()
    by_type = collections.Counter()
    counted = set()
    for obj in gc.get_objects():
        by_type[type(obj).__qualname__] += sys.getsizeof(obj)
        for ref in gc.get_referents(obj):
            if isinstance(ref, (bytes, str, bytearray)) and id(ref) not in counted:
                counted.add(id(ref))
                by_type[type(ref).__qualname__] += sys.getsizeof(ref)
            if isinstance(ref, np.ndarray):
                owner = ref
                while isinstance(owner.base, np.ndarray):
                    owner = owner.base
                if id(owner) in seen or owner.base is not None:
                    continue
                seen[id(owner)] = owner
                holders[type(obj).__qualname__] += owner.nbytes
                shapes[(owner.shape[1:] if owner.ndim > 1 else (), str(owner.dtype))] += owner.nbytes
    with open(path, "w") as out:
        out.write(f"arrays {len(seen)} bytes {sum(a.nbytes for a in seen.values())}\n")
        for name, size in holders.most_common(15):
            out.write(f"holder {name}: {size}\n")
        for key, size in shapes.most_common(15):
            out.write(f"shape {key}: {size}\n")
        for name, size in by_type.most_common(20):
            out.write(f"object {name}: {size}\n")
signal.signal(signal.SIGUSR1, dump)
retention_s = float(os.environ.get("MOESCOPE_MEM_STEP_RETENTION_S", "0"))
if retention_s:  # what-if: the join keeping steps this long instead of its default
    from moescope.agent.pipeline import Pipeline
    Pipeline.__init__.__kwdefaults__["step_retention_ns"] = int(retention_s * 1e9)
if os.environ.get("MOESCOPE_MEM_ALLOCATOR") == "glibc-defaults":
    # the arm before the malloc tuning: only the arena cap, a trim once a minute, none at start-up
    from moescope.agent import allocator
    def arenas_only(self):
        return self._libc is not None and self._libc.mallopt(allocator.M_ARENA_MAX, allocator.ARENAS) == 1
    allocator.Allocator.configure = arenas_only
    allocator.Allocator.trim_now = lambda self: None
    allocator.Allocator.__init__.__kwdefaults__["trim_period_ns"] = 60_000_000_000
sys.argv = ["moescope.agent", *sys.argv[1:]]
runpy.run_module("moescope.agent", run_name="__main__", alter_sys=True)
"""
PHASE_LINES = {
    "tracing ": "probe loaded and targets added",
    "nvtx: attached to the ring": "an NVTX ring attached",
}


def status(pid: int) -> dict[str, int]:
    values: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in STATUS_KEYS:
            values[name] = int(value.split()[0])  # kB, Threads a count
    return values


def smaps_summary(pid: int, *, top: int = 12) -> dict[str, Any]:
    """Rss, Pss and Anonymous (kB) summed per mapping name; a ring file under /dev/shm is `[ring]`."""
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    current: list[int] | None = None
    header = re.compile(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \d+\s*(.*)$")
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if (m := header.match(line)) is not None:
            name = m.group(1) or "[anon]"
            if name.startswith("/dev/shm/"):
                name = "[ring]"
            elif name.startswith("/"):
                name = name.rsplit("/", 1)[1]
            current = sums[name]
            continue
        field, _, rest = line.partition(":")
        if current is not None and field in ("Rss", "Pss", "Anonymous"):
            current[("Rss", "Pss", "Anonymous").index(field)] += int(rest.split()[0])
    ordered = sorted(sums.items(), key=lambda kv: -kv[1][0])
    return {
        "total_kb": {k: sum(v[i] for v in sums.values()) for i, k in enumerate(("rss", "pss", "anon"))},
        "top": [{"mapping": name, "rss_kb": v[0], "pss_kb": v[1], "anon_kb": v[2]} for name, v in ordered[:top]],
    }


class Sampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.t0 = time.monotonic()
        self.samples: list[dict[str, float]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(SAMPLE_PERIOD_S):
            try:
                self.samples.append({"t_s": round(time.monotonic() - self.t0, 2), **status(self.pid)})
            except OSError:
                return


def run_once(config: Config, *, duration_s: float, tracemalloc_frames: int, step_retention_s: float,
             allocator: str, workdir: Path, nvtx_env: dict[str, str],
             snapshot_to: Path | None = None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != INJECTION_ENV}
    env[RING_DIR_ENV] = str(workdir / "rings")
    env.update(nvtx_env)
    dump_dir = workdir / "dumps"
    dump_dir.mkdir(exist_ok=True)
    producers: list[tuple[subprocess.Popen[str], LineReader]] = []
    agent: subprocess.Popen[str] | None = None
    try:
        for rank in range(config.producers):
            proc = subprocess.Popen(producer_argv(config, rank=rank, duration_s=duration_s, c_exe=None), env=env,
                                    cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True, start_new_session=True)
            assert proc.stdout is not None
            producers.append((proc, LineReader(proc.stdout, keep_lines=None)))
        for proc, out in producers:
            parse_json_line(out.next_line(timeout_s=START_TIMEOUT_S), f"producer {proc.pid}")
        agent_env = dict(os.environ, MOESCOPE_MEM_TRACEMALLOC=str(tracemalloc_frames),
                         MOESCOPE_MEM_DUMP_DIR=str(dump_dir),
                         MOESCOPE_MEM_STEP_RETENTION_S=str(step_retention_s), MOESCOPE_MEM_ALLOCATOR=allocator)
        agent = subprocess.Popen(
            [sys.executable, "-c", WRAPPER, "start", *[a for p, _ in producers for a in ("--pid", str(p.pid))],
             "--no-policy", "--metrics-port", "0", "--state-dir", str(workdir / "state")],
            cwd=REPO, env=agent_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        assert agent.stdout is not None and agent.stderr is not None
        sampler = Sampler(agent.pid)
        sampler.start()
        err = LineReader(agent.stderr, keep_lines=None)
        LineReader(agent.stdout, keep_lines=None)
        phases: list[dict[str, Any]] = []
        waiting = {p.pid for p, _ in producers}
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while waiting:
                line = err.next_line(timeout_s=max(0.1, deadline - time.monotonic()))
                if line is None:
                    raise LaunchError("agent stderr closed")
                for marker, what in PHASE_LINES.items():
                    if marker in line:
                        phases.append({"t_s": round(time.monotonic() - sampler.t0, 2), "phase": what,
                                       **status(agent.pid)})
                if "nvtx: attached to the ring of pid " in line:
                    waiting.discard(int(line.rsplit(" ", 1)[1]))
        except (LaunchError, TimeoutError) as exc:
            raise BenchError(f"agent did not attach to every ring (missing {sorted(waiting)}): {exc}") from None
        err.drain()
        attached = {"t_s": round(time.monotonic() - sampler.t0, 2), **status(agent.pid)}
        cpu0_s, wall0_s = cpu_s(agent.pid), time.monotonic()
        for proc, _ in producers:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for proc, out in producers:
            parse_json_line(out.next_line(timeout_s=duration_s + START_TIMEOUT_S), f"producer {proc.pid} result")
        end = {"t_s": round(time.monotonic() - sampler.t0, 2), **status(agent.pid),
               "agent_cpu_pct": round(100.0 * (cpu_s(agent.pid) - cpu0_s) / (time.monotonic() - wall0_s), 1)}
        mappings = smaps_summary(agent.pid)
        os.kill(agent.pid, signal.SIGUSR1)
        for _ in range(DUMP_WAIT_ROUNDS):  # the dump runs between bytecodes of the agent's main thread
            if (dump_dir / "dump1.done").exists():
                break
            time.sleep(0.5)
        sampler.done.set()
        dumps = {p.name: p.read_text() for p in sorted(dump_dir.iterdir()) if p.suffix not in (".done", ".snapshot")}
        if snapshot_to is not None and (dump_dir / "dump1.tracemalloc.snapshot").exists():
            shutil.copyfile(dump_dir / "dump1.tracemalloc.snapshot", snapshot_to)
        return {"attached": attached, "end": end, "phases": phases, "smaps": mappings,
                "samples": sampler.samples, "dumps": dumps}
    finally:
        if agent is not None:
            stop(agent, sig=signal.SIGINT)
        for proc, _ in producers:
            stop(proc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agent_memory", description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="deepseek-v3")
    parser.add_argument("--convention", choices=CONVENTIONS, default="v2-compact")
    parser.add_argument("--vectors", choices=("set", "held"), default="held",
                        help="the Python producers' vectors: a numpy payload set per event, or held in a buffer "
                             "bound once (moe_scale's --vectors; held: the form of the bar's run)")
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument("--steps-per-s", type=float, default=25.0)
    parser.add_argument("--duration-s", type=float, default=15.0)
    parser.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES",
                        help="trace Python allocations with FRAMES frames each (slows the agent); the whole "
                             "snapshot is kept beside --json-out as .tracemalloc (tracemalloc.Snapshot.load)")
    parser.add_argument("--step-retention-s", type=float, default=0.0, metavar="S",
                        help="what-if: the join retires unclaimed steps after S s (default: its own retention)")
    parser.add_argument("--allocator", choices=("agent", "glibc-defaults"), default="agent",
                        help="agent: the agent's malloc tuning (agent/allocator.py); glibc-defaults: without it "
                             "(arena cap only), the arm to compare against")
    parser.add_argument("--json-out", default=str(RESULTS_DIR / "agent_memory.json"))
    args = parser.parse_args(argv)
    if args.producers < 1 or not args.duration_s > 0 or not args.steps_per_s > 0 or args.tracemalloc < 0:
        print("agent_memory: --producers >= 1, --duration-s and --steps-per-s > 0, --tracemalloc >= 0",
              file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("agent_memory: needs root (the agent attaches eBPF probes): run it with sudo", file=sys.stderr)
        return 3
    config = Config(args.shape, args.convention, "python", args.producers, args.steps_per_s, args.vectors)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="moescope-agent-memory-") as tmp, \
            tempfile.TemporaryDirectory(prefix="moescope-agent-memory-rings-", dir=shm) as rings:
        workdir = Path(tmp)
        (workdir / "rings").symlink_to(rings)
        try:
            result = run_once(config, duration_s=args.duration_s, tracemalloc_frames=args.tracemalloc,
                              step_retention_s=args.step_retention_s, allocator=args.allocator,
                              workdir=workdir, nvtx_env=nvtx_env_from_agent(),
                              snapshot_to=Path(args.json_out).with_suffix(".tracemalloc") if args.tracemalloc else None)
        except (BenchError, LaunchError, TimeoutError, OSError) as exc:
            print(f"agent_memory: {exc}", file=sys.stderr)
            return 4
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "agent_memory", "config": config.label,
                               "duration_s": args.duration_s, **result}, indent=2) + "\n")
    a, e = result["attached"], result["end"]
    total = result["smaps"]["total_kb"]
    print(f"agent_memory: {config.label}: attached RSS {a['VmRSS'] / 1e3:.0f} MB (anon {a['RssAnon'] / 1e3:.0f}, "
          f"shmem {a['RssShmem'] / 1e3:.0f}); end of {args.duration_s:g} s: RSS {e['VmRSS'] / 1e3:.0f} MB "
          f"(anon {e['RssAnon'] / 1e3:.0f}, file {e['RssFile'] / 1e3:.0f}, shmem {e['RssShmem'] / 1e3:.0f}), "
          f"Pss {total['pss'] / 1e3:.0f} MB, peak {e['VmHWM'] / 1e3:.0f} MB (less the rings "
          f"{(e['VmHWM'] - e['RssShmem']) / 1e3:.0f}); "
          f"agent {e['agent_cpu_pct']:.0f} % of a core -> {out}")
    for row in result["smaps"]["top"][:6]:
        print(f"  {row['mapping']}: rss {row['rss_kb'] / 1e3:.1f} MB, pss {row['pss_kb'] / 1e3:.1f}, "
              f"anon {row['anon_kb'] / 1e3:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
