"""The MoE routing panel at DeepSeek-V3 shape (L = 58 MoE layers, E = 256 experts), at 80 and 160
columns: the per-expert strip buckets the experts to the width (the header says how many a cell
holds, a cell shows its hottest expert), the rows left go to the most unhealthy layers, nothing
overflows the terminal, and the whole screen still fits with eight ranks beside it."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

import numpy as np

from moescope.agent import state as st
from moescope.agent.tui.layout import Dashboard
from moescope.agent.tui.moe import HEAT_LEVELS, MoePanel

from .conftest import load_fixture, render
from .test_ranks_panel import eight_ranks

LAYERS, EXPERTS = 58, 256
BAD_GINI_LAYERS = (5, 17, 42)  # Gini 0.4: far out of the 0.08-0.12 band
BAD_ENTROPY_LAYER = 33  # H/log2E 0.45: under the band
HOT_LAYER, HOT_EXPERT, HOT_SHARE = 17, 200, 0.2


def deepseek_moe() -> st.Moe:
    """58 x 256 routing as the windows output builds it (agent/outputs/windows.py panels())."""
    rng = np.random.default_rng(7)
    layers = []
    for layer in range(LAYERS):
        tokens = rng.integers(400, 600, size=EXPERTS).astype(np.float64)
        if layer == HOT_LAYER:  # one expert takes HOT_SHARE of the layer's tokens
            rest = tokens.sum() - tokens[HOT_EXPERT]
            tokens[HOT_EXPERT] = HOT_SHARE * rest / (1 - HOT_SHARE)
        shares, per_bin = st.bin_expert_shares(tokens.tolist())
        norm = 0.45 if layer == BAD_ENTROPY_LAYER else 0.6
        layers.append(st.MoeLayer(
            layer=layer, num_experts=EXPERTS, experts_per_bin=per_bin, expert_token_share=shares,
            hot_experts=st.hottest_experts(tokens.tolist()), tokens_total=int(tokens.sum()),
            entropy_bits=norm * math.log2(EXPERTS), gini=0.4 if layer in BAD_GINI_LAYERS else 0.1,
            capacity_drops=0,
        ))
    return st.Moe(window_s=10.0, layers=layers)


def glyph(ratio: float) -> str:
    return next(g for bound, g, _ in HEAT_LEVELS if ratio < bound)


def test_moe_panel_at_deepseek_shape(golden: Callable[[str, str], None]) -> None:
    moe = deepseek_moe()
    assert len(moe.layers[0].expert_token_share) == EXPERTS  # 256 bins of one expert: the snapshot keeps all
    # the strip's room: the panel's inner width less the label (5) and stat columns (52 + 8 gaps)
    for width, strip_room in ((80, 80 - 4 - 65), (160, 160 - 4 - 65)):
        per_cell = math.ceil(EXPERTS / strip_room)  # 24 experts a cell at 80 columns, 3 at 160
        text = render(MoePanel(moe, height=12), width=width)
        lines = text.splitlines()
        assert len(lines) == 12 and all(len(line) <= width for line in lines)
        assert f"{per_cell}/cell" in lines[1]
        rows = {int(line.split()[1][1:]): line for line in lines[2:-2]}
        assert len(rows) == 12 - 4  # border 2 + header + legend
        # the most unhealthy layers take the rows first
        assert {*BAD_GINI_LAYERS, BAD_ENTROPY_LAYER} <= set(rows)
        assert f"+{LAYERS - len(rows)} hidden (0 out of band)" in lines[-2]
        # the hot expert's cell shows its own load (x51 uniform), not its cell's mean
        strip = rows[HOT_LAYER].split()[2]
        assert len(strip) == math.ceil(EXPERTS / per_cell)
        assert strip[HOT_EXPERT // per_cell] == glyph(HOT_SHARE * EXPERTS) == "█"
        assert f"E{HOT_EXPERT} " in rows[HOT_LAYER]
        assert strip.count("█") == 1
        golden(f"moe-deepseek-{width}", text)


def test_screen_at_deepseek_shape_with_eight_ranks() -> None:
    base = load_fixture("gpu_busy")
    snapshot = dataclasses.replace(base, moe=deepseek_moe(), ranks=eight_ranks())
    for width, height in ((80, 24), (80, 50), (160, 40)):
        text = render(Dashboard(snapshot, now_unix_s=base.taken_unix_s, height=height), width=width, height=height)
        lines = text.splitlines()
        assert len(lines) <= height and all(len(line) <= width for line in lines)
        assert "MoE routing · 58 layers · E=256" in text and "Ranks · 8 producers" in text
        shown = [int(m) for m in re.findall(r"^│ L(\d+) ", text, flags=re.MULTILINE)]
        bad = {*BAD_GINI_LAYERS, BAD_ENTROPY_LAYER}
        assert shown, text  # at least one layer row, even at 24 rows
        # the rows go to out-of-band layers first: all of them shown, or only out-of-band ones
        assert bad <= set(shown) or set(shown) <= bad
        assert f"+{LAYERS - len(shown)} hidden ({len(bad - set(shown))} out of band)" in text
