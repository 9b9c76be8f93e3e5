"""The moe/v2 (and v1) NVTX emitter (docs/nvtx-convention.md): message names, payload types and
the one reusable-attributes producer that every moescope-side producer uses — the reference
runtime (examples/moe_runtime) and `moescope.instrument()` for Hugging Face transformers models
(moescope/hf/).

v2 (the default) emits O(layers) events per step: per layer one `moe.routing` mark whose payload
is the layer's routing vector (tokens routed per expert, then tokens over capacity per expert) and
one `moe.experts` range around the layer's experts, with the experts' compute times as one vector.
v1 emits one mark per expert with tokens and one `moe.expert.ffn` range per expert run.
Per step, v2 names the step's requests with one `moe.step.requests` vector (keys, input tokens,
output tokens: moe/v2.1); v1 marks each request key (`moe.request`).

The v2.2 compact form (`CompactStep`, from `compact_step()`): per layer only a `moe.layer` range, per
step one `moe.step.routing` and one `moe.step.entropy` vector, both *held*: a 0-d structured numpy
array bound once to its attributes object, which the producer refills in place (the `nvtx` package
keeps a pointer to a 0-d array's own bytes instead of copying it per set), so a step's vectors cost
two bare marks.

Only the model thread emits. Messages come from the fixed set MESSAGES, registered once at start
(registered strings are cached by the producer: a unique string per event would leak). With no
NVTX tool attached `nvtx.get_domain` returns a dummy domain and every call here is an empty method.
Neutral: imports numpy and nvtx only (a serving process imports it; so may the agent's tests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import nvtx
from nvtx._lib.lib import DummyDomain

CONVENTIONS = ("v2", "v1")
DEFAULT_CONVENTION = "v2"
DOMAIN_NAME = "moe"

MSG_STEP = "moe.step"
MSG_REQUEST = "moe.request"
MSG_LAYER = "moe.layer"
MSG_ROUTER = "moe.router"
MSG_EXPERT_TOKENS = "moe.expert.tokens"
MSG_EXPERT_DROPPED = "moe.expert.dropped"
MSG_EXPERT_LOAD = "moe.expert.load"
MSG_EXPERT_FFN = "moe.expert.ffn"
MSG_ROUTING = "moe.routing"
MSG_EXPERTS = "moe.experts"
MSG_EXPERTS_TIME = "moe.experts.time"
MSG_STEP_DEVICE = "moe.step.device"
MSG_STEP_ROUTING = "moe.step.routing"
MSG_STEP_REQUESTS = "moe.step.requests"
MSG_STEP_ENTROPY = "moe.step.entropy"  # v2.2 compact form (docs/nvtx-convention.md): CompactStep sends it
ROUTING_PLACES = ("layer", "step")  # v2: a routing vector per layer, or one for the whole step
# In the order of the convention's table (tests/runtime/test_docs.py checks).
MESSAGES: tuple[str, ...] = (
    MSG_STEP, MSG_REQUEST, MSG_STEP_REQUESTS, MSG_LAYER, MSG_ROUTER, MSG_ROUTING, MSG_EXPERTS, MSG_EXPERTS_TIME,
    MSG_STEP_DEVICE, MSG_STEP_ROUTING, MSG_STEP_ENTROPY,
    MSG_EXPERT_TOKENS, MSG_EXPERT_DROPPED, MSG_EXPERT_LOAD, MSG_EXPERT_FFN,
)


class NvtxDomainLike(Protocol):
    """The subset of `nvtx.Domain` this module uses (tests pass a recording implementation)."""

    def get_registered_string(self, string: str) -> Any: ...
    def get_event_attributes(self, message: Any = None, color: Any = None, category: Any = None,
                             payload: Any = None) -> Any: ...
    def push_range(self, attributes: Any = None) -> None: ...
    def pop_range(self) -> None: ...
    def mark(self, attributes: Any = None) -> None: ...


class Instrumentation:
    """No-op instrumentation: used when disabled or when no NVTX tool is attached."""

    active = False
    convention = DEFAULT_CONVENTION
    # What the model loop should do for this convention (the no-op one asks for nothing).
    expert_ranges = False  # one moe.expert.ffn range per expert run (v1)
    expert_times = False  # time each expert's compute for moe.experts.time (v2)

    def step_push(self, tokens: int) -> None:
        pass

    def request_mark(self, request_key: int) -> None:
        pass

    def step_requests(self, keys: Sequence[int], input_tokens: Sequence[int], output_tokens: Sequence[int]) -> None:
        """The step's requests, inside moe.step before the first layer: per request its key, the
        prompt tokens this step processed and the tokens it generated. This base (and v1) marks
        each key; v2 sends one moe.step.requests vector."""
        for key in keys:
            self.request_mark(key)

    def layer_push(self, layer: int, num_experts: int) -> None:
        pass

    def router_push(self, layer: int, entropy_bits: float) -> None:
        pass

    def expert_tokens_mark(self, expert: int, tokens: int) -> None:
        pass

    def expert_dropped_mark(self, expert: int, tokens: int) -> None:
        pass

    def routing(self, layer: int, demand: np.ndarray, dropped: np.ndarray) -> None:
        """The router's decision for the layer, inside its moe.router range."""

    def experts_push(self, layer: int, assignments: int) -> None:
        pass

    def experts_time_mark(self, layer: int, time_us: np.ndarray) -> None:
        pass

    def experts_pop(self) -> None:
        pass

    def step_device_mark(self, time_us: np.ndarray) -> None:
        """v2 moe.step.device: each layer's device time of its experts, µs, after the last layer."""

    def load_push(self, expert: int, bytes_moved: int) -> None:
        pass

    def ffn_push(self, expert: int, tokens: int) -> None:
        pass

    def pop(self) -> None:
        """Ends the innermost open range (NVTX ranges nest per thread)."""

    def step_pop(self) -> None:
        """Ends the moe.step range (v2 per-step routing: after sending the step's routing vector)."""

    def compact_step(self, layer_experts: Sequence[int], layer_ids: Sequence[int] | None = None) -> CompactStep:
        """The v2.2 compact emission of steps whose layers (in index order: `layer_ids`, default
        0..L-1) have these E: its vectors are real buffers to fill; this no-op one emits nothing."""
        return CompactStep(layer_experts, domain=None, layer_ids=layer_ids)


