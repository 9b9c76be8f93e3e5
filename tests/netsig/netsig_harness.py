"""Harness for the netsig tests: a network namespace of the test's own (loopback up, 1500-byte
MTU, one segment per packet), TCP peers from net_peers.py run inside it, an
nftables drop rule (every tenth packet) on its loopback, nstat read inside it, and the real probe."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

import pytest

from moescope.probes.netsig.loader import NetSignalProbe

HERE = Path(__file__).resolve().parent
NET_PEERS = HERE / "net_peers.py"
WAIT_S = 60.0  # generous: only bounds waiting, never asserted on
_names = count()

# One packet in ten that loopback delivers is dropped on arrival: TCP has to retransmit (this
# kernel has no netem). On arrival, not on the way out: a packet dropped at the output hook fails
# its send back to TCP, which queues it again as new data (not a retransmit), so only a lost
# tail ACK ever forced a resend; 4 x 256 KiB then retransmitted 0-5 segments and CI once saw 0.
# Dropped on input, the sender believes it sent the segment: ~20 retransmits per connection.
# Every tenth, not one in ten at random: a random rule can drop the same segment's resends (or
# their ACKs) several times running, and each loss doubles the retransmit timeout (0.2 s, 0.4 s,
# ... 8 in a row is 51 s): CI once stalled a connection past the peers' limits. Counted, the
# packet after a dropped one always passes, so no resend is lost twice while its flow is alone.
DROP_RULESET = """
table inet moescope_netsig_test {
  chain in {
    type filter hook input priority 0; policy accept;
    iif "lo" numgen inc mod 10 0 drop
  }
}
"""


def _run(argv: list[str], *, stdin: str | None = None) -> str:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=WAIT_S, check=False)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def stop(popen: subprocess.Popen[str]) -> None:
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        popen.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


@dataclass
class Server:
    pid: int
    port: int
    popen: subprocess.Popen[str]


@dataclass
class NetNamespace:
    name: str
    started: list[subprocess.Popen[str]] = field(default_factory=list)

    def exec_argv(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, role: str, *args: str, stdin: bool = False) -> subprocess.Popen[str]:
        popen = subprocess.Popen(
            self.exec_argv(sys.executable, str(NET_PEERS), role, *args),
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
            start_new_session=True,
        )
        self.started.append(popen)
        return popen

    def server(self, role: str, *args: str) -> Server:
        popen = self.popen(role, *args)
        assert popen.stdout is not None
        line = popen.stdout.readline().split()
        assert len(line) == 4 and line[0] == "PORT", f"server {role} did not start: {line!r}"
        return Server(pid=int(line[3]), port=int(line[1]), popen=popen)

    def client(self, role: str, *args: str) -> dict[str, Any]:
        """Run a client to its end; its JSON line."""
        popen = self.popen(role, *args)
        out, _ = popen.communicate(timeout=WAIT_S)
        assert popen.returncode == 0, f"client {role} failed ({popen.returncode})"
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return result

    def drop_packets(self, on: bool) -> None:
        if on:
            _run(self.exec_argv("nft", "-f", "-"), stdin=DROP_RULESET)
        else:
            _run(self.exec_argv("nft", "delete", "table", "inet", "moescope_netsig_test"))

    def nstat(self, counter: str) -> int:
        """A namespace counter read by iproute2's nstat (absolute, history untouched)."""
        for line in _run(self.exec_argv("nstat", "-asz", counter)).splitlines():
            fields = line.split()
            if len(fields) >= 2 and fields[0] == counter:
                return int(fields[1])
        raise AssertionError(f"nstat has no {counter}")

    def close(self) -> None:
        for popen in self.started:
            stop(popen)
        subprocess.run(["ip", "netns", "delete", self.name], capture_output=True, timeout=WAIT_S, check=False)


@pytest.fixture
def netns() -> Iterator[NetNamespace]:
    namespace = NetNamespace(f"moescope-netsig-{os.getpid()}-{next(_names)}")
    _run(["ip", "netns", "add", namespace.name])
    try:
        _run(namespace.exec_argv("ip", "link", "set", "lo", "up"))
        # Small packets, one segment each: losses are recovered by fast retransmit in well under a
        # second, and one retransmitted skb is one segment (as TCP_INFO counts them).
        _run(namespace.exec_argv("ip", "link", "set", "dev", "lo", "mtu", "1500", "gso_max_segs", "1"))
        yield namespace
    finally:
        namespace.close()


@pytest.fixture
def probe(bpf: None) -> Iterator[NetSignalProbe]:
    loaded = NetSignalProbe()
    loaded.load()
    try:
        yield loaded
    finally:
        loaded.close()
