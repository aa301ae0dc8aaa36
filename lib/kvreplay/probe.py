"""Probe the execution contract on a device: do the duplicate rows stay in sync, and does the desync gate fail closed?

Usage: ``python -m kvreplay.probe --device cuda [--rows 2] [--caps 32 64 8] [--out probe.json]``.

The settings (:data:`SETTINGS`) are the default contract, all SDPA backends
with cuDNN allowed and deterministic algorithms off, cuDNN attention alone,
and the memory-efficient kernel alone with deterministic algorithms. Each runs
Experiment 1 rows (live decoding, then the four-arm matrix, BF16 and FP32). Per
setting and precision it reports how many rows passed every gate, which
gate stopped the others, and whether BF16 prefill drifted from live. The
default contract must pass; a variant may fail, but only through a gate
(``desync``), never silently. Prints a table and writes JSON; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from .decoding.contract import Caps
from .model.execution import device_or_exit
from .ledger.records import Exp1Record, GateFailure
from .experiments.live_vs_prefill import live_vs_prefill_row
from .data.problems import load_bank
from .runner import ArmSettings, RunSpec

SETTINGS: dict[str, dict[str, Any]] = {
    "contract default (math SDPA; deterministic on CUDA)": {"sdpa_backends": ("math",), "deterministic": None},
    "all SDPA backends incl. cuDNN, nondeterministic": {"sdpa_backends": ("cudnn", "flash", "efficient", "math"), "deterministic": False},
    "cuDNN SDPA only, nondeterministic": {"sdpa_backends": ("cudnn",), "deterministic": False},
    "efficient SDPA, deterministic": {"sdpa_backends": ("efficient",), "deterministic": True},
}


def run(device: str = "cuda", rows: int = 2, caps: tuple[int, int, int] = (32, 64, 8), dtypes=("bfloat16", "float32"),
        settings: dict | None = None) -> list[dict]:
    """Probe each setting; returns one dict per (setting, dtype)."""

    problems = load_bank()[:rows]
    out = []
    for label, kw in (settings or SETTINGS).items():
        for dtype in dtypes:
            s = ArmSettings(profile="probe", dtype=dtype, caps=Caps(*caps), device=device, threads=1, **kw)
            t0 = time.perf_counter()
            try:
                lm, fmt = s.load()
            except Exception as e:  # a backend this torch build or device cannot use at all
                out.append({"setting": label, "dtype": dtype, "error": f"{type(e).__name__}: {e}"})
                continue
            spec = RunSpec(lm=lm, fmt=fmt, decoding=s.decoding)
            recs: list[Exp1Record] = []
            failures: list[GateFailure] = []  # in problem order, a kernel error among them
            for p in problems:
                try:
                    rec = live_vs_prefill_row(spec, p)
                except RuntimeError as e:  # a kernel refusing the mask, say: not a gate, but not silent either
                    failures.append({"gate": "error", "reason": f"{type(e).__name__}: {str(e)[:200]}"})
                    continue
                recs.append(rec)
                if rec["gate_failure"] is not None:
                    failures.append(rec["gate_failure"])
            ok = [r for r in recs if r["gate_failure"] is None]
            out.append({
                "setting": label, "dtype": dtype, "rows": len(problems), "passed_all_gates": len(ok),
                "gates_failed": sorted({f["gate"] for f in failures}),
                "first_failure": failures[0]["reason"] if failures else None,
                "boundary_non_exact": sum(not r["endpoints"]["boundary_exact"] for r in ok),
                "suffix_differs": sum(r["endpoints"]["suffix_differs"] for r in ok),
                "seconds": round(time.perf_counter() - t0, 1),
            })
            del lm, spec
    return out


def main(argv: list[str] | None = None) -> int:
    import pandas as pd

    ap = argparse.ArgumentParser(prog="python -m kvreplay.probe", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--caps", type=int, nargs=3, default=(32, 64, 8))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device_or_exit(ap, args.device)
    if args.rows < 1:
        ap.error(f"--rows {args.rows}: must be at least 1")
    res = run(args.device, args.rows, tuple(args.caps))
    print(pd.DataFrame(res).to_markdown(index=False))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
