"""The drift explorer's figures (notebook 08): one row's per-layer drift, per-position heatmaps, the detail view
and the boundary's top-k logits. Conventions as in :mod:`kvreplay.report.figure_style`; re-exported by
:mod:`kvreplay.report.figures`.

Each figure is a :class:`matplotlib.figure.Figure` on its own Agg canvas, made without pyplot: no current figure,
no figure manager. So a widget callback that draws one can never have it shown elsewhere (an inline backend's
end-of-cell display, a log console) or closed under it by another draw. Show it as PNG bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle


from .figure_style import KIND_MARKERS, at_floor, integer_axis, log_with_exact, mark_layer_kinds


# ----------------------------------------------------------------------------- drift explorer


def _figure(**kwargs) -> Figure:
    """A figure outside pyplot (see the module docstring) on its own Agg canvas, so it draws and renders anywhere."""
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def explorer_layers(frame: pd.DataFrame, *, title: str):
    """One row's per-layer K/V drift: relative L2 and max |Δ|, each on its own log axis with a ``0 (exact)`` band.

    Args:
        frame: :func:`kvreplay.report.frames.layer_drift_frame` (``layer``, ``kind``, ``rel_l2``, ``max_abs``).
    """
    fig = _figure(figsize=(11, 3.4), constrained_layout=True)
    axes = fig.subplots(1, 2)
    for ax, col, label in ((axes[0], "rel_l2", "relative L2"), (axes[1], "max_abs", "max |Δ|")):
        floor = log_with_exact(ax, frame[col])
        for kind, sub in frame.sort_values("layer").groupby("kind"):
            ax.plot(sub["layer"], at_floor(sub[col], floor), marker=KIND_MARKERS.get(kind, "o"), ms=4, label=kind)
        integer_axis(ax.xaxis)
        ax.set_xlabel("layer")
        mark_layer_kinds(ax, frame)
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return fig


def drift_heatmaps(maps: Mapping[tuple[str, str], pd.DataFrame], tokens: Sequence[str], blocks: Mapping[str, int], *,
                   title: str, layer: int | None = None, head: int | None = None, kind: str | None = None,
                   window: tuple[int, int] | None = None):
    """Per-head and per-position drift maps (layers x heads, layers x positions) on a log colour scale.

    Args:
        maps: :func:`kvreplay.report.rebuild.drift_maps` output: ``{(kind, "head"): [layers, heads],
            (kind, "position"): [layers, |z|]}`` relative L2 (NaN where the reference is 0).
        tokens: the token text of each position of z (``len(tokens) == |z|``), shown on the position axis.
        blocks: block name -> first position of that block in z (dotted boundaries).
        title: the figure title.
        layer, head: highlighted layer (a horizontal line) and KV head (a column outline), if given.
        kind: ``key`` or ``value`` to draw one kind only (default both).
        window: ``(start, stop)`` positions shown on the position axis (default all; token labels
            are drawn when at most 80 positions are shown).

    Returns:
        the figure. Exact zeros are drawn in white (below the colour scale's floor); NaN in grey.
    """
    kinds = [kind] if kind else ["key", "value"]
    vals = np.concatenate([maps[(k, a)].to_numpy().ravel() for k in kinds for a in ("head", "position")])
    pos = vals[np.isfinite(vals) & (vals > 0)]
    vmin, vmax = (pos.min(), pos.max()) if len(pos) else (1e-12, 1e-11)
    if vmax <= vmin:
        vmax = vmin * 10
    norm = LogNorm(vmin=vmin, vmax=vmax)
    cmap = matplotlib.colormaps["magma"].with_extremes(under="white", bad="0.85")
    n_pos = maps[(kinds[0], "position")].shape[1]
    lo, hi = window if window else (0, n_pos)
    lo, hi = max(0, lo), min(n_pos, hi)
    fig = _figure(figsize=(13, 3.6 * len(kinds) + 1.2), constrained_layout=True)
    axes = fig.subplots(len(kinds), 2, gridspec_kw={"width_ratios": [1, 5]}, squeeze=False)
    im = None
    for i, k in enumerate(kinds):
        for j, axis in enumerate(("head", "position")):
            ax = axes[i, j]
            m = maps[(k, axis)].to_numpy().astype(float)
            shown = np.where(m == 0, vmin / 10, m)  # exact zeros under the scale: white
            extent_lo = lo if axis == "position" else 0
            data = shown[:, lo:hi] if axis == "position" else shown
            im = ax.imshow(data, aspect="auto", origin="lower", cmap=cmap, norm=norm, interpolation="nearest",
                           extent=(extent_lo - 0.5, extent_lo + data.shape[1] - 0.5, -0.5, m.shape[0] - 0.5))
            ax.set_ylabel("layer")
            integer_axis(ax.yaxis)
            if layer is not None:
                ax.axhline(layer, color="cyan", lw=0.8, ls="--")
            if axis == "head":
                ax.set_xticks(range(m.shape[1]))
                ax.set_xlabel("KV head")
                if head is not None:
                    ax.add_patch(Rectangle((head - 0.5, -0.5), 1, m.shape[0], fill=False, ec="cyan", lw=1.5))
            else:
                ax.set_xlabel("token position in z (token text)")
                for name, s in blocks.items():
                    if lo <= s < hi:
                        ax.axvline(s - 0.5, color="cyan", ls=":", lw=1)
                block_labels(ax, blocks, lo, hi)
                token_ticks(ax, tokens, lo, hi)
            ax.set_title(f"{k}s: drift per {axis}", fontsize=9, loc="left", pad=TITLE_PAD)
    assert im is not None  # kinds is never empty (kinds[0] is read above), so the loop drew at least one image
    fig.colorbar(im, ax=axes, shrink=0.7, label="relative L2 (log; white: exactly 0)")
    fig.suptitle(title, fontsize=10)
    return fig


TITLE_PAD = 24
"""Points between a position axis and its title: room for the two rows of block names (:func:`block_labels`)."""


def block_labels(ax, blocks: Mapping[str, int], lo: int = 0, hi: int | None = None) -> None:
    """Name each block of z above a position axis at its first position (``lo <= start < hi``), alternating between
    two heights so that the names of neighbouring blocks do not overlap; the axes' title sits above both rows
    (:data:`TITLE_PAD`). Each name is an annotation whose ``xy`` is ``(start, 1)`` (:func:`kvreplay.notebook.explorer.zoom`
    hides those outside a window)."""
    shown = sorted((s, name) for name, s in blocks.items() if lo <= s < (hi if hi is not None else s + 1))
    for i, (s, name) in enumerate(shown):
        ax.annotate(name, (s, 1.0), xycoords=ax.get_xaxis_transform(), xytext=(1, 1 + 10 * (i % 2)),
                    textcoords="offset points", color="tab:blue", fontsize=7, va="bottom", ha="left")


def token_ticks(ax, tokens: Sequence[str], lo: int = 0, hi: int | None = None, max_labels: int = 80) -> None:
    """Label x positions ``lo..hi-1`` with their token text (every k-th position when there are more than ``max_labels``)."""
    hi = len(tokens) if hi is None else hi
    step = max(1, math.ceil((hi - lo) / max_labels))
    ticks = list(range(lo, hi, step))
    ax.set_xticks(ticks, [f"{tokens[p]}" if step == 1 else f"{p}:{tokens[p]}" for p in ticks], rotation=90, fontsize=6)


def explorer_view(maps: Mapping[tuple[str, str], pd.DataFrame], detail: np.ndarray, tokens: Sequence[str],
                  blocks: Mapping[str, int], *, layer: int, head: int, kind: str, title: str):
    """The explorer's main view for one kind (K or V): layers x positions, layers x heads, and one layer/head per position.

    Args:
        maps: :func:`kvreplay.report.rebuild.drift_maps` output.
        detail: relative L2 per position ``[|z|]`` of the selected layer and head (NaN where the reference is 0).
        tokens: token text per position of z.
        blocks: block name -> first position in z.
        layer, head, kind: the selection (highlighted in the maps).
        title: the figure title.

    Returns:
        the figure (log colour scale and log y axis; exact zeros white / on the ``0 (exact)`` band).
    """
    pos_map = maps[(kind, "position")].to_numpy().astype(float)
    head_map = maps[(kind, "head")].to_numpy().astype(float)
    vals = np.concatenate([pos_map.ravel(), head_map.ravel()])
    good = vals[np.isfinite(vals) & (vals > 0)]
    vmin, vmax = (good.min(), good.max()) if len(good) else (1e-12, 1e-11)
    vmax = vmax if vmax > vmin else vmin * 10
    norm = LogNorm(vmin=vmin, vmax=vmax)
    cmap = matplotlib.colormaps["magma"].with_extremes(under="white", bad="0.85")
    n = pos_map.shape[1]
    fig = _figure(figsize=(13, 7.6), constrained_layout=True)
    gs = fig.add_gridspec(2, 2, width_ratios=[1, 5], height_ratios=[1.25, 1])
    ax_head, ax_pos, ax_det = fig.add_subplot(gs[0, 0]), fig.add_subplot(gs[0, 1]), fig.add_subplot(gs[1, :])
    im = ax_pos.imshow(np.where(pos_map == 0, vmin / 10, pos_map), aspect="auto", origin="lower", cmap=cmap, norm=norm,
                       interpolation="nearest")
    ax_head.imshow(np.where(head_map == 0, vmin / 10, head_map), aspect="auto", origin="lower", cmap=cmap, norm=norm,
                   interpolation="nearest")
    ax_head.add_patch(Rectangle((head - 0.5, -0.5), 1, head_map.shape[0], fill=False, ec="cyan", lw=1.5))
    ax_head.set_xticks(range(head_map.shape[1]))
    ax_head.set_xlabel("KV head")
    ax_head.set_title(f"{kind}s: drift per head", fontsize=9, loc="left", pad=TITLE_PAD)
    for ax in (ax_head, ax_pos):
        ax.axhline(layer, color="cyan", lw=0.9, ls="--")
        ax.set_ylabel("layer")
        integer_axis(ax.yaxis)
    ax_pos.set_title(f"{kind}s: drift per position (all heads)", fontsize=9, loc="left", pad=TITLE_PAD)
    token_ticks(ax_pos, tokens, 0, n)
    fig.colorbar(im, ax=[ax_head, ax_pos], shrink=0.9, label="relative L2 (log; white: exactly 0)")
    floor = log_with_exact(ax_det, pd.Series(detail).fillna(0))
    x = np.arange(n)
    d = np.nan_to_num(detail, nan=0.0)
    ax_det.vlines(x, floor / 3, at_floor(d, floor), color="#c44e52", lw=1)
    ax_det.plot(x, at_floor(d, floor), "o", color="#c44e52", ms=2.5)
    ax_det.set_xlim(-0.5, n - 0.5)
    token_ticks(ax_det, tokens, 0, n)
    ax_det.set_ylabel("relative L2 over head_dim")
    ax_det.set_title(f"layer {layer}, KV head {head}, {kind}s: drift per position", fontsize=9, loc="left",
                     pad=TITLE_PAD)
    for ax in (ax_pos, ax_det):
        for name, s0 in blocks.items():
            ax.axvline(s0 - 0.5, color="tab:cyan" if ax is ax_pos else "0.4", ls=":", lw=1)
        block_labels(ax, blocks)
    fig.suptitle(title, fontsize=10)
    return fig


def topk_logits(topk: pd.DataFrame, ref: str, other: str, *, title: str):
    """Boundary logits of two states on the union of their top-k tokens, and their difference.

    Args:
        topk: :func:`kvreplay.report.rebuild.topk_frame` (``text``, ``reference``, ``other``, ``other - reference``).
        ref, other: arm names for the legend.
    """
    fig = _figure(figsize=(12, 3.8), constrained_layout=True)
    axes = fig.subplots(1, 2)
    x = np.arange(len(topk))
    axes[0].bar(x - 0.2, topk["reference"], width=0.4, label=ref)
    axes[0].bar(x + 0.2, topk["other"], width=0.4, label=other)
    lo = topk[["reference", "other"]].min().min()
    hi = topk[["reference", "other"]].max().max()
    axes[0].set_ylim(lo - 1, hi + 0.5)
    axes[1].bar(x, topk["other - reference"], color="#c44e52")
    axes[1].axhline(0, color="0.3", lw=0.8)
    for ax in axes:
        ax.set_xticks(x, topk["text"], rotation=60, fontsize=7)
        ax.set_xlabel("token (text)")
    axes[0].legend(fontsize=8)
    axes[0].set_ylabel("boundary logit")
    axes[1].set_ylabel(f"{other} − {ref} (logit)")
    fig.suptitle(title, fontsize=10)
    return fig
