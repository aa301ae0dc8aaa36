"""``python -m kvreplay.bench --vs-generate``: the engine and Hugging Face ``generate`` doing the same work.

:func:`engine_vs_generate` continues the same saved boundaries (:func:`load_boundaries`) by the same number of
tokens on both sides, per batched step, with the memory floor; :func:`exp1_end_to_end` times a real Experiment 1
chunk; :func:`choice_stats_cost` times the choice statistics apart from the model; :func:`profile_step` says where
a step's time goes. ``docs/engine.md`` reads the records. Speed is reported, never tested.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .. import engine
from ..model import kernels
from ..decoding.contract import Caps
from ..decoding.decode import build_prefill
from ..experiments.live_vs_prefill import EXP1
from ..paths import ROOT
from ..runner import ArmSettings, RunSpec



def _sync(lm) -> None:
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)



# ------------------------------------------------------------------------------ engine vs generate, same work
PAPER_CAPS = (768, 512, 64)
"""The caps whose boundary prefixes :func:`engine_vs_generate` decodes by default (the ``paper`` profile's)."""

FLAG_SETS = ("engine", "torch-defaults")
"""Flags ``generate`` runs under in :func:`engine_vs_generate`: ``engine``, the engine's execution contract on the
device (on CUDA: deterministic algorithms, no NaN fill of new memory, cuDNN deterministic, TF32 off); and
``torch-defaults``, torch's own (nondeterministic algorithms, NaN fill on, cuDNN's TF32 on). The faster is the one
to beat. ``generate`` picks its SDPA backend as torch does in both (it is not held to the contract's ``math``)."""

HF_PATHS = ("dynamic", "static", "compile")
"""Hugging Face ``generate`` configurations of :func:`engine_vs_generate`: its dynamic cache; a static cache with
compilation off; a static cache that transformers compiles (``torch.compile`` of the forward, its CompileConfig;
CUDA only)."""


def load_boundaries(path: str | Path | None, n: int, source: str | Path | None = None,
                    cycle: bool = False) -> tuple[list[list[int]], dict]:
    """The boundary prefixes both sides decode, saved once to ``path`` and read back from it after that.

    Args:
        path: a JSON file ``{"source", "sha256", "prefixes"}``; read when it exists, else written from ``source``.
        n: prefixes needed (the largest batch).
        source: a prefix bank (``prefix_bank_bf16.jsonl``, default the ``paper`` profile's: caps 768/512/64).
        cycle: with fewer than ``n`` prefixes, repeat them in order up to ``n`` (a short bank, e.g. a trial's
            few rows: a step's cost depends on the lengths, not on which problems fill the slots).

    Returns:
        ``(prefixes, {"file", "source", "sha256", "n", "distinct"})``.

    Raises:
        ValueError: the file holds fewer than ``n`` prefixes (none, with ``cycle``).
    """
    import hashlib
    import json

    from ..ledger.prefix_bank import read_prefix_bank
    from ..paths import LEDGERS

    p = Path(path) if path is not None else None
    if p is not None and p.is_file():
        saved = json.loads(p.read_text())
    else:
        bank = Path(source) if source is not None else LEDGERS / "paper" / "prefix_bank_bf16.jsonl"
        entries, digest = read_prefix_bank(bank)
        saved = {"source": str(bank.resolve().relative_to(ROOT)) if bank.resolve().is_relative_to(ROOT) else str(bank),
                 "source_sha256": digest, "prefixes": [e["prefix"] for e in entries]}
        if p is not None:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(saved) + "\n")
    distinct = len(saved["prefixes"])
    if distinct < n and not (cycle and distinct):
        raise ValueError(f"{path or source}: {distinct} boundary prefixes, {n} needed"
                         + ("" if cycle else " (--cycle repeats them)"))
    sha = hashlib.sha256(json.dumps(saved["prefixes"]).encode()).hexdigest()
    prefixes = [saved["prefixes"][i % distinct] for i in range(n)]
    return prefixes, {"file": str(p) if p else None, "source": saved["source"], "sha256": sha, "n": n,
                      "distinct": min(distinct, n)}


