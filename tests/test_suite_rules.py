"""The suite's own rule (tests/conftest.py): under `make test` (MOESCOPE_REQUIRE_BPF=1) a skipped test
fails the run, named; without it a skip is a skip. Checked on a throwaway suite with this conftest."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()
SUITE = """
import pytest

def test_skips() -> None:
    pytest.skip("no device here")

def test_runs() -> None:
    assert True
"""


@pytest.mark.parametrize("required", [True, False])
def test_a_skip_fails_the_run_only_where_every_test_must_run(pytester: pytest.Pytester,
                                                            monkeypatch: pytest.MonkeyPatch, required: bool) -> None:
    if required:
        monkeypatch.setenv("MOESCOPE_REQUIRE_BPF", "1")
    else:
        monkeypatch.delenv("MOESCOPE_REQUIRE_BPF", raising=False)
    pytester.makeconftest(CONFTEST.replace("reason = bpf_unavailable_reason()", "reason = None"))
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess("-q")
    result.assert_outcomes(passed=1, skipped=1)
    if required:
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        result.stdout.fnmatch_lines(["*1 test(s) skipped under MOESCOPE_REQUIRE_BPF=1*", "*test_suite.py::test_skips"])
    else:
        assert result.ret == pytest.ExitCode.OK
