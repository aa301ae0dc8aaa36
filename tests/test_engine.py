"""Batched decode engine (static per-row KV cache, batched one-token step) on tiny random-weight models, CPU.

What must hold and is asserted here:
- at batch shape B=1 (two rows) the engine chooses the same tokens as the ``DynamicCache`` decoders of
  :mod:`kvreplay.decoding.decode` (FP32); margins, logits and caches are compared within a tolerance, since the
  static cache's key dimension (``max_len``) may change the kernels' reduction order;
- at a fixed batch shape (rows, ``max_len``) a problem's tokens, margins, boundary caches and logits are
  bit-identical whatever its companions and its slot, with slots reused, and from run to run;
- planted desync and non-finite faults are caught and named.
Across batch shapes the bits may differ; nothing here asserts they do not.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import TINY_CAPS, TINY_FORMAT, tiny_lm
from kvreplay.decoding import caches, decode
from kvreplay import engine, gates
from kvreplay.decoding.contract import MERGE, PROMPT, resolve_format
from kvreplay.gates import GateError

MAX_SUFFIX = 200  # fixed max_len of the suffix runs compared bit for bit (batch shape = rows x MAX_SUFFIX)
MAX_LIVE = 220


@functools.cache
def _setup(arch: str, dtype: torch.dtype = torch.float32, role_table: bool = False):
    """Model, format, six prompts of different lengths and their live boundaries (``decode.decode_live``)."""
    table = None
    if role_table:
        g = torch.Generator().manual_seed(3)
        table = (torch.randn(14, 64, generator=g) * 2.0).to(dtype)
    lm = tiny_lm(arch, dtype, role_table=table)
    fmt = resolve_format(lm.tokenizer, TINY_FORMAT)
    prompts = [fmt.prompt_ids("Q" + "xyz"[i % 3] * (2 * i) + "?", ("x", "y", f"z{i}", "w")) for i in range(6)]
    lives = [decode.decode_live(lm, fmt, p, TINY_CAPS) for p in prompts]
    return lm, fmt, prompts, lives


def _replicas(states):
    return [caches.live_replica(s) for s in states]


def _same_suffix(a: decode.Suffix, b: decode.Suffix) -> bool:
    """Tokens, margins (exact float equality) and blocks identical."""
    return (a.tokens, a.margins, a.merge, a.answer) == (b.tokens, b.margins, b.merge, b.answer)


def test_batch1_suffix_tokens_equal_decode_suffix(arch):
    lm, fmt, prompts, lives = _setup(arch)
    states = [*lives[:3], decode.build_incremental(lm, fmt, lives[3].ids), decode.build_prefill(lm, fmt, lives[4].ids)]
    before = [[t.clone() for _, t in gates.cache_tensors(s.cache)] for s in states]
    got = engine.decode_suffixes(lm, fmt, states, TINY_CAPS, run=engine.EngineRun(batch=1))
    want = [decode.decode_suffix(lm, fmt, s, TINY_CAPS) for s in _replicas(states)]
    for g, w in zip(got, want):
        assert g.tokens == w.tokens and g.merge == w.merge and g.answer == w.answer
        assert [m is None for m in g.margins] == [m is None for m in w.margins]
        assert [m for m in g.margins if m is not None] == pytest.approx([m for m in w.margins if m is not None],
                                                                      rel=1e-5, abs=1e-5)
    # the boundaries are copied, not consumed
    for s, b in zip(states, before):
        assert all(torch.equal(t, u) for (_, t), u in zip(gates.cache_tensors(s.cache), b))


def test_batch1_with_role_table_equals_decode_suffix():
    lm, fmt, _, lives = _setup("llama", role_table=True)
    got = engine.decode_suffixes(lm, fmt, lives[:2], TINY_CAPS, run=engine.EngineRun(batch=1))
    want = [decode.decode_suffix(lm, fmt, s, TINY_CAPS) for s in _replicas(lives[:2])]
    assert [g.tokens for g in got] == [w.tokens for w in want]


def test_batch1_live_equals_decode_live(arch):
    lm, fmt, prompts, lives = _setup(arch)
    got = engine.decode_lives(lm, fmt, prompts[:3], TINY_CAPS, run=engine.EngineRun(batch=1))
    for g, w in zip(got, lives):
        assert g.ids == w.ids and g.schedule == w.schedule
        assert torch.equal(g.roles, w.roles) and torch.equal(g.positions, w.positions)
        torch.testing.assert_close(g.logits, w.logits, rtol=1e-5, atol=1e-5)
        for (n, a), (_, b) in zip(gates.cache_tensors(g.cache), gates.cache_tensors(w.cache)):
            assert a.shape == b.shape == (2, 2, len(w.ids), 16), n
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=n)
    # an engine boundary feeds the one-problem suffix decoder like any other
    s = decode.decode_suffix(lm, fmt, caches.live_replica(got[0]), TINY_CAPS)
    assert s.tokens == decode.decode_suffix(lm, fmt, caches.live_replica(lives[0]), TINY_CAPS).tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_companions_and_slot_leave_a_problem_bit_identical(arch, dtype):
    lm, fmt, prompts, lives = _setup(arch, dtype)
    x = lives[0]
    a = engine.decode_suffixes(lm, fmt, [x, lives[1], lives[2]], TINY_CAPS, run=engine.EngineRun(batch=3, max_len=MAX_SUFFIX))
    b = engine.decode_suffixes(lm, fmt, [lives[5], lives[4], x], TINY_CAPS, run=engine.EngineRun(batch=3, max_len=MAX_SUFFIX))
    assert _same_suffix(a[0], b[2])  # slot 0 with companions 1, 2 == slot 2 with companions 5, 4
    la = engine.decode_lives(lm, fmt, [prompts[0], prompts[1], prompts[2]], TINY_CAPS, run=engine.EngineRun(batch=3, max_len=MAX_LIVE))
    lb = engine.decode_lives(lm, fmt, [prompts[5], prompts[4], prompts[0]], TINY_CAPS, run=engine.EngineRun(batch=3, max_len=MAX_LIVE))
    assert la[0].ids == lb[2].ids
    gates.check_exact("slot 0 vs slot 2", caches.boundary_tensors(la[0]), caches.boundary_tensors(lb[2]))


def test_slot_reuse_and_per_row_positions_equal_one_problem_runs():
    lm, fmt, prompts, lives = _setup("llama")
    assert len({len(p) for p in prompts}) == len(prompts)  # every row of a batch is at its own position
    calls = lm.calls
    many = engine.decode_suffixes(lm, fmt, lives, TINY_CAPS, run=engine.EngineRun(batch=2, max_len=MAX_SUFFIX))  # 6 problems, 2 slots
    steps = lm.calls - calls
    alone = [engine.decode_suffixes(lm, fmt, [s], TINY_CAPS, run=engine.EngineRun(batch=2, max_len=MAX_SUFFIX))[0] for s in lives]
    assert all(_same_suffix(m, o) for m, o in zip(many, alone))
    assert steps < sum(len(s.tokens) for s in many)  # problems shared steps
    again = engine.decode_suffixes(lm, fmt, lives, TINY_CAPS, run=engine.EngineRun(batch=2, max_len=MAX_SUFFIX))
    assert all(_same_suffix(m, g) for m, g in zip(many, again))  # deterministic
    live_many = engine.decode_lives(lm, fmt, prompts, TINY_CAPS, run=engine.EngineRun(batch=2, max_len=MAX_LIVE))
    assert len({len(b.ids) for b in live_many}) > 1
    for p, m in zip(prompts, live_many):
        one = engine.decode_lives(lm, fmt, [p], TINY_CAPS, run=engine.EngineRun(batch=2, max_len=MAX_LIVE))[0]
        assert m.ids == one.ids
        gates.check_exact("reused slot vs alone", caches.boundary_tensors(m), caches.boundary_tensors(one))


def test_step_writes_each_row_at_its_own_position():
    lm, fmt, _, lives = _setup("qwen2")
    eng = engine.StepEngine(lm, fmt, engine.EngineRun(batch=2, max_len=MAX_SUFFIX))
    lengths = [eng.admit(s, b.cache, b.roles) for s, b in enumerate(lives[1:5:3])]
    assert lengths[0] != lengths[1]
    for s, n in enumerate(lengths):
        eng.set_row_pair(s, 100 + s, n, MERGE, MERGE)
    eng.step()
    keys = eng.cache.layers[0].keys
    for s, n in enumerate(lengths):
        rows = keys[2 * s : 2 * s + 2]
        assert rows[:, :, n].abs().sum() > 0 and torch.equal(rows[0], rows[1])
        assert rows[:, :, n + 1 :].abs().sum() == 0  # nothing beyond the row's own position
    assert eng.roles[0, lengths[0]] == MERGE and eng.roles[2, lengths[1]] == MERGE
    assert eng.roles[0, lengths[0] + 1] == PROMPT  # zero padding


@pytest.mark.gate("desync")
@pytest.mark.gate("nonfinite")
def test_planted_faults_are_caught_and_stay_in_their_row():
    lm, fmt, _, lives = _setup("llama")
    clean = engine.decode_suffixes(lm, fmt, [lives[3], lives[0]], TINY_CAPS, run=engine.EngineRun(batch=2, max_len=MAX_SUFFIX))
    desync = caches.clone_boundary(lives[1], "desync")
    nonfinite = caches.clone_boundary(lives[5], "nonfinite")
    bad_logits = caches.clone_boundary(lives[2], "inf-logits")
    with torch.inference_mode():
        desync.cache.layers[0].keys[1, :, 5] += 0.25  # one duplicate row only
        # both rows (they agree, but are not finite); the step writes NaN keys/values of layer 1 at position 156
        nonfinite.cache.layers[0].values[:, :, 3] = float("nan")
        bad_logits.logits[:, 7] = float("inf")
    with pytest.raises(GateError, match="desync") as err:
        engine.decode_suffixes(lm, fmt, [lives[0], desync], TINY_CAPS, run=engine.EngineRun(batch=2, max_len=MAX_SUFFIX))
    assert err.value.gate == "desync" and "problem 1" in err.value.reason
    got = engine.decode_suffixes(lm, fmt, [lives[3], desync, nonfinite, lives[0]], TINY_CAPS, run=engine.EngineRun(batch=2, max_len=MAX_SUFFIX), on_gate_error="return")
    assert isinstance(got[1], GateError) and got[1].gate == "desync"
    assert isinstance(got[2], GateError) and got[2].gate == "nonfinite"
    # the companion is unaffected, and the slot the NaN problem left (NaN beyond position 146) is cleared
    # before the shorter problem 3 reuses it: masked NaN would still poison its attention
    assert len(lives[0].ids) < len(lives[5].ids)
    assert _same_suffix(got[0], clean[0]) and _same_suffix(got[3], clean[1])
    with pytest.raises(GateError, match="nonfinite"):
        engine.decode_suffixes(lm, fmt, [bad_logits], TINY_CAPS, run=engine.EngineRun(batch=1))


def test_bad_arguments_are_refused():
    lm, fmt, _, lives = _setup("llama")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        engine.decode_suffixes(lm, fmt, lives[:1], TINY_CAPS, run=engine.EngineRun(step_path="graph", batch=1))
    with pytest.raises(ValueError, match="unknown step path"):
        engine.decode_suffixes(lm, fmt, lives[:1], TINY_CAPS, run=engine.EngineRun(step_path="compiled", batch=1))
    with pytest.raises(ValueError, match="max_len"):
        engine.decode_suffixes(lm, fmt, lives[:1], TINY_CAPS, run=engine.EngineRun(batch=1, max_len=len(lives[0].ids) + 3))
    with pytest.raises(ValueError, match="on_gate_error"):
        engine.decode_suffixes(lm, fmt, lives[:1], TINY_CAPS, run=engine.EngineRun(batch=1), on_gate_error="ignore")
    assert engine.decode_suffixes(lm, fmt, [], TINY_CAPS) == []


def test_choice_stats_tie_goes_to_lowest_id_and_mask_applies():
    logits = torch.tensor([[1.0, 5.0, 2.0, 5.0, 9.0], [1.0, 5.0, 2.0, 5.0, 9.0],
                           [0.0, 1.0, 3.0, 2.0, 0.5], [0.0, 1.0, 3.0, float("nan"), 0.5]])
    eligible = torch.tensor([[True, True, True, True, False]] * 2 + [[True] * 5] * 2)
    token, margin, same, finite = engine.choice_stats(logits, eligible).tolist()
    assert token[:2] == [1.0, 1.0] and margin[:2] == [0.0, 0.0]  # exact tie 1 vs 3: lowest ID; 4 is masked out
    assert token[2] == 2.0 and margin[2] == 1.0
    assert same == [1.0, 1.0, 0.0, 0.0] and finite == [1.0, 1.0, 1.0, 0.0]


# ----------------------------------------------------------------------------------------- grouped attention
def _math_sdpa(q, k, v, mask, scale):
    """torch's math SDPA over keys/values repeated per query head (what the ``sdpa`` step computes)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = q.shape[1] // k.shape[1]
    with sdpa_kernel([SDPBackend.MATH]):
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_attention_computes_attention_and_ignores_masked_keys(dtype):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(*shape, generator=g).to(dtype) for shape in ((4, 6, 1, 16), (4, 2, 40, 16), (4, 2, 40, 16)))
    lengths = torch.tensor([1, 7, 23, 40])
    mask = (torch.arange(40)[None, :] < lengths[:, None])[:, None, None, :]
    out, weights = engine.grouped_attention(None, q, k, v, mask, scaling=0.25)
    assert weights is None and out.shape == (4, 1, 6, 16) and out.dtype == dtype
    torch.testing.assert_close(out.float(), _math_sdpa(q, k, v, mask, 0.25).float(),
                               rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5 if dtype == torch.float32 else 1e-2)
    # what the mask hides changes no bit: garbage beyond each row's length
    k2, v2 = k.clone(), v.clone()
    for r, n in enumerate(lengths.tolist()):
        k2[r, :, n:] = 1e4
        v2[r, :, n:] = -1e4
    assert torch.equal(engine.grouped_attention(None, q, k2, v2, mask, scaling=0.25)[0], out)
    # a row's output does not depend on the other rows (the batch dimension is independent)
    assert torch.equal(engine.grouped_attention(None, q[2:3], k[2:3], v[2:3], mask[2:3], scaling=0.25)[0], out[2:3])


