"""The checkpoint folder: role tables saved with their manifest, verified, loaded onto the base model, made once
per training config (:func:`ensure_checkpoints`), and the profile's pointer file to them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..decoding.contract import (
    N_ROLE_ROWS,
    ROLE_OFFSET,
    resolve_format,
)
from ..ledger.files import atomic_write, read_json
from ..ledger.store import canonical_json, config_digest
from ..model.execution import resolve_contract
from ..model.models import LoadedModel, environment_record, file_sha256, load_model
from ..paths import ROOT
from ..data.problems import Problem
from ..runner import model_key
from .training import (
    CHECKPOINT_NAMES,
    SCHEMA_VERSION,
    AdaptConfig,
    CheckpointError,
    TrainResult,
    assert_disjoint,
    data_record,
    load_source,
    split_problems,
    train_role_table,
)


# ----------------------------------------------------------------------------- checkpoint files


def checkpoint_folder(root: str | Path, config: dict) -> Path:
    """``<root>/role-table-<name>-<digest12>`` for a training config."""
    return Path(root) / f"role-table-{config['name']}-{config_digest(config)[:12]}"


def _file_name(step: int) -> str:
    return f"role_table_step{step:04d}.pt"


def save_checkpoints(folder: str | Path, config: dict, result: TrainResult, base: dict, environment: dict) -> dict:
    """Write both role tables, then the manifest (last, so a folder without a manifest is never reused).

    Returns:
        the manifest.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    entries = {}
    for name, step in zip(CHECKPOINT_NAMES, config["checkpoints"]):
        path = folder / _file_name(step)
        table = result.tables[step]
        if tuple(table.shape) != (N_ROLE_ROWS, table.shape[1]) or bool(table[:ROLE_OFFSET].any()):
            raise CheckpointError(f"role table at step {step} must be [14, hidden] with rows 0..7 zero")
        torch.save(table.cpu(), path)
        entries[name] = {"step": step, "file": path.name, "sha256": file_sha256(path)}
    manifest = {
        "schema_version": SCHEMA_VERSION, "config_digest": config_digest(config), "config": config,
        "base_model": base | {"weights_sha256_float32": result.base_weights_sha256, "unchanged_after_training": True},
        "checkpoint_0": "the base model with no role rows (a zero table), as in Experiments 1-4",
        "checkpoints": entries,
        "curve": {"train": result.train_curve, "heldout": result.heldout_curve},
    }
    atomic_write(folder / "environment.json", json.dumps(environment, indent=1, sort_keys=True) + "\n")
    atomic_write(folder / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True) + "\n")  # last: marks it done
    return manifest


def read_manifest(folder: str | Path) -> dict:
    """``manifest.json`` of a checkpoint folder.

    Raises:
        CheckpointError: if it is missing.
    """
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        raise CheckpointError(f"no checkpoint manifest at {path}: run notebooks/00_role_adaptation.ipynb first")
    return read_json(path, f"delete {path.parent} and run notebooks/00_role_adaptation.ipynb again")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One verified role-table file of the family.

    Attributes:
        name: ``early`` or ``later``; step: its training step; path: the file; sha256: its digest
        (checked against the manifest); folder: the checkpoint folder; base_model: the manifest's base identity.
    """
    name: str
    step: int
    path: Path
    sha256: str
    folder: Path
    base_model: dict


def checkpoint(folder: str | Path, which: str = "later") -> Checkpoint:
    """A role-table file of the family, checked against its manifest's sha256.

    Raises:
        CheckpointError: unknown name, missing file, or a digest that differs from the manifest's.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    if which not in manifest["checkpoints"]:
        raise CheckpointError(f"{folder}: no checkpoint {which!r}; it has {sorted(manifest['checkpoints'])}")
    e = manifest["checkpoints"][which]
    path = folder / e["file"]
    if not path.is_file():
        raise CheckpointError(f"role table {path} listed in {folder / 'manifest.json'} is missing")
    got = file_sha256(path)
    if got != e["sha256"]:
        raise CheckpointError(
            f"role table {path} has sha256 {got}, its manifest says {e['sha256']}: the file was changed; "
            f"delete {folder} and rerun notebooks/00_role_adaptation.ipynb"
        )
    return Checkpoint(which, e["step"], path, got, folder, manifest["base_model"])


def verify_folder(folder: str | Path, config: dict) -> dict:
    """Check a finished checkpoint folder against a training config and its files' digests.

    Returns:
        the manifest.

    Raises:
        CheckpointError: if the manifest belongs to another config or any file's digest differs.
    """
    manifest = read_manifest(folder)
    if manifest.get("config_digest") != config_digest(config) or manifest.get("schema_version") != SCHEMA_VERSION:
        raise CheckpointError(f"{folder} holds checkpoints of another training config ({manifest.get('config_digest')})")
    for name in manifest["checkpoints"]:
        checkpoint(folder, name)
    return manifest


