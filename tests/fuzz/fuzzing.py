"""Hypothesis settings for the fuzz tests (docs/hardening.md), applied per test with `@fuzz(n)`
so that nothing here changes the settings of other test folders.

Profiles, chosen with HYPOTHESIS_PROFILE:
- `ci` (default): derandomized (the same examples on every run: reproducible CI), no example
  database, `n` examples for the test; the whole folder stays well under a minute on 2 shared cores.
- `long`: a fresh random seed per run and 5000 examples per test, for a soak:

      HYPOTHESIS_PROFILE=long .venv/bin/python -m pytest tests/fuzz -q --hypothesis-show-statistics

deadline=None everywhere: the machine is shared and noisy, and no assertion here is timed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings

_SUPPRESS = (HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture)
PROFILES: dict[str, settings] = {
    "ci": settings(derandomize=True, database=None, deadline=None, max_examples=100,
                   suppress_health_check=_SUPPRESS, print_blob=True),
    "long": settings(derandomize=False, deadline=None, max_examples=5000, suppress_health_check=_SUPPRESS,
                     print_blob=True),
}


def fuzz(ci_examples: int) -> Callable[[Any], Any]:
    """The test's settings: `ci_examples` examples under the ci profile, the profile's own count
    under any other."""
    name = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    if name not in PROFILES:
        raise ValueError(f"HYPOTHESIS_PROFILE={name!r}: known profiles are {sorted(PROFILES)}")
    profile = PROFILES[name]
    examples = ci_examples if name == "ci" else profile.max_examples
    return settings(profile, max_examples=examples)
