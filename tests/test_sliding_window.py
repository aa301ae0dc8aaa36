"""Sliding-window and local/global attention in every construction (tiny random Gemma 3 and Mistral models, FP32).

The reference is the model's own forward over the same flat IDs in one call, its masks built by ``transformers``
itself (``create_causal_mask`` / ``create_sliding_window_causal_mask``, which apply the window) with the role
visibility of Table 2 passed as their ``and_mask_function``: the window convention is transformers', not ours.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import GEMMA3_LAYER_TYPES, TINY_CAPS, TINY_FORMAT, TINY_WINDOW, key_paths, tiny_lm, tiny_problems
from kvreplay.decoding import caches, decode
from kvreplay.analysis import drift
from kvreplay import engine, gates
from kvreplay.decoding.contract import BRANCH1, BRANCH2, BRANCH3, MERGE, ContractError, resolve_format, visibility_matrix
from kvreplay.experiments.matrix import comparison
from kvreplay.model.models import ModelLoadError, attention_layout, cache_refusal, kv_cache, self_check
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

TOL = dict(rtol=1e-4, atol=1e-4)


def _live(lm, fmt):
    p = tiny_problems(1)[0]
    return decode.decode_live(lm, fmt, fmt.prompt_ids(p.question, p.options), TINY_CAPS)


def reference_logits(lm, ids, roles) -> torch.Tensor:
    """Logits ``[n, vocab]`` of one forward over ``ids`` (batch 1) with transformers' own masks AND role visibility."""
    config = lm.model.config
    dev = lm.device
    ids_t = torch.tensor([ids], device=dev)
    r = torch.tensor([roles], device=dev)
    vis = visibility_matrix(dev)
    embeds = lm.model.get_input_embeddings()(ids_t)
    pos = torch.arange(len(ids), device=dev).unsqueeze(0)

    def role_visible(b, h, q, k):
        return vis[r[b, q], r[b, k]]

    kw = dict(config=config, inputs_embeds=embeds, attention_mask=None, past_key_values=None, position_ids=pos,
              and_mask_function=role_visible)
    types = set(attention_layout(config).layer_types)
    masks = {"full_attention": create_causal_mask(**kw), "sliding_attention": create_sliding_window_causal_mask(**kw)}
    mask = masks if len(types) > 1 else masks[types.pop()]
    with torch.inference_mode():
        return lm.model(inputs_embeds=embeds, attention_mask=mask, position_ids=pos, use_cache=False).logits[0]


def test_layouts_of_the_tiny_models(windowed_arch):
    layout = tiny_lm(windowed_arch).layout
    assert layout.window == TINY_WINDOW
    if windowed_arch == "gemma3":
        assert layout.layer_types == tuple(GEMMA3_LAYER_TYPES) and layout.mask_by_type
        assert layout.windows == (TINY_WINDOW, TINY_WINDOW, None, TINY_WINDOW)
    else:  # Mistral gives no layer_types: every layer slides, one mask serves all
        assert layout.kinds() == ["sliding", "sliding"] and not layout.mask_by_type
    assert tiny_lm("llama").layout.windows is None and not tiny_lm("llama").layout.windowed


def test_the_window_is_transformers_own(windowed_arch):
    """With every token in the prompt role (plain causal), the decoders' masks give the logits of the model's forward
    with no mask at all, where transformers builds the sliding-window mask itself; and the window does bite."""
    lm = tiny_lm(windowed_arch)
    n = 5 * TINY_WINDOW
    ids = [40 + (7 * i) % 200 for i in range(n)]
    roles = torch.zeros(2, n, dtype=torch.long)
    embeds, mask, positions = decode.model_inputs(lm, torch.tensor([ids, ids]), roles, 0)
    with torch.inference_mode():
        ours = lm.model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, use_cache=False).logits[0]
        theirs = lm.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
        causal = lm.model(inputs_embeds=embeds, attention_mask=torch.ones(2, 1, n, n, dtype=torch.bool).tril(),
                          position_ids=positions, use_cache=False).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (ours[TINY_WINDOW:] - causal[TINY_WINDOW:]).abs().max() > 1e-2  # a single 4-D mask drops the window
    torch.testing.assert_close(ours[: TINY_WINDOW], causal[: TINY_WINDOW], rtol=1e-5, atol=1e-5)


