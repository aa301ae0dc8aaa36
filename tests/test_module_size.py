"""Small modules and short docstring sentences: no library module over 600 lines, no docstring sentence over 40 words.

The modules and docstrings listed below are over the limits today; each entry may only shrink, and an entry whose
module now fits must go (the lists are what is left to split and shorten, never a place to add to).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kvreplay.paths import ROOT

LIB = ROOT / "lib" / "kvreplay"
MAX_LINES = 600
MAX_WORDS = 40

OVER_600: dict[str, int] = {}
"""Module (under lib/kvreplay) -> its line count when this list was made: still to split by concept."""


def _modules() -> dict[str, Path]:
    return {p.relative_to(LIB).as_posix(): p for p in sorted(LIB.rglob("*.py")) if "__pycache__" not in p.parts}


def test_no_module_is_over_600_lines():
    lines = {name: len(p.read_text().splitlines()) for name, p in _modules().items()}
    over = {name: n for name, n in lines.items() if n > MAX_LINES and name not in OVER_600}
    assert not over, f"modules over {MAX_LINES} lines (split them by concept and re-export): {over}"
    grown = {name: (lines.get(name), cap) for name, cap in OVER_600.items() if lines.get(name, 0) > cap}
    assert not grown, f"listed modules that grew (module: (now, listed)): {grown}"
    fits = [name for name in OVER_600 if lines.get(name, 0) <= MAX_LINES]
    assert not fits, f"these modules now fit in {MAX_LINES} lines: take them out of OVER_600: {fits}"


def sentences(doc: str) -> list[str]:
    """A docstring's sentences: split at paragraph breaks, at ``Name:`` entries of its sections, and after ``.``,
    ``;``, ``?`` or ``!`` followed by a capital, a backquote or a parenthesis."""
    out = []
    for block in re.split(r"\n\s*\n|\n\s*(?=[\w, *]+:(?:\s|$))", doc):
        out += re.split(r"(?<=[.!?;])\s+(?=[A-Z(`*:\"])", re.sub(r"\s+", " ", block).strip())
    return [s for s in out if s]


def long_sentences() -> dict[str, int]:
    """Module -> how many of its docstring sentences are over :data:`MAX_WORDS` words."""
    out: dict[str, int] = {}
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node) or ""
                n = sum(len(s.split()) > MAX_WORDS for s in sentences(doc))
                if n:
                    out[name] = out.get(name, 0) + n
    return out


LONG_SENTENCES: dict[str, int] = {
    "__init__.py": 1, "adapt/__init__.py": 4, "bench.py": 4, "caches.py": 1, "decode.py": 2,
    "engine/__init__.py": 1, "engine/attention.py": 5, "engine/decoders.py": 3, "engine/step.py": 3,
    "experiments/bridge.py": 1, "experiments/controls.py": 1, "experiments/transplant.py": 1, "explorer.py": 1,
    "models.py": 1, "probe.py": 1, "problems.py": 2, "profiles.py": 1, "rebuild.py": 1,
    "report/cross_hardware.py": 1, "report/frames.py": 1, "runner/__init__.py": 1, "runner/actors.py": 2,
    "runner/batched.py": 2, "runner/loop.py": 2, "self_check.py": 2, "session.py": 1, "verify.py": 3
}
"""Module -> docstring sentences over 40 words when this list was made: still to shorten."""


def test_no_docstring_sentence_is_over_40_words():
    counts = long_sentences()
    over = {name: n for name, n in counts.items() if n > LONG_SENTENCES.get(name, 0)}
    assert not over, (f"docstring sentences over {MAX_WORDS} words (say it in fewer; keep shapes, dtypes, units, "
                      f"errors and the paper section): {over}")
    done = [name for name, n in LONG_SENTENCES.items() if counts.get(name, 0) < n]
    assert not done, f"shortened: lower or remove their LONG_SENTENCES entries: {done}"


def test_the_sentence_split_can_fail():
    doc = "Short one. Every " + " ".join(["word"] * 40) + ".\n\nArgs:\n    x: " + " ".join(["w"] * 10)
    assert [len(s.split()) for s in sentences(doc)] == [2, 41, 1, 11]
