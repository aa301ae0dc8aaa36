"""The batched decode engine on a GPU: bit checks and ms per step against today's one-problem decoder.

Usage (on the GPU machine; ``bench`` after ``source scripts/offline_gpu_env.sh``):

* ``python3 scripts/gpu_engine_bench.py tiny OUTDIR`` — tiny random-weight Llama from ``tests/conftest.py``
  on CUDA (FP32 and BF16): graph == eager bits at one batch shape, companion/slot independence, a planted
  desync caught on the graph path, batch-1 tokens against :func:`kvreplay.decode.decode_suffix`.
* ``python3 scripts/gpu_engine_bench.py bench OUTDIR [PROBLEMS]`` — the embedded SmolLM2-135M in BF16 under
  the CUDA execution contract (deterministic algorithms, TF32 off, math SDPA): live boundaries of the first
  PROBLEMS bank problems (default 64) from :func:`kvreplay.engine.decode_lives`, then the suffix decoders
  timed: today's :func:`~kvreplay.decode.decode_suffix` (eager, DynamicCache, 2 rows) and
  :func:`~kvreplay.engine.decode_suffixes` eager and graph at B = 1, 8, 32, 64 problems (2B rows), with
  graph == eager bits at B=8 (suffixes and live boundaries) and a problem's bits under other companions
  and another slot. Writes ``OUTDIR/engine_bench.json``.

Times are wall-clock (``time.perf_counter`` around whole decodes, the device synchronised before and
after); "ms per problem-token" divides by the tokens the problems decoded; "step ms" are the
:meth:`~kvreplay.engine.StepEngine.step` calls' medians (each ends in its one host read) after the first
(which captures the graph). Nothing is asserted: the checks are recorded.
"""

from __future__ import annotations

import dataclasses

import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

from kvreplay import caches, decode, engine, gates  # noqa: E402
from kvreplay.contract import Caps, resolve_format  # noqa: E402

STEP_TIMES: list[float] = []
_step = engine.StepEngine.step


def _timed_step(self):
    t = time.perf_counter()
    out = _step(self)
    STEP_TIMES.append(time.perf_counter() - t)
    return out


engine.StepEngine.step = _timed_step


def same_suffixes(a, b) -> bool:
    return all((x.tokens, x.margins) == (y.tokens, y.margins) for x, y in zip(a, b)) and len(a) == len(b)


def same_boundaries(a, b) -> bool:
    try:
        for x, y in zip(a, b):
            gates.check_exact("a vs b", caches.boundary_tensors(x), caches.boundary_tensors(y))
            if x.ids != y.ids:
                return False
    except gates.GateError:
        return False
    return len(a) == len(b)


CUDA = torch.cuda.is_available()
GRAPH = "graph" if CUDA else "eager"  # a dry run of this script on a CPU replaces the graph path by eager


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def timed(fn):
    sync()
    STEP_TIMES.clear()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t, list(STEP_TIMES)


def tiny(outdir: Path) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import TINY_CAPS, TINY_FORMAT, tiny_lm

    from kvreplay.execution import resolve_contract

    resolve_contract(device="cuda" if CUDA else "cpu").apply()
    res: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        lm = tiny_lm("llama", dtype)
        lm.model.to("cuda" if CUDA else "cpu")
        fmt = resolve_format(lm.tokenizer, TINY_FORMAT)
        prompts = [fmt.prompt_ids("Q" + "x" * (2 * i) + "?", ("x", "y", f"z{i}", "w")) for i in range(6)]
        lives = [decode.decode_live(lm, fmt, p, TINY_CAPS) for p in prompts]
        r: dict = {}
        kw = engine.EngineRun(batch=3, max_len=200)
        ge = engine.decode_suffixes(lm, fmt, lives[:3], TINY_CAPS, run=dataclasses.replace(kw, step_path="eager"))
        gg = engine.decode_suffixes(lm, fmt, lives[:3], TINY_CAPS, run=dataclasses.replace(kw, step_path=GRAPH))
        r["suffix_graph_eq_eager_B3"] = same_suffixes(ge, gg)
        other = engine.decode_suffixes(lm, fmt, [lives[5], lives[4], lives[0]], TINY_CAPS, run=dataclasses.replace(kw, step_path=GRAPH))
        r["suffix_companions_slot_B3"] = same_suffixes([gg[0]], [other[2]])
        reuse = engine.decode_suffixes(lm, fmt, lives, TINY_CAPS, run=dataclasses.replace(kw, step_path=GRAPH))
        r["suffix_slot_reuse_B3"] = same_suffixes(reuse[:3], gg)
        le = engine.decode_lives(lm, fmt, prompts[:3], TINY_CAPS, run=engine.EngineRun(step_path="eager", batch=3, max_len=220))
        lg = engine.decode_lives(lm, fmt, prompts[:3], TINY_CAPS, run=engine.EngineRun(step_path=GRAPH, batch=3, max_len=220))
        r["live_graph_eq_eager_B3"] = same_boundaries(le, lg)
        b1 = engine.decode_suffixes(lm, fmt, lives[:3], TINY_CAPS, run=engine.EngineRun(step_path=GRAPH, batch=1))
        ref = [decode.decode_suffix(lm, fmt, caches.live_replica(s), TINY_CAPS) for s in lives[:3]]
        r["B1_graph_tokens_eq_decode_suffix"] = [x.tokens == y.tokens for x, y in zip(b1, ref)]
        bad = caches.clone_boundary(lives[1], "desync")
        with torch.inference_mode():
            bad.cache.layers[0].keys[1, :, 5] += 0.25
        got = engine.decode_suffixes(lm, fmt, [lives[0], bad, lives[2]], TINY_CAPS, run=dataclasses.replace(kw, step_path=GRAPH), on_gate_error="return")
        r["planted_desync_caught"] = isinstance(got[1], gates.GateError) and got[1].gate == "desync"
        r["companions_of_fault_unchanged"] = same_suffixes([got[0], got[2]], [gg[0], gg[2]])
        res[str(dtype).replace("torch.", "")] = r
        print(dtype, r, flush=True)
    return res


