"""Model requests for the tests of the breakdown's views (live window, panel, policy, report):
a kernel record and the steps that carried it, broken down by the real agent/request_phases.py."""

from __future__ import annotations

from dataclasses import dataclass

from moescope.agent.join import RequestJoined
from moescope.agent.request_phases import RequestBreakdown, StepTimes, breakdown
from moescope.probes.ingress.loader import IngressRecord

MS = 1_000_000


@dataclass(frozen=True)
class ModelRequest:
    """A request's shape in ms; ``decode_steps`` steps follow the prefill step."""

    receive_ms: float = 0.2
    queue_ms: float = 3.0
    prefill_ms: float = 40.0
    decode_steps: int = 7
    decode_step_ms: float = 10.0
    write_ms: float = 0.5
    load_ms_per_step: float = 1.0
    routing_ms_per_step: float = 0.25
    input_tokens: int | None = 12  # None: the producer does not report tokens
    streamed: bool = False


def kernel_and_steps(shape: ModelRequest, *, start_ns: int, fd: int = 7) -> tuple[IngressRecord, list[StepTimes]]:
    t = start_ns + int(shape.receive_ms * MS)
    last_read = t
    t += int(shape.queue_ms * MS)
    reported = shape.input_tokens is not None
    steps = [StepTimes(start_ns=t, end_ns=t + int(shape.prefill_ms * MS),
                       routing_ns=int(shape.routing_ms_per_step * MS), expert_load_ns=int(shape.load_ms_per_step * MS),
                       input_tokens=shape.input_tokens, output_tokens=1 if reported else None)]
    t = steps[0].end_ns
    for _ in range(shape.decode_steps):
        steps.append(StepTimes(start_ns=t, end_ns=t + int(shape.decode_step_ms * MS),
                               routing_ns=int(shape.routing_ms_per_step * MS),
                               expert_load_ns=int(shape.load_ms_per_step * MS),
                               input_tokens=0 if reported else None, output_tokens=1 if reported else None))
        t = steps[-1].end_ns
    # streamed: the first token's bytes leave right after the prefill step; otherwise after the last step
    first_response = steps[0].end_ns + MS // 10 if shape.streamed else t + MS // 10
    end = t + int(shape.write_ms * MS)
    record = IngressRecord(tgid=100, tid=100, fd=fd, generation=1, seq=0, family=2, peer_addr="127.0.0.1",
                           peer_port=40000 + fd, start_ns=start_ns, first_response_ns=first_response, end_ns=end,
                           bytes_in=300, bytes_out=900, flags=0, last_read_ns=last_read)
    return record, steps


def model_request(shape: ModelRequest, *, start_ns: int, fd: int = 7,
                  model: str | None = "moe-tiny") -> tuple[IngressRecord, RequestBreakdown]:
    record, steps = kernel_and_steps(shape, start_ns=start_ns, fd=fd)
    b = breakdown(record, steps, model=model)
    assert b is not None
    return record, b


def joined(shape: ModelRequest, *, start_ns: int, fd: int = 7) -> RequestJoined:
    """The join's event for the request (steps left out: the views read the breakdown)."""
    record, b = model_request(shape, start_ns=start_ns, fd=fd)
    return RequestJoined(record=record, steps=(), first_claims=(), breakdown=b)
