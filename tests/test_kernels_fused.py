"""The fused invariant kernels (``kernels: invariant-fused``, :mod:`kvreplay.model.kernels_fused`) under Triton's CPU
interpreter: each kernel gives a row the same bits alone, in a batch, in another slot, among one query or many
and over a longer padded cache; its values stay within rounding of the reference kernels (:mod:`kvreplay.model.kernels`);
rope keeps the reference's bits; off a CUDA device without the interpreter the value is refused.

The interpreter is a correctness check of the kernels' logic, not of a GPU's bits: ``tl.dot`` runs as numpy's
matmul there. With ``TRITON_INTERPRET=0`` on a CUDA machine the same tests run the compiled kernels on the GPU.
End to end on the tiny models (prefill = live = incremental, a row alone = the row in a batch, the
engine's row) the runs take minutes, so they are marked ``slow`` (``KVREPLAY_SLOW=1``); the same checks run
through ``KVREPLAY_TEST_KERNELS=invariant-fused TRITON_INTERPRET=1`` on tests/test_kernels.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # also set by conftest.py, before triton is first imported

import pytest
import torch
from conftest import TINY_CAPS, TINY_FORMAT, tiny_lm, tiny_problems
from kvreplay.decoding import decode
from kvreplay.bench import invariance_checks as invariance
from kvreplay.model import kernels
from kvreplay.decoding.contract import ContractError, resolve_format
from kvreplay.engine import EngineRun
from kvreplay.engine.invariant import check_engine
from kvreplay.model.execution import resolve_contract

kf = pytest.importorskip("kvreplay.model.kernels_fused")
DEVICE = torch.device("cpu" if kf.interpreted() else "cuda")
"""The CPU under the interpreter; with ``TRITON_INTERPRET=0`` on a CUDA machine, the compiled kernels on the GPU."""
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 and no CUDA device: the fused kernels cannot run", allow_module_level=True)

DTYPES = (torch.float32, torch.bfloat16)
IDS = ["fp32", "bf16"]


def _within_rounding(a: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | float) -> bool:
    """``|a - ref| <= 2 eps(dtype) |ref| + 64 eps(float32) scale`` everywhere: one or two roundings of the output
    dtype plus a float32 sum of another order over terms of magnitude ``scale`` (e.g. ``|x| @ |W|.T``)."""
    bound = 2 * torch.finfo(ref.dtype).eps * ref.float().abs() + 64 * torch.finfo(torch.float32).eps * scale
    return bool(((a.float() - ref.float()).abs() <= bound).all())


class _Norm(torch.nn.Module):
    def __init__(self, n: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(n, dtype=dtype))
        self.variance_epsilon = 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_linear_row_alone_equals_the_row_in_any_tile(dtype):
    torch.manual_seed(0)
    w, b = 0.1 * torch.randn(96, 80, dtype=dtype, device=DEVICE), torch.randn(96, dtype=dtype, device=DEVICE)
    x = torch.randn(70, 80, dtype=dtype, device=DEVICE)  # 70 rows: two row tiles, the second partly empty
    batch = kf.linear(x, w, b)
    for i in (0, 5, 63, 64, 69):  # a row alone sits at tile row 0; in the batch at other tile rows and tiles
        assert torch.equal(kf.linear(x[i : i + 1], w, b), batch[i : i + 1]), i
    assert torch.equal(kf.linear(x[60:], w, b), batch[60:])  # a slice across the tile boundary
    assert torch.equal(kf.linear(x.reshape(7, 10, 80), w, b), batch.reshape(7, 10, 96))  # leading dimensions
    scale = x.float().abs() @ w.float().abs().T + b.float().abs()
    assert _within_rounding(batch, kernels.row_linear(x, w, b), scale)  # the reference: another summation order


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rms_norm_row_alone_equals_the_row_in_a_batch(dtype):
    torch.manual_seed(1)
    norm = _Norm(80, dtype).to(DEVICE)
    x = 3 * torch.randn(33, 80, dtype=dtype, device=DEVICE)
    batch = kf.rms_norm(norm, x)
    assert all(torch.equal(kf.rms_norm(norm, x[i : i + 1]), batch[i : i + 1]) for i in (0, 17, 32))
    reference = kernels.row_rms_norm(norm, x)  # rsqrt and the mean of squares may differ in their last bits
    assert batch.dtype == dtype and _within_rounding(batch, reference, reference.float().abs() / 8)


def _causal(b: int, q: int, k: int, lengths) -> torch.Tensor:
    """``[b, 1, q, k]`` bool: query ``t`` of row ``i`` sees keys ``<= t`` below ``lengths[i]`` (the last ``q``
    positions of each row's sequence when ``q < k``)."""
    index = torch.arange(k)
    pos = torch.arange(k - q, k) if q < k else torch.arange(q)
    mask = index[None, None, :] <= pos[None, :, None]
    return (mask & (index[None, None, :] < torch.tensor(lengths)[:, None, None]))[:, None].to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_attention_one_query_equals_it_among_many_and_in_a_batch(dtype):
    torch.manual_seed(2)
    heads, kv, d, n = 6, 2, 16, 150  # three key blocks of 64, the last one partial
    q = torch.randn(1, heads, n, d, dtype=dtype, device=DEVICE)
    k, v = torch.randn(1, kv, n, d, dtype=dtype, device=DEVICE), torch.randn(1, kv, n, d, dtype=dtype, device=DEVICE)
    scale = d ** -0.5
    prefill = kf.block_attention(q, k, v, _causal(1, n, n, [n]), scale)  # every query at once
    for t in (0, 63, 64, 130, n - 1):  # one query over its own keys (live, incremental)
        alone = kf.block_attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1],
                                   _causal(1, 1, t + 1, [t + 1]), scale)
        assert torch.equal(alone[0, 0], prefill[0, t]), t
    # the last query in a static cache of 256 positions (NaN past the row), slot 1 beside a shorter row
    pad_k = torch.full((2, kv, 256, d), float("nan"), dtype=dtype, device=DEVICE)
    pad_v = pad_k.clone()
    pad_k[1, :, :n], pad_v[1, :, :n] = k[0], v[0]
    pad_k[0, :, :40], pad_v[0, :, :40] = torch.randn(2, kv, 40, d, dtype=dtype, device=DEVICE)
    qq = torch.randn(2, heads, 1, d, dtype=dtype, device=DEVICE)
    qq[1] = q[0, :, n - 1 : n]
    mask = torch.zeros(2, 1, 1, 256, dtype=torch.bool, device=DEVICE)
    mask[0, 0, 0, :40], mask[1, 0, 0, :n] = True, True
    batch = kf.block_attention(qq, pad_k, pad_v, mask, scale)
    assert torch.equal(batch[1, 0], prefill[0, n - 1]) and bool(torch.isfinite(batch).all())
    reference = kernels.block_attention(q, k, v, _causal(1, n, n, [n]), scale)
    assert _within_rounding(prefill, reference, v.float().abs().max())


