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
# # Experiment 1 — the matched live/prefill four-arm matrix
#
# *Paper §3.5 and §4.1.* One greedy multi-branch decode per problem reaches the merge
# boundary and keeps its **live** `DynamicCache`. From the same integer prefix z we
# build a **live replica** (deep copy under inference mode, verified), a **prefill**
# cache (one forward call over z) and a **prefill replica** (an independent second
# call). All four arms continue through the one shared suffix decoder with the same
# duplicate batch of two. The paper's claim: in BF16 the boundary caches differ in the
# last bits and long greedy suffixes then diverge (166/200); in FP32 the decoded
# divergence vanishes. Every endpoint below is conditional on fail-closed integrity
# gates (replicas exact, state identical, storage disjoint, duplicates in sync).
#
# Defaults are the `smoke` profile; `make paper` sets `profile` to the one it runs (`notebooks/params/<profile>.yaml`).

# %% tags=["parameters"]
profile = "smoke"  # which notebooks/params file: a profile name, or a path to a YAML file
overrides = {}     # values replacing the profile's, e.g. {"n_rows": 4, "execution": {"device": "cuda"}}

# %%
from pathlib import Path

import pandas as pd
from IPython.display import Markdown, display

from kvreplay.experiments.endpoints import require_gates
from kvreplay.experiments.length_arm import EXP1_LENGTH, length_summary, length_table
from kvreplay.experiments.live_vs_prefill import EXP1
from kvreplay.experiments.matrix import matrix_summary, matrix_table
from kvreplay.experiments.tie_rules import BINS, EXP1_TIES, margin_units, tie_rule_summary, tie_rule_table, tie_steps
from kvreplay.ledger.files import read_environment
from kvreplay.report import figures
from kvreplay.report.files import drift_by_layer
from kvreplay.notebook.session import open_session

session = open_session("notebooks/01_experiment1_live_vs_prefill.ipynb", profile, overrides)
p = session.params
rows = session.rows(p.n_rows)
print(f"{len(rows)} problems from {p.problems!r}; ledgers under {session.ledger_root / p.profile}")

# %% [markdown]
# ## Run (or resume, or reuse a finished ledger)
# Preflight rows run first; a preflight gate failure aborts the arm.

# %%
records, ledgers = {}, {}
for dtype in p.precisions:
    records[dtype], ledgers[dtype] = session.run(EXP1, dtype)
    print(dtype, "->", ledgers[dtype].dir.name)

# %% [markdown]
# ## Execution contract
# As recorded in the ledger's `environment.json` when its rows were computed (model loaded, flags applied); the
# scientific config that keys the ledger is in its `manifest.json`.

# %%
session.contract(ledgers)

# %% [markdown]
# ## Results table (paper's terms)
# Rates carry Wilson 95% intervals; the accuracy difference is prefill minus live with 20,000 problem-paired
# percentile bootstrap replicates; McNemar is exact and two-sided on discordant correctness (it reads direction,
# not equivalence). Drift is the relative L2 over all K and V tensors concatenated, per row; we report its
# median and range over rows.

# %%
summaries = {d: matrix_summary(records[d], d, "live", seed=p.seed, n_resamples=p.n_resamples) for d in p.precisions}
cross = None
if {"bfloat16", "float32"} <= set(p.precisions):
    same = sum(a["prefix"] == b["prefix"] for a, b in zip(records["bfloat16"], records["float32"]))
    cross = (same, len(rows))
table = matrix_table(list(summaries.values()), cross)
session.save_table(table, "table_exp1_matrix")
table

# %% [markdown]
# ## The BF16 prefix bank read by Experiments 2–5

# %%
if "bfloat16" in p.precisions:
    bank_path, digest = session.write_prefix_bank(records["bfloat16"], ledgers["bfloat16"])
    print(bank_path, digest)

# %% [markdown]
# ## Exploratory: the tie-rule control (not in the paper)
# Only when the profile lists `tie_rules`: Experiment 1 BF16 under each greedy tie rule (docs/experiments.md).

# %%
tie_summary = None
if p.tie_rules and "bfloat16" in p.precisions:
    tie_records, tie_ledgers = {}, {}
    for plan in session.plans(EXP1_TIES):  # one plan per rule
        rule = plan.key["tie_rule"]
        tie_records[rule], tie_ledgers[rule] = session.run(plan, "bfloat16")
    reference_rule = session.execution["tie_rule"]
    tie_summary = tie_rule_summary(records["bfloat16"], tie_records, reference_rule)
    session.save_table(tie_rule_table(tie_summary, reference_rule), "table_exp1_tie_rules",
                       caption="Experiment 1 BF16 under other greedy tie rules (exploratory)")
    tie_arms = {f"exp1 {d} ({reference_rule})": records[d] for d in p.precisions}
    tie_arms |= {f"exp1_ties bfloat16 ({rule})": rows for rule, rows in tie_records.items()}
    steps = tie_steps(tie_arms)
    session.save_table(steps.set_index("arm"), "table_exp1_tie_steps",
                       caption="Exact-tie steps per 1,000 chosen tokens, per arm (live and prefill suffixes)")
    units = margin_units(tie_arms)
    if len(units):
        session.save_figure(figures.tie_margins(units, BINS, title=f"Experiment 1 ({p.profile}): greedy margins in "
                                                "BF16 spacings"), "exp1_tie_margins")
    display(session.contract(tie_ledgers))
    display(steps)

