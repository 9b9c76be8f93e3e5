"""Policy signals read from the runtime's own `stats` (control socket), one poll per sample period.

The trace pipeline is the policy's main signal source (it has the p99s from NVTX and the kernel).
This source needs only the control socket, so the policy can run on any runtime speaking
moescope-control/1 — and on the reference runtime before, or without, the NVTX pipeline:

- device_memory_used_ratio: the worst device's `used_ratio`;
- expert_queue_tokens: per (layer, expert) the deepest of `queue_depth` and `queue_peak` (the
  deepest queue of the last 200-400 ms, where the runtime reports it: a prefill's queue lasts one
  step, which a 200 ms poll of `queue_depth` alone saw by chance); an expert stays reported (0
  included) for `sticky_s` after it was last at or past `queue_floor` or penalised, so a rule that
  fired on it sees it clear. `queue_floor` (``queue_floor_for(rules)``: the lowest fire or clear
  threshold of the rules on this signal, all firing upward; else 0, every non-zero queue) keeps the
  snapshot to the experts a rule can act on: under a production batch nearly every expert of
  58 x 256 has some queue within 200-400 ms, and a dict of all of them every period was ~1-2 ms;
  a value under the floor reads as 0 (the same to every such rule: under its clear threshold);
- expert_load_gini: Gini of the tokens routed per expert in the last `window_s` (deltas of the
  cumulative `tokens`), per layer, via moescope.agent.routing_health;
- router_entropy_ratio: the token-weighted mean over `window_s` of `entropy_bits` / log2 E, per layer;
- step_p99_ms, expert_load_p99_ms, request_p99_ms: NaN (not in stats: the pipeline's).

Each poll asks for narrowed stats (`fields`, `placement_since`: docs/control-protocol.md): the
per-layer queues and penalties every period (tokens and entropy while routing is read here), the
per-expert placement only after the runtime's placement_version moved. A runtime that refuses the
arguments gets whole stats.

A runtime that names a stats page in its reply (`stats_page`: moescope/stats_page.py, the reference
runtime's default) is read from the page in the periods between: one `pread`, no call, no wake-up
of the runtime. Beside NVTX (routing not read here) such a period takes only the queues and
penalties, from the page's arrays in numpy, and keeps the state as the last call left it (the
placement, pools and model it is kept for: a change to them moves the page's version, and the next
period calls); with routing it makes the state of the page (``RuntimeState.with_page``). The
socket is asked again when the page's version moved (placement, precision or a pool changed), when
the connection shows the runtime gone, and at least every ``PAGE_REFRESH_S``. A page that cannot
be opened or goes wrong is counted (``page_errors``), logged once, and the socket serves every
period of that connection.

A failed poll yields a snapshot with no data (every rule holds its state) and is counted.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from moescope.agent.policy.actuator import PLACEMENT_FIELDS, CommandFailed, ControlConnection, RuntimeState
from moescope.agent.policy.rules import RuleSpec, Signals, fires_upward, make_signals, vouch_expert_values
from moescope.agent.routing_health import LayerRouting, RoutingHealthWindow, normalised_router_entropy
from moescope.collectors.registry import SourceHealth
from moescope.stats_page import LAYOUT_NAME, PageBusy, PageSnapshot, StatsPageError, StatsPageReader

log = logging.getLogger(__name__)

# The per-layer stats fields every period reads (the queue rule, its stickiness), and those that
# only the runtime's own routing view needs (NVTX off)
NARROW_FIELDS = ("queue_depth_sparse", "queue_peak_sparse", "penalty_sparse")  # the non-zero entries only
ROUTING_FIELDS = ("tokens", "entropy_bits")
# With a stats page, `stats` over the socket at least this often: the rest of the reply (memory,
# model) is held between, and a runtime that stopped answering shows up within it.
PAGE_REFRESH_S = 5.0
QUEUE_SIGNAL = "expert_queue_tokens"


def queue_floor_for(rules: Iterable[RuleSpec]) -> float:
    """The smallest queue a rule on expert_queue_tokens can act on: the lowest of their fire and
    clear thresholds when every one fires upward (a lower value is under each one's clear threshold,
    as 0 is), else 0 (every non-zero queue is reported)."""
    specs = [spec for spec in rules if spec.signal == QUEUE_SIGNAL and spec.enabled]
    if not specs or not all(fires_upward(spec.comparison) for spec in specs):
        return 0.0
    return max(0.0, min(min(spec.fire, spec.clear) for spec in specs))


class RuntimeStatsSignals:
    def __init__(
        self,
        socket_path: Path | str,
        *,
        timeout_s: float,
        window_s: float = 10.0,
        sticky_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
        use_page: bool = True,
        runtime_pid: int | None = None,
        queue_floor: float = 0.0,
    ) -> None:
        self.socket_path = Path(socket_path)
        self.queue_floor = queue_floor  # queues under it are not reported (queue_floor_for)
        self.timeout_s = timeout_s
        self.window_s = window_s
        self.sticky_s = sticky_s
        self.clock = clock
        self.polls = 0
        self.poll_errors = 0
        self._conn: ControlConnection | None = None
        self._health: RoutingHealthWindow | None = None
        self._prev_tokens: dict[int, np.ndarray] = {}
        self._last_busy_s: dict[tuple[int, int], float] = {}
        self._queue_shape: tuple[int, int] | None = None  # the shape _last_busy_s's keys were checked in
        # the last queue signal made of a page with no busy expert: (that PageBusy, the signal, until
        # when it stands: the first sticky expert's expiry). An idle runtime's page is the same
        # object period after period (StatsPageReader.read_busy): the signal is too.
        self._idle_queue: tuple[PageBusy, dict[tuple[int, int], float], float] | None = None
        self.last_state: RuntimeState | None = None
        # The last read's outcome (None: not read yet), for RuntimeStatsSource.health().
        self.last_read_ok: bool | None = None
        self.last_read_error: str | None = None
        # Routing health from the runtime's cumulative token counts (Gini, entropy per layer): the
        # agent turns it off while NVTX gives it the same per step.
        self.with_routing = True
        # Whether the runtime answers narrowed stats (None: not asked yet; False: it refused them)
        self.narrowed: bool | None = None
        self._placement_held = False  # last_state's placement is this connection's runtime's
        self.page: StatsPageReader | None = None
        self.page_periods = 0  # periods read from the stats page alone
        self.page_errors = 0  # pages refused or gone wrong (the socket serves instead)
        self.use_page = use_page  # False: every period over the socket (benchmarks compare the two)
        # The runtime's pid as this process sees it, where known: its page is opened through
        # /proc/PID/root, since a runtime in a container names a path in its own mount namespace.
        self.runtime_pid = runtime_pid
        self._page_tried = False  # this connection's runtime's page was tried (once per connection)
        self._page_version: int | None = None  # the page version last_state is up to date with
        self._socket_read_s = -math.inf  # when `stats` was last read over the socket
        # the last page snapshot read, the state made of it, and (routing, floor) it was made with:
        # a reader hands the same snapshot back while the page had no update (an idle runtime)
        self._from_page: tuple[PageSnapshot, RuntimeState, tuple[bool, float]] | None = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        # the next connection may reach another runtime (a restart on the same socket path): its
        # placement is read whole, whether it takes narrowed stats is asked again, its page opened anew
        self.narrowed = None
        self._placement_held = False
        self._close_page()
        self._page_tried = False

    def _close_page(self) -> None:
        if self.page is not None:
            self.page.close()
            self.page = None
        self._page_version = None
        self._from_page = None

    def _page_error(self, exc: StatsPageError) -> None:
        self.page_errors += 1
        if self.page_errors == 1:
            log.warning("policy: %s; reading `stats` over the socket (counting further page errors)", exc)
        self._close_page()

    def _read_page(self) -> PageSnapshot | PageBusy | None:
        """This period's page: whole with routing, else only its busy experts (what _queue reads)."""
        page = self.page
        if page is None:
            return None
        try:
            if self.with_routing:
                return page.read(routing=True)
            return page.read_busy(self._floor())
        except StatsPageError as exc:
            self._page_error(exc)
            return None

    def _open_page(self, result: dict[str, Any], state: RuntimeState) -> None:
        """The page a `stats` reply names, opened once per connection: owned by the control
        socket's owner, of the reply's shape and pid. Not named: nothing to do."""
        self._page_tried = True
        named = result.get("stats_page")
        if named is None:
            return
        try:
            if (not isinstance(named, dict) or named.get("layout") != LAYOUT_NAME
                    or not isinstance(named.get("path"), str)):
                raise StatsPageError(f"stats page {named!r}: not a {LAYOUT_NAME} page")
            pid = result.get("pid")
            if not isinstance(pid, int) or isinstance(pid, bool):
                raise StatsPageError("stats page: the reply carries no pid")
            path = named["path"]
            if self.runtime_pid is not None and path.startswith("/"):
                path = f"/proc/{self.runtime_pid}/root{path}"
            self.page = StatsPageReader.open(path, layers=state.layers, experts=state.experts, pid=pid,
                                             owner_uid=os.stat(self.socket_path).st_uid)
        except (StatsPageError, OSError) as exc:
            self._page_error(exc if isinstance(exc, StatsPageError) else StatsPageError(f"stats page: {exc}"))

    def _read(self, now_s: float) -> tuple[RuntimeState, PageBusy | None]:
        """This period's state, and the page its queues and penalties are to be read from (None:
        the state's own, from a call or made of the page with routing)."""
        if self._conn is not None and self._conn.peer_gone():
            self.close()  # the runtime went (or let this connection go): a fresh connection, its page anew
        page = self._read_page()  # (a page is open only while its connection is)
        held = self.last_state
        if (page is not None and held is not None and page.version == self._page_version
                and now_s - self._socket_read_s < PAGE_REFRESH_S):
            self.page_periods += 1
            if not self.with_routing:
                # beside NVTX a period needs only the queues and penalties: read from the page's
                # busy experts by _queue; the state (placement, pools, model: what it is kept for) stands
                assert isinstance(page, PageBusy)
                return held, page
            made = self._from_page
            key = (self.with_routing, self.queue_floor)
            if made is not None and made[0] is page and made[1] is held and made[2] == key:
                return held, None  # the page had no update since (StatsPageReader.read): the same state
            assert isinstance(page, PageSnapshot)
            state = held.with_page(page, routing=self.with_routing, queue_floor=self.queue_floor)
            self._from_page = (page, state, key)
            return state, None
        if self._conn is None:
            self._conn = ControlConnection(self.socket_path, timeout_s=self.timeout_s)
        try:
            narrowed = self._read_narrowed(self._conn) if self.narrowed is not False else None
            if narrowed is not None:
                result, state = narrowed
            else:
                result = self._conn.call("stats")
                state = RuntimeState.from_stats(result)
            self._socket_read_s = now_s
            # the version read before this call: a change since makes the next period call again
            self._page_version = page.version if page is not None else None
            if self.use_page and not self._page_tried:
                self._open_page(result, state)
            return state, None
        except CommandFailed:
            self.close()  # a fresh connection next period
            raise
        finally:
            if self._conn is not None:
                self._conn.results.clear()  # a long-lived connection keeps no history

    def _read_narrowed(self, conn: ControlConnection) -> tuple[dict[str, Any], RuntimeState] | None:
        """`stats` narrowed to what a period needs: queues and penalties (tokens and entropy too
        while routing is read here), the placement only when its version moved since the held one.
        At 48 layers x 128 experts the whole reply is ~400 KB and ~20 ms for each side to build and
        read; narrowed it is the queues'. None when the runtime refuses the arguments (an older
        moescope-control/1 runtime: unknown arguments are an error there): whole stats from then on.
        Returns the reply with its state."""
        held = self.last_state
        fields = list(NARROW_FIELDS + (ROUTING_FIELDS if self.with_routing else ()))
        args: dict[str, object] = {"fields": fields}
        if held is not None and held.placement_version is not None and self._placement_held:
            args["placement_since"] = held.placement_version
        else:
            fields += PLACEMENT_FIELDS  # nothing held to compare with: this period reads it
        try:
            result = conn.call("stats", args)
        except CommandFailed as exc:
            if exc.outcome not in ("refused", "unsupported") or self.narrowed:
                raise  # (a runtime that took narrowed stats before and refuses now is failing, not older)
            self.narrowed = False
            log.info("policy: the runtime does not take narrowed stats (%s); reading whole stats", exc)
            return None
        self.narrowed = True
        state = RuntimeState.from_stats(result, previous=held if self._placement_held else None)
        self._placement_held = state.placement_version is not None
        return result, state

    def __call__(self) -> Signals:
        now_s = self.clock()
        return make_signals(now_s, self.read_values(now_s))

    def read_values(self, now_s: float) -> dict[str, Any]:
        """This period's signals as Signals field values (what ``__call__`` makes its snapshot of;
        empty when the read failed): the agent adds them to the pipeline's snapshot, one a period."""
        self.polls += 1
        try:
            state, page = self._read(now_s)
        except CommandFailed as exc:
            self.poll_errors += 1
            self.last_read_ok, self.last_read_error = False, str(exc)
            if self.poll_errors == 1:
                log.warning("policy: cannot read runtime stats: %s (counting further failures)", exc)
            return {}
        self.last_read_ok, self.last_read_error = True, None
        self.last_state = state  # the agent's live view shows precision and residency from it
        now_ns = int(now_s * 1e9)
        if not self.with_routing:
            self._health, self._prev_tokens = None, {}  # a baseline again if routing is turned back on
            return {"device_memory_used_ratio": self._memory_ratio(state),
                    "expert_queue_tokens": self._queue(state, now_s, page)}
        experts = state.experts
        if self._health is None or self._health.num_experts != experts:
            self._health = RoutingHealthWindow(duration_ns=int(self.window_s * 1e9), num_experts=experts)
            self._prev_tokens = {}
        routings = []
        for layer in range(state.layers):
            total = np.array([int(state.tokens[(layer, e)]) for e in range(experts)], dtype=np.int64)
            prev = self._prev_tokens.get(layer)
            self._prev_tokens[layer] = total
            if prev is None:
                continue  # the first poll is the baseline: cumulative counts are not a window
            routings.append(
                LayerRouting(
                    layer=layer,
                    tokens_per_expert=np.maximum(total - prev, 0),
                    dropped_per_expert=np.zeros(experts, dtype=np.int64),
                    router_entropy_bits=state.entropy_bits.get(layer, math.nan),
                )
            )
        if routings:
            self._health.add_step(now_ns, routings)
        gini: dict[int, float] = {}
        entropy: dict[int, float] = {}
        for layer in self._health.layers():
            gini[layer] = self._health.layer_stats(layer, now_ns).gini
            entropy[layer] = normalised_router_entropy(self._health.router_entropy_bits(layer, now_ns), experts)
        return {"device_memory_used_ratio": self._memory_ratio(state),
                "expert_queue_tokens": self._queue(state, now_s),
                "expert_load_gini": gini, "router_entropy_ratio": entropy}

    def _floor(self) -> float:
        return max(self.queue_floor, 1e-9)  # (0: any queue above 0)

    def _queue(self, state: RuntimeState, now_s: float,
               page: PageBusy | None = None) -> dict[tuple[int, int], float]:
        # A penalised expert is reported too, so a penalty taken over at start sees its queue clear.
        # Python runs per expert at or past the floor only: the experts reported for stickiness
        # alone (0.0) are copied, expired and range-checked in C-driven passes (a busy production
        # runtime has most of 58 x 256 experts sticky, and a loop over them was ~1 us each a period).
        floor = self._floor()
        layers, experts = state.layers, state.experts
        last = self._last_busy_s
        if (layers, experts) != self._queue_shape:  # a new runtime: what is held is checked again
            for key in [key for key in last if not (0 <= key[0] < layers and 0 <= key[1] < experts)]:
                del last[key]
            self._queue_shape = (layers, experts)
        idle = self._idle_queue
        if idle is not None and page is idle[0] and now_s <= idle[2]:
            return vouch_expert_values(idle[1])  # no update since, nothing busy in it, no sticky expert expired yet
        self._idle_queue = None
        queued: dict[tuple[int, int], float]  # the experts at or past the floor, with their queue
        if page is not None:  # (a period beside NVTX served by the runtime's page: _read)
            # its busy experts, made by the page's reader in one pass (StatsPageReader.read_busy; the
            # page is of this state's shape: checked when it was opened)
            queued, penalised = page.queued, page.penalised
        else:
            depth = state.queue_depth  # (narrowed: only the non-zero entries; an expert left out is 0)
            peak = state.queue_peak
            queued = {key: max(value, peak.get(key, 0)) for key, value in depth.items() if value >= floor}
            queued.update({key: max(value, depth.get(key, 0)) for key, value in peak.items() if value >= floor})
            penalised = [key for key, penalty in state.penalty.items() if penalty > 0]
        busy = [*queued, *penalised]
        # (a key past the shape, from a runtime's bad reply, is never reported)
        last.update(dict.fromkeys([key for key in busy if 0 <= key[0] < layers and 0 <= key[1] < experts], now_s))
        sticky_s = self.sticky_s
        if any(now_s - last_s > sticky_s for last_s in last.values()):
            for key in [key for key, last_s in last.items() if now_s - last_s > sticky_s]:
                del last[key]
        queue = dict.fromkeys(last, 0.0)
        for key, value in queued.items():
            if key in queue:
                queue[key] = float(value)
        if page is not None and not busy:
            self._idle_queue = (page, queue, min(last.values(), default=math.inf) + sticky_s)
        # its keys are the checked (int, int) of `last`, its values floats: Signals.targets reads it as it is
        return vouch_expert_values(queue)

    @staticmethod
    def _memory_ratio(state: RuntimeState) -> float:
        ratios = [float(m["used_ratio"]) for m in state.memory.values()]
        return max(ratios) if ratios else math.nan