def test_rope_batched_equals_the_reference_per_position():
    lm = tiny_lm("llama", torch.float32)
    rope = lm.model.model.rotary_emb
    positions = torch.tensor([[0, 1, 2, 3, 500, 1500], [7, 7, 9, 100, 101, 2047]])
    x = torch.zeros(1, 1, dtype=torch.float32)
    batched = rope(x, positions)
    per_position = kernels.row_rope(rope.forward, x, positions)
    assert all(torch.equal(a, b) for a, b in zip(batched, per_position))


def test_refusals_before_any_row(monkeypatch):
    torch.manual_seed(3)
    q, k = torch.randn(1, 2, 1, 16, device=DEVICE), torch.randn(1, 1, 4, 16, device=DEVICE)
    blind = torch.zeros(1, 1, 1, 4, dtype=torch.bool, device=DEVICE)
    with pytest.raises(kernels.KernelContractError, match="sees no key"):
        kf.block_attention(q, k, k, blind, 0.25)
    with pytest.raises(kernels.KernelContractError, match="bool mask"):
        kf.block_attention(q, k, k, blind.float(), 0.25)
    with pytest.raises(kernels.KernelContractError, match="one dtype"):
        kf.linear(torch.randn(2, 4, device=DEVICE), torch.randn(3, 4, dtype=torch.bfloat16, device=DEVICE), None)
    monkeypatch.setattr(kf, "_INTERPRET", False)
    with pytest.raises(kernels.KernelContractError, match="TRITON_INTERPRET"):
        kf.check_device(torch.device("cpu"))
    lm = tiny_lm("llama", torch.float32)
    lm.contract = resolve_contract(kernels=kernels.FUSED)
    fmt = resolve_format(lm.tokenizer, TINY_FORMAT)
    prompt = fmt.prompt_ids(tiny_problems(1)[0].question, tiny_problems(1)[0].options)
    with pytest.raises(kernels.KernelContractError, match="CUDA device"):
        decode.decode_live(lm, fmt, prompt, TINY_CAPS)


def test_value_is_parsed_and_runs_on_the_engine_with_its_own_attention_only():
    spec = kernels.parse_kernels(kernels.FUSED)
    assert spec.fused and spec.invariant == frozenset(kernels.CLASSES) and kernels.FUSED in kernels.KERNELS
    for path in ("eager", "engine-eager", "graph"):  # no host read while a graph is captured
        kernels.check_step_path(kernels.FUSED, path)
    with pytest.raises(ValueError, match="CUDA graph"):
        kernels.check_step_path(kernels.INVARIANT, "graph")  # the reference still refuses it
    with pytest.raises(ValueError, match="sdpa"):
        kernels.check_step_path(kernels.FUSED, "engine-eager", "flex")
    lm = tiny_lm("llama", torch.float32)
    lm.contract = resolve_contract(kernels=kernels.FUSED)
    check_engine(lm, "graph", "sdpa", None)
    with pytest.raises(ContractError, match="attention 'flex'"):
        check_engine(lm, "eager", "flex", None)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_tiny_model_invariants_under_fused_kernels(dtype):
    lm = tiny_lm("llama", dtype)
    lm.model.to(DEVICE)
    lm.contract = resolve_contract(kernels=kernels.FUSED)
    fmt = resolve_format(lm.tokenizer, TINY_FORMAT)
    prompts = [fmt.prompt_ids(p.question, p.options) for p in tiny_problems(3)]
    r = invariance.construction_check(lm, fmt, prompts[0], TINY_CAPS)
    assert r["live_vs_incremental"] == [] and r["live_vs_prefill"] == [], r
    assert r["logits_live_vs_prefill"] and r["logits_live_vs_incremental"]
    b = invariance.batch_check(lm, prompts[0], [prompts[1], prompts[0][:-7]], sizes=(3,))
    assert all(x["logits_equal"] and not x["cache_differs"] for x in b.values()), b
    e = invariance.engine_check(lm, fmt, prompts[0], prompts[1:], TINY_CAPS, EngineRun(step_path="eager"), sizes=(2,))
    assert all(v == [] for v in e.values()), e

