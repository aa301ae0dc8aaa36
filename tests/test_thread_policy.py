"""Every entry point sets its own OpenMP thread policy before torch loads: ``python -m kvreplay.…`` and every notebook's
first imports (papermill kernels, the explorer), in a process whose environment does not set it.

OpenMP reads ``OMP_WAIT_POLICY`` once, when torch loads its runtime. ``OMP_DISPLAY_ENV=VERBOSE`` makes that runtime
print what it read: ``GOMP_SPINCOUNT = '0'`` under ``PASSIVE`` (idle threads sleep at once), a large count otherwise.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import subprocess
import sys

import pytest
from kvreplay.paths import NOTEBOOKS, ROOT

SLEEPS = "GOMP_SPINCOUNT = '0'"


def _environment() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    return env | {"OMP_DISPLAY_ENV": "VERBOSE"}


def _spin(args: list[str], cwd=ROOT) -> str:
    run = subprocess.run([sys.executable, *args], cwd=cwd, env=_environment(), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line.strip() for line in run.stderr.splitlines() if "GOMP_SPINCOUNT" in line]
    assert lines, f"{args}: torch's OpenMP runtime did not load (no OMP_DISPLAY_ENV output)"
    return lines[0]


def test_the_check_tells_the_policies_apart():
    assert _spin(["-c", "import torch"]) != SLEEPS  # unset: idle threads spin
    assert _spin(["-c", "import os; os.environ['OMP_WAIT_POLICY'] = 'PASSIVE'; import torch"]) == SLEEPS


@pytest.mark.parametrize("module", ["kvreplay.verify", "kvreplay.paper", "kvreplay.bench", "kvreplay.probe",
                                    "kvreplay.report.partial"])
def test_python_dash_m_sets_the_policy_before_torch(module):
    assert _spin(["-c", f"import runpy, sys; sys.argv = ['{module}', '--help']\ntry:\n    runpy.run_module("
                        f"'{module}', run_name='__main__')\nexcept SystemExit:\n    pass\nimport torch"]) == SLEEPS


def _ours(node: ast.stmt) -> bool:
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [getattr(node, "module", "") or ""]
    return any(n == "kvreplay" or n.startswith("kvreplay.") for n in names)


def _first_imports(notebook) -> str:
    """The imports that open the first code cell after a notebook's parameters cell, in their order, up to the first
    of this package, then ``import kvreplay``: any import from the package runs its ``__init__`` (which sets the
    policy) first, so only the imports before it could load an OpenMP runtime too early."""
    cells = [c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code"]
    after = next(i for i, c in enumerate(cells) if "parameters" in c["metadata"].get("tags", [])) + 1
    body = ast.parse("".join(cells[after]["source"])).body
    leading = list(itertools.takewhile(lambda node: isinstance(node, (ast.Import, ast.ImportFrom)), body))
    first = next(i for i, node in enumerate(leading) if _ours(node))
    return "\n".join([*(ast.unparse(node) for node in leading[:first]), "import kvreplay"])


@pytest.mark.parametrize("notebook", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_every_notebook_kernel_sets_the_policy_before_torch(notebook):
    code = _first_imports(NOTEBOOKS / notebook)
    assert "import" in code, code[:200]
    assert _spin(["-c", code + "\nimport torch"], cwd=NOTEBOOKS) == SLEEPS, notebook
