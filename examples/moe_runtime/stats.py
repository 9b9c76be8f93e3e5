"""Routing statistics and counters, written by the model thread, read by /stats and the control socket."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypedDict

import numpy as np

from moescope.errors import UsageError
from moescope.stats_page import StatsPageWriter, held_peak, peak_bucket, roll_peaks

# Hotness (for prefetch) halves every this many steps of a layer.
HOTNESS_HALF_LIFE_STEPS = 32


# The per-layer fields of a `stats` reply (docs/control-protocol.md) that `fields` selects among; a
# runtime's descriptive layer keys (the transformers server's module, experts, top_k, shared) are
# always sent. The placement fields come too while `placement_since` is not the runtime's
# placement_version: a poller reads the large, rarely changing part only after it changed.
LAYER_FIELDS = ("tokens", "dropped", "rerouted_in", "queue_depth", "queue_peak", "last_step_tokens", "penalty",
                "device", "tier", "dtype", "precision", "offloaded", "loads", "entropy_bits", "capacity")
PLACEMENT_FIELDS = ("device", "tier", "dtype", "precision", "offloaded")
# Sent only when named: a per-expert field's entries that are not 0, as [expert, value] pairs (a
# poller at 58 x 256 experts reads the few busy queues instead of 14848 zeros)
SPARSE_FIELDS = {"queue_depth_sparse": "queue_depth", "queue_peak_sparse": "queue_peak", "penalty_sparse": "penalty"}


def sparse_pairs(values: list[int] | list[float]) -> list[list[int | float]]:
    """A per-expert list's non-zero entries as [expert, value] pairs, in expert order."""
    return [[expert, value] for expert, value in enumerate(values) if value]


def selected_layer_fields(fields: list[object] | None, placement_since: int | None,
                          placement_version: int) -> frozenset[str]:
    """The per-layer fields one `stats` call sends: every one without `fields`, else those named,
    plus the placement fields when `placement_since` is given and differs from placement_version.
    A name that is not a per-layer field is a usage error (one line, the known names)."""
    if fields is None:
        return frozenset(LAYER_FIELDS)
    unknown = [f for f in fields if not isinstance(f, str) or (f not in LAYER_FIELDS and f not in SPARSE_FIELDS)]
    if unknown:
        raise UsageError(f"stats: unknown field(s) {unknown!r}; per-layer fields: "
                         f"{[*LAYER_FIELDS, *SPARSE_FIELDS]}")
    wanted = frozenset(str(f) for f in fields)
    if placement_since is not None and placement_since != placement_version:
        wanted |= frozenset(PLACEMENT_FIELDS)
    return wanted


class StatsSnapshot(TypedDict):
    """`RuntimeStats.snapshot()`: per-layer lists (one value per expert, or per layer) and counters."""

    tokens: list[list[int]]
    dropped: list[list[int]]
    rerouted_in: list[list[int]]
    queue_depth: list[list[int]]
    queue_peak: list[list[int]]  # the deepest queue_depth in the last 200-400 ms (stats_page.held_peak)
    last_step_tokens: list[list[int]]
    loads: list[list[int]]
    entropy_bits: list[float]
    capacity: list[int]
    counters: dict[str, float]  # integer counts, and mean_batch_requests


