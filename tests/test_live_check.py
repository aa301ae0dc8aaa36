"""The live construction is checked too (gate ``live_equals_incremental``), and the profiles cannot turn the
construction checks off (paper §3.5-3.6): planted faults in the live decoder, through the runner the notebooks use."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from conftest import TINY_CAPS, TINY_FORMAT, make_tokenizer, tiny_lm, tiny_problems
from kvreplay.decoding import decode
from kvreplay import engine
from kvreplay.decoding.contract import resolve_format
from kvreplay.decoding.settings import Decoding
from kvreplay.experiments.live_vs_prefill import EXP1, live_vs_prefill_row
from kvreplay.experiments.matrix import DRIFT_OUTLIER_FACTOR, drift_outliers, matrix_summary, matrix_table
from kvreplay.gates import GateError, check_live_equals_incremental
from kvreplay.runner import ArmSettings, RunSpec
from kvreplay.runner.spec import EngineRun
from kvreplay.runner.spec import live_check_ids


TINY_ARM_DTYPE = "bfloat16"  # the tiny_arm fixture's default dtype in this module (conftest)


def _events(ledger) -> list[dict]:
    return [json.loads(x) for x in (ledger.dir / "runlog.jsonl").read_text().splitlines()]


@contextlib.contextmanager
def _live_without_mask(monkeypatch, only: set[str] | None = None):
    """The eager live decoder's calls lose their 4-D mask (the model falls back to its plain causal mask), for every
    prompt or only those of the problems in ``only``; incremental and prefill keep theirs."""
    on = {"live": False}
    real_inputs, real_live = decode.model_inputs, decode.decode_live
    fmt = resolve_format(make_tokenizer(), TINY_FORMAT)
    prompts = None if only is None else {tuple(fmt.prompt_ids(p.question, p.options)) for p in tiny_problems(4)
                                         if p.problem_id in only}

    def inputs(*args, **kwargs):
        embeds, mask, positions = real_inputs(*args, **kwargs)
        return embeds, None if on["live"] else mask, positions

    def live(lm, fmt, prompt, caps, **kwargs):
        on["live"] = prompts is None or tuple(prompt) in prompts
        try:
            return real_live(lm, fmt, prompt, caps, **kwargs)
        finally:
            on["live"] = False

    monkeypatch.setattr(decode, "model_inputs", inputs)
    monkeypatch.setattr(decode, "decode_live", live)
    yield


def test_the_live_check_sample_is_declared_from_the_ids_alone():
    ids = [f"p-{i:03d}" for i in range(400)]
    assert live_check_ids(ids, 2, 0.0) == {"p-000", "p-001"}  # the preflight rows always
    assert live_check_ids(ids, 0, 1.0) == set(ids)
    quarter = live_check_ids(ids, 2, 0.25)
    assert {"p-000", "p-001"} <= quarter and 60 < len(quarter) < 140  # about a quarter, by the hash
    assert live_check_ids(list(reversed(ids)), 0, 0.25) == quarter - {"p-000", "p-001"} | (
        {"p-000", "p-001"} & live_check_ids(ids, 0, 0.25))  # a problem's membership does not depend on the order
    assert live_check_ids(ids[:50], 2, 0.25) == quarter & set(ids[:50])  # nor on the other problems
    with pytest.raises(ValueError, match=r"live_check_fraction must lie in \[0, 1\], got 1.5"):
        live_check_ids(ids, 1, 1.5)
    with pytest.raises(ValueError, match=r"live_check_fraction must be a number in \[0, 1\], got -0.1"):
        ArmSettings(profile="t", dtype="bfloat16", caps=TINY_CAPS, live_check_fraction=-0.1)


def test_a_clean_bf16_row_passes_and_its_record_does_not_change(tiny_format):
    """A pass adds nothing to the row: checked and unchecked records are equal, byte for byte."""
    lm = tiny_lm("llama", torch.bfloat16)
    fmt, p = tiny_format(lm), tiny_problems(1)[0]
    checked = RunSpec(lm=lm, fmt=fmt, decoding=Decoding.of(TINY_CAPS), live_check_ids=frozenset({p.problem_id}))
    a = live_vs_prefill_row(checked, p)
    b = live_vs_prefill_row(RunSpec(lm=lm, fmt=fmt, decoding=Decoding.of(TINY_CAPS)), p)
    assert a["gate_failure"] is None and json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert [c["problem_id"] for c in checked.live_checks] == [p.problem_id]


@pytest.mark.gate("live_equals_incremental")
def test_the_gate_names_the_first_tensor_that_differs(tiny_format):
    lm = tiny_lm("llama", torch.bfloat16)
    fmt = tiny_format(lm)
    live = decode.decode_live(lm, fmt, fmt.prompt_ids("Q?", ["a", "b"]), TINY_CAPS)
    inc = decode.build_incremental(lm, fmt, live.ids)
    check_live_equals_incremental(live, inc, "p")
    with torch.inference_mode():
        inc.cache.layers[1].values[0, 1, 4, 3] += 1.0
    with pytest.raises(GateError, match=r"gate 'live_equals_incremental' failed: p live vs its incremental rebuild: "
                                        r"L01.value differs in 1 of \d+ elements \(largest \|difference\| 0.99\d\)"):
        check_live_equals_incremental(live, inc, "p")
    inc = decode.build_incremental(lm, fmt, live.ids)
    inc.logits = inc.logits.clone()
    inc.logits[:, 7] += 0.5
    with pytest.raises(GateError, match="boundary logits differs in 2 of"):
        check_live_equals_incremental(live, inc, "p")


def test_a_dropped_live_mask_aborts_a_bf16_arm_in_preflight(tmp_path, tiny_arm, monkeypatch):
    """The issue's fault: every gate passed before; now the preflight row fails and the arm stops."""
    with _live_without_mask(monkeypatch):
        with pytest.raises(GateError, match=r"preflight row tiny-00 failed gate 'live_equals_incremental': problem "
                                            r"tiny-00 live vs its incremental rebuild: L01.key differs"):
            EXP1.run(tiny_arm(live_check_fraction=0.0), tiny_problems(3), ledger_root=tmp_path / "l", progress=False)
    (folder,) = (tmp_path / "l" / "t").glob("exp1-bfloat16-*")
    rows = [json.loads(x) for x in (folder / "rows.jsonl").read_text().splitlines()]
    assert [r["gate_failure"]["gate"] for r in rows] == ["live_equals_incremental"]  # nothing after it ran


