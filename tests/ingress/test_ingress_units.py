"""Ingress pieces that need no kernel: the C/ctypes struct contract, procfs parsing, the daemon's
sink handling, and the loader's error mapping."""

from __future__ import annotations

import ctypes as ct
import subprocess
from pathlib import Path

import pytest

from moescope import errors
from moescope.agent.daemon import Daemon
from moescope.probes.ingress import loader, procnet

C_PROGRAM = r"""
#include <stdio.h>
#include <stddef.h>
#include "ingress.h"
#define S(t) printf(#t " %zu\n", sizeof(struct t))
#define O(t, f) printf(#t "." #f " %zu\n", offsetof(struct t, f))
#define C(n) printf(#n " %d\n", n)
int main(void) {
    S(ingress_event); S(ingress_conn_key); S(ingress_conn); S(ingress_inflight);
    O(ingress_event, tgid); O(ingress_event, fd); O(ingress_event, family); O(ingress_event, peer_addr);
    O(ingress_conn, tid); O(ingress_conn, peer_addr); O(ingress_inflight, kind); O(ingress_inflight, tid);
    C(INGRESS_F_NO_RESPONSE); C(INGRESS_F_SEEDED); C(INGRESS_F_FLUSHED);
    C(INGRESS_DROP_RINGBUF_FULL); C(INGRESS_DROP_CONN_EVICTED); C(INGRESS_DROP_INFLIGHT_FULL);
    C(INGRESS_DROP_NR); C(INGRESS_CC_USER_INSERTS); C(INGRESS_CC_USER_DELETES); C(INGRESS_CC_NR);
    C(INGRESS_K_ACCEPT); C(INGRESS_TARGET_SLOTS); printf("INGRESS_TARGET_SHARED %u\n", INGRESS_TARGET_SHARED); C(INGRESS_K_READ); C(INGRESS_K_WRITE);
    return 0;
}
"""


def test_ctypes_mirrors_match_the_c_header(tmp_path: Path) -> None:
    source = tmp_path / "layout.c"
    source.write_text(C_PROGRAM)
    binary = tmp_path / "layout"
    subprocess.run(["gcc", "-Wall", "-Werror", f"-I{loader.PROBE_DIR}", "-o", str(binary), str(source)], check=True)
    facts = dict(
        line.rsplit(" ", 1)
        for line in subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout.splitlines()
    )
    c = {name: int(value) for name, value in facts.items()}

    assert c["ingress_event"] == ct.sizeof(loader.IngressEvent)
    assert c["ingress_conn_key"] == ct.sizeof(loader.IngressConnKey)
    assert c["ingress_conn"] == ct.sizeof(loader.IngressConn)
    assert c["ingress_inflight"] == ct.sizeof(loader.IngressInflight)
    for struct, py in (
        ("ingress_event", loader.IngressEvent),
        ("ingress_conn", loader.IngressConn),
        ("ingress_inflight", loader.IngressInflight),
    ):
        for key, value in c.items():
            if key.startswith(struct + "."):
                assert getattr(py, key.split(".")[1]).offset == value, key
    assert c["INGRESS_F_NO_RESPONSE"] == loader.F_NO_RESPONSE
    assert c["INGRESS_F_SEEDED"] == loader.F_SEEDED
    assert c["INGRESS_F_FLUSHED"] == loader.F_FLUSHED
    assert c["INGRESS_DROP_RINGBUF_FULL"] == loader.DROP_RINGBUF_FULL
    assert c["INGRESS_DROP_CONN_EVICTED"] == loader.DROP_CONN_EVICTED
    assert c["INGRESS_DROP_INFLIGHT_FULL"] == loader.DROP_INFLIGHT_FULL
    assert c["INGRESS_DROP_NR"] == loader.DROP_NR == len(loader.DROP_NAMES)
    assert c["INGRESS_CC_USER_INSERTS"] == loader.CC_USER_INSERTS
    assert c["INGRESS_CC_USER_DELETES"] == loader.CC_USER_DELETES
    assert c["INGRESS_CC_NR"] == loader.CC_NR
    assert (c["INGRESS_TARGET_SLOTS"], c["INGRESS_TARGET_SHARED"]) == (loader.TARGET_SLOTS, loader.TARGET_SHARED)
    assert (c["INGRESS_K_ACCEPT"], c["INGRESS_K_READ"], c["INGRESS_K_WRITE"]) == (
        loader.K_ACCEPT,
        loader.K_READ,
        loader.K_WRITE,
    )


