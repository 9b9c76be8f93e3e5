"""agent/request_phases.py: a request's breakdown from its kernel record and the steps that carried it.

The phases must sum to the kernel-measured duration exactly whatever order the inputs arrive in
(hypothesis, adversarial times); TTFT follows the wire when the first response byte left between
the end of the prefill step and the end of the last step, else the prefill step's end; tokens are
the reported sums, or one output token per step when not reported."""

from __future__ import annotations

from typing import NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moescope.agent.request_phases import PHASES, StepTimes, breakdown

MS = 1_000_000
T0 = 7_000_000_000_000


class Kernel(NamedTuple):
    """The four kernel times the breakdown reads (IngressRecord has them under these names)."""

    start_ns: int
    last_read_ns: int
    first_response_ns: int
    end_ns: int


def at(ms: float) -> int:
    return T0 + int(round(ms * MS))


def step(start_ms: float, end_ms: float, tokens: tuple[int, int] | None = None, *, routing_ms: float = 0,
         load_ms: float = 0) -> StepTimes:
    return StepTimes(start_ns=at(start_ms), end_ns=at(end_ms), routing_ns=int(routing_ms * MS),
                     expert_load_ns=int(load_ms * MS), input_tokens=None if tokens is None else tokens[0],
                     output_tokens=None if tokens is None else tokens[1])


# ------------------------------------------------------------------ adversarial orderings

times = st.integers(min_value=0, max_value=10**12)
step_times = st.builds(
    StepTimes,
    start_ns=times,
    end_ns=times,
    routing_ns=st.integers(min_value=0, max_value=10**9),
    expert_load_ns=st.integers(min_value=0, max_value=10**9),
    input_tokens=st.none() | st.integers(min_value=0, max_value=10**5),
    output_tokens=st.none() | st.integers(min_value=0, max_value=64),
)


@settings(max_examples=400, deadline=None)
@given(kernel=st.builds(Kernel, times, st.just(0) | times, st.just(0) | times, times),
       steps=st.lists(step_times, min_size=1, max_size=12))
def test_phases_sum_to_the_duration_whatever_the_order(kernel: Kernel, steps: list[StepTimes]) -> None:
    """Any times at all (unsorted steps, steps outside the interval, end before start, zeros): every
    phase is >= 0 and the five sum to the kernel duration exactly (integer ns)."""
    b = breakdown(kernel, steps)
    assert b is not None
    phases = b.phase_ns()
    assert list(phases) == list(PHASES)
    assert all(ns >= 0 for ns in phases.values()), phases
    assert sum(phases.values()) == b.duration_ns == max(kernel.end_ns, kernel.start_ns) - kernel.start_ns
    assert b.steps == len(steps) and 1 <= b.prefill_steps <= len(steps)
    assert b.expert_load_ns == sum(s.expert_load_ns for s in steps)
    assert b.routing_ns == sum(s.routing_ns for s in steps)
    assert b.ttft_source in ("wire", "step")
    if b.tokens_reported:
        assert b.output_tokens == sum(s.output_tokens or 0 for s in steps)
        assert b.input_tokens == sum(s.input_tokens or 0 for s in steps)
    else:
        assert any(s.output_tokens is None for s in steps)
        assert (b.output_tokens, b.input_tokens) == (len(steps), None)
    assert (b.tpot_ns is None) == (b.output_tokens < 2)


@st.composite
def kernel_consistent(draw: st.DrawFn) -> tuple[Kernel, list[StepTimes]]:
    """Times the kernel and the join can produce: first read <= last read <= first response byte
    <= last byte, and steps that start inside the interval (the join rule), in start order."""
    start = draw(st.integers(min_value=T0, max_value=T0 + 10**9))
    end = draw(st.integers(min_value=start, max_value=start + 10**10))
    last_read = draw(st.integers(min_value=start, max_value=end))
    first_byte = draw(st.integers(min_value=last_read, max_value=end))
    starts = sorted(draw(st.lists(st.integers(min_value=start, max_value=end), min_size=1, max_size=10)))
    steps = [StepTimes(start_ns=s, end_ns=draw(st.integers(min_value=s, max_value=end + 10**6)),
                       input_tokens=None, output_tokens=None) for s in starts]
    return Kernel(start, last_read, first_byte, end), steps


@settings(max_examples=300, deadline=None)
@given(case=kernel_consistent())
def test_ttft_lies_inside_the_request_for_kernel_times(case: tuple[Kernel, list[StepTimes]]) -> None:
    kernel, steps = case
    b = breakdown(kernel, steps)
    assert b is not None
    assert 0 <= b.ttft_ns <= b.duration_ns
    assert sum(b.phase_ns().values()) == kernel.end_ns - kernel.start_ns
    assert b.receive_ns == kernel.last_read_ns - kernel.start_ns  # receive is exactly the kernel's read span
    prefill_end = steps[b.prefill_steps - 1].end_ns
    last_end = max(s.end_ns for s in steps)
    if prefill_end <= kernel.first_response_ns <= last_end:
        assert (b.ttft_source, b.ttft_ns) == ("wire", kernel.first_response_ns - kernel.start_ns)
    else:
        assert b.ttft_source == "step"


