"""``make bench``: decode speed of the shared suffix decoder against Hugging Face ``generate`` (CPU or GPU).

Usage: ``python -m kvreplay.bench [--model embedded] [--dtype bfloat16] [--tokens 64] [--repeats 3]``.

Measured in one process, on one real MMLU problem decoded to its merge
boundary: (1) per-token time of :func:`kvreplay.decode.decode_suffix` (explicit
4-D role mask, role-aware positions, desync check, structural mask, every
step) against ``model.generate`` (greedy, same model, same duplicate batch of
two, same number of new tokens, default causal mask), whose prefill is timed
separately and subtracted; (2) one-call prefill time of the boundary prefix;
(3) one Experiment 1 row (four arms) at the given caps, as rows per hour;
(4) Experiment 1 rows per hour with ``--workers`` row-parallel processes
(:class:`kvreplay.parallel.RowPool`, timed after every worker has loaded the
model and finished one warm-up row), and its ratio to one process; (5) peak
resident memory, and peak GPU memory on CUDA. Times are medians over
``--repeats``. Nothing is asserted: speed is reported, never tested.
``generate`` runs with the library's default SDPA backend choice, our decoder
with the pinned contract (``math``), so the ratio includes that choice.
``--device cuda`` measures on the GPU under the CUDA execution contract
(deterministic algorithms, TF32 off).
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
        caps: tuple[int, int, int] = (48, 160, 12), device: str = "cpu", workers: int = 2,
        rows: int | None = None, worker_threads: int | None = None) -> pd.DataFrame:
    """Measure and return the benchmark table (one row per quantity, seconds and ratios).

    ``workers`` <= 1 skips the row-parallel measurement; ``rows`` rows (default
    two per worker) are timed both in one process and in the workers.
    ``worker_threads`` (default: ``threads // workers`` on CPU, so the workers
    share the cores the single process had; ``threads`` on CUDA) are each
    worker's intra-op threads. The warm-up maps one row per worker after the
    pool starts; the pool hands rows to whichever worker is free, so a worker
    still loading then is not waited for.
    """
    from .caches import live_replica
    from .contract import Caps
    from .data import load_bank
    from .decode import build_prefill, decode_live, decode_suffix
    from .experiments import ArmSettings, RunSpec, exp1_row

    settings = ArmSettings(profile="bench", dtype=dtype, caps=Caps(*caps), model=model, threads=threads, device=device)
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
    bank = load_bank()
    t_row = _median_time(lambda: exp1_row(RunSpec(lm=lm, fmt=fmt, caps=settings.caps), problem), 1)
    t_seq = None
    if workers > 1:
        from .parallel import RowPool

        spec = RunSpec(lm=lm, fmt=fmt, caps=settings.caps)
        n = rows or 2 * workers
        timed = bank[1 : 1 + n]
        t0 = time.perf_counter()
        for p in timed:
            exp1_row(spec, p)
        t_seq = time.perf_counter() - t0
        import dataclasses

        if worker_threads is None:
            worker_threads = threads if lm.device.type == "cuda" else max(1, threads // workers)
        with RowPool(dataclasses.replace(settings, threads=worker_threads), exp1_row, workers=workers) as pool:
            list(pool.map(bank[1 + n : 1 + n + workers]))  # start-up and one warm-up row per worker
            t0 = time.perf_counter()
            list(pool.map(timed))
            t_par = time.perf_counter() - t0
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
    }
    if t_seq is not None:
        rows[f"Experiment 1 rows per hour, one process ({n} rows)"] = round(3600 * n / t_seq, 1)
        rows[f"Experiment 1 rows per hour, {workers} workers x {worker_threads} thread(s) (same {n} rows)"] = round(3600 * n / t_par, 1)
        rows[f"{workers} workers / one process (throughput ratio)"] = round(t_seq / t_par, 2)
    rows["peak resident memory of this process (MiB)"] = round(peak_mib)
    if lm.device.type == "cuda":
        rows["peak GPU memory of this process (MiB)"] = round(torch.cuda.max_memory_allocated() / 2**20)
    return pd.DataFrame({"value": rows})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvreplay.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--workers", type=int, default=2, help="row-parallel processes for the rows-per-hour ratio (1: skip)")
    ap.add_argument("--worker-threads", type=int, default=None, help="intra-op threads per worker (default: threads // workers on CPU)")
    ap.add_argument("--rows", type=int, default=None, help="rows timed for the rows-per-hour ratio (default 2 per worker)")
    ap.add_argument("--caps", type=int, nargs=3, default=(48, 160, 12), metavar=("BRANCH", "MERGE", "ANSWER"))
    args = ap.parse_args(argv)
    table = run(args.model, args.dtype, args.tokens, args.repeats, args.threads, tuple(args.caps), args.device, args.workers,
                args.rows, args.worker_threads)
    print(table.to_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
