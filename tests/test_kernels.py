"""The invariant-kernel contract (``kernels: invariant``) on the tiny Llama and Qwen2 models, BF16 and FP32, on CPU.

Under it prefill, live and incremental boundaries coincide bit for bit on every layer, and a row computed alone
equals the same row inside batches of 2 and 7 beside other sequences of other lengths; a planted fault in any
one kernel class is caught by those checks; an operation the contract does not cover, a model it does not cover
and the engine's graph path are refused (the engine's eager step: tests/test_engine_invariant.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import TINY_CAPS, TINY_FORMAT, tiny_lm, tiny_problems
from kvreplay.decoding import caches, decode
from kvreplay import gates
from kvreplay.bench import invariance_checks as invariance
from kvreplay.model import kernels
from kvreplay.decoding.contract import ContractError, resolve_format
from kvreplay.model.execution import resolve_contract
from kvreplay.runner import ArmSettings, resolve_execution

DTYPES = (torch.float32, torch.bfloat16)
UNDER_TEST = os.environ.get("KVREPLAY_TEST_KERNELS", "invariant")
"""The kernels value the invariance tests run under: ``KVREPLAY_TEST_KERNELS=invariant-except-linear`` shows them
catch one class left on the default path (where this machine's default kernels are not invariant)."""


def _lm(arch: str, dtype: torch.dtype, value: str = UNDER_TEST):
    lm = tiny_lm(arch, dtype)
    lm.contract = resolve_contract(kernels=value)
    return lm, resolve_format(lm.tokenizer, TINY_FORMAT)


def _prompt(fmt, i: int = 0) -> list[int]:
    p = tiny_problems(i + 1)[i]
    return fmt.prompt_ids(p.question, p.options)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_prefill_live_incremental_coincide(arch, dtype):
    lm, fmt = _lm(arch, dtype)
    r = invariance.construction_check(lm, fmt, _prompt(fmt), TINY_CAPS)
    assert r["live_vs_incremental"] == [] and r["live_vs_prefill"] == [], r
    assert r["logits_live_vs_prefill"] and r["logits_live_vs_incremental"]
    live, inc, pre = r["boundaries"]
    # the same suffix from each, and a replica and a whole-cache transplant keep the bits
    replica = caches.live_replica(live)
    moved, _ = caches.transplant(pre, replica, label="prefill<-live")
    suffixes = [decode.decode_suffix(lm, fmt, b, TINY_CAPS).tokens for b in (live, pre, moved)]
    assert suffixes[0] == suffixes[1] == suffixes[2]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_row_alone_equals_row_in_batches(arch, dtype):
    lm, fmt = _lm(arch, dtype)
    target = _prompt(fmt, 0)
    companions = [_prompt(fmt, 1), target[:-7], target + [70, 71, 72], _prompt(fmt, 2)[:30]]
    r = invariance.batch_check(lm, target, companions, sizes=(2, 7))
    assert all(v["logits_equal"] and not v["cache_differs"] for v in r.values()), r


def _nudged(original, when):
    """A planted fault: ``original``'s result moved by one ulp whenever ``when(args)`` holds (a shape-dependent kernel)."""
    def fault(*args, **kwargs):
        out = original(*args, **kwargs)
        if not when(args, kwargs):
            return out
        if isinstance(out, tuple):
            return tuple(torch.nextafter(o, torch.full_like(o, float("inf"))) for o in out)
        return torch.nextafter(out, torch.full_like(out, float("inf")))
    return fault


def _tokens(name: str, args, kwargs) -> int:
    """Token rows of one kernel call (all rows of the batch)."""
    if name == "block_attention":
        return args[0].shape[0] * args[0].shape[2]
    if name == "row_rope":
        return kwargs.get("position_ids", args[-1]).numel()
    x = args[1] if name in ("row_mlp", "row_rms_norm") else args[0]
    return x.numel() // x.shape[-1]


def _batch(name: str, args, kwargs) -> int:
    if name == "row_rope":
        return kwargs.get("position_ids", args[-1]).shape[0]
    x = args[1] if name in ("row_mlp", "row_rms_norm") else args[0]
    return x.shape[0]


FAULTY = ("row_linear", "row_mlp", "row_rms_norm", "block_attention", "row_rope")


@pytest.mark.parametrize("name", FAULTY)
def test_planted_fault_is_caught(name, monkeypatch):
    """A kernel whose bits depend on its call (one ulp when the call holds more than the duplicate pair of rows,
    or more than one sequence) is caught by the construction check, and by the batch check."""
    lm, fmt = _lm("llama", torch.float32, "invariant")
    monkeypatch.setattr(kernels, name, _nudged(getattr(kernels, name), lambda a, k: _tokens(name, a, k) > 2))
    r = invariance.construction_check(lm, fmt, _prompt(fmt), TINY_CAPS)
    assert r["live_vs_prefill"] or not r["logits_live_vs_prefill"]
    monkeypatch.undo()
    monkeypatch.setattr(kernels, name, _nudged(getattr(kernels, name), lambda a, k: _batch(name, a, k) > 1))
    target = _prompt(fmt)
    b = invariance.batch_check(lm, target, [target[:-3]], sizes=(2,))
    assert not b[2]["logits_equal"] or b[2]["cache_differs"]


def test_uncovered_operation_fails_closed():
    lm, fmt = _lm("llama", torch.float32, "invariant")
    live = decode.decode_live(lm, fmt, _prompt(fmt), TINY_CAPS)
    # a forward hook on a decoder layer reduces its output: no covered kernel runs it
    def reduce(module, args, output):
        torch.sum(output[0] if isinstance(output, tuple) else output)

    hook = lm.model.model.layers[0].register_forward_hook(reduce)
    try:
        with pytest.raises(kernels.UncoveredOperationError, match="sum ran outside every covered kernel"):
            decode.build_prefill(lm, fmt, live.ids)
    finally:
        hook.remove()
    with kernels.installed(lm.model, "invariant"), pytest.raises(kernels.UncoveredOperationError, match="softmax"):
        torch.softmax(torch.ones(3), -1)
    assert torch.softmax(torch.ones(2), -1).tolist() == [0.5, 0.5]  # nothing is left installed


def test_uncovered_models_and_values_are_refused(windowed_arch):
    lm = tiny_lm(windowed_arch)
    with pytest.raises(kernels.KernelContractError, match="covers"), kernels.installed(lm.model, "invariant"):
        pass
    with pytest.raises(ValueError, match="unknown kernels value"):
        resolve_contract(kernels="fast")
    with pytest.raises(ValueError, match="eager decoders only"):
        ArmSettings(profile="smoke", dtype="float32", caps=TINY_CAPS, kernels="invariant-except-linear",
                    step_path="engine-eager")
    with pytest.raises(ValueError, match="kernels"):
        resolve_execution("nb.ipynb", {"kernels": "invariant-except-softmax"})


def test_engine_refuses_the_graph_path_under_invariant_kernels():
    from kvreplay.engine import EngineRun, StepEngine

    lm, fmt = _lm("llama", torch.float32, "invariant")
    with pytest.raises(ContractError, match="step_path 'graph' is not covered"):
        StepEngine(lm, fmt, EngineRun(batch=1, max_len=64, step_path="graph"))


def test_key_entry_only_when_not_default():
    assert resolve_contract().key() == {}
    assert resolve_contract(kernels="invariant").key() == {"kernels": "invariant"}
    assert resolve_contract(kernels="invariant-except-norm").key() == {"kernels": "invariant-except-norm"}
    settings = ArmSettings(profile="smoke", dtype="float32", caps=TINY_CAPS)
    problems = tiny_problems(1)
    config = settings.config("exp1", problems)
    assert "execution" not in config
    other = ArmSettings(profile="smoke", dtype="float32", caps=TINY_CAPS, kernels="invariant").config("exp1", problems)
    assert other == config | {"execution": {"kernels": "invariant"}}


def test_environment_records_kernels_only_when_not_default():
    from kvreplay.model.models import environment_record

    lm = tiny_lm("llama")
    lm.contract = resolve_contract()
    assert "kernels" not in environment_record(lm)["contract"]  # today's environment records are unchanged
    lm.contract = resolve_contract(kernels="invariant")
    env = environment_record(lm)["contract"]
    assert env["kernels"] == "invariant" and env["kernels_attention_block"] == kernels.ATTENTION_BLOCK


@pytest.mark.parametrize("value", ["invariant", "invariant-except-lm_head"])
def test_fp32_readout_runs_under_invariant_kernels(value):
    """The FP32 readout's float32 copies of the norm and head are covered: prefill, incremental and live give the
    same readout logits bit for bit, and the readout writes the same cache as the plain build."""
    lm, fmt = _lm("qwen2", torch.bfloat16, value)
    readout = decode.FP32Readout(lm)
    live = decode.decode_live(lm, fmt, _prompt(fmt), TINY_CAPS)
    pre_ro = decode.build_prefill(lm, fmt, live.ids, readout=readout)
    inc_ro = decode.build_incremental(lm, fmt, live.ids, readout=readout)
    assert pre_ro.logits.dtype == torch.float32 and torch.equal(pre_ro.logits, inc_ro.logits)
    plain = decode.build_prefill(lm, fmt, live.ids)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(gates.cache_tensors(plain.cache), gates.cache_tensors(pre_ro.cache)))
    suffix = decode.decode_suffix(lm, fmt, pre_ro, TINY_CAPS, readout=readout)
    assert suffix.tokens == decode.decode_suffix(lm, fmt, inc_ro, TINY_CAPS, readout=readout).tokens


