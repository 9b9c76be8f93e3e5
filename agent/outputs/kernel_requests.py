"""The live view's request numbers (rate, p50/p95/p99, unanswered) from the ingress probe's
in-kernel aggregate, over a sliding window: exact at any rate, whatever happens to per-request
records (ring full, sampled out).

A daemon tick hook reads the cumulative totals every ``period_ns`` (250 ms); the window's numbers
are the difference between the newest reading and the oldest one inside the window, so a rate or
a percentile covers ``window_s`` of requests up to the last reading (at most one period old).
Percentiles are nearest rank over the kernel's log-linear histogram (within 3.1 % of the exact
value: probes/ingress/aggregate.py).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

from moescope.agent import state as st
from moescope.probes.ingress.aggregate import RequestTotals

DEFAULT_PERIOD_NS = 250_000_000
# (the two readings' times, seconds between them, their difference, the newest reading)
_Delta = tuple[tuple[int, int], float, RequestTotals, RequestTotals]


class KernelRequestWindow:
    def __init__(
        self,
        read: Callable[[], RequestTotals],
        *,
        window_ns: int,
        period_ns: int = DEFAULT_PERIOD_NS,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        if window_ns <= 0 or period_ns <= 0:
            raise ValueError(f"window and period must be > 0 ns, got {window_ns}, {period_ns}")
        self._read = read
        self.window_ns = window_ns
        self.period_ns = period_ns
        self._clock = clock
        self._lock = threading.Lock()  # tick on the daemon thread; panel/p99 on the publisher's, the policy's
        self._readings: deque[tuple[int, RequestTotals]] = deque()
        self._last_ns: int | None = None
        # The last difference, by the readings it spans: the policy asks for the p99 five times a
        # second and the live view for the panel, while the readings change every period.
        self._delta_cache: _Delta | None = None
        self._p99_cache: tuple[tuple[int, int], float] | None = None  # the p99 of that difference
        # the oldest and newest readings (None before two): what _delta reads, five times a second
        # on the policy's thread, without taking the lock (one lock round trip was ~5 µs of a wake)
        self._ends: tuple[tuple[int, RequestTotals], tuple[int, RequestTotals]] | None = None

    def tick(self, now_ns: int) -> None:
        """Daemon tick hook: a reading every period."""
        if self._last_ns is not None and now_ns - self._last_ns < self.period_ns:
            return None
        self.sample(now_ns)
        return None

    def sample(self, now_ns: int | None = None) -> None:
        now = self._clock() if now_ns is None else now_ns
        totals = self._read()
        with self._lock:
            self._last_ns = now
            self._readings.append((now, totals))
            # keep the newest reading at or before the window's start as the base of the difference
            horizon = now - self.window_ns
            while len(self._readings) > 1 and self._readings[1][0] <= horizon:
                self._readings.popleft()
            readings = self._readings
            # the window's two ends, replaced whole: readers take them without the lock
            self._ends = (readings[0], readings[-1]) if len(readings) >= 2 else None

    def _delta(self) -> _Delta | None:
        """(the readings' times, seconds covered, the difference, the newest reading); None before
        two readings. The difference is computed once per pair of readings."""
        ends = self._ends  # (one attribute read: sample() replaces it whole)
        if ends is None:
            return None
        (first_ns, first), (last_ns, last) = ends
        key = (first_ns, last_ns)
        cached = self._delta_cache
        if cached is not None and cached[0] == key:
            return cached
        found = key, (last_ns - first_ns) / 1e9, last - first, last
        self._delta_cache = found
        return found

    def p99_ms(self) -> float:
        """p99 kernel latency over the window (ms); NaN when no request was answered in it."""
        found = self._delta()
        if found is None:
            return math.nan
        held = self._p99_cache
        if held is not None and held[0] == found[0]:
            return held[1]
        value = found[2].percentile_ns(99)
        p99 = math.nan if value is None else value / 1e6
        self._p99_cache = (found[0], p99)
        return p99

    def panel(self) -> st.Requests:
        """The Requests panel of the live-state snapshot."""
        found = self._delta()
        if found is None:
            return st.Requests(window_s=self.window_ns / 1e9)
        _, seconds, delta, last = found

        def ms(pct: float) -> float | None:
            value = delta.percentile_ns(pct)
            return None if value is None else value / 1e6

        return st.Requests(
            window_s=self.window_ns / 1e9,
            rate_per_s=delta.requests / seconds if seconds > 0 else None,
            latency_p50_ms=ms(50),
            latency_p95_ms=ms(95),
            latency_p99_ms=ms(99),
            errors_total=last.unanswered,
            errors_per_s=delta.unanswered / seconds if seconds > 0 else None,
        )