# ------------------------------------------------------------------ TTFT: wire vs step


def test_streamed_answer_ttft_is_the_first_byte_on_the_wire() -> None:
    # read 0-2 ms, queue to 5, prefill 5-20, three decode steps to 35, first token written at 21
    kernel = Kernel(at(0), at(2), at(21), at(36))
    steps = [step(5, 20, (12, 1)), step(25, 28, (0, 1)), step(29, 32, (0, 1)), step(32, 35, (0, 1))]
    b = breakdown(kernel, steps, model="moe-tiny")
    assert b is not None
    assert b.phase_ns() == {"receive": 2 * MS, "queue": 3 * MS, "prefill": 15 * MS, "decode": 15 * MS,
                            "write": 1 * MS}
    assert (b.ttft_source, b.ttft_ns) == ("wire", 21 * MS)
    assert b.tpot_ns == pytest.approx((36 - 21) * MS / 3)  # (last byte - first token) / (4 - 1)
    assert (b.input_tokens, b.output_tokens, b.tokens_reported, b.model) == (12, 4, True, "moe-tiny")
    assert b.prefill_steps == 1 and b.steps == 4


def test_unstreamed_answer_ttft_is_the_end_of_the_prefill_step() -> None:
    # the whole answer is written after the last step: the first token existed at 20 ms
    kernel = Kernel(at(0), at(1), at(36), at(37))
    steps = [step(5, 20, (12, 1)), step(25, 35, (0, 1))]
    b = breakdown(kernel, steps)
    assert b is not None
    assert (b.ttft_source, b.ttft_ns) == ("step", 20 * MS)
    assert b.write_ns == 2 * MS and b.decode_ns == 15 * MS
    assert b.tpot_ns == pytest.approx((37 - 20) * MS / 1)


def test_headers_before_the_first_token_do_not_count_as_it() -> None:
    # a server that wrote its headers at 3 ms, before prefill ended: TTFT falls back to the step
    kernel = Kernel(at(0), at(1), at(3), at(40))
    b = breakdown(kernel, [step(5, 20, (8, 1)), step(21, 30, (0, 1))])
    assert b is not None
    assert (b.ttft_source, b.ttft_ns) == ("step", 20 * MS)


def test_chunked_prefill_ends_at_the_step_that_produced_the_first_token() -> None:
    # a prompt in two chunks (no token from the first), then decode
    kernel = Kernel(at(0), at(1), at(31), at(50))
    steps = [step(5, 10, (64, 0)), step(12, 20, (36, 1)), step(30, 40, (0, 2))]  # 2: speculative decoding
    b = breakdown(kernel, steps)
    assert b is not None
    assert b.prefill_steps == 2
    assert (b.queue_ns, b.prefill_ns, b.decode_ns, b.write_ns) == (4 * MS, 15 * MS, 20 * MS, 10 * MS)
    assert (b.input_tokens, b.output_tokens) == (100, 3)
    assert (b.ttft_source, b.ttft_ns) == ("wire", 31 * MS)


# ------------------------------------------------------------------ tokens: reported vs inferred


def test_tokens_inferred_as_one_per_step_without_reports() -> None:
    kernel = Kernel(at(0), at(1), at(30), at(31))
    b = breakdown(kernel, [step(2, 10), step(11, 15), step(16, 20)])
    assert b is not None
    assert (b.input_tokens, b.output_tokens, b.tokens_reported) == (None, 3, False)
    assert b.prefill_steps == 1  # the first step produced the first token


def test_a_step_without_a_report_makes_the_request_unreported() -> None:
    kernel = Kernel(at(0), at(1), at(30), at(31))
    b = breakdown(kernel, [step(2, 10, (5, 1)), step(11, 15)])
    assert b is not None
    assert (b.input_tokens, b.output_tokens, b.tokens_reported) == (None, 2, False)


def test_one_output_token_has_no_tpot_and_subphases_are_summed() -> None:
    kernel = Kernel(at(0), at(1), at(30), at(31))
    b = breakdown(kernel, [step(2, 10, (7, 1), routing_ms=0.5, load_ms=3)])
    assert b is not None
    assert b.tpot_ns is None and b.output_tokens == 1
    assert (b.expert_load_ns, b.routing_ns) == (3 * MS, MS // 2)
    assert b.subphase_ns() == {"expert_load": 3 * MS, "routing": MS // 2}


def test_no_step_no_breakdown() -> None:
    assert breakdown(Kernel(at(0), at(1), at(2), at(3)), []) is None


def test_record_without_last_read_ends_receive_at_the_first_step() -> None:
    # last_read_ns 0 (a record from before the probe set it): receive runs to the first step
    b = breakdown(Kernel(at(0), 0, at(30), at(31)), [step(4, 10, (3, 1))])
    assert b is not None
    assert (b.receive_ns, b.queue_ns) == (4 * MS, 0)