class RuntimeStatsSource:
    """A daemon source of ``RuntimeState`` records: the runtime's stats that the policy's poller
    (``RuntimeStatsSignals``, on the policy thread) last read, emitted once each on the daemon thread,
    so per-layer precision and residency reach spans and the live view through the join. A state
    that shows the same as the one emitted before it (``RuntimeState.same_view``: same placement
    version, pools and model) is counted, not emitted again."""

    name = "runtime-stats"

    def __init__(self, signals: RuntimeStatsSignals, *, emit: Callable[[object], None]) -> None:
        self.signals = signals
        self._emit = emit
        self._last: RuntimeState | None = None
        self.emitted = 0
        self.unchanged = 0  # states read that equal the last one emitted: not emitted again
        self._last_poll_duration_ns: int | None = None

    def poll(self, now_ns: int) -> int:
        started_ns = time.monotonic_ns()
        try:
            return self._poll_once()
        finally:
            self._last_poll_duration_ns = time.monotonic_ns() - started_ns

    def _poll_once(self) -> int:
        state = self.signals.last_state  # one attribute read: the policy thread replaces it whole
        if state is None or state is self._last:
            return 0
        previous, self._last = self._last, state
        if previous is not None and state.same_view(previous):
            # An idle runtime answers the same stats every period, and a busy one the same
            # placement and pools with new queues: the join and the live view show only the former,
            # so a state that shows the same changes nothing downstream (and the join's work is skipped).
            self.unchanged += 1
            return 0
        self._emit(state)
        self.emitted += 1
        return 1

    def health(self) -> SourceHealth:
        """This source's last poll's duration; success is the policy poller's last read (the
        control-socket `stats` call), which is where this source's data can fail."""
        return SourceHealth(self._last_poll_duration_ns, self.signals.last_read_ok, self.signals.last_read_error)

    def stats(self) -> dict[str, int]:
        # "records": every state taken from the poller (the live view's rate of this source), also
        # those equal to the previous one and so not emitted again ("records_unchanged").
        # "page_periods": periods read from the runtime's stats page without a call; "page_errors":
        # pages refused or gone wrong (the socket served instead)
        signals = self.signals
        return {"records": self.emitted + self.unchanged, "records_unchanged": self.unchanged,
                "polls_failed": signals.poll_errors, "page_periods": signals.page_periods,
                "page_errors": signals.page_errors}

    def close(self) -> None:
        return None
