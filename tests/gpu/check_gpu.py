"""GPU check, driven by tests/gpu/check_gpu.sh: the real NVML collector on a real NVIDIA GPU, a CUDA
process's per-process memory, and (once examples/moe_runtime exists) the reference runtime on CUDA
under load with expert migration and FP16 fallback through its control socket.

Prints every check as PASS/FAIL/SKIP and a summary; exits 1 if anything failed. Every child
process runs in its own process group and is killed at the end.

    python tests/gpu/check_gpu.py [--device cuda] [--nvml-library PATH] [--seconds 3] [--load-s 20]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from moescope.collectors.nvml import NvmlCollector, NvmlSample, format_sample, is_na, open_nvml  # noqa: E402
from moescope.examples.moe_runtime.launch import LaunchError, LineReader, launch, runtime_argv  # noqa: E402

HERE = Path(__file__).resolve().parent
MIB = 1 << 20
GIB = 1 << 30
CUDA_ALLOC_BYTES = 1 * GIB


@dataclass
class Report:
    results: list[tuple[str, str, str]] = field(default_factory=list)  # (status, check, detail)

    def add(self, status: str, check: str, detail: str = "") -> None:
        self.results.append((status, check, detail))
        print(f"[{status}] {check}{': ' + detail if detail else ''}", flush=True)

    def check(self, ok: bool, check: str, detail: str = "") -> bool:
        self.add("PASS" if ok else "FAIL", check, detail)
        return ok

    def failed(self) -> int:
        return sum(1 for status, _, _ in self.results if status == "FAIL")

    def summary(self, started: float) -> int:
        """Prints every result and the counts; the exit status (1 if anything failed)."""
        print("== summary", flush=True)
        for status, check, detail in self.results:
            print(f"  {status:4} {check}{' — ' + detail if detail else ''}")
        failed = self.failed()
        passed = sum(1 for s, _, _ in self.results if s == "PASS")
        print(f"{passed} passed, {failed} failed, {time.monotonic() - started:.0f} s", flush=True)
        return 1 if failed else 0


class Children:
    """Every process this check starts; all killed (whole process group) at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[str]:
        proc = subprocess.Popen(argv, start_new_session=True, text=True, cwd=REPO, **kwargs)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=15)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait(timeout=15)


def echo(label: str) -> Callable[[str], None]:
    """Prints a child's stdout lines as they arrive, labelled (called on its reader thread)."""

    def show(line: str) -> None:
        print(f"    {label}| {line}", flush=True)

    return show


def first_line(proc: subprocess.Popen[str], label: str, pattern: str, *, timeout_s: float) -> str | None:
    """The first stdout line matching pattern (every line echoed; the pipe drained on a thread, so
    it never fills), or None at EOF or timeout."""
    assert proc.stdout is not None
    try:
        reader = LineReader(proc.stdout, on_line=echo(label))
        return reader.wait_for(re.compile(pattern), timeout_s=timeout_s).strip()
    except LaunchError:
        return None


def sample_for(collector: NvmlCollector, seconds: float, *, show: bool) -> tuple[list[NvmlSample], list[float]]:
    samples: list[NvmlSample] = []
    durations_ms: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline or len(samples) < 2:
        start = time.perf_counter()
        sample = collector.collect()
        durations_ms.append((time.perf_counter() - start) * 1e3)
        samples.append(sample)
        if show:
            print(f"  --- sample {len(samples)}")
            for line in format_sample(sample):
                print(f"  {line}")
            print(f"  memory signal: {sample.memory_signal()}")
        time.sleep(collector.period_s)
    return samples, durations_ms


