"""moescope/procfs.py against real processes this test starts and stops (exit, zombie, a renamed
comm, a thread that ends, a recycled pid simulated by a wrong start time), plus stat-line parsing."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from moescope.procfs import (
    ProcessIdentity,
    name_thread,
    parse_stat,
    pid_exists,
    read_cmdline,
    read_comm,
    read_start_ticks,
    read_stat,
    task_cpu,
    task_cpu_by_name,
    task_exists,
)

# A child that runs `setup`, says "ready", then obeys one line per command read from stdin.
CHILD = r"""
import os, sys, threading, time
done = threading.Event()
worker = threading.Thread(target=done.wait)
worker.start()
print("ready", threading.get_native_id(), worker.native_id, flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd.startswith("comm "):
        with open("/proc/self/comm", "w") as f:
            f.write(cmd[5:])
    elif cmd == "end-thread":
        done.set()
        worker.join()
        # join() returns when Python is done with the thread; the kernel task can outlive that by
        # a few microseconds (CI saw it once): "ended" is when its /proc entry is gone (bounded)
        for _ in range(5000):
            if not os.path.exists(f"/proc/self/task/{worker.native_id}"):
                break
            time.sleep(0.001)
    print("ok", flush=True)
done.set()
"""

def _wait_task_gone(tid: int) -> None:
    """join() returns when Python is done with a thread; the kernel task can outlive that by a few
    microseconds: wait (bounded) until its /proc entry is gone."""
    for _ in range(5000):
        if not os.path.exists(f"/proc/self/task/{tid}"):
            return
        time.sleep(0.001)


ODD_COMM = "moe) (x y)"  # spaces, a ')' inside, and a ')' last: the stat line's last ')' is still the kernel's


class Child:
    def __init__(self, *extra_argv: str) -> None:
        self.argv = [sys.executable, "-c", CHILD, *extra_argv]
        self.popen = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.popen.stdout is not None and self.popen.stdin is not None
        ready, main_tid, worker_tid = self.popen.stdout.readline().split()
        assert ready == "ready"
        self.pid = self.popen.pid
        self.main_tid, self.worker_tid = int(main_tid), int(worker_tid)

    def command(self, line: str) -> None:
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()
        assert self.popen.stdout.readline().strip() == "ok"

    def exit_unreaped(self) -> None:
        """Let it exit and wait until it is a zombie, without reaping it (WNOWAIT)."""
        assert self.popen.stdin is not None
        self.popen.stdin.close()
        os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)

    def stop(self) -> None:
        if self.popen.stdin is not None and not self.popen.stdin.closed:
            self.popen.stdin.close()
        self.popen.wait(timeout=30)
        if self.popen.stdout is not None:
            self.popen.stdout.close()


@pytest.fixture
def child() -> Iterator[Child]:
    c = Child("a b", "")
    try:
        yield c
    finally:
        if c.popen.poll() is None:
            c.popen.kill()
        c.stop()


def test_live_child_is_read_and_is_gone_after_exit(child: Child) -> None:
    identity = ProcessIdentity.of(child.pid)
    assert identity is not None and identity.pid == child.pid
    assert identity.alive() and pid_exists(child.pid)
    assert read_start_ticks(child.pid) == identity.start_ticks
    assert read_cmdline(child.pid) == child.argv  # an argument with a space and an empty last one survive
    comm = read_comm(child.pid)
    assert comm is not None and comm.startswith("python")
    stat = read_stat(child.pid)
    assert stat is not None and stat.ppid == os.getpid() and stat.comm == comm and not stat.exited

    child.stop()  # exits and is reaped
    assert not identity.alive()
    assert not pid_exists(child.pid)
    assert ProcessIdentity.of(child.pid) is None
    assert read_comm(child.pid) is None and read_cmdline(child.pid) is None
    assert read_stat(child.pid) is None and read_start_ticks(child.pid) is None


def test_zombie_is_not_alive(child: Child) -> None:
    identity = ProcessIdentity.of(child.pid)
    assert identity is not None
    child.exit_unreaped()
    stat = read_stat(child.pid)
    assert stat is not None and stat.state == "Z" and stat.exited  # the pid is still taken
    assert not pid_exists(child.pid)
    assert not identity.alive()
    assert ProcessIdentity.of(child.pid) is None
    assert read_cmdline(child.pid) == []  # a zombie has no address space left to show


def test_recycled_pid_is_a_different_process(child: Child) -> None:
    identity = ProcessIdentity.of(child.pid)
    assert identity is not None
    earlier_holder = ProcessIdentity(pid=child.pid, start_ticks=identity.start_ticks - 1)
    assert identity.alive() and pid_exists(child.pid)
    assert not earlier_holder.alive()


def test_comm_with_spaces_and_parentheses_is_parsed_past(child: Child) -> None:
    identity = ProcessIdentity.of(child.pid)  # taken while the name is plain "python3..."
    assert identity is not None
    child.command(f"comm {ODD_COMM}")
    assert read_comm(child.pid) == ODD_COMM
    stat = read_stat(child.pid)
    assert stat is not None
    assert stat.comm == ODD_COMM and stat.pid == child.pid and stat.ppid == os.getpid()
    assert stat.state in {"S", "R"}
    assert stat.start_ticks == identity.start_ticks and identity.alive()


def test_thread_liveness(child: Child) -> None:
    assert child.main_tid == child.pid
    assert task_exists(child.pid, child.main_tid) and task_exists(child.pid, child.worker_tid)
    child.command("end-thread")  # the worker has been joined
    assert not task_exists(child.pid, child.worker_tid)
    assert task_exists(child.pid, child.main_tid) and pid_exists(child.pid)
    assert not task_exists(child.pid, 0) and not task_exists(os.getpid(), child.worker_tid)


def test_pid_exists_edges() -> None:
    assert pid_exists(os.getpid())
    assert not pid_exists(0) and not pid_exists(-1)  # never os.kill(0 or -1, ...): those mean groups
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    assert not pid_exists(pid_max + 1)
    assert ProcessIdentity.of(0) is None and read_comm(-3) is None and read_cmdline(0) is None


STAT_TAIL = "S 1 77 77 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 987654 0 0 18446744073709551615"


def _write_stat(root: Path, pid: int, line: str) -> None:
    (root / str(pid)).mkdir(parents=True)
    (root / str(pid) / "stat").write_text(line + "\n")


def test_fixture_tree_is_read_without_falling_back_to_signals(tmp_path: Path) -> None:
    _write_stat(tmp_path, 10, f"10 (sleeper) {STAT_TAIL}")
    _write_stat(tmp_path, 11, f"11 (zombie) Z{STAT_TAIL[1:]}")
    _write_stat(tmp_path, 12, "12 (torn")
    assert pid_exists(10, proc_root=tmp_path)
    assert not pid_exists(11, proc_root=tmp_path)
    assert not pid_exists(12, proc_root=tmp_path)  # malformed counts as gone
    # our own pid is alive on this machine, but not in the tree asked about
    assert not pid_exists(os.getpid(), proc_root=tmp_path)
    assert ProcessIdentity(10, 987654).alive(proc_root=tmp_path)
    assert not ProcessIdentity(10, 987655).alive(proc_root=tmp_path)
    assert ProcessIdentity.of(10, proc_root=tmp_path) == ProcessIdentity(10, 987654)


@pytest.mark.parametrize(
    ("line", "comm"),
    [
        (f"77 (python3) {STAT_TAIL}", "python3"),
        (f"77 (a b c) {STAT_TAIL}", "a b c"),
        (f"77 (x) S 2 3 (y) {STAT_TAIL}", "x) S 2 3 (y"),  # a comm that imitates fields
        (f"77 ()) {STAT_TAIL}", ")"),
        (f"77 () {STAT_TAIL}", ""),
        (f"77 (new\nline) {STAT_TAIL}", "new\nline"),
    ],
)
def test_parse_stat_takes_fields_after_the_last_paren(line: str, comm: str) -> None:
    for raw in (line, line.encode() + b"\n"):
        stat = parse_stat(raw)
        assert (stat.pid, stat.comm, stat.state, stat.ppid, stat.start_ticks) == (77, comm, "S", 1, 987654)


def test_parse_stat_undecodable_comm_bytes() -> None:
    stat = parse_stat(b"5 (\xff\xfe) " + STAT_TAIL.encode())
    assert stat.comm == "\ufffd\ufffd" and stat.start_ticks == 987654


@pytest.mark.parametrize(
    "line",
    [
        "",
        "77 python3 S 1",  # no parentheses
        "(python3) " + STAT_TAIL,  # no pid before the comm
        "77 (python3) S 1 77 77",  # cut short before field 22
        "77 (python3) " + STAT_TAIL.replace("987654", "soon"),
        "x7 (python3) " + STAT_TAIL,
    ],
)
def test_parse_stat_rejects_malformed_lines(line: str) -> None:
    with pytest.raises(ValueError):
        parse_stat(line)


# utime 250 and stime 50 ticks (fields 14 and 15)
BUSY_TAIL = "S 1 77 77 0 -1 4194560 0 0 0 0 250 50 0 0 20 0 1 0 987654 0 0 18446744073709551615"


def test_task_cpu_reads_every_thread_and_skips_what_is_gone_or_torn(tmp_path: Path) -> None:
    tasks = tmp_path / "40" / "task"
    for tid, line in ((40, f"40 (main one) {BUSY_TAIL}"), (41, f"41 (ms-policy) {STAT_TAIL}"), (42, "42 (torn")):
        (tasks / str(tid)).mkdir(parents=True)
        (tasks / str(tid) / "stat").write_text(line + "\n")
    (tasks / "43").mkdir()  # a thread that exited between the listing and the read
    ticks = os.sysconf("SC_CLK_TCK")
    assert parse_stat(f"40 (x) {BUSY_TAIL}").cpu_ticks == 300
    assert task_cpu(40, proc_root=tmp_path) == {40: ("main one", 300 / ticks), 41: ("ms-policy", 0.0)}
    assert task_cpu_by_name(40, proc_root=tmp_path) == {"main": 300 / ticks, "ms-policy": 0.0}
    assert task_cpu(41, proc_root=tmp_path) == {}  # no such process in the tree
    assert task_cpu(0, proc_root=tmp_path) == {}
    # precise: schedstat's nanoseconds where a thread has them, its ticks where not (or unreadable)
    (tasks / "40" / "schedstat").write_text("2500000123 77 9\n")
    (tasks / "41" / "schedstat").write_text("garbage\n")
    assert task_cpu(40, proc_root=tmp_path, precise=True) == {40: ("main one", 2.500000123), 41: ("ms-policy", 0.0)}
    assert task_cpu_by_name(40, proc_root=tmp_path, precise=True) == {"main": 2.500000123, "ms-policy": 0.0}


def test_a_thread_is_named_by_itself_or_by_tid_and_the_main_thread_never() -> None:
    import threading

    named: list[bool] = []
    go, hold = threading.Event(), threading.Event()

    def worker() -> None:
        named.append(name_thread("ms-test-worker-and-more"))  # over 15 bytes: the kernel keeps 15
        go.set()
        x = 0
        while not hold.is_set():  # some CPU to be seen
            x += 1

    other = threading.Thread(target=worker)
    idle = threading.Thread(target=hold.wait)
    process_name = read_comm(os.getpid())
    other.start()
    idle.start()
    try:
        assert go.wait(10.0)
        assert idle.native_id is not None and other.native_id is not None
        assert name_thread("ms-idle", tid=idle.native_id)
        assert not name_thread("ms-main")  # the main thread's name is the process's
        assert not name_thread("x", tid=os.getpid())
        threads = task_cpu(os.getpid())
        assert named == [True]
        assert threads[other.native_id][0] == "ms-test-worker-"
        assert threads[idle.native_id][0] == "ms-idle"
        assert threads[os.getpid()][0] == process_name == read_comm(os.getpid())
        assert all(cpu >= 0 for _, cpu in threads.values())
    finally:
        hold.set()
        other.join(10.0)
        idle.join(10.0)
    assert idle.native_id is not None
    _wait_task_gone(idle.native_id)
    assert not name_thread("gone", tid=idle.native_id)  # the thread has ended
