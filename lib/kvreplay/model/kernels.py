"""Invariant kernels: a reference implementation in which a row's bits do not depend on its call (a contract value).

Under the execution-contract value ``kernels: invariant`` every reducing operation of a Llama-kind or Qwen2 model
gives one token row the same bits whatever the number of rows or tokens in the call, its companions in the batch
or its slot: so a prefill over ``z``, the live decoder's one-token calls and the incremental replay build the same
cache bit for bit, and a row computed alone equals the row inside a batch. Each operation is run with one fixed
shape per row, so the same kernel runs on the same operand shapes wherever the row sits:

* ``linear`` (the decoder layers' projections and the MLP, its activation included): one token row at a time,
  ``F.linear`` on a fresh ``[1, in]`` copy (M = 1);
* ``norm`` (RMSNorm): one row at a time, Hugging Face's formula (float32 mean of squares, ``rsqrt``);
* ``attention``: one query at a time over its keys in blocks of :data:`ATTENTION_BLOCK` positions anchored at key 0,
  up to the block holding its last visible key, in float32. Scores come per block, then the exact maximum over
  visible keys, ``exp`` per block, per-block sums and ``P @ V`` per block added in block order. Masked keys and cache
  padding enter as exact zeros (``torch.where`` on both the weights and the values, so a non-finite padding value cannot
  leak: ``0 * NaN`` is NaN);
* ``lm_head``: the output projection one row at a time, as ``linear``. The choice statistics (greedy argmax, the
  top-1 minus top-2 margin) are already exact: maxima and comparisons of one row's logits and one subtraction,
  no order-dependent sum;
* ``rope``: the rotary cosines and sines one position at a time.

A second fixed order for the attention class is its own value, ``invariant-attention-block-128``
(:data:`ATTENTION_ORDERS`): every class invariant, attention over key blocks of 128 positions instead of 64. The
maximum, the exponentials and every other class keep their bits; what changes is only how the sums over keys (the
softmax denominator and ``P @ V``) are grouped: partial sums over 128 keys, added in block order. So prefill = live
under it too, by construction, and its caches and suffixes against ``invariant``'s measure what a change of one
fixed reduction order does at fixed precision.

Each class can be left on the default path (``invariant-except-<class>``, e.g. ``invariant-except-attention``), so
"every operation invariant but one" is a contract value: the attribution control. Nothing is patched globally. The
model's own modules get instance-level ``forward`` replacements and a registered attention function
(:data:`ATTENTION_NAME`) while :func:`installed` is entered. So no matmul override reaches the rotary frequency
product (``inv_freq @ position_ids``, a one-term product) or anything outside the model.

While installed, a guard (:class:`_Guard`, a ``TorchFunctionMode``) refuses every reducing or transcendental
floating-point torch call (matmul, linear, softmax, sum, mean, SDPA, exp, rsqrt, cos, sin, silu, ...) that does not
come from one of the wrapped operations, covered or deliberately left default: an operation the contract does
not cover fails closed with :class:`UncoveredOperationError` instead of running silently. Models other than
Llama and Qwen2, and any module type outside :data:`COVERED_MODULES`, are refused with :class:`KernelContractError`
before any row.

This is a reference: slow (one Python-level kernel call per row, query and key block), portable between CPU and
CUDA, and meant for tests, gates and the attribution control. Its bits are those of this torch build, device and
thread count, like every other contract's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import types
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .kernels_contract import ATTENTION_BLOCK, KernelContractError

DEFAULT = "default"
INVARIANT = "invariant"
CLASSES = ("linear", "attention", "norm", "lm_head", "rope")
"""The operation classes the invariant contract covers, each switchable on its own."""
EXCEPT = "invariant-except-"
ATTENTION_ORDERS = {"invariant-attention-block-128": 128}
"""Values with every class invariant and attention over another fixed key-block size (a second fixed order of the
attention class's key reductions): value -> key positions per block. 128 rather than a smaller block: the reference
then makes half as many block calls, and 128 is the key-block size of FlexAttention's kernels."""
FUSED = "invariant-fused"
"""Every class invariant through the fused Triton kernels (:mod:`kvreplay.model.kernels_fused`): the fast path, its own bits."""
KERNELS = (DEFAULT, INVARIANT, *(EXCEPT + c for c in CLASSES), *ATTENTION_ORDERS, FUSED)
"""Every value of the execution contract's ``kernels`` key."""
ATTENTION_NAME = "kvreplay_invariant"
"""The attention function registered with ``transformers`` for the invariant attention."""
FUSED_ATTENTION_NAME = "kvreplay_invariant_fused"
"""The attention function registered for ``invariant-fused`` (:func:`kvreplay.model.kernels_fused.block_attention`)."""
GUARDED_SDPA_NAME = "kvreplay_guarded_sdpa"
"""The model's own SDPA attention, registered under the guard (attention left on the default path)."""

COVERED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
COVERED_MODULES = frozenset({
    "LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", "LlamaRMSNorm",
    "LlamaRotaryEmbedding", "Qwen2ForCausalLM", "Qwen2Model", "Qwen2DecoderLayer", "Qwen2Attention", "Qwen2MLP",
    "Qwen2RMSNorm", "Qwen2RotaryEmbedding", "ModuleList", "Embedding", "Linear", "SiLU", "SiLUActivation",
})
"""Module types the invariant contract knows (any other module in a model refuses it)."""


class UncoveredOperationError(RuntimeError):
    """A reducing floating-point operation ran outside every covered kernel while invariant kernels were installed."""


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """A parsed ``kernels`` value: which operation classes run invariant.

    Attributes:
        name: the contract value (one of :data:`KERNELS`).
        invariant: the classes (of :data:`CLASSES`) on the invariant path; empty for ``default``.
        attention_block: key positions per block of the invariant attention (:data:`ATTENTION_BLOCK` unless the
            value is one of :data:`ATTENTION_ORDERS`).
        fused: the invariant classes run the fused Triton kernels (:data:`FUSED`), not the reference ones.
    """
    name: str
    invariant: frozenset
    attention_block: int = ATTENTION_BLOCK
    fused: bool = False

    @property
    def default(self) -> bool:
        return not self.invariant


def parse_kernels(value: "str | KernelSpec") -> KernelSpec:
    """The :class:`KernelSpec` of a ``kernels`` value.

    Raises:
        ValueError: naming the value and the accepted ones.
    """
    if isinstance(value, KernelSpec):
        return value
    if value == DEFAULT:
        return KernelSpec(DEFAULT, frozenset())
    if value == INVARIANT:
        return KernelSpec(INVARIANT, frozenset(CLASSES))
    if isinstance(value, str) and value.startswith(EXCEPT) and value[len(EXCEPT):] in CLASSES:
        return KernelSpec(value, frozenset(CLASSES) - {value[len(EXCEPT):]})
    if value == FUSED:
        return KernelSpec(FUSED, frozenset(CLASSES), fused=True)
    if isinstance(value, str) and value in ATTENTION_ORDERS:
        return KernelSpec(value, frozenset(CLASSES), ATTENTION_ORDERS[value])
    raise ValueError(f"unknown kernels value {value!r}; use one of {list(KERNELS)}")


def check_step_path(value: str, step_path: str, attention: str = "sdpa") -> None:
    """Refuse a ``kernels`` value that is unknown, or that the arm's decode path does not run.

    ``default`` runs on every path. ``invariant`` and ``invariant-fused`` run on the eager decoders (``step_path``
    ``eager``) and on the batched engine's eager step (``engine-eager``; ``invariant-fused`` also on ``graph``) with
    ``attention`` ``sdpa``, which the invariant attention
    replaces (:mod:`kvreplay.engine.invariant`). The ablation values ``invariant-except-<class>`` run on the eager
    decoders only: the class they leave default computes over the engine's batch shape, so a row's bits would depend
    on its batch.

    Raises:
        ValueError: naming the value and the setting it does not run with (``graph``, ``flex``/``grouped``, or an
            ablation value on the engine).
    """
    spec = parse_kernels(value)
    if spec.default or step_path == "eager":
        return
    if spec.name not in (INVARIANT, FUSED):
        raise ValueError(f"kernels {value!r} runs on the eager decoders only (step_path 'eager'), not "
                         f"{step_path!r}: it leaves one class on the default path, whose bits would depend on the "
                         f"engine's batch (the engine takes kernels 'invariant' or 'invariant-fused')")
    if step_path != "engine-eager" and not (spec.fused and step_path == "graph"):
        raise ValueError(f"kernels {value!r} runs on step_path 'eager' or 'engine-eager', not {step_path!r} (the "
                         f"reference kernels cannot be captured in a CUDA graph)")
    if attention != "sdpa":
        raise ValueError(f"kernels {value!r} on the engine needs attention 'sdpa' (replaced by the invariant "
                         f"attention), not {attention!r}")


def check_model(model: torch.nn.Module) -> None:
    """Refuse a model the invariant contract does not cover, before any row.

    Covered: ``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` with SiLU MLPs, default RoPE, no sliding window and
    only the module types of :data:`COVERED_MODULES`.

    Raises:
        KernelContractError: naming the architecture, the module (its path and type) or the config entry.
    """
    arch = type(model).__name__
    if arch not in COVERED_ARCHITECTURES:
        raise KernelContractError(f"kernels 'invariant' covers {list(COVERED_ARCHITECTURES)} only; this model is "
                                  f"{arch}: use kernels 'default' for it")
    for name, module in model.named_modules():
        if type(module).__name__ not in COVERED_MODULES:
            raise KernelContractError(f"kernels 'invariant': module {name or '<root>'} of type "
                                      f"{type(module).__name__} is not covered (covered: {sorted(COVERED_MODULES)})")
    cfg = model.config
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    problems = []
    if getattr(cfg, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg.hidden_act!r} (covered: 'silu')")
    if rope != "default":
        problems.append(f"rope_type {rope!r} (covered: 'default')")
    if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        problems.append("sliding-window layers")
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        problems.append(f"pretraining_tp {cfg.pretraining_tp}")
    if problems:
        raise KernelContractError(f"kernels 'invariant': {arch} with {', '.join(problems)} is not covered")


# --- the fixed-shape kernels ------------------------------------------------------------------------------------

def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` one row at a time: ``x [..., in]`` -> ``[..., out]`` in ``x``'s dtype (M = 1 calls)."""
    rows = x.reshape(-1, x.shape[-1])
    out = x.new_empty(rows.shape[0], weight.shape[0])
    for i in range(rows.shape[0]):
        out[i] = F.linear(rows[i : i + 1].clone(), weight, bias)[0]
    return out.reshape(*x.shape[:-1], weight.shape[0])


def row_mlp(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A gated MLP ``down(act(gate(x)) * up(x))`` one token row at a time: ``[..., hidden]`` -> ``[..., hidden]``."""
    rows = x.reshape(-1, x.shape[-1])
    out = x.new_empty(rows.shape)
    g, u, d = module.gate_proj, module.up_proj, module.down_proj
    for i in range(rows.shape[0]):
        r = rows[i : i + 1].clone()
        out[i] = F.linear(F.silu(F.linear(r, g.weight, g.bias)) * F.linear(r, u.weight, u.bias), d.weight, d.bias)[0]
    return out.reshape(x.shape)


def row_rms_norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm one row at a time, Hugging Face's formula: ``[..., hidden]`` -> same shape and dtype."""
    rows = x.reshape(-1, x.shape[-1])
    out = x.new_empty(rows.shape)
    for i in range(rows.shape[0]):
        r = rows[i : i + 1].to(torch.float32, copy=True)
        var = r.pow(2).mean(-1, keepdim=True)
        out[i] = (module.weight * (r * torch.rsqrt(var + module.variance_epsilon)).to(x.dtype))[0]
    return out.reshape(x.shape)


def row_rope(original, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding's ``(cos, sin)`` ``[batch, q, head_dim]``, one position ID at a time."""
    cos, sin = [], []
    for b in range(position_ids.shape[0]):
        for t in range(position_ids.shape[1]):
            c, s = original(x[:1, :1], position_ids[b : b + 1, t : t + 1].clone())
            cos.append(c[0, 0])
            sin.append(s[0, 0])
    shape = (*position_ids.shape, -1)
    return torch.stack(cos).reshape(shape), torch.stack(sin).reshape(shape)


def block_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                    scaling: float, block: int = ATTENTION_BLOCK) -> torch.Tensor:
    """Attention one query at a time over keys in fixed blocks anchored at key 0 (float32 inside).

    Args:
        query: ``[batch, heads, q, head_dim]``; key, value: ``[batch, kv_heads, k, head_dim]`` (grouped heads:
            query head ``h`` reads key head ``h // (heads // kv_heads)``).
        mask: ``[batch, 1, q, k]`` bool, True where the query sees the key.
        scaling: the score scale (``head_dim ** -0.5`` for these models).

    Returns:
        ``[batch, q, heads, head_dim]`` in ``query``'s dtype (the layout Hugging Face's attention functions return).

    Raises:
        KernelContractError: a query that sees no key, or a mask of another shape or dtype.
    """
    b_, h_, q_, d_ = query.shape
    kv, k_ = key.shape[1], key.shape[2]
    if mask.dtype != torch.bool or tuple(mask.shape) != (b_, 1, q_, k_):
        raise KernelContractError(f"invariant attention needs a bool mask [{b_}, 1, {q_}, {k_}], got "
                                  f"{mask.dtype} {tuple(mask.shape)}")
    g = h_ // kv
    index = torch.arange(k_, device=mask.device)
    last = torch.where(mask[:, 0], index, -1).amax(-1).tolist()  # [batch][q]: last visible key per query
    out = query.new_empty(b_, q_, h_, d_)
    for b in range(b_):
        need = max(last[b]) // block + 1
        kp = key.new_zeros(need * block, kv, d_, dtype=torch.float32)
        vp = torch.zeros_like(kp)
        span = min(k_, need * block)
        kp[:span] = key[b, :, :span].transpose(0, 1).float()
        vp[:span] = value[b, :, :span].transpose(0, 1).float()
        kblocks = kp.reshape(need, block, kv, d_).permute(0, 2, 1, 3).contiguous()  # [blocks, kv, block, d]
        vblocks = vp.reshape(need, block, kv, d_).permute(0, 2, 1, 3).contiguous()
        mp = torch.zeros(q_, need * block, dtype=torch.bool, device=mask.device)
        mp[:, :span] = mask[b, 0, :, :span]
        for t in range(q_):
            if last[b][t] < 0:
                raise KernelContractError(f"invariant attention: query {t} of row {b} sees no key")
            n = last[b][t] // block + 1
            qv = query[b, :, t].float().reshape(kv, g, d_).contiguous()
            scores, visible = [], []
            top = None
            for j in range(n):
                seen = mp[t, j * block : (j + 1) * block].clone()
                s = torch.matmul(qv, kblocks[j].transpose(-1, -2)) * scaling  # [kv, g, block]
                m = torch.where(seen, s, float("-inf")).amax(-1)
                top = m if top is None else torch.maximum(top, m)
                scores.append(s)
                visible.append(seen)
            total = acc = None
            for j in range(n):
                p = torch.where(visible[j], torch.exp(scores[j] - top[..., None]), 0.0)
                v = torch.where(visible[j][None, :, None], vblocks[j], 0.0)
                part, pv = p.sum(-1), torch.matmul(p, v)
                total, acc = (part, pv) if total is None else (total + part, acc + pv)
            out[b, t] = (acc / total[..., None]).reshape(h_, d_).to(query.dtype)
    return out


def invariant_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """The attention function registered as :data:`ATTENTION_NAME`: :func:`block_attention` with the module's
    scale; ``(output [batch, q, heads, head_dim], None)``.

    Raises:
        KernelContractError: dropout, a sliding window, attention sinks, or a mask that is not a bool tensor.
    """
    scale = _call_scale(query, attention_mask, dropout, scaling, kwargs)
    with _covered():
        return block_attention(query, key, value, attention_mask, scale), None


def _call_scale(query: torch.Tensor, attention_mask, dropout: float, scaling: float | None, kwargs: dict) -> float:
    """The score scale of one attention call under the invariant contract (the module's, else ``head_dim ** -0.5``).

    Raises:
        KernelContractError: dropout, a sliding window, attention sinks, or a mask that is not a tensor.
    """
    if dropout or kwargs.get("sliding_window") is not None or kwargs.get("s_aux") is not None:
        raise KernelContractError("invariant attention covers no dropout, sliding window or attention sinks")
    if not isinstance(attention_mask, torch.Tensor):
        raise KernelContractError(f"invariant attention needs the explicit 4-D bool mask, got {type(attention_mask).__name__}")
    return scaling if scaling is not None else query.shape[-1] ** -0.5


def _attention_with_block(block: int):
    """:func:`invariant_attention` over key blocks of ``block`` positions (the function registered for that block)."""
    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs):
        scale = _call_scale(query, attention_mask, dropout, scaling, kwargs)
        with _covered():
            return block_attention(query, key, value, attention_mask, scale, block=block), None
    return attention


def attention_name(block: int) -> str:
    """The registered name of the invariant attention over key blocks of ``block`` positions (:data:`ATTENTION_NAME`
    for :data:`ATTENTION_BLOCK`)."""
    return ATTENTION_NAME if block == ATTENTION_BLOCK else f"{ATTENTION_NAME}_block{block}"


def guarded_sdpa(*args, **kwargs):
    """The model's own SDPA attention, run as a covered operation (attention left on the default path)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with _covered():
        return sdpa_attention_forward(*args, **kwargs)


def readout(value: "str | KernelSpec", norm: torch.nn.Module, head: torch.nn.Module,
            hidden: torch.Tensor) -> torch.Tensor:
    """A final norm and LM head outside the model (the FP32 readout control's float32 copies) under ``value``.

    Under ``default`` it is ``head(norm(hidden))``, bit for bit. Otherwise it runs as a covered operation, so the
    guard lets it through; under ``invariant-fused`` through the fused kernels. The norm runs one row at a time when ``norm`` is invariant, the head when ``lm_head`` is;
    a class left default runs its module's own code.

    Args:
        norm: an RMSNorm module (``weight``, ``variance_epsilon``); head: a linear layer.
        hidden: ``[rows, hidden]`` in the copies' dtype.

    Returns:
        ``[rows, vocab]`` logits in ``hidden``'s dtype.
    """
    spec = parse_kernels(value)
    if spec.default:
        return head(norm(hidden))
    if spec.fused:
        from . import kernels_fused

        kernels_fused.check_device(hidden.device)
        with _covered():
            return kernels_fused.linear(kernels_fused.rms_norm(norm, hidden), head.weight, head.bias)
    with _covered():
        x = row_rms_norm(norm, hidden) if "norm" in spec.invariant else norm(hidden)
        return row_linear(x, head.weight, head.bias) if "lm_head" in spec.invariant else head(x)


# --- the guard ----------------------------------------------------------------------------------------------------

_GUARDED_NAMES = ("linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addmv", "mv",
                  "einsum", "softmax", "log_softmax", "_softmax", "sum", "mean", "var", "std", "norm", "logsumexp",
                  "cumsum", "prod", "scaled_dot_product_attention", "exp", "rsqrt", "sqrt", "cos", "sin", "silu",
                  "gelu", "tanh", "sigmoid", "layer_norm", "rms_norm", "group_norm", "dot", "vdot", "tensordot")


class _Guard(TorchFunctionMode):
    """Refuse a reducing or transcendental floating-point call outside the covered kernels (:func:`_covered`)."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _GUARDED_NAMES and not _STATE.covered and _floating(args, kwargs):
            raise UncoveredOperationError(f"kernels 'invariant': {name} ran outside every covered kernel (an "
                                          f"operation the contract does not cover); refused")
        return func(*args, **kwargs)


def _floating(args, kwargs) -> bool:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return True
        if isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in a):
            return True
    return False


class _State(threading.local):
    covered = 0


_STATE = _State()


@contextlib.contextmanager
def _covered() -> Iterator[None]:
    """A covered kernel runs: the guard lets its operations through (and torch-function dispatch is skipped)."""
    _STATE.covered += 1
    try:
        with torch._C.DisableTorchFunction():
            yield
    finally:
        _STATE.covered -= 1


# --- installing ---------------------------------------------------------------------------------------------------

def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, invariant_attention)
    for block in ATTENTION_ORDERS.values():
        AttentionInterface.register(attention_name(block), _attention_with_block(block))
    AttentionInterface.register(GUARDED_SDPA_NAME, guarded_sdpa)


def _register_fused_attention() -> None:
    from transformers import AttentionInterface

    from . import kernels_fused

    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs):
        scale = _call_scale(query, attention_mask, dropout, scaling, kwargs)
        with _covered():
            check = getattr(module, "layer_idx", 0) == 0 and not (query.is_cuda and torch.cuda.is_current_stream_capturing())
            return kernels_fused.block_attention(query, key, value, attention_mask, scale, check=check), None

    AttentionInterface.register(FUSED_ATTENTION_NAME, attention)


@contextlib.contextmanager
def _installed_fused(model: torch.nn.Module) -> Iterator[None]:
    """:func:`installed` for ``invariant-fused``: every class on its fused kernel, the model's rope batched."""
    from . import kernels_fused

    kernels_fused.check_device(next(model.parameters()).device)
    _register_fused_attention()
    head = model.get_output_embeddings()
    patched: list[torch.nn.Module] = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if module is head:
            _wrap(module, lambda orig, x: kernels_fused.linear(x, head.weight, head.bias))
        elif kind.endswith("MLP"):
            _wrap(module, lambda orig, x, m=module: kernels_fused.mlp(m, x))
        elif kind == "Linear" and ".mlp." not in f".{name}.":
            _wrap(module, lambda orig, x, m=module: kernels_fused.linear(x, m.weight, m.bias))
        elif kind.endswith("RMSNorm"):
            _wrap(module, lambda orig, x, m=module: kernels_fused.rms_norm(m, x))
        elif kind.endswith("RotaryEmbedding"):
            _wrap(module, _default)  # one-term product and elementwise cos/sin: batched, it keeps each row's bits
        else:
            continue
        patched.append(module)
    with _guarded(model, patched, FUSED_ATTENTION_NAME):
        yield


@contextlib.contextmanager
def _guarded(model: torch.nn.Module, patched: list[torch.nn.Module], attention: str) -> Iterator[None]:
    """Run ``model`` with its attention function registered as ``attention`` under the guard; on exit restore its
    attention and drop the instance-level forwards of ``patched`` (:func:`_wrap`)."""
    cfg = model.config
    before = cfg._attn_implementation
    cfg._attn_implementation = attention
    try:
        with _Guard():
            yield
    finally:
        cfg._attn_implementation = before
        for module in patched:
            del module.forward


_CHECKED: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def _wrap(module: torch.nn.Module, kernel) -> None:
    """Give ``module`` an instance-level forward running ``kernel(original_forward, *args)`` as a covered operation."""
    original = module.forward

    def forward(self, *args, **kwargs):
        with _covered():
            return kernel(original, *args, **kwargs)

    module.forward = types.MethodType(forward, module)


def _default(original, *args, **kwargs):
    return original(*args, **kwargs)


@contextlib.contextmanager
def installed(model: torch.nn.Module, kernels: "str | KernelSpec") -> Iterator[None]:
    """Run ``model`` under ``kernels`` inside the block (nothing changes for ``default``).

    Every linear layer, MLP, RMSNorm, the rotary embedding, the LM head and the attention function are wrapped:
    invariant classes run their fixed-shape kernel, the others their default code as a covered operation; the
    guard refuses anything else. Everything is restored on exit.

    Raises:
        KernelContractError: the model is not covered (:func:`check_model`), or the value is unknown.
        UncoveredOperationError: (inside the block) an uncovered reducing operation ran.
    """
    spec = parse_kernels(kernels)
    if spec.default:
        yield
        return
    if model not in _CHECKED:
        check_model(model)
        _CHECKED[model] = True
    if spec.fused:
        with _installed_fused(model):
            yield
        return
    _register_attention()
    on = spec.invariant
    head = model.get_output_embeddings()
    patched: list[torch.nn.Module] = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if module is head:
            _wrap(module, (lambda orig, x: row_linear(x, head.weight, head.bias)) if "lm_head" in on else _default)
        elif kind.endswith("MLP"):
            _wrap(module, (lambda orig, x, m=module: row_mlp(m, x)) if "linear" in on else _default)
        elif kind == "Linear" and ".mlp." not in f".{name}.":
            _wrap(module, (lambda orig, x, m=module: row_linear(x, m.weight, m.bias)) if "linear" in on else _default)
        elif kind.endswith("RMSNorm"):
            _wrap(module, (lambda orig, x, m=module: row_rms_norm(m, x)) if "norm" in on else _default)
        elif kind.endswith("RotaryEmbedding"):
            _wrap(module, row_rope if "rope" in on else _default)
        else:
            continue
        patched.append(module)
    with _guarded(model, patched, attention_name(spec.attention_block) if "attention" in on else GUARDED_SDPA_NAME):
        yield
