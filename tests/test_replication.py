"""Experiment 5 (kvreplay.experiments.replication): the frozen interpretation matrix, the outcome-blind panel, six arms per row."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import TINY_CAPS, TINY_FORMAT, tiny_lm, tiny_problems
from kvreplay import adapt
from kvreplay.decoding import decode
from kvreplay.decoding.settings import Decoding
from kvreplay.experiments import replication
from kvreplay.experiments.fixed_prefix import load_fixed_prefixes
from kvreplay.experiments.live_vs_prefill import live_vs_prefill_row
from kvreplay.experiments.replication import (
    CHECKPOINT_SENSITIVE,
    CONDITIONAL,
    PROCEDURAL,
    STRONG,
    UNDERPOWERED,
    interpret,
    scaled_thresholds,
)
from kvreplay.gates import GateError
from kvreplay.ledger.prefix_bank import write_prefix_bank
from kvreplay.runner import RunSpec

# ----------------------------------------------------------------------------- thresholds and labels


@pytest.mark.parametrize("n, expected", [(48, (12, 6)), (16, (4, 2)), (2, (1, 1)), (1, (1, 1)), (47, (12, 6)),
                                         (49, (13, 7)), (24, (6, 3)), (200, (50, 25))])
def test_thresholds_scale_with_the_panel_and_round_up(n, expected):
    assert scaled_thresholds(n) == expected


@pytest.mark.parametrize("counts, label, scaled", [
    ((48, 42, 6, 42, 0), STRONG, False),
    ((48, 43, 5, 43, 0), CONDITIONAL, False),               # the paper's outcome
    ((48, 43, 5, 42, 0), CHECKPOINT_SENSITIVE, False),
    ((48, 40, 8, 40, 1), PROCEDURAL, False),
    ((48, 11, 37, 11, 0), UNDERPOWERED, False),
    # the primary verdict keeps the paper's absolute 12 and 6 whatever the panel size
    ((16, 4, 12, 4, 0), UNDERPOWERED, False),
    ((16, 4, 12, 4, 0), STRONG, True),                      # secondary: exactly at the scaled thresholds (4, 2)
    ((16, 3, 13, 3, 0), UNDERPOWERED, True),
    ((16, 15, 1, 15, 0), CONDITIONAL, True),
    ((16, 12, 4, 12, 0), CONDITIONAL, False),
    ((16, 0, 16, 0, 0), UNDERPOWERED, False),               # no divergent row: recovery is vacuous
    ((200, 12, 188, 12, 0), STRONG, False),
    ((200, 12, 188, 12, 0), UNDERPOWERED, True),            # scaled to 200 rows: 50 divergent needed
    # precedence
    ((48, 40, 8, 30, 1), PROCEDURAL, False),                # a procedural failure voids the recovery evidence
    ((48, 3, 45, 2, 0), CHECKPOINT_SENSITIVE, False),       # an observed recovery failure needs no power
    ((2, 1, 1, 1, 0), UNDERPOWERED, False),                 # smoke: far below the paper's thresholds
    ((2, 1, 1, 1, 0), STRONG, True),                        # ... though "strong" once scaled to (1, 1)
    ((2, 2, 0, 2, 0), CONDITIONAL, True),
])
def test_every_label_and_its_precedence(counts, label, scaled):
    n, div, ex, rec, novel = counts
    got = interpret(n, div, ex, rec, novel, scaled=scaled)
    assert got.label == label, got
    assert got.scaled is scaled and got.reason and f"n = {n}" in got.thresholds_text()
    if not scaled:
        assert (got.min_divergent, got.min_exact) == (12, 6)


def test_interpret_rejects_inconsistent_counts():
    for bad in ((10, 5, 4, 5, 0), (10, 5, 5, 6, 0), (10, 5, 5, 5, 6)):
        with pytest.raises(ValueError, match="inconsistent"):
            interpret(*bad)
    with pytest.raises(ValueError):
        scaled_thresholds(0)


# ----------------------------------------------------------------------------- the outcome-blind panel


def _bank(tmp_path, problems, lengths):
    recs = [{"problem_id": p.problem_id, "prompt_len": 1, "prefix": list(range(n))} for p, n in zip(problems, lengths)]
    path = tmp_path / "bank.jsonl"
    write_prefix_bank(recs, path, "src")
    return path


def test_panel_reads_only_ids_and_lengths(tmp_path):
    problems = tiny_problems(7)
    lengths = [30, 10, 50, 10, 40, 20, 60]
    fixed = load_fixed_prefixes(_bank(tmp_path, problems, lengths), problems)
    cand = replication.panel_candidates(fixed.entries)
    assert cand == [(p.problem_id, n) for p, n in zip(problems, lengths)]
    panel = replication.freeze_replication_panel(cand, 4)
    # sorted by (length, id): 10 tiny-01, 10 tiny-03, 20, 30, 40, 50, 60 -> positions round(i * 6 / 3) = 0, 2, 4, 6
    assert panel == [{"problem_id": "tiny-01", "prefix_len": 10}, {"problem_id": "tiny-05", "prefix_len": 20},
                     {"problem_id": "tiny-04", "prefix_len": 40}, {"problem_id": "tiny-06", "prefix_len": 60}]
    # changing every outcome (answers; any suffix or divergence label elsewhere) cannot change the panel
    flipped = [dataclasses.replace(p, answer="D" if p.answer != "D" else "A") for p in problems]
    again = load_fixed_prefixes(tmp_path / "bank.jsonl", flipped)
    assert replication.freeze_replication_panel(replication.panel_candidates(again.entries), 4) == panel
    # structurally: records carrying outcomes are refused
    with pytest.raises(TypeError, match="pairs"):
        replication.freeze_replication_panel([{"problem_id": "x", "prefix_len": 3, "suffix_differs": True}], 1)
    with pytest.raises(ValueError, match="repeat"):
        replication.freeze_replication_panel([("a", 1), ("a", 2)], 1)
    assert len(replication.freeze_replication_panel(cand, 100)) == 7  # a small bank: every row
    doc = replication.panel_doc(panel, n_requested=4, prefix_bank_sha256=fixed.sha256, checkpoint={"kind": "x"})
    assert doc["rule"] == replication.PANEL_RULE and doc["n"] == len(panel) == 4 and doc["panel"] == panel


# ----------------------------------------------------------------------------- one row, six arms


@pytest.fixture
def spec(tiny_format):
    lm = tiny_lm("llama", torch.bfloat16, role_table=torch.randn(14, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16))
    return RunSpec(lm=lm, fmt=tiny_format(lm), decoding=Decoding.of(TINY_CAPS))


def test_replication_row_runs_exactly_six_arms(spec, monkeypatch):
    p = tiny_problems(1)[0]
    prefix = live_vs_prefill_row(spec, p)["prefix"]
    calls = []
    real = decode.decode_suffix

    def counting(lm, fmt, state, caps, **kwargs):
        calls.append(state.construction)
        return real(lm, fmt, state, caps, **kwargs)

    monkeypatch.setattr(decode, "decode_suffix", counting)
    rec = replication.replication_row(spec, p, prefix)
    assert rec["gate_failure"] is None, rec["gate_failure"]
    assert sorted(calls) == sorted(["incremental", "incremental_replica", "prefill", "prefill_replica",
                                    "prefill<-incremental", "incremental<-prefill"])
    assert list(rec["interventions"]) == ["whole"] and rec["stratum"] == "panel"
    assert rec["interventions"]["whole"]["prefill<-incremental"]["suffix"] == rec["baseline"]["incremental"]
    assert set(rec["scores"]) == {"incremental", "prefill"} and isinstance(rec["scores"]["incremental"]["correct"], bool)
    s = replication.replication_summary([rec])
    assert s["rows"] == 1 and s["divergence"].n == 1 and s["interpretation"].n == 1
    table = replication.replication_table(s, "tiny + role table")
    assert table.iloc[:, 0]["interpretation (frozen matrix)"] == s["interpretation"].label
    exp2 = [{"problem_id": p.problem_id, "gate_failure": None,
             "arms": {"incremental": {"correct": not rec["scores"]["incremental"]["correct"], "predicted": "Z",
                                      "suffix": [1, 2, 3]}}}]
    acc = replication.accuracy_vs_checkpoint0(exp2, [rec], n_resamples=100)
    assert acc["mcnemar"].b + acc["mcnemar"].c == 1 and acc["answers_differ"] == 1
    assert acc["suffix_len"]["ckpt0"] == (3, 3, 3) and acc["suffix_len"]["later"][0] == len(rec["baseline"]["incremental"])
    assert "vs" in replication.accuracy_table(acc).iloc[:, 0]["incremental suffix length, median (range), checkpoint 0 vs later"]
    with pytest.raises(GateError, match="missing"):
        replication.accuracy_vs_checkpoint0([], [rec])


def test_failed_gate_withholds_the_verdict(spec):
    p = tiny_problems(1)[0]
    prefix = live_vs_prefill_row(spec, p)["prefix"]
    bad = dataclasses.replace(spec, faults=lambda states: setattr(states["prefill_replica"], "logits",
                                                                    states["prefill_replica"].logits + 1))
    rec = replication.replication_row(bad, p, prefix)
    assert rec["gate_failure"]["gate"] == "replica" and "scores" not in rec
    with pytest.raises(GateError, match="report"):
        replication.replication_summary([rec])


# ----------------------------------------------------------------------------- which checkpoint


def _tiny_family(tmp_path):
    cfg = adapt.AdaptConfig(name="t", model="embedded", fmt=TINY_FORMAT, n_train=2, n_heldout=1, steps=2,
                            checkpoints=(1, 2), eval_every=1, threads=1)
    from kvreplay.runner import model_key

    folder, manifest = adapt.ensure_checkpoints(cfg, tmp_path / "ck", bank=[], problems=tiny_problems(3), progress=False,
                                                loader=lambda: tiny_lm("llama", torch.float32), base_key=model_key("embedded"))
    pointer = tmp_path / "ledger" / adapt.POINTER
    adapt.write_pointer(pointer, folder, manifest)
    return folder, pointer


def test_resolve_checkpoint(tmp_path):
    folder, pointer = _tiny_family(tmp_path)
    ck = replication.resolve_checkpoint("embedded", None, None, pointer)
    later = adapt.checkpoint(folder, "later")
    assert ck.model == "embedded" and ck.role_table == str(later.path) and ck.record["role_table_sha256"] == later.sha256
    assert "later role table of notebook 00 (step 2" in ck.description == replication.describe_checkpoint(ck.record)
    with pytest.raises(adapt.CheckpointError, match="trained on"):
        replication.resolve_checkpoint(str(later.path), None, None, pointer)  # another base model than the table's
    user = replication.resolve_checkpoint("embedded", str(later.path), str(later.path), pointer)
    assert user.record["kind"] == "user-given checkpoint" and user.role_table == str(later.path)
    with pytest.raises(FileNotFoundError):
        replication.resolve_checkpoint("embedded", None, str(tmp_path / "none.pt"), pointer)
    t = torch.load(later.path, weights_only=True)
    torch.save(t + 1, later.path)
    with pytest.raises(adapt.CheckpointError, match="sha256"):
        replication.resolve_checkpoint("embedded", None, None, pointer)
    with pytest.raises(adapt.CheckpointError, match="00_role_adaptation"):
        replication.resolve_checkpoint("embedded", None, None, tmp_path / "missing.json")


def test_role_table_ledger_key_is_location_independent(tmp_path):
    from kvreplay.model.models import ModelLoadError
    from kvreplay.paths import ROOT
    from kvreplay.runner import role_table_key

    f = tmp_path / "t.pt"
    torch.save(torch.zeros(14, 4), f)
    key = role_table_key(f)
    assert key["model"] == str(f) and len(key["sha256"]) == 64
    inside = ROOT / "build" / "kvreplay-test-key" / "t.pt"  # torch.save writes the file stem into the archive
    inside.parent.mkdir(parents=True, exist_ok=True)
    torch.save(torch.zeros(14, 4), inside)
    try:
        assert role_table_key(inside) == {"model": "build/kvreplay-test-key/t.pt", "sha256": key["sha256"]}
    finally:
        inside.unlink()
        inside.parent.rmdir()
    with pytest.raises(ModelLoadError):
        role_table_key(tmp_path / "none.pt")
