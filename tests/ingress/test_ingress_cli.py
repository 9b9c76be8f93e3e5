"""`agent start` end to end: the installed console script, real servers, real signals."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

from ingress_harness import AGENT, HTTP_SERVERS, WAIT_S, AgentRun, CPair, HttpClient, Server, free_port

from moescope import errors

SUMMARY = re.compile(
    r"^agent: summary: (?P<requests>\d+) requests \((?P<unanswered>\d+) unanswered\), "
    r"latency p50 (?P<p50>[-\d.]+)(?: ms)? p99 (?P<p99>[-\d.]+)(?: ms)?, drops (?P<drops>\d+) \((?P<detail>[^)]*)\), "
    r"records (?P<records>\d+), sampled out (?P<sampled>\d+), ",
    re.M,
)
NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")


def finish(run: AgentRun) -> tuple[int, str, str]:
    out, err = run.popen.communicate(timeout=WAIT_S * 2)
    return run.popen.returncode, out, run.attach_line + err


def summary_of(out: str) -> re.Match[str]:
    match = SUMMARY.search(out)
    assert match, f"no summary line in {out!r}"
    return match


class RecordLine(TypedDict):
    """One line of `--records` (IngressRecord.to_json_dict()), as far as these tests read it."""

    tgid: int
    peer_port: int
    start_ns: int
    end_ns: int
    bytes_in: int
    bytes_out: int
    flags: list[str]


def read_records(path: Path) -> list[RecordLine]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def nearest_rank_ms(values: list[int], pct: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(pct / 100 * len(ordered))) - 1] / 1e6


def assert_summary_matches_records(match: re.Match[str], records: list[RecordLine]) -> None:
    """The summary's numbers, recomputed independently from the records file."""
    latencies = [r["end_ns"] - r["start_ns"] for r in records if "no_response" not in r["flags"]]
    assert int(match["requests"]) == len(records)  # the kernel's count, answered or not
    assert int(match["unanswered"]) == len(records) - len(latencies)
    for pct, key in ((50, "p50"), (99, "p99")):
        exact = nearest_rank_ms(latencies, pct)
        # The kernel histogram reports its bucket's midpoint, within 1/32 of the exact value;
        # the line prints 3 decimals.
        assert exact * (1 - 1 / 32) - 0.0011 <= float(match[key]) <= exact * (1 + 1 / 32) + 0.0011
    assert int(match["drops"]) == 0
    assert match["detail"] == "ringbuf_full=0 conn_evicted=0 inflight_full=0 sink_errors=0"
    assert (int(match["records"]), int(match["sampled"])) == (len(records), 0)


def test_pid_duration_records_and_summary(
    bpf: None, tmp_path: Path, start_server: Callable[..., Server], run_agent: Callable[..., AgentRun]
) -> None:
    server = start_server("threaded")
    records_path = tmp_path / "records.jsonl"
    run = run_agent("--pid", str(server.pid), "--duration", "4", "--records", str(records_path))
    assert f"tracing pid {server.pid}" in run.attach_line
    clients = [HttpClient(server.port) for _ in range(2)]
    for i in range(12):
        clients[i % 2].request(path=f"/size/{i}")
    for c in clients:
        c.close()
    code, out, err = finish(run)
    assert code == 0, err
    records = read_records(records_path)
    assert len(records) == 12
    assert {r["tgid"] for r in records} == {server.pid}
    assert sorted(r["peer_port"] for r in records) == sorted([c.local_port for c in clients] * 6)
    assert sorted(r["bytes_in"] for r in records) == sorted(q.sent_bytes for c in clients for q in c.requests)
    assert sorted(r["bytes_out"] for r in records) == sorted(q.received_bytes for c in clients for q in c.requests)
    assert_summary_matches_records(summary_of(out), records)
    assert server.popen.poll() is None  # the agent leaves a --pid target running


