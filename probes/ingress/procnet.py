"""Read TCP sockets: /proc/<pid>/net/tcp{,6} tables, /proc/<pid>/fd socket inodes, and the
listening sockets from the kernel's sock_diag netlink interface.

Used at attach (seed connections opened before the probe), by `agent start --port` (find the
processes holding a listening socket, and while a port waits for a restarted server, rescan it every
200 ms) and by the netsig source (each target's listening ports, every 30 s). `proc_root` lets tests
point the parsers at fixture trees.

Listening sockets (``listening_sockets``) come from sock_diag where the namespace is the agent's
own: a dump that asks for the LISTEN state only walks the kernel's listening hash. Reading
/proc/<pid>/net/tcp{,6} walks the whole established hash as well (262,144 buckets on this VM)
whatever the namespace holds: ~2.5 ms of CPU a read of the pair, against ~0.03 ms for the dump
(`benchmarks/listening_scan.py`). Another namespace's sockets, a kernel without inet_diag, or a
refused dump: /proc, as before.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from moescope.procfs import PROC

log = logging.getLogger(__name__)

TCP_ESTABLISHED = 0x01
TCP_CLOSE_WAIT = 0x08
TCP_LISTEN = 0x0A

AF_INET = 2
AF_INET6 = 10


def address_text(family: int, raw: bytes) -> str | None:
    """A socket address from its raw bytes as the probes write it (IPv4-mapped IPv6 as IPv4);
    None for a family that is neither."""
    if family == AF_INET:
        return str(ipaddress.IPv4Address(raw[:4]))
    if family == AF_INET6:
        address = ipaddress.IPv6Address(raw[:16])
        return str(address.ipv4_mapped or address)
    return None


@dataclass(frozen=True, slots=True)
class TcpSocket:
    inode: int
    state: int
    family: int
    local_addr: bytes  # 4 or 16 bytes, network order
    local_port: int
    remote_addr: bytes
    remote_port: int


def _addr_bytes(hex_addr: str) -> bytes:
    # The kernel prints each 32-bit word of the address as a native-endian integer.
    words = [hex_addr[i : i + 8] for i in range(0, len(hex_addr), 8)]
    return b"".join(int(word, 16).to_bytes(4, "little") for word in words)


def parse_tcp_table(text: str, *, family: int) -> list[TcpSocket]:
    """Parse the text of /proc/net/tcp (family AF_INET) or /proc/net/tcp6 (AF_INET6)."""
    sockets: list[TcpSocket] = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        local, remote, state_hex, inode_text = fields[1], fields[2], fields[3], fields[9]
        local_addr, _, local_port = local.partition(":")
        remote_addr, _, remote_port = remote.partition(":")
        try:
            sockets.append(
                TcpSocket(
                    inode=int(inode_text),
                    state=int(state_hex, 16),
                    family=family,
                    local_addr=_addr_bytes(local_addr),
                    local_port=int(local_port, 16),
                    remote_addr=_addr_bytes(remote_addr),
                    remote_port=int(remote_port, 16),
                )
            )
        except ValueError:
            continue  # a malformed line is skipped, never fatal
    return sockets


def read_tcp_tables(*, net_dir: Path) -> list[TcpSocket]:
    """All TCP sockets of one network namespace (`net_dir` is /proc/net or /proc/<pid>/net)."""
    sockets: list[TcpSocket] = []
    for name, family in (("tcp", AF_INET), ("tcp6", AF_INET6)):
        try:
            text = (net_dir / name).read_text()
        except OSError:
            continue  # no IPv6 in this kernel/namespace
        sockets.extend(parse_tcp_table(text, family=family))
    return sockets


def proc_listening_sockets(*, net_dir: Path) -> list[TcpSocket]:
    """The LISTEN-state sockets of one namespace's /proc tables (``read_tcp_tables``): the dear read,
    for another namespace or where sock_diag is refused (``listening_sockets``)."""
    return [s for s in read_tcp_tables(net_dir=net_dir) if s.state == TCP_LISTEN]


# sock_diag, as <linux/netlink.h>, <linux/sock_diag.h> and <linux/inet_diag.h> define it.
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300  # NLM_F_ROOT | NLM_F_MATCH
NLMSG_ERROR = 2
NLMSG_DONE = 3
IPPROTO_TCP = 6
_NLMSG = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
# inet_diag_req_v2: family, protocol, ext, pad, states; its inet_diag_sockid (48 bytes) left zero
_DIAG_REQUEST = struct.Struct("=BBBBI48x")
# inet_diag_msg: family, state, timer, retrans; sockid: sport, dport (big-endian), src, dst
# (16 bytes each, network order), interface, cookie; expires, rqueue, wqueue, uid, inode
_DIAG_MSG = struct.Struct("=BBBB2s2s16s16sI8xIIIII")
DIAG_RECV_BYTES = 1 << 16
DIAG_TIMEOUT_S = 1.0  # a dump of the listening hash takes microseconds; never wait on it for long
DIAG_MAX_SOCKETS = 1 << 16  # a bound on one dump (a host with more listeners reads /proc instead)
DIAG_MAX_RECVS = 1 << 12  # and on its replies (~70 listeners fit in one)


def _diag_listening(family: int) -> list[TcpSocket]:
    """This namespace's TCP sockets of `family` in the LISTEN state, from one sock_diag dump.
    Raises OSError when the kernel refuses or answers out of shape (the caller reads /proc)."""
    request = _DIAG_REQUEST.pack(family, IPPROTO_TCP, 0, 0, 1 << TCP_LISTEN)
    header = _NLMSG.pack(_NLMSG.size + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
    found: list[TcpSocket] = []
    addr_len = 4 if family == AF_INET else 16
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(DIAG_TIMEOUT_S)
        sock.sendto(header + request, (0, 0))
        for _ in range(DIAG_MAX_RECVS):
            if len(found) > DIAG_MAX_SOCKETS:
                break
            data = sock.recv(DIAG_RECV_BYTES)
            if not data:
                raise OSError("sock_diag: the dump ended without NLMSG_DONE")
            if parse_diag_reply(data, found, addr_len=addr_len):
                return found
    raise OSError(f"sock_diag: no end of the dump after {len(found)} listening sockets")


def parse_diag_reply(data: bytes, found: list[TcpSocket], *, addr_len: int) -> bool:
    """One sock_diag reply: its listening sockets appended to `found`; True at NLMSG_DONE. Raises
    OSError for a refusal (NLMSG_ERROR) or a message out of shape (cut short, a length that does
    not advance); messages of other types are passed over."""
    offset = 0
    while offset + _NLMSG.size <= len(data):
        length, kind, _flags, _seq, _port = _NLMSG.unpack_from(data, offset)
        if length < _NLMSG.size or offset + length > len(data):
            raise OSError(f"sock_diag: a message of {length} bytes at {offset} of {len(data)}")
        if kind == NLMSG_DONE:
            return True
        if kind == NLMSG_ERROR:
            errno = -struct.unpack_from("=i", data, offset + _NLMSG.size)[0] if length >= _NLMSG.size + 4 else 0
            raise OSError(errno, f"sock_diag refused the dump: {os.strerror(errno) if errno > 0 else '?'}")
        if kind == SOCK_DIAG_BY_FAMILY:
            if length < _NLMSG.size + _DIAG_MSG.size:
                raise OSError(f"sock_diag: a socket message of {length} bytes")
            (family, state, _timer, _retrans, sport, _dport, src, _dst, _if,
             _expires, _rqueue, _wqueue, _uid, inode) = _DIAG_MSG.unpack_from(data, offset + _NLMSG.size)
            if state == TCP_LISTEN:  # (asked for LISTEN only; anything else is not taken)
                found.append(TcpSocket(inode=inode, state=state, family=family, local_addr=src[:addr_len],
                                       local_port=int.from_bytes(sport, "big"),
                                       remote_addr=bytes(addr_len), remote_port=0))
        offset += (length + 3) & ~3  # NLMSG_ALIGN
    return False


def same_netns(pid: int | None, *, proc_root: Path = PROC) -> bool:
    """Whether process `pid` (None: this one) is in this process's network namespace; False when
    either cannot be read."""
    if pid is None:
        return True
    try:
        theirs = os.stat(proc_root / str(pid) / "ns" / "net")
        ours = os.stat(proc_root / "self" / "ns" / "net")
    except OSError:
        return False
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)


_diag_failures = 0  # (the first is logged; /proc answers every call)


def listening_sockets(pid: int | None = None, *, proc_root: Path = PROC) -> list[TcpSocket]:
    """The TCP sockets in the LISTEN state (IPv4, then IPv6) in the network namespace of `pid`
    (None: the agent's own, /proc/net). From sock_diag when that namespace is this process's own
    and `proc_root` is the real /proc (module docstring); else, or when the dump fails, from
    /proc/<pid>/net/tcp{,6}. Either way the same sockets, fields and order of families."""
    global _diag_failures
    if proc_root == PROC and same_netns(pid, proc_root=proc_root):
        try:
            return [*_diag_listening(AF_INET), *_diag_listening(AF_INET6)]
        except OSError as exc:
            _diag_failures += 1
            if _diag_failures == 1:
                log.info("listening sockets from /proc instead of sock_diag: %s", exc)
    return proc_listening_sockets(net_dir=proc_root / "net" if pid is None else proc_root / str(pid) / "net")


def socket_fds(pid: int, *, proc_root: Path = Path("/proc")) -> dict[int, int]:
    """Map socket inode -> fd for the sockets process `pid` holds (first fd per inode)."""
    fd_dir = proc_root / str(pid) / "fd"
    result: dict[int, int] = {}
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return result
    for name in names:
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue  # closed while we looked
        if target.startswith("socket:[") and target.endswith("]"):
            result.setdefault(int(target[8:-1]), int(name))
    return result


def accepted_connections(pid: int, *, proc_root: Path = Path("/proc")) -> list[tuple[int, TcpSocket]]:
    """(fd, socket) for each connected TCP socket that process `pid` holds and that was accepted
    (its local port is a listening port in the process's netns), sorted by fd. Outbound
    connections (ephemeral local ports) are left out: they carry no requests to this server."""
    fds = socket_fds(pid, proc_root=proc_root)
    if not fds:
        return []
    table = read_tcp_tables(net_dir=proc_root / str(pid) / "net")
    listening_ports = {s.local_port for s in table if s.state == TCP_LISTEN}
    connected = (TCP_ESTABLISHED, TCP_CLOSE_WAIT)
    pairs = [
        (fds[s.inode], s)
        for s in table
        if s.state in connected and s.inode in fds and s.local_port in listening_ports
    ]
    return sorted(pairs, key=lambda pair: pair[0])


# Syscall numbers of the calls a thread can be blocked in when the probe attaches.
_SYSCALL_NUMBERS = {
    "x86_64": {"read": 0, "readv": 19, "recvfrom": 45, "recvmsg": 47, "accept": 43, "accept4": 288},
    "aarch64": {"read": 63, "readv": 65, "recvfrom": 207, "recvmsg": 212, "accept": 202, "accept4": 242},
}
READ_SYSCALLS = ("read", "readv", "recvfrom", "recvmsg")
ACCEPT_SYSCALLS = ("accept", "accept4")


def syscall_numbers() -> dict[str, int]:
    """Numbers of the read/accept syscalls on this machine's architecture ({} when unknown)."""
    return _SYSCALL_NUMBERS.get(os.uname().machine, {})


@dataclass(frozen=True, slots=True)
class BlockedSyscall:
    tid: int
    nr: int
    args: tuple[int, ...]  # the six syscall arguments


def blocked_syscalls(pid: int, *, proc_root: Path = Path("/proc")) -> list[BlockedSyscall]:
    """The syscall each thread of `pid` is currently inside (from /proc/PID/task/TID/syscall);
    threads that are running or in user space are left out."""
    result: list[BlockedSyscall] = []
    task_dir = proc_root / str(pid) / "task"
    try:
        tids = sorted(int(name) for name in os.listdir(task_dir) if name.isdigit())
    except OSError:
        return result
    for tid in tids:
        try:
            fields = (task_dir / str(tid) / "syscall").read_text().split()
        except OSError:
            continue  # the thread exited
        if len(fields) < 7 or fields[0] in ("running", "-1"):
            continue
        try:
            result.append(BlockedSyscall(tid=tid, nr=int(fields[0]), args=tuple(int(a, 16) for a in fields[1:7])))
        except ValueError:
            continue
    return result
