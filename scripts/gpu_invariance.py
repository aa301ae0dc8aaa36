"""The invariant-kernel contract's invariants measured on a device: prefill = live = incremental bit for bit on every
layer, and a row alone (B = 1) against the same row inside batches of other sizes, BF16 and FP32.

Usage (on the GPU machine, after ``source scripts/offline_gpu_env.sh``)::

    OUT=/some/folder python3 scripts/gpu_invariance.py --device cuda [--rows 2] [--caps 48 160 12] [--sizes 2 7 64]

writes ``$OUT/invariance.json``: per dtype and kernels value (``invariant``, and ``default`` for comparison), per
problem the tensors that differ between the constructions and the prefill-vs-live relative L2, and per batch size
whether the target row's logits and cache are bit-identical to the row alone; plus the environment record and
wall seconds. ``--engine-sizes 2 7 64`` adds the batched engine's check per problem
(:func:`kvreplay.invariance.engine_check`): the eager decoders' live boundary and suffix against the engine's row
alone (B = 1), and the row alone against the row beside the other problems at each size, in another slot. On the CPU the same command runs at tiny sizes (``--device cpu --rows 1 --caps 4 4 2 --sizes 2``);
``tests/test_gpu_invariance_script.py`` runs it on a tiny model. Outcomes are printed and written, never asserted.
The invariant kernels are the slow reference (one kernel call per row, query and key block): each row prints its
seconds, so try ``--rows 1`` first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvreplay import invariance
from kvreplay.contract import BlockFormat, Caps
from kvreplay.engine import EngineRun
from kvreplay.models import LoadedModel, environment_record
from kvreplay.problems import Problem


def measure(load: Callable[[str], tuple[LoadedModel, BlockFormat]], problems: list[Problem], caps: Caps,
            sizes: list[int], dtypes: list[str], values: list[str], whole: bool = False,
            engine_sizes: list[int] | None = None) -> dict:
    """The report: ``{"caps", "sizes", "runs": [{"dtype", "kernels", "rows": [...], "environment"}]}``.

    The batch check's target row is the problem's prompt block (``whole``: its whole live boundary prefix), beside
    the other problems' prompts, its own prefix cut short and its whole live prefix.
    """
    runs = []
    for dtype in dtypes:
        lm, fmt = load(dtype)
        base = lm.contract
        for value in values:
            lm.contract = dataclasses.replace(base, kernels=value)
            rows = []
            prompts = [fmt.prompt_ids(p.question, p.options) for p in problems]
            for i, p in enumerate(problems):
                t = time.perf_counter()
                c = invariance.construction_check(lm, fmt, prompts[i], caps)
                live_ids = c.pop("boundaries")[0].ids
                target = live_ids if whole else prompts[i]
                companions = [q for j, q in enumerate(prompts) if j != i] + [target[:-5], live_ids]
                b = invariance.batch_check(lm, target, companions, sizes)
                row = {"problem_id": p.problem_id, **c, "batch": {str(k): v for k, v in b.items()}}
                if engine_sizes:
                    e = invariance.engine_check(lm, fmt, prompts[i], [q for j, q in enumerate(prompts) if j != i]
                                                or [prompts[i][:-5]], caps, EngineRun(), engine_sizes)
                    row["engine"] = {str(k): v for k, v in e.items()}
                    print(f"{dtype} {value} {p.problem_id}: engine differs {row['engine']}", flush=True)
                rows.append(row | {"seconds": round(time.perf_counter() - t, 2)})
                print(f"{dtype} {value} {p.problem_id}: |z| {c['boundary']} live=inc {not c['live_vs_incremental']} "
                      f"live=prefill {not c['live_vs_prefill']} rel_l2 {c['rel_l2_prefill_vs_live']:.2e} "
                      + " ".join(f"B={k}:{v['logits_equal'] and not v['cache_differs']}" for k, v in b.items()),
                      flush=True)
            runs.append({"dtype": dtype, "kernels": value, "rows": rows, "environment": environment_record(lm)})
    return {"caps": dataclasses.asdict(caps), "sizes": sizes, "runs": runs}


def main(argv: list[str] | None = None, load: Callable[[str], tuple[LoadedModel, BlockFormat]] | None = None,
         problems: list[Problem] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--caps", type=int, nargs=3, default=[48, 160, 12])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 7, 64])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--values", nargs="+", default=["invariant", "default"])
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--whole", action="store_true", help="batch check on the whole boundary prefix, not the prompt")
    ap.add_argument("--engine-sizes", type=int, nargs="*", default=[],
                    help="batch sizes of the batched engine's check (none: not run)")
    args = ap.parse_args(argv)
    if load is None:
        from kvreplay.runner import ArmSettings

        def load(dtype: str):
            return ArmSettings(profile="invariance", dtype=dtype, caps=Caps(*args.caps), device=args.device,
                               threads=args.threads, kernels="invariant").load()
    if problems is None:
        from kvreplay.problems import load_bank

        problems = load_bank()[: args.rows]
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    report = measure(load, problems, Caps(*args.caps), args.sizes, args.dtypes, args.values, args.whole,
                     args.engine_sizes)
    report["wall_s"] = round(time.perf_counter() - t, 1)
    report["command"] = " ".join(["scripts/gpu_invariance.py", *(argv if argv is not None else sys.argv[1:])])
    path = out / "invariance.json"
    path.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path} ({report['wall_s']} s)")
    return path


if __name__ == "__main__":
    main()
