"""The tie-rule control (exploratory, not in the paper): Experiment 1 BF16 under other greedy tie rules.

:data:`EXP1_TIES` runs Experiment 1's row and chunk functions once per rule of the profile's ``tie_rules``.
:func:`tie_rule_summary` contrasts each rule with the chain's own arm; :func:`tie_steps` and :func:`margin_units`
give each arm's exact-tie rate and margins in BF16 spacings (docs/experiments.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from ..arm_facts import declared_in
from ..ledger.records import Exp1Record, Exp1Row
from ..runner.arms import Arm, ArmPlan, Chain
from ..analysis.stats import Proportion, mcnemar_exact, wilson
from ..decoding.ties import DEFAULT_TIE_RULE
from .endpoints import is_tie, paired_with_reference, require_gates
from .live_vs_prefill import EXP1

ARMS = ("live", "prefill")
"""The suffixes a row's steps are counted from (the replicas repeat them bit for bit)."""

BINS = ("0 (exact tie)", "(0, 1)", "1", "(1, 2)", "[2, 4)", "[4, 16)", "[16, 64)", ">= 64")
"""The margin histogram's bins, in BF16 spacings at the top logit's magnitude (:func:`margin_bin`)."""


def _no_single_plan(chain: Chain) -> ArmPlan[Exp1Record]:
    raise ValueError("arm exp1_ties runs once per rule of the profile's tie_rules: plan it with Session.plans")


def _plans(chain: Chain) -> list[ArmPlan[Exp1Record]]:
    """One plan per rule of ``tie_rules``: Experiment 1's problems and preflight rows, the rule and top logits keyed.

    The profile holds each rule parsed once and written as the ledger key writes it
    (:func:`kvreplay.notebook.profiles.ChainParameters`' check, :func:`kvreplay.decoding.settings.parse_rule`)."""
    rows = chain.rows(chain.params.n_rows)
    return [EXP1_TIES.plan(rows, key={"tie_rule": r, "top_logits": True},
                           preflight=chain.params.preflight) for r in chain.params.tie_rules]


EXP1_TIES: Arm[Exp1Record] = dataclasses.replace(
    EXP1, experiment=declared_in(__name__), prepare=_no_single_plan, variants=_plans, key=("tie_rule", "top_logits"))
"""Experiment 1 under another tie rule (exploratory), BF16 only, once per rule of ``tie_rules``; ledger ``exp1_ties``.

The key entries set the arm's settings (:meth:`kvreplay.runner.ArmPlan.bind`): rows are those of
:func:`~kvreplay.experiments.live_vs_prefill.live_vs_prefill_row` with the rule and ``top_logits``."""


# ----------------------------------------------------------------------------- the summary


def bf16_spacing(x: np.ndarray) -> np.ndarray:
    """The spacing of BF16 numbers at each value's magnitude, ``2**(floor(log2 |x|) - 7)`` (8 significant bits).

    Args:
        x: float logits, any shape. Returns: the same shape, float64 (the smallest normal's spacing at 0).
    """
    _, exp = np.frexp(np.abs(np.asarray(x, dtype=np.float64)))
    return np.ldexp(1.0, np.maximum(exp - 8, -133))


def margin_bin(units: float) -> str:
    """The :data:`BINS` label of a margin in BF16 spacings."""
    if units == 0:
        return BINS[0]
    edges = ((1, BINS[1]), (2, BINS[3]), (4, BINS[4]), (16, BINS[5]), (64, BINS[6]))
    if units == 1:
        return BINS[2]
    return next((label for edge, label in edges if units < edge), BINS[7])


def _steps(rows: Sequence[Exp1Row]):
    """``(margin, top-1 logit or None)`` of every model-chosen step of the live and prefill suffixes."""
    for r in rows:
        for a in ARMS:
            arm = r["arms"][a]  # type: ignore[literal-required]
            tops = arm.get("top_logits") or [None] * len(arm["margins"])
            yield from ((m, t) for m, t in zip(arm["margins"], tops) if m is not None)


def _first_gap_units(r: Exp1Row) -> float | None:
    """The smaller of the two arms' margins at the first divergent step, in BF16 spacings (``None``: no top logits)."""
    fd = r["endpoints"]["first_divergence"]
    units = []
    for a in ARMS:
        arm = r["arms"][a]  # type: ignore[literal-required]
        tops = arm.get("top_logits")
        if tops is None:
            return None
        if fd is not None and fd < len(arm["margins"]) and arm["margins"][fd] is not None:
            units.append(arm["margins"][fd] / float(bf16_spacing(np.array(tops[fd]))))
    return min(units) if units else None


