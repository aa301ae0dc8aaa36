"""Experiment 2 and 3 machinery on tiny models: selection, crossing statistics, bridge and audit."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_CAPS, tiny_lm, tiny_problems

from kvreplay.experiments import (
    RunSpec, bridge_row, exp1_row, exp2_row, first_divergence, order_statistics, precision_crossing, saved_ledger_audit,
)
from kvreplay.gates import GateError


def test_order_statistics_are_evenly_spaced_and_outcome_blind():
    items = [{"id": f"p{i}", "len": (i * 37) % 100} for i in range(20)]
    pick = order_statistics(items, 5, key=lambda e: (e["len"], e["id"]))
    srt = sorted(items, key=lambda e: (e["len"], e["id"]))
    assert pick == [srt[0], srt[5], srt[10], srt[14], srt[19]]  # round(i * 19 / 4)
    assert order_statistics(items, 50, key=lambda e: e["len"]) == srt


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def _rec(pid, suffix, answer, label, prefix=(1, 2)):
    return {"problem_id": pid, "gate_failure": None, "prefix": list(prefix),
            "endpoints": {"suffix_differs": suffix, "answer_differs": answer, "label_differs": label}}


def test_precision_crossing_counts_direction():
    bf = [_rec(f"p{i}", i < 8, i < 3, i < 1) for i in range(10)]
    fp = [_rec(f"p{i}", False, False, False) for i in range(10)]
    c = precision_crossing(bf, fp, n_resamples=500)
    assert c["prefix_identical"] == 10
    assert c["suffix"]["change"].estimate == pytest.approx(-0.8)
    assert (c["suffix"]["mcnemar"].b, c["suffix"]["mcnemar"].c) == (8, 0)
    with pytest.raises(GateError, match="paired"):
        precision_crossing(bf, list(reversed(fp)))


@pytest.fixture
def spec(tiny_format):
    lm = tiny_lm("qwen2", torch.bfloat16)
    return RunSpec(lm=lm, fmt=tiny_format(lm), caps=TINY_CAPS)


def test_bridge_row_is_exact_and_audit_joins(spec):
    problems = tiny_problems(2)
    exp1 = [exp1_row(spec, p) for p in problems]
    exp2 = [exp2_row(spec, p, r["prefix"]) for p, r in zip(problems, exp1)]
    audit = saved_ledger_audit(exp1, exp2)
    assert audit["order_agrees"] and audit["prefix_agrees"] == 2
    assert all(v == 2 for v in audit["suffix_agrees"].values())
    assert audit["cache_leaves_agree_rows"] == 2 and audit["logit_leaves_agree_rows"] == 2
    assert audit["cache_leaves"][0] > 0 and audit["logit_leaves"][0] > 0
    exp2[1]["boundary"]["prefill_vs_incremental"]["cache"]["rel_l2"] += 1e-9  # a leaf that no longer agrees
    assert saved_ledger_audit(exp1, exp2)["cache_leaves_agree_rows"] == 1
    b = bridge_row(spec, problems[0], exp1[0]["prefix"])
    assert b["gate_failure"] is None
    assert b["endpoints"]["cache_exact"] and b["endpoints"]["layers_exact"] == b["endpoints"]["layers"] == 2
    assert b["endpoints"]["logits_exact"] and b["endpoints"]["suffix_exact"] and b["same_as_saved"]
