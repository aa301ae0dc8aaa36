"""Small modules and short docstring sentences: no library module over 600 lines, no docstring sentence over 40 words."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kvreplay.paths import ROOT

LIB = ROOT / "lib" / "kvreplay"
MAX_LINES = 600
MAX_WORDS = 40


def _modules() -> dict[str, Path]:
    return {p.relative_to(LIB).as_posix(): p for p in sorted(LIB.rglob("*.py")) if "__pycache__" not in p.parts}


def test_no_module_is_over_600_lines():
    lines = {name: len(p.read_text().splitlines()) for name, p in _modules().items()}
    over = {name: n for name, n in lines.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them by concept and re-export): {over}"


def sentences(doc: str) -> list[str]:
    """A docstring's sentences: split at paragraph breaks, at ``Name:`` entries of its sections, and after ``.``,
    ``;``, ``?`` or ``!`` followed by a capital, a backquote or a parenthesis."""
    out = []
    for block in re.split(r"\n\s*\n|\n\s*(?=[\w, *]+:(?:\s|$))", doc):
        out += re.split(r"(?<=[.!?;])\s+(?=[A-Z(`*:\"])", re.sub(r"\s+", " ", block).strip())
    return [s for s in out if s]


def long_sentences() -> list[str]:
    """Every docstring sentence over :data:`MAX_WORDS` words, as ``file:line (N words): first words ...``."""
    out = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node)
                if doc is None:
                    continue
                line = node.body[0].lineno  # the docstring's first line
                for s in sentences(doc):
                    words = s.split()
                    if len(words) > MAX_WORDS:
                        out.append(f"lib/kvreplay/{name}:{line} ({len(words)} words): {' '.join(words[:8])} ...")
    return out


def test_no_docstring_sentence_is_over_40_words():
    long = long_sentences()
    assert not long, (f"docstring sentences over {MAX_WORDS} words (say it in fewer; keep shapes, dtypes, units, "
                      f"errors and the paper section):\n" + "\n".join(long))


def test_the_sentence_split_can_fail():
    doc = "Short one. Every " + " ".join(["word"] * 40) + ".\n\nArgs:\n    x: " + " ".join(["w"] * 10)
    assert [len(s.split()) for s in sentences(doc)] == [2, 41, 1, 11]