def test_a_live_fault_on_a_sampled_row_is_recorded_and_withholds_the_endpoints(tmp_path, tiny_arm, monkeypatch):
    problems = tiny_problems(3)
    with _live_without_mask(monkeypatch, only={"tiny-02"}):
        records, ledger = EXP1.run(tiny_arm(live_check_fraction=1.0), problems, ledger_root=tmp_path / "all", progress=False)
        unsampled, _ = EXP1.run(tiny_arm(live_check_fraction=0.0), problems, ledger_root=tmp_path / "none", progress=False)
    assert [r["gate_failure"] and r["gate_failure"]["gate"] for r in records] == [None, None, "live_equals_incremental"]
    with pytest.raises(GateError, match="report"):
        matrix_summary(records, "bfloat16", n_resamples=100)
    # outside the sample the fault is not seen: that is what the fraction trades for time
    assert [r["gate_failure"] for r in unsampled] == [None, None, None]
    events = _events(ledger)
    declared = [e for e in events if e["event"] == "live_check_sample"]
    assert declared == [declared[0]] and declared[0]["problem_ids"] == ["tiny-00", "tiny-01", "tiny-02"]
    assert declared[0]["fraction"] == 1.0 and declared[0]["gate"] == "live_equals_incremental"
    passed = [c["problem_id"] for e in events if e["event"] == "live_check_passed" for c in e["checks"]]
    assert passed == ["tiny-00", "tiny-01"]
    assert events.index(declared[0]) < next(i for i, e in enumerate(events) if e["event"] == "row")  # before any row


