"""Static check of the ledger row records: mypy over the code that builds and reads rows.

The records (:mod:`kvreplay.ledger.records`) are ``TypedDict`` classes: at run time a row is checked against its
record before a ledger takes it; statically, mypy checks the reads of rows in the files listed under
``[tool.mypy]`` in ``pyproject.toml`` (the experiments' summaries, the reports, the runner, the session, the
explorer, the notebooks' paired scripts, ...). What it does and does not catch is in docs/ARCHITECTURE.md, "Row
records"; the probe below pins both sides on a file written for it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory) -> Path:
    """One cache for the module's runs (the second run reuses what the first analysed)."""
    return tmp_path_factory.mktemp("mypy_cache")


def _mypy(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"MYPY_FORCE_COLOR": "0"}
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(cache),
         "--no-error-summary", "--hide-error-context", *args],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=900,
    )


def test_the_check_covers_the_row_code():
    """The configured files still hold the code that builds and reads rows, and nothing switches errors off."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    for path in ("lib/kvreplay/ledger", "lib/kvreplay/experiments", "lib/kvreplay/report", "lib/kvreplay/runner",
                 "lib/kvreplay/adapt/metric.py", "lib/kvreplay/notebook/session.py", "lib/kvreplay/notebook/explorer.py",
                 "lib/kvreplay/report/rebuild.py", "lib/kvreplay/verify.py", "lib/kvreplay/probe.py", "notebooks/py"):
        assert path in config["files"] or any(path.startswith(f"{f}/") for f in config["files"]), path
    assert config.get("check_untyped_defs") is True
    overrides = config.get("overrides", [])
    assert not any(o.get("ignore_errors") or o.get("disable_error_code") for o in overrides), overrides
    assert not any(m.startswith("kvreplay") for o in overrides for m in o.get("module", [])), overrides


def test_row_records_type_check(mypy_cache):
    """Every configured file passes mypy (mypy is in the hashed lock: a missing mypy fails here, it is not skipped)."""
    out = _mypy(cache=mypy_cache)
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert out.returncode == 0 and not errors, (
        f"mypy found {len(errors)} error(s) (exit {out.returncode}):\n" + "\n".join(errors[:60]) + out.stderr[-2000:])


def test_what_the_check_catches_and_what_it_does_not(tmp_path, mypy_cache):
    """A misspelled key and a key a failed row never has are errors; require_gates narrows them away. mypy does not
    report a read of a key a failed row *may* lack (``NotRequired``) nor a misspelled ``.get``: if it ever does,
    this test fails, and docs/ARCHITECTURE.md's list of what it does not see needs updating."""
    probe = tmp_path / "probe_records.py"
    probe.write_text(textwrap.dedent('''
        from kvreplay.experiments.endpoints import require_gates
        from kvreplay.ledger.records import Exp1Record, validate_rows


        def misspelled(rows: list[Exp1Record]) -> int:
            return sum(r["endpoints"]["suffix_differ"] for r in require_gates(rows))


        def unchecked(rows: list[Exp1Record]) -> int:
            return sum(r["endpoints"]["suffix_differs"] for r in rows)


        def checked(rows: list[Exp1Record]) -> int:
            return sum(r["endpoints"]["suffix_differs"] for r in require_gates(rows))


        def not_required(rows: list[Exp1Record]) -> int:
            return sum(r["prefix_len"] for r in rows) + len([r.get("endpointz") for r in rows])


        def loaded(rows: list[dict]) -> int:
            return sum(r["endpoints"]["suffix_differ"] for r in require_gates(validate_rows("exp1", rows)))
    '''))
    out = _mypy(str(probe), cache=mypy_cache)
    lines = out.stdout.splitlines()
    assert out.returncode == 1, out.stdout + out.stderr
    assert any(":7: error:" in x and "suffix_differ" in x and "typeddict-item" in x for x in lines), out.stdout
    assert any(":11: error:" in x and "Exp1FailedRow" in x and "endpoints" in x for x in lines), out.stdout
    assert not any(":15: error:" in x for x in lines), out.stdout
    assert not any(":19: error:" in x for x in lines), out.stdout
    # rows loaded as plain dicts are typed by validate_rows with a literal experiment
    assert any(":23: error:" in x and "suffix_differ" in x for x in lines), out.stdout
