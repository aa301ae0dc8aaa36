"""Greedy semantics, tie accounting, the construction-equivalence and non-finite gates, and the exploratory controls."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_CAPS, tiny_lm, tiny_problems
from kvreplay.decoding import decode
from kvreplay.decoding.contract import BRANCH1, Caps, resolve_format
from kvreplay.decoding.settings import Decoding
from kvreplay.experiments.controls import controls_row, controls_summary, controls_table
from kvreplay.experiments.endpoints import is_tie, tie_initiated
from kvreplay.experiments.fixed_prefix import fixed_prefix_row
from kvreplay.experiments.live_vs_prefill import live_vs_prefill_row
from kvreplay.gates import EQUIVALENCE_TOLERANCE, GateError
from kvreplay.runner import RunSpec

# ----------------------------------------------------------------------------- greedy = argmax, lowest ID on a tie


def test_exact_tie_resolves_to_the_lowest_token_id(tiny_format):
    lm = tiny_lm("llama")
    fmt = tiny_format(lm)
    mask = fmt.content_mask(BRANCH1, "cpu", lm.model.config.vocab_size)
    eligible = torch.nonzero(mask).flatten()
    low, high = int(eligible[10]), int(eligible[40])
    logits = torch.full((lm.model.config.vocab_size,), -5.0)
    logits[low] = logits[high] = 3.0
    cursor = decode.BlockCursor(fmt, TINY_CAPS, BRANCH1)
    token, role, margin, ok = cursor.step(logits)
    assert (token, role, margin, ok) == (low, BRANCH1, 0.0, True)
    logits[high] = 3.0 + 2 ** -7  # one BF16 step above: the higher ID wins, margin positive
    token, _, margin, _ = decode.BlockCursor(fmt, TINY_CAPS, BRANCH1).step(logits)
    assert token == high and margin == pytest.approx(2 ** -7)
    assert decode.first_eligible_argmax(fmt, torch.where(torch.arange(logits.numel()) == high, 3.0, logits)) == low


class _StructuralMask:
    """A logits processor applying the block contract's branch-1 content mask (what the live decoder applies)."""

    def __init__(self, allowed: torch.Tensor):
        self.allowed = allowed

    def __call__(self, input_ids, scores):
        return scores.masked_fill(~self.allowed[: scores.shape[-1]], float("-inf"))


def _branch1_matches_generate(lm, fmt, prompt, caps):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import LogitsProcessorList

    live = decode.decode_live(lm, fmt, prompt, caps)
    parsed = fmt.boundary_parse(live.ids)
    b0, b1 = parsed.content[BRANCH1]
    ours = live.ids[b0:b1]
    opener = list(fmt.openers[BRANCH1])
    closer = fmt.closers[BRANCH1][0]
    ids = torch.tensor([prompt + opener] * 2)
    allowed = fmt.content_mask(BRANCH1, "cpu", lm.model.config.vocab_size)
    with torch.inference_mode(), sdpa_kernel([SDPBackend.MATH]):
        out = lm.model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=caps.branch, eos_token_id=closer,
            pad_token_id=closer, logits_processor=LogitsProcessorList([_StructuralMask(allowed)]),
        )
    theirs = out[0, ids.shape[1]:].tolist()
    if closer in theirs:
        theirs = theirs[: theirs.index(closer)]
    return ours, theirs


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_live_branch1_equals_hf_greedy_generate_on_a_tiny_model(arch, tiny_format):
    lm = tiny_lm(arch)
    fmt = tiny_format(lm)
    caps = Caps(branch=12, merge=4, answer=3)
    for p in tiny_problems(3):
        ours, theirs = _branch1_matches_generate(lm, fmt, fmt.prompt_ids(p.question, p.options), caps)
        assert ours == theirs and len(ours) > 0


