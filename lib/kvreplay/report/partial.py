"""Endpoints of a profile whose ledgers are not complete yet (paper §4.1-§4.5, §3.4).

``make paper`` needs every row of an arm; a profile computed on a GPU in
several runs has ledgers that stop at their last finished chunk until the
last run ends. This module reads those rows
as they are, pairs the BF16 and FP32 arms on the problems both have finished,
and prints the suffix-divergence endpoint (Experiment 1: live vs prefill;
Experiment 2: incremental vs prefill on the fixed BF16 prefixes) with Wilson
intervals, the tie-initiated split and the exact McNemar test. Experiments
3-5 (one BF16 arm each) get the tables their notebooks write, computed on
the rows finished so far: the bridge table, the transplant table (with any
panel row that did not meet the transplant's precondition named) and the
replication table on the later checkpoint the ledger names. An arm
that has not started is left out (and so is the pairing). It computes
nothing on a model and writes nothing.

Usage: ``python -m kvreplay.report.partial [--profile paper] [--experiments exp1 exp2 exp3 exp4 exp5]``. How many
rows each arm has finished goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import pandas as pd

from ..arm_facts import ARM_FACTS, Derived
from ..gates import GateError
from ..ledger.lookup import finished_rows, ledger_progress
from ..ledger.records import Exp1Record, Exp2Record
from ..paths import LEDGERS
from ..analysis.stats import mcnemar_exact, wilson


def arm_rows(root: Path, experiment: str, dtype: str) -> tuple[Path, list[Any]]:
    """The one ledger folder ``<experiment>-<dtype>-*`` under ``root`` and its finished rows, in ledger order
    (typed ``Any``: their record, :mod:`kvreplay.ledger.records`, depends on ``experiment``).

    Raises:
        FileNotFoundError: no such folder, or one without its ``manifest.json`` (an arm that never started).
        ValueError: more than one folder (two configs of one arm: name the one to read).
    """
    folders = sorted(root.glob(f"{experiment}-{dtype}-*"))
    if not folders:
        raise FileNotFoundError(f"no ledger {experiment}-{dtype}-* under {root}")
    if len(folders) == 1 and not (folders[0] / "manifest.json").is_file():
        raise FileNotFoundError(f"{folders[0]} has no manifest.json")
    if len(folders) > 1:
        raise ValueError(f"{len(folders)} ledgers {experiment}-{dtype}-* under {root}: {[f.name for f in folders]}")
    return folders[0], finished_rows(folders[0])


def _titles(kind: str) -> dict[str, str]:
    return {e: f.title for e, f in ARM_FACTS.items() if f.partial == kind and f.title is not None}


COMPARISON: Mapping[str, str] = Derived(lambda: _titles("suffix"))
"""What the suffix-divergence endpoint compares, per experiment (both rows have the same ``endpoints`` layout): the
:attr:`~kvreplay.arm_facts.ArmFacts.title` of each arm tabulated ``"suffix"``."""
ONE_ARM_TITLES: Mapping[str, str] = Derived(lambda: _titles("one_arm"))
"""Experiments with one BF16 arm, reported by their notebooks' own summary tables (:func:`one_arm_table`), and what
each table is about (its heading): the arms tabulated ``"one_arm"``."""


def title(experiment: str) -> str:
    """The heading of one experiment's table (its :attr:`~kvreplay.arm_facts.ArmFacts.title`).

    Raises:
        KeyError: the experiment has no table here."""
    return {**COMPARISON, **ONE_ARM_TITLES}[experiment]


def one_arm_table(experiment: str, rows: list[Any], folder: Path | None = None) -> pd.DataFrame:
    """The summary table of a one-arm experiment (Experiment 3's bridge, 4's transplants, 5's replication) on the
    finished ``rows`` of its BF16 arm: ``partial_table(rows, folder)`` of the module its facts name
    (:attr:`~kvreplay.arm_facts.ArmFacts.module`). Experiment 5 names its checkpoint from the ledger ``folder``'s
    manifest.

    Raises:
        GateError: a row failed a gate (Experiments 4 and 5: a gate other than the transplant's precondition).
        ValueError: ``experiment`` is not one of :data:`ONE_ARM_TITLES`, or Experiment 5 without its ``folder``.
    """
    if experiment not in ONE_ARM_TITLES:
        raise ValueError(f"{experiment!r} is not one of {list(ONE_ARM_TITLES)}")
    module = importlib.import_module(f"kvreplay.experiments.{ARM_FACTS[experiment].module}")
    return cast(pd.DataFrame, module.partial_table(rows, folder))


def suffix_frame(rows: Sequence[Exp1Record] | Sequence[Exp2Record]) -> pd.DataFrame:
    """One line per finished Experiment 1 or 2 row: problem, gate failure, suffix differs, tie-initiated, boundary exact."""
    def line(r: Exp1Record | Exp2Record) -> dict:
        ep = r["endpoints"] if r["gate_failure"] is None else None  # a row stopped by a gate has none
        return {
            "problem_id": r["problem_id"],
            "gate_failure": r.get("gate_failure"),
            "suffix_differs": bool(ep["suffix_differs"]) if ep else None,
            "tie_initiated": bool(ep.get("tie_initiated")) if ep else None,
            "boundary_exact": ep["boundary_exact"] if ep else None,
        }

    return pd.DataFrame([line(r) for r in rows])


def suffix_summary(rows: Mapping[str, Sequence[Exp1Record]] | Mapping[str, Sequence[Exp2Record]]) -> pd.DataFrame:
    """Suffix divergence of each precision on its finished rows, and of both on the rows both finished.

    ``rows`` maps ``"bfloat16"`` and/or ``"float32"`` to the finished Experiment 1 (or 2) rows of that
    arm (:func:`arm_rows`); with only one precision there are no paired lines.

    Returns a frame with one line per (rows, precision): rows, gate failures, boundary caches not
    bit-exact, suffixes that differ with the Wilson 95% interval, and how many of those are tie-initiated.
    The last line is the exact McNemar test of the paired rows (BF16 differs, FP32 same / the reverse).

    Raises:
        ValueError: ``rows`` holds neither precision.
    """
    frames = {dtype: suffix_frame(rows[dtype]) for dtype in ("bfloat16", "float32") if dtype in rows}
    if not frames:
        raise ValueError("no finished arm to summarise (neither bfloat16 nor float32 rows given)")
    paired = len(frames) == 2
    shared = set(frames["bfloat16"].problem_id) & set(frames["float32"].problem_id) if paired else set()
    lines = []
    views = [("all finished", lambda f: f)]
    if paired:
        views.append(("paired (both finished)", lambda f: f[f.problem_id.isin(shared)]))
    for label, pick in views:
        for dtype, frame in frames.items():
            f = pick(frame)
            ok = f[f.gate_failure.isna()]
            k, n = int(ok.suffix_differs.sum()), len(ok)
            lines.append({"rows": label, "precision": dtype, "n": n, "gate_failures": int(f.gate_failure.notna().sum()),
                          "boundary_not_exact": int((~ok.boundary_exact.astype(bool)).sum()),
                          "suffix_differs": wilson(k, n).pct() if n else "n/a",
                          "tie_initiated": int((ok.suffix_differs.astype(bool) & ok.tie_initiated.astype(bool)).sum())})
    if shared:
        bf16 = frames["bfloat16"].set_index("problem_id").loc[sorted(shared)]
        fp32 = frames["float32"].set_index("problem_id").loc[sorted(shared)]
        m = mcnemar_exact(bf16.suffix_differs.astype(bool), fp32.suffix_differs.astype(bool))
        lines.append({"rows": "paired (both finished)", "precision": "McNemar (exact)", "n": len(shared),
                      "suffix_differs": f"BF16 only {m.b}, FP32 only {m.c}, p = {m.pvalue:.3g}"})
    return pd.DataFrame(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvreplay.report.partial", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--profile", default="paper", help="profile whose ledgers are read (<ledger-root>/<profile>/)")
    ap.add_argument("--ledger-root", type=Path, default=LEDGERS, help="folder holding <profile>/ ledger folders")
    ap.add_argument("--experiments", nargs="+", choices=[*sorted(COMPARISON), *ONE_ARM_TITLES],
                    default=[*sorted(COMPARISON), *ONE_ARM_TITLES], help="which experiments' tables, in this order")
    args = ap.parse_args(argv)
    root = args.ledger_root / args.profile
    if not root.is_dir():
        known = sorted(p.name for p in args.ledger_root.iterdir() if p.is_dir()) if args.ledger_root.is_dir() else []
        print(f"error: no ledgers of profile {args.profile!r} under {args.ledger_root} (profiles with ledgers: {known})",
              file=sys.stderr)
        return 2
    status = 0
    for experiment in args.experiments:
        rows, folders, unfinished = {}, {}, []
        for dtype in ("bfloat16",) if experiment in ONE_ARM_TITLES else ("bfloat16", "float32"):
            try:
                folder, arm = arm_rows(root, experiment, dtype)
            except FileNotFoundError as e:
                print(f"{experiment}-{dtype}: not started ({e})", file=sys.stderr)
                continue
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                status = 2
                continue
            done, wanted = ledger_progress(folder)
            print(f"{folder.name}: {done} of {wanted} rows finished", file=sys.stderr)
            if not arm:  # a run cut off in its first chunk leaves a manifest and no row
                print(f"{experiment}-{dtype}: not started (no finished row)", file=sys.stderr)
                continue
            rows[dtype], folders[dtype] = arm, folder
            if done < wanted:
                unfinished.append(f"{folder.name}: {done} of {wanted} rows, the first in the frozen order (not a sample)")
        if not rows:
            continue
        try:
            if experiment in ONE_ARM_TITLES:
                table = one_arm_table(experiment, rows["bfloat16"], folders["bfloat16"]).to_markdown()
            else:
                summary = suffix_summary(rows)
        except (GateError, ValueError) as e:
            print(f"error: {experiment}: {e}", file=sys.stderr)
            status = max(status, 1)
            continue
        print(f"## {experiment}: {title(experiment)}")
        if unfinished:
            print("unfinished: " + "; ".join(unfinished))
        print(table if experiment in ONE_ARM_TITLES else summary.astype(object).fillna("").to_markdown(index=False))
        print()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
