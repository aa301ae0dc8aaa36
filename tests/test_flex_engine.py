"""The engine's ``flex`` attention, its tolerance gate, and the scheduler that keeps the slots full (CPU).

On the CPU the ``flex`` step runs torch's reference arithmetic of FlexAttention (:func:`kvreplay.engine.flex_reference`,
checked here against torch's own uncompiled ``flex_attention`` bit for bit); the compiled kernels run on a GPU
(``python -m kvreplay.bench engine-suite``). Asserted here:
- the block mask equals the boolean mask the other attentions get, for every pair of query and key roles, and
  its block counts cover every visible key;
- the ``flex`` step stays within the ``attention_tolerance`` gate's bound of math SDPA, and a planted mask fault
  (roles ignored) fails the gate;
- under ``flex``, at a fixed batch shape, a problem's bits do not depend on its slot or companions, idle slots
  and refilled slots included, and the bridge (incremental rebuilt == engine-live) holds;
- boundaries and suffixes sharing one engine give the phase-wise records bit for bit, for every attention;
- the slot-occupancy counter counts exactly the steps jobs spent in slots;
- the ``composition`` gate's run alone moves its problem to another slot and catches a slot-dependent fault.
"""

from __future__ import annotations

import dataclasses

import json

import pytest
import torch
import yaml
from conftest import TINY_CAPS, TINY_FORMAT, make_model, make_tokenizer, tiny_lm
from kvreplay.decoding import caches, decode
from kvreplay import engine, gates
from kvreplay.decoding.contract import ANSWER, MERGE, PROMPT, resolve_format, visibility_matrix
from kvreplay.decoding.settings import Decoding
from kvreplay.engine import attention as attn
from kvreplay.experiments import fixed_prefix, live_vs_prefill
from kvreplay.gates import GateError
from kvreplay.ledger.store import canonical_json
from kvreplay.data.problems import Problem
from kvreplay.runner import ArmSettings, EngineRun, RunSpec, run_arm

MAX_LEN = 256  # a multiple of the flex block (128)


def _problems(n: int) -> list[Problem]:
    return [Problem(f"p-{i:02d}", "test", i + 1, "Q" + "xyz"[i % 3] * (3 * i) + "?", ("x", "y", f"z{i}", "w"),
                    "ABCD"[i % 4]) for i in range(n)]


_SETUPS: dict = {}


def _setup(dtype: torch.dtype = torch.float32):
    if dtype not in _SETUPS:
        lm = tiny_lm("llama", dtype)
        fmt = resolve_format(lm.tokenizer, TINY_FORMAT)
        prompts = [fmt.prompt_ids(p.question, p.options) for p in _problems(6)]
        lives = [decode.decode_live(lm, fmt, p, TINY_CAPS) for p in prompts]
        _SETUPS[dtype] = lm, fmt, prompts, lives
    return _SETUPS[dtype]


def _same(a: decode.Suffix, b: decode.Suffix) -> bool:
    return (a.tokens, a.margins, a.merge, a.answer) == (b.tokens, b.margins, b.merge, b.answer)


