"""The join's index of buffered steps by request key (pid, fd): a request claims the steps of its key
that started inside it, older entries of the key go, and a retired step leaves its keys. The index
is a list per key read from a moving head (KeySteps), not a deque; these check that it claims and
forgets exactly what a plain list scan would, over long runs of one key and over many keys."""

from __future__ import annotations

import random

from moescope.agent.join import BufferedStep, KeySteps, RequestJoin, RequestJoined
from moescope.agent.routing_health import empty_table
from moescope.collectors.moe_convention import StepEvent
from moescope.probes.ingress.loader import IngressRecord

PID = 7


def _step(i: int, keys: list[int]) -> StepEvent:
    start = 1_000_000 * (i + 1)
    return StepEvent(PID, PID, start, start + 500_000, 16, keys, None, [])


def _request(fd: int, start_ns: int, end_ns: int) -> IngressRecord:
    return IngressRecord(PID, PID, fd, 0, 0, 2, "127.0.0.1", 40000, start_ns, end_ns, end_ns, 100, 100, 0)


class _Joined:
    name = "joined"

    def __init__(self) -> None:
        self.claims: list[tuple[int, ...]] = []

    def export(self, batch: object) -> None:
        for event in batch:  # type: ignore[attr-defined]
            if isinstance(event, RequestJoined):
                self.claims.append(tuple(b.seq for b in event.steps))


def test_key_steps_reads_from_its_head_and_cuts_the_read_part() -> None:
    queue = KeySteps()
    assert len(queue) == 0
    items = [BufferedStep(i, _step(i, [3]), 16, empty_table(16), 1) for i in range(9)]
    queue.steps.extend(items)
    seen: list[BufferedStep] = []
    while len(queue):
        assert queue.live() == items[len(seen):]
        seen.append(queue.first())
        queue.drop_first()
        assert len(queue.steps) <= 2 * len(queue) + 1  # the read part never outgrows the rest
    assert seen == items and queue.steps == [] and queue.head == 0


def test_claims_over_one_key_and_many_keys_match_a_plain_scan() -> None:
    rng = random.Random(5)
    join = RequestJoin(clock=lambda: 0)
    joined = _Joined()
    join.add_output(joined)  # type: ignore[arg-type]
    keys = [3, 4, 5] + list(range(100, 160))
    model: dict[int, list[tuple[int, int]]] = {}  # key -> [(seq, start_ns)] as the join should hold them
    expected: list[tuple[int, ...]] = []
    seq = 0
    for i in range(3000):
        # key 3 is in every step (one connection serving a long stream), the others now and then
        mine = [3] + rng.sample(keys[1:], rng.randrange(0, 4))
        join.on_steps([_step(i, mine)])
        seq += 1
        for key in mine:
            model.setdefault(key, []).append((seq, 1_000_000 * (i + 1)))
        if rng.random() < 0.3:  # a request on one key, covering the last few steps of it
            key = rng.choice(keys[:3] + keys[3:][:5])
            end = 1_000_000 * (i + 1) + 600_000
            start = end - rng.randrange(1, 6) * 1_000_000
            entries = model.get(key, [])
            expected.append(tuple(s for s, t in entries if start <= t <= end))
            model[key] = [(s, t) for s, t in entries if t > end]
            join.on_request(_request(key, start, end))
    assert joined.claims == expected
    live = {key: [s for s, _ in entries] for key, entries in model.items() if entries}
    held = {key: [b.seq for b in queue.live()] for (pid, key), queue in join._by_key.items()}
    assert held == live
    join.expire(flush=True)  # every step retires: every key leaves the index
    assert not join._by_key
