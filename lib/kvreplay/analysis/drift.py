"""Per-tensor drift summaries between two boundary states (paper §3.4, Experiment 2).

For a pair of tensors, the relative drift is
``d_rel = ||X_other - X_ref||_2 / ||X_ref||_2`` computed in float64. The paper
aggregates "over all key/value tensors" without saying how; we define the
per-row value as the relative L2 over all K and V tensors concatenated:
``sqrt(sum ||dX||^2) / sqrt(sum ||X_ref||^2)``. Tables report the median
(and range) over rows of that per-row value; figures use per-layer medians.

For a model with sliding-window layers (``windows`` given) the drift is that
of the *attended state*: a sliding layer of window W is compared on its last
``W - 1`` positions, the keys a query after the boundary can still attend to
(what the model's own rolling cache keeps). A full-attention layer on all
positions. Such rows also name each layer's kind and keep the whole tensor's
drift beside it (``full_tensor``); a model without sliding layers gets the
rows it always had.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..gates import geometry


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


def attended_span(seq: int, window: int | None) -> tuple[int, int]:
    """Positions ``[start, seq)`` of a cache of ``seq`` positions that the next query can attend to.

    A sliding layer's query at position ``seq`` sees keys ``k`` with ``seq - k < window``: the last
    ``window - 1`` cached positions (``transformers``' ``DynamicSlidingWindowLayer`` keeps exactly these).
    A full-attention layer (``window`` None) sees all of them.
    """
    return (0, seq) if window is None else (max(0, seq - window + 1), seq)


def _layer(name: str) -> int:
    return int(name.split(".")[0][1:])


def attended(inventory: Sequence[tuple[str, torch.Tensor]],
             windows: Sequence[int | None] | None) -> list[tuple[str, torch.Tensor]]:
    """A cache inventory cut to its attended state: sliding layers' tensors as views of their last ``window - 1`` positions.

    Args:
        inventory: ``[("L00.key", [batch, kv_heads, seq, head_dim]), ...]``.
        windows: per layer the sliding window (``None``: full attention), or ``None`` for no sliding layer.

    Returns:
        The same names; each tensor itself or a view ``[..., start:seq, :]`` (same storage).
    """
    if windows is None:
        return list(inventory)
    out = []
    for name, t in inventory:
        start, end = attended_span(t.shape[-2], windows[_layer(name)])
        out.append((name, t if (start, end) == (0, t.shape[-2]) else t[..., start:end, :]))
    return out


def cache_drift(ref: Sequence[tuple[str, torch.Tensor]], other: Sequence[tuple[str, torch.Tensor]],
                windows: Sequence[int | None] | None = None) -> list[dict]:
    """Per-tensor summaries for two cache inventories with the same names (``L00.key`` ...).

    Args:
        ref, other: inventories ``[("L00.key", [batch, kv_heads, seq, head_dim]), ...]``.
        windows: per layer its sliding window (``None``: full attention), or ``None`` when no layer
            slides (:attr:`kvreplay.decoding.decode.Boundary.windows`).

    Returns:
        One :func:`tensor_drift` dict per tensor. With ``windows``, each adds ``layer_kind``
        (``"full"`` or ``"sliding"``); a sliding layer's fields describe its attended positions and
        add ``window``, ``positions`` (``[start, end)``), ``full_tensor`` (the whole tensor's
        ``exact``, ``rel_l2``, ``max_abs``, ``n_diff``, ``numel``), and its geometries stay the stored tensors'.

    Raises:
        ValueError: the inventories' names or shapes differ, or ``windows`` has the wrong length.
    """
    names = [n for n, _ in ref]
    if names != [n for n, _ in other]:
        raise ValueError("cache inventories differ")
    if windows is None:
        return [tensor_drift(n, a, b) for (n, a), (_, b) in zip(ref, other)]
    if len(windows) * 2 != len(names):
        raise ValueError(f"{len(windows)} layer windows for {len(names)} K/V tensors")
    rows = []
    for (n, a), (_, b) in zip(ref, other):
        window = windows[_layer(n)]
        if window is None:
            rows.append(tensor_drift(n, a, b) | {"layer_kind": "full"})
            continue
        if a.shape != b.shape:
            raise ValueError(f"{n}: shapes differ {tuple(a.shape)} vs {tuple(b.shape)}")
        whole = tensor_drift(n, a, b)
        start, end = attended_span(a.shape[-2], window)
        row = tensor_drift(n, a[..., start:end, :], b[..., start:end, :])
        row.update(ref_geometry=whole["ref_geometry"], other_geometry=whole["other_geometry"], layer_kind="sliding",
                   window=int(window), positions=[start, end],
                   full_tensor={k: whole[k] for k in ("exact", "rel_l2", "max_abs", "n_diff", "numel")})
        rows.append(row)
    return rows


def aggregate(rows: Sequence[dict]) -> dict:
    """Whole-cache aggregate of per-tensor summaries (our stated definition).

    Returns:
        ``{"exact", "rel_l2", "max_abs", "n_diff", "numel"}`` where ``rel_l2``
        is the relative L2 over all tensors concatenated; rows of a model with
        sliding layers (they carry ``layer_kind``) add ``"scope": "attended"``: the
        sums cover each sliding layer's attended positions only (:func:`cache_drift`).
    """
    num = sum(r["l2_diff"] ** 2 for r in rows)
    den = sum(r["l2_ref"] ** 2 for r in rows)
    out = {
        "exact": all(r["exact"] for r in rows),
        "rel_l2": math.sqrt(num) / math.sqrt(den) if den > 0 else 0.0,
        "max_abs": max((r["max_abs"] for r in rows), default=0.0),
        "n_diff": sum(r["n_diff"] for r in rows),
        "numel": sum(r["numel"] for r in rows),
    }
    if any("layer_kind" in r for r in rows):
        out["scope"] = "attended"
    return out


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
