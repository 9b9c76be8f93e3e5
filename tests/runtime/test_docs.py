"""The published docs and the code say the same thing: commands, stats fields, NVTX messages."""

from __future__ import annotations

import re
from pathlib import Path

from moescope.examples.moe_runtime.config import ModelConfig
from moescope.examples.moe_runtime.control import COMMAND_ARGS
from moescope.examples.moe_runtime.runtime import PROTOCOL, Runtime, RuntimeOptions
from moescope.moe_nvtx import DEFAULT_CONVENTION, MESSAGES

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_control_protocol_doc_matches_code() -> None:
    text = (DOCS / "control-protocol.md").read_text()
    assert PROTOCOL in text
    documented = set(re.findall(r"^### `(\w+)`", text, flags=re.M))
    assert documented == set(COMMAND_ARGS)
    for cmd, spec in COMMAND_ARGS.items():
        section = text.split(f"### `{cmd}`", 1)[1].split("\n### ", 1)[0]
        for arg in spec:
            assert f'"{arg}"' in section, (cmd, arg)
    runtime = Runtime(RuntimeOptions(model=ModelConfig(d_model=32, d_ff=32, layers=1, experts=4, n_heads=2),
                                     nvtx=False, stats_page=True))
    try:
        stats = runtime.stats_dict()
    finally:
        runtime.close()
    assert "stats_page" in stats
    for key in stats["stats_page"]:
        assert f'"{key}"' in text, ("stats_page", key)
    for key in stats:
        assert f'"{key}"' in text, key
    for group in ("config", "counters", "queue", "memory", "precision"):
        for key in stats[group]:
            assert f'"{key}"' in text, (group, key)
    for key in stats["layers"][0]:
        assert f'"{key}"' in text, ("layers", key)
    for key in stats["memory"]["devices"]["cpu"]:
        assert f'"{key}"' in text, ("memory.devices", key)


def test_nvtx_convention_doc_matches_code() -> None:
    text = (DOCS / "nvtx-convention.md").read_text()
    assert f"`moe/{DEFAULT_CONVENTION}`" in text
    rows = re.findall(r"^\| `(moe\.[a-z.]+)` \|", text, flags=re.M)
    assert rows == list(MESSAGES)
