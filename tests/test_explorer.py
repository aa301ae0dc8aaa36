"""The drift explorer's cache of rebuilt rows (kvreplay.report.rebuild.RebuiltDrift on disk) and its widget logic, on the
committed cpu ledgers: a row rebuilt once draws again from disk without loading a model; a row that must be rebuilt
is marked as rebuilding before the rebuild starts; keys change with the row and the versions."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from kvreplay.notebook import explorer
from kvreplay.report import rebuild
from kvreplay.ledger.lookup import find_chain_ledger
from kvreplay.paths import LEDGERS


@pytest.fixture(scope="module")
def cpu_exp1():
    ledger = find_chain_ledger(LEDGERS, "cpu", "exp1-bfloat16")
    row = rebuild.pick_row(ledger.records, None, "exp1")
    return ledger, row


@pytest.fixture
def no_model(monkeypatch, tmp_path):
    """Loading a model fails the test; the local cache is an empty temp folder (only committed rebuilds exist)."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(explorer, "load_for_ledger", refuse)
    monkeypatch.setattr(explorer, "_DRIFTS", {})
    monkeypatch.setenv(explorer.CACHE_ENV, str(tmp_path / "cache"))


def test_the_committed_rebuild_draws_without_a_model_and_matches_its_ledger(cpu_exp1, no_model):
    import matplotlib

    matplotlib.use("Agg")
    from kvreplay.report import figures

    ledger, row = cpu_exp1
    drift = explorer.cached(ledger, row, "prefill_vs_live")
    assert drift is not None, "data/explorer/cpu holds the executed notebook's row (the first divergent BF16 row)"
    assert drift.fingerprint == {"cache": True, "logits": True, "tensors": True}
    n = row["prefix_len"]
    assert len(drift.tokens) == n and drift.maps[("key", "position")].shape == (30, n)
    assert drift.detail["value"].shape == (30, 3, n) and drift.detail["value"].dtype == np.float32
    # the per-layer drift the ledger recorded, recomputed from the cached per-position map's parts: same ordering
    ledger_layers = pd.DataFrame(row["boundary"]["prefill_vs_live"]["tensors"])
    assert len(ledger_layers) == 60
    # drawing: the explorer's view, zoomed to a window with every token labelled, and the largest positions
    fig = figures.explorer_view(drift.maps, explorer.head_position_drift(drift, 5, 1, "key"), drift.tokens,
                                drift.blocks, layer=5, head=1, kind="key", title="t")
    explorer.zoom(fig, drift.tokens, (10, 40))
    (ax,) = [a for a in fig.axes if a.get_title(loc="left").startswith("keys: drift per position")]
    assert ax.get_xlim() == (9.5, 40.5) and [t.get_text() for t in ax.get_xticklabels()][:2] == drift.tokens[10:12]
    top = explorer.largest_drift(drift, 5, 1, "key", n=5)
    assert list(top.columns) == ["token", "block", "relative L2"] and len(top) == 5
    assert top["relative L2"].is_monotonic_decreasing and set(top.block) <= set(drift.blocks)
    assert explorer.committed_example("exp1-bfloat16", "prefill_vs_live").key == drift.key


def test_a_cached_rebuild_round_trips_and_its_key_follows_the_row_and_versions(cpu_exp1, tmp_path, monkeypatch):
    ledger, row = cpu_exp1
    drift = explorer.cached(ledger, row, "prefill_vs_live")
    path = rebuild.save_drift(drift, tmp_path / "x.npz")
    back = rebuild.load_drift(path)
    for k, frame in drift.maps.items():
        pd.testing.assert_frame_equal(back.maps[k], frame)
    assert all(np.array_equal(back.detail[k], drift.detail[k], equal_nan=True) for k in rebuild.KINDS)
    assert (back.summary, back.tokens, back.blocks, back.key) == (drift.summary, drift.tokens, drift.blocks, drift.key)
    # the logits kept give the full vocabulary's top-k table
    full = back.full_logits(0)
    assert full.shape == (back.key["vocab"],) and int(full.argmax()) == row["boundary"]["prefill_vs_live"]["logits"]["argmax_ref"]
    key = rebuild.drift_key(ledger, row, "prefill_vs_live")
    assert key["digest"] == drift.key["digest"]
    assert rebuild.drift_key(ledger, row | {"prefix_len": 0}, "prefill_vs_live")["digest"] != key["digest"]
    assert rebuild.drift_key(ledger, row, "live_replica")["digest"] != key["digest"]
    monkeypatch.setattr(rebuild, "REBUILD_VERSION", rebuild.REBUILD_VERSION + 1)
    assert rebuild.drift_key(ledger, row, "prefill_vs_live")["digest"] != key["digest"]
    with pytest.raises(ValueError, match=r"x.npz: a cached rebuild of version 1, this library reads 2"):
        rebuild.load_drift(path)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="bad.npz: not a cached rebuild"):
        rebuild.load_drift(tmp_path / "bad.npz")


