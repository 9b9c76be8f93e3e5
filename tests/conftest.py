"""Suite-wide rules: BPF tests never skip. Under `make test` (MOESCOPE_REQUIRE_BPF=1) a machine that
cannot load eBPF programs fails the session at start instead of quietly running less."""

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


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get("MOESCOPE_REQUIRE_BPF") == "1":
        reason = bpf_unavailable_reason()
        if reason:
            pytest.exit(f"BPF tests must run here but cannot: {reason}", returncode=3)


@pytest.fixture
def bpf() -> None:
    """Use in every test that loads eBPF: fails (never skips) where BPF is unavailable."""
    reason = bpf_unavailable_reason()
    if reason:
        pytest.fail(reason)
