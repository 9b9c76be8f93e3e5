"""MoE panel: one row per layer — expert-load heat map, router entropy (bits and H/log2 E) and
expert-load Gini against their healthy bands, capacity drops, precision, residency.

The heat map gets whatever width is left after the fixed columns. When there are more experts
than cells, each cell covers a run of experts and shows the hottest of them; where the snapshot
itself carries bins of experts, the experts it names as hottest are shown at their own load, so a
hot expert is not averaged away. Glyphs give load relative to uniform (1/E): · <¼  ░ <¾  ▒ <1½  ▓ <3  █ ≥3.
"""

from __future__ import annotations

import math

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.panel import Panel
from rich.text import Text

from moescope.agent.state import Moe, MoeLayer
from moescope.agent.tui import fmt

# (upper bound of load ratio, glyph, style); the last bound is infinite.
HEAT_LEVELS: tuple[tuple[float, str, str], ...] = (
    (0.25, "·", "dim"),
    (0.75, "░", "blue"),
    (1.5, "▒", "green"),
    (3.0, "▓", "yellow"),
    (math.inf, "█", "bold red"),
)
MIN_HEAT_CELLS = 4
# name, width; the layer label and heat map come first and are sized at render time.
STAT_COLUMNS: tuple[tuple[str, int], ...] = (
    ("hottest", 11),
    ("H bits", 6),
    ("H/log2E", 7),
    ("Gini", 6),
    ("drops", 6),
    ("prec", 7),
    ("res d/h", 9),
)
BORDER_ROWS = 2
EXTRA_ROWS = 2  # column header + legend line
MIN_ROWS = BORDER_ROWS + EXTRA_ROWS + 1


def heat_cells(layer: MoeLayer, cells: int) -> list[float]:
    """Load ratio (share / uniform share) per cell, at most `cells` cells, hottest run wins."""
    shares = layer.expert_token_share
    if not shares or layer.num_experts < 1:
        return []
    per_bin = max(1, layer.experts_per_bin)
    ratios: list[float] = []
    for i, share in enumerate(shares):
        experts_in_bin = max(1, min(per_bin, layer.num_experts - i * per_bin))
        ratios.append(share * layer.num_experts / experts_in_bin)
    # A bin's mean hides its hottest expert; the snapshot names the hottest, so show them.
    for hot in layer.hot_experts:
        b = hot.expert // per_bin
        if 0 <= b < len(ratios):
            ratios[b] = max(ratios[b], hot.share * layer.num_experts)
    if len(ratios) <= cells:
        return ratios
    group = math.ceil(len(ratios) / cells)
    return [_max_known(ratios[i : i + group]) for i in range(0, len(ratios), group)]


def _max_known(values: list[float]) -> float:
    known = [v for v in values if not math.isnan(v)]
    return max(known) if known else math.nan


def experts_per_cell(layer: MoeLayer, cells: int) -> int:
    nbins = len(layer.expert_token_share)
    per_bin = max(1, layer.experts_per_bin)
    if nbins <= cells:
        return per_bin
    return per_bin * math.ceil(nbins / cells)


def heat_text(ratios: list[float], width: int) -> Text:
    t = Text(no_wrap=True, overflow="crop")
    if not ratios:
        t.append(fmt.NA.ljust(width)[:width], style=fmt.STYLE_NA)
        return t
    for r in ratios:
        if math.isnan(r):
            t.append("?", style=fmt.STYLE_NA)
            continue
        for bound, glyph, style in HEAT_LEVELS:
            if r < bound:
                t.append(glyph, style=style)
                break
    t.append(" " * (width - len(ratios)))
    return t


def layer_severity(layer: MoeLayer) -> int:
    return max(
        fmt.severity(fmt.judge_entropy_norm(layer.entropy_norm)),
        fmt.severity(fmt.judge_gini(layer.gini)),
    )


