"""RuntimeStatsSource against the real runtime: states that show the same as the last one emitted
(the same placement version, pools and model: an idle runtime, or a busy one whose queues moved)
are counted and not emitted again; the first state and every one that shows something new reach
the daemon's sinks. And the same against a runtime that takes only whole stats (an older
moescope-control/1 runtime): whole-state equality decides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from policy_helpers import ControlProxy, StartRuntime

from moescope.agent.policy.stats_source import RuntimeStatsSignals, RuntimeStatsSource


def test_states_showing_the_same_are_counted_not_re_emitted(start_runtime: StartRuntime) -> None:
    rt = start_runtime()
    signals = RuntimeStatsSignals(rt.socket_path, timeout_s=10.0)
    signals.with_routing = False  # as the agent runs it beside NVTX
    emitted: list[object] = []
    source = RuntimeStatsSource(signals, emit=emitted.append)
    try:
        signals()
        assert signals.narrowed is True
        first = signals.last_state
        assert first is not None and first.placement_version == rt.stats()["placement_version"]
        assert first.precision and first.tier  # the first narrowed poll reads the placement
        assert source.poll(0) == 1 and emitted == [first]  # the first state always goes out
        assert source.poll(0) == 0  # the same object: nothing new
        signals()  # idle runtime: a new object with the same content
        assert signals.last_state is not first and signals.last_state == first
        assert source.poll(0) == 0 and len(emitted) == 1
        rt.complete("the runtime's queues and token counts move")
        idle = signals.last_state
        signals()
        # read from the runtime's stats page (its version had not moved): without routing the period
        # takes only queues and penalties from it, and the state (placement, pools) stands as it was
        assert signals.page_periods == 1 and signals.last_state is idle
        assert signals.last_state.precision is first.precision
        assert source.poll(0) == 0 and len(emitted) == 1
        rt.call("set_precision", {"precision": "fp16", "experts": [[1, 3]]})
        signals()
        state = signals.last_state
        assert state.placement_version != first.placement_version
        assert state.precision[(1, 3)] == "fp16" and state.precision[(0, 0)] == "fp32"
        assert source.poll(0) == 1 and emitted[-1] is state
        # records: the states read over the socket (the page's period kept one, not counted again)
        assert source.stats() == {"records": 3, "records_unchanged": 1, "polls_failed": 0, "page_periods": 1,
                                  "page_errors": 0}
    finally:
        signals.close()


class OlderRuntime(ControlProxy):
    """A moescope-control/1 runtime from before narrowed stats, over the real one: a command with
    arguments it does not know is refused (as the protocol says), everything else is passed on."""

    def __init__(self, path: Path, upstream: str) -> None:
        self.refused = 0
        super().__init__(path, upstream, answer=self._refuse_arguments, rewrite=self._no_version)

    def _refuse_arguments(self, request: dict[str, Any]) -> dict[str, Any] | None:
        if request.get("cmd") != "stats" or not request.get("args"):
            return None
        self.refused += 1
        return {"id": request.get("id"), "ok": False, "elapsed_ms": 0.0,
                "error": f"stats: unknown argument(s) {sorted(request['args'])}; accepted: []"}

    @staticmethod
    def _no_version(request: dict[str, Any], reply: dict[str, Any]) -> None:
        if request.get("cmd") == "stats" and reply.get("ok"):
            del reply["result"]["placement_version"]  # (newer than this runtime, too)
            reply["result"].pop("stats_page", None)  # (and so is the stats page: every period a call)


def test_a_runtime_without_narrowed_stats_gets_whole_stats(start_runtime: StartRuntime) -> None:
    rt = start_runtime()
    older = OlderRuntime(rt.workdir / "older.sock", rt.socket_path)
    signals = RuntimeStatsSignals(rt.workdir / "older.sock", timeout_s=10.0)
    signals.with_routing = False
    emitted: list[object] = []
    source = RuntimeStatsSource(signals, emit=emitted.append)
    try:
        signals()
        assert signals.narrowed is False and older.refused == 1 and signals.poll_errors == 0
        first = signals.last_state
        assert first is not None and first.tokens and first.tier  # whole stats: every field
        assert first.placement_version is None
        assert source.poll(0) == 1
        signals()
        assert older.refused == 1  # asked once per connection, not every period
        assert source.poll(0) == 0  # idle: equal whole states
        rt.complete("token counts move")
        signals()
        assert source.poll(0) == 1 and len(emitted) == 2  # whole-state equality: the counts moved
    finally:
        signals.close()
        older.close()


def test_the_transformers_server_takes_narrowed_stats(start_runtime: StartRuntime) -> None:
    # Its placement is each layer's precision (the experts never move): set_precision moves the version.
    rt = start_runtime(hf=True)
    signals = RuntimeStatsSignals(rt.socket_path, timeout_s=30.0)
    signals.with_routing = False
    emitted: list[object] = []
    source = RuntimeStatsSource(signals, emit=emitted.append)
    try:
        signals()
        first = signals.last_state
        assert signals.narrowed is True and first is not None and first.placement_version is not None
        assert set(first.precision.values()) == {"fp32"} and len(first.precision) == 2 * 8
        narrow = rt.call("stats", {"fields": ["queue_depth"], "placement_since": first.placement_version})
        descriptive = {"layer", "module", "experts", "top_k", "shared"}  # always sent
        assert all(set(layer) == descriptive | {"queue_depth"} for layer in narrow["layers"])
        assert source.poll(0) == 1
        rt.call("set_precision", {"precision": "bf16"})
        signals()
        state = signals.last_state
        assert state is not None and state.placement_version != first.placement_version
        assert set(state.precision.values()) == {"bf16"}
        assert source.poll(0) == 1 and emitted[-1] is state
    finally:
        signals.close()
