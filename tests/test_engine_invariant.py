"""The batched engine under the invariant-kernel contract (``kernels: invariant``), tiny Llama and Qwen2, BF16 and
FP32, on CPU.

What must hold: an engine row equals the eager decoders' row bit for bit (boundary IDs, logits, the cache on every
layer; suffix tokens, margins and top-1 logits), a row alone (B = 1) equals the same row beside companions of other
lengths at B = 2 and B = 7 in another slot, the engine's incremental rebuild equals the eager prefill; a planted
fault (one class left on the default path, or a kernel whose bits depend on the call) is caught; the settings the
contract does not cover are refused before any row; ``make verify`` recomputes a row of such a ledger alone, B = 1.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_CAPS, TINY_FORMAT, tiny_lm
from kvreplay.decoding import decode
from kvreplay import engine, verify
from kvreplay.bench import invariance_checks as invariance
from kvreplay.model import kernels
from kvreplay.decoding.contract import ContractError, resolve_format
from kvreplay.model.execution import resolve_contract
from kvreplay.gates import cache_tensors
from kvreplay.runner import ArmSettings

DTYPES = (torch.float32, torch.bfloat16)


def _lm(arch: str, dtype: torch.dtype, value: str = "invariant"):
    lm = tiny_lm(arch, dtype)
    lm.contract = resolve_contract(kernels=value)
    return lm, resolve_format(lm.tokenizer, TINY_FORMAT)


def _prompts(fmt, n: int = 4) -> list[list[int]]:
    """``n`` prompts of different lengths (the first is the target)."""
    return [fmt.prompt_ids("Q" + "xyz"[i % 3] * (5 * i) + "?", ("x", "y", f"z{i}", "w")) for i in range(n)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_engine_row_is_the_eager_row_alone_or_among_companions(arch, dtype):
    lm, fmt = _lm(arch, dtype)
    prompts = _prompts(fmt)
    r = invariance.engine_check(lm, fmt, prompts[0], prompts[1:], TINY_CAPS, engine.EngineRun(), sizes=(2, 7))
    assert r == {"eager_vs_alone": [], 2: [], 7: []}, r


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_engine_incremental_rebuild_is_the_eager_prefill(dtype):
    lm, fmt = _lm("llama", dtype)
    prompts = _prompts(fmt, 3)
    lives = [decode.decode_live(lm, fmt, p, TINY_CAPS) for p in prompts]
    rebuilt = engine.build_incrementals(lm, fmt, [b.ids for b in lives], engine.EngineRun(batch=3))
    for live, inc in zip(lives, rebuilt):
        pre = decode.build_prefill(lm, fmt, live.ids)
        assert inc.ids == pre.ids and torch.equal(inc.logits, pre.logits)
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(cache_tensors(inc.cache), cache_tensors(pre.cache)))


def _nudged(original, when):
    """A planted fault: ``original``'s result moved by one ulp whenever ``when(args)`` holds."""
    def fault(*args, **kwargs):
        out = original(*args, **kwargs)
        return torch.nextafter(out, torch.full_like(out, float("inf"))) if when(args) else out
    return fault


@pytest.mark.parametrize("fault", ["invariant-except-attention", "invariant-except-linear", "block_attention",
                                   "row_linear"])
def test_a_planted_fault_is_caught(fault, monkeypatch):
    """One class left on the model's default path (FP32, where this CPU's default matmuls and attention depend on
    the call's shape), or an invariant kernel made to depend on the number of rows in its call: the engine check
    names a difference."""
    value = fault if fault.startswith(kernels.EXCEPT) else "invariant"
    lm, fmt = _lm("llama", torch.float32, value)
    if not fault.startswith(kernels.EXCEPT):
        monkeypatch.setattr(kernels, fault, _nudged(getattr(kernels, fault), lambda a: a[0].shape[0] > 2))
    prompts = _prompts(fmt)
    r = invariance.engine_check(lm, fmt, prompts[0], prompts[1:], TINY_CAPS, engine.EngineRun(), sizes=(2,))
    assert r["eager_vs_alone"] or r[2], r


