"""The recipe search of notebook 00 (kvreplay.adapt.selection, letter balance in kvreplay.adapt.training): balanced
training rows, the held-out selection set and its disjointness, the fixed choice rule, and reuse of finished recipes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import TINY_FORMAT, tiny_lm, tracked
from kvreplay import adapt
from kvreplay.data.bank import select_bank
from kvreplay.data.problems import Problem, load_bank

LETTERS = "ABCD"


def _problems(n: int, prefix: str = "src", answers: str = "DDAB") -> list[Problem]:
    return [Problem(problem_id=f"{prefix}-{i:03d}", source="test", source_line=i + 1, question=f"{prefix} question {i}?",
                    options=(f"o{i}a", f"o{i}b", f"o{i}c", f"o{i}d"), answer=answers[i % len(answers)])
            for i in range(n)]


def _gold_text(p: Problem) -> str:
    return p.options[p.letters.index(p.answer)]


# ----------------------------------------------------------------------------- letter balance


def test_balanced_rows_cycle_the_gold_letters_and_change_only_the_option_order():
    rows = _problems(10)
    out = adapt.balance_letters(rows)
    assert [p.answer for p in out] == [LETTERS[i % 4] for i in range(10)]
    for old, new in zip(rows, out):
        assert (new.problem_id, new.question, new.source, new.source_line) == \
            (old.problem_id, old.question, old.source, old.source_line)
        assert _gold_text(new) == _gold_text(old)  # the same option is right, at another letter
        k = new.options.index(old.options[0])  # a rotation: the options' cyclic order is kept
        assert new.options == old.options[-k:] + old.options[:-k] if k else new.options == old.options
    assert adapt.balance_letters(out) == out  # balanced rows stay as they are
    with pytest.raises(ValueError, match="same number of options"):
        adapt.balance_letters([rows[0], dataclasses.replace(rows[1], options=("a", "b", "c"), answer="A")])


def test_letter_balance_is_part_of_the_config_digest_and_leaves_unbalanced_configs_as_they_were():
    from kvreplay.ledger.store import config_digest

    cfg = adapt.AdaptConfig(name="t", fmt=TINY_FORMAT, n_train=4, n_heldout=2, steps=4, checkpoints=(2, 4))
    plain = cfg.config({"model": "x"}, {})
    balanced = dataclasses.replace(cfg, letter_balanced=True).config({"model": "x"}, {})
    assert "letter_balanced" not in plain and plain["construction"] == adapt.CONSTRUCTION  # the digest it always had
    assert balanced["construction"] == adapt.CONSTRUCTION_BALANCED and balanced["letter_balance"] == adapt.BALANCE_RULE
    assert config_digest(plain) != config_digest(balanced)
    rows = _problems(8)
    assert adapt.training_rows(cfg, rows) == rows
    assert [p.answer for p in adapt.training_rows(dataclasses.replace(cfg, letter_balanced=True), rows)] == list("ABCDABCD")


# ----------------------------------------------------------------------------- the held-out selection set


def test_the_heldout_set_continues_the_banks_order_and_is_disjoint_from_it():
    source = _problems(40)
    bank = select_bank(source, 10)
    held = adapt.heldout_rows(source, bank, 12)
    order = select_bank(source, 40)
    assert [p.problem_id for p in held] == [p.problem_id for p in order[10:22]]
    adapt.assert_heldout_disjoint(held, bank=bank)
    # a later row with a bank row's question text (another ID) is skipped, outcome-blind
    twin = dataclasses.replace(order[10], question=bank[3].question.upper())
    source2 = [twin if p.problem_id == twin.problem_id else p for p in source]
    held2 = adapt.heldout_rows(source2, bank, 12)
    assert twin.problem_id not in {p.problem_id for p in held2} and len(held2) == 12
    answers = [dataclasses.replace(p, answer="A") for p in reversed(source)]  # answers and input order change nothing
    assert [p.problem_id for p in adapt.heldout_rows(answers, bank, 12)] == [p.problem_id for p in held]
    with pytest.raises(ValueError, match="fewer than the 31 held-out rows"):
        adapt.heldout_rows(source, bank, 31)
    with pytest.raises(ValueError, match="not the first rows of its source's frozen selection order"):
        adapt.heldout_rows(source, order[1:11], 5)


def test_a_planted_overlap_with_the_bank_or_the_panel_is_refused():
    source = _problems(30)
    bank = select_bank(source, 10)
    held = adapt.heldout_rows(source, bank, 8)
    with pytest.raises(ValueError, match=r"overlaps Experiment 5's frozen panel: \['src-"):
        adapt.assert_heldout_disjoint(held, **{"Experiment 5's frozen panel": [held[2].problem_id]})  # by problem ID
    renamed = dataclasses.replace(held[5], problem_id="other-1", question="  " + held[5].question.upper())
    with pytest.raises(ValueError, match="overlaps the bank"):
        adapt.assert_heldout_disjoint(held, **{"the bank": [*bank, renamed]})  # by question text
    with pytest.raises(ValueError, match="overlaps the MMLU bank"):  # and the search checks before anything is loaded
        adapt.search_recipes([adapt.AdaptConfig(name="a", fmt=TINY_FORMAT)], adapt.Criterion(8, 0.6), "/nonexistent",
                             bank=[*bank, held[0]], heldout=held, model="tiny", fmt=TINY_FORMAT, profile="t",
                             ledger_root="/nonexistent", loader=lambda: None)


def test_the_mmlu_heldout_set_is_outside_the_bank_and_every_committed_experiment5_panel():
    rows, _ = adapt.load_source("mmlu")
    bank = load_bank()
    held = adapt.heldout_rows(rows, bank, 100)
    assert len(held) == 100 and all(p.source == "mmlu" for p in held)
    panels = {f.parent.name: [e["problem_id"] for e in json.loads(f.read_text())["panel"]]
              for f in tracked("data/ledgers/*/exp5_panel.json")}
    assert panels
    adapt.assert_heldout_disjoint(held, bank=bank, **{f"the {k} panel": v for k, v in panels.items()})


# ----------------------------------------------------------------------------- the rule


def _try(name: str, correct: int, letters: dict[str, int]) -> adapt.Try:
    return adapt.Try(name, correct, sum(letters.values()), {L: letters.get(L, 0) for L in LETTERS})


CK0 = _try("ckpt0", 25, {"D": 90, "A": 10})
RULE = adapt.Criterion(100, 0.6)


@pytest.mark.parametrize("tries, chosen, met", [
    # two meet it: the more accurate; a collapsed, more accurate one does not meet it
    ([_try("a", 26, {"A": 50, "B": 50}), _try("b", 40, {"A": 95, "B": 5}), _try("c", 30, {"A": 60, "C": 40})], 2, True),
    # a tie in accuracy among those that meet it: the one listed first
    ([_try("a", 20, {"A": 50, "B": 50}), _try("b", 30, {"A": 55, "B": 45}), _try("c", 30, {"A": 40, "B": 60})], 1, True),
    # exactly checkpoint 0's accuracy and exactly the largest share meet it
    ([_try("a", 25, {"A": 60, "B": 40})], 0, True),
    # none meets it: among those at least as accurate as checkpoint 0, the lowest max-letter share
    ([_try("a", 24, {"A": 50, "B": 50}), _try("b", 35, {"A": 90, "B": 10}), _try("c", 27, {"A": 70, "B": 30})], 2, False),
    # none is as accurate as checkpoint 0: the most accurate (ties: the lower max-letter share)
    ([_try("a", 20, {"A": 50, "B": 50}), _try("b", 22, {"A": 90, "B": 10}), _try("c", 22, {"A": 70, "B": 30})], 2, False),
])
def test_the_rule_chooses_as_declared(tries, chosen, met):
    assert adapt.choose(tries, CK0, RULE) == (chosen, met)
    assert [t.meets(RULE, CK0) for t in tries].count(True) >= int(met)


def test_a_try_counts_letters_from_ledger_rows():
    rows = [{"problem_id": f"p{i}", "gold": "A", "gate_failure": None,
             "checkpoints": {"x": {"logits": dict.fromkeys(LETTERS, 0.0), "predicted": p, "correct": p == "A"}}}
            for i, p in enumerate("AABC")]
    t = adapt.letter_try(rows, "x")
    assert (t.correct, t.n, t.letters, t.max_share, t.top_letter) == (2, 4, {"A": 2, "B": 1, "C": 1, "D": 0}, 0.5, "A")
    assert t.accuracy.k == 2 and _try("t", 1, {"B": 2, "A": 2}).top_letter == "A"  # ties: the earlier letter
    with pytest.raises(ValueError, match="no recipe"):
        adapt.choose([], CK0, RULE)


# ----------------------------------------------------------------------------- the search


BASE = adapt.AdaptConfig(name="a", model="tiny", fmt=TINY_FORMAT, n_train=4, n_heldout=2, steps=4, checkpoints=(2, 4),
                         eval_every=2, threads=1)


def test_the_search_trains_each_recipe_once_scores_it_on_the_heldout_set_and_reuses_it(tmp_path, monkeypatch):
    source = _problems(12, "obqa")
    mmlu = _problems(16, "mmlu", answers="ABCD")
    bank = select_bank(mmlu, 6)
    held = adapt.heldout_rows(mmlu, bank, 5)
    recipes = [BASE, dataclasses.replace(BASE, name="a-balanced", letter_balanced=True)]
    trained, loads = [], []
    real = adapt.checkpoints.train_role_table
    monkeypatch.setattr(adapt.checkpoints, "train_role_table",
                        lambda cfg, *a, **k: trained.append(cfg.name) or real(cfg, *a, **k))
    lm = tiny_lm("llama", torch.float32)

    def loader():
        loads.append(1)
        return lm

    kw = dict(bank=bank, heldout=held, model="tiny", fmt=TINY_FORMAT, profile="t", ledger_root=tmp_path / "ledgers",
              problems=source, base_key={"model": "tiny-llama"}, progress=False)
    s = adapt.search_recipes(recipes, adapt.Criterion(5, 0.6), tmp_path / "ck", loader=loader, **kw)
    assert trained == ["a", "a-balanced"] and len({f.name for f in s.folders}) == 2
    assert s.manifests[1]["config"]["construction"] == adapt.CONSTRUCTION_BALANCED
    assert all(m["config"]["trainable_rows"] == list(range(8, 14)) for m in s.manifests)
    assert [r["problem_id"] for r in s.records] == [p.problem_id for p in held]
    assert set(s.records[0]["checkpoints"]) == {"ckpt0", "a", "a-balanced"}
    assert s.ledger.config["problem_set"] == adapt.HELDOUT_SET
    assert (s.chosen, s.met) == adapt.choose(s.tries, s.ckpt0, s.criterion) and s.folder == s.folders[s.chosen]
    table = s.table()
    assert list(table.index) == ["ckpt0", "a", "a-balanced"] and list(table["chosen"]).count("chosen") == 1
    assert table.loc["ckpt0", "meets criterion"] == "reference"

    def no_load():
        raise AssertionError("a finished search must not load the model")

    again = adapt.search_recipes(recipes, adapt.Criterion(5, 0.6), tmp_path / "ck", loader=no_load, **kw)
    assert trained == ["a", "a-balanced"] and again.records == s.records and again.folders == s.folders
    # a recipe added later trains alone; the finished ones are reused
    more = [*recipes, dataclasses.replace(BASE, name="b", lr=0.01)]
    third = adapt.search_recipes(more, adapt.Criterion(5, 0.6), tmp_path / "ck", loader=loader, **kw)
    assert trained == ["a", "a-balanced", "b"] and third.folders[:2] == s.folders
    with pytest.raises(ValueError, match="unique"):
        adapt.search_recipes([BASE, BASE], adapt.Criterion(5, 0.6), tmp_path / "ck", loader=no_load, **kw)
    with pytest.raises(ValueError, match="the criterion declares 4"):
        adapt.search_recipes(recipes, adapt.Criterion(4, 0.6), tmp_path / "ck", loader=no_load, **kw)