# ------------------------------------------------------------------------------------------------ the mask
def test_block_mask_is_the_boolean_mask_for_every_role_pair_and_covers_every_visible_key():
    rows, max_len, group = 12, 384, 3
    vis = visibility_matrix()
    g = torch.Generator().manual_seed(1)
    roles = torch.randint(0, 6, (rows, max_len), generator=g)
    roles[:, :6] = torch.arange(6)  # every key role occurs in every row
    position = torch.tensor([0, 5, 127, 128, 129, 200, 255, 256, 300, 383, 6, 64])
    for q_role in range(6):
        query_role = torch.full((rows,), q_role)
        fm = attn.FlexMask(position, query_role, roles, vis, group)
        fm.update()
        assert fm.kv_num_blocks.flatten().tolist() == (position // 128 + 1).tolist()
        b, h = torch.arange(rows).view(rows, 1, 1, 1), torch.zeros(1, 1, 1, 1, dtype=torch.long)
        q, k = torch.arange(group).view(1, 1, group, 1), torch.arange(max_len).view(1, 1, 1, max_len)
        got = fm.mask_mod(b, h, q, k).expand(rows, 1, group, max_len)
        want = (vis[q_role][roles] & (torch.arange(max_len)[None, :] <= position[:, None]))[:, None, None, :]
        assert torch.equal(got, want.expand(rows, 1, group, max_len)), q_role
        for k_role in range(6):  # each pair: visible iff Table 2 says so (at keys up to the row's position)
            seen = got[:, 0, 0][(roles == k_role) & (torch.arange(max_len)[None, :] <= position[:, None])]
            assert seen.numel() and bool(seen.all()) == bool(vis[q_role, k_role]) and bool(seen.any()) == bool(
                vis[q_role, k_role]), (q_role, k_role)
        # every key the mask lets through lies in a block the row reads (the kernel reads no other)
        blocks = fm.kv_num_blocks.view(rows, 1) * attn.FLEX_BLOCK
        assert not (want[:, 0, 0] & (torch.arange(max_len)[None, :] >= blocks)).any()
    with pytest.raises(ValueError, match="multiple of 128"):
        attn.FlexMask(position[:2], query_role[:2], roles[:2, :200], vis, group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_reference_is_torch_flex_attention_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(2)
    rows, kv_heads, group, max_len, dim = 6, 2, 3, 256, 16
    position = torch.tensor([0, 3, 127, 128, 200, 255])
    fm = attn.FlexMask(position, torch.randint(0, 6, (rows,), generator=g),
                       torch.randint(0, 6, (rows, max_len), generator=g), visibility_matrix(), group)
    fm.update()
    q, k, v = (torch.randn(*s, generator=g).to(dtype) for s in ((rows, kv_heads, group, dim),
                                                                 (rows, kv_heads, max_len, dim),
                                                                 (rows, kv_heads, max_len, dim)))
    with torch.inference_mode():
        ours = attn.flex_reference(q, k, v, fm.block_mask, 0.25)
        torch_ref = attn._torch_flex_reference(q, k, v, fm.block_mask, 0.25)
    assert torch.equal(ours, torch_ref)


def test_the_gates_reference_is_computed_in_row_blocks_each_row_on_its_own_inputs(monkeypatch):
    """The float64 reference takes a few rows at a time (its repeated keys would otherwise need several times the
    cache's memory); each row's output is the one it has computed alone, and the blocks cover every row once."""
    g = torch.Generator().manual_seed(5)
    rows, heads, kv_heads, keys, dim = 7, 6, 2, 40, 8
    q = torch.randn(rows, heads, 1, dim, generator=g)
    k, v = (torch.randn(rows, kv_heads, keys, dim, generator=g) for _ in range(2))
    allowed = torch.rand(rows, 1, 1, keys, generator=g) < 0.7
    allowed[..., 0] = True
    monkeypatch.setattr(attn, "REFERENCE_ROWS", 3)  # blocks of 3, 3 and 1 rows
    blocked = attn.reference_attention(q, k, v, allowed, 0.3)
    alone = torch.cat([attn.reference_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], allowed[i:i + 1], 0.3)
                       for i in range(rows)])
    assert blocked.shape == (rows, 1, heads, dim) and blocked.dtype == torch.float64
    assert torch.equal(blocked, alone)
    shared = attn.reference_attention(q, k, v, allowed[:1], 0.3)  # one mask broadcast over every row
    assert torch.equal(shared[:1], blocked[:1]) and shared.shape == blocked.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_step_attention_is_math_sdpa_within_tolerance_and_ignores_what_the_mask_hides(dtype):
    g = torch.Generator().manual_seed(3)
    rows, heads, kv_heads, max_len, dim = 4, 6, 2, 256, 16
    q = torch.randn(rows, heads, 1, dim, generator=g).to(dtype)
    k, v = (torch.randn(rows, kv_heads, max_len, dim, generator=g).to(dtype) for _ in range(2))
    position = torch.tensor([0, 7, 130, 255])
    roles = torch.randint(0, 6, (rows, max_len), generator=g)
    query_role = torch.tensor([MERGE, ANSWER, MERGE, ANSWER])
    roles[torch.arange(rows), position] = query_role  # a row always sees its own key
    fm = attn.FlexMask(position, query_role, roles, visibility_matrix(), heads // kv_heads)
    fm.update()
    allowed = (visibility_matrix()[query_role[:, None], roles] & (torch.arange(max_len)[None, :] <= position[:, None]))
    with torch.inference_mode():
        out, weights = attn.flex_attention_step(None, q, k, v, fm.block_mask, scaling=0.25)
        ref = attn.reference_attention(q, k, v, allowed[:, None, None, :], 0.25)
        grouped, _ = attn.grouped_attention(None, q, k, v, allowed[:, None, None, :], scaling=0.25)
        assert weights is None and out.shape == (rows, 1, heads, dim) and out.dtype == dtype
        rel = float(torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref))
        assert rel <= attn.TOLERANCE[dtype]
        torch.testing.assert_close(out.float(), grouped.float(), rtol=1e-5 if dtype == torch.float32 else 2e-2,
                                   atol=1e-5 if dtype == torch.float32 else 2e-2)
        k2, v2 = k.clone(), v.clone()  # what the mask hides changes no bit: garbage wherever it is false
        hidden = ~allowed[:, None, :, None].expand_as(k2)
        k2[hidden], v2[hidden] = 1e4, -1e4
        assert torch.equal(attn.flex_attention_step(None, q, k2, v2, fm.block_mask, scaling=0.25)[0], out)
    with pytest.raises(ValueError, match="block mask"):
        attn.flex_attention_step(None, q, k, v, allowed[:, None, None, :])
    with pytest.raises(ValueError, match="one"):
        attn.flex_attention_step(None, q.expand(rows, heads, 2, dim), k, v, fm.block_mask)
    with pytest.raises(ValueError, match="softcap"):
        attn.flex_attention_step(None, q, k, v, fm.block_mask, softcap=30.0)


