"""Cross-hardware comparison: the same Experiment 1 rows computed in two setups, compared token for token.

Two profiles that share problems (the ``cpu`` profile's 16 rows are the first
16 of the ``gpu`` profile's 200) computed Experiment 1 on different devices,
step paths and batch shapes. For each pair of setups and each precision, on the rows both hold, this
counts three things: rows with the same live boundary prefix (token IDs of z), rows with the same prefix
*and* the same suffix per arm (live and prefill), and diverging suffixes in each setup. No
model is loaded: only the ledgers' records are read.

A third setup separates device from decode path: ``gpu_eager`` (the same
rows on the H200 through the eager batch-of-one reference path of the
``cpu`` run) sits between the 2-core CPU (eager) and the H200 graph engine
(``batch`` problems per step).

Usage::

    python -m kvreplay.report.cross_hardware            # writes figures/gpu/table_cross_hardware.{csv,md,tex}
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd

from ..ledger.records import Exp1Record, arm_of
from ..ledger.checked import checked_rows
from ..paths import FIGURES, LEDGERS
from .files import save_table

SETUPS = (
    ("cpu", "2-core CPU, eager"),
    ("gpu_eager", "H200, eager"),
    ("gpu", "H200, graph engine"),
)
"""Profiles compared (ledger folder under ``data/ledgers/``) and how each one decodes."""

ARMS = ("live", "prefill")
"""Arms compared (their storage-isolated replicas are gated bit-identical to them)."""
CAPTION = ("Cross-hardware: Experiment 1 rows computed in two setups, token IDs compared on the rows both hold "
           "(same prefix; same prefix and suffix per arm)")


def exp1_records(ledger_root: str | Path, profile: str, dtype: str) -> dict[str, Exp1Record]:
    """Problem ID -> Experiment 1 record of one profile and precision (every ledger folder ``exp1-<dtype>-*``).

    Raises:
        ValueError: two ledgers of the profile hold the same problem (two configs of one arm).
    """
    out: dict[str, Exp1Record] = {}
    for folder in sorted(Path(ledger_root, profile).glob(f"exp1-{dtype}-*")):
        for row in checked_rows(folder):  # a damaged, duplicated, malformed or unchecked row: named by file and line
            rec = row.record
            if rec["problem_id"] in out:
                raise ValueError(f"{profile}: problem {rec['problem_id']} is in two exp1-{dtype} ledgers")
            out[rec["problem_id"]] = rec
    return out


def compare(a: Mapping[str, Exp1Record], b: Mapping[str, Exp1Record]) -> dict:
    """Counts over the problems both record sets hold (rows with a gate failure are left out).

    Returns:
        ``rows``, ``prefix_same``, ``<arm>_same`` (prefix and that arm's suffix token-identical) for each arm,
        ``divergent_a`` / ``divergent_b`` (prefill vs live suffixes differ in each setup).
    """
    pa = {k: r for k, r in a.items() if r["gate_failure"] is None}
    pb = {k: r for k, r in b.items() if r["gate_failure"] is None}
    ids = [k for k in pa if k in pb]
    out = {"rows": len(ids), "prefix_same": sum(pa[k]["prefix"] == pb[k]["prefix"] for k in ids)}
    for arm in ARMS:
        out[f"{arm}_same"] = sum(pa[k]["prefix"] == pb[k]["prefix"]
                                 and arm_of(pa[k], arm)["suffix"] == arm_of(pb[k], arm)["suffix"] for k in ids)
    out["divergent_a"] = sum(bool(pa[k]["endpoints"]["suffix_differs"]) for k in ids)
    out["divergent_b"] = sum(bool(pb[k]["endpoints"]["suffix_differs"]) for k in ids)
    return out


def cross_hardware_table(ledger_root: str | Path = LEDGERS, setups: Sequence[tuple[str, str]] = SETUPS,
                         precisions: Sequence[str] = ("bfloat16", "float32")) -> pd.DataFrame:
    """One row per (pair of setups, precision) with :func:`compare`'s counts as ``k/n`` strings.

    Pairs whose profiles share no row are left out.
    """
    rows = []
    for i, (pa, la) in enumerate(setups):
        for pb, lb in setups[i + 1:]:
            for dtype in precisions:
                c = compare(exp1_records(ledger_root, pa, dtype), exp1_records(ledger_root, pb, dtype))
                n = c["rows"]
                if not n:
                    continue
                rows.append({
                    "setups": f"{la} (`{pa}`) vs {lb} (`{pb}`)", "precision": dtype, "shared rows": n,
                    "boundary prefix same": f"{c['prefix_same']}/{n}",
                    **{f"prefix + {arm} suffix same": f"{c[f'{arm}_same']}/{n}" for arm in ARMS},
                    "suffixes diverge (first / second setup)": f"{c['divergent_a']}/{n} / {c['divergent_b']}/{n}",
                })
    return pd.DataFrame(rows).set_index(["setups", "precision"]) if rows else pd.DataFrame()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvreplay.report.cross_hardware", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ledger-root", default=str(LEDGERS))
    ap.add_argument("--out", default=str(FIGURES / "gpu" / "table_cross_hardware"), help="output stem")
    ap.add_argument("--setup", nargs=2, action="append", metavar=("FOLDER", "LABEL"),
                    help="a setup: its folder under --ledger-root and how it decodes (repeatable; default: "
                         + ", ".join(f"{p} ({label})" for p, label in SETUPS) + ")")
    args = ap.parse_args(argv)
    setups = tuple(tuple(s) for s in args.setup) if args.setup else SETUPS
    table = cross_hardware_table(args.ledger_root, setups)
    command = "python -m kvreplay.report.cross_hardware" + "".join(f" --setup {f} '{label}'" for f, label in args.setup or ())
    save_table(table, args.out, caption=CAPTION, source=command)
    print(table.to_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