TCP4 = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1111 1 0 100 0 0 10 0
   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 2222 1 0 20 4 30 10 -1
   2: 0100007F:D431 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 3333 1 0 20 4 30 10 -1
   3: garbage line
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:1F91 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4444 1 0 100 0 0 10 0
   1: 00000000000000000000000001000000:1F91 00000000000000000000000001000000:C001 08 00000000:00000000 00:00000000 00000000     0        0 5555 1 0 100 0 0 10 0
"""


def test_tcp_tables_parse_addresses_ports_states() -> None:
    v4 = procnet.parse_tcp_table(TCP4, family=procnet.AF_INET)
    assert [(s.inode, s.state, s.local_port, s.remote_port) for s in v4] == [
        (1111, procnet.TCP_LISTEN, 8080, 0),
        (2222, procnet.TCP_ESTABLISHED, 8080, 54321),
        (3333, procnet.TCP_ESTABLISHED, 54321, 8080),
    ]
    assert v4[1].remote_addr == bytes([127, 0, 0, 1])
    v6 = procnet.parse_tcp_table(TCP6, family=procnet.AF_INET6)
    assert v6[1].remote_addr == bytes(15) + b"\x01"  # ::1
    assert (v6[1].state, v6[1].local_port, v6[1].remote_port) == (procnet.TCP_CLOSE_WAIT, 8081, 0xC001)


def test_accepted_connections_leave_out_outbound_sockets(tmp_path: Path) -> None:
    # A fixture /proc: pid 42 holds the listener (fd 3), an accepted socket (fd 5) and an
    # outbound one (fd 6, ephemeral local port), plus a file.
    (tmp_path / "42" / "net").mkdir(parents=True)
    (tmp_path / "42" / "net" / "tcp").write_text(TCP4)
    (tmp_path / "42" / "net" / "tcp6").write_text(TCP6)
    fd_dir = tmp_path / "42" / "fd"
    fd_dir.mkdir()
    (fd_dir / "3").symlink_to("socket:[1111]")
    (fd_dir / "5").symlink_to("socket:[2222]")
    (fd_dir / "6").symlink_to("socket:[3333]")
    (fd_dir / "7").symlink_to("/var/log/x.log")
    found = procnet.accepted_connections(42, proc_root=tmp_path)
    assert [(fd, s.inode, s.remote_port) for fd, s in found] == [(5, 2222, 54321)]


def test_daemon_counts_sink_errors_and_keeps_going() -> None:
    daemon = Daemon(period_ns=1_000_000)
    seen: list[int] = []

    def broken(_record: object) -> None:
        raise RuntimeError("sink down")

    daemon.add_sink(broken)
    daemon.add_sink(seen.append)
    for i in range(3):
        daemon.emit(i)
    assert seen == [0, 1, 2]
    assert daemon.sink_errors == 3
    stops = iter([None, None, "done"])
    daemon.add_tick_hook(lambda _now: next(stops))
    assert daemon.run() == "done"
    assert daemon.ticks == 3


def test_missing_kernel_headers_is_a_probe_load_error(tmp_path: Path) -> None:
    with pytest.raises(errors.ProbeLoadError, match="kernel headers missing") as info:
        loader.check_kernel_headers(tmp_path / "no-such-build")
    assert info.value.exit_code == errors.EXIT_PROBE_LOAD


def test_bad_options_are_usage_errors() -> None:
    with pytest.raises(errors.UsageError, match="power of two"):
        loader.IngressOptions(ringbuf_pages=3).validate()
    with pytest.raises(errors.UsageError, match="max_conns"):
        loader.IngressOptions(max_conns=0).validate()
    assert "-DMAX_CONNS=65536" in loader.cflags(loader.IngressOptions())


def test_launched_command_is_held_then_execs_in_the_same_pid(tmp_path: Path) -> None:
    from moescope.agent.targets import LaunchedCommand
    from moescope.procfs import read_comm

    out = tmp_path / "out"
    command = LaunchedCommand(
        ["sh", "-c", f'echo "$MOESCOPE_TEST_VAR $$" > {out}; kill -TERM $$'], extra_env={"MOESCOPE_TEST_VAR": "seen"}
    )
    try:
        # Held: still the trampoline (python), nothing of the command has run yet.
        comm = read_comm(command.popen.pid)
        assert comm is not None and comm.startswith("python")
        assert not out.exists()
        assert command.target.alive()
        command.release()
        assert command.exit_status() == 128 + 15  # killed by SIGTERM, shell style
        assert out.read_text().split() == ["seen", str(command.popen.pid)]  # same pid after exec
        assert not command.target.alive()
    finally:
        command.stop()


def test_unknown_command_is_a_usage_error() -> None:
    from moescope.agent.targets import LaunchedCommand

    with pytest.raises(errors.UsageError, match="command not found"):
        LaunchedCommand(["no-such-command-moescope"])