def check_nvml(report: Report, children: Children, args: argparse.Namespace) -> None:
    collector = open_nvml(library_path=args.nvml_library)
    if not report.check(collector is not None, "NVML initialises (driver present)"):
        return
    assert collector is not None
    try:
        first = collector.collect()
        report.check(len(first.gpus) >= 1, "NVML sees at least one GPU", f"{len(first.gpus)} GPU(s)")
        if not first.gpus:
            return
        for g in first.gpus:
            report.check(
                isinstance(g.name, str) and isinstance(g.uuid, str) and str(g.uuid).startswith(("GPU-", "MIG-")),
                f"GPU {g.index} name and uuid",
                f"{g.name} {g.uuid}",
            )
            total, used, free = g.memory_total_bytes, g.memory_used_bytes, g.memory_free_bytes
            report.check(
                not is_na(total) and int(total) > 0 and not is_na(free) and 0 <= int(free) <= int(total),
                f"GPU {g.index} memory ({g.memory_api})",
                f"total {float(total) / GIB:.1f} GiB, used {float(used) / GIB:.2f} GiB, "
                f"reserved {float(g.memory_reserved_bytes) / MIB:.0f} MiB",
            )
            report.add(
                "PASS" if not is_na(g.utilization_gpu_percent) else "FAIL",
                f"GPU {g.index} utilization",
                f"gpu {g.utilization_gpu_percent}% mem {g.utilization_memory_percent}%",
            )
            report.add("INFO", f"GPU {g.index} NVLink links", f"{g.nvlink_link_count}")

        # A CUDA process holding 1 GiB: NVML must list it with at least that much.
        alloc = children.start(
            [sys.executable, str(HERE / "cuda_alloc.py"), "--bytes", str(CUDA_ALLOC_BYTES)],
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE,
        )
        line = first_line(alloc, "cuda_alloc", r"^allocated|^error", timeout_s=60)
        if not report.check(
            line is not None and line.startswith("allocated"), "CUDA process allocates 1 GiB", line or "no answer"
        ):
            return
        collector.target_pid = alloc.pid
        samples, durations_ms = sample_for(collector, args.seconds, show=True)
        last = samples[-1]
        g0 = next((g for g in last.gpus if any(p.pid == alloc.pid for p in g.processes)), None)
        report.check(g0 is not None, "NVML lists the CUDA process (host pid)", f"pid {alloc.pid}")
        if g0 is not None:
            used = g0.target_memory_used_bytes
            report.check(
                not is_na(used) and int(used) >= CUDA_ALLOC_BYTES,
                "per-process GPU memory >= allocation",
                f"{float(used) / MIB:.0f} MiB",
            )
            signal_ = last.memory_signal()
            report.check(
                signal_ is not None and signal_.source == "nvml" and signal_.scope.startswith(f"GPU {g0.index} "),
                "memory signal follows the target's GPU",
                str(signal_),
            )
        for g in last.gpus:
            report.check(
                not is_na(g.pcie_tx_bytes_per_s) and not is_na(g.pcie_rx_bytes_per_s),
                f"GPU {g.index} PCIe TX/RX rates",
                f"tx {float(g.pcie_tx_bytes_per_s) / MIB:.2f} rx {float(g.pcie_rx_bytes_per_s) / MIB:.2f} MiB/s",
            )
            links = [lk for lk in g.nvlinks if lk.supported]
            if g.nvlink_link_count:
                rated = [lk for lk in links if not is_na(lk.tx_bytes_per_s) and not is_na(lk.rx_bytes_per_s)]
                report.check(
                    len(rated) == len(links),
                    f"GPU {g.index} NVLink per-link rates",
                    f"{len(rated)}/{len(g.nvlinks)} links rated, "
                    f"{len(g.nvlinks) - len(links)} not supported",
                )
            else:
                report.add("INFO", f"GPU {g.index} NVLink", "no NVLink (PCIe-only board)")
        report.add(
            "INFO",
            "NVML collect cost (all GPUs)",
            f"median {statistics.median(durations_ms):.2f} ms, max {max(durations_ms):.2f} ms over {len(durations_ms)}",
        )
        alloc.terminate()
    finally:
        collector.close()