def test_grouped_attention_refuses_what_it_does_not_compute():
    q, k = torch.zeros(1, 6, 1, 8), torch.zeros(1, 4, 3, 8)
    kv, mask = k[:, :2], torch.ones(1, 1, 1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="6 heads on 4"):
        engine.grouped_attention(None, q, k, k, mask)
    with pytest.raises(ValueError, match="boolean mask"):
        engine.grouped_attention(None, q, kv, kv, torch.zeros(1, 1, 1, 3))
    with pytest.raises(ValueError, match="boolean mask"):
        engine.grouped_attention(None, q, kv, kv, None)  # no mask: the sdpa path would be causal, this one not
    with pytest.raises(ValueError, match="boolean mask"):
        engine.grouped_attention(None, q, kv, kv, torch.ones(1, 1, 1, 5, dtype=torch.bool))  # longer than the keys
    with pytest.raises(ValueError, match="dropout"):
        engine.grouped_attention(None, q, kv, kv, mask, dropout=0.1)
    with pytest.raises(ValueError, match="softcap"):
        engine.grouped_attention(None, q, kv, kv, mask, softcap=30.0)
    out, _ = engine.grouped_attention(None, q, kv, kv, mask, position_ids=torch.zeros(1, 1), use_cache=True,
                                      is_causal=None)
    assert out.shape == (1, 1, 6, 8)


