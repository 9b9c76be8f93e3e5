"""StatePublisher's one temp name: a leftover temp file is replaced, a planted link is never written
through, and publishes from several threads never collide on it."""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

from moescope.agent.state import StatePublisher, find_agents, read_snapshot

from .conftest import load_fixture


def _tmp_of(pub: StatePublisher) -> Path:
    return pub.state_dir / f".{pub.path.name}.tmp"


def test_leftover_temp_file_is_replaced_and_never_listed(tmp_path: Path) -> None:
    pub = StatePublisher(state_dir=tmp_path, pid=os.getpid())
    _tmp_of(pub).write_text("half a snapshot from a killed publish")
    pub.publish(load_fixture("gpu_busy"))
    assert read_snapshot(pub.path) == load_fixture("gpu_busy")
    assert not _tmp_of(pub).exists()
    assert [a.path for a in find_agents(tmp_path)] == [pub.path]
    pub.close()


def test_a_link_at_the_temp_name_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    pub = StatePublisher(state_dir=tmp_path / "run", pid=4243)
    _tmp_of(pub).symlink_to(victim)
    pub.publish(load_fixture("just_started"))
    assert victim.read_text() == "keep me"
    assert read_snapshot(pub.path) == load_fixture("just_started")
    pub.close()


def test_threads_publishing_at_once_all_succeed(tmp_path: Path) -> None:
    pub = StatePublisher(state_dir=tmp_path, pid=4244)
    base = load_fixture("host_large_model")
    errors: list[BaseException] = []

    def publish_many(first_seq: int) -> None:
        try:
            for seq in range(first_seq, first_seq + 25):
                pub.publish(dataclasses.replace(base, seq=seq))
        except BaseException as exc:  # collected: the assertion below names it
            errors.append(exc)

    threads = [threading.Thread(target=publish_many, args=(1000 * i,)) for i in range(1, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and pub.published == 75
    assert read_snapshot(pub.path).seq in {1024, 2024, 3024}  # some thread's last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agent-4244.state.json"]
    pub.close()
