"""One ledger row rebuilt on demand: its boundary caches, their drift maps, suffix alignment and top-k logits.

The drift explorer (:mod:`kvreplay.notebook.explorer`, notebook 08) reads a row from a
ledger and reloads the model that wrote it (:func:`load_for_ledger`). It rebuilds the
two boundary caches of one comparison from the row's token IDs
(:func:`rebuild_pair`) and checks them against the ledger's fingerprints
(:func:`fingerprint_matches`) before showing per-tensor drift.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ..decoding import caches, decode
from ..decoding.contract import resolve_format
from ..experiments.matrix import boundary_gates
from ..gates import GateError
from ..ledger.lookup import LoadedLedger
from ..ledger.records import Exp1Record, Exp1Row, Exp2Record, Exp2Row
from ..ledger.store import canonical_json
from ..model.models import ModelLoadError, load_model
from ..runner import ArmSettings, model_key

if TYPE_CHECKING:
    import torch

COMPARISONS: dict[str, dict[str, tuple[str, str]]] = {
    "exp1": {"prefill_vs_live": ("live", "prefill"), "live_replica": ("live", "live_replica"),
             "prefill_replica": ("prefill", "prefill_replica")},
    "exp2": {"prefill_vs_incremental": ("incremental", "prefill"), "incremental_replica": ("incremental", "incremental_replica"),
             "prefill_replica": ("prefill", "prefill_replica")},
}
"""Experiment -> comparison (the ledger's ``boundary`` key) -> ``(reference arm, other arm)``."""


def comparison_arms(experiment: str, comparison: str) -> tuple[str, str]:
    """``(reference arm, other arm)`` of a comparison.

    Raises:
        ValueError: naming the comparisons available for the experiment.
    """
    if experiment not in COMPARISONS:
        raise ValueError(f"experiment {experiment!r}: the explorer reads {sorted(COMPARISONS)}")
    if comparison not in COMPARISONS[experiment]:
        raise ValueError(f"comparison {comparison!r} is not in {experiment}; choose one of {sorted(COMPARISONS[experiment])}")
    return COMPARISONS[experiment][comparison]


def pick_row(records: Sequence[Exp1Record] | Sequence[Exp2Record], problem: str | None,
             experiment: str) -> Exp1Record | Exp2Record:
    """The row to explore: ``problem`` if given, else the first row whose suffixes differ, else the first row.

    Raises:
        KeyError: if ``problem`` is not in the ledger (naming the IDs that are).
    """
    if problem is not None:
        for r in records:
            if r["problem_id"] == problem:
                return r
        raise KeyError(f"problem {problem!r} is not in the {experiment} ledger; it has {[r['problem_id'] for r in records]}")
    for r in records:
        if r["gate_failure"] is None and r["endpoints"]["suffix_differs"]:  # a failed row has no endpoints
            return r
    return records[0]


def profile_model(ledger: LoadedLedger, candidate: str | None) -> str | None:
    """``candidate`` (a profile's ``model``) when it is the local model folder the ledger keyed: same folder name
    and every file's sha256 equal (:func:`kvreplay.runner.model_key`); ``None`` otherwise (a ledger of another
    kind of model, or another folder). A ledger keys a local folder by its name and file digests only, not its path:
    this is how notebook 08 finds a profile's own model folder again without a ``model`` parameter."""
    key = ledger.config["model"]
    if not candidate or "files" not in key:
        return None
    try:
        return candidate if model_key(candidate) == key else None
    except (ModelLoadError, OSError):  # an unknown path is not the ledger's folder
        return None


def model_for_ledger(ledger: LoadedLedger, model: str | None = None) -> str:
    """The ``model`` argument that reloads the ledger's model (``model`` overrides it).

    Raises:
        ValueError: if the ledger keyed a local folder (only its name and file digests are recorded) and no ``model``
            is given.
    """
    if model:
        return model
    key = ledger.config["model"]
    if key.get("model") == "embedded" or "sha256" in key or "files" not in key:
        return key["model"]
    raise ValueError(f"ledger {ledger.dir.name} was written with the local model folder {key['model']!r} (the ledger "
                     "keeps its name and file digests, not its path); pass its path as `model`, or run the profile "
                     "whose `model` names it")


def load_for_ledger(ledger: LoadedLedger, model: str | None = None):
    """Load the ledger's model and block format exactly as its config says (dtype, threads, SDPA backends, role table,
    and the execution contract's device, determinism and TF32: a ledger computed on CUDA needs a CUDA device).

    Returns:
        ``(LoadedModel, BlockFormat)``.

    Raises:
        GateError: gate ``provenance`` if the resolved format's digest differs from the ledger's.
        DeviceUnavailableError: the ledger was computed on CUDA and this machine has none.
    """
    c = ledger.config
    settings = ArmSettings.from_config(c).eager()  # the row's caches are rebuilt one problem at a time
    role = c.get("role_table")
    table = settings.role_table
    lm = load_model(model_for_ledger(ledger, model), c["dtype"], role_table=table, contract=settings.contract())
    if role and lm.identity["role_table_sha256"] != role["sha256"]:
        raise GateError("provenance", f"role table {table} has sha256 {lm.identity['role_table_sha256']}, the ledger keyed {role['sha256']}")
    fmt = resolve_format(lm.tokenizer, c["format"])
    want = ledger.contract.get("format_digest")
    if want and fmt.digest != want:
        raise GateError("provenance", f"resolved format digest {fmt.digest[:12]} differs from the ledger's {want[:12]}")
    return lm, fmt


def rebuild_pair(lm, fmt, prefix: Sequence[int], ref: str, other: str, *, where: str = "prefix"):
    """Rebuild the two boundary states of one comparison from a ledger prefix z.

    ``live`` and ``incremental`` are both rebuilt by teacher-forcing the live
    call schedule (:func:`kvreplay.decoding.decode.build_incremental`; Experiment 3
    shows it bit-identical to live decoding); ``prefill`` and
    ``prefill_replica`` are independent one-call forwards; ``*_replica`` of a
    teacher-forced state is its verified deep copy. The row's boundary gates
    (dtype, state, duplicates, replica exactness, disjoint storage) run on the pair.

    Returns:
        ``(ref_state, other_state)`` :class:`~kvreplay.decoding.decode.Boundary` objects,
        caches ``[2, kv_heads, |z|, head_dim]`` per layer.

    Raises:
        GateError: a failed gate. ContractError: a prefix that does not end at the boundary.
    """
    built: dict = {}

    def get(name: str):
        if name not in built:
            if name in ("live", "incremental"):
                s = decode.build_incremental(lm, fmt, prefix, where=where)
            elif name in ("prefill", "prefill_replica"):
                s = decode.build_prefill(lm, fmt, prefix, where=where)
            elif name.endswith("_replica"):
                s = caches.live_replica(get(name[: -len("_replica")]))
            else:
                raise ValueError(f"unknown construction {name!r}")
            s.construction = name
            built[name] = s
        return built[name]

    a, b = get(ref), get(other)
    pairs = [(ref, other)] if other == f"{ref}_replica" else []
    boundary_gates({ref: a, other: b}, lm.dtype, pairs)
    return a, b


def fingerprint_matches(ledger_summary: Mapping[str, Any], rebuilt: Mapping[str, Any]) -> dict[str, bool]:
    """Whether a rebuilt comparison (:func:`kvreplay.experiments.matrix.comparison`) equals the ledger's, part by part.

    Compares ``cache``, ``logits`` and (when the ledger has them) ``tensors`` after a JSON round trip.
    """
    norm = lambda x: json.loads(canonical_json(x))  # noqa: E731
    return {k: norm(ledger_summary[k]) == norm(rebuilt[k]) for k in ("cache", "logits", "tensors") if k in ledger_summary}


def drift_maps(
    ref: Sequence[tuple[str, torch.Tensor]], other: Sequence[tuple[str, torch.Tensor]], row: int = 0
) -> dict[tuple[str, str], pd.DataFrame]:
    """Per-head and per-position relative L2 drift of each layer's K and V (one duplicate row).

    Args:
        ref, other: cache inventories ``[("L00.key", [batch, kv_heads, seq, head_dim]), ...]``
            (:func:`kvreplay.gates.cache_tensors`), same names and shapes.
        row: which duplicate copy to read (both are bit-identical by the desync gate).

    Returns:
        ``{(kind, "head"): DataFrame [layers, kv_heads], (kind, "position"): DataFrame [layers, seq]}``
        for ``kind`` in ``key``/``value``; each cell is ``||other - ref|| / ||ref||`` over the
        remaining axes (NaN where the reference norm is 0), computed in float64.
    """
    import torch

    out: dict[tuple[str, str], dict[int, list[float]]] = {}
    for (name, a), (name_b, b) in zip(ref, other):
        if name != name_b or a.shape != b.shape:
            raise ValueError(f"inventories differ at {name} / {name_b}")
        layer, kind = name.split(".")
        r = a[row].detach().to(torch.float64)  # [kv_heads, seq, head_dim]
        d = b[row].detach().to(torch.float64) - r
        for axis, dims in (("head", (1, 2)), ("position", (0, 2))):
            num = torch.linalg.vector_norm(d, dim=dims)
            den = torch.linalg.vector_norm(r, dim=dims)
            rel = torch.where(den > 0, num / den.clamp_min(1e-300), torch.full_like(num, math.nan))
            out.setdefault((kind, axis), {})[int(layer[1:])] = rel.tolist()
    frames = {}
    for key, by_layer in out.items():
        df = pd.DataFrame.from_dict(by_layer, orient="index").sort_index()
        df.index.name = "layer"
        df.columns.name = key[1]
        frames[key] = df
    return frames


def token_text(tokenizer, token: int) -> str:
    """One token decoded, with whitespace made visible (for side-by-side tables)."""
    return repr(tokenizer.decode([int(token)]))[1:-1]


def suffix_alignment(
    tokenizer, a: Sequence[int], b: Sequence[int], margins_a: Sequence, margins_b: Sequence,
    first: int | None, before: int = 8, after: int = 12,
) -> pd.DataFrame:
    """Two suffixes side by side around their first divergence.

    Shows ``before`` steps before and ``after`` steps after it, or the first
    ``before + after + 1`` steps when the suffixes never differ.

    Returns:
        DataFrame indexed by ``step`` with each arm's token text and margin and ``same``.
    """
    n = max(len(a), len(b))
    lo, hi = (0, min(n, before + after + 1)) if first is None else (max(0, first - before), min(n, first + after + 1))
    rows = []
    for i in range(lo, hi):
        ta = a[i] if i < len(a) else None
        tb = b[i] if i < len(b) else None
        rows.append({
            "step": i,
            "reference": token_text(tokenizer, ta) if ta is not None else "",
            "margin (reference)": margins_a[i] if i < len(margins_a) else None,
            "other": token_text(tokenizer, tb) if tb is not None else "",
            "margin (other)": margins_b[i] if i < len(margins_b) else None,
            "same": ta == tb,
        })
    return pd.DataFrame(rows).set_index("step")


def topk_frame(tokenizer, ref_logits, other_logits, k: int = 10) -> pd.DataFrame:
    """Boundary logits ``[vocab]`` of two states on the union of each one's top-k tokens.

    Returns:
        DataFrame indexed by token ID: ``text``, ``reference``, ``other``, ``other - reference``,
        rank in each; sorted by the reference logit.
    """
    import torch

    r, o = ref_logits.float(), other_logits.float()
    ids = sorted(set(torch.topk(r, k).indices.tolist()) | set(torch.topk(o, k).indices.tolist()))
    rank_r = {int(t): i + 1 for i, t in enumerate(torch.topk(r, 2 * k).indices.tolist())}
    rank_o = {int(t): i + 1 for i, t in enumerate(torch.topk(o, 2 * k).indices.tolist())}
    rows = [{"token": t, "text": token_text(tokenizer, t), "reference": float(r[t]), "other": float(o[t]),
             "other - reference": float(o[t] - r[t]), "rank (reference)": rank_r.get(t), "rank (other)": rank_o.get(t)}
            for t in ids]
    return pd.DataFrame(rows).set_index("token").sort_values("reference", ascending=False)


# ----------------------------------------------------------------------------- a rebuilt row kept on disk

REBUILD_VERSION = 1
"""The version of what :class:`RebuiltDrift` holds and how it is computed; part of every cache key (bump it when
either changes, so an older cached rebuild is never read as a current one)."""

TOP_LOGITS = 64
"""Boundary logits kept per state: each state's top :data:`TOP_LOGITS` tokens and the other's logit on them, so
:func:`topk_frame` gives the full-vocabulary answer for ``k <= TOP_LOGITS // 2``."""

KINDS = ("key", "value")


@dataclasses.dataclass
class RebuiltDrift:
    """What the explorer shows of one row's rebuilt boundary pair, without the caches (small enough to keep on disk).

    Attributes:
        maps: :func:`drift_maps` (per head ``[layers, kv_heads]`` and per position ``[layers, |z|]``, float64).
        detail: kind -> relative L2 over head_dim per layer, KV head and position, float32 ``[layers, kv_heads, |z|]``
            (NaN where the reference is 0).
        logit_ids: token IDs ``[n]`` (int64) where :attr:`logits` are kept (:data:`TOP_LOGITS`).
        logits: ``(reference, other)`` boundary logits on :attr:`logit_ids`, float32 ``[n]`` each.
        summary: :func:`kvreplay.experiments.matrix.comparison` of the pair (per tensor).
        fingerprint: :func:`fingerprint_matches` of :attr:`summary` against the ledger's.
        tokens: token text of each position of z; blocks: block name -> first position in z.
        seconds: ``{"model": s, "rebuild": s}`` wall times when it was rebuilt.
        environment: :func:`kvreplay.model.models.environment_record` of the machine and model that rebuilt it.
        key: what keys it (:func:`drift_key`).
    """
    maps: dict[tuple[str, str], pd.DataFrame]
    detail: dict[str, np.ndarray]
    logit_ids: np.ndarray
    logits: tuple[np.ndarray, np.ndarray]
    summary: dict
    fingerprint: dict[str, bool]
    tokens: list[str]
    blocks: dict[str, int]
    seconds: dict[str, float]
    environment: dict
    key: dict

    def full_logits(self, which: int) -> torch.Tensor:
        """Boundary logits ``[vocab]`` (float32) of the reference (0) or other (1) state: the kept ones, ``-inf``
        elsewhere (what :func:`topk_frame` needs for ``k <= TOP_LOGITS // 2``)."""
        import torch

        vocab = int(self.key["vocab"])
        out = torch.full((vocab,), -math.inf, dtype=torch.float32)
        out[torch.from_numpy(self.logit_ids)] = torch.from_numpy(self.logits[which])
        return out


def drift_key(ledger: LoadedLedger, row: Mapping[str, Any], comparison: str, model: str | None = None) -> dict:
    """What a cached rebuild of ``row`` is keyed by: the profile and ledger folder (its config digest), the row's
    sha256, the comparison, the ledger's row-algorithm version, :data:`REBUILD_VERSION` and a model override.

    Returns:
        a JSON-serializable dict; its ``digest`` (sha256 prefix) names the file.
    """
    import hashlib

    key = {"profile": ledger.dir.parent.name, "ledger": ledger.dir.name, "problem_id": row["problem_id"],
           "comparison": comparison,
           "dtype": ledger.config["dtype"], "row_sha256": hashlib.sha256(canonical_json(row).encode()).hexdigest(),
           "row_algorithm": ledger.environment.get("row_algorithm"), "rebuild_version": REBUILD_VERSION,
           "model": model}
    return key | {"digest": hashlib.sha256(canonical_json(key).encode()).hexdigest()[:16]}


def drift_file(folder: str | Path, key: Mapping[str, Any]) -> Path:
    """``<folder>/<profile>/<problem>_<ledger>_<comparison>_<digest>.npz``: where a cached rebuild of ``key`` lives."""
    return Path(folder) / key["profile"] / f"{key['problem_id']}_{key['ledger']}_{key['comparison']}_{key['digest']}.npz"


def rebuilt_drift(lm, fmt, ledger: LoadedLedger, row: Exp1Row | Exp2Row, comparison: str, a, b, *,
                  model: str | None = None, seconds: Mapping[str, float]) -> RebuiltDrift:
    """The :class:`RebuiltDrift` of a rebuilt pair ``a, b`` (:func:`rebuild_pair`) of ``row``.

    Raises:
        KeyError: ``comparison`` is not in the row's ``boundary``.
    """
    import torch

    from ..decoding.contract import ROLE_NAMES
    from ..experiments.matrix import comparison as compare_states
    from ..gates import cache_tensors
    from ..ledger.records import comparison_of
    from ..model.models import environment_record

    summary = compare_states(a, b, per_tensor=True)
    ref, other = cache_tensors(a.cache), cache_tensors(b.cache)
    detail: dict[str, list[np.ndarray]] = {k: [] for k in KINDS}
    for (name, x), (_, y) in zip(ref, other):
        r = x[0].detach().to(torch.float64)  # [kv_heads, |z|, head_dim], the first duplicate copy
        num = torch.linalg.vector_norm(y[0].detach().to(torch.float64) - r, dim=-1)
        den = torch.linalg.vector_norm(r, dim=-1)
        rel = torch.where(den > 0, num / den.clamp_min(1e-300), torch.full_like(num, math.nan))
        detail[name.split(".")[1]].append(rel.to(torch.float32).numpy())
    la, lb = a.logits[0].float(), b.logits[0].float()
    ids = sorted(set(torch.topk(la, TOP_LOGITS).indices.tolist()) | set(torch.topk(lb, TOP_LOGITS).indices.tolist()))
    index = torch.tensor(ids, dtype=torch.long)
    roles = fmt.parse(row["prefix"]).roles
    key = drift_key(ledger, row, comparison, model) | {"vocab": int(la.shape[0])}
    return RebuiltDrift(
        maps=drift_maps(ref, other), detail={k: np.stack(v) for k, v in detail.items()},
        logit_ids=index.numpy(), logits=(la[index].numpy(), lb[index].numpy()), summary=summary,
        fingerprint=fingerprint_matches(comparison_of(row, comparison), summary),
        tokens=[token_text(lm.tokenizer, t) for t in row["prefix"]],
        blocks={ROLE_NAMES[r]: list(roles).index(r) for r in sorted(set(roles))}, seconds=dict(seconds),
        environment=environment_record(lm, ledger.config["threads"]), key=key)


def save_drift(drift: RebuiltDrift, path: str | Path) -> Path:
    """Write ``drift`` as one compressed ``.npz`` (numeric arrays, and the rest as UTF-8 JSON bytes: no pickle),
    atomically.

    Returns:
        ``path``.
    """
    import os
    import tempfile

    arrays = {f"map.{kind}.{axis}": frame.to_numpy(dtype=np.float64) for (kind, axis), frame in drift.maps.items()}
    arrays |= {f"detail.{kind}": v for kind, v in drift.detail.items()}
    arrays |= {"logit_ids": drift.logit_ids.astype(np.int64), "logits.reference": drift.logits[0],
               "logits.other": drift.logits[1]}
    meta = {"summary": drift.summary, "fingerprint": drift.fingerprint, "tokens": drift.tokens, "blocks": drift.blocks,
            "seconds": drift.seconds, "environment": drift.environment, "key": drift.key}
    arrays["meta"] = np.frombuffer(canonical_json(meta).encode(), dtype=np.uint8)  # UTF-8 JSON
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".npz")
    os.close(fd)
    try:
        np.savez_compressed(tmp, **arrays)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def load_drift(path: str | Path) -> RebuiltDrift:
    """Read a :func:`save_drift` file.

    Raises:
        ValueError: the file is not a cached rebuild of :data:`REBUILD_VERSION` (names the file).
    """
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
        meta = json.loads(arrays.pop("meta").tobytes().decode())
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: not a cached rebuild ({e})") from None
    if meta["key"].get("rebuild_version") != REBUILD_VERSION:
        raise ValueError(f"{path}: a cached rebuild of version {meta['key'].get('rebuild_version')}, "
                         f"this library reads {REBUILD_VERSION}")
    maps = {}
    for name, v in arrays.items():
        if name.startswith("map."):
            _, kind, axis = name.split(".")
            frame = pd.DataFrame(v)
            frame.index.name, frame.columns.name = "layer", axis
            maps[(kind, axis)] = frame
    return RebuiltDrift(
        maps=maps, detail={k: arrays[f"detail.{k}"] for k in KINDS}, logit_ids=arrays["logit_ids"],
        logits=(arrays["logits.reference"], arrays["logits.other"]), summary=meta["summary"],
        fingerprint=meta["fingerprint"], tokens=meta["tokens"], blocks=meta["blocks"], seconds=meta["seconds"],
        environment=meta["environment"], key=meta["key"])
