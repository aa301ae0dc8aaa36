"""Fused invariant kernels (Triton): the ``invariant-fused`` contract value, fast and batch-invariant by construction.

Under ``kernels: invariant-fused`` every reducing operation covered by :mod:`kvreplay.model.kernels` runs as one Triton
kernel launch per call with one fixed tile configuration, whatever the number of rows, queries or keys. No
reduction is split across programs. So a row's arithmetic, and its order, do not depend on its companions, its slot,
the batch size or whether its queries come one at a time (live, incremental) or all at once (prefill):

* ``linear`` and ``lm_head``: :func:`linear`, ``x @ W.T + b`` in tiles of :data:`TILE` (rows, outputs, inputs),
  a float32 accumulator summed over input tiles in order; a row's outputs never depend on the tile's other rows.
  FP32 operands multiply in IEEE float32 (no TF32); BF16 ones on the tensor cores.
* ``norm``: :func:`rms_norm`, one program per row: Hugging Face's RMSNorm formula in float32.
* ``attention``: :func:`block_attention`, one program per (row, query, key-value head), the reference's order in
  structure. Keys come in blocks of :data:`kvreplay.model.kernels.ATTENTION_BLOCK` anchored at key 0, up to the block
  holding the query's last visible key. One pass finds the exact maximum; a second adds per-block ``exp`` sums and
  ``P @ V`` in block order. Masked keys and padding enter as exact zeros.
* ``rope``: the model's own rotary embedding on all positions at once. Its one reduction is the one-term product
  ``inv_freq @ position_ids``, exact; cosine and sine are elementwise. So it equals the reference's per-position
  call bit for bit (a test checks).

These kernels have their own bits: the reference (:mod:`kvreplay.model.kernels`) reduces through torch's matmul and
``sum``, whose internal orders are not those of a Triton tile. So ``invariant-fused`` rows are compared with
``invariant-fused`` rows only; the invariants (prefill = live = incremental, a row alone = the row in a batch) are
what both values guarantee.

They run on a CUDA device, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1`` set before this module
is imported): slow, a correctness check only. Anything else raises :class:`kvreplay.model.kernels.KernelContractError`
before any row.
"""

from __future__ import annotations

import os

import torch

from .kernels_contract import ATTENTION_BLOCK, KernelContractError

try:  # triton is a pinned dependency (requirements.in); a build without it refuses the value, not the import
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

TILE = (64, 64, 64)
"""The linear kernel's tile: rows, outputs, inputs per program and step (fixed: part of ``invariant-fused``'s bits)."""
_WARPS = 4
"""Warps per program of every fused kernel (fixed, like the tile)."""


def interpreted() -> bool:
    """Whether Triton runs its CPU interpreter (``TRITON_INTERPRET=1``), as read when this module was imported."""
    return _INTERPRET


_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def record() -> dict:
    """What the fused kernels' bits depend on beyond torch: ``{"triton": version or None, "interpreter": bool,
    "tile": [rows, outputs, inputs], "warps": int}`` (an environment record's entry)."""
    return {"triton": triton.__version__ if triton is not None else None, "interpreter": _INTERPRET,
            "tile": list(TILE), "warps": _WARPS}


def check_device(device: torch.device) -> None:
    """Refuse a device the fused kernels do not run on, before any row.

    Raises:
        KernelContractError: triton is missing, or ``device`` is not CUDA and the interpreter is off.
    """
    if triton is None:
        raise KernelContractError("kernels 'invariant-fused' needs triton (pinned in requirements.in); it is not "
                                  "installed: run make setup")
    if device.type == "cuda" or (device.type == "cpu" and _INTERPRET):
        return
    raise KernelContractError(f"kernels 'invariant-fused' runs on a CUDA device, or on the CPU under Triton's "
                              f"interpreter (TRITON_INTERPRET=1 before import; a slow correctness check), not on "
                              f"{device}: use kernels 'invariant' (the reference) here")


