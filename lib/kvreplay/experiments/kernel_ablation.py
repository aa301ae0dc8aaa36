"""The kernel attribution (exploratory): which operation class, left in its default reduction order, brings back the
prefill-versus-replay cache drift and the BF16 suffix divergence, on pinned inputs.

Each kernels value of the profile's ``kernel_values`` (:data:`kvreplay.model.kernels.KERNELS`: ``default``,
``invariant``, every ``invariant-except-<class>`` and the second attention order) is one variant of
:data:`EXP2_KERNELS`, with its own ledger (``exp2_kernels-bfloat16``, key entry ``kernels``). A row is Experiment 2's
fixed-prefix row under that value: the boundary token IDs are pinned, taken from the profile's prefix bank (the
reference live decode of Experiment 1 BF16), so every value builds its caches from the same IDs. The incremental
cache is the teacher-forced replay of the live call schedule over them, the prefill cache one forward call; the two
differ only in the arithmetic under test. The rows pass every gate of Experiment 2 (preflight, replicas, the float32
construction-equivalence checks, ``desync``, ``nonfinite``).

Under ``invariant`` the two caches coincide by construction (the contract's test, not a finding). The finding is
which value brings drift and divergence back. The primary contrasts are declared in the profile before any row
(``kernel_contrasts``, default :data:`kvreplay.notebook.profiles.KERNEL_CONTRASTS`): suffix divergence of two values on the same
problems, each with its exact McNemar test (:func:`kernel_summary`). Outcomes are tabulated, never asserted; a row that
failed a gate stops the summary (``report`` gate).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence

import pandas as pd

from ..arm_facts import declared_in
from ..ledger.records import Exp2Record, Exp2Row
from ..runner.arms import Arm, ArmPlan, Chain
from ..analysis.stats import McNemar, Proportion, mcnemar_exact, wilson
from .endpoints import require_gates
from .fixed_prefix import EXP2


def _no_single_plan(chain: Chain) -> ArmPlan[Exp2Record]:
    raise ValueError("arm exp2_kernels runs once per value of the profile's kernel_values: plan it with Session.plans")


def _plans(chain: Chain) -> list[ArmPlan[Exp2Record]]:
    """One plan per value of ``kernel_values``: Experiment 2's pinned prefixes and preflight rows, the value keyed."""
    fixed = chain.fixed
    return [EXP2_KERNELS.plan(fixed.rows, key={"prefix_bank_sha256": fixed.sha256, "kernels": v},
                              prefixes=fixed.prefixes, preflight=chain.params.preflight_fixed)
            for v in chain.params.kernel_values]


EXP2_KERNELS: Arm[Exp2Record] = dataclasses.replace(
    EXP2, experiment=declared_in(__name__), prepare=_no_single_plan, variants=_plans, key=("prefix_bank_sha256", "kernels"))
"""Experiment 2 BF16 on the prefix bank under one kernels value (exploratory), once per value of ``kernel_values``;
ledger ``exp2_kernels``. The ``kernels`` entry sets the arm's execution contract
(:meth:`kvreplay.runner.ArmPlan.bind`), so the model is loaded under that value."""


@dataclasses.dataclass(frozen=True)
class ValueSummary:
    """One kernels value's rows, summarised (:func:`kernel_summary`).

    Attributes:
        n: rows. replay_exact: rows whose prefill cache equals the replayed (incremental) one bit for bit.
        rel_l2: the relative L2 of prefill against replay over every layer's keys and values, one per row.
        suffix: suffixes that part (prefill vs replay), with its Wilson 95% interval.
        tie: of those, how many began at an exact top-1/top-2 tie (margin 0 in either suffix).
    """
    n: int
    replay_exact: int
    rel_l2: tuple[float, ...]
    suffix: Proportion
    tie: int


@dataclasses.dataclass(frozen=True)
class Contrast:
    """Two kernels values' suffix divergence on the same problems: the exact McNemar test of the pairs."""
    a: str
    b: str
    n: int
    mcnemar: McNemar


def kernel_summary(by_value: Mapping[str, Sequence[Exp2Record]], contrasts: Sequence[tuple[str, str]]
                   ) -> tuple[dict[str, ValueSummary], list[Contrast]]:
    """Each value's prefill-vs-replay endpoints, and each declared contrast, on the same problems.

    Args:
        by_value: kernels value -> its :data:`EXP2_KERNELS` rows (the same problems in the same order).
        contrasts: the profile's ``kernel_contrasts``; a pair naming a value without rows is left out.

    Returns:
        value -> :class:`ValueSummary` (in ``by_value``'s order), and the contrasts' :class:`Contrast` s.

    Raises:
        GateError: a row failed a gate (``report``).
        ValueError: two values' rows are not the same problems in the same order.
    """
    rows = {v: require_gates(records) for v, records in by_value.items()}
    ids = [[r["problem_id"] for r in rs] for rs in rows.values()]
    if any(i != ids[0] for i in ids):
        raise ValueError("exp2_kernels: the kernels values' rows are not the same problems in the same order "
                         f"({', '.join(f'{v}: {len(rs)} rows' for v, rs in rows.items())})")
    out = {v: _summary(rs) for v, rs in rows.items()}
    tests = [Contrast(a, b, len(rows[a]), mcnemar_exact(_parted(rows[a]), _parted(rows[b])))
             for a, b in contrasts if a in rows and b in rows]
    return out, tests


def _parted(rows: Sequence[Exp2Row]) -> list[bool]:
    return [r["endpoints"]["suffix_differs"] for r in rows]


def _summary(rows: Sequence[Exp2Row]) -> ValueSummary:
    parted = _parted(rows)
    return ValueSummary(
        n=len(rows), replay_exact=sum(r["endpoints"]["boundary_exact"] for r in rows),
        rel_l2=tuple(r["boundary"]["prefill_vs_incremental"]["cache"]["rel_l2"] for r in rows),
        suffix=wilson(sum(parted), len(rows)),
        tie=sum(bool(p and r["endpoints"]["tie_initiated"]) for p, r in zip(parted, rows)))


def kernel_table(summary: Mapping[str, ValueSummary]) -> pd.DataFrame:
    """One line per kernels value (:func:`kernel_summary`): rows, prefill = replay bit for bit, relative L2 median and
    maximum, suffixes that part (Wilson 95%), of them begun at an exact tie."""
    lines = {}
    for value, s in summary.items():
        lines[f"`{value}`"] = {
            "rows": s.n, "prefill cache = replay, bit for bit": f"{s.replay_exact}/{s.n}",
            "rel. L2 prefill vs replay, median": statistics.median(s.rel_l2) if s.rel_l2 else float("nan"),
            "rel. L2, max": max(s.rel_l2) if s.rel_l2 else float("nan"),
            "suffixes part (Wilson 95%)": s.suffix.pct(),
            "of which begun at an exact tie": f"{s.tie}/{s.suffix.k}"}
    return pd.DataFrame.from_dict(lines, orient="index")


def contrast_table(contrasts: Sequence[Contrast]) -> pd.DataFrame:
    """One line per declared contrast: problems, divergent only under the first / only under the second, exact p."""
    return pd.DataFrame([{"contrast": f"`{c.a}` vs `{c.b}`", "problems": c.n,
                          "suffixes part only under the first / only under the second": f"{c.mcnemar.b} / {c.mcnemar.c}",
                          "exact McNemar p": c.mcnemar.pvalue} for c in contrasts],
                        columns=["contrast", "problems", "suffixes part only under the first / only under the second",
                                 "exact McNemar p"]).set_index("contrast")
