"""The paper's figures, drawn from data frames (no model, no ledger I/O).

Every function takes frames built by :mod:`kvreplay.report.frames`,
:mod:`kvreplay.report.files` or :mod:`kvreplay.experiments.replication` and returns a
matplotlib ``Figure``; the notebooks save it with
:func:`kvreplay.report.files.save_figure`, which also shows it inline.

Conventions shared by every figure here:

* drift (relative L2, max |Δ|) is drawn on a log axis; values that are
  exactly 0 (bit-exact tensors) sit on a separate band at the bottom,
  labelled ``0 (exact)``, so no axis height is spent on negative values;
* each panel gets its own y-limits from its own data;
* count axes have integer ticks and say what they count;
* outcomes that are yes/no per row are drawn as dots, never joined by lines.

The shared conventions' colours and axes are in :mod:`.figure_style`, the drift explorer's figures in
:mod:`.explorer_figures`; both are re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from .explorer_figures import drift_heatmaps, explorer_layers, explorer_view, token_ticks, topk_logits
from .figure_style import (
    KIND_MARKERS, OUTCOME_COLORS, PRECISION_COLORS, _ExactFormatter, _layer_lines, at_floor, exact_floor, integer_axis, log_with_exact,
    mark_layer_kinds,
)


# ----------------------------------------------------------------------------- Figure 1


def design_figure(caps: Mapping[str, int], batch: int, profile: str):
    """Figure 1: the matched live/prefill design of Experiment 1 as a block diagram.

    Args:
        caps: ``{"branch", "merge", "answer"}`` token caps of the profile.
        batch: duplicate rows of the shared suffix decoder (``kvreplay.decoding.decode.BATCH``).
        profile: profile name, for the title.

    Returns:
        the figure (12.5 x 5 in).
    """
    LIVE, PRE, SHARED, CMP = "#cfe3f5", "#f8dcc4", "#e4e4e4", "#d9efd3"
    # name: (column, row, width, height, text, colour) on a grid of 2.5 x 1.0 units
    layout = {
        "problem": (0, 4.0, 1.7, 1.1, "problem x\nprompt block\n(role 0)", SHARED),
        "live": (1, 3.8, 2.4, 1.5, f"live greedy decode\nprompt in one call, then\none token per call;\n"
                                  f"branches 1-3 (cap {caps['branch']})\nthrough the merge opener", LIVE),
        "z": (1, 1.1, 2.4, 1.3, "boundary prefix z\n(integer token IDs;\nroles rebuilt from IDs)", SHARED),
        "live cache": (2, 4.3, 2.3, 0.95, "live cache\n(its DynamicCache)", LIVE),
        "live replica": (2, 3.0, 2.3, 0.95, "live replica\n(deep copy, verified)", LIVE),
        "prefill": (2, 1.9, 2.3, 0.95, "prefill cache\n(one forward call over z)", PRE),
        "prefill replica": (2, 0.6, 2.3, 0.95, "prefill replica\n(second, independent call)", PRE),
        "decoder": (3, 1.4, 1.9, 3.4, f"one shared\nsuffix decoder\n\nmerge (cap {caps['merge']})\nanswer (cap {caps['answer']})"
                                      f"\n\nsame masks, positions,\nschedule; batch of\n{batch} duplicates", SHARED),
        "floors": (4, 3.6, 1.8, 1.6, "replica floors\nlive = live replica\nprefill = prefill replica\n(must be exact)", CMP),
        "contrast": (4, 0.8, 1.8, 2.2, "primary contrast\nprefill vs live:\ncache drift, logits,\nsuffix, answer,\n"
                                       "correctness,\nfirst divergence", CMP),
    }
    column_x = [0.1, 2.3, 5.3, 8.2, 10.6]
    fig, ax = plt.subplots(figsize=(12.5, 5))
    ax.set_xlim(0, 12.5)
    ax.set_ylim(0.45, 6.2)
    ax.axis("off")
    boxes = {}
    for name, (col, y, w, h, text, color) in layout.items():
        x = column_x[col]
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05,rounding_size=0.12", fc=color, ec="0.25", lw=1))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8.5)
        boxes[name] = (x, y, w, h)

    def side(name, where, f=0.5):
        x, y, w, h = boxes[name]
        return {"right": (x + w, y + f * h), "left": (x, y + f * h), "top": (x + f * w, y + h), "bottom": (x + f * w, y)}[where]

    def arrow(p, q, text="", color="0.2", lw=1.2):
        ax.add_patch(FancyArrowPatch(p, q, arrowstyle="-|>", mutation_scale=12, color=color, lw=lw))
        if text:
            ax.text((p[0] + q[0]) / 2 + 0.1, (p[1] + q[1]) / 2, text, fontsize=7.5, color="0.25", va="center")

    arrow(side("problem", "right"), side("live", "left"))
    arrow(side("live", "right", 0.75), side("live cache", "left"))
    arrow(side("live cache", "bottom"), side("live replica", "top"), "copy")
    arrow(side("live", "bottom"), side("z", "top"), "token IDs reached")
    arrow(side("z", "right", 0.7), side("prefill", "left"))
    arrow(side("z", "right", 0.3), side("prefill replica", "left"))
    dx, dy, dw, dh = boxes["decoder"]
    for name in ("live cache", "live replica", "prefill", "prefill replica"):
        p = side(name, "right")
        arrow(p, (dx, min(max(p[1], dy + 0.2), dy + dh - 0.2)), color="0.45", lw=1)
    arrow(side("decoder", "right", 0.75), side("floors", "left"))
    arrow(side("decoder", "right", 0.25), side("contrast", "left"))
    ax.text(6.25, 5.95, "fail-closed gates on every row: dtype · identical token/role/position state · duplicate rows in sync "
            "(desync) · replicas exact · disjoint storage", ha="center", fontsize=8, style="italic", color="0.3")
    ax.set_title(f"Figure 1: matched live/prefill design (Experiment 1; caps from profile {profile!r})", fontsize=10, loc="left")
    return fig


# ----------------------------------------------------------------------------- experiments 1 and 2


def first_divergence_hist(ax, x: Sequence[int], label: str = "rows") -> None:
    """Histogram of first-divergence positions (integer bins, integer count ticks) on ``ax``."""
    xs = np.asarray(x, dtype=int)
    if len(xs):
        bins = np.arange(0, xs.max() + 2) - 0.5 if xs.max() < 40 else 30
        ax.hist(xs, bins=bins, color="#4c72b0", alpha=0.85, label=label)
    integer_axis(ax.yaxis)
    integer_axis(ax.xaxis)
    ax.set_xlim(left=-0.5)
    ax.set_xlabel("first divergent suffix token (tokens after the boundary)")
    ax.set_ylabel("rows (count)")


def divergence_and_drift(firsts: pd.DataFrame, layers: pd.DataFrame, *, reference: str, title: str):
    """Experiment 1 or 2 overview: where suffixes first differ, and per-layer cache drift per precision.

    Args:
        firsts: ``precision``, ``first divergence`` (int, divergent rows only).
        layers: ``layer``, ``kind`` (key/value), ``rel_l2`` (median over rows), ``precision``
            (:func:`kvreplay.report.files.drift_by_layer` per precision).
        reference: the reference arm's name (``live`` or ``incremental``), for the labels.
        title: the figure title.

    Returns:
        the figure: left a histogram per precision (counts), right median relative L2 per layer
        on a log axis with a ``0 (exact)`` band.
    """
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), constrained_layout=True)
    ax = axes[0]
    if len(firsts):
        x = firsts["first divergence"].astype(int)
        bins = np.arange(0, x.max() + 2) - 0.5 if x.max() < 40 else 30
        for d, sub in firsts.groupby("precision", sort=False):
            ax.hist(sub["first divergence"].astype(int), bins=bins, alpha=0.7, color=PRECISION_COLORS.get(d), label=f"{d} ({len(sub)} rows)")
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no suffix diverged", ha="center", va="center", transform=ax.transAxes)
    integer_axis(ax.yaxis)
    integer_axis(ax.xaxis)
    ax.set_xlim(left=-0.5)
    ax.set_xlabel("first divergent suffix token (tokens after the boundary)")
    ax.set_ylabel("divergent rows (count)")
    ax = axes[1]
    floor = log_with_exact(ax, layers["rel_l2"])
    _layer_lines(ax, layers, "rel_l2", "precision", PRECISION_COLORS, floor, style="kind")
    ax.set_ylabel(f"median relative L2 (prefill vs {reference})")
    ax.legend(fontsize=7, ncols=2)
    fig.suptitle(title, fontsize=10)
    return fig


def fixed_prefix_drift(layers: pd.DataFrame, per_row: pd.DataFrame, *, title: str):
    """Experiment 2: per-layer drift (median over rows) and each row's whole-cache drift, per precision.

    Args:
        layers: ``layer``, ``kind``, ``rel_l2``, ``precision``.
        per_row: ``precision``, ``rel_l2`` (whole cache, one value per row), ``suffix differs`` (bool).
        title: the figure title.

    Returns:
        the figure; both panels on log axes with a ``0 (exact)`` band.
    """
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), constrained_layout=True)
    floor = log_with_exact(axes[0], layers["rel_l2"])
    _layer_lines(axes[0], layers, "rel_l2", "precision", PRECISION_COLORS, floor, style="kind")
    axes[0].set_ylabel("median relative L2 (prefill vs incremental)")
    axes[0].legend(fontsize=7, ncols=2)
    ax = axes[1]
    floor = log_with_exact(ax, per_row["rel_l2"])
    precisions = list(dict.fromkeys(per_row["precision"]))
    for i, d in enumerate(precisions):
        for differs, dx, marker in ((False, -0.12, "o"), (True, 0.12, "X")):
            sub = per_row[(per_row["precision"] == d) & (per_row["suffix differs"] == differs)]
            if len(sub):
                ax.scatter(np.full(len(sub), i + dx), at_floor(sub["rel_l2"], floor), marker=marker, s=28, alpha=0.8,
                           color=PRECISION_COLORS.get(d), label=f"suffix {'differs' if differs else 'same'}" if i == 0 or d == precisions[-1] else None)
    ax.set_xticks(range(len(precisions)), precisions)
    ax.set_xlim(-0.6, len(precisions) - 0.4)
    handles = [plt.Line2D([], [], marker=m, ls="", color="0.3", label=lbl) for m, lbl in (("o", "suffix same"), ("X", "suffix differs"))]
    ax.legend(handles=handles, fontsize=7)
    ax.set_ylabel("whole-cache relative L2 per row")
    fig.suptitle(title, fontsize=10)
    return fig


def first_divergence(firsts: pd.DataFrame, stats: Mapping[str, Mapping], *, title: str):
    """First divergence per comparison: histogram with quartile lines, one panel per group.

    Args:
        firsts: ``group``, ``first_divergence`` (:func:`kvreplay.report.frames.first_divergence_frame`).
        stats: per group ``{"rows", "divergent", "q1", "median", "q3"}`` (q1/q3 None below two values).
        title: the figure title.
    """
    groups = list(stats)
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 3.8), sharex=True, constrained_layout=True, squeeze=False)
    for ax, label in zip(axes[0], groups):
        s = stats[label]
        x = firsts.loc[firsts["group"] == label, "first_divergence"].to_numpy()
        first_divergence_hist(ax, x)
        if len(x):
            for q, ls, name in ((s.get("q1"), "--", "Q1 / Q3"), (s.get("median"), "-", "median"), (s.get("q3"), "--", None)):
                if q is not None:
                    ax.axvline(q, color="#c44e52", ls=ls, lw=1.2, label=name)
            quart = (f"Q1 {s['q1']:g}, median {s['median']:g}, Q3 {s['q3']:g}" if s.get("q1") is not None
                     else f"median {s['median']:g}")
            ax.set_title(f"{label}\n{len(x)}/{s['rows']} rows diverge; {quart}", fontsize=9)
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, f"no suffix diverged ({s['rows']} rows)", ha="center", va="center", transform=ax.transAxes)
            ax.set_title(label, fontsize=9)
    fig.suptitle(title, fontsize=10)
    return fig


def layer_drift(layer: pd.DataFrame, *, title: str):
    """Per-layer median relative drift, keys and values side by side, one curve per precision.

    Each panel has its own log y axis from its own values (a shared limit cut the value curves
    off), with a ``0 (exact)`` band for layers that are bit-exact on every row.

    Args:
        layer: ``layer``, ``kind`` (key/value), ``rel_l2``, ``precision``.
    """
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), constrained_layout=True)
    for ax, kind in zip(axes, ("key", "value")):
        sub = layer[layer["kind"] == kind]
        floor = log_with_exact(ax, sub["rel_l2"])
        _layer_lines(ax, sub, "rel_l2", "precision", PRECISION_COLORS, floor)
        ax.set_title(f"{kind}s", fontsize=9)
        ax.set_ylabel("median relative L2, prefill vs incremental")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return fig


# ----------------------------------------------------------------------------- transplants


def _wrap(label: str, width: int = 12) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(label.replace("_", " "), width)) or label


def localization(coarse: pd.DataFrame, sweep: pd.DataFrame, *, n_sweep_rows: int, title: str):
    """Experiment 4 (exploratory): outcomes of partial transplants among divergent rows.

    Args:
        coarse: indexed by intervention; columns ``follows donor``, ``follows recipient``,
            ``new (third) trajectory`` (row-direction counts, both directions summed).
        sweep: single-layer transplants: ``layer``, ``direction``, ``follows donor``, ``rows``.
        n_sweep_rows: rows in the single-layer sweep.
        title: the figure title.

    Returns:
        the figure: left stacked counts (integer ticks), right a dot grid layer x direction whose
        colour is the share of sweep rows following the donor (text: k/n).
    """
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), constrained_layout=True, gridspec_kw={"width_ratios": [1, 1.2]})
    ax = axes[0]
    if len(coarse):
        colors = {"follows donor": OUTCOME_COLORS["donor"], "follows recipient": OUTCOME_COLORS["recipient"],
                  "new (third) trajectory": OUTCOME_COLORS["third"]}
        bottom = np.zeros(len(coarse))
        labels = [_wrap(i) for i in coarse.index]
        for col, color in colors.items():
            if col in coarse:
                ax.bar(labels, coarse[col].to_numpy(), bottom=bottom, color=color, label=col)
                bottom += coarse[col].to_numpy()
        integer_axis(ax.yaxis)
        ax.set_ylabel("row-directions (count; both directions)")
        ax.tick_params(axis="x", labelsize=8)
        ax.legend(fontsize=7, title="suffix", title_fontsize=7)
        ax.set_title("whole / keys / values / halves, divergent rows", fontsize=9)
    else:
        ax.text(0.5, 0.5, "no divergent row in the panel", ha="center", va="center", transform=ax.transAxes)
    ax = axes[1]
    if len(sweep):
        dirs = list(dict.fromkeys(sweep["direction"]))
        layers = sorted(sweep["layer"].unique())
        grid = sweep.groupby(["direction", "layer"])[["follows donor", "rows"]].sum()
        for j, d in enumerate(dirs):
            for L in layers:
                k, n = grid.loc[(d, L)] if (d, L) in grid.index else (0, 0)
                share = k / n if n else np.nan
                ax.scatter(L, j, s=260, c=[[share]] if n else "white", cmap="RdYlGn", vmin=0, vmax=1, edgecolors="0.3")
                ax.text(L, j - 0.32, f"{int(k)}/{int(n)}", ha="center", va="top", fontsize=6)
        ax.set_yticks(range(len(dirs)), [d.replace("<-", " <- ") for d in dirs], fontsize=8)
        ax.set_ylim(-0.7, len(dirs) - 0.4)
        integer_axis(ax.xaxis)
        ax.set_xlabel("transplanted layer")
        sm = plt.cm.ScalarMappable(cmap="RdYlGn", norm=plt.Normalize(0, 1))
        fig.colorbar(sm, ax=ax, label="share of rows following the donor", shrink=0.8)
        ax.set_title(f"single-layer transplants ({n_sweep_rows} row(s); text: rows following the donor / rows)", fontsize=9)
    else:
        ax.text(0.5, 0.5, "no single-layer sweep", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    fig.suptitle(title, fontsize=10)
    return fig


def transplant_outcomes(coarse: pd.DataFrame, order: Sequence[str], directions: Sequence[str], *, title: str):
    """Transplant outcomes per stratum, direction and intervention (stacked row counts).

    Args:
        coarse: :func:`kvreplay.report.frames.transplant_outcomes` without single-layer interventions.
        order: interventions in drawing order (``whole``, the registered one, first).
        directions: the two transplant directions.
        title: the figure title.
    """
    strata = [s for s in ("divergent", "exact") if (coarse["stratum"] == s).any()] or ["divergent"]
    fig, axes = plt.subplots(len(strata), len(directions), figsize=(11, 3.2 * len(strata) + 0.7), squeeze=False,
                             sharey="row", constrained_layout=True)
    for i, stratum in enumerate(strata):
        for j, d in enumerate(directions):
            ax = axes[i, j]
            sub = coarse[(coarse["stratum"] == stratum) & (coarse["direction"] == d)].pivot_table(
                index="intervention", columns="outcome", values="rows", aggfunc="sum", fill_value=0).reindex(order, fill_value=0)
            bottom = np.zeros(len(sub))
            labels = [_wrap(f"{n} (registered)" if n == "whole" else n) for n in sub.index]
            for outcome, color in OUTCOME_COLORS.items():
                if outcome in sub.columns:
                    ax.bar(labels, sub[outcome], bottom=bottom, color=color, label=outcome)
                    bottom += sub[outcome].to_numpy()
            recipient, donor = d.split("<-")
            n = int(bottom.max()) if len(bottom) else 0
            ax.set_title(f"{stratum} rows (n = {n}): recipient {recipient} <- donor {donor}", fontsize=9)
            ax.set_ylabel("rows (count)")
            integer_axis(ax.yaxis)
            ax.tick_params(axis="x", labelsize=8)
    present = [o for o in OUTCOME_COLORS if (coarse["outcome"] == o).any()]
    handles = [plt.Rectangle((0, 0), 1, 1, color=OUTCOME_COLORS[o]) for o in present]
    if handles:
        fig.legend(handles, present, loc="outside lower center", ncols=4, fontsize=8, title="suffix of the transplanted state follows")
    fig.suptitle(title, fontsize=10)
    return fig


def replication(frame: pd.DataFrame, directions: Sequence[str], *, title: str):
    """Experiment 5: the panel by prefix length and the whole-cache transplant outcomes.

    Args:
        frame: :func:`kvreplay.experiments.replication.outcome_frame` (``problem_id``, ``prefix_len``,
            ``stratum``, one outcome column per direction).
        directions: the two transplant directions.
        title: the figure title.
    """
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), constrained_layout=True, gridspec_kw={"width_ratios": [1.3, 1]})
    ax = axes[0]
    frame = frame.reset_index(drop=True)
    for i, r in frame.iterrows():
        ok = all(r[d] in ("donor", "baseline") for d in directions)
        color = "#4c72b0" if r["stratum"] == "divergent" else "#999999"
        ax.bar(i, r["prefix_len"], color=color, edgecolor=color if ok else "black", hatch=None if ok else "//")
    ax.set_xticks(range(len(frame)), [p[-6:] for p in frame["problem_id"]], rotation=90, fontsize=6)
    ax.set_xlabel("panel row (problem ID, last 6 characters)")
    ax.set_ylabel("prefix length |z| (tokens)")
    integer_axis(ax.yaxis)
    ax.set_title(f"panel ({len(frame)} rows, order statistics of length): blue divergent, grey exact; hatched = not recovered", fontsize=8)
    ax = axes[1]
    strata = [st for st in ("divergent", "exact") if (frame["stratum"] == st).any()]
    xs = [f"{st}\n{d.replace('<-', ' <- ')}" for st in strata for d in directions]
    bottom = np.zeros(len(xs))
    for o, color in OUTCOME_COLORS.items():
        c = [int(((frame["stratum"] == st) & (frame[d] == o)).sum()) for st in strata for d in directions]
        if sum(c):
            ax.bar(xs, c, bottom=bottom, color=color, label=o)
            bottom += np.array(c)
    integer_axis(ax.yaxis)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_ylabel("rows (count)")
    ax.legend(title="suffix follows", fontsize=7, title_fontsize=7)
    ax.set_title("whole-cache transplant outcomes", fontsize=8)
    fig.suptitle(title, fontsize=9)
    return fig


# ----------------------------------------------------------------------------- near ties, adaptation


def near_tie(margin_sets: Mapping[str, pd.DataFrame], *, title: str):
    """Empirical CDFs of greedy margins at shared steps and at the first divergent step.

    Args:
        margin_sets: label -> :func:`kvreplay.report.frames.divergence_margins` frame
            (``margin`` >= 0, ``kind``).
        title: the figure title.

    Returns:
        the figure; x is logarithmic with exact ties (margin 0) in a ``0 (tie)`` band at the left.
    """
    allm = pd.concat(list(margin_sets.values()))["margin"] if margin_sets else pd.Series(dtype=float)
    floor = exact_floor(allm)
    fig, axes = plt.subplots(1, len(margin_sets), figsize=(5.5 * len(margin_sets), 3.9), sharex=True, constrained_layout=True,
                             squeeze=False)
    for ax, (label, df) in zip(axes[0], margin_sets.items()):
        first = df["kind"].str.startswith("first divergence")
        for kind, sel, color in (("shared", df["kind"] == "shared", "#4c72b0"), ("first divergence", first, "#c44e52")):
            m = np.sort(at_floor(df.loc[sel, "margin"].to_numpy(), floor))
            if len(m):
                n0 = int((df.loc[sel, "margin"] == 0).sum())
                ax.step(np.r_[m[0], m], np.r_[0, np.arange(1, len(m) + 1) / len(m)], where="post", color=color,
                        lw=1.6 if kind == "shared" else 2.2, label=f"{kind} (n = {len(m)}; {n0} exact ties)")
        for kind, marker, color in (("first divergence, exact tie", "x", "#8c1c13"), ("first divergence, margin > 0", "|", "#c44e52")):
            m = df.loc[df["kind"] == kind, "margin"].to_numpy()
            if len(m):
                ax.plot(at_floor(m, floor), np.full(len(m), -0.04), marker, color=color, ms=10, clip_on=False, label=f"{kind}: {len(m)}")
        ax.set_xscale("log")
        top = allm.max() if len(allm) and allm.max() > 0 else floor * 10
        ax.set_xlim(floor / 3, top * 3)
        ax.axvspan(floor / 3, floor * 3, color="0.93", zorder=0, lw=0)
        ax.xaxis.set_major_formatter(_ExactFormatter(floor, "0 (tie)"))
        ax.set_ylim(-0.08, 1.05)
        ax.set_xlabel("top-1 minus top-2 eligible logit margin (reference arm)")
        ax.set_ylabel("cumulative share of steps")
        n_div = int(first.sum())
        ax.set_title(f"{label}: {n_div} divergent rows" + ("" if n_div else " (nothing to compare)"), fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=10)
    return fig


def tie_margins(units: pd.DataFrame, bins: Sequence[str], *, title: str):
    """Histogram of greedy margins in BF16 spacings at the top logit's magnitude, one bar group per arm.

    Args:
        units: :func:`kvreplay.experiments.tie_rules.margin_units` (``arm``, ``units``, ``bin``), one row per
            model-chosen step.
        bins: the bin labels in order (:data:`kvreplay.experiments.tie_rules.BINS`).
        title: the figure title.

    Returns:
        the figure: y is the share of the arm's chosen steps in each bin (log), each arm's exact ties named in
        the legend.
    """
    arms = list(dict.fromkeys(units["arm"]))
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(bins) + 0.4 * len(arms)), 3.9), constrained_layout=True)
    width = 0.8 / max(len(arms), 1)
    x = np.arange(len(bins))
    for i, arm in enumerate(arms):
        sel = units.loc[units["arm"] == arm, "bin"]
        share = sel.value_counts().reindex(list(bins), fill_value=0).to_numpy() / len(sel)
        ax.bar(x + (i - (len(arms) - 1) / 2) * width, np.where(share > 0, share, np.nan), width,
               label=f"{arm} (n = {len(sel)}; {int((sel == bins[0]).sum())} exact ties)")
    ax.set_yscale("log")
    ax.set_xticks(x, list(bins), fontsize=8)
    ax.set_xlabel("top-1 minus top-2 eligible logit, in BF16 spacings at the top-1 logit's magnitude")
    ax.set_ylabel("share of the arm's chosen steps")
    ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=10)
    return fig


def adaptation_curve(train: pd.DataFrame, held: pd.DataFrame, steps: Mapping[str, int], *, n_heldout: int, title: str):
    """Role-table training: loss per step and held-out loss / letter accuracy.

    Args:
        train: ``step``, ``loss``.
        held: ``step``, ``loss``, ``merge``, ``answer``, ``letter_accuracy`` (0..1).
        steps: checkpoint name -> step (vertical markers).
        n_heldout: held-out rows, for the legend.
        title: the figure title.
    """
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), constrained_layout=True)
    ax = axes[0]
    ax.plot(train["step"], train["loss"], color="#4c72b0", lw=1, alpha=0.8, label="train (per step)")
    ax.plot(held["step"], held["loss"], "o-", color="#c44e52", label=f"held out ({n_heldout} rows)")
    ax.plot(held["step"], held["merge"], "s--", color="#dd8452", ms=4, lw=1, label="held out, merge part")
    ax.plot(held["step"], held["answer"], "^--", color="#55a868", ms=4, lw=1, label="held out, answer part")
    for name, step in steps.items():
        ax.axvline(step, color="0.5", ls=":", lw=1)
        ax.text(step, 1.0, f" {name}", va="bottom", fontsize=8, color="0.3", transform=ax.get_xaxis_transform())
    integer_axis(ax.xaxis)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean NLL, merge and answer halves)")
    ax.legend(fontsize=7)
    axes[1].plot(held["step"], held["letter_accuracy"], "o-", color="#8172b2")
    axes[1].set_ylim(-0.02, 1.02)
    integer_axis(axes[1].xaxis)
    axes[1].set_xlabel("optimizer step")
    axes[1].set_ylabel("held-out answer-letter accuracy (share)")
    fig.suptitle(title, fontsize=10)
    return fig


__all__ = [
    "OUTCOME_COLORS", "PRECISION_COLORS", "adaptation_curve", "at_floor", "design_figure", "divergence_and_drift",
    "drift_heatmaps", "exact_floor", "explorer_layers", "mark_layer_kinds", "explorer_view", "token_ticks", "first_divergence", "first_divergence_hist", "fixed_prefix_drift",
    "integer_axis", "layer_drift", "localization", "log_with_exact", "near_tie", "replication", "tie_margins",
    "topk_logits", "transplant_outcomes",
]
