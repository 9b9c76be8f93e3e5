"""Which per-request records become Python objects (and so spans) when more arrive than the agent
is set to handle: the sampling rule under overload.

Every request is counted in the kernel aggregate whatever happens here (aggregate.py); this only
decides which of the drained ring records are decoded and handed on. The rule, per drain:

* a token bucket fills at `records_per_s` (holding at most one second's worth); a batch that fits
  in it is kept whole (no overload: no sampling);
* otherwise every unanswered request (closed before any response byte: the error case the kernel
  can see) and the slowest 1 % of the batch (at least one record) are kept, and of the rest 1 in N
  with N = ceil(rest / what the bucket still holds), taken evenly by a counter that carries across
  batches;
* what is not kept is counted as `sampled_out`, apart from every loss (`ringbuf_full` ...).

`records_per_s = 0` turns sampling off (every record kept).
"""

from __future__ import annotations

import math

import numpy as np

SLOW_FRACTION = 0.01  # the slowest 1 % of an overloaded batch is always kept


class RecordSampler:
    def __init__(self, *, records_per_s: int, flag_no_response: int) -> None:
        if records_per_s < 0:
            raise ValueError(f"records_per_s must be >= 0, got {records_per_s}")
        self.records_per_s = records_per_s
        self._no_response = flag_no_response
        self._tokens = float(records_per_s)
        self._last_ns: int | None = None
        self._phase = 0  # position in the current 1-in-N cycle, carried across batches

    def select(self, events: np.ndarray, now_ns: int) -> np.ndarray | None:
        """Indices of the rows of `events` to keep, ascending; None when every row is kept."""
        n = int(events.size)
        if self.records_per_s == 0 or n == 0:
            return None
        if self._last_ns is not None and now_ns > self._last_ns:
            refill = (now_ns - self._last_ns) / 1e9 * self.records_per_s
            self._tokens = min(float(self.records_per_s), self._tokens + refill)
        self._last_ns = now_ns if self._last_ns is None else max(now_ns, self._last_ns)
        if n <= self._tokens:
            self._tokens -= n
            return None
        latency = events["end_ns"].astype(np.int64) - events["start_ns"].astype(np.int64)
        keep = (events["flags"] & self._no_response) != 0
        slow = max(1, math.ceil(n * SLOW_FRACTION))
        threshold = np.partition(latency, n - slow)[n - slow]
        keep |= latency >= threshold
        rest = np.flatnonzero(~keep)
        room = int(self._tokens) - int(np.count_nonzero(keep))
        if rest.size and room > 0:
            every = math.ceil(rest.size / room)
            positions = (self._phase + np.arange(rest.size)) % every
            keep[rest[positions == 0]] = True
            self._phase = int((self._phase + rest.size) % every)
        kept = np.flatnonzero(keep)
        self._tokens = max(0.0, self._tokens - kept.size)
        return kept
