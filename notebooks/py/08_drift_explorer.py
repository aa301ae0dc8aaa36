# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Drift explorer — per-layer, per-head and per-position K/V drift of one row
#
# *Paper §3.4 (relative drift, d_rel = ‖K_pre − K_inc‖₂ / ‖K_inc‖₂), §4.1–4.2.* The ledgers keep a
# summary per layer and per K/V tensor; this notebook shows them for one chosen row and comparison,
# and rebuilds that row's two boundary caches with the ledger's own model, dtype, format, threads and
# SDPA backends to show drift per KV head and per token position, the boundary-logit difference, and
# the two suffixes side by side around their first divergence. The rebuilt states must reproduce the
# ledger's recorded drift fingerprint exactly when run on the machine and software that wrote the
# ledger (checked below).
#
# **Runs as is:** the defaults read the committed `cpu` ledgers (`make lab` opens a copy of this notebook; Run All).
# The last section is the **interactive explorer** (ipywidgets): a row picker listing every row with its
# divergence status, an experiment/arm-pair picker, layer and KV-head sliders, a K/V switch and a position
# window. A row is rebuilt once (minutes: the model loads and replays z) and what the explorer draws from it is
# kept on disk (`build/explorer-cache/`, or `$KVREPLAY_EXPLORER_CACHE`), so a row rebuilt before, in any
# session, draws in about a second; rows committed under `data/explorer/` need no rebuild at all. The cells
# before it draw the same views for the row named in the parameters (they are what the executed copy under
# `executed/` shows: a committed rebuild where there is one).
#
# Comparisons: Experiment 1 `prefill_vs_live`, `live_replica`, `prefill_replica`; Experiment 2
# `prefill_vs_incremental`, `incremental_replica`, `prefill_replica`. The rebuilt `live` state is built by
# teacher-forcing the live call schedule, which Experiment 3 shows is bit-identical to live decoding on
# the same prefix.

# %% tags=["parameters"]
profile = "cpu"  # which notebooks/params file: the committed ledgers (the notebook tests pass smoke)
overrides = {}   # values replacing the profile's, e.g. {"ledger_root": "/tmp/ledgers"}
experiment = "exp1"           # "exp1" (live vs prefill) or "exp2" (incremental vs prefill, fixed BF16 prefixes)
precision = "bfloat16"        # "bfloat16" or "float32"
comparison = "prefill_vs_live"  # exp1: prefill_vs_live | live_replica | prefill_replica;
                                # exp2: prefill_vs_incremental | incremental_replica | prefill_replica
problem = None                # a problem ID; None: the first row whose suffixes differ, else the first row
rebuild = False               # True: rebuild the row's two caches here for the per-head / per-position maps when
                              # no rebuild of it is cached (loads the model; minutes)
model = None                  # None: the ledger's model (a local folder: the profile's `model`, when it is the
                              # folder the ledger keyed); give a path for a ledger written from another folder
top_k = 10                    # boundary-logit tokens shown per state
before, after = 8, 12         # suffix tokens shown before and after the first divergence
save_figures = False          # also write the figures to figures/<profile>/explorer/
interactive = True            # draw the ipywidgets explorer at the end (make paper and the tests pass False)

# %%
import numpy as np
import pandas as pd
from IPython.display import Markdown, display

from kvreplay.notebook import explorer
from kvreplay.report import figures
from kvreplay.experiments.endpoints import first_divergence
from kvreplay.ledger.lookup import find_chain_ledger
from kvreplay.ledger.records import arm_of, comparison_of
from kvreplay.report.rebuild import comparison_arms, pick_row, profile_model, suffix_alignment, token_text, topk_frame
from kvreplay.report.frames import layer_drift_frame
from kvreplay.report.files import save_figure
from kvreplay.notebook.session import open_session

# %%
session = open_session("notebooks/08_drift_explorer.ipynb", profile, overrides)
ref_arm, other_arm = comparison_arms(experiment, comparison)
ledger = find_chain_ledger(session.ledger_root, session.profile, f"{experiment}-{precision}")
model = model or profile_model(ledger, session.params.model)  # a profile's own model folder, found again
row = pick_row(ledger.records, problem, experiment)
assert not row["gate_failure"], f"row {row['problem_id']} failed gate {row['gate_failure']}: nothing to explore"
summary = comparison_of(row, comparison)
stem = f"{row['problem_id']}_{experiment}_{precision}_{comparison}"
shown = {}

