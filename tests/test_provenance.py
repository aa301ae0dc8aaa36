"""One library digest per profile: every run-log event and ``environment.json`` name the library that wrote them.

Committed profiles written before run logs recorded a digest, or by several libraries, fail the check; the ones that
pass are listed in ``ONE_LIBRARY_PROFILES`` and must keep passing. A profile not listed that passes must be added, so
the set only grows as profiles are recomputed by one library.
"""

from __future__ import annotations

import json

import pytest
from conftest import committed_profiles
from kvreplay.ledger import provenance
from kvreplay.ledger.__main__ import main
from kvreplay.ledger.store import Ledger, library_digest, run_rows
from kvreplay.paths import LEDGERS

ONE_LIBRARY_PROFILES: set[str] = set()
"""Committed profiles written by one library, with a digest on every run-log event (``python -m kvreplay.ledger
digests data/ledgers/<profile>`` exits 0). Empty: every committed profile's run logs predate the digest."""


def _ledger(root, name: str, rows: list[str]) -> Ledger:
    """A ledger under ``root`` with ``rows`` appended by :func:`run_rows`, as an arm's run writes them."""
    ledger = Ledger(root, name, {"experiment": name}, environment={"device": "cpu"}, row_algorithm=1)
    run_rows(ledger, rows, lambda k: {"problem_id": k}, key=lambda k: k, progress=False)
    return ledger


def _events(ledger: Ledger) -> list[dict]:
    return [json.loads(x) for x in (ledger.dir / "runlog.jsonl").read_text().splitlines()]


def test_every_run_log_event_records_the_library_and_the_run_its_compute_time(tmp_path):
    ledger = _ledger(tmp_path, "exp1-bfloat16", ["p1", "p2"])
    events = _events(ledger)
    assert [e["event"] for e in events] == ["start", "row", "row", "end"]
    assert {e["library_sha256"] for e in events} == {library_digest()}
    assert events[-1]["compute_s"] >= 0
    assert json.loads((ledger.dir / "environment.json").read_text())["library_sha256"] == library_digest()


def test_a_run_stopped_by_an_exception_still_records_its_compute_time(tmp_path):
    ledger = Ledger(tmp_path, "exp1-bfloat16", {"experiment": "exp1"}, environment={}, row_algorithm=1)

    def row(k):
        if k == "p2":
            raise KeyboardInterrupt
        return {"problem_id": k}

    with pytest.raises(KeyboardInterrupt):
        run_rows(ledger, ["p1", "p2"], row, key=lambda k: k, progress=False, started=0.0)
    last = _events(ledger)[-1]
    assert last["event"] == "stopped" and last["error"] == "KeyboardInterrupt" and last["compute_s"] > 0
    (p,) = provenance.profile_provenance(tmp_path)
    assert p.runs == 1 and p.compute_s == last["compute_s"] and p.unstamped == 0


def test_the_checker_passes_a_profile_of_one_library(tmp_path):
    _ledger(tmp_path, "exp1-bfloat16", ["p1", "p2"])
    _ledger(tmp_path, "exp1-float32", ["p1"])
    assert provenance.one_library_problems(tmp_path) == []
    assert provenance.profile_library_digests(tmp_path) == {library_digest()}
    assert main(["digests", str(tmp_path)]) == 0


def test_the_checker_fails_a_profile_of_two_libraries(tmp_path, capsys):
    _ledger(tmp_path, "exp1-bfloat16", ["p1"])
    other = _ledger(tmp_path, "exp1-float32", ["p1"])
    env = json.loads((other.dir / "environment.json").read_text())
    (other.dir / "environment.json").write_text(json.dumps(env | {"library_sha256": "ab" * 32}))
    problems = provenance.one_library_problems(tmp_path)
    assert len(problems) == 1 and "written by 2 libraries" in problems[0] and "abababababab (exp1-float32-" in problems[0]
    assert main(["digests", str(tmp_path)]) == 1
    assert "not one library" in capsys.readouterr().out


def test_the_checker_fails_a_resumed_run_of_another_library(tmp_path):
    ledger = _ledger(tmp_path, "exp1-bfloat16", ["p1"])
    with open(ledger.dir / "runlog.jsonl", "a") as f:  # rows appended by a later library, environment.json unchanged
        f.write(json.dumps({"event": "start", "library_sha256": "cd" * 32}) + "\n")
    assert provenance.profile_library_digests(tmp_path) == {library_digest(), "cd" * 32}
    assert "written by 2 libraries" in provenance.one_library_problems(tmp_path)[0]


def test_the_checker_fails_a_run_log_event_without_a_digest(tmp_path):
    ledger = _ledger(tmp_path, "exp1-bfloat16", ["p1"])
    with open(ledger.dir / "runlog.jsonl", "a") as f:
        f.write(json.dumps({"event": "row", "key": "p2", "seconds": 1.0}) + "\n")
    assert provenance.one_library_problems(tmp_path) == [
        f"{ledger.dir.name}: 1 run-log event(s) record no library_sha256"]


def test_the_checker_refuses_a_missing_profile_folder(tmp_path, capsys):
    assert main(["digests", str(tmp_path / "nope")]) == 2
    assert "no such profile folder" in capsys.readouterr().err


@pytest.mark.parametrize("profile", committed_profiles())  # a user's own profile is not committed: not read
def test_committed_profiles_of_one_library_are_declared_and_stay_so(profile):
    problems = provenance.one_library_problems(LEDGERS / profile)
    if profile in ONE_LIBRARY_PROFILES:
        assert not problems, f"{profile} is declared written by one library, but: {problems}"
    else:
        assert problems, f"{profile} is written by one library with a digest on every run-log event: add it to ONE_LIBRARY_PROFILES"
