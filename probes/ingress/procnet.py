"""Read TCP sockets from procfs: /proc/<pid>/net/tcp{,6} tables and /proc/<pid>/fd socket inodes.

Used at attach (seed connections opened before the probe) and by `agent start --port` (find the
processes holding a listening socket). `proc_root` lets tests point the parsers at fixture trees.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

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
