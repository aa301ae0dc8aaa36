"""Block contract, masks and the decoders on tiny random-weight Llama and Qwen2 models (paper §3.1–3.2)."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_CAPS, TINY_FORMAT, make_tokenizer, tiny_lm, tiny_problems
from kvreplay.decoding import caches, decode
from kvreplay import gates
from kvreplay.decoding.contract import (
    ANSWER,
    BRANCH1,
    BRANCH2,
    BRANCH3,
    MERGE,
    PROMPT,
    ContractError,
    attention_mask_4d,
    resolve_format,
    visibility_matrix,
)


def test_visibility_is_table_2():
    v = visibility_matrix()
    assert v[ANSWER].tolist() == [True, False, False, False, True, True]  # answer never sees branches
    assert v[MERGE].tolist() == [True, True, True, True, True, False]
    for b in (BRANCH1, BRANCH2, BRANCH3):
        assert v[b, PROMPT] and v[b, b] and sum(v[b].tolist()) == 2  # branches blind to each other
    assert v[PROMPT].tolist() == [True, False, False, False, False, False]


def test_mask_is_causal_and_role_aware():
    roles = torch.tensor([[0, 0, 1, 2, 4, 5]]).expand(2, -1)
    m = attention_mask_4d(roles, roles, 0)
    assert m.shape == (2, 1, 6, 6) and m.dtype == torch.bool
    assert not m[0, 0, 1, 2]  # causal
    assert not m[0, 0, 3, 2]  # branch 2 cannot see branch 1
    assert m[0, 0, 4, 2] and m[0, 0, 4, 3]  # merge sees branches
    assert not m[0, 0, 5, 2] and not m[0, 0, 5, 3] and m[0, 0, 5, 4]  # answer sees merge, not branches


def _live(lm, fmt, problem=None):
    p = problem or tiny_problems(1)[0]
    return decode.decode_live(lm, fmt, fmt.prompt_ids(p.question, p.options), TINY_CAPS)


def test_parse_round_trip_matches_live_roles(arch, tiny_format):
    lm = tiny_lm(arch)
    fmt = tiny_format(lm)
    live = _live(lm, fmt)
    parsed = fmt.boundary_parse(live.ids)
    assert list(parsed.roles) == live.roles[0].tolist()
    assert parsed.boundary == len(live.ids)
    suffix = decode.decode_suffix(lm, fmt, live, TINY_CAPS)
    full = fmt.parse(live.ids + suffix.tokens)
    assert full.complete
    assert set(full.roles) == {0, 1, 2, 3, 4, 5}
    m0, m1 = full.content[MERGE]
    assert (live.ids + suffix.tokens)[m0:m1] == suffix.merge
    assert len(suffix.merge) <= TINY_CAPS.merge and len(suffix.answer) <= TINY_CAPS.answer
    assert all(t not in fmt.special_ids for t in suffix.merge + suffix.answer)


def test_prefix_without_boundary_is_rejected(tiny_format):
    lm = tiny_lm()
    fmt = tiny_format(lm)
    live = _live(lm, fmt)
    with pytest.raises(ContractError, match="lacks the boundary"):
        decode.build_prefill(lm, fmt, live.ids[:-3], where="row-x")
    with pytest.raises(ContractError, match="no branch-1 opening"):
        fmt.parse(live.ids[:10], where="row-y")
    bad = list(live.ids)
    bad[fmt.boundary_parse(live.ids).content[BRANCH1][0]] = 1  # a special token inside branch content
    with pytest.raises(ContractError, match="special"):
        fmt.parse(bad, where="row-z")


def test_incremental_equals_live_bit_for_bit(arch, tiny_format):
    for dtype in (torch.float32, torch.bfloat16):
        lm = tiny_lm(arch, dtype)
        fmt = tiny_format(lm)
        live = _live(lm, fmt)
        inc = decode.build_incremental(lm, fmt, live.ids)
        assert inc.schedule == live.schedule
        gates.check_exact("incremental vs live", caches.boundary_tensors(live), caches.boundary_tensors(inc), gate="bridge")
        s1 = decode.decode_suffix(lm, fmt, live, TINY_CAPS)
        s2 = decode.decode_suffix(lm, fmt, inc, TINY_CAPS)
        assert s1.tokens == s2.tokens


def test_incremental_vs_prefill_fp32_within_tolerance(arch, tiny_format):
    lm = tiny_lm(arch, torch.float32)
    fmt = tiny_format(lm)
    live = _live(lm, fmt)
    inc = decode.build_incremental(lm, fmt, live.ids)
    pre = decode.build_prefill(lm, fmt, live.ids)
    for (n, a), (_, b) in zip(gates.cache_tensors(inc.cache), gates.cache_tensors(pre.cache)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=n)
    torch.testing.assert_close(inc.logits, pre.logits, rtol=1e-4, atol=1e-4)


def _full_sequence(lm, fmt):
    live = _live(lm, fmt)
    suffix = decode.decode_suffix(lm, fmt, live, TINY_CAPS)
    return live.ids + suffix.tokens


def _last_logits(lm, ids, roles, path, prompt_len):
    """Last-token logits ``[2, vocab]`` of a sequence, in one call or replaying the live schedule."""
    batch = torch.tensor(ids).expand(2, -1)
    roles = torch.tensor(roles).expand(2, -1)
    cache = decode.DynamicCache(config=lm.model.config)
    with torch.inference_mode():
        if path == "prefill":
            return decode.forward(lm, cache, batch, roles, 0)
        out = decode.forward(lm, cache, batch[:, :prompt_len], roles[:, :prompt_len], 0)
        for i in range(prompt_len, len(ids)):
            out = decode.forward(lm, cache, batch[:, i : i + 1], roles[:, : i + 1], i)
        return out


def _other_tokens(ids, span):
    out = list(ids)
    for i in range(*span):
        out[i] = 100 + (out[i] + 7) % 150  # another ordinary byte token
    return out


@pytest.mark.parametrize("path", ["prefill", "incremental"])
def test_answer_role_never_sees_branch_tokens(arch, path):
    """Answer-role queries ignore branch-role keys: same logits whatever the branch tokens (both paths)."""
    lm = tiny_lm(arch, torch.float32)
    ids = list(range(40, 52)) + list(range(60, 70)) + list(range(80, 86))
    roles = [PROMPT] * 12 + [BRANCH2] * 10 + [ANSWER] * 6
    a = _last_logits(lm, ids, roles, path, 12)
    b = _last_logits(lm, _other_tokens(ids, (12, 22)), roles, path, 12)
    assert torch.equal(a, b)
    # ... and equal (FP32 tolerance) to a forward without the hidden tokens that keeps the original positions
    keep = [i for i, r in enumerate(roles) if r != BRANCH2]
    n = len(keep)
    with torch.inference_mode():
        ref = lm.model(
            input_ids=torch.tensor([ids[i] for i in keep]).unsqueeze(0),
            attention_mask=torch.ones(n, n, dtype=torch.bool).tril().view(1, 1, n, n),
            position_ids=torch.tensor(keep).unsqueeze(0),
        ).logits[0, -1]
    torch.testing.assert_close(a[0], ref, rtol=1e-5, atol=1e-5)
    # the visible tokens do matter (the test can fail)
    c = _last_logits(lm, _other_tokens(ids, (22, 27)), roles, path, 12)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("path", ["prefill", "incremental"])
def test_branches_blind_to_each_other_in_contract_sequence(arch, tiny_format, path):
    """In a real multi-branch sequence, branch 3's logits ignore branches 1 and 2 (both paths)."""
    lm = tiny_lm(arch, torch.float32)
    fmt = tiny_format(lm)
    ids = _full_sequence(lm, fmt)
    parsed = fmt.parse(ids)
    end3 = parsed.content[BRANCH3][1] + len(fmt.closers[BRANCH3])
    seq, roles = ids[:end3], parsed.roles[:end3]
    other = _other_tokens(_other_tokens(seq, parsed.content[BRANCH1]), parsed.content[BRANCH2])
    assert other != seq
    a = _last_logits(lm, seq, roles, path, parsed.prompt_len)
    b = _last_logits(lm, other, roles, path, parsed.prompt_len)
    assert torch.equal(a, b)


