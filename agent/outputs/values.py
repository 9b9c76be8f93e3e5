"""Sample values as outputs see them: NVML's N/A, None and NaN are "no value", never a number."""

from __future__ import annotations

import math


def finite(value: object) -> bool:
    """A number that can be exported: not None, not N/A, not NaN or infinite."""
    try:
        return value is not None and math.isfinite(float(value))  # type: ignore[arg-type]  # N/A and numbers alike
    except (TypeError, ValueError):
        return False


def float_or_none(value: object) -> float | None:
    return float(value) if finite(value) else None  # type: ignore[arg-type]  # finite() checked it converts


def int_or_none(value: object) -> int | None:
    return int(value) if finite(value) else None  # type: ignore[call-overload]  # finite() checked it converts
