"""Policy rules and a standalone policy loop.

    agent policy show [--config FILE] [--json]
        validate and print the effective rules (packaged defaults from DESIGN.md's table,
        overridden key by key by FILE)
    agent policy run (--control-socket PATH | --pid PID) [--config FILE] [--dry-run] [--audit FILE]
                     [--duration S]
        run the policy loop on a runtime with signals read from its own `stats` (memory, expert
        queues, Gini, router entropy; no eBPF or NVTX needed), printing one line per decision
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from moescope.agent.policy.actuator import Actuator, CommandFailed, find_control_socket
from moescope.agent.policy.audit import AuditLog, AuditRecord
from moescope.agent.policy.config import PolicyConfig, load_policy
from moescope.agent.policy.engine import PolicyEngine, PolicyLoop
from moescope.agent.policy.rules import SIGNALS, RuleSpec
from moescope.agent.policy.stats_source import RuntimeStatsSignals, queue_floor_for
from moescope.errors import ControlError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="policy_command", metavar="ACTION", required=True)
    show = sub.add_parser("show", help="validate and print the effective policy rules")
    show.add_argument("--config", metavar="FILE", default=None, help="policy TOML overriding the defaults")
    show.add_argument("--json", action="store_true", help="print JSON instead of a table")
    loop = sub.add_parser("run", help="run the policy loop on a runtime, signals from its stats")
    where = loop.add_mutually_exclusive_group(required=True)
    where.add_argument("--control-socket", metavar="PATH", help="the runtime's control socket")
    where.add_argument("--pid", type=int, metavar="PID", help="the runtime's pid (finds its control socket)")
    loop.add_argument("--config", metavar="FILE", default=None, help="policy TOML overriding the defaults")
    loop.add_argument("--dry-run", action="store_true", help="record decisions, send nothing")
    loop.add_argument("--audit", metavar="FILE", default=None, help="also append audit records (JSON lines) to FILE")
    loop.add_argument("--state-file", metavar="FILE", default=None,
                      help="remember what was applied across restarts (see docs/policy.md)")
    loop.add_argument("--duration", type=float, metavar="S", default=None, help="stop after S seconds")


def _rule_json(spec: RuleSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "enabled": spec.enabled,
        "signal": spec.signal,
        "unit": SIGNALS[spec.signal].unit,
        "per": SIGNALS[spec.signal].target.value,
        "comparison": spec.comparison,
        "fire": spec.fire,
        "window": spec.window_text,
        "window_evals": spec.window_evals,
        "clear": spec.clear,
        "clear_window": spec.clear_window_text,
        "clear_window_evals": spec.clear_window_evals,
        "cooldown_s": spec.cooldown_s,
        "action": spec.action,
        "args": dict(spec.args),
        "revert": spec.revert,
        "description": spec.description,
    }


def render_table(config: PolicyConfig) -> str:
    header = ("rule", "signal", "fire", "window", "action", "clear", "clear window", "cooldown", "on")
    rows = [header]
    for spec in config.rules:
        clear_cmp = "<" if spec.comparison in (">", ">=") else ">"
        args = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in spec.args.items())
        rows.append(
            (
                spec.name,
                f"{spec.signal} [{SIGNALS[spec.signal].target.value}]",
                f"{spec.comparison} {spec.fire:g}",
                spec.window_text,
                f"{spec.action}({args})" if args else spec.action,
                f"{clear_cmp} {spec.clear:g}" + ("" if spec.revert else " (no revert)"),
                spec.clear_window_text,
                f"{spec.cooldown_s:g} s",
                "yes" if spec.enabled else "no",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        f"policy from {' + '.join(config.sources)}",
        f"sample period {config.sample_period_ms} ms; rate limit {config.max_actions} actions per "
        f"{config.rate_window_s:g} s; command timeout {config.command_timeout_ms:g} ms "
        f"(late answers awaited {config.late_answer_ms:g} ms more); "
        f"at most {config.max_targets} targets a rule",
        "",
    ]
    for row in rows:
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
    return "\n".join(lines) + "\n"


def decision_line(rec: AuditRecord) -> str:
    """One line per decision, for people watching a terminal."""
    stamp = time.strftime("%H:%M:%S", time.localtime(rec.ts_unix_s)) + f".{int(rec.ts_unix_s * 1000) % 1000:03d}"
    target = ",".join(str(t) for t in rec.target) or "-"
    value = "n/a" if math.isnan(rec.value) else f"{rec.value:.4g}"
    op = rec.comparison if rec.intent == "fire" else ("<" if rec.comparison in (">", ">=") else ">")
    sent = len([c for c in rec.commands if c.request.get("cmd") != "stats"])
    line = (
        f"{stamp} {rec.intent:6s} {rec.rule:24s} {target:6s} {rec.decision:24s} {rec.outcome:15s} "
        f"{value} {op} {rec.threshold:g} ({rec.window})  {rec.plan}"
    )
    if rec.commands:
        line += f"  [{sent} command{'s' if sent != 1 else ''}, {rec.latency_ms:.1f} ms]"
    if rec.error:
        line += f"  error: {rec.error}"
    return line


def run_loop(args: argparse.Namespace) -> int:
    config = load_policy(args.config)
    socket_path = Path(args.control_socket) if args.control_socket else find_control_socket(args.pid)
    actuator = Actuator.for_config(socket_path, config)
    try:
        actuator.read_state()
    except CommandFailed as exc:
        raise ControlError(f"cannot read the runtime's state: {exc}") from None
    audit = AuditLog(path=args.audit)
    lock = threading.Lock()

    def show(rec: AuditRecord) -> None:
        with lock:
            print(decision_line(rec), flush=True)

    audit.add_hook(show)
    engine = PolicyEngine(config, audit=audit, actuator=actuator, dry_run=args.dry_run, state_path=args.state_file)
    source = RuntimeStatsSignals(socket_path, timeout_s=config.command_timeout_ms / 1000.0, runtime_pid=args.pid,
                                 queue_floor=queue_floor_for(config.rules))
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    print(f"policy: {len(engine.rules)} rules on {socket_path}{' (dry run: nothing is sent)' if args.dry_run else ''}; "
          f"every {config.sample_period_ms} ms", flush=True)
    engine.start()
    loop = PolicyLoop(engine, source, period_s=config.sample_period_s)
    loop.start()
    try:
        stop.wait(args.duration)
    finally:
        loop.stop()
        engine.close()
        source.close()
        audit.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"policy: {engine.evaluations} evaluations, {sum(engine.decisions.values())} decisions, "
          f"{source.poll_errors} failed stats polls", flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.policy_command == "run":
        return run_loop(args)
    config = load_policy(args.config)  # ConfigError -> one line, exit 2 (agent/cli.py)
    if args.json:
        body = {
            "sources": list(config.sources),
            "sample_period_ms": config.sample_period_ms,
            "max_actions": config.max_actions,
            "rate_window_s": config.rate_window_s,
            "command_timeout_ms": config.command_timeout_ms,
            "late_answer_ms": config.late_answer_ms,
            "max_targets": config.max_targets,
            "rules": [_rule_json(spec) for spec in config.rules],
        }
        sys.stdout.write(json.dumps(body, indent=2) + "\n")
    else:
        sys.stdout.write(render_table(config))
    return 0
