"""`agent` command line: one subcommand per module, each exposing add_arguments(p) and run(args) -> int."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from moescope import errors

# (name, module, one-line help). Each module defines add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: list[tuple[str, str, str]] = [
    ("start", "moescope.agent.start", "attach to a serving process and observe it (needs root)"),
    ("traces", "moescope.agent.traces_cmd", "list and show traces kept by the embedded OTLP-JSON store"),
    ("policy", "moescope.agent.policy_cmd", "policy rules: show the effective rules, or run the loop on a runtime"),
    ("top", "moescope.agent.top_cmd", "live view of a running agent (reads its state file; no root needed)"),
    ("report", "moescope.agent.report_cmd",
     "where the time went: per-phase p50/p99/share, TTFT, TPOT and tokens for a window of traces"),
    ("nvtx-env", "moescope.agent.nvtx_env", "print NVTX_INJECTION64_PATH=... for a serving process's environment"),
]

EPILOG = """\
exit codes: 0 ok, 1 internal error, 2 usage, 3 not permitted (root needed), 4 bcc missing,
5 probe compile/load failed (kernel headers?), 6 no such process, 7 nothing listening on port,
8 target exited, 9 data source unavailable.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = errors.ArgumentParser(
        prog="agent",
        description="moescope: eBPF/NVTX observability and policy agent for MoE inference serving.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name, help_text in SUBCOMMANDS:
        module = importlib.import_module(module_name)
        p = sub.add_parser(
            name,
            help=help_text,
            description=(module.__doc__ or help_text).strip(),
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="agent: %(levelname)s: %(message)s",
    )
    try:
        return int(args._run(args))
    except errors.MoescopeError as exc:
        print(f"agent: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `agent traces show ID | head`: the reader left; say nothing more, exit like other tools.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
