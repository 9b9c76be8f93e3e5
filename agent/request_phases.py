"""Where one request's time went: the LLM-serving breakdown of a kernel-timed request.

Computed once per joined request (agent/join.py, before the steps' layer trees are let go) from
the kernel's record (probes/ingress: first byte read, last request byte read, first and last
response byte written) and the ``moe.step`` ranges that carried the request (NVTX, moe/v2). Every
output reads this one result: trace spans and ``gen_ai.*`` attributes, the ``gen_ai.server.*`` and
phase metrics, the live view's "where the time goes" window, the policy's phase signals and
``agent report``.

Phases cut the kernel interval [first byte read, last byte written] at five boundaries, each
clamped to be no earlier than the one before and no later than the end, so they always sum to the
kernel-measured duration exactly (docs/traces-and-metrics.md "Where the time goes"):

    receive  first request byte read  -> last request byte read (before the first response byte)
    queue                              -> start of the first step that carried the request
    prefill                            -> end of the step that produced its first output token
    decode                             -> end of the last step that carried it
    write                              -> last response byte written

``expert_load`` and ``routing`` are *of which* parts of prefill + decode (the ``moe.expert.load``
and ``moe.router`` time inside the request's steps; a step's time counts for every request in its
batch), never added to the sum.

Time to first token (TTFT), from the first request byte read:
- streamed (the first response byte left after the prefill step ended and before the last step
  did: the server wrote the first token while still generating) -> the first response byte on the
  wire (``ttft_source == "wire"``);
- otherwise (a non-streamed answer, whose first byte follows the last step; or a server that sent
  headers before the first token) -> the end of the prefill step, when the first token existed in
  the server (``ttft_source == "step"``).
Time per output token (TPOT) = (last byte written - first token) / (output tokens - 1), defined for
two or more output tokens (the definition vLLM and the GenAI semantic conventions use).

Tokens: a producer that sends ``moe.step.requests`` (or ``moe.request.tokens``) reports each
request's input and output tokens per step; the sums are ``input_tokens`` / ``output_tokens``
(``tokens_reported``). Without them the output tokens are the steps (one token per forward pass:
``tokens_reported`` False) and the input tokens are unknown (None).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

PHASES = ("receive", "queue", "prefill", "decode", "write")  # in order; they sum to the duration


class KernelTimes(Protocol):
    """What the breakdown needs of the kernel's record (probes/ingress IngressRecord)."""

    @property
    def start_ns(self) -> int: ...
    @property
    def last_read_ns(self) -> int: ...
    @property
    def first_response_ns(self) -> int: ...
    @property
    def end_ns(self) -> int: ...


class StepTimes(NamedTuple):
    """One step that carried the request: its interval, its time in routers and expert loads (the
    whole batch's), and this request's tokens in it where the producer reports them. A NamedTuple:
    one is built per (request, step), and a frozen dataclass costs ~3x as much to build."""

    start_ns: int
    end_ns: int
    routing_ns: int = 0
    expert_load_ns: int = 0
    input_tokens: int | None = None  # None: the producer does not report per-request tokens
    output_tokens: int | None = None


class RequestBreakdown(NamedTuple):
    """One joined request's breakdown (a NamedTuple: one is built per request)."""

    start_ns: int
    end_ns: int
    receive_ns: int
    queue_ns: int
    prefill_ns: int
    decode_ns: int
    write_ns: int
    expert_load_ns: int
    routing_ns: int
    steps: int
    prefill_steps: int  # steps up to and including the one that produced the first token
    ttft_ns: int
    ttft_source: str  # "wire" | "step"
    tpot_ns: float | None  # None below two output tokens
    input_tokens: int | None
    output_tokens: int
    tokens_reported: bool
    model: str | None = None  # gen_ai.request.model, from the runtime's stats when known

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    def phase_ns(self) -> dict[str, int]:
        """The five phases, in order (they sum to duration_ns)."""
        return {"receive": self.receive_ns, "queue": self.queue_ns, "prefill": self.prefill_ns,
                "decode": self.decode_ns, "write": self.write_ns}

    def subphase_ns(self) -> dict[str, int]:
        return {"expert_load": self.expert_load_ns, "routing": self.routing_ns}


def breakdown(record: KernelTimes, steps: Sequence[StepTimes], *, model: str | None = None) -> RequestBreakdown | None:
    """The request's breakdown, or None when no step carried it (not a model request: /stats, ...).
    ``steps`` are the request's steps, oldest first."""
    if not steps:
        return None
    start, end = record.start_ns, max(record.end_ns, record.start_ns)

    def clamp(t: int, lo: int) -> int:
        return min(max(t, lo), end)

    # receive ends at the last request byte read; a record without it (0) ends it at the first step
    last_read = record.last_read_ns or steps[0].start_ns
    b1 = clamp(last_read, start)
    b2 = clamp(steps[0].start_ns, b1)
    reported = all(s.output_tokens is not None for s in steps)
    first_token = 0
    if reported:
        first_token = next((i for i, s in enumerate(steps) if (s.output_tokens or 0) > 0), len(steps) - 1)
    prefill_step = steps[first_token]
    b3 = clamp(prefill_step.end_ns, b2)
    last_step_end = max(s.end_ns for s in steps)
    b4 = clamp(last_step_end, b3)
    first_byte = record.first_response_ns
    if first_byte and prefill_step.end_ns <= first_byte <= last_step_end:
        ttft_at, source = first_byte, "wire"
    else:
        ttft_at, source = b3, "step"
    if reported:
        output_tokens = sum(s.output_tokens or 0 for s in steps)
        input_tokens: int | None = sum(s.input_tokens or 0 for s in steps)
    else:
        output_tokens, input_tokens = len(steps), None
    tpot = (end - ttft_at) / (output_tokens - 1) if output_tokens >= 2 else None
    return RequestBreakdown(
        start_ns=start,
        end_ns=end,
        receive_ns=b1 - start,
        queue_ns=b2 - b1,
        prefill_ns=b3 - b2,
        decode_ns=b4 - b3,
        write_ns=end - b4,
        expert_load_ns=sum(s.expert_load_ns for s in steps),
        routing_ns=sum(s.routing_ns for s in steps),
        steps=len(steps),
        prefill_steps=first_token + 1,
        ttft_ns=ttft_at - start,
        ttft_source=source,
        tpot_ns=tpot,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        tokens_reported=reported,
        model=model,
    )
