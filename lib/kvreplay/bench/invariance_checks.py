"""The invariant-kernel contract's checks: constructions agree bit for bit, and a row is the same alone or in a batch.

:func:`construction_check` builds one problem's boundary live, incrementally and by prefill and compares the
caches on every layer and the boundary logits bit for bit (under ``kernels: invariant`` all three must coincide).
:func:`batch_check` runs a row alone (B = 1) and inside batches of other sizes beside other sequences of other
lengths, in another slot, and compares its logits at every position and its cache on every layer bit for bit.
:func:`engine_check` does the same through the batched engine. It compares a problem's live boundary and suffix
from the eager decoders, from the engine alone (B = 1), and from the engine beside other problems of other lengths
in another slot, bit for bit. All three report; the tests, the attribution control (:mod:`kvreplay.experiments.kernel_ablation`) and
``python -m kvreplay.bench invariance`` (:mod:`kvreplay.bench.invariance`) decide what to do with the report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch.nn.attention import sdpa_kernel

from ..decoding import caches, decode
from ..model import kernels
from ..decoding.contract import BlockFormat, Caps
from ..decoding.settings import Decoding
from ..analysis.drift import aggregate, cache_drift
from ..engine import EngineRun, decode_lives, decode_suffixes
from ..model.execution import sdpa_backend_list
from ..gates import cache_tensors
from ..model.models import LoadedModel, kv_cache


def _differing_layers(a, b) -> list[str]:
    """Names of the cache tensors (``L00.key`` ...) that are not bit-identical, for equal inventories."""
    return [n for (n, x), (_, y) in zip(cache_tensors(a), cache_tensors(b)) if not torch.equal(x, y)]


def construction_check(lm: LoadedModel, fmt: BlockFormat, prompt: Sequence[int], caps: Caps) -> dict:
    """Live, incremental and prefill boundaries of one prompt under ``lm``'s kernels, compared bit for bit.

    Returns:
        ``{"boundary": |z|, "live_vs_incremental": [...], "live_vs_prefill": [...], "logits_live_vs_prefill":
        bool, "logits_live_vs_incremental": bool, "rel_l2_prefill_vs_live": float, "boundaries": (live,
        incremental, prefill)}``. The lists name every cache tensor that differs (empty: bit-identical on every
        layer). The relative L2 is over all K and V tensors concatenated (:func:`kvreplay.analysis.drift.aggregate`).
    """
    live = decode.decode_live(lm, fmt, prompt, caps)
    inc = decode.build_incremental(lm, fmt, live.ids)
    pre = decode.build_prefill(lm, fmt, live.ids)
    drift = aggregate(cache_drift(cache_tensors(live.cache), cache_tensors(pre.cache)))
    return {
        "boundary": len(live.ids),
        "live_vs_incremental": _differing_layers(live.cache, inc.cache),
        "live_vs_prefill": _differing_layers(live.cache, pre.cache),
        "logits_live_vs_incremental": bool(torch.equal(live.logits, inc.logits)),
        "logits_live_vs_prefill": bool(torch.equal(live.logits, pre.logits)),
        "rel_l2_prefill_vs_live": float(drift["rel_l2"]),
        "boundaries": (live, inc, pre),
    }


@torch.inference_mode()
def batch_logits(lm: LoadedModel, rows: Sequence[Sequence[int]]) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """One forward call over ``rows`` (token IDs, any lengths) right-padded into one batch, under ``lm``'s kernels.

    Each row sees its own keys causally (the explicit 4-D bool mask hides padding; a padding query sees its
    row's keys), positions count from 0.

    Returns:
        ``(logits, caches)``: per row its logits ``[len, vocab]`` and per layer its keys and values
        ``[kv_heads, len, head_dim]`` (key, value alternating, the order of :func:`kvreplay.gates.cache_tensors`),
        all cut to the row's own length.
    """
    dev = lm.device
    n = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long, device=dev)
    lengths = torch.tensor([len(r) for r in rows], device=dev)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(list(r), device=dev)
    index = torch.arange(n, device=dev)
    mask = (index[None, None, :] <= index[None, :, None]) & (index[None, None, :] < lengths[:, None, None])
    positions = index.expand(len(rows), n)
    cache = kv_cache(lm.model.config)
    with sdpa_kernel(sdpa_backend_list(lm.sdpa_backends)), kernels.installed(lm.model, decode.kernels_of(lm)):
        out = lm.model(input_ids=ids, attention_mask=mask[:, None], position_ids=positions, past_key_values=cache,
                       use_cache=True)
    tensors = [t for _, t in cache_tensors(cache)]
    logits = [out.logits[i, : len(r)] for i, r in enumerate(rows)]
    return logits, [[t[i, :, : len(r)] for t in tensors] for i, r in enumerate(rows)]


def batch_check(lm: LoadedModel, target: Sequence[int], companions: Sequence[Sequence[int]],
                sizes: Sequence[int] = (2, 7)) -> dict:
    """``target`` alone (B = 1) against ``target`` inside batches of ``sizes`` rows, in the last slot, beside
    ``companions`` (cycled; other tokens, other lengths).

    Returns:
        ``{B: {"logits_equal": bool, "cache_differs": [tensor names]}}`` per batch size: bit-for-bit equality
        of the target's logits at every position and of its cache tensors over its own positions.
    """
    alone_logits, alone_cache = batch_logits(lm, [target])
    names = [f"L{i // 2:02d}.{('key', 'value')[i % 2]}" for i in range(len(alone_cache[0]))]
    out: dict = {}
    for b in sizes:
        rows = [companions[i % len(companions)] for i in range(b - 1)] + [target]
        logits, caches = batch_logits(lm, rows)
        differs = [i for i, (x, y) in enumerate(zip(alone_cache[0], caches[-1])) if not torch.equal(x, y)]
        out[b] = {"logits_equal": bool(torch.equal(alone_logits[0], logits[-1])),
                  "cache_differs": [names[i] for i in differs]}
    return out


def _boundary_differs(a: decode.Boundary, b: decode.Boundary) -> list[str]:
    """What differs between two boundaries: ``ids``, ``logits`` and the cache tensors (``L00.key`` ...)."""
    if a.ids != b.ids:
        return ["ids"]
    return (["logits"] if not torch.equal(a.logits, b.logits) else []) + _differing_layers(a.cache, b.cache)


def _suffix_differs(a: decode.Suffix, b: decode.Suffix) -> list[str]:
    """What differs between two suffixes: ``suffix.tokens``, ``suffix.margins``, ``suffix.tops`` (exact floats)."""
    return [f"suffix.{n}" for n in ("tokens", "margins", "tops") if getattr(a, n) != getattr(b, n)]


def engine_check(lm: LoadedModel, fmt: BlockFormat, prompt: Sequence[int], companions: Sequence[Sequence[int]],
                 decoding: "Decoding | Caps", run: EngineRun, sizes: Sequence[int] = (2, 7)) -> dict:
    """One problem's live boundary and suffix under ``lm``'s kernels: the eager decoders against the batched engine.

    The engine (:mod:`kvreplay.engine`, eager step, ``sdpa`` attention) decodes ``prompt`` alone (B = 1), then
    beside ``companions`` (prompts of other lengths, cycled) in batches of ``sizes`` problems. It fills its slots
    from the last, so ``prompt``, submitted last, sits in slot 0 there and in another slot than its companions'
    order would give. Each engine's ``max_len`` is what its longest problem needs, so it differs between the runs.
    ``decoding`` (caps alone: the default tie rule) is every decoder's; the engine also records top-1 logits.
    ``run`` gives the engine's other settings (step path, attention); its ``batch``, ``max_len`` and ``fill_from``
    are set here.

    Returns:
        ``{"eager_vs_alone": [...], B: [...] per size}``: what differs bit for bit between the eager decoders' row
        and the engine's row alone, and between the row alone and the row in the batch of ``B`` (empty: identical).
        Names: ``ids``, ``logits`` (boundary logits ``[2, vocab]``), the cache
        tensors ``L00.key`` ... on every layer, ``suffix.tokens``, ``suffix.margins``, ``suffix.tops``.

    Raises:
        ContractError: an engine setting the kernels contract does not cover (:mod:`kvreplay.engine.invariant`).
        GateError: a gate of the decoders.
    """
    live = decode.decode_live(lm, fmt, prompt, decoding)
    eager = decode.decode_suffix(lm, fmt, caches.live_replica(live), decoding)
    tops = dataclasses.replace(Decoding.given(decoding), top_logits=True)

    def engine_row(problems: Sequence[Sequence[int]], batch: int) -> tuple[decode.Boundary, decode.Suffix]:
        this = dataclasses.replace(run, batch=batch, max_len=None, fill_from="last")
        boundaries = decode_lives(lm, fmt, problems, tops, this)
        return boundaries[-1], decode_suffixes(lm, fmt, boundaries, tops, this)[-1]

    alone = engine_row([prompt], 1)
    out: dict = {"eager_vs_alone": _boundary_differs(live, alone[0]) + _suffix_differs(eager, alone[1])}
    for b in sizes:
        rows = [companions[i % len(companions)] for i in range(b - 1)] + [list(prompt)]
        boundary, suffix = engine_row(rows, b)
        out[b] = _boundary_differs(alone[0], boundary) + _suffix_differs(alone[1], suffix)
    return out
