"""kvreplay.report.figures and the table/figure writers of kvreplay.report.files, on synthetic frames (no model, no ledger)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from kvreplay.report import figures  # noqa: E402
from kvreplay.report.files import contract_frame, latex_escape, save_figure, save_table  # noqa: E402


def _layers():
    rows = []
    for d, scale in (("bfloat16", 1e-2), ("float32", 1e-7)):
        for kind, k in (("key", 1.0), ("value", 30.0)):  # values far above keys: one shared limit would cut them off
            for layer in range(4):
                rows.append({"layer": layer, "kind": kind, "precision": d, "rel_l2": 0.0 if layer == 0 else scale * k * layer})
    return pd.DataFrame(rows)


def _count_ticks_are_integers(axis):
    ticks = [t for t in axis.get_majorticklocs()]
    return all(float(t).is_integer() for t in ticks)


def test_layer_drift_gives_each_panel_its_own_log_limits_and_an_exact_band():
    layer = _layers()
    fig = figures.layer_drift(layer, title="t")
    for ax, kind in zip(fig.axes, ("key", "value")):
        assert ax.get_yscale() == "log"
        lo, hi = ax.get_ylim()
        assert lo > 0, "no axis height on zero or negative values"
        assert hi >= layer[layer.kind == kind].rel_l2.max(), f"{kind}: the largest value is off the top"
        floor = figures.exact_floor(layer[layer.kind == kind].rel_l2)
        assert ax.yaxis.get_major_formatter()(floor) == "0 (exact)"  # the zero band is labelled, not given a power of ten
    plt.close(fig)


def test_divergence_and_drift_histogram_counts_are_integers():
    firsts = pd.DataFrame({"precision": ["bfloat16"] * 3, "first divergence": [2, 5, 5]})
    fig = figures.divergence_and_drift(firsts, _layers(), reference="live", title="t")
    assert _count_ticks_are_integers(fig.axes[0].yaxis)
    assert fig.axes[1].get_yscale() == "log" and fig.axes[1].get_ylim()[0] > 0
    plt.close(fig)


def test_localization_draws_yes_no_outcomes_as_dots_not_lines():
    coarse = pd.DataFrame({"follows donor": [2, 1], "follows recipient": [0, 1], "new (third) trajectory": [0, 0]},
                          index=["whole", "keys_only"])
    sweep = pd.DataFrame({"layer": [0, 1, 0, 1], "direction": ["a<-b", "a<-b", "b<-a", "b<-a"],
                          "follows donor": [1, 0, 1, 1], "rows": [1, 1, 1, 1]})
    fig = figures.localization(coarse, sweep, n_sweep_rows=1, title="t")
    ax = fig.axes[1]
    assert not ax.get_lines(), "binary outcomes must not be joined by lines"
    assert "count" in fig.axes[0].get_ylabel() and _count_ticks_are_integers(fig.axes[0].yaxis)
    plt.close(fig)


def test_design_figure_is_a_function_of_the_caps():
    fig = figures.design_figure({"branch": 48, "merge": 160, "answer": 12}, 2, "cpu")
    text = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert "cap 48" in text and "cap 160" in text and "batch of\n2 duplicates" in text
    plt.close(fig)


def test_explorer_view_labels_positions_with_token_text():
    maps = {(k, a): pd.DataFrame(np.abs(np.random.default_rng(0).normal(size=(3, 2 if a == "head" else 6))) * 1e-3)
            for k in ("key", "value") for a in ("head", "position")}
    maps[("key", "position")].iloc[0, 0] = 0.0
    tokens = ["<s>", "Q", "?", "br", "me", "A"]
    fig = figures.explorer_view(maps, np.array([0, 1e-3, np.nan, 2e-3, 1e-4, 0]), tokens, {"prompt": 0, "merge": 4},
                                layer=1, head=0, kind="key", title="t")
    labels = [t.get_text() for t in fig.axes[1].get_xticklabels()]
    assert labels == tokens
    plt.close(fig)


def test_source_stamp_sits_below_every_axis(tmp_path):
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1], [0, 1])
    ax.set_xlabel("a long x label that used to collide with the stamp")
    save_figure(fig, tmp_path / "f", source="notebooks/x.ipynb", show=False)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    r = FigureCanvasAgg(fig).get_renderer()
    stamp = next(t for t in fig.texts if t.get_text().startswith("source:"))
    assert stamp.get_window_extent(r).y1 <= ax.get_tightbbox(r).y0 + 1e-6
    assert (tmp_path / "f.png").stat().st_size and (tmp_path / "f.pdf").stat().st_size


def test_latex_tables_are_escaped_and_labelled(tmp_path, capsys):
    df = pd.DataFrame({"value": ["≥ 12 → 3/4", "5% of x_y…"]}, index=["a — b", "c"])
    paths = save_table(df, tmp_path / "table_demo", caption="Demo & caption — 50%", source="notebooks/x.ipynb")
    tex = paths[2].read_text()
    assert tex.isascii()
    assert "\\label{tab:table_demo}" in tex and "\\caption{Demo \\& caption --- 50\\%}" in tex
    assert "$\\geq$ 12 $\\rightarrow$ 3/4" in tex and "5\\% of x\\_y\\ldots{}" in tex
    assert "[saved table table_demo: .csv .md .tex]" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no LaTeX spelling"):
        latex_escape("emoji 🙂")


def test_contract_frame_is_compact():
    env = {"execution_contract": {"torch": "2.13.0+cpu", "transformers": "5.17.0", "python": "3.11.7", "device": "cpu",
                                  "dtype": "bfloat16", "model": {"model": "embedded", "weights_sha256": "ab" * 32}},
           "library_sha256": "cd" * 32}
    t = contract_frame({"bfloat16": env})
    assert list(t.columns) == ["bfloat16"] and len(t) <= 14
    assert t.loc["weights sha256", "bfloat16"] == "abababababab…"
