"""Devices panel: per GPU memory used/total, utilisation and NVLink TX/RX per link; without a GPU,
the host memory budget the agent uses instead, with its source."""

from __future__ import annotations

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.panel import Panel
from rich.text import Text

from moescope.agent.state import Devices, Gpu, HostBudget
from moescope.agent.tui import fmt

BORDER_ROWS = 2
NAME_WIDTH = 14
# Memory colours follow the policy defaults: memory_alert > 92 %, expert_offload > 95 %.
MEM_WARN = 0.92
MEM_BAD = 0.95


def _bar_width(inner_width: int) -> int:
    return 20 if inner_width >= 100 else 10


def _memory(t: Text, used: int | None, total: int | None, bar_width: int) -> None:
    frac = fmt.ratio(used, total)
    style = fmt.fraction_style(frac, warn=MEM_WARN, bad=MEM_BAD)
    t.append("mem ")
    t.append(fmt.bar(frac, bar_width), style=style)
    if total is not None and 0 < total < 2**30:  # a small pool read `0.0/0.0 GiB` (the transformers trial)
        t.append(f" {fmt.num(None if used is None else used / 2**20, '.1f').rjust(5)}/"
                 f"{fmt.num(total / 2**20, '.1f')} MiB ")
    else:
        t.append(f" {fmt.gib(used).rjust(5)}/{fmt.gib(total)} GiB ")
    t.append(fmt.num(None if frac is None else frac * 100, ".0f", suffix="%").rjust(4), style=style)


def gpu_line(gpu: Gpu, inner_width: int) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append(f"GPU{gpu.index} ", style="bold")
    t.append((gpu.name or fmt.NA)[:NAME_WIDTH].ljust(NAME_WIDTH))
    t.append(" ")
    _memory(t, gpu.memory_used_bytes, gpu.memory_total_bytes, _bar_width(inner_width))
    t.append("  util ")
    t.append(fmt.num(gpu.utilization_pct, ".0f", suffix="%").rjust(4))
    return t


def nvlink_line(gpu: Gpu) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append("  NVLink GB/s tx/rx ", style=fmt.STYLE_DIM)
    txs = [lk.tx_bytes_per_s for lk in gpu.nvlinks if lk.tx_bytes_per_s is not None]
    rxs = [lk.rx_bytes_per_s for lk in gpu.nvlinks if lk.rx_bytes_per_s is not None]
    t.append(f"Σ {fmt.gbps(sum(txs) if txs else None)}/{fmt.gbps(sum(rxs) if rxs else None)}", style="bold")
    for lk in gpu.nvlinks:
        t.append(f"  L{lk.link} {fmt.gbps(lk.tx_bytes_per_s)}/{fmt.gbps(lk.rx_bytes_per_s)}")
    return t


def host_line(budget: HostBudget, inner_width: int) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append("host ", style="bold")
    _memory(t, budget.used_bytes, budget.total_bytes, _bar_width(inner_width))
    t.append(f"  source {budget.source}", style=fmt.STYLE_DIM)
    return t


class DevicesPanel:
    def __init__(self, devices: Devices | None, *, height: int | None = None) -> None:
        self.devices = devices if devices is not None else Devices()
        self.height = height

    def _entries(self) -> list[tuple[str, Gpu | HostBudget | None]]:
        """Lines in display order: ("gpu", g), ("nvlink", g), ("host", b) or ("none", None)."""
        entries: list[tuple[str, Gpu | HostBudget | None]] = []
        for gpu in self.devices.gpus:
            entries.append(("gpu", gpu))
            if gpu.nvlinks:
                entries.append(("nvlink", gpu))
        if self.devices.host_budget is not None:
            entries.append(("host", self.devices.host_budget))
        if not entries:
            entries.append(("none", None))
        return entries

    def natural_rows(self) -> int:
        return BORDER_ROWS + len(self._entries())

    def min_rows(self) -> int:
        return min(BORDER_ROWS + 1, self.natural_rows())

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        inner_width = max(1, options.max_width - 4)
        entries = self._entries()
        if self.height is not None:
            # Too short: NVLink detail lines go first (last GPU's first), then whole devices.
            room = max(1, self.height - BORDER_ROWS)
            while len(entries) > room and any(kind == "nvlink" for kind, _ in entries):
                last = max(i for i, (kind, _) in enumerate(entries) if kind == "nvlink")
                del entries[last]
            entries = entries[:room]
        lines: list[Text] = []
        for kind, item in entries:
            if kind == "gpu" and isinstance(item, Gpu):
                lines.append(gpu_line(item, inner_width))
            elif kind == "nvlink" and isinstance(item, Gpu):
                lines.append(nvlink_line(item))
            elif kind == "host" and isinstance(item, HostBudget):
                lines.append(host_line(item, inner_width))
            else:
                lines.append(Text("N/A — no GPU (NVML) or host memory data", style=fmt.STYLE_NA))
        body = Text("\n").join(lines)
        body.no_wrap = True
        body.overflow = "ellipsis"
        n = len(self.devices.gpus)
        if n:
            title = f"Devices · {n} GPU" + ("s" if n != 1 else "")
        elif self.devices.host_budget is not None:
            title = "Devices · no GPU: host memory budget"
        else:
            title = "Devices"
        yield Panel(body, title=title, title_align="left", box=box.ROUNDED, padding=(0, 1), height=self.height)