@contextlib.contextmanager
def _flags(name: str, device_type: str):
    """Run the block under a flag set of :data:`FLAG_SETS`; the flags in force before are restored after."""
    import torch.utils.deterministic as det_mod

    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             det_mod.fill_uninitialized_memory, cudnn.deterministic, cudnn.benchmark, matmul.allow_tf32,
             cudnn.allow_tf32, torch.get_float32_matmul_precision())
    try:
        if name == "engine":
            det = device_type == "cuda"  # the contract's default: deterministic on CUDA, not needed on the CPU
            torch.use_deterministic_algorithms(det)
            det_mod.fill_uninitialized_memory = not det
            cudnn.deterministic, cudnn.benchmark, matmul.allow_tf32, cudnn.allow_tf32 = det, False, False, False
            torch.set_float32_matmul_precision("highest")
        elif name == "torch-defaults":
            torch.use_deterministic_algorithms(False)
            det_mod.fill_uninitialized_memory = True
            cudnn.deterministic, cudnn.benchmark, matmul.allow_tf32, cudnn.allow_tf32 = False, False, False, True
            torch.set_float32_matmul_precision("highest")
        else:
            raise ValueError(f"unknown flag set {name!r}; use one of {FLAG_SETS}")
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        det_mod.fill_uninitialized_memory = saved[2]
        cudnn.deterministic, cudnn.benchmark, matmul.allow_tf32, cudnn.allow_tf32 = saved[3:7]
        torch.set_float32_matmul_precision(saved[7])


class _Timer:
    """Wall time of a block: CUDA events on a GPU (after a synchronize), ``time.perf_counter`` on the CPU."""
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], object]) -> float:
        """Seconds ``fn()`` took."""
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t


def memory_layout(lm) -> dict:
    """Bytes of the weights (once) and of one position's keys and values across layers, of ``lm``."""
    cfg = lm.model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    size = torch.tensor([], dtype=lm.dtype).element_size()
    weights = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    return {"weights_bytes": weights, "kv_bytes_per_position": cfg.num_hidden_layers * 2 * kv_heads * head_dim * size}


def floor_ms(layout: dict, positions: float, bandwidth: float) -> float:
    """Milliseconds to read the weights once and ``positions`` row-positions of K/V at ``bandwidth`` bytes/s."""
    return 1e3 * (layout["weights_bytes"] + positions * layout["kv_bytes_per_position"]) / bandwidth


def _steady(timer: _Timer, run: Callable[[int], object], lengths: tuple[int, int], repeats: int) -> float:
    """Steady-state seconds per step: median over ``repeats`` of ``(T(long) - T(short)) / (long - short)``.

    Each side's fixed costs (admission or prefill, graph capture, the first token) are in both runs and cancel.
    """
    short, long_ = lengths
    per = []
    for _ in range(repeats):
        t_short = timer(lambda: run(short))
        t_long = timer(lambda: run(long_))
        per.append((t_long - t_short) / (long_ - short))
    return statistics.median(per)


@contextlib.contextmanager
def _kernels(lm, value: str):
    """Within the block ``lm`` runs under ``kernels: value`` (its contract's other settings kept); restored after."""
    import dataclasses

    before = lm.contract
    if before is None or before.kernels == value:
        if value != kernels.DEFAULT and before is None:
            raise ValueError("the invariant step needs a model loaded under an execution contract")
        yield
        return
    lm.contract = dataclasses.replace(before, kernels=value)
    try:
        yield
    finally:
        lm.contract = before


def _reset_peak(lm) -> None:
    if lm.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(lm.device)


def _peak(lm) -> dict:
    """``{"peak_mib": ...}``: peak GPU memory allocated since :func:`_reset_peak` (CUDA), else nothing."""
    if lm.device.type != "cuda":
        return {}
    return {"peak_mib": round(torch.cuda.max_memory_allocated(lm.device) / 2**20, 1)}