def test_every_construction_matches_the_models_own_forward(windowed_arch, tiny_format):
    """Live, incremental, prefill, replicas, whole and partial transplants: boundary logits equal the reference's last
    logits (FP32 rounding); the suffix decoder's one-token calls keep the cache a one-call forward would build."""
    lm = tiny_lm(windowed_arch)
    fmt = tiny_format(lm)
    live = _live(lm, fmt)
    z = live.ids
    assert len(z) > 10 * TINY_WINDOW  # the branches lie far outside every sliding layer's window at the boundary
    ref = reference_logits(lm, z, live.roles[0].tolist())[-1]
    inc = decode.build_incremental(lm, fmt, z)
    pre = decode.build_prefill(lm, fmt, z)
    rep = caches.live_replica(pre)
    whole, _ = caches.transplant(pre, inc, label="prefill<-incremental")
    half, prov = caches.transplant(pre, inc, layers=[0], label="prefill<-incremental L00")
    assert {p["source"] for p in prov if p["layer"] == 0} == {"incremental"}
    assert {p["source"] for p in prov if p["layer"] > 0} == {"prefill"}
    for state in (live, inc, pre, rep, whole, half):
        assert state.windows == lm.layout.windows
        for name, t in gates.cache_tensors(state.cache):
            assert t.shape[-2] == len(z), name  # every layer keeps every position
        torch.testing.assert_close(state.logits[0], ref, **TOL, msg=state.construction)
    gates.check_functional_state({"live": live, "incremental": inc, "prefill": pre})
    # the suffix: the cache after the shared suffix decoder equals a one-call prefill of the whole sequence
    suffix = decode.decode_suffix(lm, fmt, inc, TINY_CAPS)
    full = z + suffix.tokens[:-1]  # the last token is chosen but never fed
    parsed = fmt.parse(z + suffix.tokens)
    roles = torch.tensor(parsed.roles[: len(full)]).expand(2, -1)
    one = kv_cache(lm.model.config)
    with torch.inference_mode():
        decode.forward(lm, one, torch.tensor(full).expand(2, -1), roles, 0)
    for (n, a), (_, b) in zip(gates.cache_tensors(inc.cache), gates.cache_tensors(one)):
        torch.testing.assert_close(a, b, **TOL, msg=n)
    # every token the model chose (not forced) is the reference's eligible argmax at its step
    logits = reference_logits(lm, full, list(parsed.roles[: len(full)]))
    chosen = [i for i, m in enumerate(suffix.margins) if m is not None]
    assert len(chosen) > TINY_CAPS.merge // 2
    for i in chosen:
        role = parsed.roles[len(z) + i]
        step = logits[len(z) + i - 1] if i else ref
        eligible = step.masked_fill(~fmt.content_mask(role, width=step.shape[-1]), float("-inf"))
        assert int(eligible.argmax()) == suffix.tokens[i], i


@pytest.mark.parametrize("edge_in", [BRANCH1, BRANCH2, BRANCH3])
def test_branches_straddling_the_window_edge(windowed_arch, edge_in):
    """The window's edge, seen from the boundary, falls inside one branch: constructions still equal the reference,
    and the result differs from the same weights with a window wide enough to see everything."""
    probe = tiny_lm(windowed_arch)
    fmt = resolve_format(probe.tokenizer, TINY_FORMAT)
    z = _live(probe, fmt).ids
    parsed = fmt.boundary_parse(z)
    s, e = parsed.content[edge_in]
    window = len(z) - (s + e) // 2  # the boundary query sees the second half of this branch's content, not the first
    lm = tiny_lm(windowed_arch, window=window)
    wide = tiny_lm(windowed_arch, window=4 * len(z))
    assert lm.layout.window == window
    ref = reference_logits(lm, z, list(parsed.roles))[-1]
    inc, pre = decode.build_incremental(lm, fmt, z), decode.build_prefill(lm, fmt, z)
    for state in (inc, pre):
        torch.testing.assert_close(state.logits[0], ref, **TOL, msg=state.construction)
    assert (ref - reference_logits(wide, z, list(parsed.roles))[-1]).abs().max() > 1e-3
    cmp = comparison(inc, pre, per_tensor=True)
    sliding = [t for t in cmp["tensors"] if t["layer_kind"] == "sliding"]
    assert sliding and all(t["positions"] == [len(z) - window + 1, len(z)] for t in sliding)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_incremental_equals_live_bit_for_bit(windowed_arch, tiny_format, dtype):
    lm = tiny_lm(windowed_arch, dtype)
    fmt = tiny_format(lm)
    live = _live(lm, fmt)
    inc = decode.build_incremental(lm, fmt, live.ids)
    assert inc.schedule == live.schedule
    gates.check_exact("incremental vs live", caches.boundary_tensors(live), caches.boundary_tensors(inc), gate="bridge")
    assert decode.decode_suffix(lm, fmt, live, TINY_CAPS).tokens == decode.decode_suffix(lm, fmt, inc, TINY_CAPS).tokens