@pytest.mark.notebook
def test_live_branch1_equals_hf_greedy_generate_on_the_embedded_model():
    from kvreplay.model.models import load_model
    from kvreplay.data.problems import load_bank

    lm = load_model("embedded", "float32")
    fmt = resolve_format(lm.tokenizer, "chat_multibranch")
    p = load_bank()[0]
    ours, theirs = _branch1_matches_generate(lm, fmt, fmt.prompt_ids(p.question, p.options), Caps(16, 4, 2))
    assert ours == theirs and len(ours) == 16


# ----------------------------------------------------------------------------- tie accounting


def test_tie_accounting():
    assert is_tie([1.0, 0.0, None], 1) and not is_tie([1.0, 0.0, None], 2) and not is_tie([0.5], 3)
    assert tie_initiated([0.5, 0.0], [0.5, 0.25], 1) is True
    assert tie_initiated([0.5, 0.125], [0.5, 0.0], 1) is True
    assert tie_initiated([0.5, 0.125], [0.5, 0.25], 1) is False
    assert tie_initiated([0.5], [0.5], None) is None


def test_row_endpoints_carry_tie_and_letter_fields(tiny_format):
    lm = tiny_lm("llama")
    rec = live_vs_prefill_row(RunSpec(lm=lm, fmt=tiny_format(lm), decoding=Decoding.of(TINY_CAPS)), tiny_problems(1)[0])
    ep = rec["endpoints"]
    assert {"letter_differs", "tie_initiated", "answer_differs"} <= set(ep)
    assert ep["tie_initiated"] is None if ep["first_divergence"] is None else isinstance(ep["tie_initiated"], bool)
    assert ep["letter_differs"] == (rec["arms"]["live"]["predicted"] != rec["arms"]["prefill"]["predicted"])


# ----------------------------------------------------------------------------- construction equivalence


@pytest.fixture
def prefill_sees_shifted_positions(monkeypatch):
    """Plant a non-numerical fault confined to one construction: the prefill call sees position IDs shifted by one,
    while the positions it records stay correct (so the functional-state gate cannot see it)."""
    state = {"on": False}
    inputs, prefill = decode.model_inputs, decode.build_prefill

    def shifted(*args, **kwargs):
        e, m, p = inputs(*args, **kwargs)
        return e, m, (p + 1 if state["on"] else p)

    def faulty(*args, **kwargs):
        state["on"] = True
        try:
            b = prefill(*args, **kwargs)
        finally:
            state["on"] = False
        b.positions = b.positions - 1
        return b

    monkeypatch.setattr(decode, "model_inputs", shifted)
    monkeypatch.setattr(decode, "build_prefill", faulty)


def test_clean_rows_record_rounding_sized_float32_drift(tiny_format):
    lm = tiny_lm("llama")
    p = tiny_problems(1)[0]
    rec = live_vs_prefill_row(RunSpec(lm=lm, fmt=tiny_format(lm), decoding=Decoding.of(TINY_CAPS)), p)
    assert rec["gate_failure"] is None
    assert rec["equivalence"]["rel_l2"] < 1e-5 < EQUIVALENCE_TOLERANCE
    bf = tiny_lm("llama", torch.bfloat16)
    fmt = tiny_format(bf)
    rec = live_vs_prefill_row(RunSpec(lm=bf, fmt=fmt, decoding=Decoding.of(TINY_CAPS), equivalence_ids=frozenset({p.problem_id})), p)
    assert rec["gate_failure"] is None and rec["equivalence"]["dtype"] == "float32"
    assert rec["equivalence"]["rel_l2"] < EQUIVALENCE_TOLERANCE
    other = live_vs_prefill_row(RunSpec(lm=bf, fmt=fmt, decoding=Decoding.of(TINY_CAPS)), p)  # not a preflight row: not checked in BF16
    assert other["equivalence"] is None


