"""SpanFactory and attribute cleaning, checked on real SDK spans in the SDK's in-memory exporter."""

from __future__ import annotations

import numpy as np
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanKind, StatusCode, set_span_in_context

from moescope.agent.export import SpanFactory, clean_attributes


def test_clean_attributes() -> None:
    cleaned = clean_attributes({
        "i": np.int32(3), "f": np.float64(0.5), "nan": float("nan"), "npnan": np.float64("nan"), "none": None,
        "b": np.bool_(True), "ints": np.arange(3), "mixed": [1, 2.5], "strs": ("a", "b"), "bools": [True, False],
        "odd": [1, "x"], "empty": [], "obj": object.__name__,
    })
    assert cleaned == {"i": 3, "f": 0.5, "b": True, "ints": [0, 1, 2], "mixed": [1.0, 2.5], "strs": ["a", "b"],
                       "bools": [True, False], "odd": ["1", "x"], "obj": "object"}
    assert type(cleaned["i"]) is int and type(cleaned["b"]) is bool

    # scalars only (the common span): None and NaN left out, the rest as they are, in order
    scalars = clean_attributes({"a": 1, "nan": float("nan"), "none": None, "s": "x", "b": False, "f": -0.0})
    assert list(scalars.items()) == [("a", 1), ("s", "x"), ("b", False), ("f", -0.0)]
    source = [1, 2]
    copied = clean_attributes({"ints": source})
    source.append(3)  # the caller may reuse its list: the cleaned one is a copy
    assert copied == {"ints": [1, 2]}


def test_direct_spans_store_the_cleaned_attributes_as_tuples() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_ON)  # the factory's direct path
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    factory = SpanFactory(provider.get_tracer("t"))
    assert factory.direct
    source = [4, 5]
    factory.record("s", start_ns=1, end_ns=2, attributes={
        "i": np.int64(3), "nan": float("nan"), "none": None, "ints": source, "tuple": (1.5, 2.5), "np": np.arange(2),
        "mixed": (1, 2.5), "odd": [1, "x"], "empty": (), "s": "x", "b": False, "f": 0.25,
    })
    source.append(6)
    (span,) = exporter.get_finished_spans()
    assert dict(span.attributes or {}) == {"i": 3, "ints": (4, 5), "tuple": (1.5, 2.5), "np": (0, 1),
                                           "mixed": (1.0, 2.5), "odd": ("1", "x"), "s": "x", "b": False, "f": 0.25}
    assert list(span.attributes or {}) == ["i", "ints", "tuple", "np", "mixed", "odd", "s", "b", "f"]  # order kept


def test_explicit_times_parents_and_ambient_context_ignored() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    factory = SpanFactory(tracer)
    ambient = tracer.start_span("ambient")
    from opentelemetry import context

    token = context.attach(set_span_in_context(ambient))
    try:
        root = factory.record("root", start_ns=100, end_ns=900, kind=SpanKind.SERVER)
        child = factory.record("child", start_ns=200, end_ns=150, parent=root, error="boom")  # end < start
    finally:
        context.detach(token)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["root"].parent is None  # the thread's current span does not leak in
    assert spans["root"].context.trace_id != ambient.get_span_context().trace_id
    assert (spans["root"].start_time, spans["root"].end_time, spans["root"].kind) == (100, 900, SpanKind.SERVER)
    assert spans["child"].parent is not None and spans["child"].parent.span_id == root.span_id
    assert spans["child"].context.trace_id == root.trace_id
    assert (spans["child"].start_time, spans["child"].end_time) == (200, 200)  # clamped, never negative
    assert spans["child"].status.status_code is StatusCode.ERROR and spans["child"].status.description == "boom"
    assert child == spans["child"].context