def test_prefill_vs_incremental_drift_is_per_layer_kind_and_within_tolerance(windowed_arch, tiny_format):
    lm = tiny_lm(windowed_arch)
    fmt = tiny_format(lm)
    z = _live(lm, fmt).ids
    inc, pre = decode.build_incremental(lm, fmt, z), decode.build_prefill(lm, fmt, z)
    cmp = comparison(inc, pre, per_tensor=True)
    assert cmp["cache"]["scope"] == "attended" and cmp["cache"]["rel_l2"] <= gates.EQUIVALENCE_TOLERANCE
    gates.check_equivalence("prefill vs incremental", cmp["cache"]["rel_l2"])
    kinds = lm.layout.kinds()
    for t in cmp["tensors"]:
        layer = int(t["tensor"][1:3])
        assert t["layer_kind"] == kinds[layer]
        if t["layer_kind"] == "sliding":
            assert t["window"] == TINY_WINDOW and t["positions"] == [len(z) - TINY_WINDOW + 1, len(z)]
            assert t["numel"] == 2 * 2 * (TINY_WINDOW - 1) * 16  # batch x kv heads x attended positions x head dim
            assert t["full_tensor"]["numel"] == 2 * 2 * len(z) * 16
            assert t["ref_geometry"]["shape"] == [2, 2, len(z), 16]  # the stored tensor's geometry
        else:
            assert "positions" not in t and t["numel"] == 2 * 2 * len(z) * 16
    assert cmp["cache"]["numel"] == sum(t["numel"] for t in cmp["tensors"])
    # the ledger schema takes the new fields (a Gemma 3 or Mistral Experiment 1 row validates)
    from kvreplay.ledger.records import Comparison
    from pydantic import TypeAdapter

    TypeAdapter(Comparison).validate_python(cmp)


def test_full_attention_rows_keep_their_layout(tiny_format):
    """A model without sliding layers writes the drift rows it always wrote: no new key anywhere."""
    lm = tiny_lm("llama")
    fmt = tiny_format(lm)
    z = _live(lm, fmt).ids
    cmp = comparison(decode.build_incremental(lm, fmt, z), decode.build_prefill(lm, fmt, z), per_tensor=True)
    paths = key_paths(cmp)
    assert not {p for p in paths if any(w in p for w in ("layer_kind", "window", "positions", "full_tensor", "scope"))}


def test_drift_outside_the_window_is_not_drift_of_the_attended_state(windowed_arch, tiny_format):
    """A change at positions no later query of a sliding layer can see shows in ``full_tensor`` only."""
    lm = tiny_lm(windowed_arch)
    fmt = tiny_format(lm)
    z = _live(lm, fmt).ids
    inc = decode.build_incremental(lm, fmt, z)
    other = caches.clone_boundary(inc, "scribbled")
    sliding = [i for i, w in enumerate(lm.layout.windows) if w is not None]
    with torch.inference_mode():
        for i in sliding:
            other.cache.layers[i].keys[:, :, :10] += 1.0
    cmp = comparison(inc, other, per_tensor=True)
    assert cmp["cache"]["exact"] and cmp["cache"]["rel_l2"] == 0.0
    moved = [t for t in cmp["tensors"] if t["tensor"].endswith("key") and int(t["tensor"][1:3]) in sliding]
    assert moved and all(t["exact"] and not t["full_tensor"]["exact"] for t in moved)
    with pytest.raises(gates.GateError, match="replica"):  # storage and replica gates compare the whole tensors
        caches.verify_replica(inc, other)