def test_kernel_options_are_pinned_and_recorded():
    o = engine.flex_kernel_options(rows=128, kv_heads=3, group=3)
    assert o == {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 2, "num_stages": 1, "SPLIT_KV": 1}
    assert engine.flex_kernel_options(rows=2, kv_heads=3, group=3)["SPLIT_KV"] == 44
    assert engine.flex_kernel_options(rows=8, kv_heads=1, group=32)["BLOCK_M"] == 32
    env = engine.flex_environment(128, 3, 3, "cpu")
    assert env["implementation"] == "reference (uncompiled)" and env["block"] == 128 and env["torch"] == torch.__version__


# --------------------------------------------------------------------------------------- the tolerance gate
@pytest.mark.parametrize("attention", ["flex", "grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tolerance_gate_passes_on_a_real_boundary_and_records_every_layer(attention, dtype):
    lm, fmt, _, lives = _setup(dtype)
    eng = engine.StepEngine(lm, fmt, EngineRun(batch=3, max_len=MAX_LEN, attention=attention))
    n = eng.admit(1, lives[2].cache, lives[2].roles)
    eng.set_row_pair(1, 100, n, ANSWER, ANSWER)  # an answer query: it must not see the branches
    rec = eng.check_attention("problem 2")
    assert rec["gate"] == "attention_tolerance" and len(rec["rel_err_by_layer"]) == lm.model.config.num_hidden_layers
    assert rec["max_rel_err"] == max(rec["rel_err_by_layer"]) <= engine.TOLERANCE[dtype] and rec["rows"] == 2
    assert eng.stats.attention_checks == [rec]
    with pytest.raises(ValueError, match="sdpa"):
        engine.StepEngine(lm, fmt, EngineRun(batch=1, max_len=MAX_LEN)).check_attention()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gate("attention_tolerance")
def test_tolerance_gate_catches_a_mask_that_ignores_roles(dtype):
    from torch.nn.attention.flex_attention import BlockMask

    lm, fmt, _, lives = _setup(dtype)
    eng = engine.StepEngine(lm, fmt, EngineRun(batch=2, max_len=MAX_LEN, attention="flex"))
    n = eng.admit(0, lives[3].cache, lives[3].roles)
    eng.set_row_pair(0, 100, n, ANSWER, ANSWER)
    fm = eng._flex["full_attention"]
    pos, filled = fm.position, fm.kv_num_blocks
    fm.block_mask = BlockMask.from_kv_blocks(  # planted: causal only, Table 2 forgotten
        filled, fm.block_mask.kv_indices, BLOCK_SIZE=attn.FLEX_BLOCK,
        mask_mod=lambda b, h, q, k: (k <= pos[b]) & (k < filled[b, 0, 0] * attn.FLEX_BLOCK),
        seq_lengths=(2, MAX_LEN), compute_q_blocks=False)
    with pytest.raises(GateError, match="attention_tolerance") as err:
        eng.check_attention("planted")
    assert "layer 0" in err.value.reason and eng.stats.attention_checks == []


# ------------------------------------------------------------------------------------ flex in the engine
def test_flex_suffixes_keep_slots_companions_idle_slots_and_refills_bit_exact():
    lm, fmt, _, lives = _setup(torch.bfloat16)
    run = engine.EngineRun(max_len=MAX_LEN, attention="flex")
    x = lives[0]
    a = engine.decode_suffixes(lm, fmt, [x, lives[1], lives[2]], TINY_CAPS, run=dataclasses.replace(run, batch=3))
    b = engine.decode_suffixes(lm, fmt, [lives[5], lives[4], x], TINY_CAPS, run=dataclasses.replace(run, batch=3))
    alone = engine.decode_suffixes(lm, fmt, [x], TINY_CAPS, run=dataclasses.replace(run, batch=3, fill_from="last"))  # two idle slots
    assert _same(a[0], b[2]) and _same(a[0], alone[0])
    refill = engine.decode_suffixes(lm, fmt, lives, TINY_CAPS, run=dataclasses.replace(run, batch=3))  # 6 problems through 3 slots
    assert _same(refill[0], a[0]) and _same(refill[5], b[0]) and _same(refill[4], b[1])
    again = engine.decode_suffixes(lm, fmt, lives, TINY_CAPS, run=dataclasses.replace(run, batch=3))
    assert all(_same(p, q) for p, q in zip(refill, again))  # run to run
    want = [decode.decode_suffix(lm, fmt, caches.live_replica(s), TINY_CAPS) for s in lives[:3]]
    assert sum(w.tokens == g.tokens for w, g in zip(want, a)) >= 2  # BF16: another attention may part late


def test_flex_chooses_the_reference_decoders_tokens_in_fp32():
    lm, fmt, prompts, lives = _setup(torch.float32)
    got = engine.decode_suffixes(lm, fmt, lives, TINY_CAPS, run=engine.EngineRun(batch=2, max_len=MAX_LEN, attention="flex"))
    want = [decode.decode_suffix(lm, fmt, caches.live_replica(s), TINY_CAPS) for s in lives]
    assert [g.tokens for g in got] == [w.tokens for w in want]
    live = engine.decode_lives(lm, fmt, prompts, TINY_CAPS, run=engine.EngineRun(batch=2, max_len=MAX_LEN, attention="flex"))
    assert [b.ids for b in live] == [b.ids for b in lives]


def test_flex_bridge_incremental_rebuilt_equals_engine_live_bit_for_bit():
    lm, fmt, prompts, _ = _setup(torch.bfloat16)
    live = engine.decode_lives(lm, fmt, prompts[:4], TINY_CAPS, run=engine.EngineRun(batch=3, max_len=MAX_LEN, attention="flex"))
    inc = engine.build_incrementals(lm, fmt, [b.ids for b in live][::-1], run=engine.EngineRun(batch=3, max_len=MAX_LEN, attention="flex"))[::-1]
    for a, b in zip(live, inc):
        assert a.ids == b.ids and torch.equal(a.logits, b.logits)
        gates.check_exact("live vs incremental (flex)", caches.boundary_tensors(a), caches.boundary_tensors(b))
    default = engine.decode_lives(lm, fmt, prompts[:1], TINY_CAPS, run=engine.EngineRun(batch=1, attention="flex"))  # max_len rounded up
    assert default[0].ids == live[0].ids
    with pytest.raises(ValueError, match="multiple of 128"):
        engine.decode_lives(lm, fmt, prompts[:1], TINY_CAPS, run=engine.EngineRun(batch=1, max_len=200, attention="flex"))


# ---------------------------------------------------------------------- one engine for boundaries and suffixes
@pytest.mark.parametrize("attention", ["sdpa", "grouped", "flex"])
def test_one_engine_for_boundaries_and_suffixes_gives_the_phase_wise_records(attention):
    lm, fmt, _, lives = _setup(torch.bfloat16)
    problems = _problems(5)
    run = EngineRun("eager", 2, MAX_LEN, attention=attention)
    spec = RunSpec(lm=lm, fmt=fmt, decoding=Decoding.of(TINY_CAPS), engine=run)
    one = live_vs_prefill.live_vs_prefill_chunk(spec, problems)
    steps = {k: getattr(one.stats, k) for k in ("steps", "slot_steps", "busy_slot_steps")}
    phased = live_vs_prefill.live_vs_prefill_chunk_phased(spec, problems)
    assert [canonical_json(r) for r in one] == [canonical_json(r) for r in phased]
    assert all(r["gate_failure"] is None for r in one)
    # the occupancy counter counts what the jobs decoded: a live job is in its slot for each token it fed
    # after its prompt block (the merge opener's step included), a suffix job for each token but its first
    decoded = sum(len(r["prefix"]) - r["prompt_len"] + sum(len(a["suffix"]) - 1 for a in r["arms"].values())
                  for r in one)
    assert steps["busy_slot_steps"] == decoded and steps["slot_steps"] == 2 * steps["steps"]
    # Experiment 2: incremental rebuilds of fixed prefixes and their suffixes in one engine
    prefixes = [r["prefix"] for r in one[:3]]
    two = fixed_prefix.fixed_prefix_chunk(spec, problems[:3], prefixes)
    two_phased = fixed_prefix.fixed_prefix_chunk_phased(spec, problems[:3], prefixes)
    assert [canonical_json(r) for r in two] == [canonical_json(r) for r in two_phased]


def test_the_order_boundaries_and_suffixes_take_the_slots_changes_no_bit():
    lm, fmt, prompts, _ = _setup(torch.bfloat16)
    got = {}
    for hold in (0, 3, 100):  # suffixes always first; first from 3 waiting on; boundaries always first
        out: dict = {}

        def keep(i, boundary):
            out[i] = [boundary.ids]
            return [boundary, caches.live_replica(boundary)]

        def done(i, suffixes, out=out):
            out[i] += [(s.tokens, s.margins) for s in suffixes]

        stats = engine.decode_chains(lm, fmt, TINY_CAPS, "live", prompts, keep, done, run=engine.EngineRun(batch=2, max_len=MAX_LEN), hold=hold)
        got[hold] = (out, stats.busy_slot_steps)
    assert got[0] == got[3] == got[100]  # the same work, the same bits, whatever the order


def test_a_gate_failure_in_one_engine_stays_in_its_problem():
    lm, fmt, _, _ = _setup(torch.float32)
    problems = _problems(4)
    planted = {"p-01"}

    def faults(states):  # planted: one duplicate row of p-01's prefill cache moved (gate: desync)
        if states["live"].ids == planted_ids[0]:
            with torch.inference_mode():
                states["prefill"].cache.layers[0].keys[1, :, 2] += 0.5

    spec = RunSpec(lm=lm, fmt=fmt, decoding=Decoding.of(TINY_CAPS), engine=EngineRun("eager", 2, MAX_LEN))
    clean = live_vs_prefill.live_vs_prefill_chunk(spec, problems)
    planted_ids = [next(r["prefix"] for r in clean if r["problem_id"] in planted)]
    got = live_vs_prefill.live_vs_prefill_chunk(RunSpec(lm=lm, fmt=fmt, decoding=Decoding.of(TINY_CAPS), faults=faults,
                                                        engine=spec.engine), problems)
    assert [r["gate_failure"] is not None for r in got] == [False, True, False, False]
    assert got[1]["gate_failure"]["gate"] == "desync"
    assert [canonical_json(r) for i, r in enumerate(got) if i != 1] == \
        [canonical_json(r) for i, r in enumerate(clean) if i != 1]


# ------------------------------------------------------------------------------ the runner's preflight gates
@pytest.fixture
def tiny_arm(tmp_path):
    tok = make_tokenizer()
    make_model("llama", len(tok)).save_pretrained(tmp_path / "tiny-llama")
    tok.save_pretrained(tmp_path / "tiny-llama")
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_FORMAT))

    def settings(**kw):
        base = dict(profile="t", dtype="bfloat16", caps=TINY_CAPS, model=str(tmp_path / "tiny-llama"),
                    fmt=str(tmp_path / "tiny.yaml"), threads=1, preflight=1, step_path="engine-eager", batch=2)
        return ArmSettings(**(base | kw))

    return settings


