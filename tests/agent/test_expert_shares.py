"""The live view's per-layer expert shares, all layers at once (agent/outputs/windows.py
expert_shares), against agent/state.py's one-layer definitions: bins, experts per bin, the
hottest experts with ties to the lower id, and an empty list for a layer with no tokens."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st_
from hypothesis.extra import numpy as hnp

from moescope.agent import state as st
from moescope.agent.outputs.windows import SHARE_DECIMALS, expert_shares


@settings(max_examples=200, deadline=None)
@given(st_.integers(1, 6).flatmap(lambda rows: st_.integers(1, 600).flatmap(
    lambda e: hnp.arrays(np.int64, (rows, e), elements=st_.sampled_from([0, 0, 1, 2, 7, 300, 10_000]))
)))
def test_all_rows_at_once_equal_one_row_at_a_time(tokens: np.ndarray) -> None:
    shares, per_bin, hot = expert_shares(tokens)
    for i, row in enumerate(tokens.astype(np.float64).tolist()):
        want_shares, want_per_bin = st.bin_expert_shares(row)
        assert shares[i] == pytest.approx(want_shares, abs=10.0 ** -SHARE_DECIMALS)
        if want_shares:
            assert per_bin == want_per_bin
        assert [h.expert for h in hot[i]] == [h.expert for h in st.hottest_experts(row)]
        assert [h.share for h in hot[i]] == pytest.approx([h.share for h in st.hottest_experts(row)])


def test_a_layer_with_no_tokens_has_no_shares() -> None:
    shares, _, hot = expert_shares(np.array([[0, 0, 0], [1, 0, 3]]))
    assert shares[0] == [] and hot[0] == []
    assert shares[1] == pytest.approx([0.25, 0.0, 0.75]) and [h.expert for h in hot[1]] == [2, 0, 1]
