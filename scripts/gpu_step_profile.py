"""Where the batched engine's step spends its time on a GPU (a measurement, nothing asserted).

Usage (on the GPU machine, from the repository root, ``PYTHONPATH=lib``)::

    python3 scripts/gpu_step_profile.py OUTDIR [--batches 1 8 32 64 128] [--max-lens 474 1317]

The model is a random-weight Llama with the embedded SmolLM2-135M's shape (30 layers, hidden 576,
9 query / 3 key-value heads of 64, vocabulary 49,152, tied embeddings) in BF16: a step's time does not
depend on the weights' values, so no GGUF has to travel. Every slot is idle (token 0 at position 0);
the step's shapes, and so its kernels, are those of a full batch. Under the CUDA execution contract
(deterministic algorithms, TF32 off, math SDPA) it times :meth:`kvreplay.engine.StepEngine.step` eager
and as a CUDA graph for each batch and ``max_len``, then the same with one contract switch changed at a
time (deterministic off; SDPA ``efficient``), and writes a ``torch.profiler`` table of the CUDA kernels of
one eager step at the largest batch. Writes ``OUTDIR/step_profile.json`` and ``OUTDIR/step_kernels.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvreplay import engine  # noqa: E402
from kvreplay.contract import resolve_format  # noqa: E402
from kvreplay.execution import resolve_contract  # noqa: E402
from kvreplay.models import LoadedModel  # noqa: E402
from tests.conftest import TINY_FORMAT, make_tokenizer  # noqa: E402

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)


def model(dtype=torch.bfloat16) -> LoadedModel:
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M, attn_implementation="sdpa")).to(dtype).cuda().eval()
    return LoadedModel(model=m, tokenizer=make_tokenizer(), dtype=dtype, role_table=None,
                       identity={"model": "random SmolLM2-135M shape"})


def time_steps(lm, fmt, batch: int, max_len: int, path: str, n: int = 30) -> dict:
    eng = engine.StepEngine(lm, fmt, batch=batch, max_len=max_len, step_path=path)
    with torch.no_grad():
        eng.step()  # graph capture / warm-up
        torch.cuda.synchronize()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
    ms = statistics.median(times) * 1e3
    return {"batch": batch, "max_len": max_len, "path": path, "step_ms": round(ms, 3),
            "ms_per_problem_step": round(ms / batch, 4)}


def same_bits_without_shortcuts(lm, fmt) -> dict:
    """Suffixes of six problems (graph, B=3, slot reuse) with the engine's unique-index writes and unfilled
    allocations, against the same run with both switched back to the deterministic defaults."""
    import contextlib

    from kvreplay import decode
    from tests.conftest import TINY_CAPS

    prompts = [fmt.prompt_ids("Q" + "x" * (3 * i) + "?", ("x", "y", f"z{i}", "w")) for i in range(6)]
    lives = [decode.decode_live(lm, fmt, p, TINY_CAPS) for p in prompts]
    fast = engine.decode_suffixes(lm, fmt, lives, TINY_CAPS, run=engine.EngineRun(step_path="graph", batch=3, max_len=200))
    shortcut = engine.cache._unique_index_writes  # the step and the cache both call it through this module
    engine.cache._unique_index_writes = contextlib.nullcontext
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        slow = engine.decode_suffixes(lm, fmt, lives, TINY_CAPS, run=engine.EngineRun(step_path="graph", batch=3, max_len=200))
        eager = engine.decode_suffixes(lm, fmt, lives, TINY_CAPS, run=engine.EngineRun(step_path="eager", batch=3, max_len=200))
    finally:
        engine.cache._unique_index_writes = shortcut
        torch.utils.deterministic.fill_uninitialized_memory = False
    same = [(a.tokens, a.margins) == (b.tokens, b.margins) for a, b in zip(fast, slow)]
    same_eager = [(a.tokens, a.margins) == (b.tokens, b.margins) for a, b in zip(fast, eager)]
    return {"problems": len(fast), "tokens": sum(len(a.tokens) for a in fast),
            "identical_to_deterministic_defaults": same, "identical_to_eager_defaults": same_eager}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32, 64, 128])
    ap.add_argument("--max-lens", type=int, nargs="*", default=[474, 1317])
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    resolve_contract(device="cuda").apply()
    lm = model()
    fmt = resolve_format(lm.tokenizer, TINY_FORMAT)
    from tests.conftest import tiny_lm

    checks = {}
    for name, m in (("tiny llama bf16", tiny_lm("llama", torch.bfloat16)), ("SmolLM2-135M shape bf16", lm)):
        m.model.cuda()
        checks[name] = same_bits_without_shortcuts(m, resolve_format(m.tokenizer, TINY_FORMAT))
        print(name, checks[name], flush=True)
    rows = []
    for max_len in args.max_lens:
        for b in args.batches:
            for path in ("eager", "graph"):
                if path == "eager" and b not in (1, max(args.batches)):
                    continue
                r = time_steps(lm, fmt, b, max_len, path)
                r["contract"] = "default"
                rows.append(r)
                print(r, flush=True)
    big, short = max(args.batches), min(args.max_lens)
    torch.use_deterministic_algorithms(False)
    for b in (1, big):
        r = time_steps(lm, fmt, b, short, "graph")
        r["contract"] = "deterministic off"
        rows.append(r)
        print(r, flush=True)
    torch.use_deterministic_algorithms(True)
    lm.sdpa_backends = ("efficient",)
    for b in (1, big):
        r = time_steps(lm, fmt, b, short, "graph")
        r["contract"] = "sdpa efficient"
        rows.append(r)
        print(r, flush=True)
    lm.sdpa_backends = ("math",)

    from torch.profiler import ProfilerActivity, profile

    tables = []
    for b in (1, big):
        eng = engine.StepEngine(lm, fmt, batch=b, max_len=short, step_path="eager")
        with torch.no_grad():
            eng.step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    eng.step()
                torch.cuda.synchronize()
        tables.append(f"== eager step, batch {b}, max_len {short} (3 steps)\n"
                      + prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
    (out / "step_kernels.txt").write_text("\n\n".join(tables))
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "bit_checks": checks,
            "transformers": __import__("transformers").__version__, "rows": rows}
    (out / "step_profile.json").write_text(json.dumps(info, indent=1))
    print(tables[-1][:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
