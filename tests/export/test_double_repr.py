"""The native encoder's double formatting (agent/export/double_repr.c) writes exactly repr(x): over
random bit patterns (every exponent, subnormals), the values the agent's spans carry (float32
timings widened, ratios, short decimals), and every power of two and of ten with its neighbours.
And the integer approximations of log2 5, log10 2 and log10 5 it scales by are exact where used."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moescope.agent.export import _otlp_span as native  # built by `make setup` (setup.py)


def _mismatches(values: list[float]) -> list[tuple[str, str]]:
    out = []
    for v in values:
        if math.isfinite(v):
            want, got = repr(v), native.double_repr(v)
            if got != want:
                out.append((want, got))
    return out


def test_the_tables_checked_out_so_the_encoder_formats_doubles_itself() -> None:
    assert native.fast_doubles()


def test_random_bit_patterns_are_written_as_repr() -> None:
    rng = np.random.default_rng(2026_12_04)
    values = rng.integers(0, 2**64, size=400_000, dtype=np.uint64).view(np.float64).tolist()
    assert sum(math.isfinite(v) for v in values) > 390_000
    assert _mismatches(values) == []


def test_the_values_spans_carry_are_written_as_repr() -> None:
    rng = np.random.default_rng(7)
    widened = rng.random(100_000).astype(np.float32).astype(np.float64).tolist()  # expert µs sent as float32
    ratios = (rng.random(100_000) * 10.0 ** rng.integers(-20, 20, 100_000)).tolist()
    decimals = [round(float(x), int(k)) for x, k in zip(rng.random(50_000) * 1000, rng.integers(0, 12, 50_000),
                                                        strict=True)]
    whole = [float(m) for m in range(-2000, 2000)] + [m * 1e15 for m in range(1, 2000)]
    assert _mismatches(widened + ratios + decimals + whole) == []


def test_every_power_of_two_and_ten_and_their_neighbours() -> None:
    values: list[float] = []
    for e in range(-1074, 1024):
        x = math.ldexp(1.0, e)
        values += [x, math.nextafter(x, math.inf), math.nextafter(x, 0.0), -x]
    for e in range(-325, 309):  # also where repr switches between fixed and exponent notation
        x = float(f"1e{e}")
        values += [x, math.nextafter(x, math.inf), math.nextafter(x, 0.0)]
    values += [math.ldexp(float(k), -1074) for k in range(1, 3000)]  # the smallest subnormals
    values += [0.0, -0.0, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 9007199254740993.0, 0.1, 0.3]
    assert _mismatches(values) == []
    with pytest.raises(ValueError):
        native.double_repr(math.inf)
    with pytest.raises(ValueError):
        native.double_repr(math.nan)


def test_the_scaling_approximations_are_exact_where_used() -> None:
    # bits(5^e) = floor(e log2 5) + 1 (checked against the tables at init as well), floor(log10 2^e)
    # for the binary exponents of doubles >= 1, floor(log10 5^e) for those below 1
    assert all(((e * 1217359) >> 19) + 1 == (5**e).bit_length() for e in range(0, 400))
    assert all((e * 78913) >> 18 == len(str(2**e)) - 1 for e in range(0, 1100))
    assert all((e * 732923) >> 20 == len(str(5**e)) - 1 for e in range(0, 1100))
