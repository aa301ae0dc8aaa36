"""Function lengths and parameter counts of the library, over a threshold (the CI report of docs/ARCHITECTURE.md).

``python tests/function_sizes.py --report`` prints every function of ``lib/kvreplay`` longer than
:data:`MAX_LINES` code lines or taking more than :data:`MAX_PARAMS` parameters, and whether docs/ARCHITECTURE.md
lists it (section "Long functions", with its reason). It exits 1 when the two differ: a function over the
threshold and not listed, or a listed one no longer over it. ``tests/test_code_size.py`` runs the same check.

A function's length counts the lines from its ``def`` to its last line, its docstring left out (docstrings say
shapes, units and errors, and are not design). Its parameters are every argument but ``self`` and ``cls``
(``*args`` and ``**kwargs`` count one each). Nested functions are measured on their own and named
``outer.<locals>.inner``.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "lib" / "kvreplay"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
MAX_LINES = 60
"""Code lines a function may have (docstring left out) before the report lists it."""
MAX_PARAMS = 6
"""Parameters a function may take before the report lists it."""
_LISTED = re.compile(r"^\|\s*`(?P<name>[\w/.<>]+\.py:[\w.<>]+)`\s*\|")


@dataclass(frozen=True)
class Size:
    """One function's size: ``name`` is ``<path under lib/kvreplay>:<qualified name>``."""
    name: str
    lines: int
    params: int

    @property
    def over(self) -> bool:
        """Over either threshold."""
        return self.lines > MAX_LINES or self.params > MAX_PARAMS


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    n = len(names) - (1 if names[:1] in (["self"], ["cls"]) else 0)
    return n + (a.vararg is not None) + (a.kwarg is not None)


def _lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    total = (node.end_lineno or node.lineno) - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        total -= (first.end_lineno or first.lineno) - first.lineno + 1
    return total


def sizes(source: str, path: str) -> list[Size]:
    """Every function and method of one module's ``source``, named under ``path``."""
    out: list[Size] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append(Size(f"{path}:{prefix}{child.name}", _lines(child), _params(child)))
                walk(child, f"{prefix}{child.name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return out


def library_sizes(lib: Path = LIB) -> list[Size]:
    """Every function of the library (``lib/kvreplay/**/*.py``), in path order."""
    return [s for p in sorted(lib.rglob("*.py")) if "__pycache__" not in p.parts
            for s in sizes(p.read_text(encoding="utf-8"), p.relative_to(lib).as_posix())]


def listed(text: str) -> set[str]:
    """The functions a document's table rows name first, as ``| `path.py:name` | ...``."""
    return {m["name"] for line in text.splitlines() if (m := _LISTED.match(line))}


def differences(found: list[Size], names: set[str]) -> tuple[list[Size], list[str]]:
    """``(over the threshold and not listed, listed and not over it)``."""
    over = {s.name for s in found if s.over}
    return [s for s in found if s.over and s.name not in names], sorted(names - over)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", action="store_true", help="print every function over the threshold")
    args = ap.parse_args(argv)
    found, names = library_sizes(), listed(ARCHITECTURE.read_text(encoding="utf-8"))
    unlisted, stale = differences(found, names)
    if args.report:
        print(f"functions over {MAX_LINES} code lines or {MAX_PARAMS} parameters (lines, parameters, listed):")
        for s in found:
            if s.over:
                print(f"  {s.name}  {s.lines}  {s.params}  {'listed' if s.name in names else 'NOT LISTED'}")
    for s in unlisted:
        print(f"not listed in docs/ARCHITECTURE.md (Long functions): {s.name} ({s.lines} lines, {s.params} "
              "parameters): shorten it, or list it with its reason", file=sys.stderr)
    for name in stale:
        print(f"listed in docs/ARCHITECTURE.md but no longer over the threshold (or gone): {name}", file=sys.stderr)
    return 1 if unlisted or stale else 0


if __name__ == "__main__":
    sys.exit(main())
