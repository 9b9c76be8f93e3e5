"""moescope's typed errors: each carries a one-line message for users and a documented exit code.

Neutral: the agent, its collectors and probes, and the reference runtime all raise these.

Exit codes (also in README "Exit codes"):
    0  success
    1  unexpected internal error (a bug: please report it)
    2  bad usage: flags, config or arguments
    3  not permitted: needs root (or CAP_BPF + CAP_PERFMON)
    4  bcc (Debian's python3-bpfcc) not importable
    5  kernel headers missing or the eBPF program failed to compile/load/attach
    6  no such process
    7  nothing is listening on the given port
    8  the target process exited
    9  a required data source is unavailable (NVTX ring, NVML, control socket)
"""

from __future__ import annotations

import argparse
from typing import NoReturn

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_NOT_PERMITTED = 3
EXIT_BCC_MISSING = 4
EXIT_PROBE_LOAD = 5
EXIT_NO_SUCH_PROCESS = 6
EXIT_PORT_NOT_LISTENING = 7
EXIT_TARGET_EXITED = 8
EXIT_SOURCE_UNAVAILABLE = 9


def one_line(message: str) -> str:
    """A message safe to print as one line: text from files (keys, names) may hold newlines or
    terminal escapes; those are shown escaped."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in message)


class MoescopeError(Exception):
    """Base of every error the agent reports to users as one line and an exit code."""

    exit_code = EXIT_INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UsageError(MoescopeError):
    exit_code = EXIT_USAGE


class ConfigError(UsageError):
    """A config file or value is invalid."""


class NotPermitted(MoescopeError):
    exit_code = EXIT_NOT_PERMITTED


class BccMissing(MoescopeError):
    exit_code = EXIT_BCC_MISSING


class ProbeLoadError(MoescopeError):
    """Kernel headers missing, or the eBPF program failed to compile or load."""

    exit_code = EXIT_PROBE_LOAD


class AttachError(ProbeLoadError):
    """The program loaded but a tracepoint/uprobe could not be attached."""


class NoSuchProcess(MoescopeError):
    exit_code = EXIT_NO_SUCH_PROCESS


class PortNotListening(MoescopeError):
    exit_code = EXIT_PORT_NOT_LISTENING


class TargetExited(MoescopeError):
    exit_code = EXIT_TARGET_EXITED


class SourceUnavailable(MoescopeError):
    exit_code = EXIT_SOURCE_UNAVAILABLE


class NvtxUnavailable(SourceUnavailable):
    """The target was not started with the moescope NVTX injection library."""


class NvmlUnavailable(SourceUnavailable):
    """No NVIDIA driver / NVML on this host."""


class ControlError(SourceUnavailable):
    """The runtime's control socket is unreachable, refused a command, or timed out."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, as every other bad input here is:
    `PROG: error: MESSAGE (see PROG --help)` and exit 2 (argparse prints its whole usage first,
    which buries the one line that matters; --help still prints it). Sub-parsers are of this class
    too (add_subparsers makes its parsers of the parent's type)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def tcp_port(text: str) -> int:
    """argparse type for a TCP port, 0 to 65535 (0: any free one). A number past it was a
    traceback from bind() after the program had started (agent --metrics-port, the servers' --port)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {value}")
    return value
