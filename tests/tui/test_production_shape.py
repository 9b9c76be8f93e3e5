"""The screen a user trial saw at production shape (58 layers x 256 experts, requests taking
seconds on CPU, one per-expert rule firing on eight experts): no number is cut (`8858.2` once
showed as `885…`, `955 ms` as `955 …`), no key word (`act…`, `suppressed-by-rate-l…`), a title
drops whole parts rather than ending on `· overflow`, and a per-expert rule's rows keep the
target that tells them apart. Renders at 80 to 240 columns."""

from __future__ import annotations

import dataclasses
import re

import pytest

from moescope.agent.state import ActionRecord, Network, Policy, Requests, RuleStatus, Snapshot
from moescope.agent.tui.layout import Dashboard
from moescope.agent.tui.policy import PolicyPanel
from moescope.agent.tui.requests import RequestsPanel

from .conftest import load_fixture, render
from .test_moe_scale_panel import deepseek_moe

# a digit, then `…` (`955 …`, `955 ms` cut at its unit, is looked for by name: free text cut after a
# whole word ends on ` …`)
CUT_NUMBER = re.compile(r"\d…")
TARGETS = [(3, 17), (3, 201), (12, 5), (17, 255), (30, 88), (41, 130), (55, 7), (57, 190)]
RULE = "expert_queue_soft_limit"
SIZES = [(80, 24), (100, 30), (119, 40), (120, 40), (160, 40), (200, 30), (240, 60)]


def production() -> Snapshot:
    """As agent/policy/publish.py and the kernel request window publish them."""
    base = load_fixture("gpu_busy")
    t0 = base.taken_unix_s
    rules = [
        RuleStatus(name=f"{RULE}[{layer},{expert}]", state="firing", progress=1.0, signal="expert_queue_tokens",
                   value=0.0, threshold=25.0, unit="tokens", comparison="<")
        for layer, expert in TARGETS
    ]
    outcomes = [("ok", 955.4), ("suppressed-by-rate-limit", None), ("failed", 12_034.0),
                ("suppressed-by-conflict", None)]
    actions = [
        ActionRecord(at_unix_s=t0 - 5 - 40 * i, rule=rules[i].name, action="fire router_penalty", outcome=outcome,
                     latency_ms=latency, detail=f"set_router_penalty L{TARGETS[i][0]} E{TARGETS[i][1]} 0.3")
        for i, (outcome, latency) in enumerate(outcomes)
    ]
    return dataclasses.replace(
        base,
        requests=Requests(window_s=10.0, rate_per_s=0.4, latency_p50_ms=8858.2, latency_p95_ms=8858.2,
                          latency_p99_ms=8858.2, errors_total=0, errors_per_s=0.0),
        network=Network(window_s=10.0, listen_overflows_per_s=0.0, retransmits_per_s=0.0, resets_per_s=0.0),
        moe=deepseek_moe(),
        policy=Policy(rules=rules, recent_actions=actions),
    )


def screen(width: int, height: int) -> str:
    s = production()
    return render(Dashboard(s, now_unix_s=s.taken_unix_s, height=height), width=width, height=height)


def box_lines(text: str, title: str) -> list[str]:
    """The lines of the panel whose title starts with `title`, borders included, cut out of the
    screen (it may sit beside another panel)."""
    lines = text.splitlines()
    top = next(i for i, line in enumerate(lines) if f"╭─ {title}" in line)
    left = lines[top].index(f"╭─ {title}")
    right = lines[top].index("╮", left) + 1
    out = []
    for line in lines[top:]:
        out.append(line[left:right])
        if line[left] == "╰":
            break
    return out


def test_seconds_long_latencies_whole_at_120_columns() -> None:
    panel = box_lines(screen(120, 40), "Requests")
    assert len(panel[0]) < 60  # beside the devices: the narrow case
    assert panel[1].strip("│ ").split() == ["req/s", "p50", "p95", "p99", "errors", "err/s"]
    assert panel[2].count("8.86 s") == 3
    assert not CUT_NUMBER.search("\n".join(panel)), "\n".join(panel)


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_no_number_cut_in_requests_or_policy(width: int, height: int) -> None:
    text = screen(width, height)
    for title in ("Requests", "Policy"):
        panel = "\n".join(box_lines(text, title))
        assert not CUT_NUMBER.search(panel), panel
    assert "8.86 s" in text


@pytest.mark.parametrize("width", range(30, 111, 4))
def test_requests_panel_drops_columns_never_digits(width: int) -> None:
    r = Requests(window_s=10.0, rate_per_s=12_345.6, latency_p50_ms=0.8, latency_p95_ms=48.0, latency_p99_ms=8858.2,
                 errors_total=123_456, errors_per_s=1_234.5)
    lines = render(RequestsPanel(r), width=width).splitlines()
    header, values = lines[1].strip("│ ").split(), lines[2].strip("│ ")
    assert not CUT_NUMBER.search(values), values
    # rate, p50 and p99 stay whatever the width; the others go whole, with their values
    assert header[:2] == ["req/s", "p50"] and "p99" in header
    assert "12345.6" in values and "0.80 ms" in values and "8.86 s" in values
    assert ("p95" in header) == ("48.0 ms" in values) and ("errors" in header) == ("123.5k" in values)