def test_a_flex_arm_passes_every_gate_records_its_check_and_moves_the_composition_problem(tmp_path, tiny_arm,
                                                                                          monkeypatch):
    problems = _problems(4)
    firsts: dict[int, tuple[int, int]] = {}  # engine -> (its batch, the slot of its first admission)
    admit = engine.StepEngine.admit

    def where(self, slot, cache, roles):
        firsts.setdefault(id(self), (self.batch, slot))
        return admit(self, slot, cache, roles)

    monkeypatch.setattr(engine.StepEngine, "admit", where)
    records, ledger = run_arm("exp1", tiny_arm(attention="flex"), problems, live_vs_prefill.live_vs_prefill_row,
                              ledger_root=tmp_path, progress=False, chunk=live_vs_prefill.live_vs_prefill_chunk)
    assert all(r["gate_failure"] is None for r in records)
    env = json.loads((ledger.dir / "environment.json").read_text())
    assert env["execution_contract"]["engine"]["attention"] == "flex"
    assert env["execution_contract"]["engine"]["max_len"] % 128 == 0
    assert env["execution_contract"]["engine"]["flex"]["implementation"] == "reference (uncompiled)"
    check = env["attention_tolerance"]
    assert check["problem_id"] == "p-00" and check["max_rel_err"] <= 1e-2 and check["dtype"] == "bfloat16"
    assert len(check["rel_err_by_layer"]) == 2
    events = [json.loads(x) for x in (ledger.dir / "runlog.jsonl").read_text().splitlines()]
    gated = [c["gate"] for e in events if e["event"] == "gates" for c in e["checks"]]
    assert gated == ["composition", "attention_tolerance"]  # both ran in the first chunk
    chunks = [e for e in events if e["event"] == "chunk"]
    assert chunks and all(0 < e["occupancy"] <= 1 for e in chunks)
    # the chunk's engine put its first job in slot 0; the composition probe rode in that chunk (no engine of its own)
    assert [slot for batch, slot in firsts.values() if batch == 2][:1] == [0]


