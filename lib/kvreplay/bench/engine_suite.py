"""The engine's ``flex`` attention on a GPU: the guarantees the CPU tests cannot check, on the embedded model.

Usage (on the GPU machine, after ``source scripts/offline_gpu_env.sh``)::

    python -m kvreplay.bench engine-suite OUTDIR [--budget SECONDS] [--only SECTION ...]

(``--device cpu --batch 2 --rows 4 --only ...`` is a dry run of the code paths on the CPU, with the reference
arithmetic instead of the compiled kernels and the engine's eager step instead of the graph.)

Each section runs the compiled FlexAttention kernels under the CUDA execution contract (deterministic
algorithms, TF32 off) and records what it saw in ``OUTDIR/engine_suite.json`` (written after every section, so a
run cut off keeps what it did). A section that raises is recorded with its error and the next one runs.

* ``graph_equals_eager``: BF16 suffixes of 50 real boundaries of the ``gpu`` profile's prefix bank at its caps
  (48/160/12), B = 50. Every step of the graph path is re-run by the eager step (the same compiled kernels) and
  required equal bit for bit; then the whole decode on the eager path is compared with the graph path's.
* ``determinism``: the same decode twice more on the graph path, each equal to the first bit for bit.
* ``composition``: the first boundary decoded with 49 companions in slot 0, alone in the last slot, and with the
  other companions in reverse order: equal bit for bit (tokens and margins).
* ``tolerance``: the ``attention_tolerance`` gate on every layer of a real boundary (BF16 and FP32, ``flex``
  and ``grouped``), with each layer's relative error against math SDPA in float64.
* ``fp32_rows``: the ``gpu`` profile's committed FP32 Experiment 1 rows (``data/ledgers/gpu/exp1-float32-*``)
  recomputed by the ``flex`` engine (one chunk of all 200 problems through B = 50 slots, boundaries and suffixes
  in one engine). Reported: live prefixes and the four arms' suffix tokens against the committed rows, matches
  out of 200, and the chunk's slot occupancy.
* ``bf16_arm``: the ``gpu`` profile's BF16 Experiment 1 arm under ``flex`` through ``run_arm``, with every gate
  (the preflight ``composition`` run alone in the last slot, ``graph_equals_eager``, ``attention_tolerance``,
  float32 equivalence). It writes a ledger root of its own under ``OUTDIR``; its ``environment.json`` and run
  log are kept.

Nothing about outcomes is asserted: gates raise and are recorded, every comparison is a count. Sized for one
command of about 9 minutes on an H200 (``--budget``, default 520 s, skips the sections that would start after it).
"""

from __future__ import annotations

import dataclasses

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

T0 = time.perf_counter()
SECTIONS = ("graph_equals_eager", "determinism", "composition", "tolerance", "fp32_rows", "bf16_arm")
GPU_CAPS = (48, 160, 12)  # the gpu profile's caps
BATCH = 50  # and its problems per step


def elapsed() -> float:
    return round(time.perf_counter() - T0, 1)