def load_checkpoint_model(folder: str | Path, which: str = "later", dtype: str = "bfloat16", *,
                          sdpa_backends: tuple[str, ...] = ("math",), model: str | None = None) -> LoadedModel:
    """Base model + the role table of one checkpoint, each checked by digest.

    Raises:
        CheckpointError: a role table that differs from its manifest, or a base model whose key differs
            from the one the table was trained on.
    """
    ck = checkpoint(folder, which)
    base = model or ck.base_model["model"]
    key = ck.base_model["key"]
    if model is not None and model_key(model) != key:
        raise CheckpointError(f"model {model!r} is not the base the role table was trained on ({key})")
    lm = load_model(base, dtype, role_table=ck.path, contract=resolve_contract(sdpa_backends=tuple(sdpa_backends)))
    if lm.identity["role_table_sha256"] != ck.sha256:
        raise CheckpointError(f"loaded role table digest {lm.identity['role_table_sha256']} differs from {ck.sha256}")
    return lm


def ensure_checkpoints(
    cfg: AdaptConfig, root: str | Path, *, bank: Sequence[Problem], progress: bool = True,
    loader: Callable[[], LoadedModel] | None = None, problems: Sequence[Problem] | None = None,
    base_key: dict | None = None,
) -> tuple[Path, dict]:
    """Train the family's early and later role tables, or reuse a finished folder with the same training config.

    Args:
        cfg: the training config.
        root: checkpoint root (``data/checkpoints``).
        bank: the evaluation bank; training data must be disjoint from it.
        loader: returns the FP32 base model, called only when training is needed (default: load ``cfg.model``).
        problems: the source problems (default: the valid rows of ``cfg.source``).
        base_key: identity of the base model in the training config (default:
            :func:`kvreplay.runner.model_key` of ``cfg.model``; tests pass one for a tiny model).

    Returns:
        ``(folder, manifest)``.

    Raises:
        CheckpointError: a folder for this config whose files do not match its manifest.
        ValueError: training data that overlaps the bank.
    """
    if problems is None:
        problems, source_sha = load_source(cfg.source)
    else:
        source_sha = hashlib.sha256(canonical_json([p.to_json_dict() for p in problems]).encode()).hexdigest()
    train, heldout = split_problems(problems, cfg.n_train, cfg.n_heldout)
    assert_disjoint([*train, *heldout], bank)
    key = base_key if base_key is not None else model_key(cfg.model)
    config = cfg.config(key, data_record(train, heldout, cfg.source, source_sha))
    folder = checkpoint_folder(root, config)
    if (folder / "manifest.json").is_file():
        return folder, verify_folder(folder, config)
    contract = cfg.contract()
    contract.apply()  # also when the loader hands over a model loaded earlier
    lm = loader() if loader is not None else load_model(cfg.model, "float32", contract=contract)
    fmt = resolve_format(lm.tokenizer, cfg.fmt)
    t0 = time.perf_counter()
    result = train_role_table(cfg, lm, fmt, train, heldout, progress=progress)
    seconds = time.perf_counter() - t0
    env = environment_record(lm, cfg.threads) | {"format_digest": fmt.digest}
    manifest = save_checkpoints(folder, config, result, {"model": cfg.model, "key": key}, env)
    with open(folder / "runlog.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"event": "trained", "seconds": round(seconds, 1), "steps": cfg.steps,
                            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": os.uname().nodename}) + "\n")
    return folder, manifest


def write_pointer(path: str | Path, folder: Path, manifest: dict) -> dict:
    """Record which checkpoint folder a profile's chain uses (``<ledger_root>/<profile>/role_adaptation.json``).

    The folder is stored relative to the repository root when it lies inside it.
    """
    folder = Path(folder).resolve()
    try:
        where = str(folder.relative_to(ROOT))
    except ValueError:
        where = str(folder)
    pointer = {"folder": where, "config_digest": manifest["config_digest"], "base_model": manifest["base_model"]["key"],
               "model": manifest["base_model"]["model"], "checkpoints": manifest["checkpoints"]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(pointer, indent=1, sort_keys=True) + "\n")
    return pointer


def read_pointer(path: str | Path) -> tuple[Path, dict]:
    """The checkpoint folder a profile's chain uses, from the pointer notebook 00 wrote.

    Raises:
        CheckpointError: if notebook 00 has not run for the profile.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no {path}: run notebooks/00_role_adaptation.ipynb for this profile first")
    pointer = read_json(path, "run notebooks/00_role_adaptation.ipynb for this profile again (it rewrites the pointer)")
    folder = Path(pointer["folder"])
    return (folder if folder.is_absolute() else ROOT / folder), pointer
