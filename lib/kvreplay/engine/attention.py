"""The engine step's attention: the model's SDPA call, grouped-query attention in float32, or FlexAttention.

:data:`ATTENTIONS` names the three. :func:`grouped_attention` and :func:`flex_attention_step` are registered in
transformers' ``AttentionInterface``, and :func:`use_attention` switches a model's attention layers to one of them
for the length of one engine step. :class:`FlexMask` is the block mask the ``flex`` step reads (built once per
engine, updated in place every step); :func:`reference_attention` is the math-SDPA reference of the
``attention_tolerance`` gate; :func:`flex_environment` is what a ledger records of the ``flex`` kernels.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface

from .run import FLEX_BLOCK  # the flex step's key/value block (positions), declared beside max_len's rounding

ATTENTIONS = ("sdpa", "grouped", "flex")
"""How the step's attention runs. ``sdpa``: the model's own attention call, ``scaled_dot_product_attention``
under ``lm.sdpa_backends`` (transformers first repeats each key/value head for the query heads that share it);
``grouped``: :func:`grouped_attention` (the math backend's float32 arithmetic, one matmul per key/value head for
its group of query heads, nothing repeated); ``flex``: :func:`flex_attention_step` (PyTorch's FlexAttention, keys
and values read in the model dtype with float32 accumulation, only the blocks a row has filled; compiled on CUDA,
torch's reference implementation on the CPU). Each gives other bits: the attention is part of the contract."""

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}
"""Largest relative error (L2 norm of the difference over L2 norm of the reference) of a layer's attention output
that the ``attention_tolerance`` gate accepts for a non-``sdpa`` attention, per model dtype, against
:func:`reference_attention` on the same inputs."""


_IGNORED = ("position_ids", "use_cache", "cache_position")  # keywords transformers' layers pass on, unused here
_WINDOW = "sliding_window"  # the layer's window (Gemma 2/3, Mistral, Qwen2 pass it; None on full layers): in the mask
_GROUPED = "kvreplay_grouped"  # the name grouped_attention is registered under in transformers' AttentionInterface
_FLEX = "kvreplay_flex"  # the name flex_attention_step is registered under
_CHECK = "kvreplay_attention_check"  # a step of the attention_tolerance gate (kvreplay.engine.StepEngine)
_REGISTERED = {"grouped": _GROUPED, "flex": _FLEX}
_RECOMPILE_LIMIT = 64  # compiled flex kernels one process may hold (one per step shape and dtype); beyond: an error
_LIMIT_NAME = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


def _unknown_keywords(kwargs: dict) -> list[str]:
    return sorted(k for k, v in kwargs.items() if k not in (*_IGNORED, _WINDOW) and v not in (None, False))


def _window_keyword(kwargs: dict, where: str) -> int | None:
    """The ``sliding_window`` keyword a layer passes (``None`` for a full-attention layer), checked to be a count."""
    window = kwargs.get(_WINDOW)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{where}: sliding_window must be a number of positions or None, got {window!r}")
    return window


