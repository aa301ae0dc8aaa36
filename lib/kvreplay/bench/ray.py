"""Experiment 1 on one GPU and on several (Ray row actors): steady-state rows per hour, their ratio, Ray start-up.

Usage (on a machine with N GPUs, after ``source scripts/offline_gpu_env.sh`` with the Ray wheel carried):

    python -m kvreplay.bench ray OUTDIR [ROWS [BATCH [GPUS]]]        (defaults: 80 rows, batch 16, 2 GPUs)

The arm: the embedded SmolLM2-135M in BF16 at the ``cpu``/``gpu`` profiles' caps 48 / 160 / 12, under the
CUDA execution contract's defaults (math SDPA, deterministic algorithms, TF32 off). It runs on the batched
engine's graph path (``step_path="graph"``, ``batch=BATCH``, ``max_len`` the arm's longest possible sequence),
preflight 1, on the first ROWS bank problems. It runs twice, into fresh ledgers of the same key:

* on GPUS GPUs: ``workers=GPUS``, on a local Ray cluster started for it (one actor per GPU, each with its
  model and engine, fed whole chunks of BATCH problems);
* on one GPU: ``workers=1``, in this process, without Ray (the default path).

Steady-state rows per hour: the rows after the first chunk over the time from that chunk's last append to
the last row's append (the ledgers' ``runlog.jsonl`` ``row`` events). The first chunk holds the preflight row,
which also runs the ``composition`` and ``graph_equals_eager`` gates alone. Start-up is reported apart: the Ray
cluster's start, the actors' start (model loaded), and the whole arm's wall time. Choose ROWS as BATCH
times an odd number (e.g. 80 = 16 x 5: one chunk, then two per GPU on 2 GPUs), so the chunks after the first
split evenly.

Writes ``OUTDIR/ray_bench.json`` (printed as it grows) and, flat, each run's ``rows_<label>.jsonl`` and
``runlog_<label>.jsonl``; the two ``rows.jsonl`` sha256 must agree (``ledgers_identical``). Nothing is
asserted: a failure is recorded with its traceback and the next run goes on.

``KV_DRY=1`` runs the same code on the CPU (the engine's eager step, caps 3 / 4 / 2, CPU actors of one
thread; ``KV_DRY_MODEL``/``KV_DRY_FORMAT`` may name a small model and format), to check the script without
a GPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

T0 = time.perf_counter()
DRY = os.environ.get("KV_DRY") == "1"
DEVICE, STEP_PATH, CAPS = ("cpu", "engine-eager", (3, 4, 2)) if DRY else ("cuda", "graph", (48, 160, 12))
MODEL = {k: os.environ[v] for k, v in (("model", "KV_DRY_MODEL"), ("fmt", "KV_DRY_FORMAT")) if DRY and v in os.environ}


def dump(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n")


def steady(events: list[dict], skip: int) -> dict:
    """Rows after the first ``skip`` appends, and the seconds from the ``skip``-th append to the last."""
    rows = [e for e in events if e["event"] == "row"]
    after = rows[skip:]
    seconds = sum(e["seconds"] for e in after)
    return {"rows": len(after), "seconds": round(seconds, 2),
            "rows_per_hour": round(3600 * len(after) / seconds, 1) if seconds > 0 else None}


def arm(label: str, workers: int, problems, batch: int, out: Path, scratch: Path) -> dict:
    from ..runner import actors as parallel
    from ..decoding.contract import Caps
    from ..experiments.live_vs_prefill import EXP1
    from ..runner import ArmSettings

    settings = ArmSettings(profile="raybench", dtype="bfloat16", caps=Caps(*CAPS), device=DEVICE, step_path=STEP_PATH,
                           batch=batch, preflight=1, threads=1, workers=workers, **MODEL)
    r: dict = {"workers": workers, "engine_key": settings.engine_key()}
    t = time.perf_counter()
    try:
        records, ledger = EXP1.run(settings, problems, ledger_root=scratch / label, progress=False)
        r["wall_s"] = round(time.perf_counter() - t, 1)
        events = [json.loads(x) for x in (ledger.dir / "runlog.jsonl").read_text().splitlines()]
        start = [e for e in events if e["event"] == "workers"]
        r.update(
            ledger=ledger.dir.name, rows=len(records),
            gate_failures=[(x["problem_id"], x["gate_failure"]["gate"]) for x in records if x["gate_failure"]],
            preflight_gates=[c for e in events if e["event"] == "gates" for c in e["checks"]],
            engine=next((e for e in events if e["event"] == "engine"), None),
            steady=steady(events, batch),
            rows_sha256=hashlib.sha256(ledger.rows_path.read_bytes()).hexdigest(),
        )
        if start:
            r.update(devices=start[0]["devices"], ray=start[0]["ray"], ray_started=start[0]["ray_started"],
                     ray_startup_s=start[0]["startup_s"]["ray_s"], actors_startup_s=start[0]["startup_s"]["actors_s"])
        r["lost_actors"] = [e for e in events if e["event"] == "actor_lost"]
        shutil.copy(ledger.rows_path, out / f"rows_{label}.jsonl")
        shutil.copy(ledger.dir / "runlog.jsonl", out / f"runlog_{label}.jsonl")
    except Exception as ex:  # recorded, not raised: the other run still goes on
        r["error"] = f"{type(ex).__name__}: {ex}"
        r["traceback"] = traceback.format_exc()[-3000:]
        r["wall_s"] = round(time.perf_counter() - t, 1)
    finally:
        parallel.shutdown()  # the local cluster goes with its run; the next one starts clean
    return r


def main(argv: list[str] | None = None) -> int:
    """``python -m kvreplay.bench ray OUTDIR [ROWS [BATCH [GPUS]]]``; exits with a message when fewer GPUs are
    visible than asked for."""
    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m kvreplay.bench ray OUTDIR [ROWS [BATCH [GPUS]]]"
    if argv[:1] in (["-h"], ["--help"]):
        print(usage + "\n\n" + (__doc__ or "").strip().split("\n\n")[0])
        raise SystemExit(0)
    if not argv or argv[0].startswith("-"):  # an option is not an output folder
        raise SystemExit(usage)
    out = Path(argv[0])
    args = [int(x) for x in argv[1:4]]
    rows, batch, gpus = args + [80, 16, 2][len(args):]
    out.mkdir(parents=True, exist_ok=True)
    from ..data.problems import load_bank

    found = torch.cuda.device_count() if DEVICE == "cuda" else gpus
    res: dict = {"device": DEVICE, "torch": torch.__version__, "gpus_visible": found, "rows": rows, "batch": batch,
                 "caps": CAPS, "step_path": STEP_PATH, "python": sys.version.split()[0]}
    if DEVICE == "cuda":
        res["device_names"] = [torch.cuda.get_device_name(i) for i in range(found)]
    try:
        import ray

        res["ray"] = ray.__version__
    except ImportError as ex:
        res["ray"] = f"not importable: {ex}"
    path = out / "ray_bench.json"
    if found < gpus:
        res["error"] = f"{gpus} GPUs asked for, {found} visible"
        dump(path, res)
        raise SystemExit(res["error"])
    problems = load_bank()[:rows]
    scratch = Path(tempfile.mkdtemp(prefix="raybench-"))
    # the new path first: if the call runs out of time, its figures are already written
    for label, workers in ((f"{gpus}gpu", gpus), ("1gpu", 1)):
        res[label] = arm(label, workers, problems, batch, out, scratch)
        dump(path, res)
        print(label, json.dumps(res[label], default=str)[:2500], flush=True)
    one, many = res["1gpu"], res[f"{gpus}gpu"]
    if "steady" in one and "steady" in many and one["steady"]["rows_per_hour"] and many["steady"]["rows_per_hour"]:
        res["ratio_steady_rows_per_hour"] = round(many["steady"]["rows_per_hour"] / one["steady"]["rows_per_hour"], 3)
    res["ledgers_identical"] = bool(one.get("rows_sha256")) and one.get("rows_sha256") == many.get("rows_sha256")
    res["elapsed_s"] = round(time.perf_counter() - T0, 1)
    dump(path, res)
    print(json.dumps({k: res.get(k) for k in ("ratio_steady_rows_per_hour", "ledgers_identical", "elapsed_s")}), flush=True)
    return 0
