"""The extras gate of tests/conftest.py: skipped without the extra, failed when required."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines import smollm2

CONFTEST = Path(__file__).with_name("conftest.py")
SAMPLE = """
import pytest

@pytest.mark.smollm2
def test_marked():
    pass

@pytest.mark.smollm2
def test_skips_itself():
    pytest.skip("inside the test")

@pytest.mark.smollm2
@pytest.mark.xfail(reason="expected")
def test_xfails():
    assert False

def test_plain_skip():
    pytest.skip("not gated")
"""


@pytest.fixture
def sample(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    vllm: v\n    smollm2: s\n")
    pytester.makepyfile(test_sample=SAMPLE)
    return pytester


@pytest.mark.parametrize(
    ("present", "required", "outcomes"),
    [
        (False, "", {"skipped": 4}),  # absent: the three gated tests skip
        (True, "", {"passed": 1, "skipped": 2, "xfailed": 1}),
        (False, "smollm2", {"errors": 3, "skipped": 1}),  # required and absent: setup fails
        (True, "smollm2", {"passed": 1, "failed": 1, "xfailed": 1, "skipped": 1}),
        (False, "vllm", {"skipped": 4}),  # only the named extras are required
    ],
)
def test_gate(
    sample: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    present: bool,
    required: str,
    outcomes: dict[str, int],
) -> None:
    monkeypatch.setattr(smollm2, "is_available", lambda: present)
    monkeypatch.setenv("ASYNCFLOW_TEST_REQUIRE", required)
    result = sample.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(**outcomes)
    if required == "smollm2" and present:  # the skip inside the test became a failure
        assert "skipped although ASYNCFLOW_TEST_REQUIRE requires ['smollm2']" in result.stdout.str()


def test_unknown_extra_is_a_usage_error(
    sample: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCFLOW_TEST_REQUIRE", "vllm,smolm2")
    result = sample.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "names unknown extras ['smolm2']" in result.stderr.str()