def test_grouped_step_chooses_the_decoders_tokens_and_restores_the_model(arch):
    from transformers import AttentionInterface
    from kvreplay.engine import attention

    calls = []

    def counted(module, query, key, value, mask, **kw):
        calls.append(tuple(query.shape))
        return attention.grouped_attention(module, query, key, value, mask, **kw)

    AttentionInterface.register(attention._GROUPED, counted)  # the registered function, restored below
    lm, fmt, prompts, lives = _setup(arch)
    try:
        engine.decode_suffixes(lm, fmt, lives[:2], TINY_CAPS, run=engine.EngineRun(batch=2))
        assert calls == []  # the sdpa step never calls it
        got = engine.decode_suffixes(lm, fmt, lives[:3], TINY_CAPS, run=engine.EngineRun(batch=2, attention="grouped"))
    finally:
        AttentionInterface.register(attention._GROUPED, attention.grouped_attention)
    layers = lm.model.config.num_hidden_layers
    assert calls and len(calls) % layers == 0 and all(c[0] == 4 and c[2] == 1 for c in calls)  # every layer, every step
    want = [decode.decode_suffix(lm, fmt, s, TINY_CAPS) for s in _replicas(lives[:3])]
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert lm.model.config._attn_implementation == "sdpa"  # the switch is undone after every step
    live = engine.decode_lives(lm, fmt, prompts[:2], TINY_CAPS, run=engine.EngineRun(batch=2, attention="grouped"))
    assert [b.ids for b in live] == [b.ids for b in lives[:2]]
    with pytest.raises(ValueError, match="unknown attention"):
        engine.decode_suffixes(lm, fmt, lives[:1], TINY_CAPS, run=engine.EngineRun(batch=1, attention="flash"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_step_keeps_companions_slots_and_the_bridge_bit_exact(dtype):
    lm, fmt, prompts, lives = _setup("llama", dtype)
    run = engine.EngineRun(batch=3, max_len=MAX_SUFFIX, attention="grouped")
    x = lives[0]
    a = engine.decode_suffixes(lm, fmt, [x, lives[1], lives[2]], TINY_CAPS, run=run)
    b = engine.decode_suffixes(lm, fmt, [lives[5], lives[4], x], TINY_CAPS, run=run)
    assert _same_suffix(a[0], b[2])
    # the bridge under the grouped step: an engine-live boundary and the teacher-forced rebuild of its prefix
    live = engine.decode_lives(lm, fmt, prompts[:3], TINY_CAPS, run=engine.EngineRun(batch=3, max_len=MAX_LIVE, attention="grouped"))
    inc = engine.build_incrementals(lm, fmt, [b.ids for b in live], run=engine.EngineRun(batch=3, max_len=MAX_LIVE, attention="grouped"))
    for l_, i in zip(live, inc):
        gates.check_exact("live vs incremental (grouped)", caches.boundary_tensors(l_), caches.boundary_tensors(i))
        assert torch.equal(l_.logits, i.logits)
