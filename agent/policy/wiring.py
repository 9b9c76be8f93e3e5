"""Command-line wiring for the policy engine, for `agent start`:

    add_policy_arguments(parser)
    engine = build_policy(args, runtime_pid=pid)   # None with --no-policy
    engine.start(); PolicyLoop(engine, pipeline.policy_signals, period_s=engine.config.sample_period_s)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moescope.agent.policy.actuator import Actuator, find_control_socket
from moescope.agent.policy.audit import AuditLog
from moescope.agent.policy.config import load_policy
from moescope.agent.policy.engine import PolicyEngine
from moescope.errors import ControlError

DEFAULT_AUDIT_PATH = "/var/log/moescope/policy-audit.jsonl"
DEFAULT_STATE_DIR = "/var/lib/moescope"


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("policy")
    group.add_argument("--policy", metavar="FILE", default=None,
                       help="policy TOML overriding the defaults (see `agent policy show`)")
    group.add_argument("--no-policy", action="store_true", help="observe only: no policy engine")
    group.add_argument("--dry-run", action="store_true",
                       help="the policy records its decisions and sends nothing to the runtime")
    group.add_argument("--control-socket", metavar="PATH", default=None,
                       help="the runtime's control socket (default: found from the target pid)")
    group.add_argument("--policy-audit", metavar="FILE", default=DEFAULT_AUDIT_PATH,
                       help=f"JSON-lines audit trail of every policy decision (default {DEFAULT_AUDIT_PATH})")
    group.add_argument("--policy-state-dir", metavar="DIR", default=DEFAULT_STATE_DIR,
                       help="where the agent remembers what it applied to each runtime, across restarts "
                            f"(default {DEFAULT_STATE_DIR})")


def build_policy(args: argparse.Namespace, *, runtime_pid: int | None) -> PolicyEngine | None:
    """The configured engine (not started), or None with --no-policy. Raises ConfigError for a bad
    policy file and ControlError when no control socket can be found (unless --dry-run)."""
    if args.no_policy:
        return None
    config = load_policy(args.policy)
    socket_path: Path | None = Path(args.control_socket) if args.control_socket else None
    if socket_path is None and runtime_pid is not None:
        try:
            socket_path = find_control_socket(runtime_pid)
        except ControlError:
            if not args.dry_run:
                raise
    if socket_path is None and not args.dry_run:
        raise ControlError("the policy needs the runtime's control socket: pass --control-socket PATH, "
                           "--pid of the runtime, --dry-run or --no-policy")
    actuator = Actuator.for_config(socket_path, config) if socket_path else None
    # Keyed by runtime pid: a restarted runtime starts clean, so an older agent's record must not apply.
    key = str(runtime_pid) if runtime_pid is not None else (socket_path.name if socket_path else "none")
    state_path = Path(args.policy_state_dir) / f"policy-state-{key}.json"
    return PolicyEngine(
        config,
        audit=AuditLog(path=args.policy_audit),
        actuator=actuator,
        dry_run=args.dry_run,
        state_path=state_path,
    )
