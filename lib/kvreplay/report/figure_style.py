"""The conventions every figure of :mod:`kvreplay.report.figures` shares: colours, markers, and log axes with a
``0 (exact)`` band for values that are exactly 0 (bit-exact tensors). Re-exported by :mod:`kvreplay.report.figures`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import LogFormatterSciNotation, MaxNLocator

OUTCOME_COLORS = {"donor": "#55a868", "recipient": "#c44e52", "third": "#8172b2", "baseline": "#999999"}
"""Colour of each transplant outcome (the suffix follows the donor, the recipient, neither, or the shared baseline)."""

PRECISION_COLORS = {"bfloat16": "#c44e52", "float32": "#4c72b0"}
KIND_MARKERS = {"key": "o", "value": "s"}


# ----------------------------------------------------------------------------- shared helpers


def exact_floor(values) -> float:
    """Where exact zeros are drawn on a log axis: one decade below the smallest positive value (1e-12 if none)."""
    v = np.asarray(pd.Series(values, dtype="float64").dropna())
    pos = v[v > 0]
    return float(10 ** (np.floor(np.log10(pos.min())) - 1)) if len(pos) else 1e-12


def log_with_exact(ax, values, floor: float | None = None) -> float:
    """Make ``ax``'s y axis logarithmic with a ``0 (exact)`` band at ``floor`` for values that are exactly 0.

    Args:
        ax: the axes; values are plotted by the caller through :func:`at_floor`.
        values: every y value the panel will show (its limits come from them alone).
        floor: the y at which zeros are drawn (default :func:`exact_floor`).

    Returns:
        the floor used.
    """
    v = np.asarray(pd.Series(values, dtype="float64").dropna())
    floor = exact_floor(v) if floor is None else floor
    top = v.max() if len(v) and v.max() > 0 else floor * 10
    ax.set_yscale("log")
    ax.set_ylim(floor / 3, top * 3)
    ax.axhspan(floor / 3, floor * 3, color="0.93", zorder=0, lw=0)
    ax.yaxis.set_major_formatter(_ExactFormatter(floor))
    return floor


class _ExactFormatter(LogFormatterSciNotation):
    """Log-axis labels, with the tick at the exact-zero floor labelled ``0 (exact)`` instead of its power of ten."""

    def __init__(self, floor: float, label: str = "0 (exact)"):
        super().__init__()
        self.floor, self.label = floor, label

    def __call__(self, x, pos=None):
        if x > 0 and abs(math.log10(x) - math.log10(self.floor)) < 1e-9:
            return self.label
        return super().__call__(x, pos)


def at_floor(values, floor: float) -> np.ndarray:
    """``values`` with exact zeros moved to ``floor`` (for plotting on :func:`log_with_exact` axes)."""
    v = np.asarray(values, dtype="float64").copy()
    v[v == 0] = floor
    return v


def integer_axis(axis) -> None:
    """Integer-only ticks on a count axis (``ax.yaxis`` or ``ax.xaxis``)."""
    axis.set_major_locator(MaxNLocator(integer=True))


def _layer_lines(ax, frame: pd.DataFrame, y: str, hue: str, colors: Mapping | None = None, floor: float = 1e-12,
                 style: str | None = None) -> None:
    """Per-layer curves of ``frame[y]`` (zeros on the floor), one per ``hue`` (and ``style``) value."""
    groups = [hue] + ([style] if style else [])
    palette = colors or {}
    default = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (keys, sub) in enumerate(frame.sort_values("layer").groupby(groups, sort=False)):
        keys = keys if isinstance(keys, tuple) else (keys,)
        color = palette.get(keys[0], default[i % len(default)])
        marker = KIND_MARKERS.get(keys[1], "o") if style else "o"
        ls = "-" if not style or keys[1] == "key" else "--"
        ax.plot(sub["layer"], at_floor(sub[y], floor), marker=marker, ls=ls, color=color, ms=4, lw=1.2,
                label=" ".join(str(k) for k in keys))
    integer_axis(ax.xaxis)
    ax.set_xlabel("layer")
    mark_layer_kinds(ax, frame)


def mark_layer_kinds(ax, frame: pd.DataFrame) -> None:
    """Shade the full-attention layers of a model with sliding-window layers (``frame["layer_kind"]``) and say so.

    A frame without ``layer_kind`` (a model whose every layer is full attention) is left as it is.
    """
    if "layer_kind" not in frame or not (frame["layer_kind"] == "sliding").any():
        return
    for layer in sorted(frame.loc[frame["layer_kind"] == "full", "layer"].unique()):
        ax.axvspan(layer - 0.5, layer + 0.5, color="#e3ecf7", zorder=0, lw=0)  # apart from the grey "0 (exact)" band
    ax.set_xlabel("layer (shaded: full attention; others: sliding window, drift over the attended positions)",
                  fontsize=8)
