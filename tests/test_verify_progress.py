"""`make verify` says at once what it will do, then prints each row as it is recomputed (not all at the end)."""

from __future__ import annotations


def test_verify_prints_its_plan_first_and_each_row_as_it_is_done(monkeypatch, capsys):
    from kvreplay import verify

    seen_before_row = []

    def fake(folder, rows, *, pick, report=None, **kw):
        seen_before_row.append(capsys.readouterr().out)  # what the terminal shows before this ledger's row
        check = verify.RowCheck(folder.name, "mmlu-x", "bytes", True, None, "byte-identical")
        report(check)
        return [check]

    monkeypatch.setattr(verify, "verify_ledger", fake)
    assert verify.main(["--profile", "cpu", "--only", "exp1-bfloat16", "exp3"]) == 0
    out = capsys.readouterr().out
    assert seen_before_row[0].startswith("make verify: recomputing 1 committed row(s) (shortest) of each of 2 ledgers "
                                         "of profile cpu (exp1-bfloat16-")
    assert seen_before_row[1].startswith("OK   bytes    exp1-bfloat16-")  # the first row, printed before the second
    assert out.splitlines()[-1].startswith("2 of 2 recomputed rows match byte for byte (")
