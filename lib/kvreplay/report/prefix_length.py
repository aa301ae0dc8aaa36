"""Divergence by boundary-prefix length: rows and divergences per length bin, a logistic fit, one figure.

An exploratory analysis, not a registered endpoint. The paper's boundary prefixes are 1,025-5,080 tokens
(:data:`PAPER_RANGE`); ours are far shorter. Each Experiment 1 BF16 row (prefill against live, paper §4.1) is one
observation: its prefix length in tokens and whether the two suffixes part. The logistic regression of "suffixes
part" on prefix length (statsmodels GLM, binomial family, logit link, Wald 95% intervals) is drawn only inside
the observed range; its value over the paper's range is an extrapolation beyond the data and labelled so. Across
rows a longer prefix is also another problem, so the association says nothing about the effect of length itself.
The manipulated-length arm (``exp1_length``: the same problems at another branch cap) speaks to that where a
profile ran it (:func:`length_arm_text` says which, from the ledgers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from ..analysis.stats import wilson
from .figure_style import PRECISION_COLORS, integer_axis

BIN_EDGES = (0, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 5120, 6144)
"""Prefix-length bin edges in tokens, fixed before any rate was read: bins are ``(lo, hi]``."""

PAPER_RANGE = (1025, 5080)
"""The paper's boundary-prefix lengths, first and last, in tokens."""

PER_TOKENS = 1000
"""The logistic slope is reported per this many prefix tokens (odds ratio per 1,000 tokens)."""

MIN_ROWS = 10
"""Fewer rows than this get no fit (the table and figure say so)."""


def family_of(model: dict) -> str:
    """A model family's label from a ledger's recorded model identity: its file (or name) and architecture."""
    name = str(model.get("file") or model.get("model") or "?")
    return f"{name} ({model['architecture']})" if model.get("architecture") else name


def prefix_length_frame(records: Sequence[Any], profile: str, family: str) -> pd.DataFrame:
    """One row per Experiment 1 record: ``profile``, ``family``, ``problem_id``, ``prefix_len`` (tokens, int),
    ``diverged`` (bool: the prefill and live suffixes part, ``endpoints.suffix_differs``) and ``tie_initiated``.

    Raises:
        ValueError: a record without ``prefix_len`` or ``endpoints.suffix_differs`` (naming its problem ID).
    """
    rows = []
    for r in records:
        ends = r.get("endpoints") or {}
        if r.get("prefix_len") is None or ends.get("suffix_differs") is None:
            raise ValueError(f"row {r.get('problem_id')!r} has no prefix_len or endpoints.suffix_differs")
        rows.append({"profile": profile, "family": family, "problem_id": r["problem_id"],
                     "prefix_len": int(r["prefix_len"]), "diverged": bool(ends["suffix_differs"]),
                     "tie_initiated": bool(ends.get("tie_initiated"))})
    return pd.DataFrame(rows, columns=["profile", "family", "problem_id", "prefix_len", "diverged", "tie_initiated"])


def bin_table(frame: pd.DataFrame, edges: Sequence[int] = BIN_EDGES) -> pd.DataFrame:
    """Rows and divergences per prefix-length bin (``(lo, hi]`` tokens), per profile and family, bins with rows only.

    Columns: ``profile``, ``family``, ``prefix tokens``, ``rows``, ``suffixes part`` (count), ``tie-initiated``
    (count), ``rate [Wilson 95%]`` (text, percent).

    Raises:
        ValueError: a prefix length outside ``edges``.
    """
    if len(frame) and (frame.prefix_len.max() > edges[-1] or frame.prefix_len.min() <= edges[0]):
        raise ValueError(f"prefix lengths {frame.prefix_len.min()}-{frame.prefix_len.max()} fall outside the bins "
                         f"{edges[0]}-{edges[-1]}")
    out = []
    for (profile, family), g in frame.groupby(["profile", "family"], sort=False):
        cut = pd.cut(g.prefix_len, bins=list(edges))
        for interval, b in g.groupby(cut, observed=True):
            p = wilson(int(b.diverged.sum()), len(b))
            out.append({"profile": profile, "family": family,
                        "prefix tokens": f"{int(interval.left) + 1}-{int(interval.right)}", "rows": len(b),
                        "suffixes part": int(b.diverged.sum()), "tie-initiated": int((b.diverged & b.tie_initiated).sum()),
                        "rate [Wilson 95%]": f"{100 * p.rate:.1f}% [{100 * p.low:.1f}, {100 * p.high:.1f}]"})
    return pd.DataFrame(out)


