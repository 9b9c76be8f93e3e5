"""benchmarks/e2e_overhead.py agent_cpu_now / agent_cpu_since: the agent's CPU in a round read from
its threads' schedstat (ns), not whole 10 ms ticks, and the ticks again when a thread has left
with its time; on a real process that burns a known amount of CPU. minor_faults: on a real process
that touches a known number of fresh pages, in a thread that then exits."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.e2e_overhead import CLK_TCK, agent_cpu_now, agent_cpu_since, cpu_s, minor_faults

# A process that burns 0.12 s of CPU when told, first in a thread that then exits, then in its main thread.
BURNER = """
import sys, threading, time
def burn(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
print("ready", flush=True)
sys.stdin.readline(); t = threading.Thread(target=burn, args=(0.12,)); t.start(); t.join(); print("burnt", flush=True)
sys.stdin.readline(); burn(0.12); print("burnt", flush=True)
sys.stdin.readline()
"""


def _step(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "burnt"


def test_a_rounds_cpu_is_read_exactly_and_a_thread_that_left_falls_back_to_ticks() -> None:
    proc = subprocess.Popen([sys.executable, "-c", BURNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        before = agent_cpu_now(proc.pid)
        # the burning thread has exited by the reading: its schedstat went with it, its ticks stay
        _step(proc)
        gone = agent_cpu_since(before, proc.pid)
        ticks = cpu_s(proc.pid) - before[0]
        assert gone == ticks and gone >= 0.12 - 2.0 / CLK_TCK
        # burnt by a thread that lives on: its exact time (ns, not a whole number of ticks)
        before = agent_cpu_now(proc.pid)
        _step(proc)
        live = agent_cpu_since(before, proc.pid)
        assert 0.12 <= live < 0.12 + 0.1
        assert abs(live * CLK_TCK - round(live * CLK_TCK)) > 1e-6  # not the ticks' reading
    finally:
        proc.kill()
        proc.wait(timeout=10)


# A process that maps 4000 fresh pages and touches each once, in a thread that exits, when told.
TOUCHER = """
import mmap, sys, threading
def touch():
    block = mmap.mmap(-1, 4000 * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    block.madvise(mmap.MADV_NOHUGEPAGE)  # one fault a 4 KiB page whatever the machine's THP setting
    for offset in range(0, 4000 * 4096, 4096):
        block[offset] = 1
print("ready", flush=True)
sys.stdin.readline(); t = threading.Thread(target=touch); t.start(); t.join(); print("touched", flush=True)
sys.stdin.readline()
"""


def test_minor_faults_counts_every_fresh_page_of_the_process() -> None:
    proc = subprocess.Popen([sys.executable, "-c", TOUCHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        before = minor_faults(proc.pid)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "touched"
        # every page faulted once (a thread's stack and the interpreter's own add a few): the whole
        # process's count, the exited thread's faults included
        assert 4000 <= minor_faults(proc.pid) - before < 4000 + 400
    finally:
        proc.kill()
        proc.wait(timeout=10)