def choose_layers(layers: list[MoeLayer], rows: int) -> list[MoeLayer]:
    """At most `rows` layers, most unhealthy first, shown in layer order."""
    if len(layers) <= rows:
        return list(layers)
    ranked = sorted(layers, key=lambda lay: (-layer_severity(lay), lay.layer))
    return sorted(ranked[: max(0, rows)], key=lambda lay: lay.layer)


def hottest_text(layer: MoeLayer) -> str:
    """The hottest expert and its load relative to uniform, e.g. `E17 9.1×`."""
    if not layer.hot_experts:
        return fmt.NA
    hot = layer.hot_experts[0]
    return f"E{hot.expert} {hot.share * layer.num_experts:.1f}×"


def precision_text(layer: MoeLayer) -> str:
    if layer.precision is None:
        return fmt.NA
    differing = len(layer.expert_precision)
    return f"{layer.precision}+{differing}" if differing else layer.precision


def residency_text(layer: MoeLayer) -> str:
    if layer.resident_device is None and layer.resident_host is None:
        return fmt.NA
    dev = fmt.NA if layer.resident_device is None else str(layer.resident_device)
    host = fmt.NA if layer.resident_host is None else str(layer.resident_host)
    return f"{dev}/{host}"


class MoePanel:
    def __init__(self, moe: Moe | None, *, height: int | None = None) -> None:
        self.moe = moe if moe is not None else Moe()
        self.height = height

    def natural_rows(self) -> int:
        if not self.moe.layers:
            return BORDER_ROWS + 1
        return BORDER_ROWS + EXTRA_ROWS + len(self.moe.layers)

    def min_rows(self) -> int:
        return min(MIN_ROWS, self.natural_rows())

    def _title(self, width: int) -> Text:
        layers = self.moe.layers
        parts: list[tuple[str, str | Text]] = [("", "MoE routing"), (" · ", f"{len(layers)} layers")]
        experts = sorted({lay.num_experts for lay in layers})
        if experts:
            parts.append((" · ", "E=" + "/".join(str(e) for e in experts)))
        if self.moe.window_s is not None:
            parts.append((" · ", f"{fmt.num(self.moe.window_s, 'g')} s window"))
        tokens = [lay.tokens_total for lay in layers if lay.tokens_total is not None]
        if tokens:
            # a layer's routed tokens (each token counted once per expert it went to), averaged over
            # the layers: their sum counted every token layers x top-k times and read as tokens
            parts.append((" · ", f"{fmt.count(sum(tokens) / len(tokens))} routed a layer"))
        return fmt.panel_title(parts, width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        inner_width = max(1, options.max_width - 4)
        layers = self.moe.layers
        lines: list[Text] = []
        if not layers:
            lines.append(
                Text("N/A — no MoE data yet (is the runtime started with NVTX injection?)", style=fmt.STYLE_NA)
            )
        else:
            label_width = max(5, max(len(f"L{lay.layer}") for lay in layers))
            fixed = label_width + sum(w for _, w in STAT_COLUMNS) + len(STAT_COLUMNS) + 1
            # No wider than the widest layer needs, so the numbers stay next to the map.
            most_bins = max(len(lay.expert_token_share) for lay in layers)
            heat_width = max(MIN_HEAT_CELLS, min(inner_width - fixed, max(most_bins, len("expert load"))))
            # Grouping leaves whole groups: 64 experts in 31 cells is 22 cells of 3; drop the slack.
            cells_used = max(len(heat_cells(lay, heat_width)) for lay in layers)
            heat_width = max(cells_used, min(heat_width, len("expert load")), MIN_HEAT_CELLS)
            budget = None if self.height is None else self.height - BORDER_ROWS - EXTRA_ROWS
            shown = layers if budget is None else choose_layers(layers, max(1, budget))
            lines.append(self._column_header(layers, label_width, heat_width))
            for lay in shown:
                lines.append(self._row(lay, label_width, heat_width))
            lines.append(self._legend(layers, shown, inner_width))
        for line in lines:
            line.no_wrap = True
            line.overflow = "ellipsis"
        body = Text("\n").join(lines)
        body.no_wrap = True
        body.overflow = "ellipsis"
        yield Panel(
            body,
            title=self._title(options.max_width),
            title_align="left",
            box=box.ROUNDED,
            padding=(0, 1),
            height=self.height,
        )

    def _column_header(self, layers: list[MoeLayer], label_width: int, heat_width: int) -> Text:
        per_cell = max(experts_per_cell(lay, heat_width) for lay in layers)
        heat_title = "expert load"
        if per_cell > 1:
            heat_title = f"load {per_cell}/cell"
            if len(heat_title) > heat_width:
                heat_title = f"{per_cell}/cell"
        t = Text(style="bold")
        t.append("layer".ljust(label_width))
        t.append(" ")
        t.append(heat_title[:heat_width].ljust(heat_width))
        for name, width in STAT_COLUMNS:
            t.append(" ")
            t.append(name.rjust(width))
        return t

    def _row(self, lay: MoeLayer, label_width: int, heat_width: int) -> Text:
        t = Text()
        t.append(f"L{lay.layer}".ljust(label_width), style="bold")
        t.append(" ")
        t.append_text(heat_text(heat_cells(lay, heat_width), heat_width))
        t.append(" ")
        t.append(hottest_text(lay).rjust(11)[:11])
        t.append(" ")
        t.append(fmt.num(lay.entropy_bits, ".2f").rjust(6))
        t.append(" ")
        norm = lay.entropy_norm
        j = fmt.judge_entropy_norm(norm)
        t.append((fmt.num(norm, ".3f") + j.marker).rjust(7), style=j.style)
        t.append(" ")
        j = fmt.judge_gini(lay.gini)
        t.append((fmt.num(lay.gini, ".3f") + j.marker).rjust(6), style=j.style)
        t.append(" ")
        drops = lay.capacity_drops
        t.append(fmt.count(drops).rjust(6), style=fmt.STYLE_WARN if drops else "")
        t.append(" ")
        prec = precision_text(lay)
        t.append(prec.rjust(7)[:7], style=fmt.STYLE_WARN if lay.expert_precision else "")
        t.append(" ")
        t.append(residency_text(lay).rjust(9)[:9])
        return t

    def _legend(self, layers: list[MoeLayer], shown: list[MoeLayer], width: int) -> Text:
        """The hidden layers, the healthy bands and the heat scale, in `width` cells: parts that do
        not fit are left out whole (cut, the Gini band read `Gini 0.…` at 80 columns)."""
        shown_ids = {id(lay) for lay in shown}
        hidden = [lay for lay in layers if id(lay) not in shown_ids]
        parts: list[tuple[str, str | Text]] = []
        if hidden:
            out_of_band = sum(1 for lay in hidden if layer_severity(lay))
            parts.append(("", Text(f"+{len(hidden)} hidden ({out_of_band} out of band)",
                                   style=fmt.STYLE_WARN if out_of_band else fmt.STYLE_DIM)))
        lo, hi = fmt.ENTROPY_NORM_HEALTHY
        band = f"band H/log2E {lo:.3f}–{hi:.3f}"
        experts = {lay.num_experts for lay in layers}
        if len(experts) == 1:
            (e,) = experts
            if e >= 2:
                band += f" ({lo * math.log2(e):.2f}–{hi * math.log2(e):.2f} b)"
        glo, ghi = fmt.GINI_HEALTHY
        parts += [(" · " if parts else "", band), (", ", f"Gini {glo:.2f}–{ghi:.2f}"),
                  (" · ", "load ×uniform ·<¼ ░<¾ ▒<1½ ▓<3 █≥3")]
        t = fmt.fit_parts(parts, width)
        t.stylize(fmt.STYLE_DIM)
        return t
