"""The invariant-kernel attribution control on the CPU: every kernels value on the same problems, one ledger each.

Usage (from the repository root)::

    .venv/bin/python scripts/kernel_ablation.py --profile cpu --rows 16 [--dtype bfloat16] [--out data/kernel_ablation]
    .venv/bin/python scripts/kernel_ablation.py --profile cpu --rows 16 --table   # only (re)write the table
    .venv/bin/python scripts/kernel_ablation.py --profile cpu --rows 16 --limit 1 --dtype float32 --values default invariant

Rows are the profile's first ``--rows`` bank problems at its caps, on the eager decoders under its execution
contract with ``kernels`` set to each value of ``--values`` (default: ``default``, ``invariant``, every
``invariant-except-<class>`` and ``invariant-attention-block-128``). The loop goes row by row, and within a row value by value, so an interrupted run
leaves every value with about the same number of rows; each value's ledger is append-only and a rerun resumes it
(:class:`kvreplay.ledger.store.Ledger`, keyed by :meth:`kvreplay.runner.ArmSettings.config` with the ``kernels``
entry). ``--limit N`` computes only the first N of those problems, keeping the key of all ``--rows``, so a later
run with a larger limit extends the same ledgers. ``table.md`` beside the ledgers is rewritten from them after every
row, with the command that made it.

Two fixed orders: when ``--values`` holds both ``invariant`` and ``invariant-attention-block-128`` (the default), each
problem also gets a row of the ``orders-<dtype>-invariant-vs-invariant-attention-block-128`` ledger
(:func:`kvreplay.experiments.kernel_ablation.orders_row`: order B's cache over order A's live boundary IDs, each
suffix under its own order), tabulated below the ablation table beside the ``default`` prefill-vs-live line
(``--no-orders`` skips it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep (as under make); read when torch loads

from kvreplay import kernels  # noqa: E402
from kvreplay.contract import Caps  # noqa: E402
from kvreplay.experiments.kernel_ablation import (  # noqa: E402
    ORDER_A, ORDER_B, ROW_ALGORITHM, ablation_row, ablation_table, orders_row, orders_table,
)
from kvreplay.ledger.store import Ledger  # noqa: E402
from kvreplay.paths import ROOT  # noqa: E402
from kvreplay.problems import load_bank  # noqa: E402
from kvreplay.profiles import load_parameters  # noqa: E402
from kvreplay.report.provenance_pages import rows_of_unknown_libraries  # noqa: E402
from kvreplay.runner import ArmSettings, arm_environment  # noqa: E402

VALUES = ("default", "invariant", *(kernels.EXCEPT + c for c in ("linear", "attention", "norm", "lm_head", "rope")),
          *kernels.ATTENTION_ORDERS)


def orders_config(settings: ArmSettings, problems) -> dict:
    """The ledger key of the two-orders rows: order B's arm config with the pair of orders."""
    return settings.config("kernel_orders", problems) | {"orders": [ORDER_A, ORDER_B]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--rows", type=int, default=None, help="first N bank problems (default: the profile's n_rows)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--values", nargs="+", default=list(VALUES), choices=list(kernels.KERNELS))
    ap.add_argument("--out", default="data/kernel_ablation", help="folder of <profile>/ ledgers and table.md")
    ap.add_argument("--table", action="store_true", help="only rewrite table.md from the ledgers")
    ap.add_argument("--limit", type=int, default=None, help="compute rows for only the first N of the --rows problems "
                    "(the ledger keys keep all --rows; a later run with a larger limit resumes)")
    ap.add_argument("--no-orders", action="store_true", help="no two-orders rows (invariant vs "
                    "invariant-attention-block-128 on the same IDs)")
    args = ap.parse_args(argv)
    params = load_parameters(args.profile)
    n = args.rows or params.n_rows
    caps = Caps(params.cap_branch, params.cap_merge, params.cap_answer)
    execution = dict(params.execution or {})
    problems = load_bank()[:n]
    root = (ROOT / args.out / args.profile) if not Path(args.out).is_absolute() else Path(args.out) / args.profile
    command = " ".join(["scripts/kernel_ablation.py", *(a for a in (argv if argv is not None else sys.argv[1:]) if a != "--table")])
    settings = {v: ArmSettings(profile=args.profile, dtype=args.dtype, caps=caps, threads=execution.get("threads", 2),
                               kernels=v) for v in args.values}
    lm = fmt = None
    ledgers: dict[str, Ledger] = {}
    if not args.table:
        lm, fmt = settings["default"].load()
        base = lm.contract
    for v, s in settings.items():
        env = None
        if lm is not None:
            lm.contract = dataclasses.replace(base, kernels=v)
            env = arm_environment(lm, fmt, s)
        ledgers[v] = Ledger(root, f"kernels-{args.dtype}-{v}", s.config("kernel_ablation", problems), env,
                            row_algorithm=ROW_ALGORITHM)
    orders = None
    if not args.no_orders and ORDER_A in settings and ORDER_B in settings:
        s = settings[ORDER_B]
        if lm is not None:
            lm.contract = dataclasses.replace(base, kernels=ORDER_B)
        orders = Ledger(root, f"orders-{args.dtype}-{ORDER_A}-vs-{ORDER_B}", orders_config(s, problems),
                        arm_environment(lm, fmt, s) if lm is not None else None, row_algorithm=ROW_ALGORITHM)

    def write_table() -> None:
        by_value = {v: led.records() for v, led in ledgers.items()}
        marked = rows_of_unknown_libraries({v: led.dir for v, led in ledgers.items()})
        table = ablation_table(by_value, marked)
        if orders is not None:
            table += ("\nTwo fixed orders of the attention class at fixed precision, beside the default kernels' "
                      "prefill vs live:\n\n" + orders_table(orders.records(), by_value))
            ids = {r["problem_id"] for r in orders.records()}
            shared = sorted(ids & marked.get("default", set()))
            if shared:
                table += (f"\nOf the `default` rows on these problems, {len(shared)} of {len(ids)} were written by a "
                          "library of no known commit.\n")
        (root / "table.md").write_text(
            f"Attribution control of the invariant-kernel contract, profile `{args.profile}` ({args.dtype}, caps "
            f"{caps.branch}/{caps.merge}/{caps.answer}, first {n} bank problems; rows done per value below).\n"
            f"Made by `{command}` (rerun: it resumes each ledger; `--table` rewrites only this file); rows from the "
            f"ledgers beside this file.\n\n" + table)
        print(table, flush=True)

    if not args.table:
        for p in problems[: args.limit]:
            for v in args.values:
                led = ledgers[v]
                if p.problem_id in led.done_keys():
                    continue
                lm.contract = dataclasses.replace(base, kernels=v)
                t = time.perf_counter()
                row = ablation_row(lm, fmt, p, caps)
                led.append(row)
                led.log(event="row", problem_id=p.problem_id, seconds=round(time.perf_counter() - t, 1))
                print(f"{p.problem_id} {v}: drift exact {row['drift']['exact']} rel_l2 {row['drift']['rel_l2']:.2e} "
                      f"diverged {row['diverged']} live {row['live']['predicted']} ({row['live']['correct']}) "
                      f"{time.perf_counter() - t:.0f}s", flush=True)
            if orders is not None and p.problem_id not in orders.done_keys():
                t = time.perf_counter()
                row = orders_row(lm, fmt, p, caps)
                orders.append(row)
                orders.log(event="row", problem_id=p.problem_id, seconds=round(time.perf_counter() - t, 1))
                print(f"{p.problem_id} orders: drift exact {row['drift']['exact']} rel_l2 {row['drift']['rel_l2']:.2e} "
                      f"diverged {row['diverged']} answers {row['order_a']['predicted']} {row['order_b']['predicted']} "
                      f"{time.perf_counter() - t:.0f}s", flush=True)
            write_table()
    write_table()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