def tie_rule_summary(reference: Sequence[Exp1Record], by_rule: Mapping[str, Sequence[Exp1Record]],
                     reference_rule: str = DEFAULT_TIE_RULE) -> dict[str, dict]:
    """Each rule's Experiment 1 BF16 divergence against the reference arm's, on the same problems.

    Args:
        reference: the chain's Experiment 1 BF16 rows (its rule ``reference_rule``, by default ``lowest``).
        by_rule: rule -> the :data:`EXP1_TIES` rows of that rule (same problems, same order).

    Returns:
        rule -> ``n``, ``suffix`` (:class:`~kvreplay.analysis.stats.Proportion`, live vs prefill suffix differs), ``tie``
        (divergences whose first divergent step is an exact tie in either arm), ``nonzero`` (the others),
        ``one_spacing`` (of those, the smaller margin is one BF16 spacing; ``None`` without top logits), and
        ``mcnemar`` (:func:`~kvreplay.analysis.stats.mcnemar_exact` of suffix divergence against the reference; ``None``
        for the reference). The reference comes first.

    Raises:
        GateError: a row failed a gate (``report``).
        ValueError: a rule's problems differ from the reference's, or ``by_rule`` holds the reference's rule.
    """
    paired = paired_with_reference(reference, by_rule, reference_rule, "tie rule")
    ref = paired[reference_rule]
    out: dict[str, dict] = {}
    for rule, rows in paired.items():
        div = [r for r in rows if r["endpoints"]["suffix_differs"]]
        tie = sum(bool(r["endpoints"]["tie_initiated"]) for r in div)
        gaps = [_first_gap_units(r) for r in div if not r["endpoints"]["tie_initiated"]]
        out[rule] = {
            "n": len(rows), "suffix": wilson(len(div), len(rows)), "tie": tie, "nonzero": len(div) - tie,
            "one_spacing": None if any(g is None for g in gaps) else sum(g == 1 for g in gaps),
            "mcnemar": None if rule == reference_rule else mcnemar_exact(
                [r["endpoints"]["suffix_differs"] for r in ref], [r["endpoints"]["suffix_differs"] for r in rows]),
        }
    return out


def tie_rule_table(summary: Mapping[str, dict], reference_rule: str = DEFAULT_TIE_RULE) -> pd.DataFrame:
    """The control's table: one column per rule (the reference first), from :func:`tie_rule_summary`."""
    def rate(p: Proportion) -> str:
        return p.pct()

    cols = {}
    for rule, s in summary.items():
        m = s["mcnemar"]
        cols[f"{rule}{' (reference)' if rule == reference_rule else ''}"] = {
            "rows": str(s["n"]),
            "suffix differs, live vs prefill (Wilson 95%)": rate(s["suffix"]),
            "of which begun at an exact tie (margin 0 in either arm)": f"{s['tie']}/{s['suffix'].k}",
            "of which begun at a nonzero margin (no tie rule changes that step)": f"{s['nonzero']}/{s['suffix'].k}",
            "nonzero: smaller margin exactly one BF16 spacing": "n/a (no top logits)" if s["one_spacing"] is None
            else f"{s['one_spacing']}/{s['nonzero']}",
            f"exact McNemar vs {reference_rule} (divergent only under {reference_rule} / only under this rule; p)":
                "—" if m is None else f"{m.b} / {m.c}; p = {m.pvalue:.3g}",
        }
    return pd.DataFrame(cols)


def tie_steps(arms: Mapping[str, Sequence[Exp1Record]]) -> pd.DataFrame:
    """Exact-tie steps per 1,000 model-chosen tokens of each arm (live and prefill suffixes of every row).

    Args:
        arms: label (e.g. ``"exp1 BF16 (lowest)"``) -> its rows.

    Returns:
        One row per label: ``arm``, ``chosen tokens``, ``exact-tie steps``, ``per 1,000 chosen tokens``,
        ``top-1 logits recorded`` (the histogram needs them).

    Raises:
        GateError: a row failed a gate (``report``).
    """
    out = []
    for label, records in arms.items():
        rows = require_gates(records)
        steps = list(_steps(rows))
        ties = sum(m == 0 for m, _ in steps)
        out.append({"arm": label, "chosen tokens": len(steps), "exact-tie steps": ties,
                    "per 1,000 chosen tokens": round(1000 * ties / len(steps), 2) if steps else float("nan"),
                    "top-1 logits recorded": bool(steps) and all(t is not None for _, t in steps)})
    return pd.DataFrame(out, columns=["arm", "chosen tokens", "exact-tie steps", "per 1,000 chosen tokens",
                                      "top-1 logits recorded"])


def margin_units(arms: Mapping[str, Sequence[Exp1Record]]) -> pd.DataFrame:
    """Every model-chosen step's margin in BF16 spacings at its top-1 logit's magnitude, for the histogram.

    A step's unit is :func:`bf16_spacing` of its top-1 eligible logit, whatever the arm's precision, so BF16 and
    FP32 arms share the axis (a BF16 margin is a whole number of spacings when both logits share a binade).
    Arms whose rows carry no ``top_logits`` are left out (:func:`tie_steps` says which).

    Returns:
        ``arm``, ``units`` (float), ``bin`` (:data:`BINS`), one row per step.
    """
    frames = []
    for label, records in arms.items():
        steps = [(m, t) for m, t in _steps(require_gates(records)) if t is not None]
        if not steps:
            continue
        m, t = np.array(steps, dtype=np.float64).T
        units = m / bf16_spacing(t)
        frames.append(pd.DataFrame({"arm": label, "units": units, "bin": [margin_bin(u) for u in units]}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["arm", "units", "bin"])