@pytest.mark.parametrize("width", range(30, 161, 2))
def test_requests_title_drops_whole_parts(width: int) -> None:
    network = Network(window_s=10.0, listen_overflows_per_s=0.0, retransmits_per_s=0.0, resets_per_s=0.0)
    lines = render(RequestsPanel(Requests(window_s=10.0), network=network), width=width).splitlines()
    title = lines[0].strip("╭─╮ ")
    bottom = lines[-1].strip("╰─╯ ")
    parts = ["Requests · kernel", " · 10 s window"]
    net = ["overflow 0.0/s", " retrans 0.0/s", " reset 0.0/s"]
    heads = ["".join(parts[:i]) for i in (1, 2)]
    nets = ["".join(net[:i]) for i in range(0, 4)]
    # the network rates sit in the title only whole; else in the bottom border, trailing parts dropped whole
    assert title in heads or title == heads[1] + " · " + nets[3], title
    assert bottom in nets, bottom
    if title.endswith(nets[3]):
        assert bottom == ""
    if width >= 50:  # the 120-column layout's panel (48) and up: every rate is on screen somewhere
        assert nets[3] in (title + "|" + bottom)
    assert "overflow" not in title or title.endswith("reset 0.0/s")


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_per_expert_rule_rows_keep_their_target(width: int, height: int) -> None:
    panel = box_lines(screen(width, height), "Policy")
    rule_rows = [line for line in panel if "FIRING" in line]
    assert rule_rows
    # each row ends its name on the whole target, however much of the rule's name it keeps
    targets = {(int(a), int(b)) for a, b in re.findall(r"\[(\d+),(\d+)\]\s+FIRING", "\n".join(rule_rows))}
    assert len(targets) == len(rule_rows) and targets <= set(TARGETS), "\n".join(panel)


def test_all_eight_targets_at_120_columns() -> None:
    panel = "\n".join(box_lines(screen(120, 40), "Policy"))
    for layer, expert in TARGETS:
        assert f"{RULE}[{layer},{expert}]" in panel, panel  # room enough: the whole name


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_actions_keep_headers_outcomes_and_latencies_whole(width: int, height: int) -> None:
    panel = "\n".join(box_lines(screen(width, height), "Policy"))
    assert re.search(r" actions( \+\d+)?  +rule ", panel), panel
    assert "955 ms" in panel  # the newest action always has a row
    assert "suppressed-by" not in panel
    if "45s ago" in panel:  # the second newest: rate limited, in a word that fits
        assert re.search(r"45s ago .* rate-limited ", panel), panel


def test_policy_side_by_side_names_whole() -> None:
    s = production()
    text = render(PolicyPanel(s.policy, taken_unix_s=s.taken_unix_s, side_by_side=True), width=196)
    for layer, expert in TARGETS:
        assert f"{RULE}[{layer},{expert}]" in text, text


@pytest.mark.parametrize("width", [80, 100, 120])
def test_every_action_row_whole_in_a_stacked_policy_panel(width: int) -> None:
    """All four actions (the trial's 80 columns read `actio…`, `12034…`, `suppressed-by-rate-l…`)."""
    s = production()
    text = render(PolicyPanel(s.policy, taken_unix_s=s.taken_unix_s), width=width)
    assert re.search(r"│ +actions  +rule ", text), text
    assert not CUT_NUMBER.search(text), text
    rows = [line for line in text.splitlines() if " ago " in line]
    assert len(rows) == 4
    for row, (outcome, took), (layer, expert) in zip(
        rows, [("ok", "955 ms"), ("rate-limited", "N/A"), ("failed", "12.0 s"), ("conflict", "N/A")], TARGETS,
        strict=False,
    ):
        assert re.search(rf"\[{layer},{expert}\] .* {outcome} +{took} ", row + " "), row


def test_the_actions_title_counts_every_record_not_only_the_snapshot_s() -> None:
    """The snapshot carries the last 20 actions: a trial read `actions +19` over 130 records."""
    s = production()
    policy = dataclasses.replace(s.policy, actions_total=130)
    text = render(PolicyPanel(policy, taken_unix_s=s.taken_unix_s), width=120)
    assert re.search(r"│ +actions \+126  +rule ", text), text  # 4 rows shown of 130
    old = dataclasses.replace(s.policy, actions_total=None)  # a snapshot from before the field
    text = render(PolicyPanel(old, taken_unix_s=s.taken_unix_s), width=120)
    assert re.search(r"│ +actions  +rule ", text), text
