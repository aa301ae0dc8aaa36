"""Figure data from ledger records: tidy pandas frames for first divergence, margins, transplant outcomes and per-layer drift.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import pandas as pd

from ..experiments.endpoints import require_gates
from ..experiments.transplant import DIRECTIONS, split_precondition
from ..ledger.records import (
    Exp1Record,
    Exp2Record,
    Intervention,
    ReplicationRecord,
    TensorDiff,
    TransplantRecord,
    arm_of,
    outcome_of,
)


def first_divergence_frame(groups: Mapping[str, Sequence[Exp1Record] | Sequence[Exp2Record]]) -> pd.DataFrame:
    """First-divergence positions of divergent rows, long form: ``group``, ``problem_id``, ``first_divergence``.

    Args:
        groups: group label -> an Experiment 1 or 2 arm's rows.

    Raises:
        GateError: a row failed a gate.
    """
    rows = [
        {"group": g, "problem_id": r["problem_id"], "first_divergence": r["endpoints"]["first_divergence"]}
        for g, recs in groups.items() for r in require_gates(recs) if r["endpoints"]["first_divergence"] is not None
    ]
    return pd.DataFrame(rows, columns=["group", "problem_id", "first_divergence"])


def divergence_margins(records: Sequence[Exp1Record] | Sequence[Exp2Record], ref: str) -> pd.DataFrame:
    """Top-1 minus top-2 eligible-logit margins by step kind (the near-tie figure).

    For each row, every model-chosen suffix step (forced tokens have no
    margin) before the first divergence is ``shared`` (the reference arm's
    margin; both arms share that history), as is every step of a row whose
    suffixes never differ. At the first divergence the margin is the smaller
    of the reference and prefill arms' margins (the arm closer to a tie). Its
    kind is ``first divergence, exact tie`` when it is exactly 0 (a
    tie-initiated divergence) and ``first divergence, margin > 0`` otherwise.
    Steps after the first divergence are dropped: the two trajectories no
    longer share a history there.

    Returns:
        DataFrame ``problem_id``, ``step``, ``margin``, ``kind``.

    Raises:
        GateError: if any row failed a gate.
    """
    table = []
    for r in require_gates(records):
        fd = r["endpoints"]["first_divergence"]
        margins = arm_of(r, ref)["margins"]
        other = r["arms"]["prefill"]["margins"]
        stop = len(margins) if fd is None else min(fd + 1, len(margins))
        for i in range(stop):
            m = margins[i]
            if i == fd:
                both = [x for x in (m, other[i] if i < len(other) else None) if x is not None]
                if not both:
                    continue
                m = min(both)
                kind = "first divergence, exact tie" if m == 0 else "first divergence, margin > 0"
            elif m is None:
                continue
            else:
                kind = "shared"
            table.append({"problem_id": r["problem_id"], "step": i, "margin": m, "kind": kind})
    return pd.DataFrame(table, columns=["problem_id", "step", "margin", "kind"])


def margin_percentiles(df: pd.DataFrame) -> list[float]:
    """For each first-divergence margin, the share (%) of shared-step margins at or below it."""
    shared = df.loc[df["kind"] == "shared", "margin"].to_numpy()
    if not len(shared):
        return []
    return [float(100 * (shared <= m).mean()) for m in df.loc[df["kind"].str.startswith("first divergence"), "margin"]]


def transplant_outcomes(records: Sequence[TransplantRecord] | Sequence[ReplicationRecord]) -> pd.DataFrame:
    """Counts of transplant outcomes per contemporaneous stratum, intervention and direction.

    Returns:
        DataFrame ``stratum`` (``divergent``/``exact`` by the new baselines), ``intervention``,
        ``kind`` (primary/exploratory), ``direction``, ``outcome`` (``donor``, ``recipient``,
        ``third``, ``baseline``) and ``rows``; rows that did not meet the transplant's precondition are left
        out (:func:`~kvreplay.experiments.transplant.split_precondition`).

    Raises:
        GateError: if a row failed a gate other than the precondition.
    """
    eligible, _ = split_precondition(records)  # ineligible rows have no transplant
    counts: dict[tuple, int] = {}
    for r in eligible:
        stratum = "divergent" if r["baseline"]["suffix_differs"] else "exact"
        # Experiment 4: intervention name -> Intervention; Experiment 5: its one "whole" Intervention
        done = cast(Mapping[str, Intervention], r["interventions"])
        for name, iv in done.items():
            for d in DIRECTIONS:
                key = (stratum, name, iv["kind"], d, outcome_of(iv, d)["outcome"])
                counts[key] = counts.get(key, 0) + 1
    table = [dict(zip(("stratum", "intervention", "kind", "direction", "outcome"), k), rows=v) for k, v in counts.items()]
    return pd.DataFrame(table, columns=["stratum", "intervention", "kind", "direction", "outcome", "rows"])


def layer_drift_frame(tensors: Sequence[TensorDiff]) -> pd.DataFrame:
    """Per-tensor ledger summaries (``boundary.<cmp>.tensors``) as a frame.

    Returns:
        DataFrame ``layer``, ``kind`` (key/value), ``rel_l2``, ``max_abs``, ``n_diff``, ``exact``, and for a
        model with sliding-window layers ``layer_kind`` (``full``/``sliding``).
    """
    rows = []
    for t in tensors:
        layer, kind = t["tensor"].split(".")
        rows.append({"layer": int(layer[1:]), "kind": kind, "rel_l2": t["rel_l2"], "max_abs": t["max_abs"],
                     "n_diff": t["n_diff"], "exact": t["exact"], "layer_kind": t.get("layer_kind")})
    columns = ["layer", "kind", "rel_l2", "max_abs", "n_diff", "exact"]
    if any(t.get("layer_kind") for t in tensors):
        columns.append("layer_kind")
    return pd.DataFrame(rows, columns=columns)
