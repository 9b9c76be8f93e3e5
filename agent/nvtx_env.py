"""Print the environment line that makes a serving process's NVTX calls reach moescope.

    NVTX_INJECTION64_PATH=/abs/path/to/libmoescope_nvtx.so

For systemd units (`Environment=` or an `EnvironmentFile=`), container specs, or a shell:
`env $(agent nvtx-env) python serve.py`. A process started this way can be observed later with
`agent start --pid PID` (the injection library does nothing but one load per NVTX call until an
agent attaches). `agent start -- CMD` sets the variable itself.
"""

from __future__ import annotations

import argparse
import shlex

from moescope.collectors.nvtx import INJECTION_ENV, RING_DIR_ENV, injection_library_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--export",
        action="store_true",
        help="print as a shell `export` statement (for `eval $(agent nvtx-env --export)`)",
    )
    parser.add_argument(
        "--ring-dir",
        metavar="DIR",
        help=f"also print {RING_DIR_ENV}=DIR (where the process puts its ring; default /dev/shm)",
    )


def lines(*, export: bool, ring_dir: str | None) -> list[str]:
    pairs = [(INJECTION_ENV, str(injection_library_path()))]
    if ring_dir:
        pairs.append((RING_DIR_ENV, ring_dir))
    prefix = "export " if export else ""
    # plain form is what systemd's Environment= takes; quote only for the shell form
    return [f"{prefix}{key}={shlex.quote(value) if export else value}" for key, value in pairs]


def run(args: argparse.Namespace) -> int:
    for line in lines(export=args.export, ring_dir=args.ring_dir):
        print(line)
    return 0