class NvtxInstrumentation(Instrumentation):
    """Emits the moe/v2 (or v1) ranges and marks through an NVTX domain. Not thread-safe: the
    attribute objects are reused, so only the model thread may call it."""

    active = True

    def __init__(self, *, domain: NvtxDomainLike, convention: str = DEFAULT_CONVENTION,
                 expert_ranges: bool | None = None, routing_place: str = "layer") -> None:
        if convention not in CONVENTIONS:
            raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
        if routing_place not in ROUTING_PLACES:
            raise ValueError(f"routing_place must be one of {ROUTING_PLACES}, got {routing_place!r}")
        # per step: the layers' vectors are kept and sent as one payload when the step ends (one
        # payload per step costs a Python producer ~8 µs instead of ~8 µs per layer)
        self._step_rows: list[np.ndarray] | None = [] if convention == "v2" and routing_place == "step" else None
        self.convention = convention
        self.v2 = convention == "v2"
        # v1 needs the per-expert ranges; v2 may keep them (a looping runtime has them to give)
        self.expert_ranges = (not self.v2) if expert_ranges is None else expert_ranges
        self.expert_times = self.v2
        self._domain = domain
        # Pre-register the fixed message set and build one reusable attributes object per message.
        self._attrs = {m: domain.get_event_attributes(message=m) for m in MESSAGES}
        # moe.step's attributes and the payload they hold: a step of as many tokens as the last
        # (a steady decode batch) is pushed as it is
        self._step_attrs = self._attrs[MSG_STEP]
        self._step_tokens: int | None = None
        self._push = domain.push_range
        self._pop = domain.pop_range
        self._mark = domain.mark

    # Setting attributes in place then pushing costs about half of passing keyword arguments
    # (measured 180 vs 370 ns per push+pop with an injected tool; see README "Overhead").

    def step_push(self, tokens: int) -> None:
        a = self._step_attrs
        if tokens != self._step_tokens:  # the package's payload setter costs more than this compare
            a.payload = self._step_tokens = int(tokens)
        self._push(a)

    def request_mark(self, request_key: int) -> None:
        a = self._attrs[MSG_REQUEST]
        a.payload = int(request_key)
        self._mark(a)

    def step_requests(self, keys: Sequence[int], input_tokens: Sequence[int], output_tokens: Sequence[int]) -> None:
        if not self.v2:
            for key in keys:
                self.request_mark(key)
            return
        n = len(keys)
        if len(input_tokens) != n or len(output_tokens) != n:
            raise ValueError(f"step_requests: {n} keys but {len(input_tokens)} input and "
                             f"{len(output_tokens)} output token counts")
        a = self._attrs[MSG_STEP_REQUESTS]
        # one int64 vector [3R]: keys, then input tokens, then output tokens (one payload per step)
        a.payload = np.array((*keys, *input_tokens, *output_tokens), dtype=np.int64)
        self._mark(a)

    def layer_push(self, layer: int, num_experts: int) -> None:
        a = self._attrs[MSG_LAYER]
        a.category = layer + 1
        a.payload = int(num_experts)  # moe/v1: E, so an agent attaching late can normalise
        self._push(a)

    def router_push(self, layer: int, entropy_bits: float) -> None:
        a = self._attrs[MSG_ROUTER]
        a.category = layer + 1
        a.payload = float(entropy_bits)
        self._push(a)

    def expert_tokens_mark(self, expert: int, tokens: int) -> None:
        a = self._attrs[MSG_EXPERT_TOKENS]
        a.category = expert + 1
        a.payload = int(tokens)
        self._mark(a)

    def expert_dropped_mark(self, expert: int, tokens: int) -> None:
        a = self._attrs[MSG_EXPERT_DROPPED]
        a.category = expert + 1
        a.payload = int(tokens)
        self._mark(a)

    def routing(self, layer: int, demand: np.ndarray, dropped: np.ndarray) -> None:
        if not self.v2:
            for expert in np.flatnonzero(demand).tolist():
                self.expert_tokens_mark(expert, int(demand[expert]))
            for expert in np.flatnonzero(dropped).tolist():
                self.expert_dropped_mark(expert, int(dropped[expert]))
            return
        if self._step_rows is not None:
            self._step_rows.append(np.concatenate((demand, dropped)))
            return
        a = self._attrs[MSG_ROUTING]
        a.category = layer + 1
        # one int32 vector: tokens routed to each of the E experts, then tokens over capacity
        a.payload = np.concatenate((demand, dropped)).astype(np.int32, copy=False)
        self._mark(a)

    def experts_push(self, layer: int, assignments: int) -> None:
        if not self.v2:
            return
        a = self._attrs[MSG_EXPERTS]
        a.category = layer + 1
        a.payload = int(assignments)
        self._push(a)

    def experts_time_mark(self, layer: int, time_us: np.ndarray) -> None:
        if not self.v2:
            return
        a = self._attrs[MSG_EXPERTS_TIME]
        a.category = layer + 1
        a.payload = time_us.astype(np.float32, copy=False)
        self._mark(a)

    def experts_pop(self) -> None:
        if self.v2:
            self._pop()

    def step_device_mark(self, time_us: np.ndarray) -> None:
        if not self.v2:
            return
        a = self._attrs[MSG_STEP_DEVICE]
        a.payload = time_us.astype(np.float32, copy=False)
        self._mark(a)

    def load_push(self, expert: int, bytes_moved: int) -> None:
        a = self._attrs[MSG_EXPERT_LOAD]
        a.category = expert + 1
        a.payload = int(bytes_moved)
        self._push(a)

    def ffn_push(self, expert: int, tokens: int) -> None:
        a = self._attrs[MSG_EXPERT_FFN]
        a.category = expert + 1
        a.payload = int(tokens)
        self._push(a)

    def pop(self) -> None:
        self._pop()

    def compact_step(self, layer_experts: Sequence[int], layer_ids: Sequence[int] | None = None) -> CompactStep:
        if not self.v2:
            raise ValueError("the compact form (moe/v2.2) needs convention v2")
        return CompactStep(layer_experts, domain=self._domain, layer_ids=layer_ids)

    def step_pop(self) -> None:
        rows = self._step_rows
        if rows:
            a = self._attrs[MSG_STEP_ROUTING]
            a.payload = np.concatenate(rows).astype(np.int32, copy=False)
            self._mark(a)
            rows.clear()
        self._pop()