def bench(outdir: Path, n: int) -> dict:
    from kvreplay.problems import load_bank
    from kvreplay.execution import resolve_contract
    from kvreplay.models import environment_record, load_model

    t0 = time.perf_counter()
    if CUDA:
        lm = load_model("embedded", "bfloat16", contract=resolve_contract(device="cuda"))
        fmt = resolve_format(lm.tokenizer, "chat_multibranch")
    else:  # dry run of the script's code paths on a tiny model
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from conftest import TINY_FORMAT, tiny_lm

        lm = tiny_lm("llama", torch.bfloat16)
        fmt = resolve_format(lm.tokenizer, TINY_FORMAT)
    res: dict = {"load_s": time.perf_counter() - t0, "contract": environment_record(lm)}
    prompt_max = int(os.environ.get("ENGINE_BENCH_PROMPT_MAX", "0"))  # keep bank problems with prompts this short
    prompts = [fmt.prompt_ids(p.question, p.options) for p in load_bank()]
    prompts = [p for p in prompts if not prompt_max or len(p) <= prompt_max][:n]
    res["prompt_max"] = prompt_max or None
    caps = Caps(branch=16, merge=64, answer=8)
    res["caps"] = {"branch": caps.branch, "merge": caps.merge, "answer": caps.answer}
    live_len = engine.live_length_bound(fmt, caps, max(len(p) for p in prompts)) + 1

    # live boundaries of all problems (graph, B=64), and graph == eager bits at B=8
    (lives, dt, st) = timed(lambda: engine.decode_lives(lm, fmt, prompts, caps, run=engine.EngineRun(step_path=GRAPH, batch=64, max_len=live_len)))
    zl = [len(b.ids) for b in lives]
    res["live"] = {"problems": n, "prompt_len_mean": statistics.mean(len(p) for p in prompts),
                   "z_len_mean": statistics.mean(zl), "z_len_min": min(zl), "z_len_max": max(zl),
                   "graph_B64_s": dt, "graph_B64_steps": len(st), "max_len": live_len}
    print("live", res["live"], flush=True)
    le8, dt_e, st_e = timed(lambda: engine.decode_lives(lm, fmt, prompts[:8], caps, run=engine.EngineRun(step_path="eager", batch=8, max_len=live_len)))
    lg8, dt_g, st_g = timed(lambda: engine.decode_lives(lm, fmt, prompts[:8], caps, run=engine.EngineRun(step_path=GRAPH, batch=8, max_len=live_len)))
    res["live"]["B8_graph_eq_eager_bits"] = same_boundaries(le8, lg8)
    res["live"]["B64_graph_eq_B8_graph_bits"] = same_boundaries(lives[:8], lg8)
    res["live"]["B8_eager_step_ms_median"] = 1000 * statistics.median(st_e[1:])
    res["live"]["B8_graph_step_ms_median"] = 1000 * statistics.median(st_g[1:])
    print("live checks", res["live"], flush=True)

    max_len = max(zl) + engine.suffix_length_bound(fmt, caps)
    res["suffix_max_len"] = max_len
    rows = []

    def record(name, path, b, states, fn):
        calls = lm.calls
        out, dt, st = timed(fn)
        tokens = sum(len(s.tokens) for s in out)
        row = {"decoder": name, "step_path": path, "B": b, "rows": 2 * b if b else 2, "problems": len(states),
               "tokens": tokens, "forward_calls": lm.calls - calls, "wall_s": dt,
               "ms_per_problem_token": 1000 * dt / tokens, "ms_per_call": 1000 * dt / (lm.calls - calls)}
        if len(st) > 1:
            row["step_ms_median"] = 1000 * statistics.median(st[1:])
            row["first_step_ms"] = 1000 * st[0]
        rows.append(row)
        print(row, flush=True)
        return out

    today = record("decode.decode_suffix (DynamicCache)", "eager", 1, lives[:3],
                   lambda: [decode.decode_suffix(lm, fmt, caches.live_replica(s), caps) for s in lives[:3]])
    kw = engine.EngineRun(max_len=max_len)
    e1 = record("engine.decode_suffixes", "eager", 1, lives[:3],
                lambda: engine.decode_suffixes(lm, fmt, lives[:3], caps, run=dataclasses.replace(kw, batch=1, step_path="eager")))
    g1 = record("engine.decode_suffixes", GRAPH, 1, lives[:3],
                lambda: engine.decode_suffixes(lm, fmt, lives[:3], caps, run=dataclasses.replace(kw, batch=1, step_path=GRAPH)))
    e8 = record("engine.decode_suffixes", "eager", 8, lives[:8],
                lambda: engine.decode_suffixes(lm, fmt, lives[:8], caps, run=dataclasses.replace(kw, batch=8, step_path="eager")))
    g8 = record("engine.decode_suffixes", GRAPH, 8, lives[:8],
                lambda: engine.decode_suffixes(lm, fmt, lives[:8], caps, run=dataclasses.replace(kw, batch=8, step_path=GRAPH)))
    others = lives[8:15] + [lives[0]]
    g8o = record("engine.decode_suffixes", GRAPH, 8, others,
                 lambda: engine.decode_suffixes(lm, fmt, others, caps, run=dataclasses.replace(kw, batch=8, step_path=GRAPH)))
    g32 = record("engine.decode_suffixes", GRAPH, 32, lives,
                 lambda: engine.decode_suffixes(lm, fmt, lives, caps, run=dataclasses.replace(kw, batch=32, step_path=GRAPH)))
    g64 = record("engine.decode_suffixes", GRAPH, 64, lives,
                 lambda: engine.decode_suffixes(lm, fmt, lives, caps, run=dataclasses.replace(kw, batch=64, step_path=GRAPH)))
    res["suffix_rows"] = rows
    res["checks"] = {
        "B1_graph_eq_B1_eager_bits": same_suffixes(g1, e1),
        "B8_graph_eq_B8_eager_bits": same_suffixes(g8, e8),
        "B8_problem0_slot7_other_companions_eq_slot0": same_suffixes([g8o[7]], [g8[0]]),
        "B1_graph_tokens_eq_decode_suffix": [a.tokens == b.tokens for a, b in zip(g1, today)],
        "B1_graph_margins_eq_decode_suffix": [a.margins == b.margins for a, b in zip(g1, today)],
        "tokens_eq_across_shapes_B8_B32_B64_first8": [
            a.tokens == b.tokens == c.tokens for a, b, c in zip(g8, g32[:8], g64[:8])],
    }
    # slot reuse: at B=32 the last 32 problems went into slots the first 32 left; rerun them alone at B=32
    g32b = engine.decode_suffixes(lm, fmt, lives[32:], caps, run=dataclasses.replace(kw, batch=32, step_path=GRAPH))
    res["checks"]["B32_slot_reuse_bits"] = same_suffixes(g32[32:], g32b)
    print("checks", res["checks"], flush=True)
    return res


def main() -> None:
    mode, outdir = sys.argv[1], Path(sys.argv[2])
    outdir.mkdir(parents=True, exist_ok=True)
    if mode == "tiny":
        res = tiny(outdir)
        name = "engine_tiny_checks.json"
    else:
        res = bench(outdir, int(sys.argv[3]) if len(sys.argv) > 3 else 64)
        name = "engine_bench.json"
    res["torch"] = torch.__version__
    res["device_name"] = torch.cuda.get_device_name() if CUDA else "cpu (dry run)"
    (outdir / name).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
