"""Two computations of one arm side by side on the same problems (paper §4.1, §4.2).

When a profile is recomputed under another execution contract (another attention, batch shape, tie rule or
branch cap), its BF16 rows change where an exact top-1/top-2 tie or a last-bit difference moved a trajectory.
:func:`old_vs_new` counts, on the problems both ledgers hold, whether two constructions' suffixes part
(:data:`COMPARED`). It counts under both, under the old only, under the new only and under neither, with the exact
McNemar test on the two discordant counts (:func:`kvreplay.analysis.stats.mcnemar_exact`). Rows with a gate failure in either ledger are counted
apart, never as divergent or not. Nothing is asserted about the outcome.

Command line::

    python -m kvreplay.report.recompute OLD_LEDGER NEW_LEDGER [--arms A B] [--md FILE]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from ..analysis.stats import mcnemar_exact, wilson


def parts(record: Mapping[str, Any], a: str = "prefill", b: str = "live") -> bool:
    """Whether two arms' suffixes of one Experiment 1 record part (any token differs, or one is shorter)."""
    arms = record["arms"]
    return list(arms[a]["suffix"]) != list(arms[b]["suffix"])


COMPARED = {"exp2": ("prefill", "incremental")}
"""The two constructions whose suffixes are compared, by experiment, where not prefill and live (Experiment 1 and
its controls): Experiment 2 compares prefill with incremental on its fixed prefixes."""


def old_vs_new(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]],
               arms: tuple[str, str] = ("prefill", "live")) -> dict[str, Any]:
    """The 2x2 of "the two arms' suffixes part" under two computations, on the problems both hold.

    Args:
        old, new: records with ``problem_id``, ``gate_failure`` and ``arms`` holding suffixes.
        arms: the two arms compared in each record.

    Returns:
        ``{"problems", "gate_failures", "both", "old_only", "new_only", "neither", "old_rate", "new_rate",
        "mcnemar_p"}``: counts over the common problems without a gate failure in either; each rate is a
        :class:`~kvreplay.analysis.stats.Proportion` (Wilson 95%).

    Raises:
        ValueError: the two share no problem.
    """
    by_id = {r["problem_id"]: r for r in new}
    common = [(r, by_id[r["problem_id"]]) for r in old if r["problem_id"] in by_id]
    if not common:
        raise ValueError("old_vs_new: the two ledgers share no problem")
    clean = [(o, n) for o, n in common if not o.get("gate_failure") and not n.get("gate_failure")]
    a = [parts(o, *arms) for o, _ in clean]
    b = [parts(n, *arms) for _, n in clean]
    both = sum(x and y for x, y in zip(a, b))
    return {"problems": len(clean), "gate_failures": len(common) - len(clean), "both": both,
            "old_only": sum(a) - both, "new_only": sum(b) - both, "neither": len(clean) - sum(a) - sum(b) + both,
            "old_rate": wilson(sum(a), len(clean)), "new_rate": wilson(sum(b), len(clean)),
            "mcnemar_p": mcnemar_exact(a, b).pvalue if clean else None}


def table(result: Mapping[str, Any], old_name: str, new_name: str) -> pd.DataFrame:
    """:func:`old_vs_new` as a one-row table (rates in percent with their Wilson 95% intervals)."""
    def rate(p) -> str:
        return f"{p.k}/{p.n} ({100 * p.rate:.1f}% [{100 * p.low:.1f}, {100 * p.high:.1f}])"

    return pd.DataFrame([{
        "problems": result["problems"], f"part under {old_name}": rate(result["old_rate"]),
        f"part under {new_name}": rate(result["new_rate"]), "under both": result["both"],
        f"under {old_name} only": result["old_only"], f"under {new_name} only": result["new_only"],
        "under neither": result["neither"], "exact McNemar p": f"{result['mcnemar_p']:.3g}",
        "left out (a gate failure in either)": result["gate_failures"]}])


def main(argv: list[str] | None = None) -> int:
    from ..ledger.lookup import read_ledger

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path, help="the earlier ledger folder")
    ap.add_argument("new", type=Path, help="the recomputed ledger folder")
    ap.add_argument("--arms", nargs=2, default=None, metavar=("A", "B"),
                    help="the two arms compared (default: prefill and live; Experiment 2: prefill and incremental)")
    ap.add_argument("--md", type=Path, default=None, help="write the table (with the command) to this Markdown file")
    args = ap.parse_args(argv)
    old, new = read_ledger(args.old), read_ledger(args.new)
    config = old.manifest["config"]
    arms = tuple(args.arms) if args.arms else COMPARED.get(config["experiment"], ("prefill", "live"))
    res = old_vs_new(old.records, new.records, arms)
    text = table(res, args.old.name, args.new.name).to_markdown(index=False)
    print(text)
    if args.md:
        command = "python -m kvreplay.report.recompute " + " ".join(argv if argv is not None else sys.argv[1:])
        args.md.write_text(f"`{command}`\n\n{arms[0].capitalize()} and {arms[1]} suffixes part ({config['experiment']} "
                           f"{config['dtype']}), the same problems under two computations.\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
