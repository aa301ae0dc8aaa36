"""The invariant-kernel contract's invariants measured on a device: prefill = live = incremental bit for bit on every
layer, and a row alone (B = 1) against the same row inside batches of other sizes, BF16 and FP32.

Usage (on the GPU machine, after ``source scripts/offline_gpu_env.sh``; cheapest first)::

    python -m kvreplay.bench invariance --device cuda --out "$OUT" --rows 1 --sizes 2 --caps 4 4 2 --budget-s 500
    python -m kvreplay.bench invariance --device cuda --out "$OUT" --rows 2 --sizes 2 7 64 --budget-s 500

The work is split into units, one check of one problem under one dtype and kernels value. ``batch-<B>``: the
problem's prompt block alone against the same block in the last slot of a batch of ``B`` rows, beside other
prompts and a shortened copy of itself. ``construction``: live, incremental and prefill boundaries at
``--caps``. A problem's batch units run first (cheapest), smallest ``B`` first, then its construction;
with ``--whole`` the construction runs first and the batch units use its whole live boundary prefix. Each unit
prints a line when it starts and when it ends (flushed), and its JSON is written as soon as it finishes:
``<out>/units/<dtype>/<kernels>/<problem_id>/<check>.json`` (the settings it ran under, its result, seconds and
the environment record). A
rerun with the same settings keeps finished units and runs the rest; a unit file of other settings is refused.
``<out>/invariance.json`` gathers every finished unit, per dtype and kernels value, with the environment records,
and is rewritten after each unit. ``--budget-s`` stops cleanly before that many seconds. No unit starts that the
longest finished unit of its kind says would not end in time; one still running at the limit is abandoned
(its file is not written), and the report says ``"stopped"``. Outcomes are printed and written, never asserted.
``--engine-sizes 2 7 64`` adds a unit ``engine`` per problem, after its construction
(:func:`kvreplay.bench.invariance_checks.engine_check`). It compares the eager decoders' live boundary and suffix with the
batched engine's row alone (B = 1), and the row alone with the row beside the other problems at each size, in
another slot.

On the CPU the same command runs at tiny sizes (``--device cpu --rows 1 --caps 4 4 2 --sizes 2``);
``tests/test_bench_invariance.py`` runs it on a tiny model. The invariant kernels are the slow reference (one
kernel call per row, query and key block), so on a GPU a construction unit at the ``cpu`` profile's caps takes far
longer than a batch unit of a prompt. ``--values invariant-fused`` runs the same checks under the fused Triton
kernels (CUDA; on the CPU only with ``TRITON_INTERPRET=1``, slowly). For example::

    python -m kvreplay.bench invariance --device cuda --out "$OUT" --values invariant-fused --rows 2 \
        --sizes 2 7 64 --engine-sizes 2 64 --budget-s 500
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from . import invariance_checks as invariance
from ..decoding.contract import BlockFormat, Caps
from ..engine import EngineRun
from ..model.models import LoadedModel, environment_record
from ..data.problems import Problem


class BudgetExceeded(Exception):
    """The ``--budget-s`` limit came while a unit ran (the unit is abandoned, its file not written)."""


@dataclasses.dataclass
class Units:
    """The units of a run, written under ``out`` as they finish, and the report gathered from them."""
    out: Path
    caps: Caps
    sizes: list[int]
    whole: bool
    budget_s: float | None
    engine_sizes: list[int] = dataclasses.field(default_factory=list)
    engine_step_path: str = "eager"
    start: float = dataclasses.field(default_factory=time.perf_counter)
    report: dict = dataclasses.field(default_factory=dict)
    longest: dict = dataclasses.field(default_factory=dict)

    def settings(self, dtype: str, value: str, problem_id: str, check: str) -> dict:
        """What a unit's result depends on (the caps only where a live boundary enters: the construction check,
        and every check with ``whole``)."""
        out = {"dtype": dtype, "kernels": value, "problem_id": problem_id, "check": check, "whole": self.whole}
        if check in ("construction", "engine") or self.whole:
            out["caps"] = dataclasses.asdict(self.caps)
        if check == "engine":
            out["engine_sizes"] = list(self.engine_sizes)
            if self.engine_step_path != "eager":  # an eager unit's settings stay as they were
                out["engine_step_path"] = self.engine_step_path
        return out

    def path(self, dtype: str, value: str, problem_id: str, check: str) -> Path:
        return self.out / "units" / dtype / value / problem_id / f"{check}.json"

    def kept(self, settings: dict) -> dict | None:
        """A finished unit of these settings, or None.

        Raises:
            SystemExit: the unit's file holds other settings (naming the file).
        """
        path = self.path(settings["dtype"], settings["kernels"], settings["problem_id"], settings["check"])
        if not path.is_file():
            return None
        unit = json.loads(path.read_text())
        if unit.get("settings") != settings:
            raise SystemExit(f"{path}: a unit of other settings ({unit.get('settings')}, not {settings}); use "
                             f"another --out, or delete that file to run it again")
        return unit

    def may_start(self, check: str) -> bool:
        """Whether a unit of kind ``check`` may start under the budget (by the longest of its kind so far)."""
        if self.budget_s is None:
            return True
        kind = check.split("-")[0]
        return self.elapsed() + self.longest.get(kind, 0.0) < self.budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def finish(self, settings: dict, result: dict, seconds: float, environment: dict) -> dict:
        unit = {"settings": settings, "result": result, "seconds": round(seconds, 2), "environment": environment}
        path = self.path(settings["dtype"], settings["kernels"], settings["problem_id"], settings["check"])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(unit, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
        kind = settings["check"].split("-")[0]
        self.longest[kind] = max(self.longest.get(kind, 0.0), seconds)
        return unit

    def write_report(self) -> Path:
        self.report["wall_s"] = round(self.elapsed(), 1)
        path = self.out / "invariance.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
        return path


def _say(*parts) -> None:
    print(*parts, flush=True)


def measure(load: Callable[[str], tuple[LoadedModel, BlockFormat]], problems: list[Problem], units: Units,
            dtypes: list[str], values: list[str]) -> dict:
    """Run every unit not yet finished, in order, writing each as it ends; the report.

    Returns:
        ``{"caps", "sizes", "whole", "runs": [{"dtype", "kernels", "environment", "rows": [{"problem_id",
        "construction": {...} (when run), "batch": {B: {"logits_equal", "cache_differs"}}, "seconds"}]}],
        "stopped": None or why}``.

    Raises:
        BudgetExceeded: the budget's alarm came during a unit (the caller writes the report).
    """
    rep = units.report
    rep.update({"caps": dataclasses.asdict(units.caps), "sizes": units.sizes, "whole": units.whole, "runs": [],
                "stopped": None})
    total = len(dtypes) * len(values) * len(problems) * (len(units.sizes) + 1)
    done = 0
    for dtype in dtypes:
        lm = fmt = base = None
        for value in values:
            run: dict = {"dtype": dtype, "kernels": value, "rows": [], "environment": None}
            rep["runs"].append(run)
            prompts: list[list[int]] | None = None
            for p in problems:
                row: dict = {"problem_id": p.problem_id, "batch": {}, "seconds": 0.0}
                run["rows"].append(row)
                checks = [f"batch-{b}" for b in units.sizes]
                checks = ["construction", *checks] if units.whole else [*checks, "construction"]
                checks += ["engine"] if units.engine_sizes else []
                live_ids = None
                for check in checks:
                    done += 1
                    settings = units.settings(dtype, value, p.problem_id, check)
                    unit = units.kept(settings)
                    if unit is None:
                        if not units.may_start(check):
                            rep["stopped"] = (f"budget: {units.budget_s} s would be passed by {check} of "
                                              f"{p.problem_id} ({dtype}, {value}) after {units.elapsed():.0f} s")
                            _say(f"stop: {rep['stopped']}")
                            return rep
                        if lm is None:
                            t = time.perf_counter()
                            lm, fmt = load(dtype)
                            base = lm.contract
                            _say(f"loaded {dtype} model in {time.perf_counter() - t:.1f} s")
                        lm.contract = dataclasses.replace(base, kernels=value)
                        if prompts is None:
                            prompts = [fmt.prompt_ids(q.question, q.options) for q in problems]
                        _say(f"[{done}/{total}] {dtype} {value} {p.problem_id} {check}: start "
                             f"({units.elapsed():.0f} s elapsed)")
                        t = time.perf_counter()
                        result = _run_check(lm, fmt, check, prompts, problems.index(p), units.caps, live_ids,
                                            units.engine_sizes, units.engine_step_path)
                        unit = units.finish(settings, result, time.perf_counter() - t, environment_record(lm))
                        _say(f"[{done}/{total}] {dtype} {value} {p.problem_id} {check}: {_summary(check, result)} "
                             f"{unit['seconds']:.1f} s", )
                    else:
                        _say(f"[{done}/{total}] {dtype} {value} {p.problem_id} {check}: kept "
                             f"({_summary(check, unit['result'])})")
                    run["environment"] = run["environment"] or unit["environment"]
                    row["seconds"] = round(row["seconds"] + unit["seconds"], 2)
                    if check == "engine":
                        row["engine"] = unit["result"]
                    elif check == "construction":
                        row["construction"] = unit["result"]
                        live_ids = unit["result"]["boundary_ids"]
                    else:
                        row["batch"].update(unit["result"])
                    units.write_report()
    return rep


def _run_check(lm: LoadedModel, fmt: BlockFormat, check: str, prompts: list[list[int]], i: int, caps: Caps,
               live_ids: list[int] | None, engine_sizes: Sequence[int] = (), engine_step_path: str = "eager") -> dict:
    """One unit's result: the construction check (with the live boundary's IDs), one batch size, or the engine's
    check (``{"eager_vs_alone": [...], "<B>": [...]}``, what differs; empty: identical)."""
    if check == "engine":
        others = [q for j, q in enumerate(prompts) if j != i] or [prompts[i][:-5]]
        e = invariance.engine_check(lm, fmt, prompts[i], others, caps, EngineRun(step_path=engine_step_path),
                                    engine_sizes)
        return {str(k): v for k, v in e.items()}
    if check == "construction":
        c = invariance.construction_check(lm, fmt, prompts[i], caps)
        live = c.pop("boundaries")[0]
        return {**c, "boundary_ids": list(live.ids)}
    size = int(check.split("-")[1])
    target = live_ids if live_ids is not None else prompts[i]
    companions = [q for j, q in enumerate(prompts) if j != i] + [target[:-5]]
    b = invariance.batch_check(lm, target, companions, (size,))
    return {str(k): v for k, v in b.items()}


def _summary(check: str, result: dict) -> str:
    if check == "engine":
        return "engine: " + " ".join(f"{k} {'identical' if not v else v}" for k, v in result.items())
    if check == "construction":
        return (f"|z| {result['boundary']} live=inc {not result['live_vs_incremental']} live=prefill "
                f"{not result['live_vs_prefill']} rel_l2 {result['rel_l2_prefill_vs_live']:.2e}")
    return " ".join(f"B={k}: row alone = row in batch {v['logits_equal'] and not v['cache_differs']}"
                    for k, v in result.items())


def main(argv: list[str] | None = None, load: Callable[[str], tuple[LoadedModel, BlockFormat]] | None = None,
         problems: list[Problem] | None = None) -> Path:
    ap = argparse.ArgumentParser(prog="python -m kvreplay.bench invariance", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of units/ and invariance.json "
                    "(default: $OUT, else the current folder)")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--caps", type=int, nargs=3, default=[48, 160, 12])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 7, 64])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--values", nargs="+", default=["invariant", "default"])
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--whole", action="store_true", help="batch check on the whole boundary prefix, not the prompt")
    ap.add_argument("--budget-s", type=float, default=None, help="stop cleanly before this many seconds")
    ap.add_argument("--engine-step-path", choices=["eager", "graph"], default="eager",
                    help="the engine unit's step path (graph: CUDA, under kernels invariant-fused or default)")
    ap.add_argument("--engine-sizes", type=int, nargs="*", default=[],
                    help="batch sizes of the batched engine's check, one unit per problem (none: not run)")
    args = ap.parse_args(argv)
    if any(b < 2 for b in args.sizes):
        ap.error(f"--sizes are batch sizes of 2 or more (B = 1 is the row alone), got {args.sizes}")
    from kvreplay.model import kernels

    for value in args.values:  # before the model loads: an unknown value, or fused kernels off their device
        try:
            if kernels.parse_kernels(value).fused:
                from kvreplay.model import kernels_fused

                kernels_fused.check_device(torch.device(args.device))
        except ValueError as e:  # KernelContractError is a ValueError
            ap.error(f"--values {value}: {e}")
    if load is None:
        from ..runner import ArmSettings

        def load(dtype: str):
            return ArmSettings(profile="invariance", dtype=dtype, caps=Caps(*args.caps), device=args.device,
                               threads=args.threads, kernels="invariant").load()
    if problems is None:
        from ..data.problems import load_bank

        problems = load_bank()[: args.rows]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    units = Units(out, Caps(*args.caps), sorted(args.sizes), args.whole, args.budget_s, list(args.engine_sizes),
                  args.engine_step_path)
    units.report["command"] = " ".join(["python -m kvreplay.bench invariance", *(argv if argv is not None else sys.argv[1:])])

    def alarm(signum, frame):
        raise BudgetExceeded()

    timed = args.budget_s is not None and hasattr(signal, "SIGALRM")
    previous = signal.signal(signal.SIGALRM, alarm) if timed else None
    if timed:
        signal.setitimer(signal.ITIMER_REAL, args.budget_s)
    try:
        measure(load, problems, units, args.dtypes, args.values)
    except BudgetExceeded:
        units.report["stopped"] = f"budget: {args.budget_s} s reached during a unit (abandoned, not written)"
        _say(f"stop: {units.report['stopped']}")
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    path = units.write_report()
    _say(f"wrote {path} ({units.report['wall_s']} s{'; stopped' if units.report['stopped'] else ''})")
    return path

