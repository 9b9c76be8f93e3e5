"""Listening sockets from the kernel's sock_diag dump, against /proc/<pid>/net/tcp{,6} read in the
same moment: real sockets of this test, and a listener in a network namespace the test creates."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from moescope import errors
from moescope.agent import targets
from moescope.collectors import netsig
from moescope.probes.ingress import procnet

WAIT_S = 20.0


def from_proc(pid: int) -> list[procnet.TcpSocket]:
    return [s for s in procnet.read_tcp_tables(net_dir=Path(f"/proc/{pid}/net")) if s.state == procnet.TCP_LISTEN]


@pytest.fixture
def listeners() -> Iterator[list[socket.socket]]:
    """A listener on 127.0.0.1 and, where the kernel has IPv6 loopback, one on ::1; plus a
    connected pair, which no listening-socket read may return."""
    made: list[socket.socket] = []
    v4 = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    made.append(v4)
    v4.bind(("127.0.0.1", 0))
    v4.listen()
    try:
        v6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        made.append(v6)
        v6.bind(("::1", 0))
        v6.listen()
    except OSError:
        pass  # no IPv6 loopback here: the IPv4 listener alone
    client = socket.create_connection(v4.getsockname()[:2], timeout=WAIT_S)
    made.append(client)
    accepted, _ = v4.accept()
    made.append(accepted)
    try:
        yield [s for s in made if s.type == socket.SOCK_STREAM and s not in (client, accepted)]
    finally:
        for s in made:
            s.close()


def test_the_dump_gives_what_proc_gives_without_reading_proc(listeners: list[socket.socket],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    expected = from_proc(os.getpid())
    ours = {(s.family, s.getsockname()[1]) for s in listeners}
    assert ours <= {(s.family, s.local_port) for s in expected}

    def no_proc(*, net_dir: Path) -> list[procnet.TcpSocket]:
        raise AssertionError(f"read {net_dir}: the agent's own namespace is read with sock_diag")

    monkeypatch.setattr(procnet, "read_tcp_tables", no_proc)
    dumped = procnet.listening_sockets(os.getpid())
    assert dumped == expected  # the same sockets, fields (addresses in network order) and order
    assert procnet.listening_sockets() == expected  # None: the agent's own namespace
    assert all(s.state == procnet.TCP_LISTEN for s in dumped)
    assert {s.getsockname()[1] for s in listeners} <= netsig.listening_ports(os.getpid())


def test_a_refused_dump_reads_proc_instead(listeners: list[socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(family: int) -> list[procnet.TcpSocket]:
        raise OSError(2, "sock_diag refused the dump: No such file or directory")

    monkeypatch.setattr(procnet, "_diag_listening", refused)
    before = procnet._diag_failures
    assert procnet.listening_sockets(os.getpid()) == from_proc(os.getpid())
    assert procnet._diag_failures == before + 1
    port = listeners[0].getsockname()[1]
    assert port in netsig.listening_ports(os.getpid())


def test_a_fixture_tree_is_read_as_files(tmp_path: Path) -> None:
    """A proc_root other than /proc (the parsers' test trees) is never answered from the kernel."""
    net = tmp_path / "42" / "net"
    net.mkdir(parents=True)
    (net / "tcp").write_text(
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1111\n"
        "   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 2222\n")
    found = procnet.listening_sockets(42, proc_root=tmp_path)
    assert [(s.inode, s.local_port, s.local_addr) for s in found] == [(1111, 8080, b"\x7f\x00\x00\x01")]
    assert not procnet.same_netns(42, proc_root=tmp_path)


@pytest.fixture
def other_namespace_listener() -> Iterator[tuple[int, int]]:
    """A process in a network namespace of its own (`unshare --net`, root), listening on a port:
    (pid, port). Stopped at the end."""
    unshare = shutil.which("unshare")
    assert unshare, "unshare (util-linux) is needed"
    assert os.geteuid() == 0, "a network namespace needs root (CI runs as root)"
    code = ("import socket, sys\n"
            "s = socket.socket(); s.bind(('0.0.0.0', 0)); s.listen()\n"
            "print(s.getsockname()[1], flush=True)\n"
            "sys.stdin.read()\n")
    proc = subprocess.Popen([unshare, "--net", sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip().isdigit(), f"the namespaced listener did not start: {line!r}"
        yield proc.pid, int(line)
    finally:
        proc.kill()
        proc.wait(WAIT_S)


def test_another_namespace_is_read_from_its_proc(other_namespace_listener: tuple[int, int]) -> None:
    pid, port = other_namespace_listener
    assert not procnet.same_netns(pid)
    theirs = procnet.listening_sockets(pid)
    assert theirs == from_proc(pid)
    assert port in {s.local_port for s in theirs}
    inode = next(s.inode for s in theirs if s.local_port == port)
    assert inode not in {s.inode for s in procnet.listening_sockets()}  # not in the agent's namespace
    assert netsig.listening_ports(pid) == {port}
    try:  # --port looks in the agent's namespace: that process is not found there
        assert pid not in targets.pids_listening_on(port)
    except errors.PortNotListening:
        pass


def _message(kind: int, payload: bytes, *, length: int | None = None) -> bytes:
    size = 16 + len(payload) if length is None else length
    return struct.pack("=IHHII", size, kind, 0, 1, 0) + payload


def _socket_message(port: int, inode: int, *, state: int = procnet.TCP_LISTEN) -> bytes:
    src = bytes([127, 0, 0, 1]) + bytes(12)
    payload = struct.pack("=BBBB", procnet.AF_INET, state, 0, 0) + port.to_bytes(2, "big") + bytes(2)
    payload += src + bytes(16) + struct.pack("=I8xIIIII", 0, 0, 0, 0, 0, inode)
    return _message(procnet.SOCK_DIAG_BY_FAMILY, payload)


def test_hostile_replies_are_refused_or_passed_over_never_a_hang() -> None:
    """The reply parser against replies the kernel does not send: each is an OSError (the caller
    reads /proc) or is passed over; none loops, none is taken as a socket."""
    found: list[procnet.TcpSocket] = []
    done = procnet.parse_diag_reply(_socket_message(8080, 11) + _message(99, b"xxxx")
                                    + _socket_message(9090, 12, state=procnet.TCP_ESTABLISHED)
                                    + _message(procnet.NLMSG_DONE, bytes(4)), found, addr_len=4)
    assert done
    assert [(s.local_port, s.inode, s.local_addr) for s in found] == [(8080, 11, b"\x7f\x00\x00\x01")]
    assert not procnet.parse_diag_reply(_socket_message(1, 2), [], addr_len=4)  # more to come
    hostile = {
        "a length that does not advance": _message(procnet.SOCK_DIAG_BY_FAMILY, b"", length=0),
        "a length past the reply": _message(procnet.SOCK_DIAG_BY_FAMILY, bytes(8), length=4096),
        "a socket message cut short": _message(procnet.SOCK_DIAG_BY_FAMILY, bytes(20)),
        "a refusal": _message(procnet.NLMSG_ERROR, struct.pack("=i", -errno.ENOENT) + bytes(16)),
        "a refusal cut short": _message(procnet.NLMSG_ERROR, b""),
    }
    for what, reply in hostile.items():
        with pytest.raises(OSError):
            procnet.parse_diag_reply(reply, [], addr_len=4)
            pytest.fail(f"{what}: taken")
    assert procnet.parse_diag_reply(b"\x00" * 7, [], addr_len=4) is False  # less than a header: nothing
