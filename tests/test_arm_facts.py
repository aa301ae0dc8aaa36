"""An arm's facts are declared once (kvreplay.arm_facts.ARM_FACTS) and every table that lists arms reads them.

A toy arm added in that one place is seen by the ledger lookup, the record types and their generated overloads, the
row-algorithm versions, the notebook chain, the paper tables, the partial-results report and the GPU script; the facts module and the GPU script's parent process
import no torch.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from kvreplay import arm_facts
from kvreplay.arm_facts import ARM_FACTS, ArmFacts
from kvreplay.experiments import bridge
from kvreplay.ledger import overloads
from kvreplay.ledger.lookup import LEDGER_SPECS
from kvreplay.ledger.records import FAILED_ROW_TYPES, ROW_TYPES, BridgeFailedRow, BridgeRow
from kvreplay.paper.chain import CHAIN, notebook_arms
from kvreplay.paths import ROOT
from kvreplay.notebook.profiles import load_parameters
from kvreplay.report import paper_tables, partial
from kvreplay.report.summary import TABLES_BY_EXPERIMENTS
from kvreplay.runner import ROW_ALGORITHM

TOY = ArmFacts("exp9", "10_toy_arm.ipynb", ("bfloat16",), 1, "BridgeRow", "Experiment 9, a toy",
               title="a toy arm's bridge table", partial="one_arm", reads=("exp2-bfloat16",), read_by=("06", "07"),
               assembly=True, module="bridge", tables=("table_exp9_toy",), paper=9,
               paper_rows=(("exp9", "toy", "exp9-bfloat16"), ("exp9_audit", "audit", "exp1-bfloat16")),
               paper_note="a toy's note")


def _gpu_profile():
    spec = importlib.util.spec_from_file_location("gpu_profile_facts", ROOT / "scripts" / "gpu_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_toy_arm_declared_in_one_place_is_seen_everywhere(monkeypatch, capsys):
    gpu_profile = _gpu_profile()
    assert "exp9-bfloat16" not in LEDGER_SPECS and "exp9-bfloat16" not in gpu_profile.arm_labels()
    monkeypatch.setitem(ARM_FACTS, "exp9", TOY)

    # the ledger lookup and the records
    assert LEDGER_SPECS["exp9-bfloat16"].notebook == TOY.notebook
    assert LEDGER_SPECS["exp9-bfloat16"].what == "Experiment 9, a toy, BF16"
    assert ROW_ALGORITHM["exp9"] == 1
    assert ROW_TYPES["exp9"] is BridgeRow and FAILED_ROW_TYPES["exp9"] is BridgeFailedRow
    # the typed overloads: generated with the toy's record; the committed blocks are stale until regenerated
    assert '@overload\ndef validate_rows(experiment: Literal["exp9"], rows: Iterable[Any]) -> list[BridgeRecord]' \
        in overloads.validate_rows_block()
    assert 'def records(self, key: Literal["exp9-bfloat16"]) -> list[BridgeRecord]: ...' in overloads.records_block()
    assert overloads.stale() == ["validate_rows", "ProfileLedgers.records"]
    # the chain: its notebook is in make paper's list and computes it after its upstream, the tables notebooks read it
    assert CHAIN[-1] == "10_toy_arm.ipynb" and "10_toy_arm.ipynb" in CHAIN
    params = load_parameters("smoke")
    assert notebook_arms("10_toy_arm.ipynb", params) == ["exp2-bfloat16", "exp9-bfloat16"]
    assert notebook_arms("06_tables.ipynb", params)[-1] == "exp9-bfloat16"
    assert "exp9-bfloat16" not in notebook_arms("08_drift_explorer.ipynb", params)
    # the paper tables: its results table is checked by notebook 06, its row counts and note in the setup tables
    assert TABLES_BY_EXPERIMENTS["table_exp9_toy"] == "10_toy_arm.ipynb"
    assert paper_tables.setup_rows()[-2:] == [("exp9", "rows, Exp 9 toy", "exp9-bfloat16"),
                                              ("exp9_audit", "rows, Exp 9 audit", "exp1-bfloat16")]
    run = {"model": "m", "dataset": "d", "caps": {}, "hardware": "h", "rows": {"exp9": 3, "exp9_audit": 4}}
    assert paper_tables.what_differs(9, run, {**run, "model_short": "m", "rows": {"exp9": 3, "exp9_audit": 5}}) == (
        "data (3 toy / 4 audit d vs 3 toy / 5 audit d rows); hardware (h vs h); a toy's note")
    # the partial-results report: its heading, and it is a choice of --experiments
    assert partial.title("exp9") == "a toy arm's bridge table"
    assert "exp9" in partial.ONE_ARM_TITLES
    seen = []
    monkeypatch.setattr(bridge, "partial_table", lambda rows, folder: seen.append((rows, folder)) or "table")
    assert partial.one_arm_table("exp9", ["row"]) == "table" and seen == [(["row"], None)]  # its module's table
    with pytest.raises(SystemExit):
        partial.main(["--experiments", "exp9", "--help"])
    assert "exp9" in capsys.readouterr().out
    # the GPU script's arm list, its --list-arms and its check of the arms it is given
    assert gpu_profile.arm_labels()[-1] == "exp9-bfloat16"
    assert gpu_profile.list_arms(["10"]) == ["exp9-bfloat16"]


def test_the_chain_reads_the_arms_it_read_before_the_facts():
    """notebook_arms under the smoke profile, with and without the exploratory arms (the lists the chain had)."""
    exp1, exp2 = ["exp1-bfloat16", "exp1-float32"], ["exp2-bfloat16", "exp2-float32"]
    later = ["exp3-bfloat16", "exp4-bfloat16", "exp5-bfloat16"]
    for overrides, controls, ties in (({"exploratory_controls": False}, [], []),
                                      ({"exploratory_controls": True, "tie_rules": ["highest"]},
                                       ["exp2_controls-bfloat16"], ["exp1_ties-bfloat16"])):
        params = load_parameters("smoke", overrides)
        got = {name[:2]: notebook_arms(name, params) for name in CHAIN}
        assert got == {"00": [], "01": [*exp1, *ties], "02": ["exp1-bfloat16", *exp2, *controls],
                       "03": ["exp1-bfloat16", "exp2-bfloat16", "exp3-bfloat16"], "04": ["exp2-bfloat16", "exp4-bfloat16"],
                       "05": ["exp2-bfloat16", "exp5-bfloat16"], "06": [*exp1, *exp2, *controls, *later],
                       "07": [*exp1, *exp2, *controls, *later], "08": [*exp1, *exp2]}, overrides
    fp32 = load_parameters("smoke", {"precisions": ["float32"], "tie_rules": ["highest"]})
    assert notebook_arms("01_x.ipynb", fp32) == ["exp1-float32"]  # the tie-rule control runs in BF16 only


def test_the_explorer_rebuilds_the_experiments_its_notebook_reads():
    from kvreplay.report.rebuild import COMPARISONS

    assert set(COMPARISONS) == {f.experiment for f in ARM_FACTS.values() if "08" in f.read_by}


def test_every_arm_with_functions_has_facts_and_the_reverse():
    from kvreplay.experiments.arms import ARMS

    assert list(ARMS) == [f.experiment for f in arm_facts.chain_facts()]
    for name, declared in ARMS.items():
        assert (ROOT / declared.notebook).is_file(), name
    assert arm_facts.PREFIX_BANK_SOURCE in arm_facts.arm_labels()
    with pytest.raises(ValueError, match="no arm is declared for experiment 'exp7'; arms: exp1, "):
        arm_facts.facts("exp7")
    assert [arm_facts.declared_in(f"kvreplay.experiments.{f.module}") for f in arm_facts.chain_facts()] == list(ARMS)
    with pytest.raises(ValueError, match="0 arms of ARM_FACTS name the module 'matrix'"):
        arm_facts.declared_in("kvreplay.experiments.matrix")


def test_the_generated_overloads_are_those_the_facts_give():
    """``python -m kvreplay.ledger.overloads --check``: the committed blocks are what the facts generate now."""
    assert overloads.stale() == []
    assert overloads.main(["--check"]) == 0


def test_the_facts_and_the_gpu_scripts_parent_import_no_torch():
    code = ("import runpy, sys; sys.argv = ['gpu_profile.py', '--list-arms']; import kvreplay.arm_facts; "
            "runpy.run_path('scripts/gpu_profile.py', run_name='not_main'); assert 'torch' not in sys.modules, 'torch'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
