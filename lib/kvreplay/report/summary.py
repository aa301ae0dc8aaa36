"""A profile's results recomputed from its ledgers alone: every experiment's summary and endpoint table.

The same summary functions the experiment notebooks call
(:mod:`kvreplay.experiments`) run over the finished ledgers of a profile
(:func:`kvreplay.ledger.lookup.load_profile_ledgers`); no model is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from ..arm_facts import ARM_FACTS, Derived
from ..experiments.bridge import (
    audit_table,
    bridge_summary,
    bridge_table,
    saved_ledger_audit,
)
from ..experiments.fixed_prefix import crossing_table, precision_crossing
from ..experiments.matrix import matrix_summary, matrix_table
from ..experiments.replication import accuracy_table as replication_accuracy_table
from ..experiments.replication import (
    accuracy_vs_checkpoint0,
    describe_checkpoint,
    replication_summary,
    replication_table,
)
from ..experiments.transplant import (
    DEFAULT_PRECONDITION_RULE,
    localization_table,
    transplant_summary,
    transplant_table,
)
from ..ledger.lookup import LoadedLedger, ProfileLedgers
from ..paths import CHECKPOINTS


def summarize(profile_ledgers: ProfileLedgers, *, seed: int = 20260729, n_resamples: int = 20000,
              precondition_failures: str = DEFAULT_PRECONDITION_RULE) -> dict:
    """Every endpoint of Experiments 1–5 recomputed from the ledgers with the library's summary functions.

    Returns:
        ``exp1`` / ``exp2``: dtype -> :func:`~kvreplay.experiments.matrix.matrix_summary`;
        ``exp1_cross``: ``(prefixes token-identical across precisions, rows)`` or None;
        ``crossing``: :func:`~kvreplay.experiments.fixed_prefix.precision_crossing` or None;
        ``bridge``: :func:`bridge_summary`; ``audit``: :func:`~kvreplay.experiments.bridge.saved_ledger_audit`;
        ``transplant``: :func:`~kvreplay.experiments.transplant.transplant_summary`, under the profile's
        ``exp4_precondition_failures`` rule (``precondition_failures``);
        ``replication``: :func:`~kvreplay.experiments.replication.replication_summary`;
        ``replication_accuracy``: :func:`~kvreplay.experiments.replication.accuracy_vs_checkpoint0`;
        ``replication_checkpoint``: the replication checkpoint's description (from the Exp 5 ledger key);
        ``rows``: rows per ledger key.

    Raises:
        GateError: if any row of any ledger failed a gate (endpoints are withheld).
    """
    prec = profile_ledgers.precisions
    kw = {"seed": seed, "n_resamples": n_resamples}
    out: dict = {
        "exp1": {d: matrix_summary(profile_ledgers.records(f"exp1-{d}"), d, "live", **kw) for d in prec},
        "exp2": {d: matrix_summary(profile_ledgers.records(f"exp2-{d}"), d, "incremental", **kw) for d in prec},
        "exp1_cross": None,
        "crossing": None,
    }
    if {"bfloat16", "float32"} <= set(prec):
        a, b = profile_ledgers.records("exp1-bfloat16"), profile_ledgers.records("exp1-float32")
        out["exp1_cross"] = (sum(x["prefix"] == y["prefix"] for x, y in zip(a, b)), len(a))
        out["crossing"] = precision_crossing(profile_ledgers.records("exp2-bfloat16"), profile_ledgers.records("exp2-float32"), **kw)
    out["bridge"] = bridge_summary(profile_ledgers.records("exp3-bfloat16"))
    out["audit"] = saved_ledger_audit(profile_ledgers.records("exp1-bfloat16"), profile_ledgers.records("exp2-bfloat16"))
    out["transplant"] = transplant_summary(profile_ledgers.records("exp4-bfloat16"), precondition_failures)
    out["replication"] = replication_summary(profile_ledgers.records("exp5-bfloat16"))
    out["replication_accuracy"] = accuracy_vs_checkpoint0(profile_ledgers.records("exp2-bfloat16"), profile_ledgers.records("exp5-bfloat16"), **kw)
    out["replication_checkpoint"] = describe_checkpoint(profile_ledgers["exp5-bfloat16"].config["checkpoint"])
    out["rows"] = {k: len(v.records) for k, v in profile_ledgers.ledgers.items()}
    return out


def results_tables(profile_ledgers: ProfileLedgers, results: dict) -> dict[str, pd.DataFrame]:
    """The Experiments 1–4 results tables, keyed by file stem (built by the library's table functions).

    Keys: ``table_exp1_matrix``, ``table_exp2_matrix``, ``table_exp2_crossing`` (both
    precisions only), ``table_exp3_bridge``, ``table_exp3_audit``,
    ``table5_exp4_transplant``, ``table_exp4_localization``, ``table_exp5_replication``,
    ``table_exp5_accuracy``, ``table_first_divergence``.
    """
    cross2 = results["crossing"]
    out = {
        "table_exp1_matrix": matrix_table(list(results["exp1"].values()), results["exp1_cross"]),
        "table_exp2_matrix": matrix_table(
            list(results["exp2"].values()), (cross2["prefix_identical"], cross2["n"]) if cross2 else None
        ),
    }
    if cross2:
        out["table_exp2_crossing"] = crossing_table(cross2)
    out["table_exp3_bridge"] = bridge_table(results["bridge"])
    out["table_exp3_audit"] = audit_table(results["audit"])
    out["table5_exp4_transplant"] = transplant_table(results["transplant"], profile_ledgers.records("exp4-bfloat16"))
    loc = localization_table(profile_ledgers.records("exp4-bfloat16"))
    out["table_exp4_localization"] = loc.set_index(["intervention", "stratum", "direction"]) if len(loc) else loc
    out["table_exp5_replication"] = replication_table(results["replication"], results["replication_checkpoint"])
    out["table_exp5_accuracy"] = replication_accuracy_table(results["replication_accuracy"])
    out["table_first_divergence"] = first_divergence_table(results)
    return out


TABLES_BY_EXPERIMENTS: Mapping[str, str] = Derived(lambda: {t: f.notebook for f in ARM_FACTS.values() for t in f.tables})
"""Results table -> the experiment notebook that writes it (once; each arm's
:attr:`~kvreplay.arm_facts.ArmFacts.tables`). Notebook 06 recomputes each from the
ledger rows and checks it is byte-identical to the written CSV; it writes only the tables not listed here."""


TABLE_CAPTIONS = {
    "table_exp1_matrix": "Experiment 1: matched live/prefill matrix",
    "table_exp2_matrix": "Experiment 2: fixed-prefix 2x2, prefill vs incremental per precision",
    "table_exp2_crossing": "Experiment 2: paired FP32 minus BF16 change in disagreement",
    "table_exp3_bridge": "Experiment 3: live/incremental bridge",
    "table_exp3_audit": "Experiment 3: saved-ledger audit",
    "table5_exp4_transplant": "Table 5 / Experiment 4: whole-cache transplantation (registered endpoints)",
    "table_exp4_localization": "Experiment 4 (exploratory): partial transplants, divergent rows and exact controls",
    "table_exp5_replication": "Experiment 5: outcome-blind replication on a later checkpoint (frozen interpretation matrix)",
    "table_exp5_accuracy": "Experiment 5 (secondary): decoded accuracy, later checkpoint vs checkpoint 0, same prefixes",
    "table_first_divergence": "First divergence, tokens after the boundary: quartiles (referee minor comment 3)",
    "table_prefix_length": "Exploratory: Experiment 1 BF16 rows and divergences per boundary-prefix length bin",
    "table_prefix_length_fit": "Exploratory: logistic fit of divergence on boundary-prefix length (rates beyond the "
                               "observed prefixes are extrapolations)",
}
"""Caption of every results table (the experiment notebooks and notebook 06 use the same text)."""


def same_as_saved(df: pd.DataFrame, csv: str | Path) -> bool | None:
    """Whether ``df`` serializes to exactly the CSV an experiment notebook saved (None if that file is absent)."""
    csv = Path(csv)
    if not csv.is_file():
        return None
    return df.to_csv() == csv.read_text(encoding="utf-8")


def first_divergence_table(results: dict) -> pd.DataFrame:
    """Quartiles of the first-divergence position (tokens after the boundary), per experiment and precision.

    The referee asked for the distribution next to the paper's median and range.
    """
    rows = {}
    for exp, label in (("exp1", "Exp 1 prefill vs live"), ("exp2", "Exp 2 prefill vs incremental")):
        for d, s in results[exp].items():
            q = s["first_divergence_quartiles"]
            rng = s["first_divergence_range"]
            rows[f"{label}, {d}"] = {
                "rows": s["n"],
                "divergent rows": s["suffix"].k,
                "tie-initiated": s["tie_initiated"],
                "not tie-initiated": s["suffix"].k - s["tie_initiated"],
                "min": rng[0] if rng else "",
                "Q1": f"{q[0]:g}" if q else "",
                "median": f"{s['first_divergence_median']:g}" if s["first_divergence_median"] is not None else "",
                "Q3": f"{q[2]:g}" if q else "",
                "max": rng[1] if rng else "",
            }
    return pd.DataFrame(rows).T


def checkpoint_recipe(record: dict, ledger_root: Path, checkpoints: Path = CHECKPOINTS) -> tuple[str | None, str | None]:
    """The recipe of a replication checkpoint (notebook 00's later role table) and the recipe the ``cpu`` profile's
    recipe search chose, as ``(recipe, chosen)``; either is None where it cannot be read.

    ``record`` is the Exp 5 ledger key's ``checkpoint``. A family's folder is ``role-table-<recipe>-<digest[:12]>``
    under ``checkpoints``, the digest being the training config's (``checkpoint_config_digest``); ``cpu`` names the
    folder it chose in ``<ledger_root>/cpu/role_adaptation.json``.
    """
    def recipe(folder: str) -> str | None:
        name = Path(folder).name
        return name[len("role-table-"):].rsplit("-", 1)[0] if name.startswith("role-table-") else None

    digest = record.get("checkpoint_config_digest") or ""
    found = sorted(checkpoints.glob(f"role-table-*-{digest[:12]}")) if digest else []
    pointer = Path(ledger_root) / "cpu" / "role_adaptation.json"
    chosen = recipe(json.loads(pointer.read_text())["folder"]) if pointer.is_file() else None
    return (recipe(found[0].name) if found else None), chosen


def recipe_note(ledger: LoadedLedger | None) -> str:
    """``", recipe `v1`, which our recipe search rejects for `bal-b1`"``: words on an Exp 5 ledger's checkpoint for
    the README headline (:func:`checkpoint_recipe`); empty without a ledger or a readable recipe."""
    recipe, chosen = checkpoint_recipe(ledger.config["checkpoint"], ledger.dir.parent.parent) if ledger else (None, None)
    return "" if recipe is None else f", recipe `{recipe}`" + (
        f", which our recipe search rejects for `{chosen}`" if chosen not in (None, recipe) else "")
