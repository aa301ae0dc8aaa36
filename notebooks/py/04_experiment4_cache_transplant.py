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
# # Experiment 4 — bidirectional KV-cache transplantation, and which part of the cache carries the trajectory
#
# *Paper §3.8 and §4.4; the localization is the referee's extension.* A panel is frozen from
# Experiment 2's BF16 rows before anything is decoded: evenly spaced order statistics (prefix
# length, then problem ID) within the suffix-divergent and the suffix-exact strata. Per row,
# incremental and prefill states are each built twice with disjoint storage; then every layer's
# K and V of the prefill recipient are replaced by storage-isolated copies from the incremental
# donor, and the reverse. The recipient keeps its tokens, roles, mask, positions, decoder and
# boundary logits, and the raw next-token argmax must already agree. The paper: the suffix follows
# the donor on 24/24 divergent rows in both directions, and no third trajectory appears among the
# 8 exact controls. **Registered primary endpoint: whole-cache transplants.** Key-only, value-only,
# half-depth and single-layer transplants are **exploratory** localization.

# %% tags=["parameters"]
profile = "smoke"  # which notebooks/params file: a profile name, or a path to a YAML file
overrides = {}     # values replacing the profile's, e.g. {"n_rows": 4, "execution": {"device": "cuda"}}

# %%
import pandas as pd
from IPython.display import Markdown, display

from kvreplay.experiments.endpoints import rate_text
from kvreplay.experiments.transplant import EXP4, localization_table, transplant_summary, transplant_table
from kvreplay.report import figures
from kvreplay.notebook.session import open_session

session = open_session("notebooks/04_experiment4_cache_transplant.ipynb", profile, overrides)
p = session.params
fixed = session.fixed  # the BF16 prefix bank of notebook 01, digest and order checked
print(f"{len(fixed.rows)} fixed BF16 prefixes (sha256 {fixed.sha256[:12]})")

# %% [markdown]
# ## Freeze the panel (written before any transplant is decoded)

# %%
# the panel is frozen from the committed Experiment 2 BF16 ledger of this chain (found by provenance, not re-run)
plan = session.plan(EXP4)
panel, sweep_ids = plan.notes["panel"], plan.notes["sweep"]
print(plan.notes["panel_path"])
pd.DataFrame(panel)

# %% [markdown]
# ## Run the transplants (BF16)

# %%
records, ledger = session.run(plan, "bfloat16")
print(ledger.dir.name)

# %% [markdown]
# ## Execution contract
# As recorded in the ledger's `environment.json` when its rows were computed (model loaded, flags applied); the
# scientific config that keys the ledger is in its `manifest.json`.

# %%
session.contract({"transplants (BF16)": ledger})

# %% [markdown]
# ## Registered endpoints (whole-cache transplants)
# Rows are grouped by their contemporaneous incremental/prefill baselines, as in the paper. Wilson 95%
# intervals; the power note gives the largest third-trajectory rate the control stratum can exclude. A panel row
# that fails the transplant's argmax precondition is reported by the rule the profile declares
# (`exp4_precondition_failures`: left out, counted as a failure, or both counts).

# %%
s = transplant_summary(records, p.exp4_precondition_failures)
table = transplant_table(s, records)
session.save_table(table, "table5_exp4_transplant")
table

# %% [markdown]
# ## Exploratory localization: which part of the cache carries the trajectory
# Among contemporaneously divergent rows: how often the transplanted state's suffix follows the donor, the
# recipient, or neither.

# %%
loc = localization_table(records)
if len(loc):
    session.save_table(loc.set_index(["intervention", "stratum", "direction"]), "table_exp4_localization")
loc

# %%
OUTCOMES = ["follows donor", "follows recipient", "new (third) trajectory"]
div_loc = loc[loc["stratum"] == "divergent"] if len(loc) else pd.DataFrame(
    columns=["intervention", "direction", "rows", *OUTCOMES])
coarse = (div_loc[~div_loc["intervention"].str.startswith("layer_")]
          .groupby("intervention", sort=False)[OUTCOMES].sum())
sweep = div_loc[div_loc["intervention"].str.startswith("layer_")].copy()
sweep["layer"] = sweep["intervention"].str[6:].astype(int)
fig = figures.localization(coarse, sweep, n_sweep_rows=len(sweep_ids),
                           title=f"Experiment 4 ({p.profile}): transplant outcomes among divergent rows")
figure_files = session.save_figure(fig, "exp4_transplants")

# %% [markdown]
# ## What this shows

# %%
counted = s["counted_as_failure"]
lines = [f"- {len(s['ineligible'])} panel row(s) did not meet the registered precondition "
         f"(the boundary's raw argmax already agrees between constructions) and got no transplant: "
         + "; ".join(f"{r['problem_id']} ({r['stratum']}; {r['reason']})" for r in s["ineligible"])
         + f". The profile's rule (`exp4_precondition_failures: {s['precondition_failures']}`): the rates below leave "
         f"them out; counted as failures, joint recovery is {rate_text(counted['joint_recovery'])} and a third "
         f"trajectory among exact controls {rate_text(counted['third_among_exact'])}."] if s["ineligible"] else []
lines += [
    f"- Whole-cache transplants, divergent rows: prefill <- incremental follows the donor "
    f"{rate_text(s['recovery']['prefill<-incremental'])}; "
    f"incremental <- prefill {rate_text(s['recovery']['incremental<-prefill'])}; "
    f"jointly {rate_text(s['joint_recovery'])} (paper: 24/24, Wilson [86.2, 100]%).",
    f"- Exact controls: a third trajectory in {rate_text(s['third_among_exact'])} (paper: 0/8, [0, 32.4]%).",
    "- Partial transplants are exploratory (not registered): see the localization table.",
]
display(Markdown("\n".join(lines)))
