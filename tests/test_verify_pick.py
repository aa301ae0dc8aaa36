"""`make verify` on rows a reviewer chooses: drawn at random by a seed (`--pick random --seed N`), or named (`--ids`).

Row choice reads the committed ledgers only; the recomputation itself is stubbed here (the golden-row test
recomputes real rows).
"""

from __future__ import annotations

import json

import pytest
from kvreplay import verify
from kvreplay.ledger.store import read_rows_text, row_lines
from kvreplay.paths import LEDGERS


def _ledger(prefix: str, profile: str = "cpu"):
    (folder,) = sorted((LEDGERS / profile).glob(f"{prefix}-*"))
    return folder


def _ids(folder) -> list[str]:
    return [json.loads(x)["problem_id"] for x in row_lines(read_rows_text(folder))]


def test_a_random_pick_is_drawn_by_its_seed_from_the_ledger():
    folder = _ledger("exp1-bfloat16")
    first = verify.choose_rows(folder, 3, pick="random", seed=7)
    assert first == verify.choose_rows(folder, 3, pick="random", seed=7)  # reproducible
    assert len(set(first)) == 3 and all(0 <= i < len(_ids(folder)) for i in first)
    draws = {tuple(verify.choose_rows(folder, 3, pick="random", seed=s)) for s in range(6)}
    assert len(draws) > 1  # the seed decides the draw
    other = _ledger("exp1-float32")  # the ledger's name enters the draw, so ledgers do not share row numbers
    assert any(verify.choose_rows(folder, 3, pick="random", seed=s) != verify.choose_rows(other, 3, pick="random", seed=s)
               for s in range(6))
    assert verify.choose_rows(folder, 999, pick="random", seed=1) == list(range(len(_ids(folder))))
    with pytest.raises(ValueError, match="needs a seed"):
        verify.choose_rows(folder, 1, pick="random")
    with pytest.raises(ValueError, match="pick must be one of"):
        verify.choose_rows(folder, 1, pick="slowest")


def test_rows_named_by_id_are_taken_in_the_order_given_and_an_unknown_id_names_the_ledger():
    folder = _ledger("exp1-bfloat16")
    ids = _ids(folder)
    assert verify.choose_rows(folder, 1, ids=[ids[5], ids[2]]) == [5, 2]
    with pytest.raises(ValueError, match=rf"ledger {folder} holds no row mmlu-nope"):
        verify.choose_rows(folder, ids=[ids[0], "mmlu-nope"])


def test_ids_are_looked_up_across_the_profile(monkeypatch):
    exp1, exp4 = _ledger("exp1-bfloat16"), _ledger("exp4-bfloat16")
    panel = _ids(exp4)[0]
    only_exp1 = next(i for i in _ids(exp1) if i not in _ids(exp4))
    assert verify.ids_by_ledger([exp1, exp4], [only_exp1, panel]) == {exp1: [only_exp1, panel], exp4: [panel]}
    with pytest.raises(ValueError, match=r"no row mmlu-nope in ledger\(s\) .*exp1-bfloat16-.*exp4-bfloat16-"):
        verify.ids_by_ledger([exp1, exp4], [panel, "mmlu-nope"])


def test_the_command_passes_the_choice_on_and_refuses_bad_ones_before_any_model(monkeypatch, capsys):
    calls = []

    def fake(folder, rows, *, pick, report=None, seed=None, ids=None, **kw):
        calls.append((folder.name.rsplit("-", 1)[0], rows, pick, seed, ids))
        return [verify.RowCheck(folder.name, (ids or ["mmlu-x"])[0], "bytes", True, None, "byte-identical")]

    monkeypatch.setattr(verify, "verify_ledger", fake)
    assert verify.main(["--profile", "cpu", "--only", "exp1-bfloat16", "--rows", "2", "--pick", "random", "--seed", "3"]) == 0
    assert calls == [("exp1-bfloat16", 2, "random", 3, None)]
    assert "2 committed row(s) (random, seed 3)" in capsys.readouterr().out
    calls.clear()
    panel = _ids(_ledger("exp4-bfloat16"))[0]
    assert verify.main(["--profile", "cpu", "--only", "exp1-bfloat16", "exp4", "--ids", panel]) == 0
    assert calls == [("exp1-bfloat16", 1, "shortest", None, [panel]), ("exp4-bfloat16", 1, "shortest", None, [panel])]
    calls.clear()
    assert verify.main(["--profile", "cpu", "--only", "exp1-bfloat16", "--ids", "mmlu-nope"]) == 2
    err = capsys.readouterr().err
    assert "no row mmlu-nope in ledger(s)" in err and "exp1-bfloat16-" in err and not calls
    for bad in (["--pick", "random"], ["--seed", "3"], ["--ids", panel, "--pick", "first"]):
        with pytest.raises(SystemExit) as stop:
            verify.main(["--profile", "cpu", *bad])
        assert stop.value.code == 2
    assert not calls