@pytest.mark.gate("equivalence")
def test_a_construction_fault_fails_closed_in_either_precision(tiny_format, prefill_sees_shifted_positions):
    p = tiny_problems(1)[0]
    lm = tiny_lm("llama")
    rec = live_vs_prefill_row(RunSpec(lm=lm, fmt=tiny_format(lm), decoding=Decoding.of(TINY_CAPS)), p)
    assert rec["gate_failure"]["gate"] == "equivalence", rec["gate_failure"]
    assert "exceeds the float32 tolerance" in rec["gate_failure"]["reason"]
    bf = tiny_lm("llama", torch.bfloat16)
    fmt = tiny_format(bf)
    rec = live_vs_prefill_row(RunSpec(lm=bf, fmt=fmt, decoding=Decoding.of(TINY_CAPS), equivalence_ids=frozenset({p.problem_id})), p)
    assert rec["gate_failure"]["gate"] == "equivalence"
    rec2 = fixed_prefix_row(RunSpec(lm=bf, fmt=fmt, decoding=Decoding.of(TINY_CAPS), equivalence_ids=frozenset({p.problem_id})), p,
                    rec["prefix"])
    assert rec2["gate_failure"]["gate"] == "equivalence"


def test_preflight_rows_carry_the_equivalence_gate_through_the_runner(tmp_path, monkeypatch, prefill_sees_shifted_positions):
    from kvreplay.runner import spec as runner  # ArmSettings.config looks model_key up there
    from kvreplay.experiments.live_vs_prefill import EXP1
    from kvreplay.runner import ArmSettings

    lm = tiny_lm("llama", torch.bfloat16)
    monkeypatch.setattr(ArmSettings, "load", lambda self, device=None: (lm, resolve_format(lm.tokenizer, _tiny_spec())))
    monkeypatch.setattr(runner, "model_key", lambda model: {"model": "tiny"})
    monkeypatch.setattr(ArmSettings, "config", lambda self, name, problems: {"experiment": name, "t": 1})
    settings = ArmSettings(profile="t", dtype="bfloat16", caps=TINY_CAPS, preflight=1)
    with pytest.raises(GateError, match="preflight row tiny-00 failed gate 'equivalence'"):
        EXP1.run(settings, tiny_problems(2), ledger_root=tmp_path, progress=False)


def _tiny_spec():
    from conftest import TINY_FORMAT

    return TINY_FORMAT


# ----------------------------------------------------------------------------- non-finite logits


@pytest.mark.gate("nonfinite")
def test_nan_logits_are_nonfinite_not_desync(tiny_format):
    lm = tiny_lm("llama")
    fmt = tiny_format(lm)
    prompt = fmt.prompt_ids("Q?", ["a", "b"])
    real = lm.model.forward
    calls = {"n": 0}

    def nan_after_three(*args, **kwargs):
        out = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] > 3:
            out.logits[:, -1, :] = float("nan")  # both duplicate rows alike
        return out

    lm.model.forward = nan_after_three
    with pytest.raises(GateError) as e:
        decode.decode_live(lm, fmt, prompt, TINY_CAPS)
    assert e.value.gate == "nonfinite"
    lm.model.forward = real


def test_nan_in_a_cache_is_caught_before_the_duplicate_gate(tiny_format):
    lm = tiny_lm("llama")

    def poison(states):
        with torch.inference_mode():
            states["prefill"].cache.layers[0].keys[:, 0, 0, 0] = float("nan")

    rec = live_vs_prefill_row(RunSpec(lm=lm, fmt=tiny_format(lm), decoding=Decoding.of(TINY_CAPS), faults=poison), tiny_problems(1)[0])
    assert rec["gate_failure"]["gate"] == "nonfinite" and "L00.key" in rec["gate_failure"]["reason"]


# ----------------------------------------------------------------------------- exploratory controls


