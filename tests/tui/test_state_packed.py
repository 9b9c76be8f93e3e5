"""State schema v2: long lists of numbers packed as base64 binary, read back exactly by the loader;
version 1 files (plain lists) still read; malformed packed lists refused with the field named."""

from __future__ import annotations

import base64
import json
import math

import numpy as np
import pytest

from moescope import errors
from moescope.agent.state import (
    PACKED_F64,
    PACKED_MICRO,
    PACKED_MIN_VALUES,
    READABLE_VERSIONS,
    SCHEMA_VERSION,
    Header,
    HotExpert,
    Moe,
    MoeLayer,
    Snapshot,
    from_dict,
    from_json,
    to_json,
)

from .conftest import FIXTURES, load_fixture

LAYERS, EXPERTS = 58, 256  # DeepSeek-V3


def _snapshot(rows: list[list[float]]) -> Snapshot:
    layers = [
        MoeLayer(layer=i, num_experts=len(row), expert_token_share=row,
                 hot_experts=[HotExpert(expert=0, share=0.5)], tokens_total=1000, entropy_bits=7.5, gini=0.1)
        for i, row in enumerate(rows)
    ]
    return Snapshot(header=Header(agent_pid=7, started_unix_s=1.0), taken_unix_s=2.0, seq=3,
                    moe=Moe(window_s=10.0, layers=layers))


def _shares(seed: int) -> list[list[float]]:
    tokens = np.random.default_rng(seed).integers(0, 5000, size=(LAYERS, EXPERTS))
    return np.round(tokens / tokens.sum(axis=1, keepdims=True), 6).tolist()  # as the windows output rounds


def _layer_json(snapshot: Snapshot, index: int = 0) -> object:
    return json.loads(to_json(snapshot))["moe"]["layers"][index]["expert_token_share"]


def test_deepseek_shares_pack_as_micro_units_and_read_back_exactly() -> None:
    snapshot = _snapshot(_shares(1))
    packed = _layer_json(snapshot)
    assert isinstance(packed, dict) and list(packed) == [PACKED_MICRO]
    assert len(base64.b64decode(packed[PACKED_MICRO])) == 4 * EXPERTS
    back = from_json(to_json(snapshot))
    assert back == snapshot  # every float bit for bit, not approximately
    assert json.loads(to_json(snapshot))["version"] == SCHEMA_VERSION == 2


def test_other_numbers_pack_as_float64_and_not_finite_reads_as_nan() -> None:
    row = [i / 3.0 for i in range(PACKED_MIN_VALUES)]
    row[1], row[2], row[3] = math.nan, math.inf, -1e-300
    packed = _layer_json(_snapshot([row]))
    assert isinstance(packed, dict) and list(packed) == [PACKED_F64]
    back = from_json(to_json(_snapshot([row]))).moe.layers[0].expert_token_share
    assert math.isnan(back[1]) and math.isnan(back[2])  # as null is read elsewhere
    assert back[:1] + back[3:] == row[:1] + row[3:]


def test_short_lists_stay_plain_json() -> None:
    row = [0.25, 0.75] + [0.0] * (PACKED_MIN_VALUES - 3)
    assert _layer_json(_snapshot([row])) == row
    assert from_json(to_json(_snapshot([row]))).moe.layers[0].expert_token_share == row


def test_version_1_files_with_plain_lists_still_read() -> None:
    assert 1 in READABLE_VERSIONS
    v1 = json.loads((FIXTURES / "host_large_model.json").read_text())
    assert v1["version"] == 1 and len(v1["moe"]["layers"][0]["expert_token_share"]) == 256
    snapshot = from_dict(v1)
    assert snapshot.version == SCHEMA_VERSION  # read as the current schema
    assert snapshot.moe.layers[0].expert_token_share == v1["moe"]["layers"][0]["expert_token_share"]
    # ... and written again packed, with the same numbers
    again = json.loads(to_json(snapshot))
    assert again["version"] == SCHEMA_VERSION and PACKED_MICRO in again["moe"]["layers"][0]["expert_token_share"]
    assert from_dict(again) == snapshot == load_fixture("host_large_model")


@pytest.mark.parametrize(
    ("packed", "why"),
    [
        ({"u32_micro": "AAAA", "f64": "AAAA"}, "one packed object"),
        ({"f32": "AAAAAA=="}, "one packed object"),
        ({"f64": 12}, "one packed object"),
        ({"f64": "not base64!"}, "not base64"),
        ({"f64": base64.b64encode(b"\0" * 12).decode()}, "not a multiple of 8"),
        ({"u32_micro": base64.b64encode(b"\0" * 6).decode()}, "not a multiple of 4"),
        ({"f64": "é"}, "not base64"),
    ],
)
def test_malformed_packed_lists_are_refused_naming_the_field(packed: dict, why: str) -> None:
    data = json.loads(to_json(_snapshot(_shares(2)[:3])))
    data["moe"]["layers"][2]["expert_token_share"] = packed
    with pytest.raises(errors.SourceUnavailable) as exc:
        from_dict(data)
    assert "state.moe.layers[2].expert_token_share" in str(exc.value) and why in str(exc.value)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("version", [0, 3, True, "2", None])
def test_versions_outside_the_readable_ones_are_refused(version: object) -> None:
    data = json.loads(to_json(_snapshot([[0.5, 0.5]])))
    data["version"] = version
    with pytest.raises(errors.SourceUnavailable) as exc:
        from_dict(data)
    assert "schema version" in str(exc.value) and "understands 1 and 2" in str(exc.value)


def test_packing_shrinks_the_deepseek_file() -> None:
    snapshot = _snapshot(_shares(3))
    packed_bytes = len(to_json(snapshot))
    plain = json.loads(to_json(snapshot))
    for layer, row in zip(plain["moe"]["layers"], _shares(3), strict=True):
        layer["expert_token_share"] = row
    plain_bytes = len(json.dumps(plain, separators=(",", ":")))
    assert packed_bytes < 0.75 * plain_bytes
    assert from_dict(plain) == from_json(to_json(snapshot))  # the two spellings mean the same snapshot
