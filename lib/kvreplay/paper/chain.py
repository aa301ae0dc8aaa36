"""The notebook chain ``make paper`` runs (:data:`CHAIN`), what each notebook computes, and whether it is up to date.

:func:`notebook_arms` and :func:`unfinished_arms` name the arms a notebook computes; :func:`inputs_digest` is the
sha256 a notebook is skipped on while unchanged; :func:`run_inprocess` runs its code cells without Jupyter.
Re-exported by :mod:`kvreplay.paper`.
"""

from __future__ import annotations

import ast
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ..adapt import read_pointer
from ..arm_facts import DerivedList, chain_notebooks, facts, notebook_labels
from ..ledger.files import read_manifest
from ..ledger.lookup import ledger_progress
from ..ledger.store import canonical_json, library_digest
from ..paths import LEDGERS, NOTEBOOKS
from ..notebook.profiles import ChainParameters


EXECUTED_PROFILES = ("cpu", "gpu", "paper", "gemma")
"""Profiles whose executed notebooks ``make paper`` writes to :data:`EXECUTED` and whose results pages go to
``docs/`` (those with committed ledgers; ``gemma``'s are computed on a GPU, docs/gpu.md)."""

RUN_PARAMETERS = {"interactive": False}
"""Parameters every headless run passes (to the notebooks that declare them): no widgets in executed copies."""

CHAIN: Sequence[str] = DerivedList(chain_notebooks)
"""Notebooks in dependency order (the checkpoint family, experiments, then tables, then figures), derived from
:data:`kvreplay.arm_facts.ARM_FACTS` (:func:`~kvreplay.arm_facts.chain_notebooks`)."""


def notebook_arms(name: str, params: ChainParameters) -> list[str]:
    """The ledger arms (``<experiment>-<dtype>``) notebook ``name`` reads or, where they are unfinished, computes.

    Derived from :data:`kvreplay.arm_facts.ARM_FACTS` (:func:`~kvreplay.arm_facts.notebook_labels`). First each arm
    the notebook computes, after the upstream ledgers it reads, at the precisions of ``params`` it runs at. An arm
    is left out unless the parameter that enables it is set (``exploratory_controls``, ``tie_rules``). Then the
    arms whose finished ledgers it reads (06 and 07: all but the tie-rule control; 08: Experiments 1 and 2).
    Notebook 00 (the checkpoint family) is not a ledger arm: ``[]``.
    """
    return notebook_labels(name, params.precisions, lambda parameter: getattr(params, parameter))


def unfinished_arms(chain: list[str], params: ChainParameters, ledgers: Path) -> list[str]:
    """For a profile computed elsewhere (one whose file lists ``done:``), every arm the notebooks of ``chain`` need
    that its ledgers under ``ledgers`` do not hold in full, as ``"<notebook>: <arm> (k of n rows)"`` or
    ``"... (not started)"`` (the tie-rule control per rule: ``exp1_ties-bfloat16 (highest)``). Run on such a
    profile, ``make paper`` would compute those rows on this machine (hours on a CPU for the ``paper`` caps), so :func:`main` refuses before any notebook runs. Notebook 00 is
    always listed: such a profile reads the checkpoint family its ``role_adaptation.json`` names (the ``cpu``
    profile's), and 00 would train another one here and point the profile's Experiment 5 at it."""
    out = []
    for name in chain:
        if name.startswith("00"):
            out.append(f"{name}: trains a checkpoint family; this profile reads the one its "
                       f"{ledgers / 'role_adaptation.json'} names (train it under the `cpu` profile)")
            continue
        for arm in notebook_arms(name, params):
            folders = sorted(ledgers.glob(f"{arm}-*/manifest.json"))
            groups = {arm: folders}
            declared = facts(arm.rsplit("-", 1)[0])
            if declared.variants and declared.variant_key:  # one ledger per variant (tie rule, branch cap)
                groups = {f"{arm} ({v})": [f for f in folders if read_manifest(f.parent)["config"].get(
                    declared.variant_key) == v] for v in getattr(params, declared.variants)}
            for label, found in groups.items():
                progress = [ledger_progress(f.parent) for f in found]
                if not any(done == wanted for done, wanted in progress):
                    held = ", ".join(f"{done} of {wanted} rows" for done, wanted in progress) or "not started"
                    out.append(f"{name}: {label} ({held})")
    return out