def show(fig, name, dpi=None):
    """Display a figure inline (at ``dpi``: a lighter image); with save_figures also write it (PNG and PDF) under
    figures/<profile>/explorer/."""
    shown[name] = fig
    if save_figures:
        save_figure(fig, session.out_dir / "explorer" / f"{stem}_{name}", source=session.notebook)
    else:  # the explorer's figures are made without pyplot: shown as PNG, whatever the kernel's backend
        display(explorer.as_png(fig, dpi or fig.dpi))

print(f"ledger {ledger.dir.name}: {len(ledger.records)} rows; exploring {row['problem_id']} "
      f"({experiment}, {precision}, {comparison}: {other_arm} against {ref_arm})")
explorer.rows_frame(ledger, comparison)

# %% [markdown]
# ## The row, as the ledger recorded it

# %%
ep = row["endpoints"]
overview = pd.Series({
    "problem": row["problem_id"], "prompt tokens": row["prompt_len"], "boundary prefix |z|": row["prefix_len"],
    "whole-cache exact": summary["cache"]["exact"], "whole-cache relative L2": summary["cache"]["rel_l2"],
    "whole-cache max |Δ|": summary["cache"]["max_abs"],
    "differing cache elements": f"{summary['cache']['n_diff']}/{summary['cache']['numel']}",
    "boundary logits exact": summary["logits"]["exact"], "boundary logits max |Δ|": summary["logits"]["max_abs"],
    "argmax reference / other": f"{summary['logits']['argmax_ref']} / {summary['logits']['argmax_other']}",
    "top-1 minus top-2 margin reference / other":
        f"{summary['logits']['margin_ref']:.4g} / {summary['logits']['margin_other']:.4g}",
    "suffix differs (prefill vs reference)": ep["suffix_differs"],
    "first divergence (tokens after boundary)": ep["first_divergence"],
    f"correct: {ref_arm} / {other_arm}": f"{arm_of(row, ref_arm)['correct']} / {arm_of(row, other_arm)['correct']}",
}, name=comparison)
overview.to_frame()

# %% [markdown]
# ## Per-layer drift of K and V (from the ledger)

# %%
if "tensors" in summary:
    layers = layer_drift_frame(summary["tensors"])
    show(figures.explorer_layers(layers,
                                 title=f"{row['problem_id']}: {other_arm} vs {ref_arm}, {precision} (ledger)"),
         "layers")
    display(layers.pivot(index="layer", columns="kind", values="rel_l2").T)
else:
    layers = None
    print(f"the ledger keeps only the whole-cache summary for {comparison} (exact: {summary['cache']['exact']}); "
          "rebuild = True gives the per-layer values")

# %% [markdown]
# ## Rebuild the two caches of this row
# A row rebuilt before (in `build/explorer-cache/`, or committed under `data/explorer/`) is read from there, with no
# model loaded. Otherwise, with `rebuild = True`: loads the ledger's model at its dtype and threads (once per
# kernel), resolves its block format (the digest must match), rebuilds both states from the recorded prefix z, runs
# the row's boundary gates on the pair, recomputes the drift summary and keeps what the maps need on disk.

# %%
drift = explorer.cached(ledger, row, comparison, model)  # rebuilt before: read, no model loaded
if drift is None and rebuild:
    drift = explorer.rebuild(ledger, row, comparison, model)  # written to the cache of rebuilt rows
if drift is not None:
    rebuilt, fingerprint, here = drift.summary, drift.fingerprint, drift.environment
    same_env = explorer.same_environment(drift, ledger)
    print(f"{row['problem_id']}: {explorer.origin(drift)}")
    print(explorer.equality_line(drift, ledger))
    if same_env:
        assert all(fingerprint.values()), f"rebuilt states do not reproduce the ledger's fingerprint: {fingerprint}"
    if layers is None:
        layers = layer_drift_frame(rebuilt["tensors"])
        show(figures.explorer_layers(layers,
                                     title=f"{row['problem_id']}: {other_arm} vs {ref_arm}, {precision} (rebuilt)"),
             "layers")
