"""A model's attention layout and the caches the protocol can audit (paper §3.1, Table 2).

Per decoder layer, full or sliding-window attention (:class:`AttentionLayout`); the refusal of models whose cache
the protocol cannot audit (:func:`cache_refusal`); the per-type masks the eager decoders pass
(:func:`layer_masks`). Re-exported by :mod:`kvreplay.model.models`.
"""

from __future__ import annotations

import dataclasses

import torch


class ModelLoadError(RuntimeError):
    """The requested model cannot be found, verified or loaded offline, or its cache cannot be audited."""


_CHUNKED_TYPES = ("chunked_attention",)
_RECURRENT_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "recurrent")
_KINDS = {"full_attention": "full", "sliding_attention": "sliding"}
_WORKS = ("Use a model whose every decoder layer is full or sliding-window attention with a plain key/value cache, "
          "e.g. a Llama, a Qwen2/Qwen2.5, a Mistral, a Gemma 2 or Gemma 3.")


def _layer_types(text) -> list[str]:
    """Per decoder layer, its ``transformers`` layer type (the config's ``layer_types``, else inferred as transformers does)."""
    layer_types = getattr(text, "layer_types", None)
    if layer_types is None:
        window = getattr(text, "sliding_window", None)
        chunk = getattr(text, "attention_chunk_size", None)
        kind = "sliding_attention" if window is not None else "chunked_attention" if chunk is not None else "full_attention"
        layer_types = [kind] * (getattr(text, "num_hidden_layers", None) or 0)
    return list(layer_types)


@dataclasses.dataclass(frozen=True)
class AttentionLayout:
    """Which attention each decoder layer computes, and how the decoders pass it the mask (paper §3.1 visibility).

    A ``sliding_attention`` layer's query at flat position p sees key k iff k is
    visible to the query's role (Table 2), k <= p and p - k < ``window``
    (``transformers``' ``sliding_window_overlay``); a ``full_attention`` layer
    drops the last condition. Every layer keeps a full-length cache (all |z|
    positions), so constructions compare element by element; the window is
    applied by the mask alone.

    Attributes:
        layer_types: per decoder layer, ``"full_attention"`` or ``"sliding_attention"``.
        window: the sliding window W in positions, or ``None`` when no layer slides.
        mask_by_type: pass the model a dict of 4-D masks keyed by layer type (mixed
            layers, e.g. Gemma 3); otherwise one 4-D mask serves every layer.
    """
    layer_types: tuple[str, ...]
    window: int | None
    mask_by_type: bool

    @property
    def windowed(self) -> bool:
        """True when at least one layer uses a sliding window."""
        return self.window is not None

    @property
    def windows(self) -> tuple[int | None, ...] | None:
        """Per layer its window (``None``: full attention), or ``None`` for a model without sliding layers."""
        if not self.windowed:
            return None
        return tuple(self.window if t == "sliding_attention" else None for t in self.layer_types)

    def kinds(self) -> list[str]:
        """Per layer ``"full"`` or ``"sliding"`` (the name drift rows and figures use)."""
        return [_KINDS[t] for t in self.layer_types]


def attention_layout(config) -> AttentionLayout:
    """The :class:`AttentionLayout` of a model config (its decoder text config).

    Raises:
        ModelLoadError: a layer type other than full or sliding-window attention (call :func:`cache_refusal` first
            for the reason in words).
    """
    text = config.get_text_config(decoder=True)
    types = tuple(_layer_types(text))
    odd = sorted(set(types) - set(_KINDS))
    if odd:
        raise ModelLoadError(f"layer types {odd} have no attention layout here ({cache_refusal(config)})")
    sliding = "sliding_attention" in types
    window = int(text.sliding_window) if sliding else None
    return AttentionLayout(types, window, mask_by_type=len(set(types)) > 1)


