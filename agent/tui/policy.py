"""Policy panel: each rule's state (armed / pending / firing / cooling) with progress toward its
window, last value and threshold; the most recent actions with outcome and latency.

Narrow: rules above actions. Wide (`side_by_side`): rules left, actions right.
"""

from __future__ import annotations

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from moescope.agent.state import ActionRecord, Policy, RuleStatus
from moescope.agent.tui import fmt

BORDER_ROWS = 2
PROGRESS_WIDTH = 10
STATE_STYLES = {"armed": fmt.STYLE_OK, "pending": fmt.STYLE_WARN, "firing": fmt.STYLE_BAD, "cooling": "cyan"}
STATE_RANK = {"firing": 0, "pending": 1, "cooling": 2, "armed": 3}
OUTCOME_STYLES = {"ok": fmt.STYLE_OK, "failed": fmt.STYLE_BAD, "timeout": fmt.STYLE_BAD, "dry-run": fmt.STYLE_DIM}


def value_text(value: float | None, unit: str | None) -> str:
    """3 significant digits below 10, one decimal below 100, none above."""
    if fmt.missing(value):
        return fmt.NA
    assert value is not None
    if abs(value) >= 100:
        s = f"{value:.0f}"
    elif abs(value) >= 10:
        s = f"{value:.1f}"
    else:
        s = f"{value:.3g}"
    return f"{s} {unit}" if unit else s


def choose_rules(rules: list[RuleStatus], rows: int) -> list[RuleStatus]:
    """At most `rows` rules, active ones first, shown in configured order."""
    if len(rules) <= rows:
        return list(rules)
    order = {id(r): i for i, r in enumerate(rules)}
    ranked = sorted(rules, key=lambda r: (STATE_RANK.get(r.state, 9), order[id(r)]))
    return sorted(ranked[: max(0, rows)], key=lambda r: order[id(r)])


class PolicyPanel:
    def __init__(
        self,
        policy: Policy | None,
        *,
        taken_unix_s: float | None,
        height: int | None = None,
        side_by_side: bool = False,
    ) -> None:
        self.policy = policy if policy is not None else Policy()
        self.taken_unix_s = taken_unix_s
        self.height = height
        self.side_by_side = side_by_side

    def natural_rows(self) -> int:
        rules = 1 + len(self.policy.rules) if self.policy.rules else 1
        actions = 1 + len(self.policy.recent_actions) if self.policy.recent_actions else 1
        if self.side_by_side:
            return BORDER_ROWS + max(rules, actions)
        return BORDER_ROWS + rules + actions

    def min_rows(self) -> int:
        return min(BORDER_ROWS + (2 if self.side_by_side else 4), self.natural_rows())

    def _budgets(self) -> tuple[int | None, int | None]:
        """(rule rows, action rows) excluding their header lines; None = unlimited."""
        if self.height is None:
            return None, None
        content = max(0, self.height - BORDER_ROWS)
        if self.side_by_side:
            return max(1, content - 1), max(1, content - 1)
        n_rules = max(1, len(self.policy.rules))
        n_actions = max(1, len(self.policy.recent_actions))
        if 2 + n_rules + n_actions <= content:
            return n_rules, n_actions
        # Rules come first; actions keep at least one line (the newest).
        rule_rows = max(1, min(n_rules, content - 3))
        return rule_rows, max(1, content - 2 - rule_rows)

    def rules_table(self, rows: int | None) -> Table | Text:
        rules = self.policy.rules
        if not rules:
            return Text("rules: N/A — policy engine not running", style=fmt.STYLE_NA, no_wrap=True, overflow="ellipsis")
        shown = rules if rows is None else choose_rules(rules, rows)
        hidden = len(rules) - len(shown)
        title = "rules" + (f" +{hidden}" if hidden else "")
        table = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False, expand=True)
        table.add_column(title, no_wrap=True, overflow="ellipsis", header_style="bold", max_width=24)
        table.add_column("state", no_wrap=True, header_style="bold")
        table.add_column("window", no_wrap=True, header_style="bold")
        table.add_column("value", justify="right", no_wrap=True, header_style="bold")
        table.add_column("fire", no_wrap=True, header_style="bold")
        table.add_column("signal", no_wrap=True, overflow="ellipsis", header_style="bold", ratio=1)
        for rule in shown:
            style = STATE_STYLES.get(rule.state, "")
            progress = rule.progress
            pct = fmt.num(None if progress is None else progress * 100, ".0f", suffix="%").rjust(4)
            table.add_row(
                rule.name,
                Text(rule.state.upper() if rule.state == "firing" else rule.state, style=style),
                Text(fmt.bar(progress, PROGRESS_WIDTH) + " " + pct, style=style),
                value_text(rule.value, rule.unit),
                f"{rule.comparison} {value_text(rule.threshold, rule.unit)}" if rule.threshold is not None else fmt.NA,
                Text(rule.signal or "", style=fmt.STYLE_DIM),
            )
        return table

    def actions_table(self, rows: int | None) -> Table | Text:
        actions = self.policy.recent_actions
        if not actions:
            return Text("actions: none yet", style=fmt.STYLE_NA, no_wrap=True)
        # Newest first.
        shown: list[ActionRecord] = sorted(actions, key=lambda a: -a.at_unix_s)
        if rows is not None:
            shown = shown[:rows]
        hidden = len(actions) - len(shown)
        title = "actions" + (f" +{hidden}" if hidden else "")
        table = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False, expand=True)
        table.add_column(title, no_wrap=True, justify="right", header_style="bold")
        table.add_column("rule", no_wrap=True, overflow="ellipsis", header_style="bold", max_width=22)
        table.add_column("action", no_wrap=True, overflow="ellipsis", header_style="bold", max_width=28)
        table.add_column("outcome", no_wrap=True, header_style="bold")
        table.add_column("took", justify="right", no_wrap=True, header_style="bold")
        table.add_column("detail", no_wrap=True, overflow="ellipsis", header_style="bold", ratio=1)
        for a in shown:
            ago = None if self.taken_unix_s is None else self.taken_unix_s - a.at_unix_s
            table.add_row(
                f"{fmt.duration(ago)} ago",
                a.rule,
                a.action,
                Text(a.outcome, style=OUTCOME_STYLES.get(a.outcome, "")),
                fmt.num(a.latency_ms, ".0f", suffix=" ms"),
                Text(a.detail or "", style=fmt.STYLE_DIM),
            )
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        rule_rows, action_rows = self._budgets()
        rules = self.rules_table(rule_rows)
        actions = self.actions_table(action_rows)
        body: RenderableType
        if self.side_by_side:
            body = Table.grid(expand=True, padding=(0, 2))
            body.add_column(ratio=1, no_wrap=True)
            body.add_column(ratio=1, no_wrap=True)
            body.add_row(rules, actions)
        else:
            body = Group(rules, actions)
        states = [r.state for r in self.policy.rules]
        summary = " · ".join(f"{states.count(s)} {s}" for s in ("firing", "pending", "cooling") if states.count(s))
        title = "Policy" + (f" · {summary}" if summary else "")
        yield Panel(body, title=title, title_align="left", box=box.ROUNDED, padding=(0, 1), height=self.height)
