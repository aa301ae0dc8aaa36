"""The identities an arm's ledger key holds for its inputs, computed without loading anything: the model
(:func:`model_key`), a role table (:func:`role_table_key`) and the problems (:func:`problems_digest`). Re-exported by
:mod:`kvreplay.runner.spec`, whose :class:`~kvreplay.runner.spec.ArmSettings` builds the key from them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..ledger.store import canonical_json
from ..model.models import EMBEDDED_MODELS, ModelLoadError, file_sha256, looks_like_path
from ..paths import ROOT
from ..data.problems import Problem


def model_key(model: str) -> dict:
    """Cheap identity of a model for ledger keys, computed without loading it.

    An embedded model (``embedded``, ``gemma3``) is keyed by its pinned GGUF digest; a ``.gguf`` file
    by its sha256; a local folder by the sha256 of each file in it.

    Raises:
        ModelLoadError: for an unknown path.
    """
    if model in EMBEDDED_MODELS:
        return {"model": model, "sha256": EMBEDDED_MODELS[model].sha256}
    p = Path(model).expanduser()
    if p.is_file():
        return {"model": str(model), "sha256": file_sha256(p)}
    if p.is_dir():
        return {"model": p.name, "files": {f.name: file_sha256(f) for f in sorted(p.iterdir()) if f.is_file()}}
    if looks_like_path(model) or model.endswith(".gguf"):
        raise ModelLoadError(f"unknown model {model!r}: no such file or folder")
    return {"model": model}  # a hub id: it must already be in the local cache (checked when loading)


def role_table_key(path: str | Path) -> dict:
    """Identity of a role-table file for ledger keys: its sha256, and its path relative to the repository
    root when it lies inside it (so a clone elsewhere keys the same table the same way).

    Raises:
        ModelLoadError: if the file does not exist.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise ModelLoadError(f"role table not found: {path}")
    try:
        name = str(p.resolve().relative_to(ROOT))
    except ValueError:
        name = str(path)
    return {"model": name, "sha256": file_sha256(p)}


def problems_digest(problems: Sequence[Problem]) -> str:
    """sha256 of the problems' content in frozen order."""
    import hashlib

    payload = [[p.problem_id, p.question, list(p.options), p.answer] for p in problems]
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()
