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
# # Kernel attribution — which operation's reduction order brings back the prefill-versus-replay drift
#
# *The invariant-kernel contract's attribution control (docs/execution-contract.md, "Invariant kernels"),
# exploratory.* Under `kernels: invariant` every reducing operation gives a token row the same bits whatever its
# call, so the prefill and replayed boundary caches agree by construction and no suffix can part: that is the
# contract's test, not a finding. The finding is the attribution. Each `invariant-except-<class>` value leaves one
# operation class (linear layers, attention, norms, the LM head, the rotary embedding) in its default order: which
# one brings the cache drift and the BF16 divergence back, and how much of it.
#
# The inputs are pinned: every kernels value of the profile's `kernel_values` builds its caches from the same
# boundary token IDs, the prefix bank of notebook 01 (Experiment 1's BF16 live decode), as Experiment 2 fixes its
# prefixes. The compared constructions are the prefill and the teacher-forced replay of the live call schedule over
# those IDs, which differ only in the arithmetic under test. Each value is one ledger (`exp2_kernels-bfloat16`,
# keyed by `kernels`) of Experiment 2's rows, through every gate of Experiment 2. The primary contrasts
# (`kernel_contrasts`) are declared in the profile before any row. Outcomes are reported, never asserted.
#
# Not part of `make paper`'s chain: run it after notebooks 00-02 of the same profile (docs/execution-contract.md
# gives the command).

# %% tags=["parameters"]
profile = "smoke"  # which notebooks/params file: a profile name, or a path to a YAML file
overrides = {}     # values replacing the profile's, e.g. {"kernel_values": ["default", "invariant"]}

# %%
from IPython.display import display

from kvreplay.experiments.kernel_ablation import EXP2_KERNELS, contrast_table, kernel_summary, kernel_table
from kvreplay.notebook.session import open_session

session = open_session("notebooks/09_kernel_ablation.ipynb", profile, overrides)
p = session.params
fixed = session.fixed  # the BF16 prefix bank of notebook 01, digest and order checked
print(f"{len(fixed.rows)} pinned BF16 boundary prefixes (sha256 {fixed.sha256[:12]}); kernels values: "
      f"{', '.join(p.kernel_values) or 'none (kernel_values is empty: nothing to run)'}")

# %% [markdown]
# ## Run (or resume, or reuse)
# One ledger per kernels value, each starting with its preflight rows; a gate failure there aborts the value.

# %%
records, ledgers = {}, {}
for plan in session.plans(EXP2_KERNELS):  # one plan per kernels value
    value = plan.key["kernels"]
    records[value], ledgers[value] = session.run(plan, "bfloat16")
    print(value, "->", ledgers[value].dir.name)
for value, rows in records.items():  # every value consumed exactly the bank's integer prefixes
    assert all(r["prefix"] == fixed.prefixes[r["problem_id"]] for r in rows), f"{value}: a row left its pinned prefix"

# %% [markdown]
# ## Execution contract
# As recorded in each ledger's `environment.json` (the `kernels` value among it).

# %%
session.contract(ledgers) if ledgers else None

# %% [markdown]
# ## Per kernels value, on the same problems
# On how many rows the prefill boundary cache equals the replayed one bit for bit; the relative L2 of prefill against
# replay over every layer's keys and values; how many greedy suffixes part (Wilson 95% interval), and how many of
# those began at an exact tie (top-1 minus top-2 margin 0).

# %%
summary, contrasts = kernel_summary(records, p.kernel_contrasts)
if summary:
    table = kernel_table(summary)
    session.save_table(table, "table_kernel_attribution",
                       caption="Kernel attribution, Experiment 2 BF16 on pinned prefixes: prefill vs replay per kernels value")
    display(table)

# %% [markdown]
# ## The declared contrasts
# Suffix divergence of two kernels values on the same problems: how many problems part only under the first, only
# under the second, and the exact McNemar test of those pairs.

# %%
if contrasts:
    paired = contrast_table(contrasts)
    session.save_table(paired, "table_kernel_contrasts",
                       caption="Kernel attribution: declared contrasts of suffix divergence (exact McNemar)")
    display(paired)

# %% [markdown]
# ## What the rows say
# Printed from the summary, whatever it shows.

# %%
for value, s in summary.items():
    state = ("prefill = replay bit for bit on every row" if s.replay_exact == s.n
             else f"drift on {s.n - s.replay_exact} of {s.n} rows")
    print(f"{value:32s} {state}; suffixes part on {s.suffix.k} of {s.n} ({s.tie} begun at an exact tie)")
for c in contrasts:
    print(f"{c.a} vs {c.b}: {c.mcnemar.b} / {c.mcnemar.c} discordant, exact McNemar p = {c.mcnemar.pvalue:.3g}")