def declared_parameters(name: str, params: dict) -> dict:
    """The subset of ``params`` that the notebook's ``parameters`` cell declares (no unknown-parameter noise): every
    notebook declares ``profile`` and ``overrides``; :data:`RUN_PARAMETERS` go only to the notebooks that declare them."""
    import papermill as pm

    declared = pm.inspect_notebook(str(NOTEBOOKS / name))
    return {k: v for k, v in params.items() if k in declared}


def assigned_names(src: str) -> set[str]:
    """The names a cell's top-level ``name = ...`` statements assign: a ``parameters`` cell's declared parameters,
    as papermill sees them."""
    return {t.id for node in ast.parse(src).body if isinstance(node, ast.Assign) for t in node.targets
            if isinstance(t, ast.Name)}


def code_cells(path: Path) -> list[tuple[list[str], str]]:
    """``(tags, source)`` of every code cell of a notebook file (read as JSON, no Jupyter needed)."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    out = []
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            src = c["source"] if isinstance(c["source"], str) else "".join(c["source"])
            out.append((c.get("metadata", {}).get("tags", []), src))
    return out


def run_inprocess(path: Path, params: dict) -> None:
    """Execute a notebook's code cells in one fresh namespace of this process, parameters injected as papermill would.

    The names assigned in the cell tagged ``parameters`` are the declared
    parameters; values of ``params`` for those names are assigned right after
    it. Cells run with the notebook's folder as working directory.

    Raises:
        RuntimeError: naming the notebook and the failing cell (1-based among code cells).
    """
    cells = code_cells(path)
    ns: dict = {"__name__": "__main__"}
    cwd = os.getcwd()
    os.chdir(Path(path).parent)
    try:
        for i, (tags, src) in enumerate(cells, 1):
            try:
                exec(compile(src, f"{Path(path).name}, code cell {i}", "exec"), ns)
                if "parameters" in tags:
                    declared = assigned_names(src)
                    ns.update({k: v for k, v in params.items() if k in declared})
            except Exception as e:
                raise RuntimeError(f"{Path(path).name} failed in code cell {i} ({type(e).__name__}: {e})") from e
    finally:
        os.chdir(cwd)
        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")


def inputs_digest(name: str, params: ChainParameters) -> str:
    """sha256 of everything a notebook's outputs depend on.

    Its source, the resolved chain parameters (a profile whose values change reruns it) and the library source.
    Every ledger (plain or sealed), panel and prefix-bank file of the profile, not run logs or parquet copies.
    The role-table checkpoint files the profile's pointer names."""
    import hashlib

    h = hashlib.sha256()
    h.update((NOTEBOOKS / name).read_bytes())
    h.update(canonical_json(params.model_dump(mode="json")).encode())
    h.update(library_digest().encode())
    root = Path(params.ledger_root or LEDGERS) / params.profile
    if root.is_dir():
        for f in sorted(root.rglob("*")):
            if f.is_file() and f.name.endswith((".jsonl", ".json", ".jsonl.gz")) and f.name != "runlog.jsonl":
                h.update(str(f.relative_to(root)).encode())
                h.update(f.read_bytes())
    pointer = root / "role_adaptation.json"  # the checkpoint family lives outside the ledgers (data/checkpoints)
    if pointer.is_file():

        folder, _ = read_pointer(pointer)
        for name in ("manifest.json", *sorted(p.name for p in folder.glob("*.pt"))) if folder.is_dir() else ():
            f = folder / name
            h.update(name.encode())
            h.update(f.read_bytes() if f.is_file() else b"missing")
        if not folder.is_dir():
            h.update(b"checkpoint folder missing")
    return h.hexdigest()