def test_the_widget_draws_a_cached_row_and_marks_a_rebuild_before_it_starts(cpu_exp1, no_model, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    ledger, row = cpu_exp1
    ex = explorer.Explorer(LEDGERS, "cpu", problem=row["problem_id"], pair="exp1 bfloat16: prefill vs live")
    ex.refresh()  # the committed rebuild: drawn at once, no model
    assert "drawn in" in ex.status.value and ex.window.value == (0, row["prefix_len"] - 1)
    assert (ex.layer.max, ex.head.max) == (29, 2)
    # it opens where the drift is: the layer and head of largest key drift, not layer 0, head 0
    drift = explorer.cached(ledger, row, "prefill_vs_live")
    heads = drift.maps[("key", "head")].to_numpy()
    assert heads[ex.layer.value, ex.head.value] == np.nanmax(heads) > 0 and "bit-exact" not in ex.status.value
    # where the drawn row comes from, and what was compared with the ledger
    assert "a committed rebuild (data/explorer/cpu/" in ex.source.value and "nothing rebuilt here" in ex.source.value
    assert "rebuilt in" not in ex.status.value
    assert "whole-cache summary" in ex.source.value and "reproduces the ledger bit for bit" in ex.source.value
    # the two suffixes side by side from a few tokens before they part
    first = row["endpoints"]["first_divergence"]
    assert f"suffixes part at step {first}" in ex.suffixes.value and f"step {max(0, first - 4)}" in ex.suffixes.value
    assert ex.figure.value[:4] == b"\x89PNG" and ex.figure.layout.display is None
    seen = []

    def fake_rebuild(ledger, row, comparison, model=None, progress=None):
        seen.append(ex.status.value)  # what the reader sees while the rebuild runs
        return explorer.cached(*cpu_exp1, "prefill_vs_live")

    monkeypatch.setattr(explorer, "rebuild", fake_rebuild)
    other = next(r for r in ledger.records if r["problem_id"] != row["problem_id"] and not r["gate_failure"])
    ex.row_picker.value = other["problem_id"]  # not cached: marked, then rebuilt
    assert seen and "rebuilding" in seen[0]
    ex.row_picker.value = row["problem_id"]  # back to the cached row: drawn from the cache, no rebuild
    assert len(seen) == 1 and "read from the cache" not in ex.status.value and "drawn in" in ex.status.value
    ex.last_draw_s = None
    ex.window.value = (5, 20)  # a change of the window redraws
    assert ex.last_draw_s is not None


def test_the_equality_line_says_what_was_compared_and_why_it_may_differ(cpu_exp1, no_model):
    import dataclasses

    ledger, row = cpu_exp1
    drift = explorer.cached(ledger, row, "prefill_vs_live")
    line = explorer.equality_line(drift, ledger)
    assert "boundary logits" in line and "per-layer K/V drift" in line and "bit for bit" in line
    elsewhere = dataclasses.replace(drift, fingerprint={"cache": True, "logits": False, "tensors": True},
                                    environment=drift.environment | {"device_name": "Another CPU"})
    line = explorer.equality_line(elsewhere, ledger)
    assert "boundary logits (argmax, top-5, top-1 minus top-2 margins, max |Δ|): differs" in line
    assert f"written on {ledger.contract['device_name']}" in line and "ran on Another CPU" in line
    assert "need not equal the ledger's" in line


def test_an_all_exact_row_opens_on_bit_exact(cpu_exp1, no_model):
    import dataclasses

    ledger, row = cpu_exp1
    drift = explorer.cached(ledger, row, "prefill_vs_live")
    exact = dataclasses.replace(drift, maps={k: m * 0 for k, m in drift.maps.items()})
    assert explorer.largest_view(drift) is not None and explorer.largest_view(exact) is None


def test_block_names_overlap_neither_each_other_nor_the_titles(cpu_exp1, no_model):
    import matplotlib

    matplotlib.use("Agg")
    from kvreplay.report import figures

    ledger, row = cpu_exp1
    drift = explorer.cached(ledger, row, "prefill_vs_live")
    for window in (None, (0, 40)):
        fig = figures.explorer_view(drift.maps, explorer.head_position_drift(drift, 5, 1, "key"), drift.tokens,
                                    drift.blocks, layer=5, head=1, kind="key", title="t")
        explorer.zoom(fig, drift.tokens, window)
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        for ax in fig.axes:
            boxes = [t.get_window_extent(r) for t in ax.texts if t.get_visible()]
            boxes += [ax.title.get_window_extent(r), ax._left_title.get_window_extent(r)]
            boxes = [b for b in boxes if b.width > 0]
            clash = [(i, j) for i in range(len(boxes)) for j in range(i + 1, len(boxes)) if boxes[i].overlaps(boxes[j])]
            assert not clash, f"{ax.get_title(loc='left')!r}, window {window}: labels overlap"
        matplotlib.pyplot.close(fig)


def test_figures_are_made_without_pyplot_so_no_callback_can_send_one_elsewhere(cpu_exp1, no_model):
    import matplotlib.pyplot as plt
    from kvreplay.report import figures

    ledger, row = cpu_exp1
    plt.close("all")
    ex = explorer.Explorer(LEDGERS, "cpu", problem=row["problem_id"], pair="exp1 bfloat16: prefill vs live")
    ex.refresh()
    ex.kind.value = "value"
    drift = explorer.cached(ledger, row, "prefill_vs_live")
    fig = figures.explorer_view(drift.maps, explorer.head_position_drift(drift, 0, 0, "key"), drift.tokens,
                                drift.blocks, layer=0, head=0, kind="key", title="t")
    assert fig.canvas.manager is None and plt.get_fignums() == [], "a figure is registered with pyplot"
    assert bytes(ex.figure.value[:4]) == b"\x89PNG" and "values" in ex.status.value


def test_a_pending_redraw_marks_the_old_figure_stale_and_sliders_take_the_new_range_first(cpu_exp1, no_model,
                                                                                         monkeypatch):
    ledger, row = cpu_exp1
    ex = explorer.Explorer(LEDGERS, "cpu", problem=row["problem_id"], pair="exp1 bfloat16: prefill vs live")
    ex.refresh()
    assert "kvreplay-stale" not in ex.figure._dom_classes and "kvreplay-status'" in ex.status.value
    seen = []

    def fake_rebuild(ledger, other_row, comparison, model=None, progress=None):
        seen.append((ex.window.max, ex.window.value, ex.layer.max, ex.head.max, list(ex.figure._dom_classes)))
        return explorer.cached(*cpu_exp1, "prefill_vs_live")

    monkeypatch.setattr(explorer, "rebuild", fake_rebuild)
    other = next(r for r in ledger.records if r["problem_id"] != row["problem_id"] and not r["gate_failure"]
                 and r["prefix_len"] != row["prefix_len"])
    ex.row_picker.value = other["problem_id"]
    n = other["prefix_len"]
    assert seen[0][:4] == (n - 1, (0, n - 1), 29, 2), "the sliders kept the previous row's range during the rebuild"
    drawn = []
    real = explorer.png_bytes

    def watch(fig, dpi=80):
        drawn.append((ex.status.value, list(ex.figure._dom_classes)))
        return real(fig, dpi)

    monkeypatch.setattr(explorer, "png_bytes", watch)
    ex.row_picker.value = row["problem_id"]  # back to the cached row
    ex.kind.value = "value"  # while the new figure is being made, the old one is marked
    status, classes = drawn[-1]
    assert "updating" in status and "previous view" in status and "kvreplay-stale" in classes
    assert "kvreplay-stale" not in ex.figure._dom_classes and "drawn in" in ex.status.value
    assert "opacity" in ex.style.value


def test_row_labels_follow_the_selected_arm_pair(cpu_exp1, no_model):
    from kvreplay.experiments.endpoints import first_divergence

    ledger, _ = cpu_exp1
    ex = explorer.Explorer(LEDGERS, "cpu", pair="exp1 bfloat16: live_replica vs live")
    for label, pid in ex.row_picker.options:
        rec = next(r for r in ledger.records if r["problem_id"] == pid)
        fd = first_divergence(rec["arms"]["live"]["suffix"], rec["arms"]["live_replica"]["suffix"])
        assert ("same suffix" in label) == (fd is None) and (fd is None or f"diverges at token {fd}" in label), label
    prefill = explorer.Explorer(LEDGERS, "cpu", pair="exp1 bfloat16: prefill vs live")
    assert any("diverges at token" in label for label, _ in prefill.row_picker.options)
    assert [label for label, _ in ex.row_picker.options] != [label for label, _ in prefill.row_picker.options]


def test_the_suffix_heading_says_the_letters_are_predicted_answers(cpu_exp1, no_model):
    ledger, row = cpu_exp1
    heading, _ = explorer.suffix_table(explorer.tokenizer_for(ledger), row, "live", "prefill")
    assert "(predicted answers: live " in heading and ", prefill " in heading
