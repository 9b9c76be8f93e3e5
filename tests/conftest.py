"""Suite-wide rules: BPF tests never skip. Under `make test` (MOESCOPE_REQUIRE_BPF=1) a machine that
cannot load eBPF programs fails the session at start instead of quietly running less, and a test
that skips anyway (any test: BPF, NVTX or other) fails the session at its end, named."""

from __future__ import annotations

import os

import pytest


def bpf_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "not root: eBPF tests need root"
    try:
        import bcc  # noqa: F401
    except ImportError as exc:
        return f"bcc not importable ({exc}); run scripts/setup.sh"
    if not os.path.exists("/sys/kernel/tracing/events/syscalls") and not os.path.exists(
        "/sys/kernel/debug/tracing/events/syscalls"
    ):
        return "tracefs syscall events not mounted; run scripts/setup.sh"
    return None


def _required() -> bool:
    return os.environ.get("MOESCOPE_REQUIRE_BPF") == "1"


def pytest_sessionstart(session: pytest.Session) -> None:
    if _required():
        reason = bpf_unavailable_reason()
        if reason:
            pytest.exit(f"BPF tests must run here but cannot: {reason}", returncode=3)


_SKIPPED: list[str] = []  # under make test: tests that skipped, each a failure of the session


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _required() and report.skipped:
        _SKIPPED.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _required() and _SKIPPED:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _required() and _SKIPPED:
        terminalreporter.write_line(
            f"FAILED: {len(_SKIPPED)} test(s) skipped under MOESCOPE_REQUIRE_BPF=1, where every test must run:",
            red=True,
        )
        for nodeid in _SKIPPED:
            terminalreporter.write_line(f"  {nodeid}", red=True)


@pytest.fixture
def bpf() -> None:
    """Use in every test that loads eBPF: fails (never skips) where BPF is unavailable."""
    reason = bpf_unavailable_reason()
    if reason:
        pytest.fail(reason)