def _same(a, b) -> bool:
    return (a.tokens, a.margins, a.merge, a.answer) == (b.tokens, b.margins, b.merge, b.answer)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvreplay.bench engine-suite", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--budget", type=float, default=520.0, help="seconds; no section starts after it")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run: eager step, reference flex)")
    ap.add_argument("--batch", type=int, default=BATCH, help=f"problems per step (default {BATCH}, the gpu profile's)")
    ap.add_argument("--rows", type=int, default=200, help="Experiment 1 rows of the fp32_rows and bf16_arm sections")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    graph = "graph" if cuda else "eager"
    B = args.batch
    args.out.mkdir(parents=True, exist_ok=True)

    import dataclasses

    from .. import engine
    from ..decoding.contract import ANSWER, MERGE, Caps
    from ..decoding.decode import build_prefill
    from ..decoding.settings import Decoding
    from ..experiments.live_vs_prefill import live_vs_prefill_chunk, live_vs_prefill_row
    from ..ledger.prefix_bank import read_prefix_bank
    from ..ledger.store import read_rows_text, row_lines
    from ..paths import LEDGERS
    from ..data.problems import load_bank
    from ..runner import ArmSettings, RunSpec, run_arm

    caps = Caps(*GPU_CAPS)
    settings = ArmSettings(profile="gpu", dtype="bfloat16", caps=caps, threads=4, device=args.device,
                           step_path="graph" if cuda else "engine-eager", batch=B, attention="flex")
    lm, fmt = settings.load()
    res: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu (dry run)", "sections": {},
                 "flex": engine.flex_environment(2 * B, 3, 3, lm.device), "load_s": elapsed()}
    path = args.out / "engine_suite.json"

    def dump() -> None:
        path.write_text(json.dumps(res, indent=1, sort_keys=True, default=str) + "\n")

    entries, bank_sha = read_prefix_bank(LEDGERS / "gpu" / "prefix_bank_bf16.jsonl")
    prefixes = [e["prefix"] for e in entries[:B]]
    states = [build_prefill(lm, fmt, z, where=f"bank {i}") for i, z in enumerate(prefixes)]
    max_len = -(-(max(map(len, prefixes)) + engine.suffix_length_bound(fmt, caps)) // 128) * 128
    run = engine.EngineRun(batch=B, max_len=max_len, attention="flex")
    res["boundaries"] = {"source": "data/ledgers/gpu/prefix_bank_bf16.jsonl", "sha256": bank_sha, "n": len(prefixes),
                         "max_len": max_len}
    first: dict = {}
    fp32: list = []

    def model32():
        """The model loaded in float32 (as the FP32 arms load it: not an upcast of the BF16 weights)."""
        if not fp32:
            fp32.append(dataclasses.replace(settings, dtype="float32").load()[0])
        return fp32[0]

    def graph_equals_eager() -> dict:
        t = time.perf_counter()
        checked = dataclasses.replace(run, step_path=graph, verify_steps=10_000)
        g = engine.decode_suffixes(lm, fmt, states, caps, run=checked)
        steps = g.stats.verified_steps
        seconds = time.perf_counter() - t
        e = engine.decode_suffixes(lm, fmt, states, caps, run=dataclasses.replace(run, step_path="eager"))
        first["graph"] = g
        return {"steps_checked_bit_for_bit": steps, "seconds_with_checks": round(seconds, 1),
                "eager_path_equal": sum(_same(a, b) for a, b in zip(g, e)), "of": len(g)}

    def determinism() -> dict:
        g = first.get("graph") or engine.decode_suffixes(lm, fmt, states, caps, run=dataclasses.replace(run, step_path=graph))
        again = [engine.decode_suffixes(lm, fmt, states, caps, run=dataclasses.replace(run, step_path=graph)) for _ in range(2)]
        return {"runs_equal_to_the_first": [sum(_same(a, b) for a, b in zip(g, x)) for x in again], "of": len(g)}

    def composition() -> dict:
        x = states[0]
        base = engine.decode_suffixes(lm, fmt, states, caps, run=dataclasses.replace(run, step_path=graph))[0]
        alone = engine.decode_suffixes(lm, fmt, [x], caps, run=dataclasses.replace(run, step_path=graph, fill_from="last"))[0]
        rev = engine.decode_suffixes(lm, fmt, [*states[1:][::-1], x], caps, run=dataclasses.replace(run, step_path=graph))[-1]
        return {"slot_0_with_companions_vs_alone_in_the_last_slot": _same(base, alone),
                "slot_0_vs_the_last_slot_other_companion_order": _same(base, rev), "tokens": len(base.tokens),
                "companions": len(states) - 1}

    def tolerance() -> dict:
        out = {}
        for dtype_name, model in (("bfloat16", lm), ("float32", model32())):
            for attention in ("flex", "grouped"):
                eng = engine.StepEngine(model, fmt, engine.EngineRun("eager", B, max_len, attention=attention))
                for slot in range(min(4, B)):  # real boundaries; an answer query must not see the branches
                    b = states[slot] if model is lm else build_prefill(model, fmt, prefixes[slot])
                    n = eng.admit(slot, b.cache, b.roles)
                    role = ANSWER if slot % 2 else MERGE
                    eng.set_row_pair(slot, b.ids[-1], n, role, role)
                try:
                    rec = eng.check_attention("real boundaries")
                    out[f"{dtype_name}/{attention}"] = {k: rec[k] for k in ("max_rel_err", "rel_err_by_layer",
                                                                              "tolerance", "rows")}
                except Exception as e:  # a failed gate is a result here
                    out[f"{dtype_name}/{attention}"] = {"error": f"{type(e).__name__}: {e}"}
                del eng
        return out

    def fp32_rows() -> dict:
        folder = next((LEDGERS / "gpu").glob("exp1-float32-*"))
        committed = {r["problem_id"]: r for r in (json.loads(x) for x in row_lines(read_rows_text(folder)))}
        lm32 = model32()
        problems = [p for p in load_bank() if p.problem_id in committed][: args.rows]
        run32 = dataclasses.replace(settings, dtype="float32", chunk=len(problems)).engine_run(fmt, problems)
        spec = RunSpec(lm=lm32, fmt=fmt, decoding=Decoding.of(caps), engine=run32)  # max_len: the longest sequence, whole flex blocks
        t = time.perf_counter()
        recs = live_vs_prefill_chunk(spec, problems)
        seconds = time.perf_counter() - t
        busy, slots = recs.stats.busy_slot_steps, recs.stats.slot_steps
        prefix = suffix = 0
        parted = []
        for r in recs:
            c = committed[r["problem_id"]]
            same_prefix = r.get("prefix") == c.get("prefix")
            same_suffix = same_prefix and r["gate_failure"] is None and all(
                r["arms"][a]["suffix"] == c["arms"][a]["suffix"] for a in c["arms"])
            prefix += same_prefix
            suffix += same_suffix
            if not same_suffix:
                parted.append(r["problem_id"])
        return {"ledger": folder.name, "rows": len(recs), "prefix_token_identical": prefix,
                "all_four_suffixes_token_identical": suffix, "differing": parted[:20],
                "gate_failures": sum(r["gate_failure"] is not None for r in recs), "seconds": round(seconds, 1),
                "occupancy": round(busy / slots, 4) if slots else None, "max_len": spec.engine.max_len}

    def bf16_arm() -> dict:
        root = args.out / "ledgers_flex"
        problems = load_bank()[: args.rows]
        t = time.perf_counter()
        arm = dataclasses.replace(settings, preflight=2, chunk=len(problems))
        records, ledger = run_arm("exp1", arm, problems, live_vs_prefill_row, ledger_root=root, progress=False,
                                  chunk=live_vs_prefill_chunk)
        seconds = time.perf_counter() - t
        env = json.loads((ledger.dir / "environment.json").read_text())
        log = [json.loads(x) for x in (ledger.dir / "runlog.jsonl").read_text().splitlines()]
        return {"ledger": ledger.dir.name, "rows": len(records), "seconds_with_gates_and_compiles": round(seconds, 1),
                "gate_failures": sum(r["gate_failure"] is not None for r in records),
                "engine": env["execution_contract"]["engine"], "attention_tolerance": env.get("attention_tolerance"),
                "gates": [e["checks"] for e in log if e["event"] == "gates"],
                "chunks": [e for e in log if e["event"] == "chunk"]}

    funcs = {"graph_equals_eager": graph_equals_eager, "determinism": determinism, "composition": composition,
             "tolerance": tolerance, "fp32_rows": fp32_rows, "bf16_arm": bf16_arm}
    for name in args.only:
        if elapsed() > args.budget:
            res["sections"][name] = {"skipped": f"budget of {args.budget:.0f} s spent at {elapsed()} s"}
            dump()
            continue
        t = elapsed()
        try:
            res["sections"][name] = funcs[name]()
        except Exception as e:  # recorded, not raised: the next section still runs
            res["sections"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        res["sections"][name]["section_s"] = round(elapsed() - t, 1)
        res["elapsed_s"] = elapsed()
        print(name, json.dumps(res["sections"][name], default=str)[:2000], flush=True)
        dump()
    return 0