def test_controls_row_fp32_readout_and_null_perturbation(tiny_format):
    lm = tiny_lm("llama", torch.bfloat16)
    fmt = tiny_format(lm)
    problems = tiny_problems(3)
    spec = RunSpec(lm=lm, fmt=fmt, decoding=Decoding.of(TINY_CAPS))
    records = []
    for p in problems:
        prefix = decode.decode_live(lm, fmt, fmt.prompt_ids(p.question, p.options), TINY_CAPS).ids
        rec = controls_row(spec, p, prefix)
        assert rec["gate_failure"] is None, rec["gate_failure"]
        null = rec["null_perturbation"]
        assert 0 <= null["elements_changed"] <= null["elements_target"]
        if null["elements_target"] == 0:  # tiny BF16 models can build identical caches: nothing to match
            assert null["rel_l2"] == 0 and not null["moved"]
        assert rec == controls_row(spec, p, prefix)  # seeded: identical on a rerun
        records.append(rec)
    s = controls_summary(records)
    assert s["n"] == 3 and s["baseline"].n == 3
    table = controls_table(s)
    assert table.shape[1] == 1 and "FP32 readout" in " ".join(table.index)
    assert table.index.is_unique and len(table) == 11


def test_null_perturbation_matches_the_count_and_sizes_of_a_real_difference(tiny_format):
    from kvreplay.decoding import caches
    from kvreplay.experiments.controls import null_perturbation
    from kvreplay.gates import cache_tensors

    lm = tiny_lm("llama", torch.bfloat16)
    fmt = tiny_format(lm)
    p = tiny_problems(1)[0]
    prefix = decode.decode_live(lm, fmt, fmt.prompt_ids(p.question, p.options), TINY_CAPS).ids
    state = decode.build_incremental(lm, fmt, prefix)
    other = caches.clone_boundary(state, "other")
    with torch.inference_mode():
        for layer in other.cache.layers:  # 40 elements per row of each layer's keys, changed in both duplicate rows
            layer.keys[:, 0, :4, :10] += 0.5
    before = [t.clone() for _, t in cache_tensors(state.cache)]
    out, rec = null_perturbation(state, other, seed=7)
    n_layers = len(state.cache.layers)
    assert rec["elements_target"] == 40 * n_layers
    assert 0.8 * rec["elements_target"] <= rec["elements_changed"] <= rec["elements_target"]
    assert rec["rel_l2"] > 0 and rec["real_rel_l2"] > 0
    assert all(torch.equal(a, b) for a, (_, b) in zip(before, cache_tensors(state.cache)))  # the source is untouched
    assert all(torch.equal(t[0], t[1]) for _, t in cache_tensors(out.cache))  # duplicates changed alike
    again, rec2 = null_perturbation(state, other, seed=7)
    assert rec2 == rec and all(torch.equal(a, b) for (_, a), (_, b) in zip(cache_tensors(out.cache), cache_tensors(again.cache)))
    _, rec3 = null_perturbation(state, other, seed=8)
    assert rec3["rel_l2"] != rec["rel_l2"]


def test_fp32_readout_on_a_float32_model_is_the_plain_decoder(tiny_format):
    lm = tiny_lm("qwen2")
    fmt = tiny_format(lm)
    p = tiny_problems(1)[0]
    prefix = decode.decode_live(lm, fmt, fmt.prompt_ids(p.question, p.options), TINY_CAPS).ids
    rec = controls_row(RunSpec(lm=lm, fmt=fmt, decoding=Decoding.of(TINY_CAPS)), p, prefix)
    assert rec["gate_failure"] is None
    assert rec["fp32_readout"]["incremental"] == rec["baseline"]["incremental"]
    assert rec["fp32_readout"]["prefill"] == rec["baseline"]["prefill"]


@pytest.mark.gate("readout")
def test_readout_builds_must_leave_the_cache_unchanged(tiny_format):
    lm = tiny_lm("llama", torch.bfloat16)
    fmt = tiny_format(lm)
    p = tiny_problems(1)[0]
    prefix = decode.decode_live(lm, fmt, fmt.prompt_ids(p.question, p.options), TINY_CAPS).ids

    def skew(states):
        with torch.inference_mode():
            states["prefill_fp32_readout"].cache.layers[1].values.add_(1.0)

    rec = controls_row(RunSpec(lm=lm, fmt=fmt, decoding=Decoding.of(TINY_CAPS), faults=skew), p, prefix)
    assert rec["gate_failure"]["gate"] == "readout"
