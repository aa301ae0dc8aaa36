"""Batched Experiment 1 on a GPU: the runner's gates on tiny models, then the embedded model at the paper caps.

Usage (on the GPU machine, after ``source scripts/offline_gpu_env.sh``):

* ``python3 scripts/gpu_exp1_batched.py tiny OUTDIR`` — the tiny random-weight Llama of ``tests/conftest.py``
  on CUDA, FP32 and BF16: :func:`kvreplay.experiments.live_vs_prefill.run_live_vs_prefill` on the graph path (B=2; the composition
  and graph-equals-eager preflight gates run), the same arm on the engine's eager path (whole ledgers compared
  byte for byte), and the bridge under the engine (engine-live == teacher-forced incremental, bit for bit).
  Writes ``OUTDIR/tiny.json``.
* ``python3 scripts/gpu_exp1_batched.py paper OUTDIR BUDGET_S ROWS BATCH`` — the embedded SmolLM2-135M under the
  CUDA execution contract: the batched Experiment 1 (graph path, ``BATCH`` problems per step, ``max_len`` the
  arm's longest possible sequence) at the paper caps 768/512/64 on the first ``ROWS`` bank problems in BF16,
  then the ``make bench`` GPU table (:func:`kvreplay.bench.engine_table`, Experiment 1 rows per hour at the cpu
  caps 48/160/12), then the same Experiment 1 arm in FP32 and ``generate`` with ``torch.compile`` while the
  budget lasts. Writes ``OUTDIR/exp1_batched.json``, ``OUTDIR/bench.md`` and the BF16 ledger rows. With
  ``KV_ONLY=float32`` only the FP32 arm runs (``OUTDIR/exp1_batched_float32.json``).

Nothing is asserted: gates raise (and are reported), everything else is recorded.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

T0 = time.perf_counter()
DRY = os.environ.get("KV_DRY") == "1"  # a CPU run of this script's code paths (engine's eager step, small caps)
DEVICE, GRAPH, ENGINE_PATH = ("cpu", "engine-eager", "eager") if DRY else ("cuda", "graph", "graph")
NAME = "cpu (dry run)" if DRY else torch.cuda.get_device_name()
PAPER_CAPS, CPU_CAPS = ((4, 6, 3), (3, 4, 2)) if DRY else ((768, 512, 64), (48, 160, 12))
TOKENS, BATCHES = (4, (1, 2)) if DRY else (64, (1, 8, 32, 64))
MODEL = dict(model=os.environ["KV_DRY_MODEL"], fmt=os.environ["KV_DRY_FORMAT"]) if DRY and "KV_DRY_MODEL" in os.environ else {}


def elapsed() -> float:
    return time.perf_counter() - T0


def dump(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n")


def runlog(ledger) -> list[dict]:
    return [json.loads(x) for x in (ledger.dir / "runlog.jsonl").read_text().splitlines()]


def tiny(out: Path) -> dict:
    import tempfile

    import yaml

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from conftest import TINY_CAPS, TINY_FORMAT, make_model, make_tokenizer, tiny_lm

    from kvreplay import caches, engine, gates
    from kvreplay.contract import resolve_format
    from kvreplay.problems import Problem
    from kvreplay.experiments.live_vs_prefill import EXP1
    from kvreplay.runner import ArmSettings

    tmp = Path(tempfile.mkdtemp())
    tok = make_tokenizer()
    make_model("llama", len(tok)).save_pretrained(tmp / "tiny-llama")
    tok.save_pretrained(tmp / "tiny-llama")
    (tmp / "tiny.yaml").write_text(yaml.safe_dump(TINY_FORMAT))
    problems = [Problem(f"p-{i:02d}", "test", i + 1, "Q" + "xyz"[i % 3] * (3 * i) + "?", ("x", "y", f"z{i}", "w"),
                        "ABCD"[i % 4]) for i in range(6)]
    res: dict = {"device": NAME, "torch": torch.__version__}
    for dtype in ("float32", "bfloat16"):
        base = dict(profile="t", dtype=dtype, caps=TINY_CAPS, model=str(tmp / "tiny-llama"), fmt=str(tmp / "tiny.yaml"),
                    threads=1, preflight=1, device=DEVICE, batch=2)
        r: dict = {}
        try:
            g, lg = EXP1.run(ArmSettings(**base, step_path=GRAPH), problems, ledger_root=tmp / "l", progress=False)
            e, le = EXP1.run(ArmSettings(**base, step_path="engine-eager"), problems, ledger_root=tmp / "l", progress=False)
            r["rows"] = len(g)
            r["gate_failures_graph"] = [x["gate_failure"] for x in g if x["gate_failure"]]
            r["preflight_gates_graph"] = [ev for ev in runlog(lg) if ev["event"] == "gates"]
            r["preflight_gates_engine_eager"] = [ev for ev in runlog(le) if ev["event"] == "gates"]
            r["graph_ledger_bytes_equal_engine_eager"] = lg.rows_path.read_bytes() == le.rows_path.read_bytes()
            r["keys_differ"] = lg.dir.name != le.dir.name
        except Exception as ex:
            r["error"] = f"{type(ex).__name__}: {ex}"
        # bridge under the engine on the graph path
        lm = tiny_lm("qwen2", getattr(torch, dtype))
        lm.model.to(DEVICE)
        fmt = resolve_format(lm.tokenizer, TINY_FORMAT)
        prompts = [fmt.prompt_ids("Q" + "ab"[i % 2] * (4 * i) + "?", ("x", "y", f"z{i}", "w")) for i in range(5)]
        try:
            live = engine.decode_lives(lm, fmt, prompts, TINY_CAPS, run=engine.EngineRun(step_path=ENGINE_PATH, batch=3, max_len=200))
            inc = engine.build_incrementals(lm, fmt, [b.ids for b in live][::-1], run=engine.EngineRun(step_path=ENGINE_PATH, batch=3, max_len=200))[::-1]
            for a, b in zip(live, inc):
                gates.check_exact("engine live vs incremental", caches.boundary_tensors(a), caches.boundary_tensors(b))
            r["bridge_graph_live_equals_incremental"] = f"{len(live)}/{len(live)} bit for bit"
        except Exception as ex:
            r["bridge_graph_live_equals_incremental"] = f"failed: {type(ex).__name__}: {ex}"
        res[dtype] = r
        print(dtype, json.dumps(r, default=str)[:1500], flush=True)
    # does generate with a static cache and torch.compile work on this host? (the tiny Llama, BF16)
    try:
        lm = tiny_lm("llama", torch.bfloat16)
        lm.model.to(DEVICE)
        ids = torch.tensor([[5, 6, 7, 8] * 8] * 2, device=DEVICE)
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, cache_implementation="static")
        t0 = time.perf_counter()
        lm.model.forward = torch.compile(lm.model.forward, mode="reduce-overhead")
        with torch.inference_mode():
            a = lm.model.generate(ids, max_new_tokens=16, min_new_tokens=16, **kw)
            first = time.perf_counter() - t0
            t1 = time.perf_counter()
            b = lm.model.generate(ids, max_new_tokens=16, min_new_tokens=16, **kw)
        res["compile_static_generate"] = {"works": True, "first_call_s": round(first, 1),
                                          "second_call_ms_per_token": round(1e3 * (time.perf_counter() - t1) / 16, 2),
                                          "same_tokens_twice": bool(torch.equal(a, b))}
    except Exception as ex:
        res["compile_static_generate"] = {"works": False, "error": f"{type(ex).__name__}: {str(ex)[:800]}"}
    print(res["compile_static_generate"], flush=True)
    return res


def paper(out: Path, budget: float, n_rows: int, batch: int) -> dict:
    from kvreplay import bench
    from kvreplay.contract import Caps
    from kvreplay.problems import load_bank
    from kvreplay.experiments.live_vs_prefill import EXP1
    from kvreplay.runner import ArmSettings

    res: dict = {"device": NAME, "torch": torch.__version__, "budget_s": budget,
                 "rows": n_rows, "batch": batch, "sections": {}}
    path = out / "exp1_batched.json"
    bank = load_bank()
    problems = bank[:n_rows]
    paper_caps = Caps(*PAPER_CAPS)

    def arm(dtype: str) -> dict:
        s = ArmSettings(profile="h200", dtype=dtype, caps=paper_caps, device=DEVICE, step_path=GRAPH, batch=batch,
                        preflight=1, **MODEL)
        t = time.perf_counter()
        r: dict = {"dtype": dtype, "config_engine": s.engine_key()}
        try:
            recs, ledger = EXP1.run(s, problems, ledger_root=Path(f"/tmp/kv_ledgers_{os.getpid()}"), progress=False)
            wall = time.perf_counter() - t
            ev = runlog(ledger)
            checks = [c for e in ev if e["event"] == "gates" for c in e["checks"]]
            r.update(
                wall_s=round(wall, 1), ledger=ledger.dir.name,
                engine=json.loads((ledger.dir / "environment.json").read_text())["execution_contract"].get("engine"),
                preflight_gates=checks, gate_failures=[(x["problem_id"], x["gate_failure"]) for x in recs if x["gate_failure"]],
                prefix_len=[x.get("prefix_len") for x in recs], prompt_len=[x.get("prompt_len") for x in recs],
                suffix_len={a: [len(x["arms"][a]["suffix"]) for x in recs if "arms" in x] for a in ("live", "prefill")},
                suffix_differs=sum(bool(x.get("endpoints", {}).get("suffix_differs")) for x in recs),
                boundary_non_exact=sum(not x.get("endpoints", {}).get("boundary_exact", True) for x in recs),
                replicas_exact=sum(x.get("boundary", {}).get("live_replica", {}).get("cache", {}).get("exact", False)
                                   and x["boundary"]["prefill_replica"]["cache"]["exact"] for x in recs),
                equivalence=[x.get("equivalence") for x in recs[:2]],
                row_seconds=[e.get("seconds") for e in ev if e["event"] == "row"],
            )
            gate_s = sum(c["seconds"] for c in checks if c["gate"] == "composition")
            r["rows_wall_s_without_composition_run"] = round(wall - gate_s, 1)
            r["rows_per_hour"] = round(3600 * len(recs) / max(wall - gate_s, 1e-9), 1)
            r["projected_200_rows_min"] = round((200 * (wall - gate_s) / len(recs) + gate_s) / 60, 1)
            if dtype == "bfloat16":
                shutil.copy(ledger.rows_path, out / "exp1_bf16_rows.jsonl")
        except Exception as ex:
            r["error"] = f"{type(ex).__name__}: {ex}"
            r["traceback"] = traceback.format_exc()[-2000:]
            r["wall_s"] = round(time.perf_counter() - t, 1)
        return r

    if os.environ.get("KV_ONLY") == "float32":  # a second call for the FP32 arm alone (bench table already made)
        res["sections"]["exp1_float32"] = arm("float32")
        print(json.dumps(res["sections"]["exp1_float32"], default=str)[:3000], flush=True)
        res["elapsed_s"] = round(elapsed(), 1)
        dump(out / "exp1_batched_float32.json", res)
        return res
    res["sections"]["exp1_bfloat16"] = arm("bfloat16")
    dump(path, res)
    print(json.dumps(res["sections"]["exp1_bfloat16"], default=str)[:3000], flush=True)
    # the make-bench GPU table (no compile yet)
    try:
        s = ArmSettings(profile="bench", dtype="bfloat16", caps=Caps(*CPU_CAPS), device=DEVICE, **MODEL)
        lm, fmt = s.load()
        t = time.perf_counter()
        table = bench.engine_table(lm, fmt, tokens=TOKENS, batches=BATCHES, branch_cap=CPU_CAPS[0], exp1_caps=(CPU_CAPS,),
                                   exp1_batch=BATCHES[-1], compile_=False, step_path=ENGINE_PATH)
        res["sections"]["bench_s"] = round(time.perf_counter() - t, 1)
        (out / "bench.md").write_text(table.to_markdown(index=False) + "\n")
        print(table.to_markdown(index=False), flush=True)
    except Exception:
        res["sections"]["bench_error"] = traceback.format_exc()[-2000:]
    dump(path, res)
    spent = res["sections"]["exp1_bfloat16"].get("wall_s", 0)
    if budget - elapsed() > 1.3 * spent:
        res["sections"]["exp1_float32"] = arm("float32")
        print(json.dumps(res["sections"]["exp1_float32"], default=str)[:3000], flush=True)
    else:
        res["sections"]["exp1_float32"] = f"skipped: {budget - elapsed():.0f} s left, BF16 took {spent:.0f} s"
    dump(path, res)
    if budget - elapsed() > 150 and DEVICE == "cuda":
        try:
            lm, fmt = ArmSettings(profile="bench", dtype="bfloat16", caps=Caps(*CPU_CAPS), device=DEVICE).load()
            t0 = time.perf_counter()
            lm.model.forward = torch.compile(lm.model.forward, mode="reduce-overhead")
            z = torch.tensor([fmt.prompt_ids(bank[0].question, bank[0].options)] * 2, device=DEVICE)
            kw = dict(attention_mask=torch.ones_like(z), do_sample=False, pad_token_id=lm.tokenizer.pad_token_id or 0,
                      cache_implementation="static")
            with torch.inference_mode():
                lm.model.generate(z, max_new_tokens=2, min_new_tokens=2, **kw)
                first = time.perf_counter() - t0
                times = {}
                for k in (1, 65):
                    torch.cuda.synchronize()
                    t1 = time.perf_counter()
                    lm.model.generate(z, max_new_tokens=k, min_new_tokens=k, **kw)
                    torch.cuda.synchronize()
                    times[k] = time.perf_counter() - t1
            res["sections"]["compile"] = {"first_call_s": round(first, 1),
                                          "ms_per_token": round(1e3 * (times[65] - times[1]) / 64, 2)}
        except Exception as ex:
            res["sections"]["compile"] = f"failed: {type(ex).__name__}: {str(ex)[:500]}"
    else:
        res["sections"]["compile"] = f"skipped: {budget - elapsed():.0f} s left"
    res["elapsed_s"] = round(elapsed(), 1)
    dump(path, res)
    return res


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    if mode == "tiny":
        dump(out / "tiny.json", tiny(out))
    elif mode == "paper":
        paper(out, float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(f"done in {elapsed():.1f} s", flush=True)


if __name__ == "__main__":
    main()
