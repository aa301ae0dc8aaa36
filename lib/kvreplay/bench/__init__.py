"""``make bench``: decode speed of the shared suffix decoder against Hugging Face ``generate`` (CPU or GPU).

Usage: ``python -m kvreplay.bench [--model embedded] [--dtype bfloat16] [--tokens 64] [--repeats 3]``; the
measurements on a device are subcommands (:data:`SUBCOMMANDS`): ``python -m kvreplay.bench invariance``,
``engine-suite`` and ``ray``, each with its own ``--help``.

Measured in one process, on one real MMLU problem decoded to its merge
boundary: (1) per-token time of :func:`kvreplay.decoding.decode.decode_suffix` against
``model.generate``. Ours uses the explicit 4-D role mask, role-aware positions,
the desync check and the structural mask at every step. ``generate`` is greedy,
with the same model, duplicate batch of two and number of new tokens, and the
default causal mask; its prefill is timed separately and subtracted.
(2) One-call prefill time of the boundary prefix;
(3) one Experiment 1 row (four arms) at the given caps, as rows per hour;
(4) Experiment 1 rows per hour with ``--workers`` Ray row actors, and its ratio to one process.
The actors (:class:`kvreplay.runner.actors.RowActors`) run on a local Ray cluster, or the one in
``$RAY_ADDRESS``, and are timed after each has loaded the model and finished
one warm-up row; the cluster's and the actors' start-up are reported apart.
(5) Peak resident memory, and peak GPU memory on CUDA. Times are medians over
``--repeats``. Nothing is asserted: speed is reported, never tested.
``generate`` runs with the library's default SDPA backend choice, our decoder
with the pinned contract (``math``), so the ratio includes that choice.
``--device cuda`` measures on the GPU under the CUDA execution contract
(deterministic algorithms, TF32 off), and adds a second table (:func:`engine_table`).
It gives ms per problem-step of today's decoder (eager, a duplicate batch of 2 rows)
against the batched engine's CUDA-graph step at B = 1, 8, 32, 64, 128 problems
(:func:`kvreplay.engine.decode_suffixes`). The engine runs with each step attention
(``--attention``, default both: the model's SDPA call and :func:`kvreplay.engine.grouped_attention`).
The table also times Hugging Face ``generate`` with its own static cache
(``cache_implementation="static"``) and, when it works on the host, with the model's forward
compiled (``torch.compile``, reported if it fails). It ends with Experiment 1 rows per hour with the
batched runner (:func:`kvreplay.experiments.live_vs_prefill.live_vs_prefill_chunk`, graph path) at
the given caps sets.

``--vs-generate`` runs only the side-by-side section instead (``docs/engine.md``; :mod:`kvreplay.bench.generate`),
written to ``--json`` and ``--md``; ``--invariant SHORT LONG`` adds the invariant-kernel step and prefill (``--invariant-kernels`` picks the reference, the fused kernels or both). It has :func:`engine_vs_generate` (the engine and ``generate`` continuing
the same saved boundaries by the same number of tokens, per batched step, with the memory floor).
It also has :func:`exp1_end_to_end` (a real Experiment 1 chunk: useful problem-steps per second and slot
occupancy) and :func:`profile_step` (where a step's time goes).
"""

from __future__ import annotations

import argparse
import importlib
import resource
import statistics
import sys
import time
from collections.abc import Callable

import pandas as pd
import torch