class Control:
    """Minimal client of moescope-control/1 (docs/control-protocol.md): JSON lines over AF_UNIX."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(path)
        self.file = self.sock.makefile("rw", encoding="utf-8", newline="\n")
        self.next_id = 0

    def call(self, cmd: str, **args: Any) -> dict[str, Any]:
        self.next_id += 1
        self.file.write(json.dumps({"id": self.next_id, "cmd": cmd, "args": args}) + "\n")
        self.file.flush()
        reply = json.loads(self.file.readline())
        if reply.get("id") != self.next_id:
            raise RuntimeError(f"{cmd}: reply id {reply.get('id')} != {self.next_id}")
        return reply

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def check_runtime(report: Report, children: Children, args: argparse.Namespace) -> None:
    # ===================== reference runtime section (runs once examples/moe_runtime exists) ==========
    if not (REPO / "examples" / "moe_runtime" / "__main__.py").exists():
        report.add("SKIP", "reference runtime on CUDA", "examples/moe_runtime not present yet")
        return
    if args.device.startswith("cuda"):
        probe = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.__version__, torch.cuda.is_available())"],
            capture_output=True, text=True, timeout=120,
        )
        has_cuda = probe.returncode == 0 and probe.stdout.strip().endswith("True")
        if not report.check(has_cuda, "torch with CUDA in this Python", (probe.stdout or probe.stderr).strip()[-200:]):
            return
    tmp = Path(tempfile.mkdtemp(prefix="moescope-gpu-check-"))
    sock_path = str(tmp / "control.sock")
    try:
        launched = launch(runtime_argv("--device", args.device, "--port", "0", "--control-socket", sock_path),
                          timeout_s=180, cwd=REPO, on_line=echo("runtime"))
    except LaunchError as exc:  # launch() already killed and reaped it
        report.check(False, f"runtime starts on {args.device}", str(exc)[-300:])
        return
    runtime = launched.popen
    children.procs.append(runtime)
    port = launched.banner.http_port
    report.check(True, f"runtime starts on {args.device}", f"http port: {port}")
    ctl = Control(sock_path)
    collector = (
        open_nvml(library_path=args.nvml_library, target_pid=runtime.pid) if args.device.startswith("cuda") else None
    )
    load_out = tmp / "load.json"
    load = children.start(
        [sys.executable, "-m", "moescope.examples.moe_runtime.loadgen", "--url", f"http://127.0.0.1:{port}",
         "--scenario", "balanced", "--concurrency", "4", "--duration-s", str(args.load_s),
         "--json-out", str(load_out)],
        stdout=subprocess.DEVNULL,
    )
    try:
        report.check(ctl.call("ping").get("ok") is True, "control socket ping")
        stats = ctl.call("stats")["result"]
        device = stats["config"]["primary_device"]
        layers, experts = stats["config"]["layers"], stats["config"]["experts"]
        report.add("INFO", "runtime config", f"{layers} layers x {experts} experts on {device}")
        time.sleep(min(3.0, args.load_s / 4))  # let the load reach steady state

        def step(name: str, reply: dict[str, Any], verify: Callable[[dict[str, Any]], bool]) -> None:
            ok = reply.get("ok") is True and verify(reply.get("result") or {})
            report.check(ok, name, json.dumps(reply)[:300])

        def layer0(key: str) -> list[Any]:
            return ctl.call("stats")["result"]["layers"][0][key]

        step("offload expert (0,0) to host fp16", ctl.call("offload_expert", layer=0, expert=0),
             lambda r: r["to"]["device"] == "host")
        report.check(layer0("tier")[0] == "host", "stats: expert (0,0) on host tier")
        step("restore expert (0,0)", ctl.call("restore_expert", layer=0, expert=0),
             lambda r: r["to"]["device"] == device)
        report.check(layer0("tier")[0] == "device", "stats: expert (0,0) back on device")
        step("migrate expert (0,1) to host", ctl.call("migrate_expert", layer=0, expert=1, device="host"),
             lambda r: r["to"]["tier"] == "host")
        step("migrate expert (0,1) back", ctl.call("migrate_expert", layer=0, expert=1, device=device),
             lambda r: r["to"]["device"] == device)
        step("FP16 fallback", ctl.call("set_precision", precision="fp16"),
             lambda r: r["counts"]["fp16"] == layers * experts)
        if collector is not None:
            samples, _ = sample_for(collector, 2.0, show=False)
            used = [s.gpus[0].target_memory_used_bytes for s in samples if s.gpus]
            report.check(
                any(not is_na(u) and int(u) > 0 for u in used),
                "NVML: runtime's GPU memory under load",
                f"{[f'{float(u) / MIB:.0f} MiB' for u in used[-3:]]}",
            )
        step("precision back to fp32", ctl.call("set_precision", precision="fp32"),
             lambda r: r["counts"]["fp32"] == layers * experts)
        load.wait(timeout=args.load_s + 120)
        summary = json.loads(load_out.read_text()) if load_out.exists() else {}
        report.check(
            load.returncode == 0 and summary.get("failures") == 0 and summary.get("requests", 0) > 0,
            "load during migration + fp16 fallback: 0 failed requests",
            f"requests {summary.get('requests')}, failures {summary.get('failures')}, "
            f"p99 {summary['latency_ms'].get('p99') if isinstance(summary.get('latency_ms'), dict) else '?'} ms",
        )
    except (OSError, KeyError, ValueError, RuntimeError, subprocess.TimeoutExpired) as exc:
        report.add("FAIL", "runtime control sequence", f"{type(exc).__name__}: {exc}")
    finally:
        ctl.close()
        if collector is not None:
            collector.close()
    # ===================== end of reference runtime section ===========================================


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="runtime device (cuda; cpu only for a dry run)")
    parser.add_argument("--nvml-library", default=None, help="libnvidia-ml.so.1 to use (default: the loader's)")
    parser.add_argument("--seconds", type=float, default=3.0, help="NVML sampling time")
    parser.add_argument("--load-s", type=float, default=20.0, help="load generator duration")
    parser.add_argument("--skip-nvml", action="store_true", help="runtime section only (dry runs)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="  nvml: %(levelname)s: %(message)s")
    report = Report()
    children = Children()
    started = time.monotonic()
    try:
        if args.skip_nvml:
            report.add("SKIP", "NVML checks", "--skip-nvml")
        else:
            print("== NVML collector", flush=True)
            check_nvml(report, children, args)
        print("== reference runtime", flush=True)
        check_runtime(report, children, args)
    except Exception as exc:  # the summary must still print; the failure is counted
        report.add("FAIL", "check script", f"{type(exc).__name__}: {exc}")
    finally:
        children.stop_all()
    return report.summary(started)


if __name__ == "__main__":
    sys.exit(main())
