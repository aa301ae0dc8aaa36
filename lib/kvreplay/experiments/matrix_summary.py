"""The four-arm matrix's summary: an arm's endpoint table from its records, Wilson intervals, McNemar and the
paired bootstrap, with the rows whose drift lies far outside the arm's own distribution flagged (paper §3.5, §4.1,
§4.2). Re-exported by :mod:`kvreplay.experiments.matrix`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import pandas as pd

from ..ledger.records import Exp1Record, Exp2Record, arm_of, comparison_of
from ..analysis.stats import mcnemar_exact, paired_bootstrap, wilson
from .endpoints import require_gates, with_derived_endpoints


DRIFT_OUTLIER_FACTOR = 10.0
"""A row's whole-cache drift above this many times its arm's median is flagged (:func:`drift_outliers`)."""


def drift_outliers(records: Sequence[Any], ref: str = "live", factor: float = DRIFT_OUTLIER_FACTOR) -> list[dict]:
    """Rows whose prefill-vs-reference drift lies far outside the arm's own distribution: flagged, never excluded.

    Rule, fixed before any row is seen: a passed row is flagged when its whole-cache relative L2 of prefill
    against the reference exceeds ``factor`` times the median of that drift over the arm's passed rows.
    In the committed cpu, gpu and paper ledgers (Experiments 1 and 2, both precisions, 1,664 rows) no row
    exceeds 1.4 times its arm's median. A live decoder without its 4-D mask gave 20 times the clean median
    (0.156 against 0.008 on the embedded model). With two rows no row can exceed twice the median, so
    nothing is flagged. An outcome to print beside the table, not a gate.

    Args:
        records: the arm's passed rows (:func:`~kvreplay.experiments.endpoints.require_gates`).
        ref: the reference construction (``live`` or ``incremental``).
        factor: see :data:`DRIFT_OUTLIER_FACTOR`.

    Returns:
        ``[{"problem_id", "rel_l2", "times_median"}]`` in row order (``times_median`` is inf when the median is 0).
    """
    drifts = [comparison_of(r, f"prefill_vs_{ref}")["cache"]["rel_l2"] for r in records]
    if not drifts:
        return []
    median = statistics.median(drifts)
    return [{"problem_id": r["problem_id"], "rel_l2": d, "times_median": d / median if median else float("inf")}
            for r, d in zip(records, drifts) if d > factor * median]


def matrix_summary(
    records: Sequence[Exp1Record] | Sequence[Exp2Record], dtype: str, ref: str = "live", seed: int = 20260729,
    n_resamples: int = 20000,
) -> dict:
    """Endpoints of the four-arm matrix at one precision (paper §4.1, §4.2), from ledger records alone.

    ``ref`` is the reference construction (``live`` or ``incremental``); prefill is compared against it.

    Returns:
        dict of counts, Wilson intervals (as :class:`~kvreplay.analysis.stats.Proportion`)
        for suffix, merge, answer-block, predicted-letter and label
        disagreement, ``tie_initiated`` (divergent rows whose first divergence
        is tie-initiated). Also the live-vs-prefill accuracy difference (prefill minus live, bootstrap),
        McNemar on correctness, first-divergence median/range and drift, and ``drift_outliers``
        (:func:`drift_outliers`).

    Raises:
        GateError: if any row failed a gate.
    """
    passed = require_gates(records)
    n = len(passed)
    ep = [with_derived_endpoints(r, ref) for r in passed]
    live_c = [arm_of(r, ref)["correct"] for r in passed]
    pre_c = [r["arms"]["prefill"]["correct"] for r in passed]
    firsts = [e["first_divergence"] for e in ep if e["first_divergence"] is not None]
    drifts = [comparison_of(r, f"prefill_vs_{ref}")["cache"]["rel_l2"] for r in passed]
    replicas_exact = sum(
        comparison_of(r, f"{ref}_replica")["cache"]["exact"] and r["boundary"]["prefill_replica"]["cache"]["exact"]
        for r in passed
    )
    return {
        "dtype": dtype,
        "ref": ref,
        "n": n,
        "replicas_exact": replicas_exact,
        "boundary_non_exact": sum(not e["boundary_exact"] for e in ep),
        "first_token_agree": sum(e["first_token_agree"] for e in ep),
        "suffix": wilson(sum(e["suffix_differs"] for e in ep), n),
        "merge": wilson(sum(e["merge_differs"] for e in ep), n),
        "answer": wilson(sum(e["answer_differs"] for e in ep), n),
        "letter": wilson(sum(e["letter_differs"] for e in ep), n),
        "label": wilson(sum(e["label_differs"] for e in ep), n),
        "tie_initiated": sum(bool(e["tie_initiated"]) for e in ep),
        "first_divergence_median": statistics.median(firsts) if firsts else None,
        "first_divergence_range": (min(firsts), max(firsts)) if firsts else None,
        "first_divergence_quartiles": statistics.quantiles(firsts, n=4) if len(firsts) >= 2 else None,
        "accuracy_ref": sum(live_c),
        "accuracy_prefill": sum(pre_c),
        "accuracy_diff": paired_bootstrap(live_c, pre_c, n_resamples=n_resamples, seed=seed) if n >= 2 else None,
        "mcnemar": mcnemar_exact(live_c, pre_c),
        "drift_median": statistics.median(drifts),
        "drift_range": (min(drifts), max(drifts)),
        "drift_outliers": drift_outliers(passed, ref),
        "prefix_len_range": (min(r["prefix_len"] for r in passed), max(r["prefix_len"] for r in passed)),
    }


def matrix_table(summaries: Sequence[dict], cross_precision_identical: tuple[int, int] | None) -> pd.DataFrame:
    """Results table of the four-arm matrix in the paper's terms, one column per precision."""
    rows: dict[str, dict] = {}
    for s in summaries:
        col = s["dtype"]
        n = s["n"]
        d = s["accuracy_diff"]
        mc = s["mcnemar"]
        rows.setdefault("rows", {})[col] = str(n)
        rows.setdefault("prefix length (tokens)", {})[col] = f"{s['prefix_len_range'][0]}–{s['prefix_len_range'][1]}"
        rows.setdefault("replica pairs exact", {})[col] = f"{s['replicas_exact']}/{n}"
        rows.setdefault("boundary cache non-bit-exact", {})[col] = f"{s['boundary_non_exact']}/{n}"
        rows.setdefault("first eligible argmax agrees", {})[col] = f"{s['first_token_agree']}/{n}"
        rows.setdefault("median relative L2 cache drift [range]", {})[col] = (
            f"{s['drift_median']:.3g} [{s['drift_range'][0]:.3g}, {s['drift_range'][1]:.3g}]"
        )
        out = s["drift_outliers"]
        rows.setdefault(f"rows with drift above {DRIFT_OUTLIER_FACTOR:g} x the median (flagged, not excluded)",
                        {})[col] = (f"{len(out)}/{n}: " + ", ".join(
                            f"{o['problem_id']} ({o['times_median']:.3g} x)" for o in out[:5])
                            + (f" and {len(out) - 5} more" if len(out) > 5 else "")) if out else f"0/{n}"
        for key, label in (("suffix", "suffix differs"), ("merge", "merge differs"),
                           ("answer", "answer block differs (any token)"), ("letter", "predicted letter differs"),
                           ("label", "correctness label differs")):
            rows.setdefault(label, {})[col] = s[key].pct()
        rows.setdefault("suffix differs: tie-initiated / not (either arm's top-1 − top-2 margin exactly 0 at the first "
                        "divergent step)", {})[col] = f"{s['tie_initiated']} / {s['suffix'].k - s['tie_initiated']}"
        fd = s["first_divergence_median"]
        rows.setdefault("first divergence, tokens after boundary: median (range)", {})[col] = (
            f"{fd:g} ({s['first_divergence_range'][0]}–{s['first_divergence_range'][1]})" if fd is not None else "none"
        )
        ref = s["ref"]
        rows.setdefault(f"accuracy {ref} / prefill", {})[col] = f"{s['accuracy_ref']}/{n} vs {s['accuracy_prefill']}/{n}"
        rows.setdefault(f"prefill − {ref} accuracy, pts [95% bootstrap CI]", {})[col] = (
            f"{100 * d.estimate:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]" if d else "n/a"
        )
        rows.setdefault(f"McNemar ({ref}-only vs prefill-only correct), exact p", {})[col] = (
            f"{mc.b} vs {mc.c}, p = {mc.pvalue:.3g}"
        )
    if cross_precision_identical is not None:
        k, n = cross_precision_identical
        for col in rows["rows"]:
            rows.setdefault("boundary prefix token-identical across precisions", {})[col] = f"{k}/{n}"
    return pd.DataFrame(rows).T