def test_answer_block_never_reads_branch_cache_entries(arch, tiny_format):
    """Overwrite every branch position's K/V at every layer: the answer block's decode is bit-identical."""
    lm = tiny_lm(arch, torch.float32)
    fmt = tiny_format(lm)
    live = _live(lm, fmt)
    parsed = fmt.boundary_parse(live.ids)
    rep = caches.live_replica(live)
    branch_pos = [i for i, r in enumerate(parsed.roles) if r in (BRANCH1, BRANCH2, BRANCH3)]
    s1 = decode.decode_suffix(lm, fmt, live, TINY_CAPS)
    # decode the merge block of the replica normally, then scramble branch K/V before the answer block
    cursor = decode.BlockCursor(fmt, TINY_CAPS, MERGE)
    with torch.inference_mode():
        new, roles, logits, _ = decode._run(
            lm, cursor, rep.cache, rep.ids, rep.roles, rep.logits, stop=lambda c: c.role == ANSWER and c.in_content
        )
        for layer in rep.cache.layers:
            layer.keys[:, :, branch_pos] = torch.randn_like(layer.keys[:, :, branch_pos])
            layer.values[:, :, branch_pos] = torch.randn_like(layer.values[:, :, branch_pos])
        rest, _, _, _ = decode._run(lm, cursor, rep.cache, rep.ids + new, roles, logits, stop=lambda c: c.done)
    assert new + rest == s1.tokens


