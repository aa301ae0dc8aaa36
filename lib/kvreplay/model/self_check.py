"""The self-check that a loaded model obeys explicit 4-D masks and position IDs (paper §3.1, Table 3).

Run by :func:`kvreplay.model.models.load_model` on every model it loads; re-exported by :mod:`kvreplay.model.models`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .execution import sdpa_backend_list
from .layout import _WORKS, AttentionLayout, ModelLoadError, attention_layout, context_length, kv_cache, layer_masks


SELF_CHECK_TEXT = "The quick brown fox jumps over the lazy dog near the river bank."
SELF_CHECK_TOKENS = 8
"""Length of the self-check sequence (token IDs of :data:`SELF_CHECK_TEXT`, specials left out)."""
SELF_CHECK_HIDDEN = 2
"""Index of the token the self-check hides with the 4-D mask (inside the first, multi-token call)."""
SELF_CHECK_FIRST_CALL = 5
"""Tokens in the self-check's first call; each later token gets its own one-token cached call."""
SELF_CHECK_RATIO = 0.1
"""Pass when distance(hidden, removed) <= this fraction of distance(hidden, visible) (see :func:`self_check`)."""
SELF_CHECK_GAP = 64
"""Positions the self-check's *shifted* runs add to some position IDs."""


def _self_check_ids(tokenizer, vocab: int) -> list[int]:
    """:data:`SELF_CHECK_TOKENS` ordinary token IDs (no special token, below the embedding size ``vocab``)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = [t for t in tokenizer(SELF_CHECK_TEXT, add_special_tokens=False).input_ids if t not in special and t < vocab]
    if len(ids) < SELF_CHECK_TOKENS:  # an unusual tokenizer: spread fixed IDs over the vocabulary instead
        ids = [t for t in range(vocab // 3, vocab, max(1, vocab // 50)) if t not in special]
    if len(ids) < SELF_CHECK_TOKENS:
        raise ModelLoadError(f"self-check: the vocabulary of {vocab} entries has fewer than {SELF_CHECK_TOKENS} "
                             f"ordinary tokens")
    return ids[:SELF_CHECK_TOKENS]


def _self_check_run(model: torch.nn.Module, ids: list[int], positions: list[int], hidden: int | None,
                    first: int, backends: list, layout: AttentionLayout, index: list[int] | None = None,
                    hidden_in: str = "all") -> tuple[torch.Tensor, object]:
    """One self-check decode: a ``first``-token call, then one-token cached calls, as the decoders make them.

    Args:
        ids: token IDs of one row (batch 1), length n.
        positions: the position ID of each token (length n).
        hidden: index into ``ids`` of a token no later query may attend to
            (the 4-D mask hides it), or ``None``.
        first: tokens in the first call.
        layout: the model's attention layout (masks per layer type, window on ``index``).
        index: each token's index in the full self-check sequence (default ``0..n-1``; the
            *removed* run skips the hidden one), which the sliding window counts.
        hidden_in: ``"all"`` layers, or ``"sliding"`` layers only (full layers see the token).

    Returns:
        ``(logits [vocab] float32 of the last token, the DynamicCache)``.
    """
    from torch.nn.attention import sdpa_kernel

    dev = next(model.parameters()).device
    n = len(ids)
    causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()  # [query, key]
    masked = causal.clone()
    if hidden is not None:
        masked[hidden + 1 :, hidden] = False
    full, sliding = (causal, masked) if hidden_in == "sliding" else (masked, masked)
    idx = torch.tensor(index if index is not None else list(range(n)), device=dev)
    embeds = model.get_input_embeddings()(torch.tensor([ids], device=dev))  # [1, n, hidden], model dtype
    pos = torch.tensor([positions], dtype=torch.long, device=dev)
    cache = kv_cache(model.config)
    out = None
    for s, e in [(0, first)] + [(i, i + 1) for i in range(first, n)]:
        mask = layer_masks(layout, full[s:e, :e][None, None].contiguous(), idx[s:e], idx[:e],
                           sliding_visible=sliding[s:e, :e][None, None].contiguous())
        with sdpa_kernel(backends):
            out = model(inputs_embeds=embeds[:, s:e], attention_mask=mask, position_ids=pos[:, s:e],
                        past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float(), cache


def self_check(lm: Any) -> dict:
    """Prove on a few tokens that the model honours the explicit 4-D mask and position IDs it is given.

    Five short decodes, each a multi-token first call followed by one-token
    cached calls, as the decoders make them. The calls pass ``inputs_embeds``, a bool 4-D ``attention_mask
    [1, 1, q, k]`` (a dict of them per layer type for a model mixing
    sliding-window and full layers), explicit ``position_ids [1, q]``, a
    full-length cache (:func:`kv_cache`) and ``use_cache=True``. They run
    under the loaded model's SDPA backends, dtype and device. With n =
    :data:`SELF_CHECK_TOKENS` tokens, j = :data:`SELF_CHECK_HIDDEN` and a
    position gap g (:data:`SELF_CHECK_GAP`, less if the context is shorter):

    * **hidden**: positions 0..n-1, token j hidden by the mask from every later query;
    * **removed**: the same tokens without token j, at their original
      positions (the position IDs skip j);
    * **visible**: as *hidden*, with token j visible (plain causal mask);
    * **shifted_steps**: as *hidden*, the position IDs of the one-token calls moved g later;
    * **shifted**: as *hidden*, every position ID after j moved g later (so it
      differs from *shifted_steps* only inside the multi-token call).

    A model that mixes layer types gets a sixth, **sliding_hidden**: token j
    hidden from the sliding layers only. Each layer type reading its own mask
    makes it differ from both *hidden* and *visible*.

    A model that honours the mask gives *hidden* and *removed* the same last
    logits up to rounding and *visible* different ones; one that ignores the
    mask gives *visible* = *hidden*. A model that ignores the position IDs of
    the one-token calls gives *shifted_steps* = *hidden*, one that ignores them
    in the multi-token call gives *shifted* = *shifted_steps* (the same
    computation, so the distance is exactly 0). Let ``d`` be the max absolute
    difference of the last logits in float32. The check passes when
    ``d(hidden, visible) > 0``, ``d(hidden, removed) <= SELF_CHECK_RATIO *
    d(hidden, visible)``, ``d(hidden, shifted_steps) > 0``,
    ``d(shifted, shifted_steps) > 0`` and, for mixed layers, both
    ``sliding_hidden`` distances > 0. No threshold depends on the dtype. The
    *hidden* cache must also hold plain ``keys``/``values``
    ``[1, kv_heads, n, head_dim]`` in every layer.

    Args:
        lm: the loaded model (its role table is not used: the check concerns
            attention and positions, not roles).

    Returns:
        JSON-serializable dict: ``passed`` (True), ``hidden_vs_removed``,
        ``hidden_vs_visible``, ``hidden_vs_shifted_steps``,
        ``shifted_vs_shifted_steps`` (float, logit units; mixed layers add
        ``sliding_hidden_vs_hidden``, ``sliding_hidden_vs_visible``, and a windowed
        model ``window`` and ``layer_types``), ``threshold``, ``tokens``,
        ``hidden_index``, ``gap``, ``schedule`` (tokens per call), ``dtype``, ``sdpa_backends``.

    Raises:
        ModelLoadError: the model ignores the explicit mask or position IDs
            (or its cache is not plain keys/values, or it refuses per-layer-type
            masks), naming the model, the distances and the ``transformers`` / ``torch`` versions.
    """
    import transformers
    from transformers.cache_utils import DynamicLayer

    model = lm.model
    layout = attention_layout(model.config)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = _self_check_ids(lm.tokenizer, vocab)
    n, j, first = len(ids), SELF_CHECK_HIDDEN, SELF_CHECK_FIRST_CALL
    context = context_length(model.config)
    gap = max(1, min(SELF_CHECK_GAP, context - n)) if context else SELF_CHECK_GAP
    backends = sdpa_backend_list(tuple(lm.sdpa_backends))
    name = lm.identity.get("model", type(model).__name__)
    keep = [i for i in range(n) if i != j]
    try:
        with torch.inference_mode():
            run = functools.partial(_self_check_run, model, first=first, backends=backends, layout=layout)
            hidden, cache = run(ids, list(range(n)), j)
            removed, _ = run([ids[i] for i in keep], keep, None, first=first - 1, index=keep)
            visible, _ = run(ids, list(range(n)), None)
            steps, _ = run(ids, [i + gap * (i >= first) for i in range(n)], j)
            shifted, _ = run(ids, [i + gap * (i > j) for i in range(n)], j)
            d = {"hidden_vs_removed": hidden - removed, "hidden_vs_visible": hidden - visible,
                 "hidden_vs_shifted_steps": hidden - steps, "shifted_vs_shifted_steps": shifted - steps}
            if layout.mask_by_type:
                only, _ = run(ids, list(range(n)), j, hidden_in="sliding")
                d |= {"sliding_hidden_vs_hidden": only - hidden, "sliding_hidden_vs_visible": only - visible}
            d = {k: float(v.abs().max()) for k, v in d.items()}
    except (TypeError, KeyError, AttributeError) as e:  # e.g. a model that cannot take a dict of masks per layer type
        how = "a dict of 4-D masks per layer type" if layout.mask_by_type else "an explicit 4-D mask"
        raise ModelLoadError(
            f"model {name!r} failed the load self-check: its forward call with {how} raised {type(e).__name__}: {e}. "
            f"With transformers {transformers.__version__}, torch {torch.__version__}, this protocol cannot audit this "
            f"model: every decoder call relies on the explicit masks and position IDs. {_WORKS}") from e
    for i, layer in enumerate(cache.layers):
        keys = getattr(layer, "keys", None)
        if type(layer) is not DynamicLayer or not isinstance(keys, torch.Tensor) or keys.shape[-2] != n:
            shape = tuple(keys.shape) if isinstance(keys, torch.Tensor) else None
            raise ModelLoadError(
                f"model {name!r} failed the load self-check: after {n} tokens, cache layer {i} is a "
                f"{type(layer).__name__} with keys of shape {shape}, not a plain key/value layer holding all {n} "
                f"positions; this protocol cannot audit its KV cache. {_WORKS}")
    faults = [  # comparisons are False for NaN distances, so NaN logits fail too
        ("hiding a token with the mask changed nothing", not d["hidden_vs_visible"] > 0),
        ("hiding a token with the mask does not match removing it at the same position IDs",
         d["hidden_vs_visible"] > 0 and not d["hidden_vs_removed"] <= SELF_CHECK_RATIO * d["hidden_vs_visible"]),
        ("moving the position IDs of the one-token calls changed nothing", not d["hidden_vs_shifted_steps"] > 0),
        ("moving the position IDs inside the multi-token call changed nothing", not d["shifted_vs_shifted_steps"] > 0),
    ]
    if layout.mask_by_type:
        faults += [
            ("hiding a token from the sliding layers only gave the logits of hiding it from every layer "
             "(the full-attention layers read the sliding layers' mask)", not d["sliding_hidden_vs_hidden"] > 0),
            ("hiding a token from the sliding layers only changed nothing (the sliding layers read the "
             "full-attention layers' mask)", not d["sliding_hidden_vs_visible"] > 0),
        ]
    faults = [what for what, bad in faults if bad]
    if faults:
        measured = ", ".join(f"{k.replace('_vs_', ' vs ').replace('_', ' ')} = {v:.4g}" for k, v in d.items())
        raise ModelLoadError(
            f"model {name!r} failed the load self-check: the model ignores the explicit attention mask or position "
            f"IDs it is given ({'; '.join(faults)}). Hiding token {j} of {n} with the 4-D mask should give the same "
            f"last logits as removing it and skipping its position ID, different ones from leaving it visible, and "
            f"moving position IDs {gap} later should change them; measured max |logit difference|: {measured} (a "
            f"pass needs hidden vs removed <= {SELF_CHECK_RATIO} x hidden vs visible, and the others > 0). With "
            f"transformers {transformers.__version__}, torch {torch.__version__}, attention implementation "
            f"{getattr(model.config, '_attn_implementation', None)!r} and SDPA backends {list(lm.sdpa_backends)}, "
            f"this protocol cannot audit this model: every decoder call relies on the explicit 4-D mask and "
            f"position IDs.")
    out = {
        "passed": True, **d, "threshold": SELF_CHECK_RATIO, "tokens": n, "hidden_index": j, "gap": gap,
        "schedule": [first] + [1] * (n - first), "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "sdpa_backends": list(lm.sdpa_backends),
    }
    if layout.windowed:
        out |= {"window": layout.window, "layer_types": layout.kinds()}
    return out