def kv_cache(config):
    """An empty ``DynamicCache`` for the model whose every layer keeps all positions (``[b, kv_heads, seq, head_dim]``).

    ``DynamicCache(config=...)`` gives a sliding layer a rolling
    ``DynamicSlidingWindowLayer`` that keeps only its last ``window - 1``
    positions. Here every layer is a plain ``DynamicLayer``, so live,
    incremental, prefill, replicas and transplants keep comparable full-length
    tensors and the window is applied by the mask (:class:`AttentionLayout`).
    For a model without sliding layers this is exactly ``DynamicCache(config=...)``.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=config)
    cache.layers = [DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer for layer in cache.layers]
    return cache


def cache_refusal(config) -> str | None:
    """Why this protocol cannot audit the KV cache of a model with this config, or ``None`` when it can.

    The protocol compares the caches of different constructions (live,
    incremental, prefill, replicas) element by element, layer by layer,
    so every decoder layer must keep one key and one value tensor
    ``[batch, kv_heads, seq, head_dim]`` per position. Full-attention and
    sliding-window layers do (the decoders keep all positions of a sliding
    layer and apply its window by the mask, :class:`AttentionLayout`). Refused:
    chunked attention, linear-attention / recurrent / hybrid layers, any other
    layer type, and any layer of ``DynamicCache(config=...)`` other than a
    ``DynamicLayer`` (or a ``DynamicSlidingWindowLayer`` for a sliding layer),
    or fewer cache layers than decoder layers (KV shared across layers).

    Args:
        config: the model's ``transformers`` config (its decoder text config is used).

    Returns:
        A sentence naming the offending setting and why it breaks the
        comparison, or ``None``.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    text = config.get_text_config(decoder=True)
    n_layers = getattr(text, "num_hidden_layers", None)
    layer_types = _layer_types(text)

    def where(kinds) -> str:
        idx = [i for i, t in enumerate(layer_types) if t in kinds]
        return f"layer{'s' if len(idx) > 1 else ''} {', '.join(map(str, idx))}"

    recurrent = [t for t in layer_types if t in _RECURRENT_TYPES]
    if recurrent:
        return (f"layer_types include {'/'.join(sorted(set(recurrent)))} ({where(_RECURRENT_TYPES)} of "
                f"{len(layer_types)}): a linear-attention / recurrent layer keeps a running state instead of per-token "
                f"keys and values, so there is no KV cache to compare element by element")
    if any(t in _CHUNKED_TYPES for t in layer_types):
        return (f"attention_chunk_size={getattr(text, 'attention_chunk_size', None)} ({where(_CHUNKED_TYPES)} of "
                f"{len(layer_types)} use chunked_attention): chunked attention has no mask here, so its layers' "
                f"visibility under the role table is not defined")
    other = sorted({t for t in layer_types if t not in _KINDS})
    if other:
        return (f"layer_types include {other} ({where(other)}): only full_attention and sliding_attention layers keep a "
                f"plain per-token KV cache this protocol can compare")
    if "sliding_attention" in layer_types and not isinstance(getattr(text, "sliding_window", None), int):
        return (f"{where(['sliding_attention'])} use sliding_attention but sliding_window is "
                f"{getattr(text, 'sliding_window', None)!r}, not a number of positions")
    try:
        cache = DynamicCache(config=config)
    except Exception as e:  # an exotic layer type transformers cannot even build a cache for
        return f"DynamicCache(config=...) cannot be built for it ({type(e).__name__}: {e})"
    allowed = {"full_attention": DynamicLayer, "sliding_attention": DynamicSlidingWindowLayer}
    odd = [(i, type(layer).__name__) for i, layer in enumerate(cache.layers)
           if i >= len(layer_types) or type(layer) is not allowed[layer_types[i]]]
    if odd:
        i, name = odd[0]
        return (f"DynamicCache(config=...) builds a {name} for layer {i} (and {len(odd) - 1} more), not a plain "
                f"key/value layer, so its cache cannot be compared element by element")
    if n_layers is not None and len(cache.layers) != n_layers:
        return (f"DynamicCache(config=...) holds {len(cache.layers)} cache layers for {n_layers} decoder layers "
                f"(keys and values shared across layers), so caches cannot be compared layer by layer")
    return None


def check_cache_auditable(model: torch.nn.Module, name: str) -> None:
    """Refuse, at load and before any row, a model whose KV cache this protocol cannot audit (see :func:`cache_refusal`).

    Args:
        model: the loaded ``transformers`` causal LM.
        name: how the user named the model (``model`` argument of :func:`load_model`).

    Raises:
        ModelLoadError: naming the model, the reason and what would work.
    """
    reason = cache_refusal(model.config)
    if reason is not None:
        raise ModelLoadError(f"model {name!r} ({type(model).__name__}) cannot be audited by this protocol: {reason}. "
                             f"{_WORKS}")


def layer_masks(layout: AttentionLayout, visible: torch.Tensor, query_index: torch.Tensor, key_index: torch.Tensor,
                sliding_visible: torch.Tensor | None = None) -> "torch.Tensor | dict[str, torch.Tensor]":
    """The ``attention_mask`` argument of one forward call: one 4-D mask, or a dict of them per layer type.

    Args:
        layout: the model's :class:`AttentionLayout`.
        visible: ``[batch, 1, q, k]`` bool, causal AND role visibility (full-attention layers).
        query_index, key_index: ``[q]`` and ``[k]`` int64 flat positions of the queries and keys.
        sliding_visible: the sliding layers' mask before the window (default ``visible``).

    Returns:
        ``visible`` itself for a model without sliding layers; for sliding layers the mask AND
        ``query - key < window``; a dict ``{layer type: mask}`` when ``layout.mask_by_type``.
    """
    if not layout.windowed:
        return visible
    base = visible if sliding_visible is None else sliding_visible
    near = (query_index.unsqueeze(1) - key_index.unsqueeze(0)) < layout.window  # [q, k]
    sliding = base & near
    if not layout.mask_by_type:
        return sliding
    return {"full_attention": visible, "sliding_attention": sliding}

def context_length(config) -> int | None:
    """Positions the model supports: ``max_position_embeddings`` of its decoder text config, or ``None`` if it has none."""
    value = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    return int(value) if value is not None else None