def test_port_stops_cleanly_on_sigint_and_sigterm(
    bpf: None, tmp_path: Path, start_server: Callable[..., Server], run_agent: Callable[..., AgentRun]
) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        server = start_server("asyncio")
        records_path = tmp_path / f"records-{sig}.jsonl"
        run = run_agent("--port", str(server.port), "--records", str(records_path))
        assert f"tracing pid {server.pid}" in run.attach_line
        client = HttpClient(server.port)
        for _ in range(5):
            client.request()
        client.close()
        run.popen.send_signal(sig)
        code, out, err = finish(run)
        assert code == 0, err
        records = read_records(records_path)
        assert len(records) == 5
        assert_summary_matches_records(summary_of(out), records)


def test_command_is_traced_from_its_start_and_its_status_returned(
    bpf: None, tmp_path: Path, run_agent: Callable[..., AgentRun]
) -> None:
    port_file = tmp_path / "port"
    records_path = tmp_path / "records.jsonl"
    run = run_agent(
        "--records", str(records_path), "--",
        sys.executable, str(HTTP_SERVERS), "threaded", "--port-file", str(port_file), "--self-request",
    )
    assert "tracing pid" in run.attach_line
    deadline = time.monotonic() + WAIT_S
    while not port_file.exists():
        assert time.monotonic() < deadline, "launched server never listened"
        assert run.popen.poll() is None, run.popen.communicate()
        time.sleep(0.05)
    client = HttpClient(int(port_file.read_text()))
    for _ in range(3):
        client.request()
    client.request(path="/exit")  # the server answers, then exits with status 3
    code, out, err = finish(run)
    assert code == 3, err
    records = read_records(records_path)
    # The server's request to itself, made right after it started listening, was traced:
    # the agent attached before the command ran.
    own = [r for r in records if r["peer_port"] != client.local_port]
    assert len(own) == 1 and own[0]["bytes_out"] > 0
    assert len([r for r in records if r["peer_port"] == client.local_port]) == 4
    assert_summary_matches_records(summary_of(out), records)


def test_duration_with_idle_target_reports_zero(
    bpf: None, start_server: Callable[..., Server], run_agent: Callable[..., AgentRun]
) -> None:
    server = start_server("threaded")
    code, out, err = finish(run_agent("--pid", str(server.pid), "--duration", "0.5"))
    assert code == 0, err
    match = summary_of(out)
    assert (match["requests"], match["p50"], match["p99"], match["drops"]) == ("0", "-", "-", "0")


def test_target_exit_gives_summary_then_exit_code_8(
    bpf: None, start_server: Callable[..., Server], run_agent: Callable[..., AgentRun]
) -> None:
    server = start_server("threaded")
    run = run_agent("--pid", str(server.pid))
    client = HttpClient(server.port)
    client.request()
    client.request(path="/exit")
    assert server.popen.wait(timeout=WAIT_S) == 3
    code, out, err = finish(run)
    assert code == errors.EXIT_TARGET_EXITED, err
    assert summary_of(out)["requests"] == "2"
    assert err.strip().splitlines()[-1].startswith(f"agent: error: every target exited: pid {server.pid} (")


