"""Static check of the ledger row records: mypy over the code that builds and reads rows.

The records (:mod:`kvreplay.ledger.records`) are ``TypedDict`` classes: at run time every row is checked against
its record before a ledger takes it; statically, mypy checks every read of a row's fields in the experiments'
summaries, the reports, the runner, the session and the notebooks' paired scripts (the files listed under
``[tool.mypy]`` in ``pyproject.toml``). A misspelled field, or a field read from a row that may have failed a gate,
is an error. The second test shows that the check bites, on a file written for it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("mypy", reason="mypy is in the hashed lock (requirements.txt); run `make setup`")


def _mypy(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"MYPY_FORCE_COLOR": "0"}
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(cache),
         "--no-error-summary", "--hide-error-context", *args],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=900,
    )


def test_row_records_type_check(tmp_path):
    """Every configured file passes mypy: no field of a row is read that its record does not declare."""
    out = _mypy(cache=tmp_path / "cache")
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert out.returncode == 0 and not errors, (
        f"mypy found {len(errors)} error(s) (exit {out.returncode}):\n" + "\n".join(errors[:60]) + out.stderr[-2000:])


def test_a_misspelled_field_is_an_error(tmp_path):
    """The check is not vacuous: a misspelled field and an unnarrowed read of a failed row are both reported."""
    probe = tmp_path / "probe_records.py"
    probe.write_text(textwrap.dedent('''
        from kvreplay.experiments.endpoints import require_gates
        from kvreplay.ledger.records import Exp1Record


        def misspelled(rows: list[Exp1Record]) -> int:
            return sum(r["endpoints"]["suffix_differ"] for r in require_gates(rows))


        def unchecked(rows: list[Exp1Record]) -> int:
            return sum(r["endpoints"]["suffix_differs"] for r in rows)


        def checked(rows: list[Exp1Record]) -> int:
            return sum(r["endpoints"]["suffix_differs"] for r in require_gates(rows))
    '''))
    out = _mypy(str(probe), cache=tmp_path / "cache")
    lines = out.stdout.splitlines()
    assert out.returncode == 1, out.stdout + out.stderr
    assert any(":7: error:" in x and "suffix_differ" in x and "typeddict-item" in x for x in lines), out.stdout
    assert any(":11: error:" in x and "Exp1FailedRow" in x and "endpoints" in x for x in lines), out.stdout
    assert not any(":15: error:" in x for x in lines), out.stdout
