"""The manipulated-length arm (exploratory, not in the paper): Experiment 1 BF16 on the same problems at other
branch caps.

In the committed profiles divergence rises with the boundary prefix's length, but across problems a longer prefix
is also another problem (:mod:`kvreplay.report.prefix_length`). This arm manipulates the length instead. The
chain's Experiment 1 problems are rerun with the branch cap set to each value of the profile's
``length_branch_caps``, everything else as the chain's (merge and answer caps, tie rule, execution contract). Each
cap has its own ledger (``exp1_length-bfloat16``, key entry ``cap_branch``). Rows are Experiment 1's own, through its
gates.

The comparison rule, declared before any row of the arm is computed:

* primary: every problem, paired with itself at the chain's cap: suffix divergence at each cap with its Wilson
  interval, and the exact McNemar test of the pairs (the cap is the manipulation, whatever length it gives);
* secondary: the problems whose boundary prefix actually moved in the cap's direction (longer at a larger cap,
  shorter at a smaller one). A model that ends its branches before the cap gets no longer prefix from a larger
  one; those problems are counted, not dropped from the primary comparison.

Rows that failed a gate end the summary (``report`` gate), as in every other endpoint.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence

import pandas as pd

from ..arm_facts import declared_in, facts
from ..ledger.records import Exp1Record
from ..runner.arms import Arm, ArmPlan, Chain
from ..analysis.stats import mcnemar_exact, wilson
from .endpoints import paired_with_reference
from .live_vs_prefill import EXP1


_EXPERIMENT = declared_in(__name__)
_CAP_ENTRY = str(facts(_EXPERIMENT).variant_key)
"""The ledger-key entry that holds the branch cap (its facts' :attr:`~kvreplay.arm_facts.ArmFacts.variant_key`)."""


def _no_single_plan(chain: Chain) -> ArmPlan[Exp1Record]:
    raise ValueError(f"arm {_EXPERIMENT} runs once per cap of the profile's length_branch_caps: plan it with "
                     "Session.plans")


def _plans(chain: Chain) -> list[ArmPlan[Exp1Record]]:
    """One plan per cap of ``length_branch_caps``: Experiment 1's problems and preflight rows, the cap keyed."""
    rows = chain.rows(chain.params.n_rows)
    return [EXP1_LENGTH.plan(rows, key={_CAP_ENTRY: int(c)}, preflight=chain.params.preflight)
            for c in chain.params.length_branch_caps]


EXP1_LENGTH: Arm[Exp1Record] = dataclasses.replace(
    EXP1, experiment=_EXPERIMENT, prepare=_no_single_plan, variants=_plans, key=(_CAP_ENTRY,))
"""Experiment 1 BF16 at another branch cap (exploratory), once per cap of ``length_branch_caps``; ledger
``exp1_length``. The key entry sets the arm's branch cap (:meth:`kvreplay.runner.ArmPlan.bind`)."""


def length_summary(reference: Sequence[Exp1Record], by_cap: Mapping[int, Sequence[Exp1Record]],
                   reference_cap: int) -> dict[int, dict]:
    """Each branch cap's Experiment 1 BF16 divergence against the chain's own cap, on the same problems.

    Args:
        reference: the chain's Experiment 1 BF16 rows (branch cap ``reference_cap``).
        by_cap: branch cap -> the :data:`EXP1_LENGTH` rows at that cap (same problems, same order).

    Returns:
        cap -> ``n``, ``prefix_len`` (median and range of the boundary prefix, tokens), ``suffix``
        (:class:`~kvreplay.analysis.stats.Proportion`, live vs prefill suffix differs), ``tie`` (of those, begun at an exact
        tie), ``moved`` (problems whose prefix moved in the cap's direction; ``None`` for the reference),
        ``moved_suffix`` (divergence among them; ``None`` when none moved), ``moved_reference`` (the same problems'
        divergence at the reference cap), ``mcnemar`` (exact, against the reference; ``None`` for it).
        Sorted by cap, the reference among them.

    Raises:
        GateError: a row failed a gate (``report``).
        ValueError: a cap's problems differ from the reference's, or ``by_cap`` holds the reference's cap.
    """
    paired = paired_with_reference(reference, by_cap, reference_cap, "branch cap")
    ref = paired[reference_cap]
    out: dict[int, dict] = {}
    for cap, rows in sorted(paired.items()):
        lengths = [r["prefix_len"] for r in rows]
        div = [r["endpoints"]["suffix_differs"] for r in rows]
        moved = None if cap == reference_cap else [
            (r["prefix_len"] - q["prefix_len"]) * (cap - reference_cap) > 0 for r, q in zip(rows, ref)]
        out[cap] = {
            "n": len(rows),
            "prefix_len": (statistics.median(lengths), min(lengths), max(lengths)),
            "suffix": wilson(sum(div), len(rows)),
            "tie": sum(bool(r["endpoints"]["suffix_differs"] and r["endpoints"]["tie_initiated"]) for r in rows),
            "moved": None if moved is None else sum(moved),
            "moved_suffix": None if not moved or not any(moved) else wilson(sum(d for d, m in zip(div, moved) if m), sum(moved)),
            "moved_reference": None if not moved or not any(moved) else wilson(
                sum(q["endpoints"]["suffix_differs"] for q, m in zip(ref, moved) if m), sum(moved)),
            "mcnemar": None if cap == reference_cap else mcnemar_exact(
                [q["endpoints"]["suffix_differs"] for q in ref], div),
        }
    return out


def length_table(summary: Mapping[int, dict], reference_cap: int) -> pd.DataFrame:
    """The arm's table: one column per branch cap (ascending; the chain's own marked), from
    :func:`length_summary`."""
    cols = {}
    for cap, s in summary.items():
        med, lo, hi = s["prefix_len"]
        m = s["mcnemar"]
        cols[f"branch cap {cap}{' (Experiment 1)' if cap == reference_cap else ''}"] = {
            "rows": str(s["n"]),
            "boundary prefix, tokens: median [range]": f"{med:g} [{lo}, {hi}]",
            "suffix differs, live vs prefill (Wilson 95%)": s["suffix"].pct(),
            "of which begun at an exact tie": f"{s['tie']}/{s['suffix'].k}",
            f"exact McNemar vs cap {reference_cap} (divergent only at {reference_cap} / only at this cap; p)":
                "—" if m is None else f"{m.b} / {m.c}; p = {m.pvalue:.3g}",
            "secondary: prefix moved in the cap's direction": "—" if s["moved"] is None else f"{s['moved']}/{s['n']}",
            "secondary: suffix differs among those (Wilson 95%)": "—" if s["moved_suffix"] is None
            else s["moved_suffix"].pct(),
            f"secondary: the same problems at cap {reference_cap}": "—" if s["moved_reference"] is None
            else s["moved_reference"].pct(),
        }
    return pd.DataFrame(cols)
