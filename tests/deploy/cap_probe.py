"""Tries, one by one, each privileged thing `agent start` does, and prints one JSON object of
outcomes ({step: "ok" | "ERRNO_NAME: message"}). Run as a script under `setpriv` with a reduced
capability set (tests/deploy/test_capabilities.py; docs/security.md quotes the results):

    python cap_probe.py --target-pid PID --ring FILE --socket PATH [--skip-bpf]

Steps:
  caps           the process's effective capability set (from /proc/self/status), for the record
  memlock_bytes  RLIMIT_MEMLOCK soft limit (bcc/libbpf no longer raise it on memcg-accounted kernels)
  tracefs_id     read a syscall tracepoint's id (what bcc's attach reads)
  tracefs_format read its format (what bcc's compile reads to build the args struct)
  bpf_load       compile + load + attach the agent's real ingress program (ringbuf map, tracepoints)
  proc_fd        list /proc/PID/fd of the target (socket inodes: --port lookup and connection seeding)
  proc_fd_link   readlink one of those fds
  proc_net_tcp   read /proc/PID/net/tcp (the target's network namespace)
  proc_environ   read /proc/PID/environ (the NVTX collector checks NVTX_INJECTION64_PATH there)
  proc_root      list /proc/PID/root/<ring dir> (the target's mount namespace: rings in containers)
  shm_ring       open the target's NVTX ring file (mode 0600, the target's uid) read-write
  control_socket connect to the target's control socket (mode 0600, the target's uid)
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import resource
import socket
import sys
from collections.abc import Callable
from pathlib import Path

TRACEPOINT = Path("/sys/kernel/tracing/events/syscalls/sys_enter_read")


def outcome(step: Callable[[], object]) -> str:
    try:
        step()
    except OSError as exc:
        return f"{errno.errorcode.get(exc.errno or 0, 'E?')}: {exc.strerror}"
    except Exception as exc:  # bcc raises bare Exception; the message is the evidence we record
        text = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
    return "ok"


def effective_caps() -> str:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return line.split()[1]
    return "?"


def connect_unix(path: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)


def load_ingress() -> None:
    # Imported here so an import failure is recorded as this step's outcome.
    from moescope.probes.ingress.loader import IngressProbe

    probe = IngressProbe(on_record=lambda _record: None)
    probe.load()
    probe.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target-pid", type=int, required=True)
    parser.add_argument("--ring", required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--skip-bpf", action="store_true", help="leave out the ~0.5 s compile step")
    args = parser.parse_args()
    pid = args.target_pid
    fd_dir = Path(f"/proc/{pid}/fd")
    results: dict[str, str] = {
        "uid": str(os.getuid()),
        "caps": effective_caps(),
        "memlock_bytes": str(resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]),
        "tracefs_id": outcome(lambda: (TRACEPOINT / "id").read_text()),
        "tracefs_format": outcome(lambda: (TRACEPOINT / "format").read_text()),
    }
    if not args.skip_bpf:
        results["bpf_load"] = outcome(load_ingress)
    results["proc_fd"] = outcome(lambda: os.listdir(fd_dir))
    results["proc_fd_link"] = outcome(lambda: os.readlink(fd_dir / "0"))
    results["proc_net_tcp"] = outcome(lambda: Path(f"/proc/{pid}/net/tcp").read_text())
    results["proc_environ"] = outcome(lambda: Path(f"/proc/{pid}/environ").read_bytes())
    ring_dir = Path(args.ring).parent.relative_to("/")
    results["proc_root"] = outcome(lambda: os.listdir(Path(f"/proc/{pid}/root") / ring_dir))
    results["shm_ring"] = outcome(lambda: os.close(os.open(args.ring, os.O_RDWR)))
    results["control_socket"] = outcome(lambda: connect_unix(args.socket))
    print(json.dumps(results, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