def one_line_error(run: AgentRun, code: int) -> str:
    got, out, err = finish(run)
    assert got == code, (got, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agent: error: "), err
    return lines[0]


def test_not_root_is_exit_3(bpf: None, start_server: Callable[..., Server], run_agent: Callable[..., AgentRun]) -> None:
    server = start_server("threaded")
    run = run_agent("--pid", str(server.pid), prefix=NOBODY, wait_attach=False)
    assert "needs root" in one_line_error(run, errors.EXIT_NOT_PERMITTED)


def test_ebpf_prints_the_program_without_root(bpf: None, run_agent: Callable[..., AgentRun]) -> None:
    code, out, err = finish(run_agent("--ebpf", prefix=NOBODY, wait_attach=False))
    assert code == 0, err
    assert "-DMAX_CONNS=65536" in out.splitlines()[0]
    assert "TRACEPOINT_PROBE(syscalls, sys_enter_accept4)" in out
    assert "struct ingress_event {" in out


def test_no_such_pid_is_exit_6(bpf: None, run_agent: Callable[..., AgentRun]) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    run = run_agent("--pid", str(dead.pid), wait_attach=False)
    assert f"no such process: pid {dead.pid}" in one_line_error(run, errors.EXIT_NO_SUCH_PROCESS)


def test_free_port_is_exit_7(bpf: None, run_agent: Callable[..., AgentRun]) -> None:
    port = free_port()
    run = run_agent("--port", str(port), wait_attach=False)
    assert f"nothing is listening on TCP port {port}" in one_line_error(run, errors.EXIT_PORT_NOT_LISTENING)


def test_own_pid_is_a_usage_error(bpf: None, run_agent: Callable[..., AgentRun]) -> None:
    # exec keeps the shell's pid, so $$ is the agent's own pid.
    popen = subprocess.Popen(
        ["sh", "-c", f'exec "{AGENT}" start --pid "$$"'], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = popen.communicate(timeout=WAIT_S)
    assert popen.returncode == errors.EXIT_USAGE, (out, err)
    assert "is the agent itself" in err and len(err.strip().splitlines()) == 1


def test_usage_errors_are_exit_2(bpf: None, run_agent: Callable[..., AgentRun]) -> None:
    assert "nothing to observe" in one_line_error(run_agent(wait_attach=False), errors.EXIT_USAGE)
    run = run_agent("--pid", "1", "--", "true", wait_attach=False)
    assert "not both" in one_line_error(run, errors.EXIT_USAGE)
    run = run_agent("--", "no-such-command-xyz", wait_attach=False)
    assert "command not found" in one_line_error(run, errors.EXIT_USAGE)
    run = run_agent("--pid", "1", "--pid", "1", wait_attach=False)
    assert "--pid 1 is given twice" in one_line_error(run, errors.EXIT_USAGE)
    for value in ("0", "31", "nan"):
        run = run_agent("--pid", "1", "--quiet-drain-s", value, wait_attach=False)
        text = f"--quiet-drain-s must be 0.05 to 30 seconds, got {float(value)}"
        assert text in one_line_error(run, errors.EXIT_USAGE)


def test_bad_ingress_options_are_one_line_errors(bpf: None, run_agent: Callable[..., AgentRun]) -> None:
    for flags, text in (
        (("--ingress-ring-pages", "3"), "--ingress-ring-pages must be a power of two, got 3"),
        (("--ingress-ring-pages", "-4"), "--ingress-ring-pages must be >= 0, got -4"),
        (("--ingress-rate-hint", "0"), "--ingress-rate-hint must be >= 1, got 0"),
        (("--ingress-rate-hint", "fast"), "--ingress-rate-hint must be a whole number, got 'fast'"),
        (("--ingress-records-per-s", "-1"), "--ingress-records-per-s must be >= 0, got -1"),
    ):
        run = run_agent("--pid", "1", *flags, wait_attach=False)
        assert text in one_line_error(run, errors.EXIT_USAGE)


def scrape_requests_total(port: int) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None  # not serving yet
    for line in text.splitlines():
        if line.startswith("moescope_requests_total "):
            return float(line.split()[1])
    return None


def run_c_client_under_agent(
    c_pair: CPair, run_agent: Callable[..., AgentRun], requests: int, *flags: str
) -> tuple[re.Match[str], float]:
    """`agent start --pid <C responder> FLAGS`, `requests` requests from the C client, then the
    agent's moescope_requests_total once it stops growing past `requests`, then SIGINT."""
    metrics_port = free_port()
    run = run_agent("--pid", str(c_pair.server.pid), "--metrics-port", str(metrics_port), "--no-policy",
                    "--no-collector.nvtx", *flags)
    assert f"tracing pid {c_pair.server.pid}" in run.attach_line
    deadline = time.monotonic() + WAIT_S
    while scrape_requests_total(metrics_port) is None:
        assert time.monotonic() < deadline and run.popen.poll() is None, "no /metrics from the agent"
        time.sleep(0.1)
    c_pair.requests(requests)
    total = scrape_requests_total(metrics_port)
    while total is None or total < requests:
        assert time.monotonic() < deadline, f"moescope_requests_total stayed at {total}"
        time.sleep(0.1)
        total = scrape_requests_total(metrics_port)
    run.popen.send_signal(signal.SIGINT)
    code, out, err = finish(run)
    assert code == 0, err
    return summary_of(out), total


def test_counts_are_exact_when_the_ring_overflows(
    bpf: None, c_pair: CPair, run_agent: Callable[..., AgentRun]
) -> None:
    # A one-page ring (~36 records) against ~100k requests/s: most records are lost, no count is.
    match, total = run_c_client_under_agent(c_pair, run_agent, 20_000, "--ingress-ring-pages", "1",
                                            "--ingress-records-per-s", "0")
    assert total == 20_000
    assert (int(match["requests"]), int(match["unanswered"]), int(match["sampled"])) == (20_000, 0, 0)
    lost = int(re.search(r"ringbuf_full=(\d+)", match["detail"])[1])  # type: ignore[index]
    assert lost > 0 and int(match["records"]) + lost == 20_000
    assert match["p50"] != "-" and float(match["p50"]) <= float(match["p99"])


def test_sampled_out_is_counted_apart_from_drops(
    bpf: None, c_pair: CPair, run_agent: Callable[..., AgentRun]
) -> None:
    match, total = run_c_client_under_agent(c_pair, run_agent, 20_000, "--ingress-records-per-s", "100")
    assert total == 20_000 and int(match["requests"]) == 20_000
    assert int(match["drops"]) == 0
    assert int(match["sampled"]) > 0 and int(match["records"]) + int(match["sampled"]) == 20_000


def test_bcc_missing_is_exit_4(bpf: None, tmp_path: Path, start_server: Callable[..., Server]) -> None:
    server = start_server("threaded")
    # The real agent where `import bcc` fails (a `bcc` package first on the path that raises
    # ImportError): the eBPF compiler process it starts reports it, the agent exits 4 in one line.
    shadow = tmp_path / "shadow" / "bcc"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no libbcc here')\n")
    env = os.environ | {"PYTHONPATH": str(shadow.parent)}
    done = subprocess.run(
        [sys.executable, "-m", "moescope.agent", "start", "--pid", str(server.pid)],
        capture_output=True, text=True, timeout=WAIT_S, env=env,
    )
    assert done.returncode == errors.EXIT_BCC_MISSING, done
    assert done.stderr.startswith("agent: error: bcc is not importable (no libbcc here)"), done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr


def test_command_is_stopped_with_the_agent(bpf: None, tmp_path: Path, run_agent: Callable[..., AgentRun]) -> None:
    port_file = tmp_path / "port"
    run = run_agent("--", sys.executable, str(HTTP_SERVERS), "asyncio", "--port-file", str(port_file))
    match = re.search(r"tracing pid (\d+) ", run.attach_line)
    assert match, run.attach_line
    child = int(match[1])
    deadline = time.monotonic() + WAIT_S
    while not port_file.exists():
        assert time.monotonic() < deadline, "launched server never listened"
        time.sleep(0.05)
    client = HttpClient(int(port_file.read_text()))
    client.request()
    client.request()
    run.popen.send_signal(signal.SIGTERM)
    code, out, err = finish(run)
    assert code == 0, err
    # Both answered; the second was still open (asyncio waits for readability) and is flushed.
    assert summary_of(out)["requests"] == "2"
    assert not Path(f"/proc/{child}").exists()  # terminated and reaped by the agent
    client.close()
