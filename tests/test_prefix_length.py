"""Divergence by boundary-prefix length (report.prefix_length): bins, the logistic fit inside the observed range, the
extrapolation beyond it labelled as one, on synthetic rows and on the committed `paper` ledger."""

from __future__ import annotations

import numpy as np
import pytest
from kvreplay.ledger.lookup import load_profile_ledgers
from kvreplay.paths import LEDGERS
from kvreplay.report import prefix_length as pl


def _records(lengths, parted):
    return [{"problem_id": f"p{i}", "prefix_len": n, "endpoints": {"suffix_differs": d, "tie_initiated": d and i % 2 == 0}}
            for i, (n, d) in enumerate(zip(lengths, parted))]


def _rising(n: int = 120):
    rng = np.random.default_rng(3)
    lengths = rng.integers(200, 2200, n)
    parted = rng.random(n) < 1 / (1 + np.exp(-(lengths - 1200) / 300))
    return pl.prefix_length_frame(_records(lengths.tolist(), parted.tolist()), "x", "fam")


def test_rows_and_divergences_per_bin():
    frame = pl.prefix_length_frame(_records([100, 300, 300, 1100, 1500], [False, True, False, True, True]), "x", "fam")
    bins = pl.bin_table(frame)
    assert bins["prefix tokens"].tolist() == ["1-256", "257-512", "1025-1536"]
    assert bins.rows.tolist() == [1, 2, 2] and bins["suffixes part"].tolist() == [0, 1, 2]
    assert bins["rate [Wilson 95%]"].tolist()[1].startswith("50.0% [")
    with pytest.raises(ValueError, match="outside the bins"):
        pl.bin_table(pl.prefix_length_frame(_records([7000], [True]), "x", "fam"))
    with pytest.raises(ValueError, match="no prefix_len or endpoints.suffix_differs"):
        pl.prefix_length_frame([{"problem_id": "p", "endpoints": {}}], "x", "fam")


def test_the_fit_is_drawn_inside_the_data_and_labelled_an_extrapolation_beyond():
    frame = _rising()
    fit = pl.logistic_fit(frame)
    lo, hi = fit.observed
    assert fit.note is None and fit.odds_ratio > 1 and fit.odds_ratio_ci[0] > 1 and fit.p_value < 0.05
    inside = fit.curve[~fit.curve.extrapolated]
    assert inside.prefix_len.min() == lo and inside.prefix_len.max() == hi
    assert fit.curve[fit.curve.prefix_len > hi].extrapolated.all() and fit.curve.prefix_len.max() == pl.PAPER_RANGE[1]
    assert ((fit.curve.low <= fit.curve.p) & (fit.curve.p <= fit.curve.high)).all()
    row = pl.fit_table([fit]).iloc[0]
    assert row["fitted rate at 5,080 tokens (the paper's longest)"].endswith("EXTRAPOLATION beyond the data")
    assert "EXTRAPOLATION" not in row["fitted rate, longest prefix"]
    fig = pl.prefix_length_figure(frame, fit, "t")
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert any(label.startswith("EXTRAPOLATION beyond the data") for label in labels)


def test_no_fit_where_the_rows_cannot_carry_one():
    assert pl.logistic_fit(pl.prefix_length_frame(_records([300] * 12, [False] * 12), "x", "f")).note == \
        "no fit: no row's suffixes part"
    assert pl.logistic_fit(pl.prefix_length_frame(_records([300, 900], [False, True]), "x", "f")).note == \
        "no fit: 2 rows, fewer than 10"
    with pytest.raises(ValueError, match="exactly one profile and family"):
        pl.logistic_fit(_rising().assign(profile=["a", "b"] * 60))


def test_the_committed_paper_ledger():
    exp1 = load_profile_ledgers(LEDGERS, "paper", ["bfloat16", "float32"])["exp1-bfloat16"]
    frame = pl.prefix_length_frame(exp1.records, "paper", pl.family_of(exp1.contract["model"]))
    bins = pl.bin_table(frame)
    assert bins.rows.sum() == 200 and bins["suffixes part"].sum() == 76  # the headline's 76/200
    assert (frame.prefix_len.min(), frame.prefix_len.max()) == (223, 2209)
    assert frame.family.iloc[0] == "SmolLM2-135M-Instruct.Q4_1.gguf (LlamaForCausalLM)"
