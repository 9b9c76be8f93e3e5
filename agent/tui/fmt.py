"""Formatting shared by the panels: N/A for missing values, units, healthy bands, bars."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rich.cells import cell_len
from rich.text import Text

NA = "N/A"
# A panel's title and subtitle sit in its top and bottom border between `╭─ ` and ` ─╮`.
PANEL_TITLE_MARGIN = 6

# Healthy bands for display (DESIGN.md): router entropy 8.2–8.7 bits at E=16384, scaled by log2 E,
# i.e. normalised entropy H / log2(E) in [8.2/14, 8.7/14]; expert-load Gini 0.08–0.12.
ENTROPY_NORM_HEALTHY = (8.2 / 14.0, 8.7 / 14.0)
ENTROPY_NORM_COLLAPSE = 7.5 / 14.0  # router_collapse rule default
GINI_HEALTHY = (0.08, 0.12)
GINI_MONOPOLY = 0.15  # expert_monopoly rule default

STYLE_OK = "green"
STYLE_WARN = "yellow"
STYLE_BAD = "bold red"
STYLE_DIM = "dim"
STYLE_NA = "dim"


def missing(value: float | int | None) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def num(value: float | int | None, spec: str = ".1f", *, suffix: str = "") -> str:
    """`value` formatted with `spec`, or N/A when None/NaN."""
    if missing(value):
        return NA
    assert value is not None
    if isinstance(value, float) and math.isinf(value):
        return ("-" if value < 0 else "") + "inf" + suffix
    return f"{value:{spec}}{suffix}"


def count(value: float | int | None) -> str:
    """Compact count: 950, 12.3k, 4.5M."""
    if missing(value):
        return NA
    assert value is not None
    v = float(value)
    for limit, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= limit:
            return f"{v / limit:.1f}{unit}"
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.1f}"


def _three_digits(value: float) -> str | None:
    """`value` to 3 significant digits, trailing zeros kept so the width holds still between frames
    (0.80, 48.0, 212); None from 999.5 up, where it needs a bigger unit."""
    for decimals in (2, 1, 0):
        text = f"{value:.{decimals}f}"
        if abs(float(text)) < 10.0 ** (3 - decimals):
            return text
    return None


def latency(value_ms: float | None) -> str:
    """A latency with its unit, at most 7 cells below 10^5 s: 0.80 ms, 48.0 ms, 212 ms, 8.86 s,
    1234 s. From a second on in seconds: in ms, `8858.2` was cut to `885…` by a column sized for
    `212.5`, which reads as another number."""
    if missing(value_ms):
        return NA
    assert value_ms is not None
    if math.isinf(value_ms):
        return num(value_ms, suffix=" ms")
    for scale, unit in ((1.0, "ms"), (1e3, "s")):
        text = _three_digits(value_ms / scale)
        if text is not None:
            return f"{text} {unit}"
    return f"{value_ms / 1e3:.0f} s"


def join_parts(parts: Sequence[tuple[str, str | Text]]) -> Text:
    """The parts, each after its separator, as one text."""
    out = Text()
    for sep, part in parts:
        out.append(sep)
        out.append_text(Text(part) if isinstance(part, str) else part)
    return out


def fit_parts(parts: Sequence[tuple[str, str | Text]], width: int, *, more_sep: str | None = None) -> Text:
    """The leading parts that fit in `width` cells; trailing parts are dropped whole, never cut: a
    title cut mid-phrase reads as something else (`… · overflow` without its rate reads as an
    alarm). The first part is kept whatever its width (the border crops it). With `more_sep`, parts
    left out are counted at the end (`<more_sep>+N more`, dim), fewer parts kept to make it fit."""
    kept = 1
    while kept < len(parts) and cell_len(join_parts(parts[: kept + 1]).plain) <= width:
        kept += 1
    if more_sep is None or kept == len(parts):
        return join_parts(parts[:kept])

    def marker(n: int) -> Text:
        return Text(f"+{n} more", style=STYLE_DIM)

    while kept > 1 and cell_len(join_parts([*parts[:kept], (more_sep, marker(len(parts) - kept))]).plain) > width:
        kept -= 1
    return join_parts([*parts[:kept], (more_sep, marker(len(parts) - kept))])


def panel_title(parts: Sequence[tuple[str, str | Text]], panel_width: int) -> Text:
    """`fit_parts` for the title (or subtitle) of a panel `panel_width` cells wide."""
    return fit_parts(parts, panel_width - PANEL_TITLE_MARGIN)


def gib(value_bytes: float | int | None) -> str:
    return num(None if value_bytes is None else value_bytes / 2**30, ".1f")  # num(): NaN stays N/A


def mib(value_bytes: float | int | None) -> str:
    return num(None if value_bytes is None else value_bytes / 2**20, ".1f", suffix=" MiB")


def gbps(value_bytes_per_s: float | None) -> str:
    return num(None if value_bytes_per_s is None else value_bytes_per_s / 1e9, ".1f")


def duration(seconds: float | None) -> str:
    """3d04h / 1h02m03s / 4m05s / 12s."""
    if missing(seconds):
        return NA
    assert seconds is not None
    s = max(0, int(seconds))
    if s >= 2 * 86400:
        d, rem = divmod(s, 86400)
        return f"{d}d{rem // 3600:02d}h"
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m{sec:02d}s"
    if m:
        return f"{m}m{sec:02d}s"
    return f"{sec}s"


def ratio(used: float | int | None, total: float | int | None) -> float | None:
    if used is None or total is None or missing(used) or missing(total) or not total:
        return None
    return float(used) / float(total)


def bar(fraction: float | None, width: int) -> str:
    """A fixed-width bar ████░░░░ for 0..1; N/A padded when missing."""
    if width <= 0:
        return ""
    if fraction is None or math.isnan(fraction):
        return NA.center(width)[:width]
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "█" * filled + "░" * (width - filled)


@dataclass(frozen=True, slots=True)
class Judgement:
    """A value judged against a healthy band: a text marker (readable without colour) and a style."""

    marker: str
    style: str


NO_JUDGEMENT = Judgement(" ", STYLE_NA)


def judge_entropy_norm(value: float | None) -> Judgement:
    if missing(value):
        return NO_JUDGEMENT
    assert value is not None
    lo, hi = ENTROPY_NORM_HEALTHY
    if value < ENTROPY_NORM_COLLAPSE:
        return Judgement("!", STYLE_BAD)
    if value < lo:
        return Judgement("↓", STYLE_WARN)
    if value > hi:
        return Judgement("↑", STYLE_WARN)
    return Judgement("✓", STYLE_OK)


def judge_gini(value: float | None) -> Judgement:
    if missing(value):
        return NO_JUDGEMENT
    assert value is not None
    lo, hi = GINI_HEALTHY
    if value > GINI_MONOPOLY:
        return Judgement("!", STYLE_BAD)
    if value > hi:
        return Judgement("↑", STYLE_WARN)
    if value < lo:
        return Judgement("↓", STYLE_WARN)
    return Judgement("✓", STYLE_OK)


def severity(j: Judgement) -> int:
    """0 healthy or unknown, 1 out of band, 2 past a rule's fire threshold."""
    return {"!": 2, "↓": 1, "↑": 1}.get(j.marker, 0)


def fraction_style(fraction: float | None, *, warn: float = 0.9, bad: float = 0.95) -> str:
    if fraction is None or math.isnan(fraction):
        return STYLE_NA
    if fraction >= bad:
        return STYLE_BAD
    if fraction >= warn:
        return STYLE_WARN
    return STYLE_OK