def test_zero_role_table_changes_no_bit(tiny_format):
    lm = tiny_lm("llama", torch.bfloat16)
    fmt = tiny_format(lm)
    live = _live(lm, fmt)
    zero = tiny_lm("llama", torch.bfloat16, role_table=torch.zeros(14, 64, dtype=torch.bfloat16))
    live0 = _live(zero, fmt)
    assert live.ids == live0.ids
    gates.check_exact("zero role rows", caches.boundary_tensors(live), caches.boundary_tensors(live0))


def test_role_table_rows_are_used(tiny_format):
    table = torch.zeros(14, 64)
    table[8 + ANSWER] = 5.0  # only the answer row is nonzero
    lm = tiny_lm("llama", role_table=table)
    base = tiny_lm("llama")
    fmt = tiny_format(lm)
    a, b = _live(lm, fmt), _live(base, fmt)
    gates.check_exact("answer row unused before the boundary", caches.boundary_tensors(a), caches.boundary_tensors(b))
    sa = decode.decode_suffix(lm, fmt, a, TINY_CAPS)
    sb = decode.decode_suffix(base, fmt, b, TINY_CAPS)
    assert sa.merge == sb.merge  # merge tokens do not carry the answer row


def test_structural_mask_forces_delimiters_and_caps(tiny_format):
    lm = tiny_lm()
    fmt = tiny_format(lm)
    live = _live(lm, fmt)
    parsed = fmt.boundary_parse(live.ids)
    for role in (BRANCH1, BRANCH2, BRANCH3):
        s, e = parsed.content[role]
        assert e - s <= TINY_CAPS.branch
        assert live.ids[e : e + len(fmt.closers[role])] == list(fmt.closers[role])
    assert live.ids[-len(fmt.openers[MERGE]) :] == list(fmt.openers[MERGE])


def test_no_chat_template_gives_clear_error():
    with pytest.raises(ContractError, match="no chat template"):
        resolve_format(make_tokenizer(chat_template=False), TINY_FORMAT)


def test_tokens_format_without_special_delimiter_is_rejected():
    spec = dict(TINY_FORMAT, kind="tokens", prompt_open="<|im_start|>", prompt_close="<|im_end|>",
                open={k: "<|im_start|>" for k in ("branch1", "branch2", "branch3", "merge", "answer")},
                close={k: "END" for k in ("branch1", "branch2", "branch3", "merge", "answer")})
    with pytest.raises(ContractError, match="must begin with a special token"):
        resolve_format(make_tokenizer(), spec)


def test_problem_text_with_special_token_is_rejected(tiny_format):
    lm = tiny_lm()
    fmt = tiny_format(lm)
    with pytest.raises(ContractError, match="special token"):
        fmt.prompt_ids("What does <|im_end|> mean?", ["a", "b"])


def test_format_without_answer_prefix_still_decodes_the_answer(arch):
    """The answer opener may end with the same token as the closer ('\\n' in ChatML); the answer must still be decoded."""
    spec = {k: v for k, v in TINY_FORMAT.items() if k != "answer_prefix"}
    lm = tiny_lm(arch)
    fmt = resolve_format(lm.tokenizer, spec)
    assert fmt.openers[ANSWER][-1] == fmt.closers[ANSWER][-1]
    live = _live(lm, fmt)
    suffix = decode.decode_suffix(lm, fmt, live, TINY_CAPS)
    assert fmt.parse(live.ids + suffix.tokens).complete
    assert suffix.tokens[-len(fmt.closers[ANSWER]):] == list(fmt.closers[ANSWER])
    assert len(suffix.tokens) > len(suffix.merge) + len(fmt.closers[MERGE]) + len(fmt.openers[ANSWER]) + len(fmt.closers[ANSWER]) - 1


def test_format_missing_key_is_named():
    spec = {k: v for k, v in TINY_FORMAT.items() if k != "merge"}
    with pytest.raises(ContractError, match="lacks the key"):
        resolve_format(make_tokenizer(), spec)