@dataclasses.dataclass
class LogisticFit:
    """A logistic regression of "suffixes part" on prefix length for one profile and family.

    Attributes:
        profile, family: whose rows; rows, divergent: how many, and how many part.
        observed: the shortest and longest prefix, tokens.
        odds_ratio, odds_ratio_ci: the odds ratio per :data:`PER_TOKENS` prefix tokens and its Wald 95% interval.
        p_value: the slope's Wald p-value.
        curve: the fitted probability ``p`` with ``low`` and ``high`` (95%) at ``prefix_len`` (tokens), and
            ``extrapolated`` (bool): True outside ``observed``.
        note: why there is no fit (every row parts, or none), else None; then the other fields are None/empty.
    """
    profile: str
    family: str
    rows: int
    divergent: int
    observed: tuple[int, int]
    odds_ratio: float | None = None
    odds_ratio_ci: tuple[float, float] | None = None
    p_value: float | None = None
    curve: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)
    note: str | None = None

    def at(self, tokens: int) -> pd.Series:
        """The curve's row nearest ``tokens`` (``p``, ``low``, ``high``, ``extrapolated``)."""
        return self.curve.iloc[(self.curve.prefix_len - tokens).abs().argmin()]


def logistic_fit(frame: pd.DataFrame, extrapolate_to: tuple[int, int] = PAPER_RANGE, points: int = 60) -> LogisticFit:
    """Fit ``diverged ~ 1 + prefix_len / PER_TOKENS`` to one profile and family's rows (``frame`` of
    :func:`prefix_length_frame`), and evaluate it over the observed range and over ``extrapolate_to``.

    Raises:
        ValueError: ``frame`` holds more than one profile or family, or no row.
    """
    import statsmodels.api as sm

    if frame.empty or frame.profile.nunique() != 1 or frame.family.nunique() != 1:
        raise ValueError("logistic_fit takes the rows of exactly one profile and family")
    y = frame.diverged.astype(float).to_numpy()
    lo, hi = int(frame.prefix_len.min()), int(frame.prefix_len.max())
    fit = LogisticFit(str(frame.profile.iloc[0]), str(frame.family.iloc[0]), len(frame), int(y.sum()), (lo, hi))
    if len(y) < MIN_ROWS:
        fit.note = f"no fit: {len(y)} rows, fewer than {MIN_ROWS}"
        return fit
    if y.min() == y.max():
        fit.note = f"no fit: {'every' if y.min() else 'no'} row's suffixes part"
        return fit
    x = sm.add_constant(frame.prefix_len.to_numpy() / PER_TOKENS)
    res = sm.GLM(y, x, family=sm.families.Binomial()).fit()
    slope_lo, slope_hi = res.conf_int(alpha=0.05)[1]
    fit.odds_ratio, fit.odds_ratio_ci = float(np.exp(res.params[1])), (float(np.exp(slope_lo)), float(np.exp(slope_hi)))
    fit.p_value = float(res.pvalues[1])
    grid = np.unique(np.concatenate([np.linspace(lo, hi, points), np.linspace(*extrapolate_to, points),
                                     [lo, hi, *extrapolate_to]])).round().astype(int)
    pred = res.get_prediction(sm.add_constant(grid / PER_TOKENS, has_constant="add")).summary_frame(alpha=0.05)
    fit.curve = pd.DataFrame({"prefix_len": grid, "p": pred["mean"].to_numpy(), "low": pred["mean_ci_lower"].to_numpy(),
                              "high": pred["mean_ci_upper"].to_numpy(), "extrapolated": (grid < lo) | (grid > hi)})
    return fit


def fit_table(fits: Sequence[LogisticFit], extrapolate_to: tuple[int, int] = PAPER_RANGE) -> pd.DataFrame:
    """One row per fit: rows, divergences, observed range, odds ratio per 1,000 tokens with its interval and
    p-value. Then the fitted rate at the shortest and longest observed prefix and at the ends of ``extrapolate_to``,
    each marked "EXTRAPOLATION beyond the data" where it lies outside the observed range."""
    def rate(f: LogisticFit, tokens: int) -> str:
        r = f.at(tokens)
        text = f"{100 * r.p:.1f}% [{100 * r.low:.1f}, {100 * r.high:.1f}]"
        return text + (" EXTRAPOLATION beyond the data" if not f.observed[0] <= tokens <= f.observed[1] else "")

    out = []
    for f in fits:
        row: dict[str, Any] = {"profile": f.profile, "family": f.family, "rows": f.rows, "suffixes part": f.divergent,
                               "prefix tokens observed": f"{f.observed[0]}-{f.observed[1]}"}
        if f.note:
            row["odds ratio per 1,000 tokens [95%]"] = f.note
        else:
            assert f.odds_ratio is not None and f.odds_ratio_ci is not None and f.p_value is not None
            row |= {"odds ratio per 1,000 tokens [95%]": f"{f.odds_ratio:.3g} [{f.odds_ratio_ci[0]:.3g}, "
                                                         f"{f.odds_ratio_ci[1]:.3g}]",
                    "p (Wald)": f"{f.p_value:.2g}",
                    "fitted rate, shortest prefix": rate(f, f.observed[0]),
                    "fitted rate, longest prefix": rate(f, f.observed[1]),
                    f"fitted rate at {extrapolate_to[0]:,} tokens (the paper's shortest)": rate(f, extrapolate_to[0]),
                    f"fitted rate at {extrapolate_to[1]:,} tokens (the paper's longest)": rate(f, extrapolate_to[1])}
        out.append(row)
    return pd.DataFrame(out)