def test_checked_and_unchecked_arms_write_the_same_bytes_under_the_same_key(tmp_path, tiny_arm):
    problems = tiny_problems(3)
    _, checked = EXP1.run(tiny_arm(live_check_fraction=1.0), problems, ledger_root=tmp_path / "a", progress=False)
    _, unchecked = EXP1.run(tiny_arm(live_check_fraction=0.0), problems, ledger_root=tmp_path / "b", progress=False)
    assert checked.dir.name == unchecked.dir.name  # the fraction is not part of the ledger key
    assert checked.rows_path.read_bytes() == unchecked.rows_path.read_bytes()
    checks = [c["problem_id"] for e in _events(unchecked) if e["event"] == "live_check_passed" for c in e["checks"]]
    assert checks == ["tiny-00"]  # the preflight row is checked whatever the fraction
    _, fp32 = EXP1.run(tiny_arm(dtype="float32"), problems, ledger_root=tmp_path / "c", progress=False)
    assert not [e for e in _events(fp32) if e["event"].startswith("live_check")]  # FP32 checks every row otherwise


def test_the_fp32_arm_catches_the_same_fault_through_its_equivalence_gate(tmp_path, tiny_arm, monkeypatch):
    with _live_without_mask(monkeypatch):
        with pytest.raises(GateError, match="preflight row tiny-00 failed gate 'equivalence'"):
            EXP1.run(tiny_arm(dtype="float32"), tiny_problems(2), ledger_root=tmp_path, progress=False)


@contextlib.contextmanager
def _engine_live_without_roles(monkeypatch):
    """The batched engine's live steps lose the role visibility of their 4-D mask (causal only); its incremental
    rebuild keeps it."""
    from kvreplay.engine import step

    real_vis, real_lives = step.visibility_matrix, engine.decode_lives
    on = {"live": False}

    def vis(device="cpu"):
        v = real_vis(device)
        return torch.ones_like(v) if on["live"] else v

    def lives(*args, **kwargs):
        on["live"] = True
        try:
            return real_lives(*args, **kwargs)
        finally:
            on["live"] = False

    monkeypatch.setattr(step, "visibility_matrix", vis)
    monkeypatch.setattr(engine, "decode_lives", lives)
    yield


@contextlib.contextmanager
def _engine_live_prompt_skewed(monkeypatch):
    """The engine's live jobs (one engine for boundaries, rebuilds and suffixes) admit their prompt block with one
    key nudged in both duplicate rows: a live-only construction fault that the step, the duplicates and the
    replicas cannot see; the teacher-forced rebuild of the same boundary in the same engine admits it clean."""
    import dataclasses

    from kvreplay.engine import decoders

    real = decoders._live_work

    def live_work(eng, *args, **kwargs):
        work = real(eng, *args, **kwargs)

        def admit(slot: int):
            job, logits = work.admit(slot)
            with torch.inference_mode():
                eng.cache.layers[0].keys[2 * slot : 2 * slot + 2, 0, 0, 0] += 0.25
            return job, logits
        skewed = dataclasses.replace(work, admit=admit)
        return skewed

    monkeypatch.setattr(decoders, "_live_work", live_work)
    yield


def test_the_engine_checks_its_live_boundaries_through_its_own_path(tmp_path, tiny_arm, monkeypatch):
    settings = tiny_arm(step_path="engine-eager", batch=2, live_check_fraction=1.0)
    records, ledger = EXP1.run(settings, tiny_problems(3), ledger_root=tmp_path / "clean", progress=False)
    assert all(r["gate_failure"] is None for r in records)
    checked = [c["problem_id"] for e in _events(ledger) if e["event"] == "live_check_passed" for c in e["checks"]]
    assert checked.count("tiny-01") == 1 and checked.count("tiny-02") == 1 and "tiny-00" in checked
    with _engine_live_prompt_skewed(monkeypatch):  # boundaries and suffixes in one engine (the default chunk)
        with pytest.raises(GateError, match="preflight row tiny-00 failed gate 'live_equals_incremental'"):
            EXP1.run(settings, tiny_problems(3), ledger_root=tmp_path / "faulty", progress=False)


def test_the_phase_wise_engine_path_checks_its_live_boundaries_too(tiny_format, monkeypatch):
    from kvreplay.experiments.live_vs_prefill import live_vs_prefill_chunk_phased

    lm = tiny_lm("llama", torch.bfloat16)
    fmt = tiny_format(lm)
    problems = tiny_problems(2)
    run = EngineRun("eager", 2, 4096)
    spec = RunSpec(lm=lm, fmt=fmt, decoding=Decoding.of(TINY_CAPS), engine=run,
                   live_check_ids=frozenset(p.problem_id for p in problems))
    assert all(r["gate_failure"] is None for r in live_vs_prefill_chunk_phased(spec, problems))
    with _engine_live_without_roles(monkeypatch):
        faulty = live_vs_prefill_chunk_phased(spec, problems)
    assert {r["gate_failure"]["gate"] for r in faulty} == {"live_equals_incremental"}