class HeldVector:
    """A vector payload bound once to its attributes object: a 0-d numpy array of the structured
    dtype [("values", T, (n,))], whose bytes the `nvtx` package points at instead of copying them at
    each set (it copies every n-d array). Refill `values` in place, then mark."""

    __slots__ = ("buffer", "values")

    def __init__(self, element: type[np.generic], length: int) -> None:
        self.buffer = np.zeros((), dtype=np.dtype([("values", element, (length,))]))
        self.values: np.ndarray = self.buffer["values"]  # a view: writes land in `buffer`


class CompactStep:
    """moe/v2.2 compact emission for steps of a fixed layer layout (E per layer, in index order):
    per layer one `moe.layer` range (category and E set once here), per step the held
    `moe.step.routing` (int32, per layer tokens[E] ++ over_capacity[E]) and `moe.step.entropy`
    (float64 [L], bits) vectors. The producer fills `routing` / `entropy` in place (the
    over-capacity halves start at 0 and stay so unless written), then calls `emit()` inside its
    `moe.step` range. With domain=None the buffers exist and nothing is emitted."""

    __slots__ = ("layer_experts", "layer_ids", "routing", "entropy", "rows", "routing_bytes", "_routing", "_entropy",
                 "_emit")

    def __init__(self, layer_experts: Sequence[int], *, domain: NvtxDomainLike | None,
                 layer_ids: Sequence[int] | None = None) -> None:
        self.layer_experts = tuple(int(e) for e in layer_experts)
        # each emitted layer's index (its category - 1): 0..L-1 unless the step has only some layers
        ids = range(len(self.layer_experts)) if layer_ids is None else layer_ids
        self.layer_ids = tuple(int(i) for i in ids)
        if len(self.layer_ids) != len(self.layer_experts):
            raise ValueError(f"compact step: {len(self.layer_ids)} layer ids for {len(self.layer_experts)} layers")
        self._routing = HeldVector(np.int32, 2 * sum(self.layer_experts))
        self._entropy = HeldVector(np.float64, len(self.layer_experts))
        self.routing = self._routing.values  # int32 [Σ 2E]
        self.entropy = self._entropy.values  # float64 [L]
        self.routing_bytes = self.routing.data.cast("B")  # the same bytes, for struct.pack_into
        starts = np.cumsum((0, *(2 * e for e in self.layer_experts)))
        # per layer its [2E] row (views): tokens routed per expert, then over capacity
        self.rows = [self.routing[int(a):int(b)] for a, b in zip(starts[:-1], starts[1:], strict=True)]
        self._emit = self._emit_nothing if domain is None else self._bind(domain)

    def matrix(self) -> np.ndarray | None:
        """The routing as an [L, 2E] view when every layer has the same E (else None)."""
        if not self.layer_experts or len(set(self.layer_experts)) != 1:
            return None
        return self.routing.reshape(len(self.layer_experts), -1)

    def emit(self) -> int:
        """The step's layers (one push and pop each, back to back), then the two vectors; inside
        the open moe.step range. Returns the NVTX calls made."""
        return self._emit()

    @staticmethod
    def _emit_nothing() -> int:
        return 0

    def _bind(self, domain: NvtxDomainLike) -> Callable[[], int]:
        layers = [domain.get_event_attributes(message=MSG_LAYER, category=layer + 1, payload=experts)
                  for layer, experts in zip(self.layer_ids, self.layer_experts, strict=True)]
        routing = domain.get_event_attributes(message=MSG_STEP_ROUTING, payload=self._routing.buffer)
        entropy = domain.get_event_attributes(message=MSG_STEP_ENTROPY, payload=self._entropy.buffer)
        calls = 2 * len(layers) + 2
        handle = getattr(domain, "handle", None)
        try:  # the package's module-level calls skip the keyword dict the Domain methods build (cost rules)
            from nvtx._lib import mark as lib_mark
            from nvtx._lib import pop_range as lib_pop
            from nvtx._lib import push_range as lib_push
        except ImportError:
            handle = None
        if handle is not None and isinstance(domain, nvtx.Domain):
            def emit_lib() -> int:
                for a in layers:
                    lib_push(a, handle)
                    lib_pop(handle)
                lib_mark(routing, handle)
                lib_mark(entropy, handle)
                return calls
            return emit_lib
        push, pop, mark = domain.push_range, domain.pop_range, domain.mark

        def emit_domain() -> int:
            for a in layers:
                push(a)
                pop()
            mark(routing)
            mark(entropy)
            return calls
        return emit_domain


def make_instrumentation(*, enabled: bool, domain: NvtxDomainLike | None = None,
                         convention: str = DEFAULT_CONVENTION, expert_ranges: bool | None = None,
                         routing_place: str = "layer") -> Instrumentation:
    """The real `moe` domain unless one is given; the no-op one when disabled or no tool is attached."""
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
    if not enabled:
        return Instrumentation()
    if domain is None:
        domain = nvtx.get_domain(DOMAIN_NAME)
    if isinstance(domain, DummyDomain):
        return Instrumentation()
    return NvtxInstrumentation(domain=domain, convention=convention, expert_ranges=expert_ranges,
                               routing_place=routing_place)
