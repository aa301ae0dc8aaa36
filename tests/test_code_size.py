"""Short functions and short docstring sentences.

Every library function over 60 code lines or 6 parameters is listed in docs/ARCHITECTURE.md with its reason
(``python tests/function_sizes.py --report``), and no docstring sentence is over 40 words.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

from kvreplay.paths import ROOT

LIB = ROOT / "lib" / "kvreplay"
MAX_WORDS = 40


def _modules() -> dict[str, Path]:
    return {p.relative_to(LIB).as_posix(): p for p in sorted(LIB.rglob("*.py")) if "__pycache__" not in p.parts}


def _function_sizes():
    spec = importlib.util.spec_from_file_location("function_sizes", ROOT / "tests" / "function_sizes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("function_sizes", module)  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_every_long_function_is_listed_with_its_reason_and_only_those():
    sizes = _function_sizes()
    unlisted, stale = sizes.differences(sizes.library_sizes(), sizes.listed(sizes.ARCHITECTURE.read_text()))
    assert not unlisted, ("functions over the threshold and not listed in docs/ARCHITECTURE.md (Long functions); "
                          f"shorten them, or list each with its reason: {[s.name for s in unlisted]}")
    assert not stale, f"listed in docs/ARCHITECTURE.md but no longer over the threshold: {stale}"
    assert sizes.main([]) == 0


def test_the_function_size_check_can_fail():
    sizes = _function_sizes()
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    src = f'def long():\n    """Doc\n    string."""\n{body}\n\n\ndef wide(self, a, b, c, d, e, f, *g):\n    pass\n' \
          f"\n\nclass C:\n    def m(self, a, b, c, d, e, f):\n        def inner(a, b, c, d, e, f, g):\n            pass\n"
    found = {s.name: (s.lines, s.params, s.over) for s in sizes.sizes(src, "toy.py")}
    assert found == {"toy.py:long": (62, 0, True), "toy.py:wide": (2, 7, True), "toy.py:C.m": (3, 6, False),
                     "toy.py:C.m.<locals>.inner": (2, 7, True)}
    listed = sizes.listed("| `toy.py:long` | a reason |\n| `toy.py:gone` | another |\n")
    unlisted, stale = sizes.differences(sizes.sizes(src, "toy.py"), listed)
    assert [s.name for s in unlisted] == ["toy.py:wide", "toy.py:C.m.<locals>.inner"] and stale == ["toy.py:gone"]


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