def _hf_generate(lm, prefixes: Sequence[Sequence[int]], kind: str, max_new: int) -> Callable[[int], object]:
    """``generate`` on left-padded duplicate rows of ``prefixes`` (2 per problem), greedy, exactly ``n`` new tokens."""
    from transformers import StaticCache

    dev = lm.device
    width = max(len(z) for z in prefixes)
    rows = [list(z) for z in prefixes for _ in range(2)]
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(z)) + z for z in rows], device=dev)
    mask = torch.tensor([[0] * (width - len(z)) + [1] * len(z) for z in rows], device=dev)
    kw: dict = dict(attention_mask=mask, do_sample=False, pad_token_id=pad)
    if kind == "static":
        kw["disable_compile"] = True

    def run(n: int):
        extra = {}
        if kind in ("static", "compile"):  # one cache length for every n: one compiled graph
            extra["past_key_values"] = StaticCache(config=lm.model.config, max_cache_len=width + max_new)
        with torch.inference_mode():
            return lm.model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw, **extra)
    return run


def engine_vs_generate(lm, fmt, prefixes: Sequence[Sequence[int]], *, batches: Sequence[int] = (32, 64, 128),
                       max_len: int | None = None, new_tokens: tuple[int, int] = (8, 72),
                       attentions: Sequence[str] = ("flex", "grouped"), hf: Sequence[str] = HF_PATHS,
                       flag_sets: Sequence[str] = FLAG_SETS, repeats: int = 3, step_path: str = "graph",
                       bandwidth: float = 4.3e12, caps: tuple[int, int, int] = PAPER_CAPS,
                       invariant_tokens: tuple[int, int] | None = None,
                       invariant_values: Sequence[str] = (kernels.INVARIANT,),
                       emit: Callable[[dict], None] = lambda record: None) -> list[dict]:
    """The engine and Hugging Face ``generate`` doing the same work, per batched step, and the memory floor.

    Both sides continue the same boundary prefixes (``prefixes[:B]``, e.g. :func:`load_boundaries`), B problems
    as 2B duplicate rows, by exactly the same number of greedy tokens, with no delimiter, cap or structural
    mask on the engine's side (:func:`kvreplay.engine.decode_forced`). A step's time is the steady state:
    ``(T(long) - T(short)) / (long - short)`` for ``new_tokens = (short, long)`` on one warmed-up engine or
    model, median of ``repeats`` pairs, timed with CUDA events (``perf_counter`` on the CPU). The engine runs
    under its contract (its attention, its SDPA backends for the prefill); ``generate`` under each of
    ``flag_sets`` (:data:`FLAG_SETS`) with its own SDPA choice.

    The memory floor of a step is the weights read once plus keys and values read once, at ``bandwidth``
    bytes/s. ``floor_ms`` counts every row's filled positions: the same for every path, as the work is.
    ``floor_ms_layout`` counts what the path's cache layout must read: the engine's whole static cache for
    ``sdpa``/``grouped``, its filled 128-position blocks for ``flex``, the padded width for ``generate``'s
    dynamic cache, the cache length for its static cache. Positions are taken at the middle of the timed window.

    Args:
        lm, fmt: the loaded model and block format.
        prefixes: boundary prefixes z, at least ``max(batches)``.
        batches: problems per step B.
        max_len: the engine's positions per row (default: the longest prefix plus ``new_tokens[1]``), rounded up
            to a multiple of 128 for ``flex``; the ``paper`` arms' is 4,077 (4,096 for ``flex``).
        new_tokens: ``(short, long)`` tokens per row of the two timed runs.
        attentions: engine attentions (``flex`` is reported as path ``engine``, others as ``engine-<name>``; none:
            ``generate`` only).
        hf: ``generate`` configurations (:data:`HF_PATHS`; ``compile`` runs on CUDA only).
        step_path: the engine's step, ``"graph"`` (CUDA) or ``"eager"``.
        bandwidth: memory bandwidth of the device, bytes/s (the H200 moves about 4.3e12 in practice).
        caps: the caps the prefixes were decoded at (recorded).
        invariant_tokens: ``(short, long)`` tokens of the invariant engine step's timed runs (path
            ``engine-invariant``: ``kernels: invariant``, eager step, :mod:`kvreplay.engine.invariant`), and the
            prefill of ``prefixes[0]`` timed once under each kernels value (paths ``prefill``, ``prefill-invariant``);
            ``None``: not run. The reference is slow, so fewer tokens than ``new_tokens`` suit it.
        invariant_values: the invariant kernels values timed with ``invariant_tokens``: ``invariant`` (the
            reference; paths as above) and ``invariant-fused`` (:mod:`kvreplay.model.kernels_fused`; paths
            ``engine-invariant-fused``, ``prefill-invariant-fused``), on ``step_path`` like ``default``.
        emit: called with each record as it is measured.

    Returns:
        Records with ``path``, ``B``, ``rows``, ``caps``, ``new_tokens``, ``ms_per_step``, ``ms_per_problem_step``,
        ``floor_ms``, ``floor_ms_layout``, ``x_floor``, ``flags``, ``attention`` (engine) and ``note``; engine paths
        on CUDA also ``peak_mib`` (peak GPU memory allocated while that path ran, MiB).

    Raises:
        ValueError: fewer prefixes than the largest batch, ``new_tokens`` not increasing, an unknown path,
            attention or flag set (before anything is timed).
    """
    short, long_ = new_tokens
    if not 1 <= short < long_:
        raise ValueError(f"new_tokens {new_tokens}: need 1 <= short < long")
    if invariant_tokens is not None and not 1 <= invariant_tokens[0] < invariant_tokens[1]:
        raise ValueError(f"invariant_tokens {invariant_tokens}: need 1 <= short < long")
    wrong = [v for v in invariant_values if v not in (kernels.INVARIANT, kernels.FUSED)]
    if wrong:
        raise ValueError(f"invariant_values {wrong}: use {kernels.INVARIANT!r} or {kernels.FUSED!r}")
    if len(prefixes) < max(batches):
        raise ValueError(f"{len(prefixes)} boundary prefixes for a batch of {max(batches)}")
    bad = [a for a in attentions if a not in engine.ATTENTIONS] + [h for h in hf if h not in HF_PATHS] + \
        [f for f in flag_sets if f not in FLAG_SETS]
    if bad:
        raise ValueError(f"engine_vs_generate: unknown {bad}; attentions {engine.ATTENTIONS}, hf {HF_PATHS}, "
                         f"flags {FLAG_SETS}")
    layout = memory_layout(lm)
    timer = _Timer(lm.device)
    caps_s = "/".join(map(str, caps))
    out: list[dict] = []

    def record(rec: dict) -> None:
        out.append(rec)
        emit(rec)

    states = [build_prefill(lm, fmt, z, where=f"boundary {i}")
              for i, z in enumerate(prefixes[: max(batches) if attentions or invariant_tokens else 0])]
    if invariant_tokens is not None:
        for value in (kernels.DEFAULT, *invariant_values):
            with _kernels(lm, value):
                if value == kernels.FUSED:  # the first call compiles the kernels: not timed
                    build_prefill(lm, fmt, prefixes[0], where="boundary 0")
                sec = timer(lambda: build_prefill(lm, fmt, prefixes[0], where="boundary 0"))
            record({"path": "prefill" if value == "default" else f"prefill-{value}", "B": 1, "rows": 2,
                    "caps": caps_s, "prefix": len(prefixes[0]), "ms": round(1e3 * sec, 3), "flags": "engine",
                    "note": f"one forward call over boundary 0 ({len(prefixes[0])} positions), kernels {value}, "
                            f"timed once"})
    for B in batches:
        zs = [len(z) for z in prefixes[:B]]
        middle = (short + long_) / 2
        filled = 2 * sum(n + middle for n in zs)  # row-positions read per step, both duplicates
        floor = floor_ms(layout, filled, bandwidth)
        base = {"B": B, "rows": 2 * B, "caps": caps_s, "new_tokens": long_, "timed_steps": long_ - short,
                "mean_boundary": round(sum(zs) / B, 1), "floor_ms": round(floor, 6)}
        invariant = [(v, "sdpa") for v in invariant_values] if invariant_tokens is not None else []
        for value, attention in [("default", a) for a in attentions] + invariant:
            length = max_len or max(zs) + long_
            if attention == "flex":  # whole blocks of 128 (the mask hides the padding)
                length = -(-length // engine.FLEX_BLOCK) * engine.FLEX_BLOCK
            tokens = new_tokens if value == "default" else invariant_tokens
            assert tokens is not None
            _reset_peak(lm)
            with _kernels(lm, value):
                path = "eager" if value == kernels.INVARIANT else step_path  # the reference: the eager step only
                eng = engine.StepEngine(lm, fmt, engine.EngineRun(path, B, length, attention=attention))
                run = lambda n: engine.decode_forced(lm, fmt, states[:B], n, engine=eng)  # noqa: E731
                warm = timer(lambda: run(tokens[0]))  # capture, compile
                sec = _steady(timer, run, tokens, repeats)
            if value != "default":
                read = 2 * sum(-(-(n + middle + 1) // kernels.ATTENTION_BLOCK) * kernels.ATTENTION_BLOCK for n in zs)
                how = "fused kernels (Triton)" if value == kernels.FUSED else "reference kernels"
                record(base | {"path": f"engine-{value}", "attention": "invariant (64-key blocks)", "flags": "engine",
                               "step_path": path, "max_len": length, "new_tokens": tokens[1],
                               "timed_steps": tokens[1] - tokens[0], "ms_per_step": round(1e3 * sec, 4),
                               "ms_per_problem_step": round(1e3 * sec / B, 5),
                               "floor_ms_layout": round(floor_ms(layout, read, bandwidth), 6),
                               "x_floor": round(1e3 * sec / floor, 1), **_peak(lm),
                               "note": f"kernels {value}, {how}; first run ({tokens[0]} tokens) "
                                       f"{warm:.1f} s"})
                del eng
                continue
            if attention == "flex":
                read = 2 * sum(-(-(n + middle + 1) // engine.FLEX_BLOCK) * engine.FLEX_BLOCK for n in zs)
            else:
                read = 2 * B * length
            record(base | {"path": "engine" if attention == "flex" else f"engine-{attention}", "attention": attention,
                           "flags": "engine", "step_path": step_path, "max_len": length,
                           "ms_per_step": round(1e3 * sec, 4), "ms_per_problem_step": round(1e3 * sec / B, 5),
                           "floor_ms_layout": round(floor_ms(layout, read, bandwidth), 6),
                           "x_floor": round(1e3 * sec / floor, 1), **_peak(lm),
                           "note": f"first run (capture, compile, {short} tokens) {warm:.1f} s; sdpa backends "
                                   f"{'+'.join(lm.sdpa_backends)} for the prefill"})
            del eng
        for kind in hf:
            for flags in flag_sets:
                path = {"dynamic": "generate-dynamic", "static": "generate-static",
                        "compile": "generate-static-compile"}[kind]
                rec = base | {"path": path, "flags": flags}
                if kind == "compile" and lm.device.type != "cuda":
                    record(rec | {"note": "not run: transformers compiles generate on CUDA only"})
                    continue
                try:
                    with _flags(flags, lm.device.type):
                        run = _hf_generate(lm, prefixes[:B], kind, long_)
                        warm = timer(lambda: run(short))
                        sec = _steady(timer, run, new_tokens, repeats)
                except Exception as e:  # reported, not raised: the bench measures what works on the host
                    record(rec | {"note": f"failed: {type(e).__name__}: {str(e)[:300]}"})
                    continue
                width = max(zs)
                read = 2 * B * (width + middle) if kind == "dynamic" else 2 * B * (width + long_)
                record(rec | {"ms_per_step": round(1e3 * sec, 4), "ms_per_problem_step": round(1e3 * sec / B, 5),
                              "floor_ms_layout": round(floor_ms(layout, read, bandwidth), 6),
                              "x_floor": round(1e3 * sec / floor, 1),
                              "note": f"first run ({short} tokens, compile if any) {warm:.1f} s; left-padded to "
                                      f"{width}"})
    return out


def exp1_end_to_end(lm, fmt, problems: Sequence, *, batch: int, caps: tuple[int, int, int] = PAPER_CAPS,
                    attention: str = "flex", step_path: str = "graph", gates: bool = True,
                    emit: Callable[[dict], None] = lambda record: None) -> dict:
    """A real Experiment 1 chunk end to end: useful problem-steps per second and slot occupancy.

    :func:`kvreplay.experiments.live_vs_prefill.live_vs_prefill_chunk` on ``problems`` at ``caps`` through one
    engine of ``batch`` slots (live boundaries, replicas, prefill calls, boundary gates, the four arms' suffixes,
    refills, the ragged tail), the arm's ``max_len`` as a run would resolve it. With ``gates`` the chunk runs as
    a new arm's first chunk does (:class:`kvreplay.runner.BatchedRows`): its first problem also computed alone
    (``composition``, ``graph_equals_eager`` on the graph path, ``attention_tolerance``) and the float32
    construction-equivalence check on it, timed apart.

    Returns:
        ``{"path": "exp1-chunk", "B", "problems", "caps", "attention", "seconds" (the chunk), "gate_seconds" (the
        preflight runs), "steps", "busy_slot_steps", "occupancy", "problem_steps_per_s", "rows_per_hour" (the
        chunk), "rows_per_hour_with_gates", "gate_failures", "checks"}``; steps and occupancy are the chunk's.
    """
    from ..runner.batched import BatchedRows

    settings = ArmSettings(profile="bench", dtype=str(lm.dtype).split(".")[-1], caps=Caps(*caps),
                           step_path="graph" if step_path == "graph" else "engine-eager", batch=batch,
                           device=str(lm.device), attention=attention, chunk=len(problems))
    run = settings.engine_run(fmt, problems)
    ids = frozenset([problems[0].problem_id]) if gates else frozenset()
    spec = RunSpec(lm=lm, fmt=fmt, decoding=settings.decoding, engine=run, equivalence_ids=ids)
    timer = _Timer(lm.device)
    chunk: dict = {}
    mapper = BatchedRows(spec, EXP1.plan(problems).chunk_function(), problems, on_chunk=chunk.update,
                         composition_id=problems[0].problem_id if gates else None)
    got: list = []
    # the chunk's logged seconds are rounded to 1 ms: with no gate time outside the chunk, the timed total can come
    # out below them, so it is taken as at least the chunk's
    total = max(timer(lambda: got.extend(mapper(problems))), chunk["seconds"])
    rec = {"path": "exp1-chunk", "B": batch, "problems": len(problems), "caps": "/".join(map(str, caps)),
           "attention": attention, "step_path": step_path, "max_len": run.max_len, "seconds": chunk["seconds"],
           "gate_seconds": round(total - chunk["seconds"], 2), "steps": chunk["steps"],
           "busy_slot_steps": chunk["busy_slot_steps"], "occupancy": chunk["occupancy"],
           "problem_steps_per_s": round(chunk["busy_slot_steps"] / chunk["seconds"], 1),
           "rows_per_hour": round(3600 * len(problems) / chunk["seconds"], 1),
           "rows_per_hour_with_gates": round(3600 * len(problems) / total, 1),
           "gate_failures": sum(r["gate_failure"] is not None for r in got), "checks": [c["gate"] for c in mapper.checks]}
    emit(rec)
    return rec


def choice_stats_cost(device: torch.device | str, *, batches: Sequence[int], vocabs: Sequence[int],
                      dtype: torch.dtype = torch.bfloat16, repeats: int = 3, calls: int = 100) -> list[dict]:
    """What the engine step's choice statistics cost per step at a vocabulary size, apart from the model.

    The step's work after the LM head: each row's structural mask picked from a ``[6, vocab]`` table by its
    role, then :func:`kvreplay.engine.choice_stats` on ``[2B, vocab]`` logits (mask, argmax, top-2 margin,
    duplicate and finiteness flags). Random logits in ``dtype``, every token eligible. On CUDA the work is
    captured in a CUDA graph (as inside the step) and replayed ``calls`` times between CUDA events; on the CPU
    called ``calls`` times. Median of ``repeats``. It depends on rows and vocabulary only, so SmolLM2's (49,152)
    and Gemma 3's (262,144) are measured side by side without either model.

    Returns:
        per (B, vocab): ``{"path": "choice-stats", "B", "rows", "vocab", "dtype", "ms_per_step",
        "ms_per_problem_step", "calls", "note"}`` (milliseconds).
    """
    dev = torch.device(device)
    timer = _Timer(dev)
    out = []
    g = torch.Generator(device=dev).manual_seed(0)
    for B in batches:
        for vocab in vocabs:
            rows = 2 * B
            logits = torch.randn(rows, vocab, generator=g, device=dev).to(dtype)
            table = torch.ones(6, vocab, dtype=torch.bool, device=dev)
            role = torch.zeros(rows, dtype=torch.long, device=dev)

            def once() -> None:
                engine.choice_stats(logits, table[role])

            if dev.type == "cuda":
                side = torch.cuda.Stream(device=dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    for _ in range(3):
                        once()
                torch.cuda.current_stream(dev).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    once()
                call = graph.replay
            else:
                call = once

            def many() -> None:
                for _ in range(calls):
                    call()

            many()
            sec = statistics.median(timer(many) for _ in range(repeats)) / calls
            out.append({"path": "choice-stats", "B": B, "rows": rows, "vocab": vocab, "dtype": str(dtype).split(".")[-1],
                        "ms_per_step": round(1e3 * sec, 5), "ms_per_problem_step": round(1e3 * sec / B, 6),
                        "calls": calls, "note": "structural mask by role, then kvreplay.engine.choice_stats"
                        + (", one CUDA graph" if dev.type == "cuda" else "")})
    return out


def profile_step(lm, fmt, prefixes: Sequence[Sequence[int]], *, batch: int, attention: str = "flex",
                 max_len: int | None = None, step_path: str = "graph", steps: int = 20, rows: int = 15) -> str:
    """Where an engine step's time goes: a Markdown table of ``torch.profiler``'s top operations over ``steps`` steps.

    ``batch`` boundaries (``prefixes[:batch]``, prefill states) fill the slots; after three warm-up steps (the
    graph's capture, the kernels' compilation) ``steps`` steps are profiled, each followed by the host's staging
    of the next (the greedy token at the next position). Admission and the end-of-job checks are left out. On
    CUDA ops are ranked by their own device time (a replayed graph's kernels appear as the profiler sees them),
    on the CPU by their own CPU time.
    """
    from torch.profiler import ProfilerActivity, profile

    from ..decoding.contract import MERGE, PROMPT

    states = [build_prefill(lm, fmt, z) for z in prefixes[:batch]]
    length = max_len or max(len(z) for z in prefixes[:batch]) + steps + 4
    if attention == "flex":
        length = -(-length // engine.FLEX_BLOCK) * engine.FLEX_BLOCK
    eng = engine.StepEngine(lm, fmt, engine.EngineRun(step_path, batch, length, attention=attention))
    position = []
    with torch.inference_mode():
        for slot, b in enumerate(states):
            position.append(eng.admit(slot, b.cache, b.roles))
            eng.set_row_pair(slot, int(b.logits[0].argmax()), position[-1], MERGE, PROMPT)

        def advance() -> None:
            _, stats = eng.step()
            for slot in range(len(states)):
                position[slot] += 1
                eng.set_row_pair(slot, int(stats[0][2 * slot]), position[slot], MERGE, PROMPT)

        for _ in range(3):
            advance()
        cuda = lm.device.type == "cuda"
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            for _ in range(steps):
                advance()
            _sync(lm)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    averages = prof.key_averages()
    events = sorted(averages, key=lambda e: getattr(e, key, 0), reverse=True)[:rows]
    total = sum(getattr(e, key, 0) for e in averages) or 1
    lines = [f"| op | calls | self {'device' if cuda else 'CPU'} time per step (ms) | share |", "|---|---|---|---|"]
    for e in events:
        t = getattr(e, key, 0)
        lines.append(f"| `{e.key[:90]}` | {e.count} | {t / 1e3 / steps:.3f} | {100 * t / total:.1f}% |")
    return (f"Engine step profile: B = {batch}, attention `{attention}`, step path `{step_path}`, max_len {length}, "
            f"{steps} steps after 3 warm-up steps ({'CUDA' if cuda else 'CPU'}; the step and the host's staging "
            f"only).\n\n" + "\n".join(lines) + "\n")


def merge_records(path: str | Path, records: Sequence[dict]) -> list[dict]:
    """Write ``records`` into the JSON list at ``path``, replacing any with the same path, B, flags and attention.

    So one file collects the records of several processes (one per B, or per group of paths).
    """
    import json

    p = Path(path)
    old = json.loads(p.read_text()) if p.is_file() else []
    key = lambda r: (r.get("path"), r.get("B"), r.get("flags"), r.get("attention"), r.get("problems"))  # noqa: E731
    new = {key(r) for r in records}
    merged = [r for r in old if key(r) not in new] + list(records)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(merged, indent=1) + "\n")
    return merged
