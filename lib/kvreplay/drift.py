"""Per-tensor drift summaries between two boundary states (paper §3.4, Experiment 2).

For a pair of tensors, the relative drift is
``d_rel = ||X_other - X_ref||_2 / ||X_ref||_2`` computed in float64. The paper
aggregates "over all key/value tensors" without saying how; we define the
per-row value as the relative L2 over all K and V tensors concatenated:
``sqrt(sum ||dX||^2) / sqrt(sum ||X_ref||^2)``. Tables report the median
(and range) over rows of that per-row value; figures use per-layer medians.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .gates import geometry


def tensor_drift(name: str, ref: torch.Tensor, other: torch.Tensor) -> dict:
    """Summary of ``other - ref`` for one tensor (both ``[2, kv_heads, seq, head_dim]`` or ``[2, vocab]``).

    Returns:
        dict with ``tensor``, ``exact``, ``max_abs``, ``l2_diff``, ``l2_ref``,
        ``rel_l2``, ``n_diff`` (count of differing elements), ``numel``, and the
        geometry (shape, stride, dtype, device) of both tensors.

    Raises:
        ValueError: if shapes differ.
    """
    if ref.shape != other.shape:
        raise ValueError(f"{name}: shapes differ {tuple(ref.shape)} vs {tuple(other.shape)}")
    r = ref.detach().to(torch.float64)
    d = other.detach().to(torch.float64) - r
    l2_ref = float(torch.linalg.vector_norm(r))
    l2_diff = float(torch.linalg.vector_norm(d))
    return {
        "tensor": name,
        "exact": bool(torch.equal(ref, other)),
        "max_abs": float(d.abs().max()) if d.numel() else 0.0,
        "l2_diff": l2_diff,
        "l2_ref": l2_ref,
        "rel_l2": l2_diff / l2_ref if l2_ref > 0 else (0.0 if l2_diff == 0 else math.inf),
        "n_diff": int((ref != other).sum()),
        "numel": int(ref.numel()),
        "ref_geometry": geometry(ref),
        "other_geometry": geometry(other),
    }


def cache_drift(ref: Sequence[tuple[str, torch.Tensor]], other: Sequence[tuple[str, torch.Tensor]]) -> list[dict]:
    """Per-tensor summaries for two cache inventories with the same names (``L00.key`` ...)."""
    names = [n for n, _ in ref]
    if names != [n for n, _ in other]:
        raise ValueError("cache inventories differ")
    return [tensor_drift(n, a, b) for (n, a), (_, b) in zip(ref, other)]


def aggregate(rows: Sequence[dict]) -> dict:
    """Whole-cache aggregate of per-tensor summaries (our stated definition).

    Returns:
        ``{"exact", "rel_l2", "max_abs", "n_diff", "numel"}`` where ``rel_l2``
        is the relative L2 over all tensors concatenated.
    """
    num = sum(r["l2_diff"] ** 2 for r in rows)
    den = sum(r["l2_ref"] ** 2 for r in rows)
    return {
        "exact": all(r["exact"] for r in rows),
        "rel_l2": math.sqrt(num) / math.sqrt(den) if den > 0 else 0.0,
        "max_abs": max((r["max_abs"] for r in rows), default=0.0),
        "n_diff": sum(r["n_diff"] for r in rows),
        "numel": sum(r["numel"] for r in rows),
    }


def logit_summary(ref: torch.Tensor, other: torch.Tensor, top_k: int = 5) -> dict:
    """Boundary next-token logits ``[2, vocab]``: exactness, magnitude, argmax and top-k of each.

    Returns:
        the :func:`tensor_drift` fields plus ``argmax_ref``, ``argmax_other``,
        ``argmax_agree`` (argmax: lowest token ID on an exact tie),
        ``margin_ref``/``margin_other`` (top-1 minus top-2, raw logits, row 0)
        and the top-k token IDs of each.
    """
    out = tensor_drift("logits", ref, other)
    tr, to = torch.topk(ref[0].float(), top_k), torch.topk(other[0].float(), top_k)
    a_ref, a_other = int(ref[0].float().argmax()), int(other[0].float().argmax())
    out.update(
        argmax_ref=a_ref,
        argmax_other=a_other,
        argmax_agree=a_ref == a_other,
        margin_ref=float(tr.values[0] - tr.values[1]),
        margin_other=float(to.values[0] - to.values[1]),
        topk_ref=[int(i) for i in tr.indices],
        topk_other=[int(i) for i in to.indices],
    )
    return out
