"""`make test` never sits silent: a long test's heartbeat and a fixture's progress line reach the terminal, from one
process and from the two pytest-xdist workers `make test` starts (tests/conftest.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

LONG_TESTS = """
import time

def test_long(progress):
    progress("planted progress line")
    time.sleep(2.5)

def test_short():
    pass
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadfile"]], ids=["one process", "two workers"])
def test_a_long_test_prints_its_heartbeat_and_progress(pytester, monkeypatch, workers):
    monkeypatch.setenv("KVREPLAY_TEST_HEARTBEAT_S", "1")
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_planted=LONG_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *workers)
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    lines = result.stdout.lines + result.stderr.lines
    # one process: the terminal reporter's indented lines; a worker: its stderr, tagged with its name
    tag = r"\[gw[01]\] " if workers else "  "
    beat = re.compile(rf"(^|\.){tag}\[still running after 1 s\] test_planted\.py::test_long$")
    said = re.compile(rf"(^|\.){tag}\[planted progress line\]$")
    assert any(beat.search(line) for line in lines), lines
    assert any(said.search(line) for line in lines), lines


SLOW_TEARDOWN = """
import time

import pytest

@pytest.fixture(scope="module")
def slow_to_tear_down():
    yield
    time.sleep(2.5)

def test_quick(slow_to_tear_down):
    pass
"""


def test_a_heartbeat_after_the_test_finished_says_its_fixtures_are_being_torn_down(pytester, monkeypatch):
    """A module fixture torn down after its test passed (a notebook chain, a JupyterLab server) is named as such: the
    heartbeat never says a test that finished is still running."""
    monkeypatch.setenv("KVREPLAY_TEST_HEARTBEAT_S", "1")
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_planted=SLOW_TEARDOWN)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    lines = result.stdout.lines + result.stderr.lines
    assert any(re.search(r"\[test done; tearing down its fixtures for [12] s\] test_planted\.py::test_quick$", line)
               for line in lines), lines
    assert not any("still running" in line for line in lines), lines