else:
    print(f"no rebuild of {row['problem_id']} is cached and rebuild = False: the per-head and per-position maps are "
          "drawn by the interactive explorer below (make lab), or here with rebuild = True"
          + (f" (this ledger was computed on {ledger.contract.get('device_name')}: rebuild it there to reproduce "
             "its bits)" if str(ledger.contract.get("device", "cpu")).startswith("cuda") else ""))
# what the next cell draws when this row has no rebuild here: a committed one of the cpu profile (its rows were
# computed on the CPU kind that rebuilt it, so it reproduces its ledger), named as such
example = explorer.committed_example(f"{experiment}-{precision}", comparison) if drift is None else None

# %% [markdown]
# ## Per-head and per-position drift (rebuilt)
# Each cell is ‖other − reference‖₂ / ‖reference‖₂ over the remaining axes of one layer's K or V tensor
# `[kv_heads, |z|, head_dim]` (first duplicate copy; the two copies are bit-identical by the desync gate), on a
# log colour scale. White: exactly 0; grey: an exact zero reference. The position axis shows each token's text;
# dotted lines mark where each block of z begins.

# %%
drawn = drift if drift is not None else example
if drawn is not None:
    k = drawn.key
    if drawn is example:
        display(Markdown(f"**Not this profile's row:** no rebuild of {row['problem_id']} is cached here, so these are "
                         f"the maps of row `{k['problem_id']}` of the `{k['profile']}` profile ({k['ledger']}), rebuilt "
                         f"on {drawn.environment['device_name']} where its ledger was computed; its rebuilt drift "
                         f"reproduces its ledger's: {all(drawn.fingerprint.values())}. Keys only."))
    exact_note = " (bit-exact in every tensor: all zero)" if not np.nanmax(
        [np.nanmax(m.to_numpy()) for m in drawn.maps.values()]) else ""
    show(figures.drift_heatmaps(drawn.maps, drawn.tokens, drawn.blocks, kind="key" if drawn is example else None,
                                title=f"{k['profile']} {k['problem_id']}: {other_arm} vs {ref_arm}, {precision}{exact_note}"),
         "heatmaps", dpi=72)
    starts = sorted(drawn.blocks.items(), key=lambda kv: kv[1])
    block_of = np.empty(len(drawn.tokens), dtype=object)
    for (name, s), nxt in zip(starts, [s for _, s in starts[1:]] + [len(drawn.tokens)]):
        block_of[s:nxt] = name
    per_block = pd.DataFrame({kind: drawn.maps[(kind, "position")].mean(axis=0).groupby(block_of).mean()
                              for kind in ("key", "value")}).reindex([n for n, _ in starts])
    display(Markdown(f"**Mean over layers of the per-position drift, by block of z** ({k['profile']} "
                     f"{k['problem_id']})"), per_block)
    worst_layer, worst_head = np.unravel_index(np.nanargmax(drawn.maps[("key", "head")].to_numpy()),
                                               drawn.maps[("key", "head")].shape)
    display(Markdown(f"**Positions of largest key drift, layer {worst_layer}, KV head {worst_head}** "
                     "(the layer and head of largest key drift; token text as decoded)"),
            explorer.largest_drift(drawn, int(worst_layer), int(worst_head), "key"))
else:
    print("no rebuilt caches: the per-head and per-position maps need them (see above)")

# %% [markdown]
# ## Boundary logits: difference and top-k margins

# %%
tok = explorer.tokenizer_for(ledger, model)
lg = summary["logits"]
display(pd.DataFrame({
    "reference": [lg["argmax_ref"], token_text(tok, lg["argmax_ref"]), lg["margin_ref"],
                  [token_text(tok, t) for t in lg["topk_ref"]]],
    "other": [lg["argmax_other"], token_text(tok, lg["argmax_other"]), lg["margin_other"],
              [token_text(tok, t) for t in lg["topk_other"]]],
}, index=["argmax", "argmax text", "top-1 minus top-2 margin", "top-5 (ledger)"]))
if drift is not None:
    topk = topk_frame(tok, drift.full_logits(0), drift.full_logits(1), k=top_k)
    show(figures.topk_logits(topk, ref_arm, other_arm,
                             title=f"{row['problem_id']}: boundary logits on the union of both top-{top_k}"),
         "logits")
    display(topk)

