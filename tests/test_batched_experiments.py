"""Batched runners of Experiments 3-5 and the controls on the engine's eager path (CPU, tiny random-weight model).

Each runner must give records with the per-row function's layout, pass every
gate (the composition gate included, through a preflight row), and keep its
experiment's own invariants under the engine: the bridge is bit-exact, a
whole-cache transplant follows its donor, the FP32 readout writes the plain
caches.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import TINY_CAPS, TINY_FORMAT, key_paths, make_model, make_tokenizer

from kvreplay.decoding import decode
from kvreplay import engine, gates
from kvreplay.experiments import replication
from kvreplay.experiments.bridge import EXP3, bridge_chunk, bridge_row, bridge_summary
from kvreplay.experiments.controls import EXP2_CONTROLS, controls_summary
from kvreplay.experiments.live_vs_prefill import EXP1
from kvreplay.experiments.transplant import EXP4, transplant_chunk, transplant_row, transplant_summary
from kvreplay.data.problems import Problem
from kvreplay.runner import ArmSettings, run_arm


@pytest.fixture(scope="module")
def arm(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    tok = make_tokenizer()
    make_model("llama", len(tok)).save_pretrained(root / "tiny-llama")
    tok.save_pretrained(root / "tiny-llama")
    (root / "tiny.yaml").write_text(yaml.safe_dump(TINY_FORMAT))

    def settings(**kw):
        base = dict(profile="t", dtype="bfloat16", caps=TINY_CAPS, model=str(root / "tiny-llama"),
                    fmt=str(root / "tiny.yaml"), threads=1, preflight=1)
        return ArmSettings(**(base | kw))

    return settings


PROBLEMS = [Problem(f"p-{i:02d}", "test", i + 1, "Q" + "xyz"[i % 3] * (3 * i) + "?", ("x", "y", f"z{i}", "w"),
                    "ABCD"[i % 4]) for i in range(5)]
BATCHED = dict(step_path="engine-eager", batch=2)


@pytest.fixture(scope="module")
def prefixes(arm, tmp_path_factory):
    records, _ = EXP1.run(arm(), PROBLEMS, ledger_root=tmp_path_factory.mktemp("l"), progress=False)
    return {r["problem_id"]: r["prefix"] for r in records}



def _both(name, arm, tmp_path, row, chunk, problems=PROBLEMS, **kw):
    eager, _ = run_arm(name, arm(**kw), problems, row, ledger_root=tmp_path, progress=False)
    batched, ledger = run_arm(name, arm(**(kw | BATCHED)), problems, row, ledger_root=tmp_path, progress=False, chunk=chunk)
    assert [r["problem_id"] for r in batched] == [p.problem_id for p in problems]
    failed = [(r["problem_id"], r["gate_failure"]) for r in eager + batched if r["gate_failure"]]
    assert not failed
    for a, b in zip(eager, batched):
        assert key_paths(a) == key_paths(b)
    assert "composition" in ledger.rows_path.with_name("runlog.jsonl").read_text()  # the preflight row ran alone too
    return eager, batched


def test_bridge_runner_keeps_incremental_equal_to_live_under_the_engine(arm, prefixes, tmp_path):
    eager, batched = _both("exp3", arm, tmp_path, lambda spec, p: bridge_row(spec, p, prefixes[p.problem_id]),
                           lambda spec, ps: bridge_chunk(spec, ps, [prefixes[p.problem_id] for p in ps]))
    s = bridge_summary(batched)
    assert s["layers_exact"] == s["logits_exact"] == s["suffix_exact"] == len(PROBLEMS)
    assert [r["saved_prefix_len"] for r in batched] == [len(prefixes[p.problem_id]) for p in PROBLEMS]


def test_transplant_runner_follows_the_donor_and_runs_the_sweep(arm, prefixes, tmp_path):
    strata = {p.problem_id: ("divergent" if i % 2 else "exact") for i, p in enumerate(PROBLEMS)}
    sweep = {PROBLEMS[1].problem_id}
    row = lambda spec, p: transplant_row(spec, p, prefixes[p.problem_id], strata[p.problem_id],  # noqa: E731
                                         p.problem_id in sweep)
    chunk = lambda spec, ps: transplant_chunk(spec, ps, [prefixes[p.problem_id] for p in ps],  # noqa: E731
                                              [strata[p.problem_id] for p in ps], [p.problem_id in sweep for p in ps])
    eager, batched = _both("exp4", arm, tmp_path, row, chunk)
    for r in batched:
        for d, donor in (("prefill<-incremental", "incremental"), ("incremental<-prefill", "prefill")):
            assert r["interventions"]["whole"][d]["suffix"] == r["baseline"][donor]
    assert sum(name.startswith("layer_") for name in batched[1]["interventions"]) == 2  # the tiny model's layers
    assert transplant_summary(batched)["rows"] == len(PROBLEMS)


def test_replication_runner_scores_both_baselines(arm, prefixes, tmp_path):
    eager, batched = _both("exp5", arm, tmp_path, lambda spec, p: replication.replication_row(spec, p, prefixes[p.problem_id]),
                           lambda spec, ps: replication.replication_chunk(spec, ps, [prefixes[p.problem_id] for p in ps]))
    for r in batched:
        assert set(r["interventions"]) == {"whole"} and set(r["scores"]) == {"incremental", "prefill"}


def test_controls_runner_reads_out_in_fp32_on_the_plain_caches(arm, prefixes, tmp_path):
    key = {"prefix_bank_sha256": "bank", "seed": 20260729}
    eager, _ = EXP2_CONTROLS.run(arm(), PROBLEMS, prefixes=prefixes, key=key, ledger_root=tmp_path, progress=False)
    batched, ledger = EXP2_CONTROLS.run(arm(**BATCHED), PROBLEMS, prefixes=prefixes, key=key, ledger_root=tmp_path,
                                        progress=False)
    assert not [r for r in eager + batched if r["gate_failure"]]  # gate `readout`: same caches with the FP32 head
    for a, b in zip(eager, batched):
        assert key_paths(a) == key_paths(b)
    assert controls_summary(batched)["n"] == len(PROBLEMS)
    assert "composition" in (ledger.dir / "runlog.jsonl").read_text()
    # the engine's readout: float32 logits from the body's bfloat16 hidden state, the same keys/values
    lm, fmt = arm().load()
    z = [prefixes[p.problem_id] for p in PROBLEMS[:3]]
    plain = engine.build_incrementals(lm, fmt, z, run=engine.EngineRun(batch=2))
    fp32 = engine.build_incrementals(lm, fmt, z, run=engine.EngineRun(batch=2), readout=decode.FP32Readout(lm))
    for a, b in zip(plain, fp32):
        assert a.logits.dtype == torch.bfloat16 and b.logits.dtype == torch.float32
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(gates.cache_tensors(a.cache), gates.cache_tensors(b.cache)))
        assert torch.allclose(a.logits.float(), b.logits, atol=0.1, rtol=0.02)  # the same function, finer rounding


def test_verify_recomputes_batched_rows_of_the_later_experiments(arm, prefixes, tmp_path):
    """`make verify` on batched exp3 / exp4 / controls ledgers: each row alone at the recorded batch shape, bit for bit."""
    from kvreplay.ledger.prefix_bank import write_prefix_bank
    from kvreplay.ledger.store import ROWS
    from kvreplay.verify import verify_ledger

    records = [{"problem_id": p.problem_id, "prompt_len": 1, "prefix": prefixes[p.problem_id], "gate_failure": None}
               for p in PROBLEMS]
    sha = write_prefix_bank(records, tmp_path / "t" / "prefix_bank_bf16.jsonl", "exp1-test")
    model = arm().model
    panel = [{"problem_id": p.problem_id, "stratum": "divergent", "prefix_len": len(prefixes[p.problem_id])}
             for p in PROBLEMS[:3]]
    folders = [
        EXP3.run(arm(**BATCHED), PROBLEMS, prefixes=prefixes, key={"prefix_bank_sha256": sha}, ledger_root=tmp_path,
                 progress=False)[1].dir,
        EXP4.run(arm(**BATCHED), PROBLEMS[:3], prefixes=prefixes, key={"prefix_bank_sha256": sha, "panel": panel,
                                                                       "sweep": []},
                 ledger_root=tmp_path, progress=False)[1].dir,
        EXP2_CONTROLS.run(arm(**BATCHED), PROBLEMS[:3], prefixes=prefixes, key={"prefix_bank_sha256": sha, "seed": 7},
                          ledger_root=tmp_path, progress=False)[1].dir,
    ]
    for folder in folders:
        checks = verify_ledger(folder, rows=3, pick="first", problems=PROBLEMS, model=model)
        assert [(c.mode, c.ok) for c in checks] == [("bytes", True)] * 3, (folder.name, checks)
    # a planted change in a committed transplant row is found
    lines = (folders[1] / ROWS).read_text().splitlines()
    rec = json.loads(lines[1])
    rec["interventions"]["whole"]["prefill<-incremental"]["suffix"][-1] += 1
    lines[1] = json.dumps(rec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    (folders[1] / ROWS).write_text("\n".join(lines) + "\n")
    bad = [c for c in verify_ledger(folders[1], rows=3, pick="first", problems=PROBLEMS, model=model) if not c.ok]
    assert [c.problem_id for c in bad] == [PROBLEMS[1].problem_id]
