"""After attach the agent holds only what it still needs, in every thread, and goes on tracing;
and it never maps the compiler (bcc's LLVM/clang stay in the short-lived compiler process).

Real `agent start` against a real server; capabilities read from /proc/PID/task/*/status."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from ingress_harness import WAIT_S, AgentRun, HttpClient, Server

from moescope.agent import privileges

REQUESTS = 6
KEPT_MASK = (1 << privileges.CAP_NUMBERS["CAP_DAC_OVERRIDE"]) | (1 << privileges.CAP_NUMBERS["CAP_SYS_PTRACE"])
BPF_MASK = (1 << privileges.CAP_NUMBERS["CAP_BPF"]) | (1 << privileges.CAP_NUMBERS["CAP_PERFMON"])


def thread_caps(pid: int) -> list[privileges.Capabilities]:
    found = []
    for status in sorted(Path(f"/proc/{pid}/task").glob("*/status")):
        try:
            found.append(privileges.thread_capabilities(status))
        except FileNotFoundError:
            continue  # a thread that ended between the listing and the read
    return found


def startup_lines(run: AgentRun) -> list[str]:
    """The agent's stderr up to its last start-up note (`agent: policy ...`), read line by line.

    Read here, not by communicate() at the end: a text pipe's readline() buffers ahead, and
    communicate() reads the descriptor, so lines already buffered would be lost."""
    assert run.popen.stderr is not None
    lines = []
    for _ in range(50):  # bounded: the agent prints about ten lines before it serves
        line = run.popen.stderr.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("agent: policy"):
            break
    return lines


def traced_requests(run: AgentRun, server: Server) -> tuple[list[privileges.Capabilities], str]:
    """Serve REQUESTS requests, read every thread's capabilities, stop the agent (SIGINT)."""
    client = HttpClient(server.port)
    for _ in range(REQUESTS):
        client.request()
    client.request(close=True)
    caps = thread_caps(run.popen.pid)
    run.popen.send_signal(signal.SIGINT)
    out, _ = run.popen.communicate(timeout=WAIT_S * 2)
    return caps, out


def test_every_thread_drops_bpf_and_perfmon_after_attach(
    bpf: None, start_server: Callable[..., Server], run_agent: Callable[..., AgentRun]
) -> None:
    server = start_server("threaded")
    run = run_agent("--pid", str(server.pid), "--metrics-port", "0", wait_attach=False)
    err = "".join(startup_lines(run))
    assert "agent: tracing pid" in err, err
    assert "agent: privileges dropped after attach: kept CAP_DAC_OVERRIDE, CAP_SYS_PTRACE" in err, err
    caps, out = traced_requests(run, server)
    assert run.popen.returncode == 0, out
    # several threads by then (exporter, telemetry, state publisher...), each with only the two kept
    assert len(caps) > 1, caps
    for thread in caps:
        assert thread.effective == thread.permitted == thread.bounding == KEPT_MASK, [hex(c.effective) for c in caps]
    # and the kernel timing went on without them: every request counted, the close one flushed too
    assert f"{REQUESTS + 1} requests" in out, out


def test_keep_privileges_keeps_them(
    bpf: None, start_server: Callable[..., Server], run_agent: Callable[..., AgentRun]
) -> None:
    server = start_server("threaded")
    run = run_agent("--pid", str(server.pid), "--keep-privileges", wait_attach=False)
    err = "".join(startup_lines(run))
    assert "agent: tracing pid" in err and "privileges dropped" not in err, err
    caps, out = traced_requests(run, server)
    assert run.popen.returncode == 0, out
    assert caps and all(thread.effective & BPF_MASK == BPF_MASK for thread in caps)


def test_the_agent_never_maps_the_compiler(
    bpf: None, start_server: Callable[..., Server], run_agent: Callable[..., AgentRun]
) -> None:
    server = start_server("threaded")
    run = run_agent("--pid", str(server.pid))
    assert "tracing pid" in run.attach_line, run.attach_line
    maps = Path(f"/proc/{run.popen.pid}/maps").read_text()
    run.popen.send_signal(signal.SIGINT)
    run.popen.communicate(timeout=WAIT_S * 2)
    # the probe is loaded (its ring buffer is mapped) yet no compiler library is
    assert "anon_inode:bpf-map" in maps
    for library in ("libLLVM", "libclang", "libbcc"):
        assert library not in maps, library


def test_drop_refuses_while_another_thread_runs() -> None:
    # capset(2) changes one thread; with a second thread alive the drop must not half-happen.
    code = (
        "import threading, time\n"
        "from agent import privileges\n"
        "before = privileges.thread_capabilities()\n"
        "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
        "print(privileges.drop_to(privileges.KEEP_AFTER_ATTACH))\n"
        "print(privileges.thread_capabilities() == before)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stderr
    note, unchanged = done.stdout.splitlines()
    assert note.startswith("privileges kept: 1 other thread"), note
    assert unchanged == "True"
