"""Batched experiment runner (step path and batch shape in the contract) on tiny random-weight models, CPU.

The engine's op-by-op step (``step_path="engine-eager"``) runs the batched logic on the CPU; the CUDA-graph
path is checked on a GPU (``graph_equals_eager``). Asserted here:
- batched Experiment 1 and 2 records have exactly the eager runner's layout and pass every gate;
- a batched arm resumed after a cut (other chunk boundaries) writes byte-identical ledgers;
- a chunk deadline stops an arm at a chunk boundary, keeping the finished chunk's rows;
- the composition gate aborts an arm whose problems' bits depend on their companions, before any row is written;
- the step path and batch shape join the ledger key; the defaults add nothing; refusals are clear;
- the bridge under the engine: incremental rebuilt by teacher forcing == engine-live, bit for bit;
- the per-step eager check and the valid-length (padding) gate catch planted faults.
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch
from conftest import (
    TINY_CAPS,
    TINY_FORMAT,
    key_paths,
    make_tokenizer,
    tiny_lm,
    tiny_problems,
)
from kvreplay.decoding import caches
from kvreplay import engine, gates
from kvreplay.decoding.contract import MERGE, resolve_format
from kvreplay.experiments.bridge import bridge_row
from kvreplay.experiments.fixed_prefix import EXP2
from kvreplay.experiments.live_vs_prefill import EXP1
from kvreplay.gates import GateError
from kvreplay.ledger.records import RowSchemaError
from kvreplay.ledger.store import config_digest
from kvreplay.data.problems import Problem
from kvreplay.engine import EngineRun, Measured
from kvreplay.runner import CHUNK_DEADLINE_ENV, ArmSettings, ChunkDeadline, run_arm


def _problems(n: int) -> list[Problem]:
    """Problems with prompts of different lengths (rows of one batch sit at different positions)."""
    return [Problem(f"p-{i:02d}", "test", i + 1, "Q" + "xyz"[i % 3] * (3 * i) + "?", ("x", "y", f"z{i}", "w"), "ABCD"[i % 4])
            for i in range(n)]


def test_batched_records_have_the_eager_layout_and_pass_every_gate(tmp_path, tiny_arm):
    problems = _problems(5)
    eager, ledger_e = EXP1.run(tiny_arm(), problems, ledger_root=tmp_path, progress=False)
    batched, ledger_b = EXP1.run(tiny_arm(step_path="engine-eager", batch=2), problems, ledger_root=tmp_path, progress=False)
    assert ledger_b.dir != ledger_e.dir  # another decode path, another key
    assert [r["problem_id"] for r in batched] == [p.problem_id for p in problems]
    assert all(r["gate_failure"] is None for r in eager + batched)
    for a, b in zip(eager, batched):
        assert key_paths(a) == key_paths(b)
        assert b["equivalence"]["compared"] == "prefill_vs_live" and b["equivalence"]["rel_l2"] <= 1e-4
        assert b["boundary"]["live_replica"]["cache"]["exact"] and b["boundary"]["prefill_replica"]["cache"]["exact"]
        assert b["arms"]["live"]["suffix"] == b["arms"]["live_replica"]["suffix"]
        assert b["schedule_calls"] == len(b["prefix"]) - b["prompt_len"] + 1
    env = json.loads((ledger_b.dir / "environment.json").read_text())["execution_contract"]
    assert env["engine"]["step_path"] == "engine-eager" and env["engine"]["batch"] == 2
    fmt = resolve_format(make_tokenizer(), TINY_FORMAT)
    bound = max(fmt.max_sequence_length(len(fmt.prompt_ids(p.question, p.options)), TINY_CAPS) for p in problems)
    assert env["engine"]["max_len"] == bound  # the arm's one batch shape: its longest possible sequence
    assert "engine" not in json.loads((ledger_e.dir / "environment.json").read_text())["execution_contract"]
    events = [json.loads(x) for x in (ledger_b.dir / "runlog.jsonl").read_text().splitlines()]
    assert any(e["event"] == "engine" and e["batch"] == 2 and e["step_path"] == "eager" for e in events)
    # Experiment 2 on the batched runner: fixed prefixes, incremental rebuilt through the engine
    prefixes = {r["problem_id"]: r["prefix"] for r in eager}
    two, _ = EXP2.run(tiny_arm(step_path="engine-eager", batch=2), problems[:3], prefixes=prefixes, key={"prefix_bank_sha256": "bank"}, ledger_root=tmp_path, progress=False)
    two_eager, _ = EXP2.run(tiny_arm(), problems[:3], prefixes=prefixes, key={"prefix_bank_sha256": "bank"}, ledger_root=tmp_path, progress=False)
    for a, b in zip(two_eager, two):
        assert a["gate_failure"] is None and b["gate_failure"] is None
        assert key_paths(a) == key_paths(b) and b["prefix"] == a["prefix"] and "prefill_vs_incremental" in b["boundary"]


def test_batched_arm_resumes_to_identical_bytes_with_other_chunks(tmp_path, tiny_arm):
    problems = _problems(5)
    settings = tiny_arm(step_path="engine-eager", batch=2)
    first, ledger = EXP1.run(settings, problems, ledger_root=tmp_path, progress=False)
    full = ledger.rows_path.read_bytes()
    lines = full.splitlines(keepends=True)
    ledger.rows_path.write_bytes(b"".join(lines[:3]) + lines[3][:25])  # a cut mid-write: chunks now {3, 4}, not {2, 3}, {4}
    again, ledger2 = EXP1.run(settings, problems, ledger_root=tmp_path, progress=False)
    assert ledger2.dir == ledger.dir and ledger2.rows_path.read_bytes() == full
    assert again == first


def test_chunk_deadline_stops_at_a_chunk_boundary_and_the_arm_resumes_to_identical_bytes(tmp_path, tiny_arm, monkeypatch):
    problems = _problems(5)
    settings = tiny_arm(step_path="engine-eager", batch=2)
    _, whole = EXP1.run(settings, problems, ledger_root=tmp_path / "whole", progress=False)
    monkeypatch.setenv(CHUNK_DEADLINE_ENV, f"{time.time():.3f}")  # now: only the first chunk, which always starts
    with pytest.raises(ChunkDeadline, match="p-02"):
        EXP1.run(settings, problems, ledger_root=tmp_path, progress=False)
    (folder,) = (tmp_path / "t").iterdir()
    assert (folder / "rows.jsonl").read_bytes().count(b"\n") == 2  # the first chunk (always started) is in the ledger
    events = [json.loads(x) for x in (folder / "runlog.jsonl").read_text().splitlines()]
    (gates,) = [e["checks"] for e in events if e["event"] == "gates"]  # logged when they passed, not at the arm's end
    assert [c["gate"] for c in gates] == ["composition"] and gates[0]["problem_id"] == "p-00"
    monkeypatch.delenv(CHUNK_DEADLINE_ENV)
    _, ledger = EXP1.run(settings, problems, ledger_root=tmp_path, progress=False)
    assert ledger.dir == folder and ledger.rows_path.read_bytes() == whole.rows_path.read_bytes()
    # the resumed run (a new process on a device: a new graph capture) passed the gate again before appending, on
    # the committed row with the shortest line, recomputed alone and equal to its committed line
    first_two = whole.rows_path.read_text().splitlines()[:2]
    shortest = json.loads(min(first_two, key=len))["problem_id"]
    events = [json.loads(x) for x in (folder / "runlog.jsonl").read_text().splitlines()]
    gated = [e["checks"] for e in events if e["event"] == "gates"]
    assert [[c["problem_id"] for c in checks] for checks in gated] == [["p-00"], [shortest]]
    assert gated[1][0]["reference"] == "committed row" and gated[1][0]["gate"] == "composition"


def test_a_resumed_arm_whose_bits_moved_stops_before_appending(tmp_path, tiny_arm, monkeypatch):
    """A resumed run recomputes a committed row first: bits that moved since (code, machine) append nothing."""
    problems = _problems(5)
    settings = tiny_arm(step_path="engine-eager", batch=2)
    monkeypatch.setenv(CHUNK_DEADLINE_ENV, f"{time.time():.3f}")
    with pytest.raises(ChunkDeadline):
        EXP1.run(settings, problems, ledger_root=tmp_path, progress=False)
    monkeypatch.delenv(CHUNK_DEADLINE_ENV)
    (folder,) = (tmp_path / "t").iterdir()
    before = (folder / "rows.jsonl").read_bytes()
    clean = engine.StepEngine._compute

    def moved(self):  # planted: every logit scaled alike (no companion dependence: the in-chunk gate would pass)
        logits, _ = clean(self)
        logits = logits * (1 + 1e-3)
        return logits, engine.choice_stats(logits, self._eligible[self.inputs[3]])

    monkeypatch.setattr(engine.StepEngine, "_compute", moved)
    with pytest.raises(GateError, match="composition") as err:
        EXP1.run(settings, problems, ledger_root=tmp_path, progress=False)
    assert "committed record" in err.value.reason and "B=2" in err.value.reason
    assert (folder / "rows.jsonl").read_bytes() == before  # nothing appended


def test_chunks_larger_than_the_batch_refill_slots_and_write_the_same_ledger(tmp_path, tiny_arm):
    """More problems per chunk than slots (a finished problem's slot takes the next): same key, same bytes."""
    problems = _problems(5)
    _, by_batch = EXP1.run(tiny_arm(step_path="engine-eager", batch=2), problems, ledger_root=tmp_path / "b", progress=False)
    _, by_chunk = EXP1.run(tiny_arm(step_path="engine-eager", batch=2, chunk=5), problems, ledger_root=tmp_path / "c", progress=False)
    assert by_chunk.dir.name == by_batch.dir.name
    assert by_chunk.rows_path.read_bytes() == by_batch.rows_path.read_bytes()
    engine_events = [json.loads(x) for x in (by_chunk.dir / "runlog.jsonl").read_text().splitlines()
                     if '"event": "engine"' in x]
    assert engine_events and engine_events[0]["chunk"] == 5 and engine_events[0]["batch"] == 2
    with pytest.raises(ValueError, match="chunk"):
        tiny_arm(chunk=4)  # the eager path has no chunks
    with pytest.raises(ValueError, match="chunk"):
        tiny_arm(step_path="engine-eager", batch=2, chunk=0)


def test_a_row_that_does_not_fit_its_schema_is_not_appended(tmp_path, tiny_arm, monkeypatch):
    import kvreplay.experiments.live_vs_prefill as exp1

    clean = exp1.live_vs_prefill_row
    monkeypatch.setattr(exp1, "live_vs_prefill_row", lambda spec, p: clean(spec, p) | ({"note": "planted"} if p.problem_id == "p-01" else {}))
    with pytest.raises(RowSchemaError, match=r"p-01.*note"):
        EXP1.run(tiny_arm(), _problems(3), ledger_root=tmp_path, progress=False)
    (folder,) = (tmp_path / "t").iterdir()
    assert (folder / "rows.jsonl").read_bytes().count(b"\n") == 1  # p-00 stays; p-01 was never written


@pytest.mark.gate("composition")
def test_composition_gate_aborts_on_a_companion_dependent_fault(tmp_path, tiny_arm, monkeypatch):
    clean = engine.StepEngine._compute

    def leaky(self):  # planted: every row's logits scaled by the number of rows in use (companions leak in)
        logits, _ = clean(self)
        logits = logits * (1 + 1e-3 * (self.inputs[1] > 0).sum())
        return logits, engine.choice_stats(logits, self._eligible[self.inputs[3]])

    monkeypatch.setattr(engine.StepEngine, "_compute", leaky)
    with pytest.raises(GateError, match="composition") as err:
        EXP1.run(tiny_arm(step_path="engine-eager", batch=2), _problems(4), ledger_root=tmp_path, progress=False)
    assert "p-00" in err.value.reason and "B=2" in err.value.reason
    assert not any(f.read_bytes() for f in (tmp_path / "t").glob("*/rows.jsonl"))  # nothing was appended


def test_first_difference_names_the_first_differing_leaf():
    """One helper names where two records part, for the composition gates and `make verify` alike."""
    from kvreplay import verify
    from kvreplay.runner.batched import first_difference

    assert verify.first_difference is first_difference
    a = {"arms": {"prefill": {"margins": [0.5, None], "suffix": [1, 2, 3]}}, "problem_id": "p-00"}
    assert first_difference(a, json.loads(json.dumps(a))) is None
    b = json.loads(json.dumps(a))
    b["arms"]["prefill"]["suffix"][2] = 4
    assert first_difference(a, b) == "arms.prefill.suffix[2]"
    assert first_difference(a, a | {"gate_failure": None}) == "gate_failure"  # in one record only, even as None
    assert first_difference({"s": []}, {}) == "s"  # an empty list is a leaf of its own
    assert first_difference({"s": []}, {"s": [5]}) == "s[0]"  # ... named below it where the other has elements
    long = {"s": list(range(12)), "t": [{"u": 1}] * 3}
    other = json.loads(json.dumps(long))
    other["s"][2], other["s"][10] = -1, -1
    assert first_difference(long, other) == "s[2]"  # list indices in number order, not string order
    other = json.loads(json.dumps(long))
    other["t"][2]["u"] = 0
    assert first_difference(long, other) == "t[2].u"


def test_step_path_and_batch_shape_join_the_key_and_defaults_add_nothing(tmp_path, tiny_arm):
    problems = tiny_problems(2)
    base = tiny_arm().config("exp1", problems)
    assert "engine" not in base
    keys = {
        "default": base,
        "engine-eager B=2": tiny_arm(step_path="engine-eager", batch=2).config("exp1", problems),
        "engine-eager B=3": tiny_arm(step_path="engine-eager", batch=3).config("exp1", problems),
        "engine-eager B=2 max_len 400": tiny_arm(step_path="engine-eager", batch=2, max_len=400).config("exp1", problems),
    }
    assert keys["engine-eager B=2"]["engine"] == {"step_path": "engine-eager", "batch": 2, "max_len": "longest_sequence"}
    assert len({config_digest(c) for c in keys.values()}) == len(keys)
    for c in keys.values():  # nothing else moves
        assert {k: v for k, v in c.items() if k != "engine"} == base
    with pytest.raises(ValueError, match="batch, max_len and chunk drive the batched engine"):
        tiny_arm(batch=4)
    with pytest.raises(ValueError, match="batch, max_len and chunk drive the batched engine"):
        tiny_arm(max_len=300)
    with pytest.raises(ValueError, match="needs device 'cuda'"):
        tiny_arm(step_path="graph")
    with pytest.raises(ValueError, match="unknown step path"):
        tiny_arm(step_path="fast")
    with pytest.raises(ValueError, match="batch"):
        tiny_arm(step_path="engine-eager", batch=0)
    # the engine step's attention: "grouped" joins the engine entry, the default adds nothing
    grouped = tiny_arm(step_path="engine-eager", batch=2, attention="grouped").config("exp1", problems)
    assert grouped["engine"] == keys["engine-eager B=2"]["engine"] | {"attention": "grouped"}
    assert tiny_arm(step_path="engine-eager", batch=2, attention="sdpa").config("exp1", problems) == keys["engine-eager B=2"]
    with pytest.raises(ValueError, match="the eager path calls the model's own SDPA"):
        tiny_arm(attention="grouped")
    with pytest.raises(ValueError, match="unknown attention"):
        tiny_arm(step_path="engine-eager", attention="flash")
    # experiments without a batched runner refuse a batched path rather than silently run eager
    with pytest.raises(ValueError, match="no batched runner"):
        run_arm("exp3", tiny_arm(step_path="engine-eager"), problems, lambda s, p: bridge_row(s, p, []),
                ledger_root=tmp_path, progress=False)
    with pytest.raises(ValueError, match="shorter than"):
        EXP1.run(tiny_arm(step_path="engine-eager", max_len=40), problems, ledger_root=tmp_path, progress=False)
    assert not (tmp_path / "t").exists()


@pytest.fixture(scope="module")
def lives():
    lm = tiny_lm("qwen2", torch.bfloat16)
    fmt = resolve_format(lm.tokenizer, TINY_FORMAT)
    prompts = [fmt.prompt_ids("Q" + "ab"[i % 2] * (4 * i) + "?", ("x", "y", f"z{i}", "w")) for i in range(4)]
    return lm, fmt, prompts, engine.decode_lives(lm, fmt, prompts, TINY_CAPS, run=engine.EngineRun(batch=3, max_len=200))


def test_bridge_under_the_engine_incremental_equals_live_bit_for_bit(lives):
    lm, fmt, prompts, live = lives
    prefixes = [b.ids for b in live]
    # same batch shape, other slots and companions (reversed order)
    inc = engine.build_incrementals(lm, fmt, prefixes[::-1], run=engine.EngineRun(batch=3, max_len=200))[::-1]
    for a, b in zip(live, inc):
        assert b.construction == "incremental" and a.ids == b.ids and a.schedule == b.schedule
        assert torch.equal(a.roles, b.roles) and torch.equal(a.positions, b.positions)
        gates.check_exact("engine live vs engine incremental", caches.boundary_tensors(a), caches.boundary_tensors(b))
    with pytest.raises(Exception, match="boundary"):
        engine.build_incrementals(lm, fmt, [prefixes[0][:-1]], run=engine.EngineRun(batch=3, max_len=200))


@pytest.mark.gate("graph_equals_eager")
@pytest.mark.gate("functional_state")
def test_per_step_eager_check_and_valid_length_gate_catch_planted_faults(lives, monkeypatch):
    lm, fmt, prompts, live = lives
    eng = engine.StepEngine(lm, fmt, engine.EngineRun(batch=2, max_len=200, verify_steps=3))
    n = eng.admit(0, live[1].cache, live[1].roles)
    eng.set_row_pair(0, 100, n, MERGE, MERGE)
    eng.step()
    assert eng.stats.verified_steps == 1
    roles = live[1].roles[0].tolist() + [MERGE]
    eng.check_valid_length(0, n + 1, roles, "clean")
    with pytest.raises(GateError, match="functional_state"):
        eng.check_valid_length(0, n, roles, "one short")  # position n was written: not padding
    with torch.inference_mode():
        eng.cache.layers[1].values[1, :, n + 4] = 0.5  # a write beyond the valid length, one duplicate row
    with pytest.raises(GateError, match="beyond the valid length"):
        eng.check_valid_length(0, n + 1, roles, "planted")
    clean = engine.StepEngine._compute
    calls = []

    def flaky(self):  # planted: the second computation of a step differs in one logit
        logits, stats = clean(self)
        calls.append(1)
        if len(calls) % 2 == 0:
            logits = logits.clone()
            logits[0, 5] += 1
        return logits, stats

    monkeypatch.setattr(engine.StepEngine, "_compute", flaky)
    with pytest.raises(GateError, match="graph_equals_eager"):
        engine.decode_suffixes(lm, fmt, live[:2], TINY_CAPS, run=engine.EngineRun(batch=2, max_len=200, verify_steps=2))


def test_verify_recomputes_a_batched_row_alone_at_the_arm_batch_shape(tmp_path, tiny_arm):
    """`make verify` on a batched ledger: each row in a chunk of one at the recorded (B, max_len), bit for bit."""
    from kvreplay.ledger.store import ROWS
    from kvreplay.verify import verify_ledger

    problems = _problems(4)
    _, ledger = EXP1.run(tiny_arm(step_path="engine-eager", batch=3), problems, ledger_root=tmp_path, progress=False)
    model = str(tmp_path / "tiny-llama")
    checks = verify_ledger(ledger.dir, rows=4, pick="first", problems=problems, model=model)
    assert [(c.problem_id, c.mode, c.ok) for c in checks] == [(p.problem_id, "bytes", True) for p in problems]
    # "fastest" on a batched ledger: the shortest committed line (a chunk's logged seconds sit on its first row)
    lines = (ledger.dir / ROWS).read_text().splitlines()
    shortest = json.loads(min(lines, key=len))["problem_id"]
    assert [c.problem_id for c in verify_ledger(ledger.dir, rows=1, pick="fastest", problems=problems, model=model)] \
        == [shortest]
    # a planted change in a committed row (its last suffix token) is found, with where it parts
    lines = (ledger.dir / ROWS).read_text().splitlines()
    rec = json.loads(lines[2])
    rec["arms"]["prefill"]["suffix"][-1] += 1
    lines[2] = json.dumps(rec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    (ledger.dir / ROWS).write_text("\n".join(lines) + "\n")
    bad = [c for c in verify_ledger(ledger.dir, rows=4, pick="first", problems=problems, model=model) if not c.ok]
    assert [c.problem_id for c in bad] == [problems[2].problem_id]
    assert bad[0].parted.startswith("arms.prefill.suffix[")


@dataclasses.dataclass
class _ChunkSpec:
    """What BatchedRows reads of a RunSpec when its chunk function reads nothing: the engine run."""
    engine: EngineRun


def test_the_chunk_deadline_leaves_the_preflight_gates_out_of_a_chunks_time(monkeypatch):
    """A new arm's first chunk carries its one-off gates; the estimate for the next chunk is the chunk alone."""
    from kvreplay.runner.batched import BatchedRows

    problems = _problems(4)
    spec = _ChunkSpec(EngineRun(batch=2))  # two problems per chunk
    mapper = BatchedRows(spec, lambda _spec, group: Measured({"problem_id": p.problem_id} for p in group), problems,
                         composition_id="p-00")
    monkeypatch.setattr(BatchedRows, "check_composition", lambda *_: time.sleep(0.5))  # a slow gate, a fast chunk
    monkeypatch.setenv(CHUNK_DEADLINE_ENV, f"{time.time() + 60:.3f}")
    rows = mapper(iter(problems))
    assert [next(rows)["problem_id"] for _ in range(2)] == ["p-00", "p-01"]
    assert mapper.seconds[0] < 0.25  # the chunk's own time, not the gate's half second
    monkeypatch.setenv(CHUNK_DEADLINE_ENV, f"{time.time() + 0.3:.3f}")  # room for the chunk, not for the gate
    assert [r["problem_id"] for r in rows] == ["p-02", "p-03"]
    monkeypatch.setattr(BatchedRows, "check_composition", lambda *_: None)
    mapper = BatchedRows(spec, lambda _spec, group: time.sleep(0.5) or Measured({"problem_id": p.problem_id} for p in group),
                         problems)
    rows = mapper(iter(problems))
    next(rows)
    next(rows)
    monkeypatch.setenv(CHUNK_DEADLINE_ENV, f"{time.time() + 0.3:.3f}")  # a slow chunk still stops the next one
    with pytest.raises(ChunkDeadline, match="p-02.*its gates left out"):
        next(rows)


def test_a_first_chunk_is_not_started_when_its_estimate_passes_the_deadline(monkeypatch):
    """With KV_FIRST_CHUNK_ESTIMATE (an earlier run's longest chunk) a first chunk that would be killed is not begun;
    without it, or with room for it, the first chunk starts as before."""
    from kvreplay.runner import FIRST_CHUNK_ESTIMATE_ENV
    from kvreplay.runner.batched import BatchedRows

    problems = _problems(4)
    spec = _ChunkSpec(EngineRun(batch=2))  # two problems per chunk
    calls = []
    chunk = lambda _spec, group: calls.append(len(group)) or Measured({"problem_id": p.problem_id} for p in group)  # noqa: E731
    monkeypatch.setenv(CHUNK_DEADLINE_ENV, f"{time.time() + 30:.3f}")
    monkeypatch.setenv(FIRST_CHUNK_ESTIMATE_ENV, "45")
    with pytest.raises(ChunkDeadline, match=r"first chunk of 2 problems at p-00: KV_FIRST_CHUNK_ESTIMATE says 45 s"):
        next(BatchedRows(spec, chunk, problems)(iter(problems)))
    assert calls == []  # nothing computed, nothing lost
    monkeypatch.setenv(FIRST_CHUNK_ESTIMATE_ENV, "5")
    assert [r["problem_id"] for r in BatchedRows(spec, chunk, problems)(iter(problems))] == [p.problem_id for p in problems]
    monkeypatch.delenv(FIRST_CHUNK_ESTIMATE_ENV)
    monkeypatch.setenv(CHUNK_DEADLINE_ENV, f"{time.time():.3f}")  # no estimate: the first chunk always starts
    rows = BatchedRows(spec, chunk, problems)(iter(problems))
    assert next(rows)["problem_id"] == "p-00" and calls == [2, 2, 2]


def test_a_grouped_attention_arm_passes_every_gate_and_verifies_byte_for_byte(tmp_path, tiny_arm):
    """The engine's grouped attention through the batched runner: preflight gates, its own key, `make verify`."""
    from kvreplay.verify import verify_ledger

    problems = _problems(4)
    sdpa, ledger_s = EXP1.run(tiny_arm(step_path="engine-eager", batch=2), problems, ledger_root=tmp_path, progress=False)
    grouped, ledger_g = EXP1.run(tiny_arm(step_path="engine-eager", batch=2, attention="grouped"), problems, ledger_root=tmp_path, progress=False)
    assert ledger_g.dir != ledger_s.dir
    assert all(r["gate_failure"] is None for r in grouped)
    assert [r["prefix"] for r in grouped] == [r["prefix"] for r in sdpa]  # FP32 tiny model: same tokens
    env = json.loads((ledger_g.dir / "environment.json").read_text())["execution_contract"]
    assert env["engine"]["attention"] == "grouped"
    assert "attention" not in json.loads((ledger_s.dir / "environment.json").read_text())["execution_contract"]["engine"]
    events = [json.loads(x) for x in (ledger_g.dir / "runlog.jsonl").read_text().splitlines()]
    assert any(e["event"] == "engine" and e.get("attention") == "grouped" for e in events)
    assert any(e["event"] == "gates" and any(c["gate"] == "composition" for c in e["checks"]) for e in events)
    checks = verify_ledger(ledger_g.dir, rows=2, pick="first", problems=problems, model=str(tmp_path / "tiny-llama"))
    assert [(c.mode, c.ok) for c in checks] == [("bytes", True)] * 2


def test_a_read_only_run_reads_finished_ledgers_and_refuses_to_compute(tmp_path, tiny_arm, monkeypatch):
    """`KV_LEDGERS_READ_ONLY=1` (what `make paper` sets for a profile computed on a GPU): a finished arm is read;
    an arm with rows left, under its own key or another one (a changed parameter), raises before a model is
    loaded or a folder made, and names the arm's other folders with their rows."""
    from kvreplay.runner import READ_ONLY_ENV, ReadOnlyLedgerError

    problems = _problems(3)
    rows, ledger = EXP1.run(tiny_arm(), problems, ledger_root=tmp_path, progress=False)
    monkeypatch.setenv(READ_ONLY_ENV, "1")
    loads = []
    monkeypatch.setattr(ArmSettings, "load", lambda self: loads.append(self) or pytest.fail("model loaded"))
    again, same = EXP1.run(tiny_arm(), problems, ledger_root=tmp_path, progress=False)
    assert again == rows and same.dir == ledger.dir
    folders = sorted(p.name for p in (tmp_path / "t").iterdir())
    with pytest.raises(ReadOnlyLedgerError, match=r"4 of 4 rows of this arm are not in any ledger") as e:
        EXP1.run(tiny_arm(), _problems(4), ledger_root=tmp_path, progress=False)  # another key
    assert f"other folders of this arm: {ledger.dir.name} (3 of 3 rows)" in str(e.value) and e.value.todo == 4
    with pytest.raises(ReadOnlyLedgerError, match="changed a ledger key or a panel"):
        EXP1.run(tiny_arm(preflight=2), problems, ledger_root=tmp_path, progress=False)
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == folders and loads == []
    text = (ledger.dir / "rows.jsonl").read_text()
    (ledger.dir / "rows.jsonl").write_text("".join(text.splitlines(keepends=True)[:2]))  # an unfinished arm
    with pytest.raises(ReadOnlyLedgerError, match=r"1 of 3 rows .* no other folder of this arm") as e:
        EXP1.run(tiny_arm(), problems, ledger_root=tmp_path, progress=False)
    assert e.value.path == ledger.dir and loads == []
