"""Deterministic answer matcher (paper §3.8 answer scoring).

One fixed, ordered set of extraction rules turns a decoder's free text into a
prediction and compares it with the gold answer. No model, no randomness, no
ML dependencies: pure Python and ``re``, so the same text always scores the
same way.

Multiple choice (:func:`score_multiple_choice`), first rule that fires wins:

1. ``boxed``          -- ``\\boxed{B}`` (also ``\\boxed{(B)}``, ``\\boxed{\\text{B}}``).
2. ``answer_is``      -- "answer is B", "answer: B", "correct option is B",
                         then (weaker) "option B"; the letter may be wrapped in
                         ``()``, ``[]`` or ``**``.
3. ``leading_letter`` -- the stripped text starts with a letter token:
                         "B", "B.", "B)", "(B)", "**B**".
4. ``option_text``    -- exactly one option's text (normalised) appears.
5. ``none``           -- nothing found: ``predicted=None``, ``correct=False``.

Within rules 1 and 2 the *first* occurrence wins: small models often commit to
an answer and then continue with an invented follow-up question and answer.

Numeric (:func:`score_numeric`): first ``\\boxed{...}`` whose content parses
(rule ``boxed``), else the last number in the text (rule ``numeric``).
"""

from __future__ import annotations

import math
import re
import string
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

__all__ = ["Score", "score_multiple_choice", "score_numeric", "score_answer"]


@dataclass(frozen=True)
class Score:
    """Outcome of matching one generated text against its gold answer.

    Attributes:
        predicted: Normalised prediction: an upper-case letter such as ``"B"``
            for multiple choice; for numeric answers the canonical string of
            the extracted value (see :func:`score_numeric`); ``None`` if no
            answer could be extracted.
        correct: Whether ``predicted`` equals the gold answer.
        rule: Name of the rule that produced ``predicted``: ``"boxed"``,
            ``"answer_is"``, ``"leading_letter"``, ``"option_text"``,
            ``"numeric"`` or ``"none"``.
    """
    predicted: str | None
    correct: bool
    rule: str


# --------------------------------------------------------------------------
# shared helpers

def _boxed_contents(text: str) -> list[str]:
    """Contents of every ``\\boxed{...}`` in ``text``, in order (nested braces kept)."""
    out: list[str] = []
    for m in re.finditer(r"\\boxed\s*\{", text):
        depth, start = 1, m.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    out.append(text[start:i])
                    break
    return out


# --------------------------------------------------------------------------
# multiple choice

def _letters(n_options: int) -> str:
    if not 1 <= n_options <= 26:
        raise ValueError(f"need between 1 and 26 options, got {n_options}")
    return string.ascii_uppercase[:n_options]


def _letter_pattern(letters: str) -> str:
    """Regex for one (possibly wrapped) option letter.

    Groups: ``open`` (wrapper before), ``L`` (the letter), ``close`` (wrapper
    after), ``ws`` (whitespace that follows an unwrapped letter, if that is
    what ends it).
    """
    cls = "[" + letters + letters.lower() + "]"
    return (
        r"(?P<open>\*\*|\(|\[)?\s*"
        rf"(?P<L>{cls})"
        r"(?![A-Za-z0-9])"  # a standalone letter, not the start of a word
        r"(?:\s*(?P<close>\*\*|\)|\]))?"
        r"(?=(?P<ws>[ \t]*\n|[ \t]+)?)"
    )


def _accept(m: re.Match[str], *, guard: str, strict_space: bool) -> bool:
    """Decide whether a letter match is a real option letter.

    ``guard``: letters that, unwrapped and followed on the same line by a
    word, read as English words and are rejected. ``strict_space``: if true,
    an unwrapped lower-case letter followed by a word is also rejected.
    """
    if m.group("open") or m.group("close"):
        return True
    ws = m.group("ws")
    rest = m.string[m.end() + len(ws or ""):]
    if not ws or "\n" in ws or not rest:
        return True  # followed by punctuation, a newline or end of text
    letter = m.group("L")
    if letter in guard:
        return False
    if strict_space and letter.islower():
        return False
    return True


