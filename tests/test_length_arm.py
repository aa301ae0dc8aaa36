"""The manipulated-length arm (exploratory): Experiment 1 BF16 on the same problems at other branch caps."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest

from kvreplay.experiments.arms import ARMS
from kvreplay.experiments.length_arm import EXP1_LENGTH, length_summary, length_table
from kvreplay.experiments.live_vs_prefill import EXP1
from kvreplay.ledger.records import validate_rows
from kvreplay.notebook.profiles import load_parameters

from conftest import TINY_CAPS, tiny_problems

TINY_ARM_DTYPE = "bfloat16"


def test_the_arm_is_planned_once_per_cap_and_the_caps_are_checked_in_the_profile():
    chain = types.SimpleNamespace(params=types.SimpleNamespace(length_branch_caps=(4, 16), n_rows=2, preflight=1),
                                  rows=tiny_problems)
    plans = EXP1_LENGTH.plans(chain)
    assert [dict(p.key) for p in plans] == [{"cap_branch": 4}, {"cap_branch": 16}]
    assert [p.problem_id for p in plans[0].problems] == ["tiny-00", "tiny-01"] and plans[0].preflight == 1
    with pytest.raises(ValueError, match="once per cap"):
        EXP1_LENGTH.prepare(chain)
    assert ARMS["exp1_length"] is EXP1_LENGTH and EXP1_LENGTH.row is EXP1.row and EXP1_LENGTH.dtypes == ("bfloat16",)
    assert load_parameters("smoke", {"length_branch_caps": [16]}).length_branch_caps == (16,)
    for bad, match in (([8], "the chain's own cap_branch"), ([16, 16], "listed twice"), ([0], ">= 1")):
        with pytest.raises(ValueError, match=match):
            load_parameters("smoke", {"length_branch_caps": bad})  # smoke's cap_branch is 8
    from kvreplay.paper.chain import notebook_arms

    name = "01_experiment1_live_vs_prefill.ipynb"
    assert "exp1_length-bfloat16" not in notebook_arms(name, load_parameters("smoke"))
    assert notebook_arms(name, load_parameters("smoke", {"length_branch_caps": [16]}))[-1] == "exp1_length-bfloat16"


def test_a_tiny_length_arm_passes_every_gate_decodes_at_its_cap_and_verifies(tmp_path, tiny_arm):
    problems = tiny_problems(3)
    settings = tiny_arm()
    longer = TINY_CAPS.branch * 2
    plan = EXP1_LENGTH.plan(problems, key={"cap_branch": longer}, preflight=1)
    assert plan.bind(settings).caps == dataclasses.replace(TINY_CAPS, branch=longer)
    records, ledger = plan.run(settings, ledger_root=tmp_path, progress=False)
    assert [r["gate_failure"] for r in records] == [None] * 3
    assert validate_rows("exp1_length", records) == records
    assert ledger.dir.name.startswith("exp1_length-bfloat16-")
    config = json.loads((ledger.dir / "manifest.json").read_text())["config"]
    assert config["cap_branch"] == longer and config["caps"]["branch"] == longer
    default, default_ledger = EXP1.run(settings, problems, ledger_root=tmp_path, progress=False)
    assert default_ledger.dir != ledger.dir
    # random weights rarely end a block early: the longer cap gives longer boundary prefixes
    assert all(r["prefix_len"] >= q["prefix_len"] for r, q in zip(records, default))
    assert any(r["prefix_len"] > q["prefix_len"] for r, q in zip(records, default))
    from kvreplay.verify import verify_ledger  # make verify rebinds the cap from the manifest: bit for bit

    checks = verify_ledger(ledger.dir, rows=2, pick="first", problems=problems, model=str(tmp_path / "tiny-llama"))
    assert [(c.mode, c.ok) for c in checks] == [("bytes", True)] * 2
    summary = length_summary(default, {longer: records}, TINY_CAPS.branch)
    assert list(summary) == [TINY_CAPS.branch, longer] and summary[longer]["n"] == 3
    assert summary[TINY_CAPS.branch]["mcnemar"] is None and summary[longer]["mcnemar"] is not None
    table = length_table(summary, TINY_CAPS.branch)
    assert list(table.columns) == [f"branch cap {TINY_CAPS.branch} (Experiment 1)", f"branch cap {longer}"]
    with pytest.raises(ValueError, match="the chain's own"):
        length_summary(default, {TINY_CAPS.branch: records}, TINY_CAPS.branch)
    with pytest.raises(ValueError, match="not the reference's problems"):
        length_summary(default, {longer: records[:2]}, TINY_CAPS.branch)


def _row(pid, differs, n, tie=False):
    return {"problem_id": pid, "gate_failure": None, "prefix_len": n,
            "endpoints": {"suffix_differs": differs, "tie_initiated": tie if differs else None}}


def test_the_summary_pairs_problems_and_counts_the_moved_stratum_on_hand_built_rows():
    ref = [_row("a", False, 100), _row("b", True, 100, tie=True), _row("c", False, 100), _row("d", False, 100)]
    at = [_row("a", True, 150, tie=True), _row("b", True, 150), _row("c", True, 100), _row("d", False, 100)]
    s = length_summary(ref, {96: at}, 48)
    assert (s[48]["suffix"].k, s[96]["suffix"].k, s[96]["tie"]) == (1, 3, 1)
    assert s[96]["moved"] == 2 and (s[96]["moved_suffix"].k, s[96]["moved_suffix"].n) == (2, 2)
    assert (s[96]["moved_reference"].k, s[96]["moved_reference"].n) == (1, 2)  # a and b moved; b parted at 48 too
    assert (s[96]["mcnemar"].b + s[96]["mcnemar"].c) == 2  # a and c part only at 96
    assert s[96]["prefix_len"] == (125.0, 100, 150)
    shorter = length_summary(ref, {24: [_row(x, False, 100) for x in "abcd"]}, 48)
    assert shorter[24]["moved"] == 0 and shorter[24]["moved_suffix"] is None