def test_the_composition_gate_catches_a_slot_dependent_fault(tmp_path, tiny_arm, monkeypatch):
    clean = engine.StepEngine._compute

    def by_slot(self, attention=None):  # planted: slots >= 1 get noise, the same in both duplicate rows
        logits, _ = clean(self, attention)
        noise = torch.zeros(self.rows, 1, dtype=logits.dtype)
        noise[2:] = 0.01 * (torch.arange(self.rows - 2, dtype=logits.dtype)[:, None] // 2 + 1)
        logits = logits + noise * torch.arange(logits.shape[1], dtype=logits.dtype)[None, :] / logits.shape[1]
        return logits, engine.choice_stats(logits, self._eligible[self.inputs[3]])

    monkeypatch.setattr(engine.StepEngine, "_compute", by_slot)
    with pytest.raises(GateError, match="composition") as err:
        run_arm("exp1", tiny_arm(dtype="float32"), _problems(3), live_vs_prefill.live_vs_prefill_row,
                ledger_root=tmp_path, progress=False, chunk=live_vs_prefill.live_vs_prefill_chunk)
    assert "p-00" in err.value.reason
    assert not any(f.read_bytes() for f in (tmp_path / "t").glob("*/rows.jsonl"))  # nothing was appended


def test_flex_in_the_contract():
    from kvreplay.runner import resolve_execution

    ok = resolve_execution("nb", {"step_path": "engine-eager", "attention": "flex", "max_len": 512})
    assert ok["attention"] == "flex"
    with pytest.raises(ValueError, match="multiple of 128"):
        resolve_execution("nb", {"step_path": "engine-eager", "attention": "flex", "max_len": 500})
    with pytest.raises(ValueError, match="the eager path calls the model's own SDPA"):
        resolve_execution("nb", {"attention": "flex"})