def _letter_from_fragment(fragment: str, letters: str) -> str | None:
    """Letter that a short fragment (e.g. boxed content) consists of."""
    frag = re.sub(r"\\(?:text|textbf|mathrm|mathbf)\s*\{([^{}]*)\}", r"\1", fragment)
    frag = frag.strip().strip("$").strip()
    m = re.match(r"^[(\[*\s]*([A-Za-z])(?![A-Za-z0-9])", frag)
    if m and m.group(1).upper() in letters:
        return m.group(1).upper()
    return None


def _normalise_text(s: str) -> str:
    s = " ".join(s.casefold().split())
    return s.rstrip(string.punctuation + " ")


def score_multiple_choice(text: str, gold: str, options: Sequence[str]) -> Score:
    """Score a multiple-choice answer (paper §3.8 answer scoring).

    Args:
        text: Generated text (str, any length; may be empty).
        gold: Gold option letter (str, e.g. ``"B"``; case-insensitive).
        options: Option texts without letter prefixes, in order A, B, C, ...
            (1 to 26 of them; only letters within range count, e.g. ``"E"`` is
            not a valid answer with four options).

    Returns:
        A :class:`Score` whose ``predicted`` is an upper-case letter or ``None``.
        Rules are tried in the order listed in the module docstring.

    Raises:
        ValueError: If ``options`` is empty or has more than 26 entries, or
            ``gold`` is not a letter within range.
    """
    letters = _letters(len(options))
    gold_letter = gold.strip().upper()
    if len(gold_letter) != 1 or gold_letter not in letters:
        raise ValueError(f"gold {gold!r} is not one of the option letters {letters!r}")

    def result(letter: str | None, rule: str) -> Score:
        return Score(letter, letter == gold_letter, rule if letter else "none")

    # (1) \boxed{X}
    for content in _boxed_contents(text):
        letter = _letter_from_fragment(content, letters)
        if letter:
            return result(letter, "boxed")

    # (2) explicit phrases; strong phrases before the bare "option X"
    lp = _letter_pattern(letters)
    strong = re.compile(
        r"\b(?:answer\s*(?:is\s*:?|:)|correct\s+(?:option|choice)\s+is\s*:?)"
        r"[\s*]*" + lp,
        re.IGNORECASE,
    )
    weak = re.compile(r"\boption\s+" + lp, re.IGNORECASE)
    for pattern, guard in ((strong, "aAiI"), (weak, "iI")):
        for m in pattern.finditer(text):
            if _accept(m, guard=guard, strict_space=False):
                return result(m.group("L").upper(), "answer_is")

    # (3) leading letter
    stripped = text.strip()
    m = re.compile(r"^" + lp).match(stripped)
    if m and _accept(m, guard="aAiI", strict_space=True):
        after = stripped[m.end():m.end() + 1]
        # after an unwrapped letter only . ) : ] * whitespace or end may follow
        if m.group("close") or after in ("", ".", ")", ":", "]", "*", " ", "\t", "\n", "\r"):
            return result(m.group("L").upper(), "leading_letter")

    # (4) exactly one option's text appears
    norm = _normalise_text(text)
    hits = []
    for letter, option in zip(letters, options):
        opt = _normalise_text(option)
        if opt and re.search(r"(?<!\w)" + re.escape(opt) + r"(?!\w)", norm):
            hits.append(letter)
    if len(hits) == 1:
        return result(hits[0], "option_text")

    # (5) nothing
    return Score(None, False, "none")


# --------------------------------------------------------------------------
# numeric

_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_SIGN = r"-?"
_TOKEN = re.compile(
    rf"\\frac\s*\{{\s*(?P<fn>-?\s*(?:{_NUM}))\s*\}}\s*\{{\s*(?P<fd>-?\s*(?:{_NUM}))\s*\}}"
    rf"|(?<![\w.])(?P<n>{_SIGN}(?:{_NUM}))(?:\s*/\s*(?P<d>{_NUM}))?"
)


def _clean_numeric(s: str) -> str:
    """Normalise LaTeX and formatting noise ahead of number parsing."""
    s = s.replace("\u2212", "-")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\(?:left|right|!|,|;|:|\s)", "", s)
    s = s.replace("\\$", "").replace("\\%", "").replace("$", "").replace("%", "")
    return s