def grouped_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """Grouped-query attention in float32 without repeating keys/values (the engine's ``attention="grouped"``).

    The arithmetic of torch's ``math`` SDPA backend. Query and keys are cast from BF16 or FP16 to float32 and each
    multiplied by the square root of the scale. Masked scores are set to ``-inf``, softmax runs over the keys, and
    the weighted sum of the values is cast back to the input dtype. But the query heads that share a key/value head
    are stacked into the rows of one matmul against that head's keys and values. The keys and values are still cast
    to float32 once per step (a float32 copy of each layer's cache), but never repeated. The ``sdpa`` path lets
    transformers copy every key/value head once per query head (SmolLM2-135M: 9 query heads on 3 key/value heads),
    and the math backend then casts and scales those copies. So each step moves several times more bytes of the
    static cache, and moving those bytes is where a decode step over a long static cache spends its time. The matmul
    shapes differ, so the bits may differ from ``sdpa`` (and do on the CPUs and GPUs we ran): a different attention
    is a different contract.

    Called by transformers' attention layers (registered in ``AttentionInterface``); used only inside
    :class:`StepEngine` steps with ``attention="grouped"``.

    Args:
        query: ``[rows, heads, q, head_dim]`` in the model dtype.
        key, value: ``[rows, kv_heads, keys, head_dim]``; ``heads`` must be a multiple of ``kv_heads``
            (query head ``h`` reads key/value head ``h // (heads // kv_heads)``, as transformers' ``repeat_kv``).
        attention_mask: boolean ``[rows, 1, q, keys]`` (``True``: attend). A query row whose keys are all
            masked gets NaN (the math backend gives 0); in the engine every row sees at least its own key, and
            the ``nonfinite`` gate would stop a NaN. A sliding-window layer's mask already hides the keys
            outside its window (:func:`kvreplay.model.models.layer_masks`).
        dropout: must be 0 (inference only).
        scaling: the score scale (default ``head_dim ** -0.5``).
        sliding_window: the layer's window (positions) or ``None``, as Gemma 2/3, Mistral and Qwen2 layers pass it.
            Accepted, not applied: the mask carries the window, as for the model's SDPA call, and the
            ``attention_tolerance`` gate's reference applies it on its own.

    Returns:
        ``([rows, q, heads, head_dim] in the query's dtype, None)`` (the layout transformers' layers expect).

    Raises:
        ValueError: no mask, a mask that is not boolean ``[rows, 1, q, keys]``, dropout, heads not a multiple of
            kv_heads, a ``sliding_window`` that is not a positive int, or a keyword that would change the
            attention (``is_causal``, ``softcap``, ...). Only ``position_ids``, ``use_cache`` and
            ``cache_position`` are accepted and ignored, as the model's SDPA call ignores them.
    """
    rows, heads, q, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    if heads % kv_heads or dropout:
        raise ValueError(f"grouped_attention: {heads} heads on {kv_heads} key/value heads, dropout {dropout}")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool \
            or tuple(attention_mask.shape) != (rows, 1, q, keys):
        got = attention_mask if not isinstance(attention_mask, torch.Tensor) else \
            f"{attention_mask.dtype} {tuple(attention_mask.shape)}"
        raise ValueError(f"grouped_attention takes an explicit boolean mask [{rows}, 1, {q}, {keys}], got {got}")
    unknown = _unknown_keywords(kwargs)
    if unknown:
        raise ValueError(f"grouped_attention does not compute {unknown}")
    _window_keyword(kwargs, "grouped_attention")
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


# --------------------------------------------------------------------------------------------------- flex
_SPLIT_SMS = 132
"""Streaming multiprocessors that :func:`flex_kernel_options` sizes the key/value split for (an H200's count)."""