class RuntimeStats:
    def __init__(self, *, layers: int, experts: int) -> None:
        self._lock = threading.Lock()
        self.layers = layers
        self.experts = experts
        shape = (layers, experts)
        self.tokens = np.zeros(shape, dtype=np.int64)
        self.dropped = np.zeros(shape, dtype=np.int64)
        self.rerouted_in = np.zeros(shape, dtype=np.int64)
        self.queue_depth = np.zeros(shape, dtype=np.int64)
        # the deepest queue_depth per 200 ms bucket, this one and the one before (stats_page.roll_peaks)
        self.queue_peak = np.zeros((2, *shape), dtype=np.int64)
        self._peak_bucket = 0  # the newest bucket queue_peak holds
        self.last_step_tokens = np.zeros(shape, dtype=np.int64)
        self.loads = np.zeros(shape, dtype=np.int64)
        self.hotness = np.zeros(shape, dtype=np.float64)
        self.entropy_bits = np.zeros(layers, dtype=np.float64)
        self.capacity = np.zeros(layers, dtype=np.int64)
        self._decay = 0.5 ** (1.0 / HOTNESS_HALF_LIFE_STEPS)
        self.counters: dict[str, int] = {
            "steps": 0, "requests_completed": 0, "requests_failed": 0, "requests_rejected": 0,
            "tokens_generated": 0, "tokens_prefilled": 0, "expert_loads": 0, "expert_load_bytes": 0,
            "max_batch_requests": 0, "multi_request_steps": 0, "step_errors": 0,
            # streamed answers; clients that went away mid-stream; requests dropped for that
            "streams": 0, "stream_disconnects": 0, "requests_cancelled": 0,
        }
        self._batch_requests_total = 0
        # The stats page (moescope/stats_page.py), which then holds queue_depth, tokens and
        # entropy_bits; version_key says what the rest of `stats` depends on (placement, capacity):
        # the page's version moves with it.
        self.page: StatsPageWriter | None = None
        self.version_key: Callable[[], object] = lambda: None
        self._queue_clear = True  # queue_depth is all 0 (idle() has nothing to write)

    def attach_page(self, page: StatsPageWriter, *, version_key: Callable[[], object]) -> None:
        """Keep queue depths, tokens and entropy in the page's arrays from now on: every write of
        them is one page update, seen by a reader as it happens (a prefill's queues while it runs)."""
        with self._lock:
            page.begin()
            try:
                page.queue_depth[...] = self.queue_depth
                page.queue_peak[...] = self.queue_peak
                page.set_peak_bucket(self._peak_bucket)
                page.tokens[...] = self.tokens
                page.entropy_bits[...] = self.entropy_bits
            finally:
                page.end(version_key())
            self.queue_depth, self.queue_peak = page.queue_depth, page.queue_peak
            self.tokens, self.entropy_bits = page.tokens, page.entropy_bits
            self.page, self.version_key = page, version_key

    def record_routing(self, *, layer: int, demand: np.ndarray, dropped: np.ndarray,
                       rerouted_in: np.ndarray, entropy_bits: float, capacity: int) -> None:
        with self._lock:
            page = self.page
            if page is not None:
                page.begin()
            try:
                self.tokens[layer] += demand
                self.queue_depth[layer] = demand
                bucket = peak_bucket(time.monotonic_ns())
                if bucket != self._peak_bucket:
                    roll_peaks(self.queue_peak, self._peak_bucket, bucket)
                    self._peak_bucket = bucket
                    if page is not None:
                        page.set_peak_bucket(bucket)
                held = self.queue_peak[bucket & 1, layer]
                np.maximum(held, demand, out=held)
                self.entropy_bits[layer] = entropy_bits
            finally:
                if page is not None:
                    page.end()
            self._queue_clear = False
            self.dropped[layer] += dropped
            self.rerouted_in[layer] += rerouted_in
            self.last_step_tokens[layer] = demand
            self.hotness[layer] = self.hotness[layer] * self._decay + demand
            self.capacity[layer] = capacity

    def record_load(self, *, layer: int, expert: int, bytes_moved: int) -> None:
        with self._lock:
            self.loads[layer, expert] += 1
            self.counters["expert_loads"] += 1
            self.counters["expert_load_bytes"] += bytes_moved

    def record_step(self, *, requests: int, prefill_tokens: int, decode_tokens: int) -> None:
        with self._lock:
            c = self.counters
            c["steps"] += 1
            c["tokens_prefilled"] += prefill_tokens
            c["tokens_generated"] += decode_tokens
            c["max_batch_requests"] = max(c["max_batch_requests"], requests)
            if requests > 1:
                c["multi_request_steps"] += 1
            self._batch_requests_total += requests
            if self.page is not None:
                self.page.note_version(self.version_key())

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def idle(self) -> None:
        """Nothing is queued for any expert when no request is running."""
        with self._lock:
            if self._queue_clear:
                return  # (called every 0.5 s while idle)
            page = self.page
            if page is not None:
                page.begin()
            try:
                self.queue_depth[:] = 0
            finally:
                if page is not None:
                    page.end()
            self._queue_clear = True

    def hotness_lists(self) -> tuple[list[list[float]], list[list[int]]]:
        with self._lock:
            return self.hotness.tolist(), self.tokens.tolist()

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            counters: dict[str, float] = dict(self.counters)
            steps = counters["steps"]
            counters["batches"] = steps
            counters["mean_batch_requests"] = round(self._batch_requests_total / steps, 3) if steps else 0.0
            return {
                "tokens": self.tokens.tolist(),
                "dropped": self.dropped.tolist(),
                "rerouted_in": self.rerouted_in.tolist(),
                "queue_depth": self.queue_depth.tolist(),
                "queue_peak": held_peak(self.queue_peak, self._peak_bucket, peak_bucket(time.monotonic_ns())).tolist(),
                "last_step_tokens": self.last_step_tokens.tolist(),
                "loads": self.loads.tolist(),
                "entropy_bits": self.entropy_bits.tolist(),
                "capacity": self.capacity.tolist(),
                "counters": counters,
            }