def test_null_perturbation_draws_inside_the_window(tiny_format):
    from kvreplay.experiments.controls import null_perturbation

    lm = tiny_lm("gemma3", torch.bfloat16)
    fmt = tiny_format(lm)
    z = _live(lm, fmt).ids
    inc = decode.build_incremental(lm, fmt, z)
    other = caches.clone_boundary(inc, "other")
    with torch.inference_mode():
        for layer in other.cache.layers:  # differences everywhere, inside and outside the windows
            layer.values += 0.5
    out, rec = null_perturbation(inc, other, seed=3)
    n_attended = sum(t[0].numel() for _, t in drift.attended(gates.cache_tensors(inc.cache), inc.windows)) // 2
    assert 0 < rec["elements_target"] <= n_attended  # counted over the attended positions only
    for i, w in enumerate(lm.layout.windows):
        if w is not None:
            for part in ("keys", "values"):
                before, after = getattr(inc.cache.layers[i], part), getattr(out.cache.layers[i], part)
                assert torch.equal(before[:, :, : len(z) - w + 1], after[:, :, : len(z) - w + 1])


def test_a_transplant_between_layouts_is_refused(tiny_format):
    lm = tiny_lm("gemma3")
    fmt = tiny_format(lm)
    z = _live(lm, fmt).ids
    inc, pre = decode.build_incremental(lm, fmt, z), decode.build_prefill(lm, fmt, z)
    pre.windows = None
    with pytest.raises(gates.GateError, match="sliding windows per layer differ"):
        caches.transplant(pre, inc)


def test_whole_cache_transplant_follows_its_donor(windowed_arch, tiny_format):
    lm = tiny_lm(windowed_arch, torch.bfloat16)
    fmt = tiny_format(lm)
    z = _live(lm, fmt).ids
    inc, pre = decode.build_incremental(lm, fmt, z), decode.build_prefill(lm, fmt, z)
    donor = decode.decode_suffix(lm, fmt, caches.clone_boundary(inc, "donor"), TINY_CAPS).tokens
    state, _ = caches.transplant(pre, inc)
    state.logits = inc.logits.clone()  # the whole state is the donor's: the first step too
    assert decode.decode_suffix(lm, fmt, state, TINY_CAPS).tokens == donor


def test_self_check_covers_the_layer_types(windowed_arch):
    result = self_check(tiny_lm(windowed_arch))
    assert result["passed"] and result["window"] == TINY_WINDOW
    if windowed_arch == "gemma3":
        assert result["sliding_hidden_vs_hidden"] > 0 and result["sliding_hidden_vs_visible"] > 0
        assert result["layer_types"] == ["sliding", "sliding", "full", "sliding"]


def test_self_check_fails_when_every_layer_reads_one_mask():
    lm = tiny_lm("gemma3")
    forward = lm.model.forward

    def one_mask(*args, **kwargs):
        mask = kwargs["attention_mask"]
        kwargs["attention_mask"] = mask["full_attention"] if isinstance(mask, dict) else mask
        return forward(*args, **kwargs)

    lm.model.forward = one_mask
    with pytest.raises(ModelLoadError, match="sliding layers read the full-attention layers' mask"):
        self_check(lm)


def test_cache_refusal_takes_sliding_windows_and_still_refuses_recurrent_layers():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3NextConfig

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    assert cache_refusal(MistralConfig(**small, sliding_window=32)) is None
    mixed = Qwen2Config(**small, sliding_window=32, use_sliding_window=True, max_window_layers=1)
    assert cache_refusal(mixed) is None and attention_layout(mixed).windows == (None, 32)
    hybrid = Qwen3NextConfig(**small, layer_types=["linear_attention", "full_attention"])
    assert "linear_attention (layer 0 of 2)" in cache_refusal(hybrid)
    chunked = LlamaConfig(**small)
    chunked.layer_types = ["full_attention", "chunked_attention"]
    chunked.attention_chunk_size = 16
    assert "attention_chunk_size=16" in cache_refusal(chunked)


