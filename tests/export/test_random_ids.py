"""The span factory draws the SDK default generator's ids itself (its methods are interpreted
Python): the same draws from the same random state, and any other generator is used as it is."""

from __future__ import annotations

import random

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

from moescope.agent.export.spans import SpanFactory


class Counting(IdGenerator):
    def __init__(self) -> None:
        self.n = 0

    def generate_span_id(self) -> int:
        self.n += 1
        return self.n

    def generate_trace_id(self) -> int:
        self.n += 1
        return self.n


def test_the_default_generator_s_draws_are_the_same() -> None:
    factory = SpanFactory(TracerProvider(sampler=ALWAYS_ON).get_tracer("t"))
    assert factory.direct
    sdk = RandomIdGenerator()
    random.seed(7)
    expected = [(sdk.generate_trace_id(), sdk.generate_span_id()) for _ in range(50)]
    random.seed(7)
    ids = factory._ids
    assert type(ids) is not RandomIdGenerator  # (the compiled stand-in)
    assert [(ids.generate_trace_id(), ids.generate_span_id()) for _ in range(50)] == expected
    assert ids.is_trace_id_random() is True
    random.seed(7)
    spans = factory.child_span_ids(5)
    random.seed(7)
    assert spans == [sdk.generate_span_id() for _ in range(5)]


def test_an_invalid_draw_is_drawn_again() -> None:
    factory = SpanFactory(TracerProvider(sampler=ALWAYS_ON).get_tracer("t"))
    draws = iter([0, 0, 5, 0, 9])
    original = random.getrandbits
    try:
        random.getrandbits = lambda bits: next(draws)
        assert factory._ids.generate_span_id() == 5
        assert factory._ids.generate_trace_id() == 9
    finally:
        random.getrandbits = original


def test_another_generator_is_used_as_it_is() -> None:
    counting = Counting()
    factory = SpanFactory(TracerProvider(sampler=ALWAYS_ON, id_generator=counting).get_tracer("t"))
    assert factory._ids is counting
    assert factory.child_span_ids(3) == [1, 2, 3]