# %% [markdown]
# ## Exploratory: the manipulated-length arm (not in the paper)
# Only when the profile lists `length_branch_caps`: Experiment 1 BF16 on the same problems at each of those branch
# caps, so the boundary prefix's length is manipulated rather than observed across problems. The comparison rule is
# declared in `kvreplay.experiments.length_arm` (primary: every problem, paired with itself at the chain's cap).

# %%
length_summary_ = None
if p.length_branch_caps and "bfloat16" in p.precisions:
    length_records = {}
    for plan in session.plans(EXP1_LENGTH):  # one plan per branch cap
        length_records[plan.key["cap_branch"]], _ = session.run(plan, "bfloat16")
    length_summary_ = length_summary(records["bfloat16"], length_records, p.cap_branch)
    length_frame = length_table(length_summary_, p.cap_branch)
    session.save_table(length_frame, "table_exp1_length",
                       caption="Experiment 1 BF16 at other branch caps, same problems (exploratory)")
    display(length_frame)

# %% [markdown]
# ## Figures
# Left: where the live and prefill suffixes first differ (tokens after the boundary). Right: per-layer relative
# L2 drift of prefill against live, median over rows, keys and values, per precision.

# %%
firsts = pd.DataFrame([
    {"precision": d, "first divergence": r["endpoints"]["first_divergence"]}
    for d in p.precisions for r in require_gates(records[d]) if r["endpoints"]["first_divergence"] is not None
], columns=["precision", "first divergence"])
layers = pd.concat([drift_by_layer(records[d]).assign(precision=d) for d in p.precisions])
fig = figures.divergence_and_drift(firsts, layers, reference="live",
                                   title=f"Experiment 1 ({p.profile}): first divergence and per-layer cache drift")
figure_files = session.save_figure(fig, "exp1_divergence_and_drift")

# %% [markdown]
# ## Integrity assertions
# These fail the notebook (and `make paper`) if the run does not meet the contract.

# %%
for d in p.precisions:
    s = summaries[d]
    assert s["replicas_exact"] == s["n"], f"{d}: replica pairs not exact on every row"
print("all assertions passed")

# %% [markdown]
# ## What this shows

# %%
lines = []
for d in p.precisions:
    s = summaries[d]
    lines.append(
        f"- **{d}**: replicas exact on {s['replicas_exact']}/{s['n']} rows; "
        f"the prefill boundary cache is non-bit-exact on "
        f"{s['boundary_non_exact']}/{s['n']} (median relative L2 {s['drift_median']:.3g}); "
        f"suffixes differ on {s['suffix'].pct()}, "
        f"answers on {s['answer'].pct()}, correctness labels on {s['label'].k}/{s['n']}; "
        f"accuracy live {s['accuracy_ref']}/{s['n']} vs prefill {s['accuracy_prefill']}/{s['n']}."
    )
if cross:
    lines.append(f"- Boundary prefixes token-identical across the two independently decoded precisions: "
                 f"{cross[0]}/{cross[1]}.")
if tie_summary:
    for rule, t in list(tie_summary.items())[1:]:
        lines.append(f"- Tie rule **{rule}** (exploratory): suffixes differ on {t['suffix'].pct()} against "
                     f"{tie_summary[reference_rule]['suffix'].pct()} under {reference_rule} (exact McNemar p = "
                     f"{t['mcnemar'].pvalue:.3g}); {t['tie']} begun at an exact tie, {t['nonzero']} at a nonzero margin.")
if length_summary_:
    for cap, t in length_summary_.items():
        if cap == p.cap_branch:
            continue
        lines.append(f"- Branch cap **{cap}** (exploratory, same problems; median boundary prefix {t['prefix_len'][0]:g} "
                     f"against {length_summary_[p.cap_branch]['prefix_len'][0]:g} tokens at {p.cap_branch}): suffixes "
                     f"differ on {t['suffix'].pct()} against {length_summary_[p.cap_branch]['suffix'].pct()} (exact "
                     f"McNemar p = {t['mcnemar'].pvalue:.3g}); the prefix moved in the cap's direction on "
                     f"{t['moved']}/{t['n']}.")
# the model as loaded when the rows were computed (the ledger's environment.json), the problems as the parameters name them
model_id = read_environment(ledgers[p.precisions[0]].dir)["execution_contract"]["model"]
data = "the frozen MMLU bank" if p.problems == "bank" else f"`{Path(p.problems).name}`"
lines.append("- Paper (14B, GPQA Main, 768/512/64 caps): BF16 suffixes differ 166/200, answers 49/200, labels 20/200; "
             f"FP32 0/200 decoded disagreement. This run uses {model_id.get('file') or model_id['model']} "
             f"({model_id['layers']} layers, {model_id['kv_heads']} KV heads), {len(rows)} problems from {data} and caps "
             f"{p.cap_branch}/{p.cap_merge}/{p.cap_answer}, so compare directions, not magnitudes.")
display(Markdown("\n".join(lines)))
