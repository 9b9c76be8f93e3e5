"""Dynamic batching engine: one model thread runs steps over the running requests (continuous
batching: a request joins at the next step; an idle engine waits up to max_wait_ms to gather a
batch). Each step is one `moe.step` NVTX range naming its requests: one `moe.step.requests` vector
(keys, input tokens, output tokens; moe/v2) or one `moe.request` mark per request (v1).

Streamed requests: after each step the model thread appends the new token and notifies the
request's condition; the handler thread waits on it and writes. The model thread never waits on a
client (the hand-over is the request's token list, at most max_tokens long); a request whose client
went away is cancelled and leaves the batch at the next step."""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Protocol

import torch

from moescope.errors import MoescopeError
from moescope.examples.moe_runtime.model import SequenceState
from moescope.examples.moe_runtime.stats import RuntimeStats
from moescope.moe_nvtx import Instrumentation

log = logging.getLogger("moe_runtime.batcher")


class SequenceLike(Protocol):
    length: int  # tokens this sequence has consumed (0: the next step is its prefill)


class StepModel(Protocol):
    """What the engine needs of a model (the reference MoEModel, or examples/hf_server's backend)."""

    sync_ranges: bool

    def new_sequence(self) -> Any: ...
    def forward(self, seqs: list[Any], new_tokens: list[list[int]]) -> torch.Tensor: ...
    def synchronize(self) -> None: ...


class Overloaded(MoescopeError):
    """Too many requests waiting: the caller answers 503."""


@dataclasses.dataclass(eq=False)
class Request:
    request_key: int  # the connection's fd as the server sees it (the moe.request payload)
    prompt_ids: list[int]
    max_tokens: int
    enqueued_ns: int = dataclasses.field(default_factory=time.monotonic_ns)
    started_ns: int = 0
    finished_ns: int = 0
    generated: list[int] = dataclasses.field(default_factory=list)
    steps: int = 0
    error: str | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    seq: SequenceLike = dataclasses.field(default_factory=SequenceState)  # the model's, set at admission
    stream: bool = False  # the handler writes each token as it comes (server-sent events)
    # stream: notified (by the model thread) after each new token and when the request ends
    progress: threading.Condition | None = None
    cancelled: bool = False  # set by the handler (client gone): the engine drops it at the next step

    def __post_init__(self) -> None:
        if self.stream and self.progress is None:
            self.progress = threading.Condition()

    def notify(self) -> None:
        """Wakes a streaming handler (the condition's lock is only held to check and wait)."""
        progress = self.progress
        if progress is not None:
            with progress:
                progress.notify_all()


class BatchEngine:
    def __init__(self, *, model: StepModel, stats: RuntimeStats, instrumentation: Instrumentation,
                 max_batch_size: int, max_wait_ms: float, max_waiting: int) -> None:
        self.model = model
        self.stats = stats
        self.ins = instrumentation
        self.max_batch_size = max_batch_size
        self.max_wait_ms = max_wait_ms
        self.max_waiting = max_waiting
        self._cond = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="moe-model", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, *, timeout_s: float = 5.0) -> bool:
        """Ends the loop after the step in progress; True once the model thread has exited."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def queue_sizes(self) -> dict[str, int]:
        with self._cond:
            return {"requests_waiting": len(self._waiting), "requests_running": len(self._running)}

    def submit(self, request: Request) -> None:
        with self._cond:
            if len(self._waiting) >= self.max_waiting:
                self.stats.count("requests_rejected")
                raise Overloaded(f"{len(self._waiting)} requests already waiting (max {self.max_waiting})")
            self._waiting.append(request)
            self._cond.notify_all()

    def _admit(self) -> bool:
        """Move waiting requests into the running batch; False when stopping."""
        with self._cond:
            if not self._running:
                while not self._waiting and not self._stop:
                    self.stats.idle()
                    self._cond.wait(0.5)
                if self._stop:
                    return False
                # Idle engine: give concurrent arrivals max_wait_ms to join the first step.
                deadline = time.monotonic() + self.max_wait_ms / 1000.0
                while len(self._waiting) < self.max_batch_size and not self._stop:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            while self._waiting and len(self._running) < self.max_batch_size:
                request = self._waiting.popleft()
                request.started_ns = time.monotonic_ns()
                request.seq = self.model.new_sequence()
                self._running.append(request)
            return not self._stop

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while self._admit():
            try:
                self._step()
            except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, never the server
                log.exception("step failed")
                self.stats.count("step_errors")
                self._finish_all(f"internal error in model step: {type(exc).__name__}: {exc}")
        self._finish_all("server shutting down")
        with self._cond:
            for request in self._waiting:
                request.error = "server shutting down"
                request.done.set()
                request.notify()
            self._waiting.clear()

    def _drop_cancelled(self) -> None:
        """Requests whose client went away leave the batch (their KV state is freed)."""
        with self._cond:
            cancelled = [r for r in self._running if r.cancelled]
            if not cancelled:
                return
            self._running = [r for r in self._running if not r.cancelled]
        now = time.monotonic_ns()
        for request in cancelled:
            request.error = "client disconnected"
            request.finished_ns = now
            request.seq = SequenceState()
            self.stats.count("requests_cancelled")
            request.done.set()
            request.notify()

    def _finish_all(self, error: str) -> None:
        with self._cond:
            running, self._running = self._running, []
        for request in running:
            request.error = error
            request.finished_ns = time.monotonic_ns()
            self.stats.count("requests_failed")
            request.done.set()
            request.notify()

    def _step(self) -> None:
        self._drop_cancelled()
        batch = list(self._running)
        if not batch:
            return
        new_tokens = [r.prompt_ids if r.seq.length == 0 else r.generated[-1:] for r in batch]
        n_tokens = sum(len(t) for t in new_tokens)
        # per request: prompt tokens this step processes (all of them at its prefill, 0 in decode)
        input_tokens = [len(t) if r.seq.length == 0 else 0 for r, t in zip(batch, new_tokens)]
        prefill = sum(input_tokens)
        ins = self.ins
        ins.step_push(n_tokens)
        try:
            # each forward generates one token per request
            ins.step_requests([r.request_key for r in batch], input_tokens, [1] * len(batch))
            logits = self.model.forward([r.seq for r in batch], new_tokens)
            if self.model.sync_ranges:
                self.model.synchronize()
        finally:
            ins.step_pop()
        next_ids = torch.argmax(logits, dim=-1).tolist()  # greedy: deterministic outputs
        self.stats.record_step(requests=len(batch), prefill_tokens=prefill, decode_tokens=len(batch))
        finished = []
        for request, token in zip(batch, next_ids):
            request.generated.append(int(token))
            request.steps += 1
            if len(request.generated) >= request.max_tokens:
                finished.append(request)
            elif request.progress is not None:
                request.notify()
        if finished:
            with self._cond:
                self._running = [r for r in self._running if r not in finished]
            now = time.monotonic_ns()
            for request in finished:
                request.finished_ns = now
                request.seq = SequenceState()  # free the model's state (KV cache) now
                self.stats.count("requests_completed")
                request.done.set()
                request.notify()
