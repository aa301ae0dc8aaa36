"""kvreplay.report.partial: endpoints of ledgers that stop at their last finished chunk."""

import json

import pytest
from kvreplay.report.partial import arm_rows, exp1_summary


def _row(pid, differs, tie, gate=None):
    return {"problem_id": pid, "gate_failure": gate,
            "endpoints": {"suffix_differs": differs, "tie_initiated": tie if differs else None, "boundary_exact": False}}


def _ledger(root, name, rows):
    (root / name).mkdir(parents=True)
    (root / name / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_paired_rows_and_counts(tmp_path):
    _ledger(tmp_path, "exp1-bfloat16-aaaa", [_row("p1", True, True), _row("p2", True, False), _row("p3", False, None),
                                             _row("p4", True, True)])
    _ledger(tmp_path, "exp1-float32-bbbb", [_row("p1", False, None), _row("p2", False, None), _row("p3", True, False)])
    s = exp1_summary(tmp_path).set_index(["rows", "precision"])
    assert s.loc[("all finished", "bfloat16"), "suffix_differs"].startswith("3/4 ")
    assert s.loc[("all finished", "bfloat16"), "tie_initiated"] == 2
    assert s.loc[("paired (both finished)", "bfloat16"), "suffix_differs"].startswith("2/3 ")
    assert s.loc[("paired (both finished)", "float32"), "suffix_differs"].startswith("1/3 ")
    assert s.loc[("paired (both finished)", "McNemar (exact)"), "suffix_differs"].startswith("BF16 only 2, FP32 only 1")


def test_gate_failures_are_counted_not_scored(tmp_path):
    _ledger(tmp_path, "exp1-bfloat16-aaaa", [_row("p1", True, True), _row("p2", False, None, gate="replica")])
    _ledger(tmp_path, "exp1-float32-bbbb", [_row("p1", False, None)])
    s = exp1_summary(tmp_path).set_index(["rows", "precision"])
    assert s.loc[("all finished", "bfloat16"), "gate_failures"] == 1
    assert s.loc[("all finished", "bfloat16"), "suffix_differs"].startswith("1/1 ")


def test_missing_or_ambiguous_ledger(tmp_path):
    with pytest.raises(FileNotFoundError, match="exp1-bfloat16"):
        arm_rows(tmp_path, "exp1", "bfloat16")
    _ledger(tmp_path, "exp1-bfloat16-aaaa", [])
    _ledger(tmp_path, "exp1-bfloat16-cccc", [])
    with pytest.raises(ValueError, match="2 ledgers"):
        arm_rows(tmp_path, "exp1", "bfloat16")