def test_readout_default_is_the_modules_own_code():
    lm = tiny_lm("llama", torch.float32)
    norm, head = lm.model.model.norm, lm.model.get_output_embeddings()
    x = torch.randn(5, lm.model.config.hidden_size)
    assert torch.equal(kernels.readout("default", norm, head, x), head(norm(x)))
    one = kernels.readout("invariant", norm, head, x[2:3])
    assert torch.equal(kernels.readout("invariant", norm, head, x)[2:3], one)  # a row alone = the row among five


def test_second_attention_order_is_its_own_value(monkeypatch):
    """``invariant-attention-block-128``: every class invariant, attention over key blocks of 128 (a second fixed
    order); prefill = live = incremental under it too; its own key entry and environment record; the engine refuses it."""
    value = "invariant-attention-block-128"
    spec = kernels.parse_kernels(value)
    assert spec.invariant == frozenset(kernels.CLASSES) and spec.attention_block == 128
    assert kernels.parse_kernels("invariant").attention_block == kernels.ATTENTION_BLOCK == 64
    blocks = []
    original = kernels.block_attention
    monkeypatch.setattr(kernels, "block_attention", lambda *a, **k: blocks.append(k.get("block")) or original(*a, **k))
    lm, fmt = _lm("llama", torch.float32, value)
    r = invariance.construction_check(lm, fmt, _prompt(fmt), TINY_CAPS)
    assert r["live_vs_incremental"] == [] and r["live_vs_prefill"] == [], r
    assert blocks and set(blocks) == {128}
    assert resolve_contract(kernels=value).key() == {"kernels": value}
    from kvreplay.model.models import environment_record
    assert environment_record(lm)["contract"]["kernels_attention_block"] == 128
    with pytest.raises(ValueError, match="eager decoders only"):
        ArmSettings(profile="smoke", dtype="float32", caps=TINY_CAPS, kernels=value, step_path="engine-eager")


def test_block_size_changes_only_the_key_sums():
    """Blocks of 64 and 128 give the same output up to rounding, and the same bits when every query sees at most 64
    keys (one block either way)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 40, 8, generator=g)
    k, v = torch.randn(1, 1, 200, 8, generator=g), torch.randn(1, 1, 200, 8, generator=g)
    mask = torch.ones(1, 1, 40, 200, dtype=torch.bool).tril(160)
    a, b = (kernels.block_attention(q, k, v, mask, 8 ** -0.5, block=n) for n in (64, 128))
    assert torch.allclose(a, b, atol=1e-5)
    short = torch.zeros_like(mask)
    short[..., :50] = True
    assert torch.equal(*(kernels.block_attention(q, k, v, short, 8 ** -0.5, block=n) for n in (64, 128)))
