"""Tests for kvreplay.analysis.scoring (paper §3.8 answer scoring)."""

from __future__ import annotations

import pytest
from kvreplay.analysis.scoring import Score, score_answer, score_multiple_choice, score_numeric

OPTIONS = ["London", "Paris", "Berlin", "Rome"]


@pytest.mark.parametrize(
    ("text", "predicted", "rule"),
    [
        # (1) boxed
        (r"\boxed{B}", "B", "boxed"),
        (r"So the answer is \boxed{\text{C}}", "C", "boxed"),
        (r"\boxed{(d)}", "D", "boxed"),
        # (2) explicit phrases
        ("The answer is B", "B", "answer_is"),
        ("The answer is B because Paris is the capital.", "B", "answer_is"),
        ("Answer: D) 42", "D", "answer_is"),
        ("I think the correct option is c.", "C", "answer_is"),
        ("**Answer:** C", "C", "answer_is"),
        ("the answer is **B**.", "B", "answer_is"),
        ("answer is [D]", "D", "answer_is"),
        ("Berlin is nice, but answer: (A)", "A", "answer_is"),
        ("Option D is correct.", "D", "answer_is"),
        ("Option A is wrong. The answer is C.", "C", "answer_is"),  # strong phrase first
        ("Answer: B\n\nQuestion: What is 2+2?\nAnswer: C", "B", "answer_is"),  # first wins
        # (3) leading letter
        ("B", "B", "leading_letter"),
        ("B. Paris", "B", "leading_letter"),
        ("B) Paris", "B", "leading_letter"),
        ("(C)", "C", "leading_letter"),
        ("**B**", "B", "leading_letter"),
        ("  c)  ", "C", "leading_letter"),
        ("A", "A", "leading_letter"),
        ("A.", "A", "leading_letter"),
        ("A: London", "A", "leading_letter"),
        ("A\nbecause London is big", "A", "leading_letter"),
        ("D Rome is the capital", "D", "leading_letter"),
        # (4) option text
        ("Paris", "B", "option_text"),
        ("I think it is rome.", "D", "option_text"),  # "I" is the pronoun, not option I
        ("The capital is   PARIS!", "B", "option_text"),
    ],
)
def test_multiple_choice_rules(text: str, predicted: str, rule: str) -> None:
    score = score_multiple_choice(text, "B", OPTIONS)
    assert score == Score(predicted, predicted == "B", rule)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "A cat is on the mat.",  # article, not option A
        "I think so.",  # pronoun
        "The answer is a city in Europe.",
        "E",  # out of range with four options
        "(F)",
        r"\boxed{G}",
        "The answer is H.",
        "Paris or London, hard to say.",  # two option texts: ambiguous
        "Parisian food",  # option text only as part of a word
        "B-cell lymphoma",
        "Because of reasons",
    ],
)
def test_multiple_choice_none(text: str) -> None:
    assert score_multiple_choice(text, "B", OPTIONS) == Score(None, False, "none")


def test_out_of_range_letter_falls_through_to_option_text() -> None:
    assert score_multiple_choice("The answer is E. Paris", "B", OPTIONS) == Score(
        "B", True, "option_text"
    )


def test_ten_options_allow_letters_up_to_j() -> None:
    options = [f"opt{i}" for i in range(10)]
    assert score_multiple_choice("The answer is J", "J", options) == Score("J", True, "answer_is")
    assert score_multiple_choice("(I)", "I", options) == Score("I", True, "leading_letter")
    assert score_multiple_choice("K", "J", options).rule == "none"


def test_gold_is_case_insensitive_and_incorrect_is_reported() -> None:
    assert score_multiple_choice("B", "b", OPTIONS).correct
    score = score_multiple_choice("The answer is C", "B", OPTIONS)
    assert score == Score("C", False, "answer_is")


@pytest.mark.parametrize("gold", ["E", "", "AB", "1"])
def test_invalid_gold_raises(gold: str) -> None:
    with pytest.raises(ValueError):
        score_multiple_choice("B", gold, OPTIONS)


def test_no_options_raises() -> None:
    with pytest.raises(ValueError):
        score_multiple_choice("B", "B", [])


@pytest.mark.parametrize(
    ("text", "gold", "predicted", "rule"),
    [
        ("1,000", "1000", "1000", "numeric"),
        ("The total is 1000.", "1,000", "1000", "numeric"),
        ("so it is 1/2", 0.5, "0.5", "numeric"),
        ("x = 0.5", "1/2", "0.5", "numeric"),
        (r"\boxed{1/2}", "0.5", "0.5", "boxed"),
        (r"\boxed{\frac{1}{2}}", 0.5, "0.5", "boxed"),
        (r"\boxed{\dfrac{-1}{3}}", "-1/3", "-0.3333333333333333", "boxed"),
        (r"we get \frac{3}{4}", 0.75, "0.75", "numeric"),
        ("50%", 50, "50", "numeric"),
        ("a rate of 50 %", "50%", "50", "numeric"),
        ("$1,234.50", "1234.5", "1234.5", "numeric"),
        (r"\boxed{x = -3}", -3, "-3", "boxed"),
        ("3-5 is -2", "-2", "-2", "numeric"),
        ("The answer is 42.", 42, "42", "numeric"),
        (r"First 7, then \boxed{12} and 99 more.", 12, "12", "boxed"),
        (r"\boxed{5 \text{ apples}}", "5", "5", "boxed"),
        (r"\boxed{} but really 7", "7", "7", "numeric"),  # empty box: last number
        ("0.1 + 0.2 = 0.30000001", 0.3, "0.30000001", "numeric"),  # within rel_tol
    ],
)
def test_numeric_correct(text: str, gold: str | float, predicted: str, rule: str) -> None:
    assert score_numeric(text, gold) == Score(predicted, True, rule)


def test_numeric_wrong_and_tolerance() -> None:
    assert score_numeric("x = 0.5", "0.6") == Score("0.5", False, "numeric")
    assert not score_numeric("0.3001", 0.3).correct  # outside rel_tol=1e-6
    assert not score_numeric("50%", 0.5).correct  # % is stripped, not divided


@pytest.mark.parametrize("text", ["no numbers here", r"\boxed{B}", "1/0", ""])
def test_numeric_none(text: str) -> None:
    assert score_numeric(text, 1) == Score(None, False, "none")


@pytest.mark.parametrize("gold", ["banana", float("nan"), float("inf")])
def test_numeric_invalid_gold_raises(gold: str | float) -> None:
    with pytest.raises(ValueError):
        score_numeric("1", gold)


def test_score_answer_dispatch() -> None:
    assert score_answer("B. Paris", "B", OPTIONS).rule == "leading_letter"
    assert score_answer(r"\boxed{2}", "2", None) == Score("2", True, "boxed")
    assert score_answer("it is 2", "2", []) == Score("2", True, "numeric")


def test_deterministic() -> None:
    text = "I believe the answer is (C), not B."
    assert score_multiple_choice(text, "C", OPTIONS) == score_multiple_choice(text, "C", OPTIONS)
