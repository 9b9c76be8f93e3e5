"""Fault tests with real processes: the reference runtime under the load generator, the real
`agent start` (eBPF ingress, NVTX, telemetry, trace export, /metrics, policy, live state), real
signals, a real OTLP receiver, real file systems. Assertions are on counts and values; time only
bounds the waits (docs/reliability.md lists each failure mode and the test here that proves it)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections import Counter

from otlp_receiver import GrpcOtlpReceiver

from moescope import errors
from moescope.agent import state as st
from moescope.agent.export.config import DEFAULT_BATCH_SPANS
from moescope.agent.export.store import TraceStore

from .harness import WAIT_S, Lab, rss_bytes, run_load, wait_until

SUMMARY = re.compile(r"^agent: summary: (\d+) requests \((\d+) unanswered\).*drops (\d+) \(", re.M)
EXPORT = re.compile(r"^agent: export: (.*)$", re.M)


def export_stats(stdout: str) -> dict[str, int]:
    match = EXPORT.search(stdout)
    assert match, f"no export line in {stdout!r}"
    return {k: int(v) for k, v in (item.split() for item in match.group(1).split(", "))}


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text exposition (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        metric_name, _, label_text = series.partition("{")
        if metric_name != name:
            continue
        got = ",".join(sorted(label_text.rstrip("}").split(","))) if label_text else ""
        if got == want:
            return float(value)
    return 0.0


def test_sigkill_of_the_agent_under_load_costs_the_runtime_no_request(lab: Lab) -> None:
    rt = lab.runtime()
    before = run_load(rt.port, lab.tmp / "before.json", duration_s=2)
    agent = lab.agent("--port", str(rt.port))
    load = lab.load(rt.port, "during", duration_s=8)
    wait_until(lambda: len(agent.records()) >= 20, what="the agent to record 20 requests under load")
    os.kill(agent.pid, signal.SIGKILL)  # no handler, no cleanup: the kernel tears its probes down
    assert agent.popen.wait(timeout=WAIT_S) == -signal.SIGKILL
    recorded_at_kill = len(agent.records())
    during = load.result()
    after = run_load(rt.port, lab.tmp / "after.json", duration_s=2)
    for phase in (before, during, after):
        assert phase["failures"] == 0 and phase["ok"] > 0, phase
    # The load went on past the kill: more requests were served than the agent saw.
    assert during["ok"] > recorded_at_kill
    assert rt.popen.poll() is None


def test_a_restarted_server_is_reattached_by_itself(lab: Lab) -> None:
    first = lab.runtime()
    port = first.port
    agent = lab.agent("--port", str(port))
    assert run_load(port, lab.tmp / "first.json", duration_s=1.5)["failures"] == 0
    wait_until(lambda: any(r["tgid"] == first.pid for r in agent.records()), what="a record of the first server")
    first.stop(signal.SIGKILL)
    agent.wait_stderr(f"target pid {first.pid} (python) exited; waiting for a process listening on port {port}")
    assert agent.popen.poll() is None  # a --port agent waits for the server to come back

    second = lab.runtime(port=port)
    line = agent.wait_stderr(f"re-attached to pid {second.pid} (python) listening on port {port}")
    following = agent.wait_stderr(f"following pid {second.pid}:")
    assert following.endswith("ingress, nvtx, telemetry, policy"), following
    # the policy talks to the new runtime's own control socket
    agent.wait_stderr(f"control socket {second.control_socket}")
    load = run_load(port, lab.tmp / "second.json", duration_s=2)
    assert load["failures"] == 0 and load["ok"] > 0
    # every request the load generator made to the new server is recorded, under the new pid
    wait_until(lambda: Counter(r["tgid"] for r in agent.records())[second.pid] >= load["ok"],
               what="the new server's requests in the records file")
    assert agent.stop(signal.SIGINT) == 0
    out = agent.stdout()
    assert "re-attached 1 times; still waiting on ports: none" in out
    # the server that went is said at exit too, beside the one that replaced it
    assert f"agent: targets: 1 exited while observed: pid {first.pid} (python)" in out, out
    nvtx = re.search(rf"^agent: nvtx pid {second.pid}: (\d+) records", out, re.M)
    assert nvtx and int(nvtx.group(1)) > 0, out
    # traced: request spans and NVTX step spans of the new pid reached the trace files
    store = TraceStore.load(lab.tmp / "state" / "traces")
    names = Counter(
        s.name for t in store.trace_ids() for s in store.spans(t) if s.attributes.get("process.pid") == second.pid
    )
    assert names["moe.step"] > 0 and sum(names.values()) > names["moe.step"], names
    assert "s after the previous target exited" in line


def test_otlp_receiver_outage_bounded_memory_counted_drops_and_resumed_export(lab: Lab) -> None:
    # Small enough that the stalled phase overflows it at the default --span-detail layer (~15 spans
    # per request): what is tested is that the queue stays bounded and the overflow is counted.
    queue_spans = 500
    with GrpcOtlpReceiver() as rx:
        rt = lab.runtime()
        agent = lab.agent("--port", str(rt.port), "--otlp-endpoint", rx.endpoint, "--otlp-timeout-ms", "2000",
                          "--export-queue-spans", str(queue_spans))
        assert run_load(rt.port, lab.tmp / "warm.json", duration_s=2)["failures"] == 0
        rx.wait_for_spans(1)
        rss_before = rss_bytes(agent.pid)
        # The issue asks for minutes; 20 s at this load is several times the queue, which is what
        # is tested. First the collector is down (refuses: UNAVAILABLE), then stalled (holds each
        # export past the agent's timeout, so the queue fills).
        rx.set_unavailable(True)
        outage = lab.load(rt.port, "outage", duration_s=20)
        queued_max = 0.0
        polls = 0
        while outage.popen.poll() is None:
            queued_max = max(queued_max, metric(agent.metrics(), "moescope_export_queue_spans"))
            polls += 1
            if polls == 20:  # about half-way
                rx.hold()
                rx.set_unavailable(False)
            try:
                outage.popen.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
        assert outage.result()["failures"] == 0
        rss_after = rss_bytes(agent.pid)
        text = agent.metrics()
        dropped = metric(text, "moescope_export_spans_dropped_total", reason="queue_full")
        failed = metric(text, "moescope_export_spans_total", outcome="failed")
        assert rx.refused > 0
        assert dropped > 0 and failed > 0, (dropped, failed)
        # queued counts the queue and the batch in flight: never more than both bounds together
        assert 0 < queued_max <= queue_spans + DEFAULT_BATCH_SPANS
        # `agent top` shows the loss too: the live state has an export row with its drops
        def export_row_drops() -> int:
            snap = st.read_snapshot(st.state_file_for(lab.tmp / "state", agent.pid))
            return sum(s.drops_total or 0 for s in snap.header.sources if s.name == "export")

        wait_until(lambda: export_row_drops() >= dropped + failed, what="the export row's drops in the live state")
        have = rx.span_count()
        back_unix_ns = time.time_ns()
        rx.release()  # held exports are answered now (too late for the agent: they count as failed)
        assert run_load(rt.port, lab.tmp / "back.json", duration_s=2)["failures"] == 0
        # export resumed: spans of requests made after the collector came back reach it
        wait_until(lambda: any(s.start_ns > back_unix_ns for s in rx.spans()), what="spans made after the outage",
                   period_s=0.5)
        assert agent.stop() == 0
    stats = export_stats(agent.stdout())
    assert stats["dropped_queue_full"] >= dropped and stats["failed"] >= failed
    assert stats["exported"] >= have
    growth = rss_after - rss_before
    print(
        f"agent RSS {rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB over the outage; "
        f"queued max {queued_max:.0f} (bound {queue_spans} + {DEFAULT_BATCH_SPANS} in flight); "
        f"dropped {stats['dropped_queue_full']}, failed {stats['failed']}"
    )
    # The queue holds at most queue_spans spans (a few MiB); an unbounded one would hold all of them.
    # Unbounded, every span lost here (thousands) would have been held instead.
    assert growth < 48 * 2**20, growth


def test_state_dir_unwritable_costs_only_the_live_state(lab: Lab) -> None:
    # Root writes through chmod 000, so "unwritable" is a file where the directory should be.
    blocked = lab.tmp / "not-a-dir"
    blocked.write_text("a file, not a directory\n")
    with GrpcOtlpReceiver() as rx:
        rt = lab.runtime()
        agent = lab.agent("--port", str(rt.port), "--otlp-endpoint", rx.endpoint, state_dir=blocked)
        note = agent.wait_stderr("live state off")
        assert f"cannot create state dir {blocked}" in note
        assert run_load(rt.port, lab.tmp / "load.json", duration_s=2)["failures"] == 0
        rx.wait_for_spans(1)  # OTLP export goes on
        # /metrics goes on and counts what reached the receiver
        wait_until(lambda: metric(agent.metrics(), "moescope_export_spans_total", outcome="exported") > 0,
                   what="exported spans counted in /metrics")
        wait_until(lambda: len(agent.records()) > 0, what="records")
        assert not blocked.is_dir() and agent.popen.poll() is None
        assert agent.stop() == 0
    assert SUMMARY.search(agent.stdout())
    assert "Traceback" not in agent.stderr()


def test_state_dir_full_says_so_keeps_the_rest_going_and_recovers(lab: Lab) -> None:
    full = lab.tmp / "full"
    full.mkdir()
    # Small, and larger than the trace files' own bound (2 x 1 MiB), so freeing space lets them fit.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(full)], check=True)
    try:
        filler = full / "filler"
        with open(filler, "wb", buffering=0) as f:  # fill it: writes fail with ENOSPC from here on
            try:
                for _ in range(2048):  # bounded: 8 MiB is past the size
                    f.write(b"\0" * 4096)
            except OSError:
                pass
        assert filler.stat().st_size >= 3 * 2**20
        (full / "traces").mkdir()  # a directory takes no data blocks; the files in it fail to grow
        rt = lab.runtime()
        agent = lab.agent("--port", str(rt.port), "--trace-file-max-bytes", str(2**20), "--trace-files-keep", "2",
                          state_dir=full)
        assert run_load(rt.port, lab.tmp / "full.json", duration_s=2)["failures"] == 0
        agent.wait_stderr("No space left on device")
        # the rest goes on: requests recorded, /metrics served and counting the failed export
        wait_until(lambda: len(agent.records()) > 0, what="records")
        wait_until(lambda: metric(agent.metrics(), "moescope_export_spans_total", outcome="failed") > 0,
                   what="failed export counted in /metrics")
        assert agent.popen.poll() is None
        filler.unlink()  # space again: the file export resumes by itself
        assert run_load(rt.port, lab.tmp / "freed.json", duration_s=2)["failures"] == 0
        wait_until(lambda: metric(agent.metrics(), "moescope_export_spans_total", outcome="exported") > 0,
                   what="export to resume")
        assert agent.stop() == 0
        store = TraceStore.load(full / "traces")
        assert store.trace_ids()
        stats = export_stats(agent.stdout())
        assert stats["failed"] > 0 and stats["exported"] > 0
        errors_said = [line for line in agent.stderr().splitlines() if "No space left on device" in line]
        print(f"{len(errors_said)} ENOSPC lines: {errors_said[:3]}")
        assert "Traceback" not in agent.stderr()
    finally:
        subprocess.run(["umount", "-l", str(full)], check=False)


def test_target_exit_gives_a_clean_report(lab: Lab) -> None:
    # --pid: the pid is gone for good, so the agent reports and exits 8.
    rt = lab.runtime()
    agent = lab.agent("--pid", str(rt.pid))
    load = run_load(rt.port, lab.tmp / "load.json", duration_s=1.5)
    assert load["failures"] == 0
    wait_until(lambda: len(agent.records()) >= load["ok"], what="every request recorded")
    rt.stop(signal.SIGTERM)
    assert agent.popen.wait(timeout=WAIT_S) == errors.EXIT_TARGET_EXITED
    match = SUMMARY.search(agent.stdout())
    assert match, agent.stdout()
    assert int(match.group(1)) == len(agent.records()) >= load["ok"]
    assert int(match.group(3)) == 0
    last = agent.stderr().strip().splitlines()[-1]
    assert last.startswith(f"agent: error: every target exited: pid {rt.pid} ("), last
    # --port with --exit-on-target-exit: the same, instead of waiting for a successor
    rt2 = lab.runtime()
    (lab.tmp / "records.jsonl").unlink()
    agent2 = lab.agent("--port", str(rt2.port), "--exit-on-target-exit")
    rt2.stop(signal.SIGTERM)
    assert agent2.popen.wait(timeout=WAIT_S) == errors.EXIT_TARGET_EXITED
    assert SUMMARY.search(agent2.stdout())