def test_format_special_tokens_and_instruction_placeholder():
    """A ``kind: tokens`` format may name extra special tokens (Gemma's turn tokens are not marked special by its
    GGUF tokenizer) and place the instruction inside the opener."""
    from conftest import make_tokenizer

    tok = make_tokenizer()
    spec = dict(TINY_FORMAT, kind="tokens", prompt_open="<|im_start|>", prompt_close="<|im_end|>",
                special_tokens=["~"],
                open={k: "~user {instruction}<|im_end|>~model " for k in ("branch1", "branch2", "branch3", "merge", "answer")},
                close={k: "<|im_end|>" for k in ("branch1", "branch2", "branch3", "merge", "answer")})
    fmt = resolve_format(tok, spec)
    tilde = tok("~", add_special_tokens=False).input_ids[0]
    assert tilde in fmt.special_ids and fmt.openers[MERGE][0] == tilde
    assert tok.decode(fmt.openers[BRANCH2]) == "~user b2<|im_end|>~model "
    assert not fmt.content_mask(MERGE)[tilde]
    with pytest.raises(ContractError, match="special token"):
        fmt.prompt_ids("What is ~?", ["a", "b"])
    with pytest.raises(ContractError, match="is 2 tokens"):
        resolve_format(tok, dict(spec, special_tokens=["~~"]))


def test_attended_views_share_storage():
    t = torch.zeros(2, 1, 20, 4)
    (name, view), = drift.attended([("L00.key", t)], [8])
    assert view.shape[-2] == 7 and view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert drift.attended_span(5, 8) == (0, 5) and drift.attended_span(20, None) == (0, 20)


# ------------------------------------------------------------------------------------------- the batched engine
ATTENTIONS = ["sdpa", "grouped", "flex"]
ENGINE_LEN = 256  # the engine's max_len in these tests: a multiple of flex's block, beyond the longest sequence (193)
_ENGINE: dict = {}


def _engine_setup(arch: str, dtype: torch.dtype = torch.float32):
    """Model, format, four prompts and their eager live boundaries (every prefix longer than 128 + the window, so a
    sliding layer's flex blocks start past block 0 late in the boundary and in the suffixes)."""
    if (arch, dtype) not in _ENGINE:
        lm = tiny_lm(arch, dtype)
        fmt = resolve_format(lm.tokenizer, TINY_FORMAT)
        prompts = [fmt.prompt_ids("Q" + "xyz"[i % 3] * (2 * i) + "?", ("x", "y", f"z{i}", "w")) for i in range(4)]
        _ENGINE[arch, dtype] = lm, fmt, prompts, [decode.decode_live(lm, fmt, p, TINY_CAPS) for p in prompts]
    return _ENGINE[arch, dtype]


def _same(a: decode.Suffix, b: decode.Suffix) -> bool:
    return (a.tokens, a.margins, a.merge, a.answer) == (b.tokens, b.margins, b.merge, b.answer)