def flex_kernel_options(rows: int, kv_heads: int, group: int) -> dict[str, int]:
    """The pinned Triton options of the ``flex`` step's decoding kernel (no autotuning: fixed kernels, fixed bits).

    ``BLOCK_N`` 64, 2 warps, 1 pipeline stage: torch's default decoding configuration for these head sizes.
    ``BLOCK_M``: the group of query heads stacked per key/value head, rounded up to a power of two, at least 16
    (torch's default). ``SPLIT_KV``: the number of parts the keys are cut into, reduced in float32 after. Torch
    sizes it from the GPU's multiprocessor count; here it is 2 x (132 // (rows x kv_heads)), at least 1 (an
    H200's default), so the kernel does not change with the GPU.

    Args:
        rows: physical rows of the step (``2B``).
        kv_heads: key/value heads of the model.
        group: query heads per key/value head.

    Returns:
        ``{"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "SPLIT_KV"}`` (ints).
    """
    return {"BLOCK_M": max(16, 1 << max(group - 1, 0).bit_length()), "BLOCK_N": 64, "num_warps": 2, "num_stages": 1,
            "SPLIT_KV": max(1, 2 * (_SPLIT_SMS // max(rows * kv_heads, 1)))}


@functools.cache
def _compiled_flex():
    # one compiled function for the process; its kernels are cached per input shape and dtype (dynamic=False)
    return torch.compile(flex_attention, fullgraph=True, dynamic=False,
                         options={"max_autotune": False, "coordinate_descent_tuning": False})


def _run_flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: BlockMask,
              scale: float) -> torch.Tensor:
    """FlexAttention of ``[rows, kv_heads, group, D]`` queries: compiled on CUDA, the reference elsewhere."""
    if query.device.type == "cuda":
        options = flex_kernel_options(query.shape[0], query.shape[1], query.shape[2])
        with torch._dynamo.config.patch(**{_LIMIT_NAME: _RECOMPILE_LIMIT}):
            return _compiled_flex()(query, key, value, block_mask=block_mask, scale=scale, kernel_options=options)
    return flex_reference(query, key, value, block_mask, scale)


def flex_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: BlockMask,
                   scale: float) -> torch.Tensor:
    """The arithmetic of torch's uncompiled ``flex_attention`` (its reference), with the mask built by broadcasting.

    Torch's eager ``flex_attention`` applies ``mask_mod`` through four nested ``vmap`` calls: tens of
    milliseconds of Python per call. A :class:`FlexMask`'s ``mask_mod`` broadcasts as it is, so here it is
    called once on ``[rows, 1, group, keys]`` index grids. The rest is torch's: float32
    scores (float64 for float64 inputs), scaled, ``-inf`` where masked, ``torch._safe_softmax``, then the
    probabilities in the input dtype times the values. The CPU tests check it equals ``flex_attention`` bit
    for bit.

    Args:
        query: ``[rows, heads, q, D]``; key, value: ``[rows, heads, keys, D]`` (no GQA here).
        block_mask: a block mask whose ``mask_mod`` broadcasts (a :class:`FlexMask`'s).
        scale: the score scale.

    Returns:
        ``[rows, heads, q, D]`` in the query's dtype.
    """
    rows, heads, q, _ = query.shape
    keys = key.shape[2]
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    dev = query.device
    b = torch.arange(rows, device=dev).view(rows, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev)
    m = torch.arange(q, device=dev).view(1, 1, q, 1)
    n = torch.arange(keys, device=dev).view(1, 1, 1, keys)
    mask = block_mask.mask_mod(b, h, m, n).expand(rows, heads, q, keys)
    scores = ((query.to(work) @ key.to(work).transpose(-2, -1)) * scale).to(work)
    scores = torch.where(mask, scores, torch.tensor(-float("inf"), dtype=work, device=dev))
    return torch._safe_softmax(scores, dim=-1).to(query.dtype) @ value.to(query.dtype)


def _torch_flex_reference(query, key, value, block_mask, scale):
    """Torch's own uncompiled ``flex_attention`` (what :func:`flex_reference` reproduces; the tests compare)."""
    with warnings.catch_warnings():  # "called without torch.compile": the unfused reference is what is wanted
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention(query, key, value, block_mask=block_mask, scale=scale)


class FlexMask:
    """The ``flex`` step's block mask over an engine's buffers: role visibility AND causal, filled blocks only.

    Built once per engine at ``max_len``: :data:`FLEX_BLOCK` positions a block. :meth:`update` sets each row's
    blocks to read from its position, in place on the device, so the mask lives inside a captured CUDA graph. Its
    ``mask_mod`` reads the engine's own buffers. Key ``k`` of row ``b`` is visible iff ``k <= position[b]``, ``k``
    lies in a block the row reads, and ``visibility[query_role[b], roles[b, k]]`` (Table 2). That is the boolean
    mask the other attentions get. The block term makes the CPU reference compute what the block-sparse GPU kernel
    reads.

    With ``window`` W (a sliding-window layer's mask, docs/models.md) a key is also visible only when
    ``position[b] - k < W``. A row reads from the block holding its first key inside the window, so the blocks
    wholly before the window are not read at all (at 3,000 positions and W = 512, 5 blocks of 24 are read).

    Args:
        position: ``[rows]`` int64, each row's position this step (the engine's input buffer).
        query_role: ``[rows]`` int64 raw role of each row's token this step.
        roles: ``[rows, max_len]`` int64 raw roles of every position of every row.
        visibility: ``[6, 6]`` bool (:func:`kvreplay.decoding.contract.visibility_matrix`).
        group: query heads per key/value head (the stacked query length).
        window: the sliding window in positions, or ``None`` (full attention).

    Attributes:
        block_mask: the ``BlockMask`` (batch ``rows``, one head, query length ``group``, key length ``max_len``).
        kv_num_blocks: ``[rows, 1, 1]`` int32, blocks each row reads (``position // FLEX_BLOCK + 1`` without a
            window).
        first_block: ``[rows]`` int32, the first block each row reads (0 without a window).
        window: as given.

    Raises:
        ValueError: ``max_len`` not a multiple of :data:`FLEX_BLOCK`, or a window below 1.
    """
    def __init__(self, position: torch.Tensor, query_role: torch.Tensor, roles: torch.Tensor,
                 visibility: torch.Tensor, group: int, window: int | None = None):
        rows, max_len = roles.shape
        if max_len % FLEX_BLOCK:
            raise ValueError(f"attention 'flex' reads keys in blocks of {FLEX_BLOCK}: max_len={max_len} must be a "
                             f"multiple of {FLEX_BLOCK} (round it up)")
        if window is not None and window < 1:
            raise ValueError(f"a sliding window covers at least 1 position, got {window}")
        blocks = max_len // FLEX_BLOCK
        dev = roles.device
        self.position, self.window, self.blocks = position, window, blocks
        self.kv_num_blocks = torch.ones(rows, 1, 1, dtype=torch.int32, device=dev)
        self.first_block = torch.zeros(rows, dtype=torch.int32, device=dev)
        self._steps = torch.arange(blocks, dtype=torch.int32, device=dev).view(1, 1, 1, blocks)
        indices = self._steps.expand(rows, 1, 1, blocks).contiguous()
        filled = self.kv_num_blocks
        first = self.first_block

        if window is None:
            def mask_mod(b, h, q, k):
                return (k <= position[b]) & (k < filled[b, 0, 0] * FLEX_BLOCK) & visibility[query_role[b], roles[b, k]]
        else:
            def mask_mod(b, h, q, k):
                start = first[b] * FLEX_BLOCK
                return ((k <= position[b]) & (position[b] - k < window) & (k >= start)
                        & (k < start + filled[b, 0, 0] * FLEX_BLOCK) & visibility[query_role[b], roles[b, k]])

        self.mask_mod = mask_mod
        self.block_mask = BlockMask.from_kv_blocks(filled, indices, BLOCK_SIZE=FLEX_BLOCK,
                                                   mask_mod=mask_mod, seq_lengths=(group, max_len),
                                                   compute_q_blocks=False)
        self.block_mask.kvreplay_window = window  # read by flex_attention_step: the layer's window must match
        self.kv_indices = self.block_mask.kv_indices  # [rows, 1, 1, blocks] int32, each row's block list

    def update(self) -> None:
        """Set every row's blocks from its position (in place, on the device; capturable)."""
        if self.window is None:
            self.kv_num_blocks.copy_((self.position // FLEX_BLOCK + 1).view(-1, 1, 1))
            return
        last = self.position // FLEX_BLOCK
        first = (self.position - (self.window - 1)).clamp(min=0) // FLEX_BLOCK
        self.first_block.copy_(first)
        self.kv_num_blocks.copy_((last - first + 1).view(-1, 1, 1))
        self.kv_indices.copy_((first.view(-1, 1, 1, 1) + self._steps).clamp(max=self.blocks - 1))


def flex_attention_step(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: BlockMask, dropout: float = 0.0, scaling: float | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """One decode step's attention through FlexAttention (the engine's ``attention="flex"``).

    The query heads that share a key/value head are stacked as that head's query positions (one query per row
    in the engine's step). So the kernel reads each key/value head once, in the model dtype, with float32
    accumulation and softmax, and only the blocks the mask's ``kv_num_blocks`` give each row. No float32 copy of
    the cache is made. Torch's GQA option is not used: its decoding kernel refuses a group that
    is not a power of two (SmolLM2-135M: 3). On CUDA the call is ``torch.compile(flex_attention)`` with the
    options of :func:`flex_kernel_options` (the same kernels in a captured graph and in the eager step); on the
    CPU it is torch's unfused reference (float32 scores over every position, the mask applied densely).

    Called by transformers' attention layers (registered in ``AttentionInterface``); used only inside
    :class:`kvreplay.engine.StepEngine` steps with ``attention="flex"``, which pass :attr:`FlexMask.block_mask`
    as the model's ``attention_mask``.

    Args:
        query: ``[rows, heads, 1, head_dim]`` in the model dtype.
        key, value: ``[rows, kv_heads, max_len, head_dim]``; ``heads`` a multiple of ``kv_heads`` (query head ``h``
            reads key/value head ``h // (heads // kv_heads)``, as transformers' ``repeat_kv``).
        attention_mask: a :class:`FlexMask`'s ``block_mask`` for these rows (query length ``heads // kv_heads``);
            for a sliding-window layer the one built with the layer's window.
        dropout: must be 0.
        scaling: the score scale (default ``head_dim ** -0.5``).
        sliding_window: the layer's window (positions) or ``None``, as transformers' layers pass it; it must be
            the block mask's own (``FlexMask.window``), so a layer never reads another kind of layer's mask.

    Returns:
        ``([rows, 1, heads, head_dim] in the query's dtype, None)``.

    Raises:
        ValueError: no block mask or one of another shape, a block mask whose window is not the layer's, more than
            one query per row, dropout, heads not a multiple of kv_heads, or an attention-changing keyword (as
            :func:`grouped_attention`).
    """
    rows, heads, q, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    if heads % kv_heads or dropout or q != 1:
        raise ValueError(f"flex_attention_step: {heads} heads on {kv_heads} key/value heads, {q} queries per row "
                         f"(one), dropout {dropout}")
    group = heads // kv_heads
    if not isinstance(attention_mask, BlockMask) or tuple(attention_mask.shape) != (rows, 1, group, keys):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, (BlockMask, torch.Tensor)) else attention_mask
        raise ValueError(f"flex_attention_step takes a FlexMask's block mask of shape {(rows, 1, group, keys)}, "
                         f"got {got}")
    unknown = _unknown_keywords(kwargs)
    if unknown:
        raise ValueError(f"flex_attention_step does not compute {unknown}")
    window = _window_keyword(kwargs, "flex_attention_step")
    if getattr(attention_mask, "kvreplay_window", None) != window:
        raise ValueError(f"flex_attention_step: layer {getattr(module, 'layer_idx', '?')} has sliding window {window}, "
                         f"its block mask applies {getattr(attention_mask, 'kvreplay_window', None)} "
                         f"(a FlexMask built with the layer's window is needed)")
    scale = scaling if scaling is not None else dim ** -0.5
    out = _run_flex(query.reshape(rows, kv_heads, group, dim), key, value, attention_mask, scale)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(_FLEX, flex_attention_step)


def flex_environment(rows: int, kv_heads: int, group: int, device: torch.device | str) -> dict:
    """What a ledger records of the ``flex`` step: block size, kernel options, how it runs, torch and Triton versions.

    Returns:
        ``{"block": 128, "kernel_options": {...}, "implementation", "torch", "triton"}``; on the CPU
        ``implementation`` is ``"reference (uncompiled)"``, ``kernel_options`` ``None`` and ``triton`` ``None``.
    """
    cuda = torch.device(device).type == "cuda"
    triton = None
    if cuda:
        import triton as _triton

        triton = _triton.__version__
    return {"block": FLEX_BLOCK, "kernel_options": flex_kernel_options(rows, kv_heads, group) if cuda else None,
            "implementation": ("torch.compile(flex_attention, fullgraph=True, dynamic=False), max_autotune off"
                               if cuda else "reference (uncompiled)"),
            "torch": torch.__version__, "triton": triton}


# ------------------------------------------------------------------------------------ reference and switch
def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor,
                        scaling: float | None = None) -> torch.Tensor:
    """The ``attention_tolerance`` gate's reference: torch's math SDPA in float64 on the same inputs.

    Args:
        query: ``[rows, heads, q, head_dim]``.
        key, value: ``[rows, kv_heads, keys, head_dim]`` (repeated per query head here, as transformers does).
        allowed: boolean ``[rows, 1, q, keys]`` (``True``: attend).
        scaling: the score scale (default ``head_dim ** -0.5``).

    Returns:
        ``[rows, q, heads, head_dim]`` float64 (the layout attention functions return).

    Computed :data:`REFERENCE_ROWS` rows at a time, so the float64 keys and values repeated per query head take a
    slice of the cache's memory, not four times all of it (a batch of 128 rows at 4,096 positions would need GiBs).
    """
    group = query.shape[1] // key.shape[1]
    out = []
    with sdpa_kernel([SDPBackend.MATH]):
        for r in range(0, query.shape[0], REFERENCE_ROWS):
            s = slice(r, r + REFERENCE_ROWS)
            out.append(torch.nn.functional.scaled_dot_product_attention(
                query[s].double(), key[s].double().repeat_interleave(group, 1),
                value[s].double().repeat_interleave(group, 1),
                attn_mask=allowed[s] if allowed.shape[0] > 1 else allowed, scale=scaling))
    return torch.cat(out).transpose(1, 2)


REFERENCE_ROWS = 16
"""Rows per call of :func:`reference_attention` (each row's reference is computed on its own inputs alone)."""


def attention_function(attention: str):
    """The function transformers calls for ``attention`` (``grouped`` or ``flex``; ``sdpa`` has none of ours).

    Raises:
        ValueError: ``sdpa`` or an unknown name.
    """
    if attention == "grouped":
        return grouped_attention
    if attention == "flex":
        return flex_attention_step
    raise ValueError(f"attention {attention!r} has no function of the engine's: one of {tuple(_REGISTERED)}")


@contextlib.contextmanager
def use_attention(model: torch.nn.Module, attention: str) -> Iterator[None]:
    """Within the block the model's attention layers call :func:`grouped_attention` (``attention="grouped"``),
    :func:`flex_attention_step` (``"flex"``), or a name already registered in ``AttentionInterface``; ``"sdpa"``
    leaves the model's own attention."""
    if attention == "sdpa":
        yield
        return
    config = model.config
    was = config._attn_implementation
    config._attn_implementation = _REGISTERED.get(attention, attention)
    try:
        yield
    finally:
        config._attn_implementation = was
