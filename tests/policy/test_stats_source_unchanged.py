"""RuntimeStatsSource against the real runtime: an idle runtime's repeated, equal stats are counted
and not emitted again; the first state and every changed one reach the daemon's sinks."""

from __future__ import annotations

from policy_helpers import StartRuntime

from moescope.agent.policy.stats_source import RuntimeStatsSignals, RuntimeStatsSource


def test_equal_states_are_counted_not_re_emitted(start_runtime: StartRuntime) -> None:
    rt = start_runtime()
    signals = RuntimeStatsSignals(rt.socket_path, timeout_s=10.0)
    signals.with_routing = False  # as the agent runs it beside NVTX
    emitted: list[object] = []
    source = RuntimeStatsSource(signals, emit=emitted.append)
    try:
        signals()
        assert source.poll(0) == 1 and emitted == [signals.last_state]  # the first state always goes out
        assert source.poll(0) == 0  # the same object: nothing new
        signals()  # idle runtime: a new object with the same content
        first = emitted[0]
        assert signals.last_state is not first and signals.last_state == first
        assert source.poll(0) == 0 and len(emitted) == 1
        rt.complete("the runtime's token counts move")
        signals()
        assert signals.last_state != first
        assert source.poll(0) == 1 and emitted[-1] is signals.last_state
        assert source.stats() == {"records": 3, "records_unchanged": 1, "polls_failed": 0}
    finally:
        signals.close()
