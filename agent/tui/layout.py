"""The whole screen: panels stacked when narrow (< WIDE_MIN_COLUMNS), a grid when wide; rows are
shared out so the screen is filled but never overflows (panels cut their own content to fit and
say how much they hid). The "where the time goes" panel sits under the requests (full width when
wide), whole when the others keep their minimum rows, else as its summary line."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.table import Table

from moescope.agent.phase_table import Phases
from moescope.agent.state import Snapshot
from moescope.agent.tui.devices import DevicesPanel
from moescope.agent.tui.header import HEADER_ROWS, HeaderBar
from moescope.agent.tui.moe import MoePanel
from moescope.agent.tui.phases import PhasesPanel
from moescope.agent.tui.policy import PolicyPanel
from moescope.agent.tui.ranks import RanksPanel, shows_ranks
from moescope.agent.tui.requests import RequestsPanel

WIDE_MIN_COLUMNS = 120
# Policy rules and actions side by side only from here: each table needs ~90 columns.
POLICY_SIDE_BY_SIDE_MIN_COLUMNS = 190


def share_rows(total: int, mins: Sequence[int], naturals: Sequence[int]) -> list[int]:
    """Give each panel its minimum, then one row at a time, round robin, up to its natural height.

    The result may exceed `total` when even the minimums do not fit (the screen then crops).
    """
    heights = [min(m, n) for m, n in zip(mins, naturals, strict=True)]
    left = total - sum(heights)
    while left > 0:
        grew = False
        for i, natural in enumerate(naturals):
            if left > 0 and heights[i] < natural:
                heights[i] += 1
                left -= 1
                grew = True
        if not grew:
            break
    return heights


def snapshot_phases(snapshot: Snapshot | None) -> Phases | None:
    """The snapshot's "where the time goes" table; None when its agent publishes none (no panel)."""
    return None if snapshot is None else snapshot.phases  # None: its agent did not publish one


def snapshot_ranks(snapshot: Snapshot | None) -> RanksPanel | None:
    """The ranks panel when the snapshot has more than one producer, else None (no panel)."""
    if snapshot is None or not shows_ranks(snapshot.ranks):
        return None
    return RanksPanel(snapshot.ranks)


def phases_height(panel: PhasesPanel, flex: int, others_min: int) -> int:
    """The whole table when the other panels keep their minimum rows, else its summary line."""
    natural = panel.natural_rows()
    return natural if flex - natural >= others_min else panel.min_rows()


class Dashboard:
    """Renders one snapshot (or nothing yet) to the console's width and the given/terminal height."""

    def __init__(
        self,
        snapshot: Snapshot | None,
        *,
        now_unix_s: float,
        error: str | None = None,
        height: int | None = None,
        fit_height: bool = True,
    ) -> None:
        """`height`: rows to fill; None: the rows the console offers (the terminal's under Live),
        or, with `fit_height=False`, each panel's natural height (printing to a pipe)."""
        self.snapshot = snapshot
        self.now_unix_s = now_unix_s
        self.error = error
        self.height = height
        self.fit_height = fit_height

    def header(self) -> HeaderBar:
        s = self.snapshot
        return HeaderBar(
            None if s is None else s.header,
            None if s is None else s.self_cost,
            taken_unix_s=None if s is None else s.taken_unix_s,
            now_unix_s=self.now_unix_s,
            seq=None if s is None else s.seq,
            publish_interval_s=None if s is None else s.publish_interval_s,
            error=self.error,
        )

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        height = self.height
        if height is None and self.fit_height:
            # a parent (rich's Screen, Group) resets `height` for children but keeps `max_height`
            height = options.height if options.height is not None else options.max_height
        if options.max_width >= WIDE_MIN_COLUMNS:
            yield from self._wide(height, options.max_width)
        else:
            yield from self._narrow(height)

    def _narrow(self, height: int | None) -> list[RenderableType]:
        s = self.snapshot
        moe = MoePanel(None if s is None else s.moe)
        devices = DevicesPanel(None if s is None else s.devices)
        policy = PolicyPanel(None if s is None else s.policy, taken_unix_s=None if s is None else s.taken_unix_s)
        table = snapshot_phases(s)
        phases = None if table is None else PhasesPanel(table)
        ranks = snapshot_ranks(s)
        if height is not None:
            flex = height - HEADER_ROWS - RequestsPanel.natural_rows()
            if phases is not None:
                phases.height = phases_height(phases, flex, devices.min_rows() + moe.min_rows() + policy.min_rows()
                                              + (0 if ranks is None else ranks.min_rows()))
                flex -= phases.height
            # devices first: short, and it answers "is the GPU full"; ranks last: it gets what is left
            panels: list[DevicesPanel | MoePanel | PolicyPanel | RanksPanel] = [devices, moe, policy]
            if ranks is not None:
                panels.append(ranks)
            heights = share_rows(flex, [p.min_rows() for p in panels], [p.natural_rows() for p in panels])
            for panel, rows in zip(panels, heights, strict=True):
                panel.height = rows
        requests = RequestsPanel(None if s is None else s.requests, network=None if s is None else s.network)
        out: list[RenderableType] = [self.header(), requests]
        out += [p for p in (phases, ranks) if p is not None]
        return [*out, moe, devices, policy]

    def _wide(self, height: int | None, width: int) -> list[RenderableType]:
        s = self.snapshot
        moe = MoePanel(None if s is None else s.moe)
        devices = DevicesPanel(None if s is None else s.devices)
        policy = PolicyPanel(
            None if s is None else s.policy,
            taken_unix_s=None if s is None else s.taken_unix_s,
            side_by_side=width >= POLICY_SIDE_BY_SIDE_MIN_COLUMNS,
        )
        requests = RequestsPanel(None if s is None else s.requests, network=None if s is None else s.network)
        top_natural = max(RequestsPanel.natural_rows(), devices.natural_rows())
        top_min = max(RequestsPanel.natural_rows(), devices.min_rows())
        table = snapshot_phases(s)
        phases = None if table is None else PhasesPanel(table)
        ranks = snapshot_ranks(s)
        top_h: int | None = None
        if height is not None:
            flex = height - HEADER_ROWS
            ranks_min = 0 if ranks is None else ranks.min_rows()
            if phases is not None:
                phases.height = phases_height(phases, flex, top_min + moe.min_rows() + policy.min_rows() + ranks_min)
                flex -= phases.height
            mins = [top_min, moe.min_rows(), policy.min_rows()]
            naturals = [top_natural, moe.natural_rows(), policy.natural_rows()]
            if ranks is not None:
                mins.append(ranks_min)
                naturals.append(ranks.natural_rows())
            top_h, moe_h, pol_h, *ranks_h = share_rows(flex, mins, naturals)
            moe.height, policy.height = moe_h, pol_h
            if ranks is not None:
                ranks.height = ranks_h[0]
        else:
            top_h = top_natural
        requests.height = top_h
        devices.height = top_h
        top = Table.grid(expand=True, padding=(0, 0))
        top.add_column(ratio=2)
        top.add_column(ratio=3)
        top.add_row(requests, devices)
        out: list[RenderableType] = [self.header(), top]
        out += [p for p in (phases, ranks) if p is not None]
        return [*out, moe, policy]