def test_drift_outliers_flag_rows_far_above_the_arms_median():
    def row(pid, rel):
        return {"problem_id": pid, "gate_failure": None, "boundary": {"prefill_vs_live": {"cache": {"rel_l2": rel}}}}

    rows = [row(f"p{i}", 0.008 + 0.001 * i) for i in range(5)] + [row("bad", 0.156)]
    out = drift_outliers(rows)
    assert [o["problem_id"] for o in out] == ["bad"] and out[0]["times_median"] > DRIFT_OUTLIER_FACTOR
    assert drift_outliers(rows[:5]) == [] and drift_outliers(rows[:1] + rows[-1:]) == []  # two rows: never
    assert drift_outliers([row("a", 0.0), row("b", 0.0), row("c", 1e-7)])[0]["problem_id"] == "c"


def test_the_matrix_table_prints_the_flagged_rows(tiny_format):
    lm = tiny_lm("llama", torch.bfloat16)
    spec = RunSpec(lm=lm, fmt=tiny_format(lm), decoding=Decoding.of(TINY_CAPS))
    recs = [live_vs_prefill_row(spec, p) for p in tiny_problems(3)]
    recs[2]["boundary"]["prefill_vs_live"]["cache"]["rel_l2"] = 1.0  # as a live fault outside the sample would show
    for r in recs[:2]:
        r["boundary"]["prefill_vs_live"]["cache"]["rel_l2"] = 0.01
    s = matrix_summary(recs, "bfloat16", n_resamples=100)
    assert [o["problem_id"] for o in s["drift_outliers"]] == ["tiny-02"]
    row = matrix_table([s], None).loc["rows with drift above 10 x the median (flagged, not excluded)", "bfloat16"]
    assert row == "1/3: tiny-02 (100 x)"


def _skew_live(states):
    """A live state that is not what the live decoder's own function gives: one key nudged in both duplicate rows and
    in its replica alike, so the duplicate, replica, storage and functional-state gates all pass."""
    with torch.inference_mode():
        for name in ("live", "live_replica"):
            states[name].cache.layers[1].keys[:, 0, 3, 0] += 0.25


def test_a_skewed_live_state_passes_every_other_gate_and_fails_this_one(tiny_format):
    lm = tiny_lm("llama", torch.bfloat16)
    fmt, p = tiny_format(lm), tiny_problems(1)[0]
    unchecked = live_vs_prefill_row(RunSpec(lm=lm, fmt=fmt, decoding=Decoding.of(TINY_CAPS), faults=_skew_live), p)
    assert unchecked["gate_failure"] is None
    checked = live_vs_prefill_row(RunSpec(lm=lm, fmt=fmt, decoding=Decoding.of(TINY_CAPS), faults=_skew_live,
                                          live_check_ids=frozenset({p.problem_id})), p)
    assert checked["gate_failure"]["gate"] == "live_equals_incremental"
    assert "L01.key differs in 2 of" in checked["gate_failure"]["reason"]


def test_row_actors_carry_the_live_check(tmp_path, tiny_arm):
    """With Ray row actors the sample travels into each actor: the preflight row's check runs there."""
    from kvreplay.runner import actors as parallel

    parallel.shutdown()
    parallel.connect(num_cpus=2)
    try:
        settings = tiny_arm(workers=2, live_check_fraction=0.0)
        with pytest.raises(GateError, match="preflight row tiny-00 failed gate 'live_equals_incremental'"):
            EXP1.run(settings, tiny_problems(3), ledger_root=tmp_path / "faulty", progress=False, faults=_skew_live)
        records, ledger = EXP1.run(settings, tiny_problems(3), ledger_root=tmp_path / "clean", progress=False)
        assert all(r["gate_failure"] is None for r in records)
        (declared,) = [e for e in _events(ledger) if e["event"] == "live_check_sample"]
        assert declared["problem_ids"] == ["tiny-00"] and declared["fraction"] == 0.0
    finally:
        parallel.shutdown()