from .. import engine
from ..decoding.caches import live_replica
from ..decoding.contract import Caps, ContractError
from ..decoding.decode import build_prefill, decode_live, decode_suffix
from ..model.execution import device_or_exit
from ..experiments.live_vs_prefill import EXP1
from ..data.problems import load_bank
from ..runner import ArmSettings, RunSpec, resolve_execution
from ..runner.actors import RowActors, shutdown
from .generate import (  # noqa: F401  (re-exported: the --vs-generate section lives there)
    FLAG_SETS, HF_PATHS, PAPER_CAPS, floor_ms, _hf_generate, memory_layout, _sync, choice_stats_cost, engine_vs_generate,
    exp1_end_to_end, load_boundaries, merge_records, profile_step,
)


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(model: str = "embedded", dtype: str = "bfloat16", tokens: int = 64, repeats: int = 3, threads: int = 2,
        caps: tuple[int, int, int] = (48, 160, 12), device: str = "cpu", workers: int = 2,
        rows: int | None = None, worker_threads: int | None = None,
        format_name: str = "chat_multibranch") -> pd.DataFrame:
    """Measure and return the benchmark table (one row per quantity, seconds and ratios).

    ``workers`` <= 1 skips the row-actor measurement; ``rows`` rows (default
    two per actor) are timed both in one process and on the actors.
    ``worker_threads`` (default: ``threads // workers`` on CPU, so the actors
    share the cores the single process had; ``threads`` on CUDA) are each
    actor's intra-op threads. After the actors start, a warm-up maps one row
    per actor; the timed rows are then spread over the actors, at most
    :data:`kvreplay.runner.actors.DEPTH` in flight on each. A local Ray cluster
    started here is shut down at the end.

    Raises:
        ValueError: more actors than the Ray cluster can hold (see :class:`kvreplay.runner.actors.RowActors`).
    """
    settings = ArmSettings(profile="bench", dtype=dtype, caps=Caps(*caps), model=model, fmt=format_name,
                           threads=threads, device=device)
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
    row = EXP1.plan(bank).row_function()  # the arm's own row function, as notebook 01 runs it
    t_row = _median_time(lambda: row(RunSpec(lm=lm, fmt=fmt, decoding=settings.decoding), problem), 1)
    t_seq = None
    if workers > 1:
        import dataclasses

        spec = RunSpec(lm=lm, fmt=fmt, decoding=settings.decoding)
        n = rows or 2 * workers
        timed = bank[1 : 1 + n]
        t0 = time.perf_counter()
        for p in timed:
            row(spec, p)
        t_seq = time.perf_counter() - t0
        if worker_threads is None:
            worker_threads = threads if lm.device.type == "cuda" else max(1, threads // workers)

        def pid(p):
            return p.problem_id

        with RowActors(dataclasses.replace(settings, threads=worker_threads), row, workers=workers) as pool:
            startup, started, address = pool.startup, pool.cluster["started"], pool.cluster["address"]
            warm = bank[1 + n : 1 + n + workers]
            list(pool.mapper(warm, key=pid)(warm))  # one warm-up row per actor
            t0 = time.perf_counter()
            list(pool.mapper(timed, key=pid)(timed))
            t_par = time.perf_counter() - t0
        if started:
            shutdown()
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
        rows[f"Experiment 1 rows per hour, {workers} Ray actors x {worker_threads} thread(s) (same {n} rows)"] = round(3600 * n / t_par, 1)
        rows[f"{workers} actors / one process (throughput ratio)"] = round(t_seq / t_par, 2)
        rows["Ray cluster"] = "local, started here" if started else f"joined at {address}"
        rows["Ray cluster start-up or join (s)"] = startup["ray_s"]
        rows[f"{workers} Ray actors start-up, model loaded (s)"] = startup["actors_s"]
    rows["peak resident memory of this process (MiB)"] = round(peak_mib)
    if lm.device.type == "cuda":
        rows["peak GPU memory of this process (MiB)"] = round(torch.cuda.max_memory_allocated() / 2**20)
    return pd.DataFrame({"value": rows})



def _attention_note(attention: str, sdpa: str) -> str:
    """What attends in an engine row: the SDPA backends, and the step's own attention where it is not SDPA."""
    return f"sdpa {sdpa}" if attention == "sdpa" else f"step attention {attention}, sdpa {sdpa} outside the step"


def engine_table(lm, fmt, *, tokens: int = 64, batches: tuple[int, ...] = (1, 8, 32, 64), branch_cap: int = 48,
                 exp1_caps: tuple[tuple[int, int, int], ...] = ((48, 160, 12),), exp1_batch: int = 64,
                 exp1_rows: int | None = None, compile_: bool = True, repeats: int = 3,
                 step_path: str = "graph", max_lens: tuple[int | None, ...] = (None,),
                 attentions: tuple[str, ...] = ("sdpa",),
                 emit: Callable[[dict], None] = lambda row: None) -> pd.DataFrame:
    """The GPU section of ``make bench``: ms per problem-step of each decode path, and batched Experiment 1 rows/hour.

    Boundaries: live boundaries of the first ``max(batches)`` bank problems at
    branch cap ``branch_cap`` (engine, graph path, B = ``max(batches)``).
    Every suffix decode runs merge content to ``tokens`` (cap) and a one-token
    answer from those boundaries; ms per problem-step is the decode's wall time
    divided by the tokens its problems decoded (a step of B problems counts B).
    ``max_len`` (positions per row of the engine's static cache) is the longest
    boundary plus the suffix bound for every engine run. The engine rows are
    repeated for each of ``max_lens`` (``None``: that length): a step attends
    over all ``max_len`` positions, so its cost grows with it (the ``paper``
    profile's arms have ``max_len`` 4,077). The SDPA backends are ``lm``'s (``lm.sdpa_backends``), as in every
    run; each row's note names them. Today's decoder and ``generate`` decode one problem (a duplicate batch
    of 2 rows); ``generate`` times are for ``tokens`` new tokens with its own
    prefill subtracted (median of ``repeats``). Experiment 1 rows per hour:
    :func:`kvreplay.experiments.live_vs_prefill.live_vs_prefill_chunk` on ``exp1_rows`` problems (default
    ``exp1_batch``) at each caps set, graph path, B = ``exp1_batch``, the first
    chunk of each caps set timed whole (two graph captures, ~0.3 s each, included). ``step_path="eager"``
    runs the engine's op-by-op step instead (any device; a dry run of this code). The engine rows and the
    Experiment 1 rows are repeated for each of ``attentions`` (:data:`kvreplay.engine.ATTENTIONS`: the model's
    SDPA call, or :func:`kvreplay.engine.grouped_attention`); the live boundaries come from the first. ``generate`` with a
    static cache is timed with compilation off (``disable_compile=True``) and, on CUDA, last, as
    transformers compiles it (``torch.compile``, mode ``reduce-overhead``), which takes minutes; ``emit``
    gets each row as it is measured (``main`` prints it at once, so a run cut off by a time limit keeps
    what it measured).

    Returns:
        One row per measurement: ``path``, ``B`` (problems per step), ``rows`` (physical), ``ms per problem-step``
        or ``rows per hour``, and ``note`` (a failure's message).

    Raises:
        ValueError: the graph path with a model not on CUDA; a ``max_lens`` entry shorter than
            the suffix runs need (before anything is timed).
    """
    if step_path == "graph" and lm.device.type != "cuda":
        raise ValueError("engine_table's graph path needs a CUDA model")
    if not batches or min(batches) < 1 or exp1_batch < 1:
        raise ValueError(f"engine_table: batches {tuple(batches)} and exp1_batch {exp1_batch} must be at least 1")
    attentions = tuple(dict.fromkeys(attentions))  # each once, in the order given
    if not attentions or any(a not in engine.ATTENTIONS for a in attentions):
        raise ValueError(f"engine_table: attentions {tuple(attentions)}: use some of {engine.ATTENTIONS}")
    sdpa = "+".join(lm.sdpa_backends)
    label = "graph" if step_path == "graph" else "engine eager step"
    bank = load_bank()
    n = max(batches)
    caps = Caps(branch=branch_cap, merge=tokens, answer=1)
    prompts = [fmt.prompt_ids(p.question, p.options) for p in bank[:n]]
    def refuse_short(longest: int, what: str) -> int:
        need = longest + engine.suffix_length_bound(fmt, caps)
        short = [m for m in max_lens if m is not None and m < need]
        if short:
            raise ValueError(f"engine_table: max_len={short[0]} is shorter than the {need} positions {what}")
        return need

    # no boundary is shorter than its prompt: an obviously short max_len is refused before the live decode
    refuse_short(max(map(len, prompts)), "the longest prompt and the suffix bound already take")
    lives = engine.decode_lives(lm, fmt, prompts, caps, run=engine.EngineRun(step_path=step_path, batch=n, attention=attentions[0]))
    need = refuse_short(max(len(b.ids) for b in lives), "the suffix runs need")
    out = []

    def timed(fn):
        _sync(lm)
        t = time.perf_counter()
        r = fn()
        _sync(lm)
        return time.perf_counter() - t, r

    today = []
    for b in lives[:repeats]:
        t, s = timed(lambda: decode_suffix(lm, fmt, live_replica(b), caps))
        today.append(1e3 * t / len(s.tokens))
    out.append({"path": "decode.decode_suffix (today: eager, DynamicCache)", "B": 1, "rows": 2,
                "ms per problem-step": round(statistics.median(today), 2)})
    emit(out[-1])
    for attention in attentions:
        kind = f"{label}, attention {attention}"
        for max_len in (m or need for m in max_lens):
            for B in batches:
                states = lives[: max(B, min(n, 2 * B)) if B > 1 else repeats]
                shape = engine.EngineRun(step_path, B, max_len, attention=attention)
                engine.decode_suffixes(lm, fmt, states[:B], caps, run=shape)  # capture
                t, got = timed(lambda: engine.decode_suffixes(lm, fmt, states, caps, run=shape))
                steps = sum(len(s.tokens) for s in got)
                out.append({"path": f"engine.decode_suffixes, {kind}", "B": B, "rows": 2 * B,
                            "ms per problem-step": round(1e3 * t / steps, 2),
                            "note": f"{len(states)} problem{'s' * (len(states) != 1)}, max_len {max_len}, "
                                    + _attention_note(attention, sdpa)})
                emit(out[-1])
    z = lives[0].ids
    ids = torch.tensor([z, z], device=lm.device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=lm.tokenizer.pad_token_id or 0)

    def hf(k, **extra):
        with torch.inference_mode():
            lm.model.generate(ids, max_new_tokens=k, min_new_tokens=k, **kw, **extra)

    def per_token(label, **extra):
        try:
            hf(2, **extra)  # warm-up (a static cache is allocated, a compiled forward traced)
            t_n = _median_time(lambda: (hf(tokens + 1, **extra), _sync(lm)), repeats)
            t_1 = _median_time(lambda: (hf(1, **extra), _sync(lm)), repeats)
            out.append({"path": label, "B": 1, "rows": 2, "ms per problem-step": round(1e3 * (t_n - t_1) / tokens, 2)})
        except Exception as e:  # reported, not raised: the bench measures what works on the host
            out.append({"path": label, "B": 1, "rows": 2, "note": f"failed: {type(e).__name__}: {str(e)[:200]}"})

    per_token("HF generate, dynamic cache")
    emit(out[-1])
    per_token("HF generate, static cache, compile off", cache_implementation="static", disable_compile=True)
    emit(out[-1])
    chunk = EXP1.plan(bank).chunk_function()  # the arm's own chunk function, as notebook 01 runs it
    for c in exp1_caps:
        rows = exp1_rows or exp1_batch
        group = bank[1 : 1 + rows]
        c_caps = Caps(*c)
        for attention in attentions:
            arm = ArmSettings(profile="bench", dtype=str(lm.dtype).split(".")[-1], caps=c_caps, device=str(lm.device),
                              step_path="graph" if step_path == "graph" else "engine-eager", batch=exp1_batch,
                              attention=attention)
            run = arm.engine_run(fmt, group + bank[:1])
            assert run is not None  # a batched step path
            need = run.max_len
            spec = RunSpec(lm=lm, fmt=fmt, decoding=arm.decoding, engine=run)
            t, recs = timed(lambda: chunk(spec, group))
            failed = sum(r["gate_failure"] is not None for r in recs)
            out.append({"path": f"Experiment 1 batched runner, {label}, attention {attention}, caps {tuple(c)}",
                        "B": exp1_batch, "rows": 2 * exp1_batch, "rows per hour": round(3600 * len(group) / t, 1),
                        "note": f"{len(group)} rows in {t:.1f} s, max_len {need}, {_attention_note(attention, sdpa)}, "
                                f"{failed} gate failures"})
            emit(out[-1])
    if compile_:  # last: tracing and capture take minutes, and a time limit may end the process here
        # transformers compiles the forward itself for a static cache on CUDA (CompileConfig: torch.compile,
        # mode "reduce-overhead"); a second torch.compile wrapped around it fails on CUDA-graph outputs
        compiled = "HF generate, static cache + torch.compile (transformers' CompileConfig, reduce-overhead)"
        if lm.device.type != "cuda":
            out.append({"path": compiled, "B": 1, "rows": 2, "note": "not run: transformers compiles generate on CUDA only"})
        else:
            t0 = time.perf_counter()
            per_token(compiled, cache_implementation="static")
            out[-1]["note"] = (out[-1].get("note", "") + f" compile + runs {time.perf_counter() - t0:.0f} s").strip()
        emit(out[-1])
    return pd.DataFrame(out)


SUBCOMMANDS = {"invariance": "invariance", "engine-suite": "engine_suite", "ray": "ray"}
"""``python -m kvreplay.bench <subcommand> ...`` -> the module whose ``main(argv)`` runs it: the invariant-kernel
invariants on a device (``invariance``), the ``flex`` engine's guarantees on a GPU (``engine-suite``), Experiment 1
on one GPU and on several (``ray``). Without a subcommand: the benchmark above."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUBCOMMANDS:
        sub = importlib.import_module(f"{__package__}.{SUBCOMMANDS[argv[0]]}")
        status = sub.main(argv[1:])
        return status if isinstance(status, int) else 0
    ap = argparse.ArgumentParser(prog="python -m kvreplay.bench", description=__doc__.splitlines()[0],
                                 epilog=f"subcommands, each with its own --help: {', '.join(SUBCOMMANDS)}")
    ap.add_argument("--model", default="embedded", help="the model (embedded: the bundled SmolLM2-135M; gemma3: Gemma 3 "
                    "270M, make setup MODELS=gemma3; or a folder)")
    ap.add_argument("--format", default="chat_multibranch",
                    help="the block format (gemma3_multibranch for --model gemma3, which has no chat template)")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 or float32")
    ap.add_argument("--tokens", type=int, default=64, help="merge tokens each timed suffix decode runs to (its cap)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats; medians are reported")
    ap.add_argument("--threads", type=int, default=2, help="intra-op CPU threads")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--workers", type=int, default=2, help="Ray row actors for the rows-per-hour ratio (1: skip)")
    ap.add_argument("--worker-threads", type=int, default=None, help="intra-op threads per actor (default: threads // workers on CPU)")
    ap.add_argument("--rows", type=int, default=None, help="rows timed for the rows-per-hour ratio (default 2 per actor)")
    ap.add_argument("--caps", type=int, nargs=3, default=(48, 160, 12), metavar=("BRANCH", "MERGE", "ANSWER"),
                    help="caps of the first table's Experiment 1 row; BRANCH is also the engine rows' branch cap")
    ap.add_argument("--engine", action=argparse.BooleanOptionalAction, default=None,
                    help="the GPU section (engine_table); default on with a CUDA device")
    ap.add_argument("--exp1-caps", type=int, nargs=3, action="append", metavar=("BRANCH", "MERGE", "ANSWER"),
                    help="caps of a batched Experiment 1 rows-per-hour run (repeatable; default 48 160 12 and 768 512 64)")
    ap.add_argument("--exp1-batch", type=int, default=64, help="problems per batched step of those runs")
    ap.add_argument("--exp1-rows", type=int, default=None, help="rows timed per caps set (default: --exp1-batch)")
    ap.add_argument("--no-compile", action="store_true", help="skip generate with torch.compile")
    ap.add_argument("--batches", type=int, nargs="+", default=None, metavar="B",
                    help="problems per step of the engine rows (default 1 8 32 64 128; with --vs-generate 32 64 128)")
    ap.add_argument("--max-len", type=int, nargs="+", default=[0], metavar="N",
                    help="positions per row of the engine rows' static cache, the rows repeated for each "
                         "(default 0: what they need; the paper profile's arms have 4077)")
    ap.add_argument("--engine-only", action="store_true",
                    help="only the engine section (implies --engine): skip the first table")
    ap.add_argument("--sdpa", nargs="+", default=["math"], metavar="BACKEND",
                    help="SDPA backends of the engine section (default math, the execution contract's; also flash, "
                         "and on CUDA efficient and cudnn: other bits, so another contract)")
    ap.add_argument("--attention", nargs="+", choices=engine.ATTENTIONS, default=None, metavar="ATTENTION",
                    help="the engine step's attention in the engine section, its rows repeated for each (default "
                         "all: sdpa, the model's SDPA call; grouped, kvreplay.engine.grouped_attention; flex, "
                         "kvreplay.engine.flex_attention_step; each other bits). With --vs-generate: default flex "
                         "grouped")
    ap.add_argument("--step-path", choices=("graph", "engine-eager"), default="graph",
                    help="the engine's step in the engine section (graph: CUDA only; engine-eager: op by op, any "
                         "device, a dry run)")
    vs = ap.add_argument_group("engine against generate, the same work (--vs-generate)")
    vs.add_argument("--vs-generate", action="store_true",
                    help="only this section: engine_vs_generate at --batches (default 32 64 128), exp1_end_to_end "
                         "(--e2e), profile_step (--profile-steps); records to --json, tables to --md")
    vs.add_argument("--hf", nargs="*", choices=HF_PATHS, default=list(HF_PATHS), metavar="PATH",
                    help="generate configurations: dynamic, static, compile (default all; none: the engine only)")
    vs.add_argument("--skip-engine", action="store_true",
                    help="no engine rows (e.g. a process for generate's rows only; --e2e and --profile-steps still run)")
    vs.add_argument("--flags", nargs="+", choices=FLAG_SETS, default=list(FLAG_SETS),
                    help="flag sets generate runs under (default both)")
    vs.add_argument("--new-tokens", type=int, nargs=2, default=(8, 72), metavar=("SHORT", "LONG"),
                    help="tokens per row of the two timed runs; a step is (T(LONG) - T(SHORT)) / (LONG - SHORT)")
    vs.add_argument("--boundaries", default=None, metavar="FILE",
                    help="the saved boundary prefixes (JSON; written from the prefix bank --bank when "
                         "missing, read after that)")
    vs.add_argument("--bank", default=None, metavar="FILE",
                    help="the prefix bank --boundaries is written from (default the paper profile's, SmolLM2's "
                         "tokens; another model needs a bank of its own, e.g. its profile's prefix_bank_bf16.jsonl)")
    vs.add_argument("--cycle", action="store_true",
                    help="repeat the bank's prefixes in order when it holds fewer than the largest batch")
    vs.add_argument("--choice-vocab", type=int, nargs="+", default=[], metavar="V",
                    help="also time the step's choice statistics alone at these vocabulary sizes for each of "
                         "--batches (choice_stats_cost; e.g. 49152 262144: SmolLM2's and Gemma 3's)")
    vs.add_argument("--e2e", type=int, default=0, metavar="N",
                    help="also an Experiment 1 chunk of the first N bank problems at --vs-caps (0: none)")
    vs.add_argument("--e2e-batch", type=int, default=None, metavar="B", help="its problems per step (default the first of --batches)")
    vs.add_argument("--no-gates", action="store_true", help="the Experiment 1 chunk without its preflight gates")
    vs.add_argument("--vs-caps", type=int, nargs=3, default=PAPER_CAPS, metavar=("BRANCH", "MERGE", "ANSWER"),
                    help="caps of the Experiment 1 chunk and of the recorded boundaries (default 768 512 64)")
    vs.add_argument("--invariant", type=int, nargs=2, default=None, metavar=("SHORT", "LONG"),
                    help="also time the engine's invariant-kernel step (kernels: invariant, eager step) over SHORT and "
                         "LONG new tokens per row, and the prefill of the first boundary under each kernels value")
    vs.add_argument("--invariant-kernels", nargs="+", default=["invariant"], choices=["invariant", "invariant-fused"],
                    metavar="VALUE", help="the kernels values --invariant times: invariant (the reference, eager step), "
                                          "invariant-fused (the Triton kernels; CUDA; on --step-path), or both")
    vs.add_argument("--profile-steps", type=int, default=0, metavar="N",
                    help="also profile N engine steps at the first of --batches (torch.profiler, top ops; 0: none)")
    vs.add_argument("--bandwidth-tbs", type=float, default=4.3, help="memory bandwidth for the floor, TB/s (default 4.3)")
    vs.add_argument("--json", default=None, metavar="FILE", help="merge the records into this JSON list")
    vs.add_argument("--md", default=None, metavar="FILE", help="append this run's tables (and command) to this Markdown file")
    args = ap.parse_args(argv)
    device_type = device_or_exit(ap, args.device)
    if args.vs_generate:
        return _vs_generate_main(ap, args, argv)
    engine_on = args.engine_only or args.engine or (args.engine is None and device_type == "cuda")
    if args.exp1_rows is not None and args.exp1_rows < 1:
        ap.error(f"--exp1-rows {args.exp1_rows}: must be at least 1")
    if args.attention is not None and not engine_on:
        ap.error(f"--attention {' '.join(args.attention)}: the step attention is the engine section's; add --engine "
                 f"or --engine-only (on by default with a CUDA device)")
    if min(args.max_len) < 0:
        ap.error(f"--max-len {args.max_len}: positions are at least 1 (0: what the engine rows need)")
    # every engine run's contract, refused as a profile's `execution` would be (the SDPA backends on the device, graph
    # only on CUDA, a batch of at least 1), before the first table
    step_path = args.step_path if engine_on else "engine-eager"
    args.batches = args.batches or [1, 8, 32, 64, 128]
    for option, batch in [*(("--batches", b) for b in args.batches), ("--exp1-batch", args.exp1_batch)]:
        where = f"{option} {batch}, --sdpa {' '.join(args.sdpa)}, --step-path {step_path}, --device {args.device}"
        try:
            resolve_execution(where, {"device": args.device, "sdpa_backends": list(args.sdpa), "step_path": step_path,
                                      "batch": batch})
        except ValueError as e:  # names `where`
            ap.error(str(e))
    if not args.engine_only:
        table = run(args.model, args.dtype, args.tokens, args.repeats, args.threads, tuple(args.caps), args.device,
                    args.workers, args.rows, args.worker_threads, args.format)
        print(table.astype(object).fillna("").to_markdown())
    if engine_on:

        settings = ArmSettings(profile="bench", dtype=args.dtype, caps=Caps(*args.caps), model=args.model,
                               fmt=args.format, threads=args.threads, device=args.device,
                               sdpa_backends=tuple(args.sdpa))
        lm, fmt = settings.load()
        caps_sets = tuple(tuple(c) for c in (args.exp1_caps or [(48, 160, 12), (768, 512, 64)]))
        print(engine_table(lm, fmt, tokens=args.tokens, batches=tuple(args.batches), branch_cap=args.caps[0],
                           exp1_caps=caps_sets, exp1_batch=args.exp1_batch, exp1_rows=args.exp1_rows,
                           compile_=not args.no_compile, repeats=args.repeats,
                           step_path="graph" if args.step_path == "graph" else "eager",
                           max_lens=tuple(m or None for m in args.max_len),
                           attentions=tuple(args.attention or engine.ATTENTIONS),
                           emit=lambda row: print("measured:", row, flush=True)
                           ).astype(object).fillna("").to_markdown(index=False))
    return 0


def _vs_generate_main(ap: argparse.ArgumentParser, args, argv: list[str] | None) -> int:
    """``--vs-generate``: the side-by-side records, the end-to-end chunk and the step profile (see :func:`main`)."""
    import json
    import shlex

    batches = tuple(args.batches or (32, 64, 128))
    attentions = tuple(args.attention or ("flex", "grouped"))
    step_path = "graph" if args.step_path == "graph" else "eager"
    e2e_batch = args.e2e_batch or batches[0]
    for b in (*batches, e2e_batch):
        try:
            resolve_execution(f"--batches/--e2e-batch {b}", {"device": args.device, "step_path": args.step_path,
                                                               "batch": b, "sdpa_backends": list(args.sdpa),
                                                               "attention": attentions[0]})
        except ValueError as e:
            ap.error(str(e))
    if not 1 <= args.new_tokens[0] < args.new_tokens[1]:
        ap.error(f"--new-tokens {args.new_tokens}: need 1 <= SHORT < LONG")
    if args.invariant and not 1 <= args.invariant[0] < args.invariant[1]:
        ap.error(f"--invariant {args.invariant}: need 1 <= SHORT < LONG")
    try:
        prefixes, source = load_boundaries(args.boundaries, max(batches), args.bank, args.cycle)
    except (OSError, ValueError) as e:
        ap.error(f"boundaries: {e}")
    settings = ArmSettings(profile="bench", dtype=args.dtype, caps=Caps(*args.vs_caps), model=args.model,
                           fmt=args.format, threads=args.threads, device=args.device, sdpa_backends=tuple(args.sdpa))
    lm, fmt = settings.load()
    for i, z in enumerate(prefixes):  # before anything is timed: the boundaries must be this model's and format's
        try:
            fmt.boundary_parse(z, where=f"boundary {i}")
        except ContractError as e:
            ap.error(f"the boundaries of {source['file'] or source['source']} are not boundary prefixes of "
                     f"--model {args.model} in --format {args.format} ({e}); write them from a prefix bank of this "
                     f"model (--bank) into a new --boundaries file")
    show = lambda rec: print("measured:", json.dumps(rec), flush=True)  # noqa: E731
    max_len = next((m for m in args.max_len if m), None)
    records = engine_vs_generate(lm, fmt, prefixes, batches=batches, max_len=max_len,
                                 new_tokens=tuple(args.new_tokens), attentions=() if args.skip_engine else attentions,
                                 hf=tuple(args.hf),
                                 flag_sets=tuple(args.flags), repeats=args.repeats, step_path=step_path,
                                 bandwidth=args.bandwidth_tbs * 1e12, caps=tuple(args.vs_caps),
                                 invariant_tokens=tuple(args.invariant) if args.invariant else None,
                                 invariant_values=tuple(args.invariant_kernels), emit=show)
    if args.choice_vocab:
        records += choice_stats_cost(lm.device, batches=batches, vocabs=args.choice_vocab, dtype=lm.dtype,
                                     repeats=args.repeats)
        for rec in records[-len(batches) * len(args.choice_vocab):]:
            show(rec)
    if args.e2e:
        problems = load_bank()[: args.e2e]
        records.append(exp1_end_to_end(lm, fmt, problems, batch=e2e_batch, caps=tuple(args.vs_caps),
                                       attention=attentions[0], step_path=step_path, gates=not args.no_gates,
                                       emit=show))
    env = {"device": torch.cuda.get_device_name() if lm.device.type == "cuda" else "cpu", "torch": torch.__version__,
           "dtype": args.dtype, "boundaries": source, "bandwidth_tbs": args.bandwidth_tbs}
    for r in records:
        r["environment"] = env
    profile = profile_step(lm, fmt, prefixes, batch=batches[0], attention=attentions[0], max_len=max_len,
                           step_path=step_path, steps=args.profile_steps) if args.profile_steps else ""
    if args.json:
        merge_records(args.json, records)
    table = pd.DataFrame(records).drop(columns=["environment"], errors="ignore")
    text = table.astype(object).fillna("").to_markdown(index=False)
    print(text)
    if profile:
        print(profile)
    if args.md:
        command = "python -m kvreplay.bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
        with open(args.md, "a", encoding="utf-8") as f:
            f.write(f"## `{command}`\n\n{env['device']}, torch {env['torch']}, {args.dtype}; boundaries "
                    f"{source['source']} (sha256 {source['sha256'][:12]}, {source['n']} prefixes)\n\n{text}\n\n"
                    + (profile + "\n" if profile else ""))
    return 0

