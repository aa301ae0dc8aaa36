"""Each experiment arm is declared once (kvreplay.runner.Arm), and its declaration keys the committed ledgers.

The ledger key of every arm of every committed profile, computed from the arm's declaration under the profile's
parameters (panels frozen from the committed upstream ledgers, read-only), must name the committed folder: a
refactor that changed what enters a key would make ``make paper`` recompute instead of reading.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from kvreplay.experiments.arms import ARMS, arm
from kvreplay.gates import GateError
from kvreplay.ledger.lookup import PREFIX_BANK
from kvreplay.paths import LEDGERS, ROOT
from kvreplay.runner import READ_ONLY_ENV
from kvreplay.notebook.session import open_session

from conftest import tiny_problems

COMMITTED = {
    "cpu": ("cpu", {}),
    "gpu": ("gpu", {}),
    "paper": ("paper", {}),
    # the gpu profile's first 16 rows through the eager reference path on the same H200 (report.cross_hardware)
    "gpu_eager": ("gpu", {"profile": "gpu_eager", "n_rows": 16,
                          "execution": {"threads": 4, "device": "cuda", "workers": 1}}),
}
"""Ledger folder under data/ledgers -> the profile and overrides its arms ran under."""


def _committed_folders(profile: str) -> set[str]:
    return {f.name for f in (LEDGERS / profile).iterdir()
            if (f / "manifest.json").is_file() and json.loads((f / "manifest.json").read_text())["config"]
            .get("experiment") in ARMS}


def _checkpoint_missing(profile: str) -> str | None:
    pointer = LEDGERS / profile / "role_adaptation.json"
    if not pointer.is_file():
        return None
    folder = ROOT / json.loads(pointer.read_text())["folder"]
    return None if folder.is_dir() else str(folder.relative_to(ROOT))


@pytest.mark.parametrize("folder", sorted(COMMITTED))
def test_each_arm_declaration_keys_its_committed_ledger(folder, monkeypatch):
    """Every committed arm's folder is the one its declaration names under the profile's parameters (nothing runs)."""
    monkeypatch.setenv(READ_ONLY_ENV, "1")  # a panel that would change is refused, never rewritten
    profile, overrides = COMMITTED[folder]
    committed = _committed_folders(folder)
    assert committed, folder
    found, skipped = set(), []
    for name, declared in ARMS.items():
        session = open_session(declared.notebook, profile, overrides | {"ledger_root": str(LEDGERS)}, quiet=True)
        labels = [f"{name}-{d}" for d in declared.dtypes if d in session.params.precisions]
        if not any(c.rsplit("-", 1)[0] in labels for c in committed):
            continue
        if name == "exp5" and _checkpoint_missing(folder):
            skipped.append(f"{name}: its checkpoint folder {_checkpoint_missing(folder)} is not here (make paper "
                           "PROFILE=cpu trains it)")
            continue
        for plan in session.plans(declared):  # one, or one per variant (the tie-rule control: per rule)
            for label in labels:
                path = plan.folder(session.arm_settings(plan, label.rsplit("-", 1)[1]), LEDGERS)
                assert path.name in committed, f"{folder}: {label} keys {path.name}, committed: {sorted(committed)}"
                found.add(path.name)
    left = committed - found
    assert not left or skipped, f"{folder}: committed ledgers no arm declaration keys: {sorted(left)}"
    assert all(c.startswith("exp5-") for c in left), (left, skipped)
    if skipped:
        pytest.skip("; ".join(skipped))


def test_every_experiment_of_the_row_algorithms_has_one_declaration():
    from kvreplay.runner import ROW_ALGORITHM

    assert set(ARMS) == set(ROW_ALGORITHM) - {"adapt_eval"}
    assert all(a.experiment == name for name, a in ARMS.items())
    with pytest.raises(ValueError, match="no arm is declared for experiment 'exp9'; arms: exp1, exp1_ties, exp1_length, exp2"):
        arm("exp9")


def test_no_notebook_script_or_command_wires_an_arm_itself():
    """Notebooks 01-05, verify, bench and the GPU script call the declarations: none calls ``run_arm`` or a row or
    chunk function of an experiment, and no script executes notebook cells."""
    names = {"run_arm", "live_vs_prefill_row", "live_vs_prefill_chunk", "fixed_prefix_row", "fixed_prefix_chunk",
             "controls_row", "controls_chunk", "bridge_row", "bridge_chunk", "transplant_row", "transplant_chunk",
             "replication_row", "replication_chunk"}
    files = [*sorted((ROOT / "notebooks" / "py").glob("0[0-5]_*.py")), ROOT / "lib/kvreplay/verify.py",
             ROOT / "lib/kvreplay/bench/__init__.py", ROOT / "lib/kvreplay/bench/generate.py",
             ROOT / "lib/kvreplay/report/rebuild.py", ROOT / "scripts/gpu_profile.py"]
    for path in files:
        tree = ast.parse(path.read_text())
        called = {n.func.id if isinstance(n.func, ast.Name) else n.func.attr for n in ast.walk(tree)
                  if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}
        assert not called & names, f"{path.relative_to(ROOT)} wires an arm itself: {sorted(called & names)}"
        assert not called & {"exec", "compile"}, f"{path.relative_to(ROOT)} executes code it reads"
    runs = [line.strip() for path in sorted((ROOT / "notebooks" / "py").glob("0[1-5]_*.py"))
            for line in path.read_text().splitlines() if "session.run(" in line]
    assert len(runs) == 8 and all(len(r) < 100 for r in runs), runs  # 01 (+ tie rules, + branch caps), 02 (+ controls), 03-05


@pytest.mark.gate("provenance")
def test_a_plan_refuses_other_key_entries_and_a_problem_without_its_prefix():
    problems = tiny_problems(2)
    exp2 = ARMS["exp2"]
    with pytest.raises(ValueError, match=r"arm exp2: its ledger key adds \['prefix_bank_sha256'\], got \['seed'\]"):
        exp2.plan(problems, key={"seed": 1})
    with pytest.raises(GateError, match=r"gate 'provenance' failed: prefix bank has no prefix for \['tiny-01'\]"):
        exp2.plan(problems, key={"prefix_bank_sha256": "x"}, prefixes={"tiny-00": [1, 2]})
    with pytest.raises(ValueError, match="arm exp1 takes no fixed prefixes"):
        ARMS["exp1"].plan(problems, prefixes={"tiny-00": [1]})
    plan = exp2.plan(problems, key={"prefix_bank_sha256": "x"}, prefixes={"tiny-00": [1, 2], "tiny-01": [3]},
                     notes={"panel": [1]})
    assert plan.prefixes_of(problems) == [[1, 2], [3]] and plan.key == {"prefix_bank_sha256": "x"}
    assert plan._bare().notes == {} and plan._bare() == plan  # notes never reach the row function


def test_a_bf16_only_arm_refuses_float32(tmp_path):
    from kvreplay.decoding.contract import Caps
    from kvreplay.runner import ArmSettings

    plan = ARMS["exp3"].plan(tiny_problems(1), key={"prefix_bank_sha256": "x"}, prefixes={"tiny-00": [1]})
    with pytest.raises(ValueError, match="arm exp3 runs at bfloat16, not float32"):
        plan.run(ArmSettings(profile="t", dtype="float32", caps=Caps(4, 4, 4)), ledger_root=tmp_path)


def test_verify_binds_a_ledger_to_its_arm_from_the_manifest(tmp_path):
    """make verify rebuilds the plan from a ledger's key: a manifest without the arm's key entries is refused."""
    from kvreplay.verify import ledger_plan

    folder = next((LEDGERS / "cpu").glob("exp4-bfloat16-*"))
    config = json.loads((folder / "manifest.json").read_text())["config"]
    from kvreplay.data.problems import load_bank

    bank = load_bank()
    plan = ledger_plan(folder, config, bank)
    assert [p.problem_id for p in plan.problems] == config["problem_ids"] and plan.key["sweep"] == config["sweep"]
    entries = [json.loads(x) for x in (LEDGERS / "cpu" / PREFIX_BANK).read_text().splitlines()]
    assert plan.prefixes == {e["problem_id"]: e["prefix"] for e in entries if e["problem_id"] in config["problem_ids"]}
    old = {k: v for k, v in config.items() if k != "sweep"}
    with pytest.raises(ValueError, match=r"its manifest lacks the key entries \['sweep'\] of arm exp4"):
        ledger_plan(folder, old, bank)
    assert Path(folder).is_dir()