if triton is not None:
    @triton.jit
    def _to(x, dtype: tl.constexpr, ROUND: tl.constexpr):
        """``x`` (float32) in ``dtype``, rounded to nearest even. ``ROUND``: round in integer arithmetic first (the
        interpreter truncates a float32-to-bfloat16 conversion; the GPU rounds to nearest even itself)."""
        if ROUND:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
        return x.to(dtype)

    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                       ROUND: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + rk
            a = tl.load(x_ptr + rm[:, None] * K + ks[None, :], mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0)
            w = tl.load(w_ptr + rn[None, :] * K + ks[:, None], mask=(rn[None, :] < N) & (ks[:, None] < K), other=0.0)
            if UPCAST:  # the interpreter's dot mishandles bfloat16 operands: exact float32 copies of them
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], _to(acc, y_ptr.dtype.element_ty, ROUND),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit(do_not_specialize=["N"])
    def _rms_kernel(x_ptr, w_ptr, y_ptr, N, eps, BLOCK: tl.constexpr, ROUND_X: tl.constexpr, ROUND_Y: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < N
        x = tl.load(x_ptr + row * N + cols, mask=inside, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / N
        normed = _to(x * tl.rsqrt(var + eps), x_ptr.dtype.element_ty, ROUND_X)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0)
        y = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(y_ptr + row * N + cols, _to(y, y_ptr.dtype.element_ty, ROUND_Y), mask=inside)

    @triton.jit(do_not_specialize=["KLEN"])
    def _attention_kernel(q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, scale, KLEN,
                          sqb, sqh, sqt, skb, skh, skn, svb, svh, svn, smb, smq, sob, sot, soh,
                          G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                          BLOCK: tl.constexpr, ROUND: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1).to(tl.int64)
        kh = tl.program_id(2).to(tl.int64)
        gi = tl.arange(0, BG)
        di = tl.arange(0, BD)
        ni = tl.arange(0, BLOCK)
        heads = kh * G + gi
        qmask = (gi[:, None] < G) & (di[None, :] < D)
        q = tl.load(q_ptr + b * sqb + heads[:, None] * sqh + t * sqt + di[None, :], mask=qmask, other=0.0)
        q = q.to(tl.float32)
        last = tl.max(tl.full((BLOCK,), -1, dtype=tl.int32), axis=0)  # the query's last visible key
        start = tl.zeros_like(last)  # loop-carried int32 tensors, typed before the loops
        while start < KLEN:  # while loops: Triton 3.6's interpreter takes no runtime value as a range bound
            keys = start + ni
            seen = tl.load(m_ptr + b * smb + t * smq + keys, mask=keys < KLEN, other=0) != 0
            last = tl.maximum(last, tl.max(tl.where(seen, keys, -1), axis=0))
            start += BLOCK
        blocks = (last + BLOCK) // BLOCK  # up to the block holding it; 0 where the query sees no key
        top = tl.full((BG,), float("-inf"), dtype=tl.float32)
        j = tl.zeros_like(blocks)
        while j < blocks:
            keys = j * BLOCK + ni
            inside = keys < KLEN
            seen = tl.load(m_ptr + b * smb + t * smq + keys, mask=inside, other=0) != 0
            k = tl.load(k_ptr + b * skb + kh * skh + keys[:, None] * skn + di[None, :],
                        mask=inside[:, None] & (di[None, :] < D), other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
            top = tl.maximum(top, tl.max(tl.where(seen[None, :], s, float("-inf")), axis=1))
            j += 1
        total = tl.zeros((BG,), dtype=tl.float32)
        acc = tl.zeros((BG, BD), dtype=tl.float32)
        j = tl.zeros_like(blocks)
        while j < blocks:
            keys = j * BLOCK + ni
            inside = keys < KLEN
            seen = tl.load(m_ptr + b * smb + t * smq + keys, mask=inside, other=0) != 0
            k = tl.load(k_ptr + b * skb + kh * skh + keys[:, None] * skn + di[None, :],
                        mask=inside[:, None] & (di[None, :] < D), other=0.0).to(tl.float32)
            v = tl.load(v_ptr + b * svb + kh * svh + keys[:, None] * svn + di[None, :],
                        mask=inside[:, None] & (di[None, :] < D), other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
            p = tl.where(seen[None, :], tl.exp(s - top[:, None]), 0.0)
            v = tl.where(seen[:, None], v, 0.0)
            total = total + tl.sum(p, axis=1)
            acc = acc + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            j += 1
        out = acc / total[:, None]
        tl.store(o_ptr + b * sob + t * sot + heads[:, None] * soh + di[None, :], _to(out, o_ptr.dtype.element_ty, ROUND),
                 mask=qmask)


def _round(dtype: torch.dtype) -> bool:
    """Whether a kernel rounds its ``dtype`` outputs in integer arithmetic (bfloat16 under the interpreter)."""
    return _INTERPRET and dtype == torch.bfloat16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` in fixed tiles (:data:`TILE`): ``x [..., in]`` -> ``[..., out]`` in ``x``'s dtype.

    Raises:
        KernelContractError: operands of different dtypes or devices, or a dtype other than float32 or bfloat16.
    """
    if x.dtype != weight.dtype or x.device != weight.device or x.dtype not in (torch.float32, torch.bfloat16):
        raise KernelContractError(f"invariant-fused linear: x {x.dtype} on {x.device}, weight {weight.dtype} on "
                                  f"{weight.device}; needs one dtype (float32 or bfloat16) on one device")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    w = weight.contiguous()
    m, k = rows.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        bm, bn, bk = TILE
        b = bias.contiguous() if bias is not None else w
        _linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            rows, w, b, out, m, n, k, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32 or _INTERPRET,
            UPCAST=_INTERPRET and x.dtype == torch.bfloat16, ROUND=_round(x.dtype),
            BM=bm, BN=bn, BK=bk, num_warps=_WARPS)
    return out.reshape(*x.shape[:-1], n)


def mlp(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A gated MLP ``down(silu(gate(x)) * up(x))`` over the fused :func:`linear`: ``[..., hidden]`` -> same shape.

    SiLU and the product are elementwise (torch), so they add no order.
    """
    g, u, d = module.gate_proj, module.up_proj, module.down_proj
    h = torch.nn.functional.silu(linear(x, g.weight, g.bias)) * linear(x, u.weight, u.bias)
    return linear(h, d.weight, d.bias)


def rms_norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm one program per row (float32 mean of squares, ``rsqrt``): ``[..., hidden]`` -> same shape.

    The output dtype is that of ``weight * x`` in torch (the model's dtype for these models).
    """
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(module.weight.dtype, x.dtype), device=x.device)
    if rows.shape[0]:
        n = rows.shape[1]
        _rms_kernel[(rows.shape[0],)](rows, module.weight.contiguous(), out, n, float(module.variance_epsilon),
                                      BLOCK=triton.next_power_of_2(n), ROUND_X=_round(x.dtype),
                                      ROUND_Y=_round(out.dtype), num_warps=_WARPS)
    return out.reshape(x.shape)


def block_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                    scaling: float, block: int = ATTENTION_BLOCK, check: bool = True) -> torch.Tensor:
    """Attention over fixed key blocks, one program per (row, query, key-value head), float32 inside.

    Args:
        query: ``[batch, heads, q, head_dim]``; key, value: ``[batch, kv_heads, k, head_dim]`` (query head ``h``
            reads key head ``h // (heads // kv_heads)``).
        mask: ``[batch, 1, q, k]`` bool, True where the query sees the key.
        scaling: the score scale; block: key positions per block (anchored at key 0).
        check: refuse a query that sees no key (one device-to-host read). Without it such a query's output is NaN
            (``0 / 0``), which the decoders' finite-logit checks refuse; a CUDA graph cannot read the device.

    Returns:
        ``[batch, q, heads, head_dim]`` in ``query``'s dtype (Hugging Face's attention-function layout).

    Raises:
        KernelContractError: a mask of another shape or dtype, or (with ``check``) a query that sees no key.
    """
    b_, h_, q_, d_ = query.shape
    kv, k_ = key.shape[1], key.shape[2]
    if mask.dtype != torch.bool or tuple(mask.shape) != (b_, 1, q_, k_):
        raise KernelContractError(f"invariant-fused attention needs a bool mask [{b_}, 1, {q_}, {k_}], got "
                                  f"{mask.dtype} {tuple(mask.shape)}")
    if h_ % kv:
        raise KernelContractError(f"invariant-fused attention: {h_} query heads over {kv} key-value heads")
    if check and not bool(mask[:, 0].any(-1).all()):
        raise KernelContractError("invariant-fused attention: a query sees no key")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))  # no copy of a static cache
    m = mask.to(torch.int8).contiguous()
    out = torch.empty(b_, q_, h_, d_, dtype=query.dtype, device=query.device)
    g = h_ // kv
    _attention_kernel[(b_, q_, kv)](
        q, k, v, m, out, float(scaling), k_,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), m.stride(0), m.stride(2), out.stride(0), out.stride(1), out.stride(2),
        G=g, BG=max(triton.next_power_of_2(g), 2), D=d_, BD=max(triton.next_power_of_2(d_), 16), BLOCK=block,
        ROUND=_round(query.dtype), num_warps=_WARPS)
    return out
