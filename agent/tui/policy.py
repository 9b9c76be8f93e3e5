"""Policy panel: each rule's state (armed / pending / firing / cooling) with progress toward its
window, last value and threshold; the most recent actions with outcome and latency.

Narrow: rules above actions. Wide (`side_by_side`): rules left, actions right. Where a row does not
fit, free text goes first (signal, detail), then rule names are cut before their target (the
`[layer,expert]` of a per-expert rule is what tells its rows apart), then whole columns; a number,
a state or an outcome is never cut (agent/tui/columns.py).
"""

from __future__ import annotations

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from moescope.agent.state import ActionRecord, Policy, RuleStatus
from moescope.agent.tui import fmt
from moescope.agent.tui.columns import Column, FittedTable, ellipsize, ellipsize_words

BORDER_ROWS = 2
PROGRESS_WIDTH = 10
STATE_STYLES = {"armed": fmt.STYLE_OK, "pending": fmt.STYLE_WARN, "firing": fmt.STYLE_BAD, "cooling": "cyan"}
STATE_RANK = {"firing": 0, "pending": 1, "cooling": 2, "armed": 3}
OUTCOME_STYLES = {
    "ok": fmt.STYLE_OK,
    "late": fmt.STYLE_WARN,  # done, but answered past the command timeout
    "failed": fmt.STYLE_BAD,
    "timeout": fmt.STYLE_BAD,
    "refused": fmt.STYLE_BAD,
    "unreachable": fmt.STYLE_BAD,
    "protocol-error": fmt.STYLE_BAD,
    "internal-error": fmt.STYLE_BAD,
    "rate-limited": fmt.STYLE_WARN,
    "conflict": fmt.STYLE_WARN,
    "dry-run": fmt.STYLE_DIM,
}
# The engine's decisions that sent nothing (agent/policy/audit.py DECISIONS), in a word that fits.
OUTCOME_WORDS = {"suppressed-by-rate-limit": "rate-limited", "suppressed-by-conflict": "conflict"}
# A rule name cut before its target keeps this many characters of the rule (`expert_que…[5,17]`):
# enough to tell expert_queue_*, expert_load_* and expert_offload apart.
RULE_NAME_MIN = 10
FREE_TEXT_MIN = 10  # signal, detail and action: narrower than this, the column goes


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


def cut_name(name: Text, width: int) -> Text:
    """A rule (instance) name cut to `width` before its target: `expert_queue_soft_limit[5,17]` →
    `expert_queue_so…[5,17]` (agent/policy/publish.py names an instance `rule[target]`)."""
    plain = name.plain
    if name.cell_len <= width:
        return name
    rule, bracket, _ = plain.partition("[")
    keep = width - (len(plain) - len(rule)) - 1
    if not bracket or keep < 1:
        return ellipsize(name, width)
    return Text(rule[:keep] + "…" + plain[len(rule):], style=name.style)


def name_floor(names: list[str]) -> int:
    """How narrow a column of rule names may be cut: every target whole after RULE_NAME_MIN characters."""
    widths = []
    for name in names:
        rule, bracket, _ = name.partition("[")
        widths.append(min(len(name), RULE_NAME_MIN + 1 + len(name) - len(rule)) if bracket else RULE_NAME_MIN + 1)
    return max(widths, default=RULE_NAME_MIN + 1)


def outcome_word(outcome: str) -> str:
    return OUTCOME_WORDS.get(outcome, outcome)


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

    def rules_table(self, rows: int | None) -> FittedTable | Text:
        rules = self.policy.rules
        if not rules:
            return Text("rules: N/A — policy engine not running", style=fmt.STYLE_NA, no_wrap=True, overflow="ellipsis")
        shown = rules if rows is None else choose_rules(rules, rows)
        hidden = len(rules) - len(shown)
        title = "rules" + (f" +{hidden}" if hidden else "")
        names = [rule.name for rule in shown]
        # Signal first (the rule's name mostly says it), then the name before its target, then the
        # progress bar, then the threshold; name, state and value stay.
        name = Column(title, rank=2, shrink_to=name_floor(names), cut=cut_name)
        state = Column("state")
        window = Column("window", rank=3, droppable=True)
        value = Column("value", justify="right")
        fire = Column("fire", rank=4, droppable=True)
        signal = Column("signal", rank=1, shrink_to=FREE_TEXT_MIN, droppable=True, cut=ellipsize_words, stretch=True)
        for rule in shown:
            style = STATE_STYLES.get(rule.state, "")
            progress = rule.progress
            pct = fmt.num(None if progress is None else progress * 100, ".0f", suffix="%").rjust(4)
            name.cells.append(Text(rule.name))
            state.cells.append(Text(rule.state.upper() if rule.state == "firing" else rule.state, style=style))
            window.cells.append(Text(fmt.bar(progress, PROGRESS_WIDTH) + " " + pct, style=style))
            value.cells.append(Text(value_text(rule.value, rule.unit)))
            fire.cells.append(Text(
                f"{rule.comparison} {value_text(rule.threshold, rule.unit)}" if rule.threshold is not None else fmt.NA
            ))
            signal.cells.append(Text(rule.signal or "", style=fmt.STYLE_DIM))
        return FittedTable([name, state, window, value, fire, signal], expand=False)

    def actions_table(self, rows: int | None) -> FittedTable | Text:
        actions = self.policy.recent_actions
        if not actions:
            return Text("actions: none yet", style=fmt.STYLE_NA, no_wrap=True)
        # Newest first.
        shown: list[ActionRecord] = sorted(actions, key=lambda a: -a.at_unix_s)
        if rows is not None:
            shown = shown[:rows]
        # the records not shown since the start, not only of the last few the snapshot carries (a
        # user trial read `actions +19` over 130 records)
        total = self.policy.actions_total if self.policy.actions_total is not None else len(actions)
        hidden = max(0, total - len(shown))
        title = "actions" + (f" +{fmt.count(hidden)}" if hidden else "")
        # Detail first, then the rule name before its target, then the action, then how long it took;
        # when, rule and outcome stay.
        when = Column(title, justify="right")
        rule = Column("rule", rank=2, shrink_to=name_floor([a.rule for a in shown]), cut=cut_name)
        action = Column("action", rank=3, shrink_to=FREE_TEXT_MIN, droppable=True, cut=ellipsize_words)
        outcome = Column("outcome")
        took = Column("took", justify="right", rank=4, droppable=True)
        detail = Column("detail", rank=1, shrink_to=FREE_TEXT_MIN, droppable=True, cut=ellipsize_words, stretch=True)
        for a in shown:
            ago = None if self.taken_unix_s is None else self.taken_unix_s - a.at_unix_s
            word = outcome_word(a.outcome)
            when.cells.append(Text(f"{fmt.duration(ago)} ago"))
            rule.cells.append(Text(a.rule))
            action.cells.append(Text(a.action))
            outcome.cells.append(Text(word, style=OUTCOME_STYLES.get(word, "")))
            took.cells.append(Text(fmt.latency(a.latency_ms)))
            detail.cells.append(Text(a.detail or "", style=fmt.STYLE_DIM))
        return FittedTable([when, rule, action, outcome, took, detail], expand=False)

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
        title = fmt.panel_title(
            [("", "Policy")]
            + [(" · ", f"{states.count(s)} {s}") for s in ("firing", "pending", "cooling") if states.count(s)],
            options.max_width,
        )
        yield Panel(body, title=title, title_align="left", box=box.ROUNDED, padding=(0, 1), height=self.height)
