"""``make bench``: decode speed of the shared suffix decoder against Hugging Face ``generate`` (CPU or GPU).

Usage: ``python -m kvreplay.bench [--model embedded] [--dtype bfloat16] [--tokens 64] [--repeats 3]``.

Measured in one process, on one real MMLU problem decoded to its merge
boundary: (1) per-token time of :func:`kvreplay.decode.decode_suffix` (explicit
4-D role mask, role-aware positions, desync check, structural mask, every
step) against ``model.generate`` (greedy, same model, same duplicate batch of
two, same number of new tokens, default causal mask), whose prefill is timed
separately and subtracted; (2) one-call prefill time of the boundary prefix;
(3) one Experiment 1 row (four arms) at the given caps, as rows per hour;
(4) peak resident memory. Times are medians over ``--repeats``. Nothing is
asserted: speed is reported, never tested. ``generate`` runs with the
library's default SDPA backend choice, our decoder with the pinned contract
(``math``), so the ratio includes that choice. Row-parallel workers and the GPU
numbers are not measured yet.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time

import pandas as pd
import torch


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(model: str = "embedded", dtype: str = "bfloat16", tokens: int = 64, repeats: int = 3, threads: int = 2,
        caps: tuple[int, int, int] = (48, 160, 12)) -> pd.DataFrame:
    """Measure and return the benchmark table (one row per quantity, seconds and ratios)."""
    from .caches import live_replica
    from .contract import Caps
    from .data import load_bank
    from .decode import build_prefill, decode_live, decode_suffix
    from .experiments import ArmSettings, RunSpec, exp1_row

    settings = ArmSettings(profile="bench", dtype=dtype, caps=Caps(*caps), model=model, threads=threads)
    lm, fmt = settings.load()
    problem = load_bank()[0]
    live = decode_live(lm, fmt, fmt.prompt_ids(problem.question, problem.options), settings.caps)
    z = live.ids
    # (1) ours: a merge block forced to run `tokens` content steps (cap), then a one-token answer
    bench_caps = Caps(branch=caps[0], merge=tokens, answer=1)
    steps = []

    def ours():
        s = decode_suffix(lm, fmt, live_replica(live), bench_caps)
        steps.append(len(s.tokens))

    t_ours = _median_time(ours, repeats)
    ours_per_token = t_ours / steps[-1]
    # HF generate on the same duplicate batch (its own prefill subtracted)
    ids = torch.tensor([z, z], device=lm.device)
    def hf(n):
        with torch.inference_mode():
            lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=lm.tokenizer.pad_token_id or 0)

    t_hf_n = _median_time(lambda: hf(steps[-1] + 1), repeats)
    t_hf_1 = _median_time(lambda: hf(1), repeats)
    hf_per_token = (t_hf_n - t_hf_1) / steps[-1]
    t_prefill = _median_time(lambda: build_prefill(lm, fmt, z), repeats)
    t_row = _median_time(lambda: exp1_row(RunSpec(lm=lm, fmt=fmt, caps=settings.caps), problem), 1)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    device = torch.cuda.get_device_name() if lm.device.type == "cuda" else "cpu"
    rows = {
        "device / dtype / threads": f"{device} / {dtype} / {torch.get_num_threads()}",
        "boundary prefix |z| (tokens)": len(z),
        "suffix decoder, s per token": round(ours_per_token, 5),
        "HF generate, s per token (prefill subtracted)": round(hf_per_token, 5),
        "suffix decoder / generate (per-token ratio)": round(ours_per_token / hf_per_token, 3),
        "prefill of z, one call (s)": round(t_prefill, 3),
        f"Experiment 1 row, caps {caps} (s)": round(t_row, 1),
        "Experiment 1 rows per hour, one process": round(3600 / t_row, 1),
        "peak resident memory (MiB)": round(peak_mib),
    }
    return pd.DataFrame({"value": rows})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvreplay.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    table = run(args.model, args.dtype, args.tokens, args.repeats, args.threads)
    print(table.to_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