def prefix_length_figure(frame: pd.DataFrame, fit: LogisticFit, title: str,
                         extrapolate_to: tuple[int, int] = PAPER_RANGE, edges: Sequence[int] = BIN_EDGES):
    """The figure: per-bin divergence rates with Wilson 95% intervals and row counts, each row as a tick at 0 or 1.
    The logistic fit is drawn with its 95% band inside the observed range (solid); dashed and labelled, its
    extrapolation over the paper's range, which is shaded. Returns the matplotlib figure."""
    color = PRECISION_COLORS["bfloat16"]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ax.axvspan(*extrapolate_to, color="0.93", zorder=0, lw=0)
    ax.text(sum(extrapolate_to) / 2, 1.05, f"the paper's prefixes ({extrapolate_to[0]:,}-{extrapolate_to[1]:,} tokens)",
            ha="center", va="bottom", fontsize=8, color="0.35")
    jitter = np.random.default_rng(0).uniform(-0.015, 0.015, len(frame))
    ax.scatter(frame.prefix_len, frame.diverged.astype(float) + jitter, marker="|", s=30, color="0.45", lw=0.8,
               label="one row (suffixes part = 1)")
    cut = pd.cut(frame.prefix_len, bins=list(edges))
    for interval, b in frame.groupby(cut, observed=True):
        p = wilson(int(b.diverged.sum()), len(b))
        mid = b.prefix_len.median()
        ax.errorbar(mid, p.rate, yerr=[[p.rate - p.low], [p.high - p.rate]], fmt="o", color="black", ms=4, capsize=3)
        ax.annotate(f"{int(b.diverged.sum())}/{len(b)}", (mid, p.high), textcoords="offset points", xytext=(0, 4),
                    ha="center", fontsize=7)
    ax.plot([], [], "o", color="black", ms=4, label="rate per length bin, Wilson 95%")
    if fit.note is None:
        inside, beyond = fit.curve[~fit.curve.extrapolated], fit.curve[fit.curve.prefix_len > fit.observed[1]]
        ax.plot(inside.prefix_len, inside.p, color=color, lw=2, label="logistic fit (observed range), 95% band")
        ax.fill_between(inside.prefix_len, inside.low, inside.high, color=color, alpha=0.2, lw=0)
        if len(beyond):
            ax.plot(beyond.prefix_len, beyond.p, color=color, lw=1.2, ls="--",
                    label="EXTRAPOLATION beyond the data (not evidence)")
    else:
        ax.text(0.02, 0.5, fit.note, transform=ax.transAxes, fontsize=9)
    ax.set_xlim(0, max(extrapolate_to[1], fit.observed[1]) * 1.03)
    ax.set_ylim(-0.05, 1.12)
    ax.set_xlabel("boundary prefix length, tokens")
    ax.set_ylabel("P(suffixes part), Exp 1 BF16")
    integer_axis(ax.xaxis)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="lower right", frameon=True)
    fig.tight_layout()
    return fig


def length_arm_text(profile_root: str | Path) -> str:
    """One sentence on whether a profile runs the same problems at two branch caps, read from its ledger folders.

    ``profile_root`` is ``data/ledgers/<profile>``; the manipulated-length arm's folders are ``exp1_length-*``, the
    chain's cap is Experiment 1 BF16's (``caps.branch`` of its manifest's config).

    Raises:
        LedgerFileError: a damaged manifest (naming it).
    """
    from ..ledger.files import read_manifest
    from ..ledger.store import read_rows_text

    root = Path(profile_root)
    name = f"`{root.name}`"
    chain = sorted(root.glob("exp1-bfloat16-*/manifest.json"))
    caps = [read_manifest(f.parent)["config"]["caps"]["branch"] for f in chain]
    arms = sorted(root.glob("exp1_length-*/manifest.json"))
    if not arms:
        return (f"{name} runs no arm at a second branch cap (no `exp1_length` ledger), so there a longer prefix is "
                "also another problem.")
    parts = []
    for f in arms:
        config = read_manifest(f.parent)["config"]
        rows = len(read_rows_text(f.parent).splitlines())
        parts.append(f"{rows} of its {len(config['problem_ids'])} problems at branch cap {config['caps']['branch']}")
    beside = f" beside the chain's {caps[0]}" if caps else ""
    return (f"{name} runs Experiment 1 BF16 on the same problems at a second branch cap (`exp1_length`: "
            f"{'; '.join(parts)}{beside}; `figures/{root.name}/table_exp1_length`).")
