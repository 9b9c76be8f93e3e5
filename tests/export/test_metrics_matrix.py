"""agent/metrics.py record_expert_matrix and the flush built on it (agent/outputs/metrics.py): the
per-expert counters from whole count matrices equal, sample for sample, a plain per-layer, per-dict
model of the bounded labels (the hottest experts admitted while slots remain, by tokens descending
then expert ascending; every other expert in expert="other"; layers past max_layers in
layer="other"), across several flushes; and the pending-count sums (int32 steps folded into int64)
are exact."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from moescope.agent.join import BufferedStep, StepSeen
from moescope.agent.metrics import OTHER, Metrics
from moescope.agent.outputs.metrics import INT32_MAX, MetricsOutput, PendingCounts
from moescope.agent.routing_health import LayerTable, layer_table
from moescope.collectors.moe_convention import StepEvent

TOKENS = "moescope_expert_tokens"
DROPPED = "moescope_expert_dropped_tokens"
Samples = dict[tuple[str, str, str], float]


class ReferenceLabels:
    """The bounded-label rule written out one layer, one dict at a time (the model the matrix path
    must equal): expected counter totals per (family, layer label, expert label)."""

    def __init__(self, *, max_layers: int, max_experts_per_layer: int) -> None:
        self.max_layers = max_layers
        self.max_experts = max_experts_per_layer
        self.admitted: dict[int, set[int]] = {}
        self.totals: Samples = {}

    def layer_label(self, layer: int) -> str:
        if layer not in self.admitted and len(self.admitted) < self.max_layers:
            self.admitted[layer] = set()
        return str(layer) if layer in self.admitted else OTHER

    def record(self, layer: int, tokens: Mapping[int, int], dropped: Mapping[int, int]) -> None:
        label = self.layer_label(layer)
        own: set[int] = set()
        if label != OTHER:
            own = self.admitted[layer]
            fresh = sorted((e for e, n in tokens.items() if n > 0 and e not in own), key=lambda e: (-tokens[e], e))
            own.update(fresh[: max(0, self.max_experts - len(own))])
        for family, counts in ((TOKENS, tokens), (DROPPED, dropped)):
            for expert, n in counts.items():
                if n > 0:
                    key = (family, label, str(expert) if expert in own else OTHER)
                    self.totals[key] = self.totals.get(key, 0) + n

    def record_rows(self, layers: Sequence[int], tokens: np.ndarray, dropped: np.ndarray) -> None:
        for layer, t, d in zip(layers, tokens.tolist(), dropped.tolist()):
            self.record(layer, dict(enumerate(t)), dict(enumerate(d)))


def expert_samples(metrics: Metrics) -> Samples:
    """Every per-expert counter sample in the registry (no refresh: what was written)."""
    return {
        (family.name, sample.labels["layer"], sample.labels["expert"]): sample.value
        for family in metrics.registry.collect() if family.name in (TOKENS, DROPPED)
        for sample in family.samples if sample.name.endswith("_total")
    }


COUNT = st.sampled_from([0, 0, 0, 1, 2, 3, 5, 5, 40])  # many zeros and ties: admission order shows


@st.composite
def flushes(draw: st.DrawFn) -> tuple[int, int, int, list[list[tuple[list[int], np.ndarray, np.ndarray]]]]:
    """(max_layers, max_experts_per_layer, E, flushes of batches (layers, tokens [R, E], dropped [R, E]))."""
    max_layers = draw(st.integers(1, 4))
    max_experts = draw(st.integers(0, 5))
    experts = draw(st.integers(1, 9))
    out = []
    for _ in range(draw(st.integers(1, 4))):
        batches = []
        for _ in range(draw(st.integers(1, 3))):
            layers = draw(st.lists(st.integers(0, 6), min_size=0, max_size=5))  # repeats allowed: rows in order
            tokens = draw(hnp.arrays(np.int64, (len(layers), experts), elements=COUNT))
            dropped = draw(hnp.arrays(np.int64, (len(layers), experts), elements=COUNT))
            batches.append((layers, tokens, dropped))
        out.append(batches)
    return max_layers, max_experts, experts, out


@settings(max_examples=150, deadline=None)
@given(flushes())
def test_matrix_path_equals_the_per_dict_model(case: tuple[int, int, int, list[list[tuple[list[int], np.ndarray,
                                                                                              np.ndarray]]]]) -> None:
    max_layers, max_experts, _, rounds = case
    metrics = Metrics(max_layers=max_layers, max_experts_per_layer=max_experts)
    via_dicts = Metrics(max_layers=max_layers, max_experts_per_layer=max_experts)
    reference = ReferenceLabels(max_layers=max_layers, max_experts_per_layer=max_experts)
    for batches in rounds:
        for layers, tokens, dropped in batches:
            metrics.record_expert_matrix(layers=layers, tokens=tokens, dropped=dropped)
            for layer, t, d in zip(layers, tokens.tolist(), dropped.tolist()):
                via_dicts.record_expert_counts(layer=layer, tokens={e: n for e, n in enumerate(t) if n},
                                               dropped={e: n for e, n in enumerate(d) if n})
            reference.record_rows(layers, tokens, dropped)
        assert expert_samples(metrics) == reference.totals
        assert expert_samples(via_dicts) == reference.totals
    assert metrics.get("moescope_agent_metric_series_dropped", metric=TOKENS) == 0


def test_slots_go_to_the_hottest_then_the_lower_expert() -> None:
    metrics = Metrics(max_layers=8, max_experts_per_layer=2)
    # experts 1, 2 and 3 tie at 5: the two lower ids are admitted; 0 (4) and 3 sum into "other"
    metrics.record_expert_matrix(layers=[0], tokens=[[4, 5, 5, 5]], dropped=[[0, 0, 0, 2]])
    assert expert_samples(metrics) == {(TOKENS, "0", "1"): 5, (TOKENS, "0", "2"): 5, (TOKENS, "0", OTHER): 9,
                                       (DROPPED, "0", OTHER): 2}


def test_admission_across_flushes_keeps_earlier_experts() -> None:
    metrics = Metrics(max_layers=8, max_experts_per_layer=2)
    metrics.record_expert_matrix(layers=[3], tokens=[[0, 0, 7, 0]], dropped=[[0, 0, 0, 0]])  # one slot used
    # expert 2 keeps its series although 0 and 1 are hotter now; 1 (9) takes the last slot; 3 had
    # no tokens this flush (never admitted by drops alone), so its drop goes to "other"
    metrics.record_expert_matrix(layers=[3], tokens=[[8, 9, 1, 0]], dropped=[[0, 1, 0, 4]])
    metrics.record_expert_matrix(layers=[3], tokens=[[0, 0, 0, 50]], dropped=[[0, 0, 6, 0]])
    assert expert_samples(metrics) == {
        (TOKENS, "3", "2"): 8, (TOKENS, "3", "1"): 9, (TOKENS, "3", OTHER): 58,
        (DROPPED, "3", "1"): 1, (DROPPED, "3", OTHER): 4, (DROPPED, "3", "2"): 6,
    }


def test_a_zero_row_takes_a_layer_slot_and_later_layers_are_other() -> None:
    metrics = Metrics(max_layers=1, max_experts_per_layer=4)
    metrics.record_expert_matrix(layers=[0, 1, 2], tokens=[[0, 0], [3, 0], [0, 2]], dropped=[[0, 0], [0, 0], [1, 0]])
    # layer 0 had a step (no tokens): it holds the one layer label; 1 and 2 sum into layer="other"
    assert expert_samples(metrics) == {(TOKENS, OTHER, OTHER): 5, (DROPPED, OTHER, OTHER): 1}
    assert metrics.expert_labels.layer_label(0) == "0"


def test_no_slots_gives_per_layer_totals_only() -> None:
    metrics = Metrics(max_layers=4, max_experts_per_layer=0)
    metrics.record_expert_matrix(layers=[0, 1], tokens=[[1, 2, 3], [0, 0, 0]], dropped=None)
    assert expert_samples(metrics) == {(TOKENS, "0", OTHER): 6}


def test_named_expert_columns_follow_their_ids() -> None:
    metrics = Metrics(max_layers=4, max_experts_per_layer=1)
    # columns are experts 9 and 4, tied: expert 4 (the lower id, not the first column) is admitted
    metrics.record_expert_matrix(layers=[0], tokens=[[6, 6]], dropped=[[1, 2]], experts=[9, 4])
    assert expert_samples(metrics) == {(TOKENS, "0", "4"): 6, (TOKENS, "0", OTHER): 6,
                                       (DROPPED, "0", "4"): 2, (DROPPED, "0", OTHER): 1}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"layers": [0, 1], "tokens": [[1, 2]]}, "2 layers"),
    ({"layers": [0], "tokens": [1, 2]}, "matrix"),
    ({"layers": [0], "tokens": [[1, 2]], "dropped": [[1, 2, 3]]}, "dropped"),
    ({"layers": [0], "tokens": [[1, 2]], "experts": [5, 5]}, "distinct"),
    ({"layers": [0], "tokens": [["a", "b"]]}, "numbers"),
])
def test_bad_matrices_are_one_line_errors(kwargs: dict[str, object], message: str) -> None:
    metrics = Metrics()
    with pytest.raises(ValueError, match=message):
        metrics.record_expert_matrix(**kwargs)  # type: ignore[arg-type]
    assert expert_samples(metrics) == {}


# ------------------------------------------------------------------ the flush (MetricsOutput)


def step_seen(seq: int, table: LayerTable, *, pid: int = 7) -> StepSeen:
    start = 1_000_000_000 + seq * 5_000_000
    step = StepEvent(pid=pid, tid=pid, start_ns=start, end_ns=start + 2_000_000 + seq * 10_000, tokens=16)
    return StepSeen(step=BufferedStep(seq=seq, step=step, num_experts=table.num_experts, table=table, batch_size=1),
                    experts_changed=False)


def compact_table(layers: list[int], tokens: np.ndarray, dropped: np.ndarray) -> LayerTable:
    """A table as the join builds for compact steps: tokens | dropped as views of one int32 block."""
    block = np.concatenate([tokens, dropped], axis=1).astype(np.int32)
    e = tokens.shape[1]
    return layer_table(layers=layers, tokens=block[:, :e], dropped=block[:, e:], block=block)


@st.composite
def step_rounds(draw: st.DrawFn) -> tuple[int, int, list[list[tuple[list[int], np.ndarray, np.ndarray]]]]:
    max_layers = draw(st.integers(1, 5))
    max_experts = draw(st.integers(0, 4))
    experts = draw(st.integers(2, 8))
    rounds = []
    for _ in range(draw(st.integers(1, 4))):
        steps = []
        for _ in range(draw(st.integers(1, 4))):
            layers = sorted(draw(st.sets(st.integers(0, 7), min_size=1, max_size=6)))
            tokens = draw(hnp.arrays(np.int64, (len(layers), experts), elements=COUNT))
            dropped = draw(hnp.arrays(np.int64, (len(layers), experts), elements=COUNT))
            steps.append((layers, tokens, dropped))
        rounds.append(steps)
    return max_layers, max_experts, rounds


@settings(max_examples=80, deadline=None)
@given(step_rounds())
def test_flushes_of_steps_equal_the_model_fed_each_flushs_sums(
    case: tuple[int, int, list[list[tuple[list[int], np.ndarray, np.ndarray]]]],
) -> None:
    max_layers, max_experts, rounds = case
    metrics = Metrics(max_layers=max_layers, max_experts_per_layer=max_experts)
    output = MetricsOutput(metrics)
    reference = ReferenceLabels(max_layers=max_layers, max_experts_per_layer=max_experts)
    seq = 0
    for steps in rounds:
        sums: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for layers, tokens, dropped in steps:
            output.export([step_seen(seq, compact_table(layers, tokens, dropped))])
            seq += 1
            for layer, t, d in zip(layers, tokens, dropped):
                held = sums.get(layer, (np.zeros_like(t), np.zeros_like(d)))
                sums[layer] = (held[0] + t, held[1] + d)
        output.force_flush()
        for layer in sorted(sums):  # a flush writes its layers in ascending order
            reference.record(layer, dict(enumerate(sums[layer][0].tolist())), dict(enumerate(sums[layer][1].tolist())))
        assert expert_samples(metrics) == reference.totals
    assert metrics.get("moescope_steps") == seq


def test_layer_health_gauges_from_columns_equal_per_layer_objects() -> None:
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 9, size=(5, 6))
    tokens[2] = 0  # a layer with no tokens: NaN gauges
    table = layer_table(layers=[0, 1, 2, 3, 4], tokens=tokens, dropped=rng.integers(0, 2, size=(5, 6)),
                        router_entropy_bits=rng.uniform(0, 2.5, size=5))
    by_rows, by_objects = Metrics(max_layers=3), Metrics(max_layers=3)  # layers 3 and 4: layer="other"
    by_rows.set_layer_health_rows(table, [0, 1, 2, 3, 4])
    for i in range(5):
        by_objects.set_layer_health(table.health(i))

    def gauges(metrics: Metrics) -> dict[tuple[str, str], float]:
        return {(f.name, s.labels["layer"]): s.value for f in metrics.registry.collect()
                if f.type == "gauge" and f.name.startswith(("moescope_router_", "moescope_expert_load_"))
                for s in f.samples if "layer" in s.labels}

    want = gauges(by_objects)
    got = gauges(by_rows)
    assert got.keys() == want.keys() and len(want) == 7 * 4
    for key, value in want.items():
        assert got[key] == value or (np.isnan(value) and np.isnan(got[key])), key
    assert np.isnan(got[("moescope_expert_load_gini", "2")])
    assert got[("moescope_expert_load_gini", OTHER)] == table.health(4).load.gini  # the last other layer's


def test_int32_steps_fold_into_exact_int64_sums() -> None:
    pending = PendingCounts()
    big = 2**30
    narrow = compact_table([0, 1], np.array([[big, 1], [0, 3]]), np.array([[0, 0], [big, 0]]))
    for _ in range(5):  # 5 * 2^30 passes int32: the int32 sums must be folded before they wrap
        pending.add(narrow)
    wide_row = compact_table([1], np.array([[big, big]]), np.array([[0, 0]]))  # a column sum past int32
    pending.add(wide_row)
    (layers, tokens, dropped), = pending.take()
    assert layers.tolist() == [0, 1]
    assert tokens.tolist() == [[5 * big, 5], [big, big + 15]]
    assert dropped.tolist() == [[0, 0], [5 * big, 0]]
    assert INT32_MAX < 5 * big and pending.take() == []
    # one layer reported twice in a step: its two rows add into one entry, past int32 in one step
    twice = compact_table([0, 0], np.array([[3 * 2**29, 0], [3 * 2**29, 1]]), np.array([[0, 0], [0, 0]]))
    pending.add(twice)
    (layers, tokens, _), = pending.take()
    assert layers.tolist() == [0] and tokens.tolist() == [[3 * 2**30, 1]]


def test_another_expert_count_is_flushed_as_its_own_batch() -> None:
    metrics = Metrics(max_layers=4, max_experts_per_layer=1)
    output = MetricsOutput(metrics)
    output.export([step_seen(0, compact_table([0], np.array([[1, 4]]), np.array([[0, 1]])))])
    output.export([step_seen(1, compact_table([0], np.array([[9, 0, 2]]), np.array([[1, 0, 0]])))])
    output.force_flush()
    # E = 2 first: expert 1 (4) takes layer 0's slot; then E = 3: expert 0 is "other" though hotter
    assert expert_samples(metrics) == {(TOKENS, "0", "1"): 4, (TOKENS, "0", OTHER): 12,
                                       (DROPPED, "0", "1"): 1, (DROPPED, "0", OTHER): 1}
    assert metrics.get("moescope_experts") == 3  # the latest step's E


def test_step_totals_and_durations_are_the_per_pid_sums() -> None:
    metrics = Metrics()
    output = MetricsOutput(metrics)
    table = compact_table([0], np.array([[1, 1]]), np.array([[0, 0]]))
    events = [step_seen(i, table, pid=100 + i % 3) for i in range(10)]
    output.export(events)
    output.force_flush()
    single = Metrics()  # the same durations observed one by one
    for event in events:
        single.observe("moescope_step_duration_seconds", event.step.step.duration_ns / 1e9)

    def buckets(m: Metrics) -> list[tuple[str, float]]:
        return [(s.labels["le"], s.value) for f in m.registry.collect() if f.name == "moescope_step_duration_seconds"
                for s in f.samples if s.name.endswith("_bucket")]

    assert buckets(metrics) == buckets(single) and metrics.get("moescope_step_duration_seconds") == 10
    assert metrics.get("moescope_steps") == 10 and metrics.get("moescope_step_tokens") == 160
    assert [metrics.get("moescope_rank_steps", pid=str(pid)) for pid in (100, 101, 102)] == [4, 3, 3]


def test_flush_sets_each_layers_health_from_the_latest_table_holding_it() -> None:
    metrics = Metrics(max_layers=2)  # layers 0 and 1 own labels; 2 and 3 share layer="other"
    output = MetricsOutput(metrics)
    first = compact_table([0, 1, 3], np.array([[1, 0], [5, 1], [2, 2]]), np.zeros((3, 2), dtype=np.int64))
    second = compact_table([1, 2], np.array([[1, 1], [9, 0]]), np.zeros((2, 2), dtype=np.int64))
    output.export([step_seen(0, first), step_seen(1, second)])
    output.force_flush()
    gini = {layer: metrics.get("moescope_expert_load_gini", layer=layer) for layer in ("0", "1", OTHER)}
    # layer 0 from the first table, 1 from the second; "other" was set for 3 (first) then for 2 (second)
    assert gini == {"0": first.health(0).load.gini, "1": second.health(0).load.gini,
                    OTHER: second.health(1).load.gini}
    assert gini["0"] != gini["1"] != gini[OTHER]


def test_admit_labels_one_dict_by_the_same_rule() -> None:
    labels = Metrics(max_layers=1, max_experts_per_layer=2).expert_labels
    assert labels.admit(5, {7: 3, 2: 3, 9: 4, 4: 0}) == {7: OTHER, 2: "2", 9: "9", 4: OTHER}
    assert labels.admit(5, {7: 50, 2: 0}) == {7: OTHER, 2: "2"}  # slots stay with 2 and 9
    assert labels.admit(6, {1: 1}) == {1: OTHER}  # past max_layers


def test_layer_gauges_past_max_series_are_dropped_and_counted_per_update() -> None:
    layers = 131  # two past the per-layer gauges' bound (129 label values) when max_layers allows them
    table = layer_table(layers=list(range(layers)), tokens=np.ones((layers, 2), dtype=np.int64))
    by_rows, by_objects = Metrics(max_layers=200), Metrics(max_layers=200)
    for _ in range(2):
        by_rows.set_layer_health_rows(table, list(range(layers)))
        for i in range(layers):
            by_objects.set_layer_health(table.health(i))
    for metrics in (by_rows, by_objects):
        assert metrics.get("moescope_agent_metric_series_dropped", metric="moescope_expert_load_gini") == 2 * 2
        assert metrics.get("moescope_expert_load_gini", layer="128") == 0.0
        assert np.isnan(metrics.get("moescope_expert_load_gini", layer="129"))  # no such series