# %% [markdown]
# ## The two suffixes side by side

# %%
ra, rb = arm_of(row, ref_arm), arm_of(row, other_arm)
sa, sb = ra["suffix"], rb["suffix"]
ma, mb = ra["margins"], rb["margins"]
first = first_divergence(sa, sb)
aligned = suffix_alignment(tok, sa, sb, ma, mb, first, before=before, after=after)
cut = first if first is not None else len(sa)
texts = pd.DataFrame({
    ref_arm: [tok.decode(sa[:cut]), tok.decode(sa[cut:]), ra["answer_text"], ra["correct"]],
    other_arm: [tok.decode(sb[:cut]), tok.decode(sb[cut:]), rb["answer_text"], rb["correct"]],
}, index=["shared part (up to the first divergence)", "after the first divergence", "answer text", "correct"])
display(Markdown(f"**First divergence: {first if first is not None else 'none'}** "
                 f"(suffix tokens after the boundary; {len(sa)} and {len(sb)} tokens)"))
display(aligned)
texts

# %% [markdown]
# ## What this shows

# %%
lines = [f"- Row `{row['problem_id']}` ({experiment}, {precision}): {other_arm} against {ref_arm}; "
         f"whole-cache relative L2 "
         f"{summary['cache']['rel_l2']:.3g}, {summary['cache']['n_diff']} of {summary['cache']['numel']} "
         f"cache elements differ; "
         f"boundary logits max |Δ| {summary['logits']['max_abs']:.3g}, "
         f"argmax {'agrees' if lg['argmax_ref'] == lg['argmax_other'] else 'differs'}."]
if layers is not None:
    worst = layers.sort_values("rel_l2", ascending=False).iloc[0]
    lines.append(f"- Largest per-tensor drift: layer {int(worst.layer)} {worst.kind}s "
                 f"(relative L2 {worst.rel_l2:.3g}); "
                 f"{int((~layers.exact).sum())} of {len(layers)} K/V tensors are not bit-exact.")
if example is not None:
    lines.append(f"- No rebuild of this row is cached here; the per-head and per-position maps above are row "
                 f"`{example.key['problem_id']}` of the `{example.key['profile']}` profile, a committed rebuild that "
                 f"reproduces its ledger's drift summary: {all(example.fingerprint.values())}.")
if drift is not None:
    lines.append(f"- The maps: {explorer.origin(drift)}; it reproduces the ledger's drift summary: "
                 f"{all(fingerprint.values())} (same machine and software: {same_env}).")
if first is None:
    lines.append(f"- The two suffixes are identical ({len(sa)} tokens).")
else:
    m = ma[first] if first < len(ma) else None
    lines.append(f"- The suffixes first differ {first} tokens after the boundary; "
                 f"there the {ref_arm} arm's top-1 minus top-2 margin was "
                 f"{m if m is None else f'{m:.3g}'} "
                 f"(answers: {ra['predicted']} vs {rb['predicted']}).")
display(Markdown("\n".join(lines)))

# %% [markdown]
# ## Interactive explorer
# Pick an arm pair (experiment, precision, comparison) and a row (each listed with where its suffixes first
# differ and whether this comparison's boundary cache is exact). A row rebuilt before draws at once from the cache
# of rebuilt rows; another is rebuilt once (progress bar; the figure says "Rebuilding" meanwhile). The layer and
# KV-head sliders, the K/V switch and the position window redraw from the cache when released. Top: drift per
# position (block boundaries dotted) and per head, log colour scale, the selected layer dashed and head outlined;
# bottom: the selected layer and head per position. Narrow the position window until every token's text is on the
# axis; below the figure, the positions of largest drift of the selected layer and head, with their tokens. Above
# the maps: the ledger's per-layer summary of the row.

# %%
if interactive:
    ex = explorer.Explorer(session.ledger_root, session.profile, model=model, problem=row["problem_id"],
                           pair=f"{experiment} {precision}: {other_arm} vs {ref_arm}")
    ex.show()
else:
    print("interactive = False (a headless run): open this notebook in JupyterLab (make lab) for the controls")