@pytest.mark.parametrize("window", [TINY_WINDOW, 1, 130])
def test_flex_window_mask_is_the_boolean_window_mask_and_reads_only_blocks_it_needs(window):
    from kvreplay.engine import attention as attn
    from kvreplay.model.models import AttentionLayout, layer_masks

    rows, max_len, group = 10, 384, 2
    g = torch.Generator().manual_seed(4)
    roles = torch.randint(0, 6, (rows, max_len), generator=g)
    position = torch.tensor([0, 7, 8, 127, 128, 135, 136, 255, 300, 383])
    query_role = torch.randint(0, 6, (rows,), generator=g)
    roles[torch.arange(rows), position] = query_role
    vis = visibility_matrix()
    fm = attn.FlexMask(position, query_role, roles, vis, group, window)
    fm.update()
    k = torch.arange(max_len)
    allowed = vis[query_role[:, None], roles] & (k[None, :] <= position[:, None])
    layout = AttentionLayout(("sliding_attention",), window, mask_by_type=False)
    want = layer_masks(layout, allowed.view(1, 1, rows, max_len), position, k).view(rows, max_len)
    b, h = torch.arange(rows).view(rows, 1, 1, 1), torch.zeros(1, 1, 1, 1, dtype=torch.long)
    got = fm.mask_mod(b, h, torch.arange(group).view(1, 1, group, 1), k.view(1, 1, 1, max_len))
    assert torch.equal(got.expand(rows, 1, group, max_len), want[:, None, None, :].expand(rows, 1, group, max_len))
    first = (position - window + 1).clamp(min=0) // attn.FLEX_BLOCK
    assert fm.first_block.tolist() == first.tolist()
    assert fm.kv_num_blocks.flatten().tolist() == (position // attn.FLEX_BLOCK - first + 1).tolist()
    for r in range(rows):  # the blocks the kernel reads: exactly those from the window's first to the row's own
        n = int(fm.kv_num_blocks[r])
        read = fm.block_mask.kv_indices[r, 0, 0, :n].tolist()
        assert read == list(range(int(first[r]), int(position[r]) // attn.FLEX_BLOCK + 1))
        covered = torch.zeros(max_len, dtype=torch.bool)
        for blk in read:
            covered[blk * attn.FLEX_BLOCK:(blk + 1) * attn.FLEX_BLOCK] = True
        assert not (want[r] & ~covered).any()  # every key the window lets through lies in a block read
    assert fm.block_mask.kvreplay_window == window
    with torch.inference_mode():  # the CPU reference is torch's own flex_attention on this mask, bit for bit
        q = torch.randn(rows, 2, group, 16, generator=g)
        kv = torch.randn(rows, 2, max_len, 16, generator=g)
        assert torch.equal(attn.flex_reference(q, kv, kv, fm.block_mask, 0.25),
                           attn._torch_flex_reference(q, kv, kv, fm.block_mask, 0.25))
    with pytest.raises(ValueError, match="at least 1"):
        attn.FlexMask(position, query_role, roles, vis, group, 0)


def test_the_step_attentions_take_the_layers_window_keyword():
    from kvreplay.engine import attention as attn

    q, kv = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 128, 8)
    mask = torch.ones(2, 1, 1, 128, dtype=torch.bool)
    out, _ = attn.grouped_attention(None, q, kv, kv, mask, sliding_window=8)  # accepted: the mask carries the window
    assert torch.equal(out, attn.grouped_attention(None, q, kv, kv, mask)[0])
    with pytest.raises(ValueError, match="sliding_window must be"):
        attn.grouped_attention(None, q, kv, kv, mask, sliding_window=8.0)
    position, qrole = torch.tensor([100, 120]), torch.tensor([MERGE, MERGE])
    roles = torch.full((2, 128), MERGE)
    full = attn.FlexMask(position, qrole, roles, visibility_matrix(), 2)
    sliding = attn.FlexMask(position, qrole, roles, visibility_matrix(), 2, window=8)
    for fm in (full, sliding):
        fm.update()
    attn.flex_attention_step(None, q, kv, kv, sliding.block_mask, sliding_window=8)
    attn.flex_attention_step(None, q, kv, kv, full.block_mask, sliding_window=None)
    with pytest.raises(ValueError, match="sliding window 8, its block mask applies None"):
        attn.flex_attention_step(None, q, kv, kv, full.block_mask, sliding_window=8)  # a sliding layer, a full mask
    with pytest.raises(ValueError, match="sliding window None, its block mask applies 8"):
        attn.flex_attention_step(None, q, kv, kv, sliding.block_mask)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_engine_boundaries_and_suffixes_follow_the_eager_decoders_in_fp32(windowed_arch, attention):
    """Engine-live boundaries: the eager decoders' IDs, logits within float32 rounding, windows carried, and the
    eager path's gates pass on them (functional state, float32 construction equivalence on the attended state);
    the engine's incremental rebuild equals its live boundary bit for bit; suffixes choose the eager tokens."""
    lm, fmt, prompts, lives = _engine_setup(windowed_arch)
    run = engine.EngineRun(batch=2, max_len=ENGINE_LEN, attention=attention)
    got = engine.decode_lives(lm, fmt, prompts, TINY_CAPS, run=run)
    inc = engine.build_incrementals(lm, fmt, [b.ids for b in got][::-1], run=run)[::-1]
    for e, i, w in zip(got, inc, lives):
        assert e.ids == w.ids and e.windows == i.windows == lm.layout.windows
        torch.testing.assert_close(e.logits, w.logits, **TOL)
        for (name, a), (_, b) in zip(gates.cache_tensors(e.cache), gates.cache_tensors(w.cache)):
            assert a.shape[-2] == len(e.ids), name  # full length in every layer
            torch.testing.assert_close(a, b, **TOL, msg=name)
        gates.check_exact("engine incremental vs engine live", caches.boundary_tensors(e), caches.boundary_tensors(i),
                          gate="bridge")
        assert torch.equal(e.logits, i.logits)
        pre = decode.build_prefill(lm, fmt, e.ids)
        gates.check_functional_state({"live": e, "incremental": i, "prefill": pre})
        cmp = comparison(e, pre, per_tensor=True)
        assert cmp["cache"]["scope"] == "attended"
        gates.check_equivalence("prefill vs engine live", cmp["cache"]["rel_l2"])
    suffixes = engine.decode_suffixes(lm, fmt, got, TINY_CAPS, run=run)
    want = [decode.decode_suffix(lm, fmt, caches.live_replica(s), TINY_CAPS) for s in lives]
    assert [s.tokens for s in suffixes] == [w.tokens for w in want]


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_engine_applies_the_window_at_the_edge_inside_a_branch(attention):
    """The boundary query's window edge falls inside branch 2: the engine's boundary logits are the model's own forward
    (transformers' masks), and differ from a window wide enough to see everything."""
    probe = tiny_lm("gemma3")
    fmt = resolve_format(probe.tokenizer, TINY_FORMAT)
    p = tiny_problems(1)[0]
    prompt = fmt.prompt_ids(p.question, p.options)
    z = decode.decode_live(probe, fmt, prompt, TINY_CAPS).ids
    parsed = fmt.boundary_parse(z)
    s, e = parsed.content[BRANCH2]
    window = len(z) - (s + e) // 2
    lm, wide = tiny_lm("gemma3", window=window), tiny_lm("gemma3", window=4 * len(z))
    ref = reference_logits(lm, z, list(parsed.roles))[-1]
    (inc,) = engine.build_incrementals(lm, fmt, [z], run=engine.EngineRun(batch=1, max_len=ENGINE_LEN, attention=attention))
    torch.testing.assert_close(inc.logits[0], ref, **TOL)
    (far,) = engine.build_incrementals(wide, fmt, [z], run=engine.EngineRun(batch=1, max_len=ENGINE_LEN, attention=attention))
    assert (far.logits[0] - inc.logits[0]).abs().max() > 1e-3


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_engine_bits_do_not_depend_on_slot_or_companions_in_bf16(windowed_arch, attention):
    lm, fmt, prompts, lives = _engine_setup(windowed_arch, torch.bfloat16)
    run = engine.EngineRun(batch=3, max_len=ENGINE_LEN, attention=attention)
    x = lives[0]
    a = engine.decode_suffixes(lm, fmt, [x, lives[1], lives[2]], TINY_CAPS, run=run)
    b = engine.decode_suffixes(lm, fmt, [lives[3], lives[2], x], TINY_CAPS, run=run)
    alone = engine.decode_suffixes(lm, fmt, [x], TINY_CAPS, run=dataclasses.replace(run, fill_from="last"))  # another slot, two idle
    assert _same(a[0], b[2]) and _same(a[0], alone[0]) and _same(a[2], b[1])
    live = engine.decode_lives(lm, fmt, prompts[:3], TINY_CAPS, run=run)
    inc = engine.build_incrementals(lm, fmt, [s.ids for s in live][::-1], run=run)[::-1]  # other slots
    for l_, i in zip(live, inc):
        gates.check_exact("live vs incremental (BF16)", caches.boundary_tensors(l_), caches.boundary_tensors(i),
                          gate="bridge")
        assert torch.equal(l_.logits, i.logits)


@pytest.mark.parametrize("attention", ["grouped", "flex"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tolerance_gate_passes_on_a_windowed_model(windowed_arch, attention, dtype):
    lm, fmt, _, lives = _engine_setup(windowed_arch, dtype)
    eng = engine.StepEngine(lm, fmt, engine.EngineRun(batch=2, max_len=ENGINE_LEN, attention=attention))
    n = eng.admit(1, lives[3].cache, lives[3].roles)
    eng.set_row_pair(1, 100, n, MERGE, MERGE)
    rec = eng.check_attention("a windowed boundary")
    assert len(rec["rel_err_by_layer"]) == len(lm.layout.layer_types)
    assert rec["max_rel_err"] <= engine.TOLERANCE[dtype]


def test_tolerance_gate_catches_a_flex_mask_that_forgets_the_window():
    """Planted: the sliding layers' block mask keeps its blocks and its claimed window but drops ``p - k < W``."""
    from kvreplay.engine import attention as attn
    from torch.nn.attention.flex_attention import BlockMask

    lm, fmt, _, lives = _engine_setup("gemma3")
    eng = engine.StepEngine(lm, fmt, engine.EngineRun(batch=2, max_len=ENGINE_LEN, attention="flex"))
    n = eng.admit(0, lives[2].cache, lives[2].roles)
    eng.set_row_pair(0, 100, n, MERGE, MERGE)
    eng.check_attention("clean")
    fm = eng._flex["sliding_attention"]
    full = eng._flex["full_attention"]
    planted = BlockMask.from_kv_blocks(full.kv_num_blocks, full.kv_indices, BLOCK_SIZE=attn.FLEX_BLOCK,
                                       mask_mod=full.mask_mod, seq_lengths=(2, ENGINE_LEN), compute_q_blocks=False)
    planted.kvreplay_window = TINY_WINDOW
    fm.block_mask = planted
    with pytest.raises(gates.GateError, match="attention_tolerance") as err:
        eng.check_attention("planted")
    assert "layer 0's output" in err.value.reason and "3 of 4 layers" in err.value.reason  # the sliding ones


def test_tolerance_gate_catches_a_dense_mask_that_forgets_the_window(monkeypatch):
    """Planted: ``grouped`` gets the full-attention mask on every layer; the gate's reference applies the window."""
    lm, fmt, _, lives = _engine_setup("mistral")
    eng = engine.StepEngine(lm, fmt, engine.EngineRun(batch=1, max_len=ENGINE_LEN, attention="grouped"))
    n = eng.admit(0, lives[1].cache, lives[1].roles)
    eng.set_row_pair(0, 100, n, MERGE, MERGE)
    monkeypatch.setattr(engine.StepEngine, "_dense_mask", lambda self: self._allowed()[:, None, None, :])
    with pytest.raises(gates.GateError, match="2 of 2 layers beyond it") as err:
        eng.check_attention("planted")
    assert err.value.gate == "attention_tolerance"


def test_engine_run_takes_windowed_models_and_refuses_layouts_it_cannot_mask(tiny_format):
    from kvreplay.runner import ArmSettings
    from transformers import Qwen3NextConfig

    lm = tiny_lm("gemma3")
    settings = ArmSettings(profile="t", dtype="float32", caps=TINY_CAPS, step_path="engine-eager", batch=1)
    run = settings.engine_run(tiny_format(lm), tiny_problems(1), lm.model.config)
    assert run is not None and run.max_len >= len(_live(lm, tiny_format(lm)).ids)
    hybrid = Qwen3NextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, layer_types=["linear_attention", "full_attention"])
    with pytest.raises(ValueError, match="cannot mask this model.*linear_attention"):
        settings.engine_run(tiny_format(lm), tiny_problems(1), hybrid)


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_an_experiment1_arm_on_the_engine_passes_every_gate_on_a_tiny_gemma3(tmp_path, attention):
    import json

    import yaml
    from conftest import make_model, make_tokenizer
    from kvreplay.experiments import live_vs_prefill
    from kvreplay.runner import ArmSettings, run_arm

    tok = make_tokenizer()
    make_model("gemma3", len(tok)).save_pretrained(tmp_path / "tiny-gemma3")
    tok.save_pretrained(tmp_path / "tiny-gemma3")
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_FORMAT))
    settings = ArmSettings(profile="t", dtype="bfloat16", caps=TINY_CAPS, model=str(tmp_path / "tiny-gemma3"),
                           fmt=str(tmp_path / "tiny.yaml"), threads=1, preflight=1, step_path="engine-eager",
                           batch=2, attention=attention)
    records, ledger = run_arm("exp1", settings, tiny_problems(3), live_vs_prefill.live_vs_prefill_row,
                              ledger_root=tmp_path, progress=False, chunk=live_vs_prefill.live_vs_prefill_chunk)
    assert len(records) == 3 and all(r["gate_failure"] is None for r in records)
    assert records[0]["equivalence"]["rel_l2"] <= gates.EQUIVALENCE_TOLERANCE  # float32 check, engine rebuild
    for r in records:
        cmp = r["boundary"]["prefill_vs_live"]
        assert cmp["cache"]["scope"] == "attended"
        assert [t["layer_kind"] for t in cmp["tensors"]][::2] == ["sliding", "sliding", "full", "sliding"]
    env = json.loads((ledger.dir / "environment.json").read_text())
    assert env["execution_contract"]["engine"]["step_path"] == "engine-eager"
    events = [json.loads(x) for x in (ledger.dir / "runlog.jsonl").read_text().splitlines()]
    gated = [c["gate"] for e in events if e["event"] == "gates" for c in e["checks"]]
    assert gated == (["composition", "attention_tolerance"] if attention == "flex" else ["composition"])
    if attention == "flex":
        assert env["attention_tolerance"]["max_rel_err"] <= 1e-2