def test_settings_the_contract_does_not_cover_are_refused_before_any_row(windowed_arch):
    lm, fmt = _lm("llama", torch.float32)
    for (run, kwargs), named in (((dict(step_path="graph"), {}), "step_path 'graph'"),
                                 ((dict(attention="flex"), {}), "attention 'flex'"),
                                 ((dict(attention="grouped"), {}), "attention 'grouped'"),
                                 (({}, {"readout": decode.FP32Readout(lm)}), "FP32 readout")):
        with pytest.raises(ContractError, match=named):
            engine.StepEngine(lm, fmt, engine.EngineRun(batch=1, max_len=128, **run), **kwargs)
    other = tiny_lm(windowed_arch)
    other.contract = resolve_contract(kernels="invariant")
    with pytest.raises(kernels.KernelContractError, match="covers|not covered"):
        engine.StepEngine(other, resolve_format(other.tokenizer, TINY_FORMAT), engine.EngineRun(batch=1, max_len=64))
    base = dict(profile="smoke", dtype="float32", caps=TINY_CAPS, kernels="invariant")
    ArmSettings(**base, step_path="engine-eager", batch=4)  # taken
    with pytest.raises(ValueError, match="not 'graph'"):
        ArmSettings(**base, step_path="graph", device="cuda")
    with pytest.raises(ValueError, match="attention 'sdpa'"):
        ArmSettings(**base, step_path="engine-eager", attention="flex", max_len=256)
    with pytest.raises(ValueError, match="eager decoders only"):
        ArmSettings(**(base | {"kernels": "invariant-except-norm"}), step_path="engine-eager")


def test_verify_recomputes_a_row_of_an_invariant_batched_ledger_alone(tmp_path, tiny_arm, monkeypatch):
    """A batched ledger under ``kernels: invariant`` is verified with its row alone at B = 1: byte-identical; and a
    kernel fault that only a batch of more than one problem shows (it reproduces at the recorded B = 3, so a check
    at the recorded shape would pass) is caught."""
    from kvreplay.experiments.live_vs_prefill import EXP1
    from kvreplay.data.problems import Problem

    problems = [Problem(f"p-{i:02d}", "test", i + 1, "Q" + "xyz"[i % 3] * (3 * i) + "?", ("x", "y", "z", "w"), "A")
                for i in range(3)]
    settings = tiny_arm(kernels="invariant", step_path="engine-eager", batch=3)
    model = str(tmp_path / "tiny-llama")
    _, ledger = EXP1.run(settings, problems, ledger_root=tmp_path / "ok", progress=False)
    assert json.loads((ledger.dir / "manifest.json").read_text())["config"]["engine"]["batch"] == 3
    checks = verify.verify_ledger(ledger.dir, rows=1, pick="first", problems=problems, model=model)
    assert [(c.mode, c.ok) for c in checks] == [("bytes", True)], checks
    assert checks[0].detail.endswith("(alone: B=1)")
    original = kernels.block_attention
    monkeypatch.setattr(kernels, "block_attention", _nudged(original, lambda a: a[0].shape[0] > 2))
    _, faulty = EXP1.run(settings, problems, ledger_root=tmp_path / "faulty", progress=False)
    checks = verify.verify_ledger(faulty.dir, rows=1, pick="first", problems=problems, model=model)
    assert [(c.mode, c.ok) for c in checks] == [("bytes", False)], checks


def test_a_gpu_ledger_under_invariant_kernels_does_not_compare_the_batch():
    recorded = {"device": "cuda:0", "device_name": "H", "gpu_capability": "9.0", "gpu_sm_count": 132,
                "cuda_runtime": "13.0", "cublas": "c", "torch": "2.11", "engine": {"step_path": "engine-eager",
                                                                                  "batch": 64}}
    here = recorded | {"engine": {"step_path": "engine-eager", "batch": 1}}
    assert verify.compare_environments(recorded, here).mode == "portable"  # the default contract: batch is owed
    recorded["contract"] = {"kernels": "invariant"}
    assert verify.compare_environments(recorded, here).mode == "bytes"