def _to_fraction(num: str, den: str | None = None) -> Fraction | None:
    try:
        value = Fraction(re.sub(r"[,\s]", "", num))
        if den is not None:
            value /= Fraction(re.sub(r"[,\s]", "", den))
    except (ValueError, ZeroDivisionError):
        return None
    return value


def _token_value(m: re.Match[str]) -> Fraction | None:
    if m.group("fn") is not None:
        return _to_fraction(m.group("fn"), m.group("fd"))
    return _to_fraction(m.group("n"), m.group("d"))


def _parse_final(s: str) -> Fraction | None:
    """Value of a final-answer fragment: whole-fragment parse, else its last number."""
    s = _clean_numeric(s)
    if "=" in s:
        s = s.rsplit("=", 1)[1]
    compact = re.sub(r"\s+", "", s)
    while len(compact) > 1 and (compact[0], compact[-1]) in (("{", "}"), ("(", ")")):
        compact = compact[1:-1]
    m = _TOKEN.fullmatch(compact)
    if m:
        return _token_value(m)
    tokens = list(_TOKEN.finditer(s))
    return _token_value(tokens[-1]) if tokens else None


def _canonical(value: Fraction) -> str:
    """Integer string if integral (``"1000"``), else ``repr`` of the float (``"0.5"``)."""
    if value.denominator == 1:
        return str(value.numerator)
    return repr(float(value))


def score_numeric(text: str, gold: str | float) -> Score:
    """Score a numeric answer (paper §3.8 answer scoring).

    The final answer is the content of the first ``\\boxed{...}`` that holds a
    number (rule ``"boxed"``; ``x = 0.5`` inside takes the right-hand side),
    else the last number in the text (rule ``"numeric"``). Thousands commas,
    ``$``, ``%`` and spaces are dropped (so ``"50%"`` equals ``50``, not
    ``0.5``); ``a/b`` and ``\\frac{a}{b}`` (also ``\\dfrac``, ``\\tfrac``) become
    their values. Values are compared with
    ``math.isclose(rel_tol=1e-6, abs_tol=1e-9)``.

    Args:
        text: Generated text (str).
        gold: Gold value, as a number or a string in any of the forms above
            (unitless; whatever units the problem bank uses).

    Returns:
        A :class:`Score`. ``predicted`` is canonical: the integer string for
        integral values (``"1000"``), else ``repr(float(value))`` (``"0.5"``
        for ``1/2``); ``None`` if no number was found.

    Raises:
        ValueError: If ``gold`` is not a finite number or has no numeric form.
    """
    if isinstance(gold, str):
        gold_value = _parse_final(gold)
        if gold_value is None:
            raise ValueError(f"gold {gold!r} has no numeric value")
        gold_float = float(gold_value)
    else:
        gold_float = float(gold)
    if not math.isfinite(gold_float):
        raise ValueError(f"gold {gold!r} is not a finite number")

    value: Fraction | None = None
    rule = "none"
    for content in _boxed_contents(text):
        value = _parse_final(content)
        if value is not None:
            rule = "boxed"
            break
    if value is None:
        tokens = list(_TOKEN.finditer(_clean_numeric(text)))
        for m in reversed(tokens):
            value = _token_value(m)
            if value is not None:
                rule = "numeric"
                break
    if value is None:
        return Score(None, False, "none")
    correct = math.isclose(float(value), gold_float, rel_tol=1e-6, abs_tol=1e-9)
    return Score(_canonical(value), correct, rule)


# --------------------------------------------------------------------------

def score_answer(text: str, gold: str, options: Sequence[str] | None) -> Score:
    """Score ``text`` against ``gold`` (paper §3.8 answer scoring).

    Args:
        text: Generated text (str).
        gold: Gold letter (multiple choice) or gold value as a string (numeric).
        options: Option texts in order A, B, ...; ``None`` or empty means the
            question is numeric.

    Returns:
        The :class:`Score` from :func:`score_multiple_choice` if options are
        given, else from :func:`score_numeric`.

    Raises:
        ValueError: As raised by the dispatched scorer (invalid gold).
    """
    if options:
        return score_multiple_choice(text, gold, options)
    return score_numeric(text, gold)
