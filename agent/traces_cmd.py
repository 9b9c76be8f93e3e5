"""List and show traces kept by the embedded store (OTLP-JSON files written when no OTLP endpoint is set).

  agent traces list [--limit N] [--json]       recent traces: id, start, duration, span count, root span
  agent traces show TRACE_ID [--json]          one trace as a tree (a unique id prefix of 4+ digits works)

The store is STATE_DIR/traces (--state-dir, else $MOESCOPE_STATE_DIR, else /var/lib/moescope).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from moescope import errors
from moescope.agent.export.config import TRACES_SUBDIR, add_state_dir_argument, default_traces_dir
from moescope.agent.export.store import TraceStore, render_list, render_tree, trace_as_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="traces_command", metavar="ACTION", required=True)
    p_list = sub.add_parser("list", help="recent traces, newest first")
    add_state_dir_argument(p_list)
    p_list.add_argument(
        "--limit", type=int, default=20, metavar="N", help="show at most N traces (default 20; 0 = all)"
    )
    p_list.add_argument("--json", action="store_true", help="one JSON object per trace")
    p_show = sub.add_parser("show", help="one trace as a tree of spans")
    add_state_dir_argument(p_show)
    p_show.add_argument("trace_id", metavar="TRACE_ID", help="32 hex digits, or a unique prefix of 4 or more")
    p_show.add_argument("--json", action="store_true", help="the trace's spans as JSON")


def _traces_dir(args: argparse.Namespace) -> Path:
    if args.state_dir:
        return Path(args.state_dir) / TRACES_SUBDIR
    return default_traces_dir(os.environ)


def run(args: argparse.Namespace) -> int:
    if args.traces_command == "list" and args.limit < 0:
        raise errors.UsageError(f"--limit must be >= 0, got {args.limit}")
    store = TraceStore.load(_traces_dir(args))
    if store.bad_lines:
        print(f"agent: warning: skipped {store.bad_lines} unreadable lines in {store.directory}", file=sys.stderr)
    if args.traces_command == "list":
        summaries = store.summaries()
        if args.limit:
            summaries = summaries[: args.limit]
        if args.json:
            for s in summaries:
                print(json.dumps({"trace_id": s.trace_id, "root": s.root_name, "start_ns": s.start_ns,
                                  "duration_ns": s.duration_ns, "spans": s.span_count}))
        else:
            sys.stdout.write(render_list(summaries))
        return 0
    trace_id = store.resolve(args.trace_id)
    spans = store.spans(trace_id)
    if args.json:
        print(json.dumps(trace_as_json(trace_id, spans), indent=2))
    else:
        sys.stdout.write(render_tree(trace_id, spans))
    return 0
