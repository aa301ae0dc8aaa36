"""The engine's static KV cache: keys and values of every row at a write position of its own.

:class:`RowCache` (a transformers ``Cache``) holds one :class:`RowLayer` per decoder layer; a one-token step
writes each row's keys/values at that row's position (``write_pos``), so problems of different lengths share
one batch. Positions beyond a row's length stay zero padding, hidden by the step's mask.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from ..model.models import LoadedModel, kv_cache


@contextlib.contextmanager
def _unique_index_writes():
    """Within the block, CUDA ``scatter_`` uses its plain kernel even under deterministic algorithms.

    The deterministic variant sorts the indices so that duplicates are written in a fixed order. The
    engine's writes have one index per (row, head, feature), so both kernels write the same values to the
    same places, and the plain one skips a sort per layer and step. On CPU nothing changes.
    """
    was = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    if was:
        torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        if was:
            torch.use_deterministic_algorithms(True, warn_only=warn_only)


class RowLayer(CacheLayerMixin):
    """One layer of :class:`RowCache`: static keys/values written at a position per row.

    Attributes:
        keys, values: ``[rows, kv_heads, max_len, head_dim]`` in the model dtype.
    """
    is_compileable = False
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor):
        super().__init__()
        self.keys, self.values = keys, values
        self._index = index  # [rows, kv_heads, 1, head_dim] int64 view of the rows' write positions
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the buffers are allocated up front."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write one new token per row at that row's position; return the full static buffers.

        Args:
            key_states, value_states: ``[rows, kv_heads, 1, head_dim]`` of this step.

        Returns:
            ``(keys, values)``, each ``[rows, kv_heads, max_len, head_dim]``; positions a
            row has not reached are padding, hidden by the caller's mask.

        Raises:
            ValueError: if more than one token per row is given.
        """
        if key_states.shape[-2] != 1:
            raise ValueError(f"RowCache takes one token per row and step, got {key_states.shape[-2]}")
        with _unique_index_writes():
            self.keys.scatter_(2, self._index, key_states)
            self.values.scatter_(2, self._index, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2], 0

    def get_seq_length(self) -> int:
        """The static length ``max_len`` (rows' own lengths live in the engine, not here)."""
        return self.keys.shape[-2]

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


class RowCache(Cache):
    """Static KV cache with a write position per row (a ``transformers`` ``Cache``).

    ``transformers`` 5.17 calls ``cache.update(key, value, layer_idx)`` with no
    position, so the positions the next update writes at are held here, in
    :attr:`write_pos`, which the caller fills in place before each forward call.
    The model must be given an explicit 4-D mask ``[rows, 1, 1, max_len]``
    (``create_causal_mask`` returns a 4-D mask unchanged), which hides every
    position a row has not reached.

    Args:
        layers: number of decoder layers.
        rows: physical batch rows.
        kv_heads, head_dim: key/value heads and head size of the model.
        max_len: positions per row.
        dtype, device: of the buffers (the model's).

    Attributes:
        layers: :class:`RowLayer` per decoder layer, ``keys``/``values``
            ``[rows, kv_heads, max_len, head_dim]``, zero where never written.
        write_pos: ``[rows]`` int64, the position each row's next token is written at.
    """
    def __init__(self, layers: int, rows: int, kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str, write_pos: torch.Tensor | None = None):
        self.write_pos = torch.zeros(rows, dtype=torch.long, device=device) if write_pos is None else write_pos
        if tuple(self.write_pos.shape) != (rows,):
            raise ValueError(f"write_pos must have shape ({rows},), got {tuple(self.write_pos.shape)}")
        index = self.write_pos.view(rows, 1, 1, 1).expand(rows, kv_heads, 1, head_dim)
        shape = (rows, kv_heads, max_len, head_dim)
        super().__init__(layers=[
            RowLayer(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                     index)
            for _ in range(layers)
        ])
        self.rows, self.kv_heads, self.head_dim, self.max_len = rows, kv_heads, head_dim, max_len

    @classmethod
    def for_model(cls, lm: LoadedModel, rows: int, max_len: int, write_pos: torch.Tensor | None = None) -> "RowCache":
        """A zeroed cache shaped for ``lm`` (layers, KV heads and head size read from its config)."""
        cfg = lm.model.config
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(cfg.num_hidden_layers, rows, kv_heads, head_dim, max_len, lm.dtype, lm.device, write_pos)

    def load_rows(self, first: int, source: DynamicCache) -> int:
        """Clear rows ``first, first + 1`` and copy a duplicate pair's cache into positions ``0..n-1``.

        Args:
            first: the pair's first row (even).
            source: cache whose layers hold ``[2, kv_heads, n, head_dim]`` in this cache's dtype.

        Returns:
            ``n``, the number of positions copied.

        Raises:
            ValueError: layer count, geometry or dtype differ, or ``n > max_len``.
        """
        if len(source.layers) != len(self.layers):
            raise ValueError(f"source cache has {len(source.layers)} layers, the engine's model {len(self.layers)}")
        n = source.layers[0].keys.shape[-2]
        if n > self.max_len:
            raise ValueError(f"a cache of {n} positions does not fit max_len={self.max_len}")
        for i, (dst, src) in enumerate(zip(self.layers, source.layers)):
            for name, d, s in (("keys", dst.keys, src.keys), ("values", dst.values, src.values)):
                want = (2, self.kv_heads, n, self.head_dim)
                if tuple(s.shape) != want or s.dtype != d.dtype:
                    raise ValueError(f"layer {i} {name}: got {tuple(s.shape)} {s.dtype}, expected {want} {d.dtype}")
                d[first : first + 2].zero_()
                d[first : first + 2, :, :n].copy_(s)
        return n

    def to_dynamic(self, first: int, n: int, config) -> DynamicCache:
        """A ``DynamicCache`` of copies of rows ``first, first + 1``, positions ``0..n-1``.

        Every layer keeps all ``n`` positions, a sliding-window layer's too (:func:`kvreplay.model.models.kv_cache`),
        as the eager decoders' caches do.

        Returns:
            a cache whose layers hold ``[2, kv_heads, n, head_dim]`` in the model dtype.
        """
        out = kv_cache(config)
        for i, layer in enumerate(self.layers):
            out.update(layer.keys[first : first + 2, :, :n].clone(), layer.values[first : first + 2, :, :n].clone(), i)
        return out

