"""benchmarks/common.py median_ratio_interval and e2e_overhead.resolved: how a benchmark says whether
its rounds can read a ratio against its bar (met / missed / unresolved), on arms built to each case."""

from __future__ import annotations

import math
import statistics

import pytest

from benchmarks.common import median_ratio_interval
from benchmarks.e2e_overhead import resolved

OFF = [49.6, 51.0, 49.2, 49.4, 49.0, 50.1, 48.8]  # ms of CPU a request, one value a round: +-2 %
QUIET = [50.0, 50.05, 49.98, 50.02, 49.96, 50.01, 50.03]  # a machine swinging +-0.1 %


def test_the_interval_holds_the_median_ratio_and_is_the_same_for_the_same_seed() -> None:
    on = [v * 1.004 + d for v, d in zip(OFF, (0.3, -0.8, 1.1, 0.2, -0.4, 0.6, -0.1), strict=True)]
    low, high = median_ratio_interval(OFF, on)
    point = statistics.median(on) / statistics.median(OFF)
    assert low <= point <= high
    assert low < high
    assert (low, high) == median_ratio_interval(OFF, on)


def test_a_cost_well_inside_the_bar_reads_met_and_one_well_past_it_reads_missed() -> None:
    inside = median_ratio_interval(QUIET, [v * 1.002 for v in QUIET])
    assert inside[1] <= 1.01
    assert resolved(inside, 1.01, upper_is_worse=True) == "met"
    # the same 0.2 % on rounds swinging +-2 %: each arm resampled on its own, nothing is read
    assert resolved(median_ratio_interval(OFF, [v * 1.002 for v in OFF]), 1.01, upper_is_worse=True) == "unresolved"
    past = median_ratio_interval(OFF, [v * 1.05 for v in OFF])
    assert past[0] > 1.01
    assert resolved(past, 1.01, upper_is_worse=True) == "missed"


def test_rounds_that_swing_more_than_the_cost_read_unresolved() -> None:
    # the on arm costs 0.5 % more by construction, but its rounds swing +-5 %
    on = [v * 1.005 * s for v, s in zip(OFF, (0.95, 1.05, 0.97, 1.04, 1.0, 0.96, 1.03), strict=True)]
    interval = median_ratio_interval(OFF, on)
    assert interval[0] < 1.01 < interval[1]
    assert resolved(interval, 1.01, upper_is_worse=True) == "unresolved"


def test_a_bar_where_lower_is_worse_reads_from_the_other_end() -> None:
    rps = [17.40, 17.42, 17.41, 17.43, 17.40]
    assert resolved(median_ratio_interval(rps, rps), 0.99, upper_is_worse=False) == "met"
    assert math.isnan(median_ratio_interval(rps[:4], rps[:4])[0])  # four rounds: no interval
    assert resolved(median_ratio_interval(rps, [v * 0.9 for v in rps]), 0.99, upper_is_worse=False) == "missed"
    assert resolved((0.97, 1.02), 0.99, upper_is_worse=False) == "unresolved"


FIVE = [1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("a, b", [([], FIVE), (FIVE[:2], FIVE), (FIVE, FIVE[:4]), ([0.0] * 5, FIVE)])
def test_too_few_rounds_or_a_zero_baseline_give_no_interval(a: list[float], b: list[float]) -> None:
    # (a median's bootstrap over fewer than five runs an arm is too narrow to read a bar from)
    low, high = median_ratio_interval(a, b)
    assert math.isnan(low) and math.isnan(high)
    assert resolved((low, high), 1.01, upper_is_worse=True) == "unresolved"
