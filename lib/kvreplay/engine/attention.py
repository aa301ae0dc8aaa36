"""The engine step's attention: the model's SDPA call, or grouped-query attention without repeated key/value heads.

:data:`ATTENTIONS` names the two; :func:`grouped_attention` is registered in transformers' ``AttentionInterface``
and :func:`use_attention` switches a model's attention layers to it for the length of one engine step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from transformers import AttentionInterface

ATTENTIONS = ("sdpa", "grouped")
"""How the step's attention runs. ``sdpa``: the model's own attention call, ``scaled_dot_product_attention``
under ``lm.sdpa_backends`` (transformers first repeats each key/value head for the query heads that share it);
``grouped``: :func:`grouped_attention` (the math backend's float32 arithmetic, one matmul per key/value head for
its group of query heads, nothing repeated). The two give different bits: the attention is part of the contract."""

_IGNORED = ("position_ids", "use_cache", "cache_position")  # keywords transformers' layers pass on, unused here
_GROUPED = "kvreplay_grouped"  # the name grouped_attention is registered under in transformers' AttentionInterface


def grouped_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """Grouped-query attention in float32 without repeating keys/values (the engine's ``attention="grouped"``).

    The arithmetic of torch's ``math`` SDPA backend (query and keys each multiplied by the square root of the
    scale in float32, after a cast from BF16 or FP16; masked scores set to ``-inf``, softmax over the keys, the
    weighted sum of the values cast back to the input dtype), but the query heads that share a key/value head
    are stacked into the rows of one matmul against that head's keys and values. The keys and values are
    still cast to float32 once per step (a float32 copy of each layer's cache), but never repeated: the
    ``sdpa`` path lets transformers copy every key/value head once per query head (SmolLM2-135M: 9 query
    heads on 3 key/value heads) and the math backend then casts and scales those copies, so each step moves
    several times more bytes of the static cache, which is what a decode step over a long static cache spends
    its time on. The matmul shapes differ, so the bits may differ from ``sdpa`` (and do on the CPUs and GPUs
    we ran): a different attention is a different contract.

    Called by transformers' attention layers (registered in ``AttentionInterface``); used only inside
    :class:`StepEngine` steps with ``attention="grouped"``.

    Args:
        query: ``[rows, heads, q, head_dim]`` in the model dtype.
        key, value: ``[rows, kv_heads, keys, head_dim]``; ``heads`` must be a multiple of ``kv_heads``
            (query head ``h`` reads key/value head ``h // (heads // kv_heads)``, as transformers' ``repeat_kv``).
        attention_mask: boolean ``[rows, 1, q, keys]`` (``True``: attend). A query row whose keys are all
            masked gets NaN (the math backend gives 0); in the engine every row sees at least its own key, and
            the ``nonfinite`` gate would stop a NaN.
        dropout: must be 0 (inference only).
        scaling: the score scale (default ``head_dim ** -0.5``).

    Returns:
        ``([rows, q, heads, head_dim] in the query's dtype, None)`` (the layout transformers' layers expect).

    Raises:
        ValueError: no mask, a mask that is not boolean ``[rows, 1, q, keys]``, dropout, heads not a multiple of
            kv_heads, or a keyword that would change the attention (``is_causal``, ``softcap``,
            ``sliding_window``, ...: only ``position_ids``, ``use_cache`` and ``cache_position`` are accepted
            and ignored, as the model's SDPA call ignores them).
    """
    rows, heads, q, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    if heads % kv_heads or dropout:
        raise ValueError(f"grouped_attention: {heads} heads on {kv_heads} key/value heads, dropout {dropout}")
    if attention_mask is None or attention_mask.dtype != torch.bool or tuple(attention_mask.shape) != (rows, 1, q, keys):
        got = None if attention_mask is None else f"{attention_mask.dtype} {tuple(attention_mask.shape)}"
        raise ValueError(f"grouped_attention takes an explicit boolean mask [{rows}, 1, {q}, {keys}], got {got}")
    unknown = sorted(k for k, v in kwargs.items() if k not in _IGNORED and v not in (None, False))
    if unknown:
        raise ValueError(f"grouped_attention does not compute {unknown}")
    group = heads // kv_heads
    root = math.sqrt(scaling if scaling is not None else dim ** -0.5)
    # not in place: for float32 inputs .float() returns the cache's own tensor
    scores = torch.matmul((query.float() * root).reshape(rows, kv_heads, group * q, dim),
                          (key.float() * root).transpose(-2, -1)).view(rows, kv_heads, group, q, keys)
    scores = scores.masked_fill(~attention_mask[:, :, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).view(rows, kv_heads, group * q, keys)
    out = torch.matmul(weights, value.float()).view(rows, heads, q, dim).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(_GROUPED, grouped_attention)


@contextlib.contextmanager
def use_attention(model: torch.nn.Module, attention: str) -> Iterator[None]:
    """Within the block the model's attention layers call :func:`grouped_attention` (``attention="grouped"``)."""
    if attention == "sdpa":
        yield
        return
    config = model.config
    was = config._attn_implementation
    config._attn_implementation = _GROUPED
    try:
        yield
    finally:
        config._attn_implementation = was

