"""Sliding-window and local/global attention in every construction (tiny random Gemma 3 and Mistral models, FP32).

The reference is the model's own forward over the same flat IDs in one call, its masks built by ``transformers``
itself (``create_causal_mask`` / ``create_sliding_window_causal_mask``, which apply the window) with the role
visibility of Table 2 passed as their ``and_mask_function``: the window convention is transformers', not ours.
"""

from __future__ import annotations

import pytest
import torch
from conftest import GEMMA3_LAYER_TYPES, TINY_CAPS, TINY_FORMAT, TINY_WINDOW, key_paths, tiny_lm, tiny_problems
from kvreplay import caches, decode, drift, gates
from kvreplay.contract import BRANCH1, BRANCH2, BRANCH3, MERGE, ContractError, resolve_format, visibility_matrix
from kvreplay.experiments.matrix import comparison
from kvreplay.models import ModelLoadError, attention_layout, cache_refusal, kv_cache, self_check
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


def test_the_engine_refuses_a_windowed_model_before_any_row(tiny_format):
    from kvreplay.runner import ArmSettings

    lm = tiny_lm("gemma3")
    settings = ArmSettings(profile="t", dtype="float32", caps=TINY_CAPS, step_path="engine-eager", batch=1)
    with pytest.raises(ValueError, match="does not apply sliding windows yet.*step_path 'eager'"):
        settings.engine_run(tiny_format(lm), tiny_problems(1), lm.model.config)
    assert settings.engine_run(tiny_format(lm), tiny_problems(1), tiny_lm("llama").model.config) is not None


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
