"""Batched decode engine: many problems per forward call, one-token step replayable as a CUDA graph.

The decoders of :mod:`kvreplay.decode` run one problem as a physical batch of
two duplicate rows, one forward call per token, through a ``DynamicCache``.
This module runs ``B`` problems at once: the batch holds ``2B`` rows (problem
in slot ``s`` owns rows ``2s`` and ``2s + 1``), every row has its own write
position in a static KV cache (:class:`RowCache`), and one batched one-token
step (:class:`StepEngine`) advances every problem by one token. Everything the
step reads lives in static buffers that are updated in place, so on CUDA the
step is captured once in a ``torch.cuda.CUDAGraph`` and replayed
(``step_path="graph"``); ``step_path="eager"`` runs the same code directly.

What stays as in :mod:`kvreplay.decode`:

* prompt blocks and prefills are one forward call per problem (its two
  duplicates) through :func:`kvreplay.decode.forward` and a ``DynamicCache``;
  the resulting keys/values are copied into the problem's rows;
* every step passes an explicit boolean 4-D mask (causal AND role visibility
  of Table 2, via :func:`kvreplay.contract.visibility_matrix`), explicit
  position IDs counting from 0, and input embeddings plus the role-embedding
  rows of ``lm.role_table`` when it is set;
* the block state machine, structural logits mask, forced delimiters and caps
  are those of :class:`kvreplay.decode.BlockCursor`; greedy choice is the
  argmax over eligible tokens (an exact tie goes to the lowest token ID), the
  margin is top-1 minus top-2 eligible logit (float32);
* the duplicate rows of every problem must agree bit for bit after every
  step (gate ``desync``), and logits must be finite (gate ``nonfinite``).

What differs: keys beyond a row's length are zero padding hidden by the mask,
and the key dimension of every attention call is the cache's ``max_len``.
Results are reproducible bit for bit for a given *batch shape* (rows,
``max_len``), dtype and device, whatever the companions of a problem and its
slot; across batch shapes, and against the ``DynamicCache`` decoders, the bits
may differ (the kernels' reduction order depends on the shapes), so the step
path and batch shape belong in any key that records results.

Host synchronisation: one device-to-host read per step (chosen tokens,
margins, duplicate and finiteness flags of every row together), plus one per
problem admitted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.nn.attention import sdpa_kernel
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from . import decode
from .contract import (
    ANSWER,
    BRANCH1,
    MERGE,
    PROMPT,
    ROLE_OFFSET,
    BlockFormat,
    Caps,
    ContractError,
    visibility_matrix,
)
from .decode import BlockCursor, Boundary, Suffix
from .gates import GateError
from .models import LoadedModel

STEP_PATHS = ("eager", "graph")
"""``eager``: the step runs op by op; ``graph``: captured once in a CUDA graph and replayed (CUDA only)."""

ATTENTIONS = ("sdpa", "grouped")
"""How the step's attention runs. ``sdpa``: the model's own attention call, ``scaled_dot_product_attention``
under ``lm.sdpa_backends`` (transformers first repeats each key/value head for the query heads that share it);
``grouped``: :func:`grouped_attention` (the math backend's float32 arithmetic, one matmul per key/value head for
its group of query heads, nothing repeated). The two give different bits: the attention is part of the contract."""

_GROUPED = "kvreplay_grouped"  # the name grouped_attention is registered under in transformers' AttentionInterface

_STAT_ROWS = 4  # chosen token, margin, duplicate rows equal, row finite

VERIFIED_STEPS = [0]
"""Steps this process has checked against the eager step (``verify_steps``), all engines together."""


# --------------------------------------------------------------------------------------------------- attention
def grouped_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """Grouped-query attention in float32 without repeating keys/values (the engine's ``attention="grouped"``).

    The arithmetic of torch's ``math`` SDPA backend for half-precision inputs (query and keys each multiplied
    by the square root of the scale after the cast to float32, masked scores set to ``-inf``, softmax over the
    keys, the weighted sum of the values cast back to the input dtype), but the query heads that share a
    key/value head are stacked into the rows of one matmul against that head's keys and values. The ``sdpa``
    path lets transformers copy every key/value head once per query head and the math backend cast those
    copies to float32: with SmolLM2-135M's 9 query heads on 3 key/value heads, that reads the whole static
    cache about four times more per step, which is what a decode step over a long static cache spends
    its time on. The matmul shapes differ, so the bits may differ from ``sdpa`` (and do on the CPUs and GPUs
    we ran): a different attention is a different contract.

    Called by transformers' attention layers (registered in ``AttentionInterface``); used only inside
    :class:`StepEngine` steps with ``attention="grouped"``.

    Args:
        query: ``[rows, heads, q, head_dim]`` in the model dtype.
        key, value: ``[rows, kv_heads, keys, head_dim]``; ``heads`` must be a multiple of ``kv_heads``
            (query head ``h`` reads key/value head ``h // (heads // kv_heads)``, as transformers' ``repeat_kv``).
        attention_mask: boolean ``[rows, 1, q, keys]`` (``True``: attend) or ``None``.
        dropout: must be 0 (inference only).
        scaling: the score scale (default ``head_dim ** -0.5``).

    Returns:
        ``([rows, q, heads, head_dim] in the query's dtype, None)`` (the layout transformers' layers expect).

    Raises:
        ValueError: a float mask, dropout, or heads not a multiple of kv_heads.
    """
    rows, heads, q, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    if heads % kv_heads or dropout:
        raise ValueError(f"grouped_attention: {heads} heads on {kv_heads} key/value heads, dropout {dropout}")
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise ValueError(f"grouped_attention takes a boolean mask, got {attention_mask.dtype}")
    group = heads // kv_heads
    root = math.sqrt(scaling if scaling is not None else dim ** -0.5)
    scores = torch.matmul((query.float() * root).reshape(rows, kv_heads, group * q, dim),
                          (key.float() * root).transpose(-2, -1)).view(rows, kv_heads, group, q, keys)
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask[:, :, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).view(rows, kv_heads, group * q, keys)
    out = torch.matmul(weights, value.float()).view(rows, heads, q, dim).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(_GROUPED, grouped_attention)


@contextlib.contextmanager
def _attention(model: torch.nn.Module, attention: str) -> Iterator[None]:
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


# ---------------------------------------------------------------------------------------------------- KV cache
@contextlib.contextmanager
def _unique_index_writes():
    """Within the block, CUDA ``scatter_`` uses its plain kernel even under deterministic algorithms.

    The deterministic variant sorts the indices so that duplicates are written in a fixed order; the
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

        Returns:
            a cache whose layers hold ``[2, kv_heads, n, head_dim]`` in the model dtype.
        """
        out = DynamicCache(config=config)
        for i, layer in enumerate(self.layers):
            out.update(layer.keys[first : first + 2, :, :n].clone(), layer.values[first : first + 2, :, :n].clone(), i)
        return out


# ------------------------------------------------------------------------------------------------- the step
def choice_stats(logits: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """Greedy choice, margin and integrity flags of every row, computed on the device.

    Args:
        logits: ``[rows, vocab]`` next-token logits (model dtype), rows in duplicate pairs ``(2s, 2s + 1)``.
        eligible: ``[rows, vocab]`` bool structural mask (true = may be chosen).

    Returns:
        ``[4, rows]`` float32: the chosen token (argmax of the eligible logits in
        float32, the lowest ID on an exact tie; exact for vocabularies below
        2**24), the margin top-1 minus top-2 eligible logit (float32 units of the
        logits), 1.0 where the row's duplicate pair is bit-identical (as
        ``torch.equal``; NaN never is), 1.0 where every logit of the row is finite.
    """
    rows, vocab = logits.shape
    masked = logits.float().masked_fill(~eligible, float("-inf"))
    idx = masked.argmax(-1)
    top1 = masked.gather(1, idx[:, None]).squeeze(1)
    with _unique_index_writes():  # one index per row
        top2 = masked.scatter(1, idx[:, None], float("-inf")).amax(-1)
    pair = logits.reshape(rows // 2, 2, vocab)
    same = (pair[:, 0] == pair[:, 1]).all(-1)
    same = same[:, None].expand(rows // 2, 2).reshape(rows)
    finite = torch.isfinite(logits).all(-1)
    return torch.stack([idx.float(), top1 - top2, same.float(), finite.float()])


class StepEngine:
    """Static buffers and the batched one-token step of ``rows = 2 * batch`` rows.

    Per row the step reads, from device buffers updated in place: the input
    token, its position, its raw role (query role), and the raw role of the
    block the *next* token is chosen in (its structural mask); the raw roles
    of every earlier position of the row live in :attr:`roles`. It writes the
    new token's role and keys/values at the row's position, builds the row's
    mask (role visibility AND ``k <= position``), runs the model, and leaves
    ``[rows, vocab]`` logits and :func:`choice_stats` in output buffers.

    Args:
        lm: the loaded model (its ``sdpa_backends`` are used in every step).
        fmt: block format (structural masks per role).
        batch: problems per step ``B`` (``2B`` rows).
        max_len: positions per row (the cache's key dimension).
        step_path: ``"eager"`` or ``"graph"`` (CUDA only; captured at the first step).
        verify_steps: the first ``verify_steps`` steps are each computed a second
            time by the eager step on the same inputs, and the two must agree bit
            for bit in every row's logits, choice statistics and the keys/values
            written (gate ``graph_equals_eager``; on the graph path this checks the
            replayed graph against the op-by-op step). The step is idempotent for
            fixed inputs, so a passing check changes no bit of the run.
        readout: a :class:`kvreplay.decode.FP32Readout`: the body runs in the model
            dtype and writes the same keys/values, the final norm and LM head run in
            float32 (``[rows, vocab]`` float32 logits; the exploratory control of
            Experiment 2). ``None``: the model's own head.
        attention: ``"sdpa"`` or ``"grouped"`` (:data:`ATTENTIONS`): the step's attention (prompt blocks and
            prefills, one call per problem outside the step, always use the model's own SDPA).

    Raises:
        ValueError: unknown step path or attention, ``graph`` off CUDA, ``batch < 1``, ``max_len < 1`` or
            ``verify_steps < 0``.
        ContractError: a vocabulary of 2**24 tokens or more.
    """
    def __init__(self, lm: LoadedModel, fmt: BlockFormat, batch: int, max_len: int, step_path: str = "eager",
                 verify_steps: int = 0, readout: decode.FP32Readout | None = None, attention: str = "sdpa"):
        if step_path not in STEP_PATHS:
            raise ValueError(f"unknown step path {step_path!r}; use one of {STEP_PATHS}")
        if attention not in ATTENTIONS:
            raise ValueError(f"unknown attention {attention!r}; use one of {ATTENTIONS}")
        self.attention = attention
        if step_path == "graph" and lm.device.type != "cuda":
            raise ValueError(f"step path 'graph' needs a CUDA device, the model is on {lm.device}")
        if batch < 1 or max_len < 1:
            raise ValueError(f"batch and max_len must be at least 1, got {batch} and {max_len}")
        if verify_steps < 0:
            raise ValueError(f"verify_steps must be at least 0, got {verify_steps}")
        self.verify_steps, self.verified = verify_steps, 0
        self.readout = readout
        self.lm, self.fmt, self.batch, self.max_len, self.step_path = lm, fmt, batch, max_len, step_path
        self.rows = rows = 2 * batch
        dev = lm.device
        vocab = lm.model.get_output_embeddings().weight.shape[0]
        if vocab > 1 << 24:
            raise ContractError(f"vocabulary of {vocab} tokens: token IDs would not be exact in float32")
        # inputs: token, position, query role, choice role  ([4, rows] int64, one host-to-device copy per step)
        self.inputs = torch.zeros(4, rows, dtype=torch.long, device=dev)
        self._host = torch.zeros(4, rows, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.cache = RowCache.for_model(lm, rows, max_len, write_pos=self.inputs[1])
        self.roles = torch.zeros(rows, max_len, dtype=torch.long, device=dev)
        self._vis = visibility_matrix(dev)
        eligible = torch.ones(6, vocab, dtype=torch.bool, device=dev)
        for role in range(BRANCH1, ANSWER + 1):
            eligible[role] = fmt.content_mask(role, dev, vocab)
        self._eligible = eligible
        self._k = torch.arange(max_len, device=dev)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._out: tuple[torch.Tensor, torch.Tensor] | None = None
        self.steps = 0
        self.idle_all()

    # ---- buffers
    def idle_all(self) -> None:
        """Put every row in the idle state (token 0 at position 0 with role prompt: attends to key 0 only)."""
        self._host.zero_()
        self._host[3] = MERGE

    def admit(self, slot: int, cache: DynamicCache, roles: torch.Tensor) -> int:
        """Load a duplicate pair's state into slot ``slot`` (rows ``2*slot``, ``2*slot + 1``), clearing them first.

        Args:
            cache: layers ``[2, kv_heads, n, head_dim]`` in the model dtype.
            roles: ``[2, n]`` int64 raw roles of the ``n`` positions.

        Returns:
            ``n``.

        Raises:
            ValueError: wrong geometry, dtype, or ``n >= max_len`` (no room for one more token).
        """
        r = 2 * slot
        n = self.cache.load_rows(r, cache)
        if tuple(roles.shape) != (2, n):
            raise ValueError(f"roles must be [2, {n}], got {tuple(roles.shape)}")
        if n >= self.max_len:
            raise ValueError(f"a prefix of {n} positions leaves no room in max_len={self.max_len}")
        self.roles[r : r + 2].zero_()
        self.roles[r : r + 2, :n].copy_(roles)
        return n

    def set_row_pair(self, slot: int, token: int, position: int, role: int, choice_role: int) -> None:
        """Stage the next step's inputs of one problem (both duplicate rows; host side, copied at :meth:`step`).

        Raises:
            ContractError: ``position >= max_len``.
        """
        if position >= self.max_len:
            raise ContractError(f"slot {slot}: position {position} is beyond max_len={self.max_len}")
        r = 2 * slot
        h = self._host
        h[0, r : r + 2] = token
        h[1, r : r + 2] = position
        h[2, r : r + 2] = role
        h[3, r : r + 2] = choice_role

    def set_idle(self, slot: int) -> None:
        """Stage slot ``slot`` as idle for the next step (its outputs are ignored)."""
        self.set_row_pair(slot, 0, 0, PROMPT, MERGE)

    # ---- the step
    def _compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        lm = self.lm
        token, pos, qrole, crole = self.inputs
        with _unique_index_writes():  # one position per row
            self.roles.scatter_(1, pos[:, None], qrole[:, None])
        allowed = self._vis[qrole[:, None], self.roles] & (self._k[None, :] <= pos[:, None])  # [rows, max_len]
        embeds = lm.model.get_input_embeddings()(token[:, None])
        if lm.role_table is not None:
            embeds = embeds + lm.role_table[qrole + ROLE_OFFSET][:, None, :]
        kwargs = dict(inputs_embeds=embeds, attention_mask=allowed[:, None, None, :], position_ids=pos[:, None],
                      past_key_values=self.cache, use_cache=True)
        with sdpa_kernel(decode._backends(lm.sdpa_backends)), _attention(lm.model, self.attention):
            if self.readout is None:
                logits = lm.model(**kwargs, logits_to_keep=1).logits[:, -1, :]
            else:
                logits = self.readout(lm, kwargs)
        return logits, choice_stats(logits, self._eligible[crole])

    def _capture(self) -> None:
        # The step is idempotent for fixed inputs (it rewrites the same role and keys/values at each row's
        # position before reading them), so the warm-up runs do not change what the first replay computes.
        side = torch.cuda.Stream(device=self.lm.device)
        side.wait_stream(torch.cuda.current_stream(self.lm.device))
        with torch.cuda.stream(side):
            for _ in range(3):
                self._compute()
        torch.cuda.current_stream(self.lm.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._out = self._compute()
        self._graph = graph

    def step(self) -> tuple[torch.Tensor, list[list[float]]]:
        """Copy the staged inputs to the device and run one batched step.

        Returns:
            ``(logits, stats)``: ``[rows, vocab]`` logits on the device (a static
            buffer on the graph path: valid until the next step) and
            :func:`choice_stats` read to the host as 4 lists of ``rows`` floats
            (the step's one host sync).
        """
        self.inputs.copy_(self._host, non_blocking=True)
        if self.step_path == "graph":
            if self._graph is None:
                self._capture()
            self._graph.replay()
            logits, stats = self._out
        else:
            logits, stats = self._compute()
        if self.steps < self.verify_steps:
            self._verify(logits, stats)
        self.lm.calls += 1
        self.steps += 1
        return logits, stats.tolist()

    def _written(self) -> list[torch.Tensor]:
        """Keys and values at every row's current write position: per layer ``[rows, kv_heads, 1, head_dim]``."""
        return [t.gather(2, layer._index) for layer in self.cache.layers for t in (layer.keys, layer.values)]

    def _verify(self, logits: torch.Tensor, stats: torch.Tensor) -> None:
        """Recompute this step eagerly on the same inputs; require identical logits, statistics and keys/values.

        Raises:
            GateError: gate ``graph_equals_eager``, naming the step and what differed.
        """
        first = (logits.clone(), stats.clone(), [t.clone() for t in self._written()])
        again = self._compute()
        second = (again[0], again[1], self._written())
        for name, a, b in zip(("logits", "choice statistics"), first[:2], second[:2]):
            if not torch.equal(a, b):
                raise GateError("graph_equals_eager", f"step {self.steps} ({self.step_path} vs eager): {name} differ")
        if not all(torch.equal(a, b) for a, b in zip(first[2], second[2])):
            raise GateError("graph_equals_eager",
                            f"step {self.steps} ({self.step_path} vs eager): keys/values written differ")
        self.verified += 1
        VERIFIED_STEPS[0] += 1

    def check_valid_length(self, slot: int, n: int, roles: Sequence[int], where: str) -> None:
        """Functional state of a slot's rows in the padded static cache: exactly ``n`` valid positions.

        Positions ``0..n-1`` must carry the problem's raw roles ``roles[:n]``;
        every position from ``n`` to ``max_len - 1`` must be padding: role 0 and
        keys/values exactly zero in every layer (never written, so what the
        mask hides is nothing), in both duplicate rows.

        Args:
            slot: the problem's slot (rows ``2*slot``, ``2*slot + 1``).
            n: positions the problem has written (its valid length).
            roles: raw roles of at least ``n`` tokens.

        Raises:
            GateError: gate ``functional_state``.
        """
        r = 2 * slot
        want = torch.zeros(self.max_len, dtype=torch.long, device=self.roles.device)
        want[:n] = torch.tensor(list(roles[:n]), dtype=torch.long, device=want.device)
        bad = [(self.roles[r : r + 2] != want).any()]
        for layer in self.cache.layers:
            bad += [layer.keys[r : r + 2, :, n:].ne(0).any(), layer.values[r : r + 2, :, n:].ne(0).any()]
        flags = torch.stack(bad).tolist()
        if flags[0]:
            raise GateError("functional_state", f"{where}: the engine's role row differs from the problem's "
                            f"roles within its valid length {n} or is not padding beyond it")
        if any(flags[1:]):
            raise GateError("functional_state", f"{where}: keys/values written beyond the valid length {n} "
                            f"(positions the mask hides must be untouched padding)")

    def first_choice(self, logits: torch.Tensor, choice_role: int) -> list[list[float]]:
        """:func:`choice_stats` of a duplicate pair's logits ``[2, vocab]`` (from a prefill), read to the host."""
        eligible = self._eligible[choice_role].expand(2, -1)
        return choice_stats(logits, eligible).tolist()


# -------------------------------------------------------------------------------------------- the cursor
class _Cursor(BlockCursor):
    """:class:`BlockCursor` split in two halves around a batched step.

    :meth:`prepare` applies the cap before the logits exist (so the step knows
    the structural mask); :meth:`BlockCursor.take` consumes the forced queue or accepts the
    token chosen on the device. Together they make the transitions of
    :meth:`BlockCursor.step`.
    """
    def prepare(self) -> int:
        """Apply the content cap; return the raw role whose structural mask the next choice uses."""
        if self.in_content and self.count >= self.caps.for_role(self.role):
            self._close()
        return self.role


@dataclasses.dataclass
class _Job:
    index: int
    cursor: _Cursor
    ids: list[int]
    roles: list[int]
    new: list[int] = dataclasses.field(default_factory=list)
    margins: list = dataclasses.field(default_factory=list)
    finishing: bool = False  # fed its last token: the next step's logits end it (live boundary)


def _check(stats: list[list[float]], row: int, where: str, position: int) -> None:
    if stats[3][row] != 1.0 or stats[3][row + 1] != 1.0:
        raise GateError("nonfinite", f"{where}: non-finite logits after the step ending at position {position}")
    if stats[2][row] != 1.0:
        raise GateError("desync",
                        f"{where}: duplicate rows' logits differ after the step ending at position {position}")


def _drive(
    engine: StepEngine,
    n_jobs: int,
    admit: Callable[[int, int], tuple[_Job, torch.Tensor]],
    stop_after_feed: Callable[[_Cursor], bool],
    finish: Callable[[_Job, int, torch.Tensor | None], object],
    on_gate_error: str,
) -> list:
    """The slot scheduler shared by the batched decoders.

    ``admit(job_index, slot)`` loads a problem into a slot and returns its
    job and the duplicate pair's logits ``[2, vocab]``; ``finish(job, slot,
    logits)`` builds the result (``logits`` are the pair's last step logits
    for a job that ended after a feed, else ``None``).
    """
    if on_gate_error not in ("raise", "return"):
        raise ValueError(f"on_gate_error must be 'raise' or 'return', got {on_gate_error!r}")
    results: list = [None] * n_jobs
    slots: list[_Job | None] = [None] * engine.batch
    queue = list(range(n_jobs))
    queue.reverse()

    def fail(slot: int, err: GateError) -> None:
        job = slots[slot]
        slots[slot] = None
        engine.set_idle(slot)
        if on_gate_error == "raise":
            raise err
        results[job.index] = err

    def advance(slot: int, chosen: int, margin: float) -> None:
        """Take the next token of the job in ``slot`` and stage its feed (or finish the job)."""
        job = slots[slot]
        token, role, m = job.cursor.take(chosen, margin)
        job.new.append(token)
        job.margins.append(m)
        job.roles.append(role)
        if job.cursor.done:
            try:  # the last token was chosen, not fed: |ids| + |new| - 1 positions written
                engine.check_valid_length(slot, len(job.ids) + len(job.new) - 1, job.roles, f"problem {job.index}")
            except GateError as err:
                fail(slot, err)
                return
            results[job.index] = finish(job, slot, None)
            slots[slot] = None
            engine.set_idle(slot)
            return
        position = len(job.ids) + len(job.new) - 1
        if stop_after_feed(job.cursor):
            job.finishing = True
            engine.set_row_pair(slot, token, position, role, MERGE)
        else:
            engine.set_row_pair(slot, token, position, role, job.cursor.prepare())

    while True:
        for slot in range(engine.batch):
            while slots[slot] is None and queue:
                index = queue.pop()
                job, logits = admit(index, slot)
                slots[slot] = job
                stats = engine.first_choice(logits, job.cursor.prepare())
                try:
                    _check(stats, 0, f"problem {index}", len(job.ids) - 1)
                except GateError as err:
                    fail(slot, err)
                    continue
                advance(slot, int(stats[0][0]), stats[1][0])
        if all(j is None for j in slots):
            break
        logits, stats = engine.step()
        for slot, job in enumerate(slots):
            if job is None:
                continue
            r = 2 * slot
            try:
                _check(stats, r, f"problem {job.index}", len(job.ids) + len(job.new) - 1)
            except GateError as err:
                fail(slot, err)
                continue
            if job.finishing:
                try:  # every token was fed
                    engine.check_valid_length(slot, len(job.ids) + len(job.new), job.roles, f"problem {job.index}")
                except GateError as err:
                    fail(slot, err)
                    continue
                results[job.index] = finish(job, slot, logits[r : r + 2].clone())
                slots[slot] = None
                engine.set_idle(slot)
            else:
                advance(slot, int(stats[0][r]), stats[1][r])
    return results


def suffix_length_bound(fmt: BlockFormat, caps: Caps) -> int:
    """Most tokens a suffix can hold: merge content and closer, answer opener, content and closer."""
    return (caps.merge + len(fmt.closers[MERGE]) + len(fmt.openers[ANSWER]) + caps.answer
            + len(fmt.closers[ANSWER]))


def live_length_bound(fmt: BlockFormat, caps: Caps, prompt_len: int) -> int:
    """Most tokens a live prefix z can hold: the prompt, three capped branch blocks, the merge opener."""
    branches = sum(len(fmt.openers[r]) + caps.branch + len(fmt.closers[r]) for r in (1, 2, 3))
    return prompt_len + branches + len(fmt.openers[MERGE])


def _engine(lm, fmt, batch, step_path, max_len, need: int, verify_steps: int = 0, readout=None,
            attention: str = "sdpa") -> StepEngine:
    if max_len is None:
        max_len = need
    if need > max_len:
        raise ValueError(f"max_len={max_len} is shorter than the {need} positions the longest problem may need")
    return StepEngine(lm, fmt, batch, max_len, step_path, verify_steps, readout, attention)


# -------------------------------------------------------------------------------------------- the decoders
@torch.inference_mode()
def decode_suffixes(
    lm: LoadedModel,
    fmt: BlockFormat,
    boundaries: Sequence[Boundary],
    caps: Caps,
    *,
    batch: int = 8,
    step_path: str = "eager",
    max_len: int | None = None,
    on_gate_error: str = "raise",
    verify_steps: int = 0,
    readout: decode.FP32Readout | None = None,
    attention: str = "sdpa",
) -> list:
    """The shared suffix decoder for many boundary states at once (batched :func:`kvreplay.decode.decode_suffix`).

    Every boundary continues through merge and answer with the block state
    machine, caps, forced delimiters and structural mask of
    :func:`~kvreplay.decode.decode_suffix`, one token per step, ``batch``
    problems per step. A boundary's cache is copied into the engine (it is
    not consumed, unlike :func:`~kvreplay.decode.decode_suffix`).

    Args:
        lm: the loaded model.
        fmt: the block format.
        boundaries: states from :func:`~kvreplay.decode.build_incremental`,
            :func:`~kvreplay.decode.build_prefill`, :func:`~kvreplay.decode.decode_live`
            or :func:`decode_lives`: caches ``[2, kv_heads, |z|, head_dim]`` in
            the model dtype, roles ``[2, |z|]``, logits ``[2, vocab]``.
        caps: content caps (merge and answer are used).
        batch: problems per step (``2 * batch`` rows); part of the batch shape.
        step_path: ``"eager"`` or ``"graph"`` (CUDA graph; CUDA only).
        max_len: positions per row, part of the batch shape; default the longest
            ``|z|`` plus :func:`suffix_length_bound`. Fix it to compare runs over
            different problem sets bit for bit.
        on_gate_error: ``"raise"`` stops at the first failed gate; ``"return"``
            puts the :class:`~kvreplay.gates.GateError` in that problem's place
            and goes on with the others.
        verify_steps: steps checked against the eager step (:class:`StepEngine`).
        attention: the step's attention, ``"sdpa"`` or ``"grouped"`` (:data:`ATTENTIONS`); part of the contract.
        readout: FP32 readout of every step's logits (:class:`StepEngine`); the
            boundaries' logits should come from constructions built with it.

    Returns:
        One :class:`~kvreplay.decode.Suffix` per boundary, in order (or a
        ``GateError`` with ``on_gate_error="return"``).

    Raises:
        GateError: ``desync`` (a problem's duplicate rows' logits differ),
            ``nonfinite`` (non-finite logits) or ``functional_state`` (a row's
            valid length, :meth:`StepEngine.check_valid_length`), with
            ``on_gate_error="raise"``; ``graph_equals_eager`` always raises.
        ContractError: a suffix did not close its answer block.
        ValueError: bad ``batch``, ``step_path``, ``max_len`` or cache geometry.
    """
    if not boundaries:
        return []
    need = max(len(b.ids) for b in boundaries) + suffix_length_bound(fmt, caps)
    engine = _engine(lm, fmt, batch, step_path, max_len, need, verify_steps, readout, attention)

    def admit(index: int, slot: int):
        b = boundaries[index]
        n = engine.admit(slot, b.cache, b.roles)
        if n != len(b.ids):
            raise ValueError(f"problem {index}: cache holds {n} positions, the prefix has {len(b.ids)}")
        return _Job(index, _Cursor(fmt, caps, MERGE), list(b.ids), b.roles[0].tolist()), b.logits

    def finish(job: _Job, slot: int, logits):
        b = boundaries[job.index]
        full = job.ids + job.new
        parsed = fmt.parse(full, where=f"{b.construction} suffix")
        if not parsed.complete:
            raise ContractError(f"{b.construction} suffix: the answer block was not closed")
        (m0, m1), (a0, a1) = parsed.content[MERGE], parsed.content[ANSWER]
        return Suffix(job.new, job.margins, full[m0:m1], full[a0:a1])

    return _drive(engine, len(boundaries), admit, lambda c: False, finish, on_gate_error)


@torch.inference_mode()
def decode_lives(
    lm: LoadedModel,
    fmt: BlockFormat,
    prompts: Sequence[Sequence[int]],
    caps: Caps,
    *,
    batch: int = 8,
    step_path: str = "eager",
    max_len: int | None = None,
    on_gate_error: str = "raise",
    verify_steps: int = 0,
    attention: str = "sdpa",
) -> list:
    """Live multi-branch decoding of many prompts at once (batched :func:`kvreplay.decode.decode_live`).

    Each prompt block is processed in one forward call of its duplicate pair
    (:func:`kvreplay.decode.forward`, ``DynamicCache``) and copied into the
    problem's rows; branches 1-3 and the merge opener then advance one token
    per batched step, as :func:`~kvreplay.decode.decode_live` schedules them.

    Args:
        prompts: token IDs of each prompt block (role 0).
        caps: content caps (branches stop at ``caps.branch``).
        batch, step_path, max_len, on_gate_error, verify_steps, attention: as in :func:`decode_suffixes`
            (``max_len`` defaults to the longest prompt plus :func:`live_length_bound`'s blocks).

    Returns:
        One live :class:`~kvreplay.decode.Boundary` per prompt: ``ids`` z,
        ``roles`` ``[2, |z|]``, a ``DynamicCache`` of copies ``[2, kv_heads,
        |z|, head_dim]``, the boundary ``logits`` ``[2, vocab]``, ``schedule``
        ``[prompt_len, 1, 1, ...]`` and ``positions`` ``[2, |z|]`` (0..|z|-1).
        A ``GateError`` in a prompt's place with ``on_gate_error="return"``.

    Raises:
        GateError: as in :func:`decode_suffixes`.
        ValueError: as in :func:`decode_suffixes`.
    """
    if not prompts:
        return []
    need = live_length_bound(fmt, caps, max(len(p) for p in prompts)) + 1
    engine = _engine(lm, fmt, batch, step_path, max_len, need, verify_steps, attention=attention)
    dev = lm.device

    def admit(index: int, slot: int):
        ids = list(prompts[index])
        roles = torch.full((decode.BATCH, len(ids)), PROMPT, dtype=torch.long, device=dev)
        cache = DynamicCache(config=lm.model.config)
        logits = decode.forward(lm, cache, decode._as_batch(ids, dev), roles, 0)
        engine.admit(slot, cache, roles)
        cursor = _Cursor(fmt, caps, PROMPT, [(t, BRANCH1) for t in fmt.openers[BRANCH1]])
        return _Job(index, cursor, ids, [PROMPT] * len(ids)), logits

    def finish(job: _Job, slot: int, logits):
        z = job.ids + job.new
        n = len(z)
        roles = torch.tensor(job.roles, dtype=torch.long, device=dev).expand(decode.BATCH, -1).contiguous()
        positions = torch.arange(n, device=dev).expand(decode.BATCH, -1).contiguous()
        cache = engine.cache.to_dynamic(2 * slot, n, lm.model.config)
        schedule = [len(job.ids)] + [1] * len(job.new)
        return Boundary("live", z, roles, cache, logits, schedule, positions)

    return _drive(engine, len(prompts), admit, lambda c: c.role == MERGE and c.in_content, finish, on_gate_error)


@torch.inference_mode()
def build_incrementals(
    lm: LoadedModel,
    fmt: BlockFormat,
    prefixes: Sequence[Sequence[int]],
    *,
    batch: int = 8,
    step_path: str = "eager",
    max_len: int | None = None,
    on_gate_error: str = "raise",
    verify_steps: int = 0,
    readout: decode.FP32Readout | None = None,
    attention: str = "sdpa",
) -> list:
    """Teacher-forced replay of the live call schedule through the engine (batched incremental construction).

    Each prefix z is rebuilt exactly as :func:`decode_lives` built it: the
    prompt block in one forward call of the duplicate pair, then every later
    token of z fed in its own batched step with its raw role, up to the merge
    opener; the logits of the step after the last token are the boundary
    logits. At the same batch shape (``batch``, ``max_len``) and slot, an
    engine-live boundary and the incremental rebuild of its prefix must be
    bit-identical (the bridge under the engine): every input of every step is
    the same, and a problem's bits do not depend on its companions.

    Args:
        prefixes: boundary prefixes z (token IDs ending right after the merge opener).
        batch, step_path, max_len, on_gate_error, verify_steps, readout, attention: as in
            :func:`decode_suffixes` (``max_len`` defaults to the longest prefix plus one);
            with ``readout`` the prompt call and every step give FP32-readout logits
            and write the same keys/values as without it.

    Returns:
        One ``"incremental"`` :class:`~kvreplay.decode.Boundary` per prefix,
        laid out as :func:`decode_lives` lays out its boundaries (a
        ``GateError`` in its place with ``on_gate_error="return"``).

    Raises:
        ContractError: a prefix that does not end at the boundary.
        GateError, ValueError: as in :func:`decode_suffixes`.
    """
    if not prefixes:
        return []
    parsed = [fmt.boundary_parse(z, where=f"prefix {i}") for i, z in enumerate(prefixes)]
    need = max(len(z) for z in prefixes) + 1
    engine = _engine(lm, fmt, batch, step_path, max_len, need, verify_steps, readout, attention)
    dev = lm.device
    free = Caps(branch=1 << 30, merge=1 << 30, answer=1 << 30)  # every token is forced: no cap applies

    def admit(index: int, slot: int):
        z, p = list(prefixes[index]), parsed[index].prompt_len
        roles = torch.full((decode.BATCH, p), PROMPT, dtype=torch.long, device=dev)
        cache = DynamicCache(config=lm.model.config)
        logits = decode.forward(lm, cache, decode._as_batch(z[:p], dev), roles, 0, readout=readout)
        engine.admit(slot, cache, roles)
        cursor = _Cursor(fmt, free, PROMPT, list(zip(z[p:], parsed[index].roles[p:])))
        return _Job(index, cursor, z[:p], [PROMPT] * p), logits

    def finish(job: _Job, slot: int, logits):
        z = job.ids + job.new
        if z != list(prefixes[job.index]):
            raise ContractError(f"prefix {job.index}: teacher forcing stopped at {len(z)} tokens, not at its boundary")
        n = len(z)
        roles = torch.tensor(job.roles, dtype=torch.long, device=dev).expand(decode.BATCH, -1).contiguous()
        positions = torch.arange(n, device=dev).expand(decode.BATCH, -1).contiguous()
        cache = engine.cache.to_dynamic(2 * slot, n, lm.model.config)
        return Boundary("incremental", z, roles, cache, logits, [len(job.ids)] + [1] * len(job.new), positions)

    return _drive(engine, len(prefixes), admit, lambda c: c.role == MERGE and c.in_content, finish, on_gate_error)
