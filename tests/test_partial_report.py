"""kvreplay.report.partial: endpoints of ledgers that stop at their last finished chunk."""

import json

import pytest
from kvreplay.report.partial import arm_rows, suffix_summary, main


def _row(pid, differs, tie, gate=None):
    return {"problem_id": pid, "gate_failure": gate,
            "endpoints": {"suffix_differs": differs, "tie_initiated": tie if differs else None, "boundary_exact": False}}


def _ledger(root, name, rows, wanted=None):
    """A ledger folder ``<arm>-<digest12>`` for ``name`` (``<arm>-<tag>``, the tag in its config); returns its name."""
    from kvreplay.ledger.store import Ledger

    arm, tag = name.rsplit("-", 1)
    ids = wanted or [r["problem_id"] for r in rows]
    ledger = Ledger(root, arm, {"problem_ids": ids, "tag": tag})
    (ledger.dir / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ledger.dir.name


def test_paired_rows_and_counts(tmp_path):
    _ledger(tmp_path, "exp1-bfloat16-aaaa", [_row("p1", True, True), _row("p2", True, False), _row("p3", False, None),
                                             _row("p4", True, True)])
    _ledger(tmp_path, "exp1-float32-bbbb", [_row("p1", False, None), _row("p2", False, None), _row("p3", True, False)])
    s = suffix_summary({d: arm_rows(tmp_path, "exp1", d)[1] for d in ("bfloat16", "float32")}).set_index(["rows", "precision"])
    assert s.loc[("all finished", "bfloat16"), "suffix_differs"].startswith("3/4 ")
    assert s.loc[("all finished", "bfloat16"), "tie_initiated"] == 2
    assert s.loc[("paired (both finished)", "bfloat16"), "suffix_differs"].startswith("2/3 ")
    assert s.loc[("paired (both finished)", "float32"), "suffix_differs"].startswith("1/3 ")
    assert s.loc[("paired (both finished)", "McNemar (exact)"), "suffix_differs"].startswith("BF16 only 2, FP32 only 1")


def test_gate_failures_are_counted_not_scored(tmp_path):
    _ledger(tmp_path, "exp1-bfloat16-aaaa", [_row("p1", True, True), _row("p2", False, None, gate="replica")])
    _ledger(tmp_path, "exp1-float32-bbbb", [_row("p1", False, None)])
    s = suffix_summary({d: arm_rows(tmp_path, "exp1", d)[1] for d in ("bfloat16", "float32")}).set_index(["rows", "precision"])
    assert s.loc[("all finished", "bfloat16"), "gate_failures"] == 1
    assert s.loc[("all finished", "bfloat16"), "suffix_differs"].startswith("1/1 ")


def test_missing_or_ambiguous_ledger(tmp_path):
    with pytest.raises(FileNotFoundError, match="exp1-bfloat16"):
        arm_rows(tmp_path, "exp1", "bfloat16")
    _ledger(tmp_path, "exp1-bfloat16-aaaa", [])
    _ledger(tmp_path, "exp1-bfloat16-cccc", [])
    with pytest.raises(ValueError, match="2 ledgers"):
        arm_rows(tmp_path, "exp1", "bfloat16")


def test_cli_counts_finished_rows_against_the_manifest_and_skips_a_cut_off_line(tmp_path, capsys):
    ids = ["p1", "p2", "p3", "p4", "p5"]
    bf16 = _ledger(tmp_path / "paper", "exp1-bfloat16-aaaa", [_row("p1", True, True), _row("p2", False, None)], wanted=ids)
    fp32 = _ledger(tmp_path / "paper", "exp1-float32-bbbb", [_row("p1", False, None)], wanted=ids)
    with open(tmp_path / "paper" / bf16 / "rows.jsonl", "a") as f:
        f.write('{"problem_id": "p3", "endpo')  # the time limit cut this row off mid-write
    assert main(["--ledger-root", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert f"{bf16}: 2 of 5 rows finished" in captured.err
    assert f"{fp32}: 1 of 5 rows finished" in captured.err
    assert "BF16 only 1, FP32 only 0" in out


def test_one_precision_only_has_no_pairing(tmp_path, capsys):
    ids = ["p1", "p2", "p3"]
    bf16 = _ledger(tmp_path / "paper", "exp2-bfloat16-aaaa", [_row("p1", True, True), _row("p2", False, None)], wanted=ids)
    s = suffix_summary({"bfloat16": arm_rows(tmp_path / "paper", "exp2", "bfloat16")[1]})
    assert list(s.rows) == ["all finished"] and s.suffix_differs[0].startswith("1/2 ")
    with pytest.raises(ValueError, match="neither"):
        suffix_summary({})
    assert main(["--ledger-root", str(tmp_path), "--experiments", "exp2"]) == 0
    captured = capsys.readouterr()
    assert "exp2-float32: not started" in captured.err and f"{bf16}: 2 of 3 rows finished" in captured.err
    assert "McNemar" not in captured.out


def test_an_unknown_profile_is_an_error_not_a_list_of_unstarted_arms(tmp_path, capsys):
    from kvreplay.report.partial import main

    (tmp_path / "paper").mkdir()
    assert main(["--profile", "paperr", "--ledger-root", str(tmp_path)]) == 2
    assert "profiles with ledgers: ['paper']" in capsys.readouterr().err


def test_an_arm_without_rows_or_manifest_is_not_started_and_errors_exit_without_a_traceback(tmp_path, capsys):
    """What a cut-off first call leaves (a manifest, no row), a folder with no manifest, two folders of one arm, an
    Experiment 5 manifest naming no checkpoint and a real gate failure: each a line naming it, never a traceback."""
    root = tmp_path / "paper"
    exp5 = _ledger(root, "exp5-bfloat16-aaaa", [], wanted=["p1", "p2"])  # the run was cut off in its first chunk
    (root / "exp3-bfloat16-bbbb").mkdir(parents=True)  # no manifest
    assert main(["--ledger-root", str(tmp_path), "--experiments", "exp3", "exp5"]) == 0
    captured = capsys.readouterr()
    assert "exp5-bfloat16: not started (no finished row)" in captured.err
    assert "exp3-bfloat16: not started (" in captured.err and "has no manifest.json" in captured.err
    assert captured.out == ""

    _ledger(root, "exp1-bfloat16-cccc", [_row("p1", True, True)])
    _ledger(root, "exp1-bfloat16-dddd", [_row("p1", True, True)])
    assert main(["--ledger-root", str(tmp_path), "--experiments", "exp1"]) == 2
    assert "error: 2 ledgers exp1-bfloat16-* under" in capsys.readouterr().err

    (root / exp5 / "rows.jsonl").write_text(json.dumps({"problem_id": "p1", "gate_failure": None}) + "\n")
    assert main(["--ledger-root", str(tmp_path), "--experiments", "exp5"]) == 1
    captured = capsys.readouterr()
    assert "error: exp5: " in captured.err and "names no replication checkpoint" in captured.err


def test_an_unfinished_one_arm_table_says_its_rows_are_the_first_not_a_sample(tmp_path, capsys, monkeypatch):
    import pandas as pd
    from kvreplay.report import partial

    root = tmp_path / "paper"
    exp3 = _ledger(root, "exp3-bfloat16-aaaa", [{"problem_id": "p1"}], wanted=["p1", "p2"])
    seen = []

    def table(experiment, rows, folder=None):  # the bridge table itself is tested with the experiment
        seen.append((experiment, [r["problem_id"] for r in rows], folder.name))
        return pd.DataFrame({"bridge (BF16)": ["1"]}, index=["rows"])

    monkeypatch.setattr(partial, "one_arm_table", table)
    assert main(["--ledger-root", str(tmp_path), "--experiments", "exp3"]) == 0
    out = capsys.readouterr().out
    assert seen == [("exp3", ["p1"], exp3)]
    assert out.startswith("## exp3: the incremental bridge (new live boundary vs its incremental rebuild)\n"
                          f"unfinished: {exp3}: 1 of 2 rows, the first in the frozen order (not a sample)")
