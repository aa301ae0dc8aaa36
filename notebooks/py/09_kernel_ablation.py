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
# # Kernel ablation — which operation's reduction order brings back the prefill-versus-live drift
#
# *The invariant-kernel contract's attribution control (docs/execution-contract.md, "Invariant kernels").* Under
# `kernels: invariant` every reducing operation gives a token row the same bits whatever its call, so the prefill
# and live boundary caches agree by construction and no suffix can part: that is the contract's test, not a
# finding. The finding is the ablation. Each `invariant-except-<class>` value leaves one operation class (linear
# layers, attention, norms, the LM head, the rotary embedding) in its default order: which one brings the cache
# drift and the BF16 divergence back, and how much of it. A second fixed order of the attention class,
# `invariant-attention-block-128` (key blocks of 128 instead of 64), sets the size of a change of one fixed order
# at fixed precision beside the default kernels' prefill-versus-live drift.
#
# This notebook reads the committed ledgers under `data/kernel_ablation/<profile>/` (written by
# `scripts/kernel_ablation.py`) and computes no row. It stops on a failed digest, schema or value check, never on
# an unfavourable result. It is not part of `make paper`: run it with
# `.venv/bin/papermill notebooks/09_kernel_ablation.ipynb build/09_kernel_ablation.ipynb -p profile cpu`.

# %% tags=["parameters"]
profile = "cpu"                  # the folder under data/kernel_ablation/
dtype = "bfloat16"               # the precision whose ledgers are read
ledgers = "data/kernel_ablation"  # relative to the repository root, or absolute
out = ""                         # folder for the table and figure (empty: build/kernel_ablation/<profile>)

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from IPython.display import Markdown, display

from kvreplay.experiments.kernel_ablation import ORDER_A, ORDER_B, ablation_frame, ablation_table, load_ablation, orders_table
from kvreplay.report.provenance_pages import rows_of_unknown_libraries
from kvreplay.paths import ROOT
from kvreplay.report.files import save_figure, save_table

pd.set_option("display.max_colwidth", None, "display.width", 250)
root = Path(ledgers) if Path(ledgers).is_absolute() else ROOT / ledgers
target = Path(out) if out else ROOT / "build" / "kernel_ablation" / profile
target.mkdir(parents=True, exist_ok=True)
SOURCE = "notebooks/09_kernel_ablation.ipynb"
found = load_ablation(root / profile, dtype)  # stops here on a digest, schema, value or row-algorithm mismatch
pd.DataFrame({name: {"folder": folder.name, "rows": len(found.orders if name.startswith("orders") else
                                                       found.by_value[name.split(f"{dtype}-", 1)[1]])}
              for name, folder in found.folders.items()}).T

# %% [markdown]
# ## The ablation, one line per kernels value
# Per value: how many rows; on how many the prefill boundary cache equals the live one bit for bit; the relative
# L2 of prefill against live over every layer's keys and values; how many greedy suffixes part (with the Wilson
# 95% interval), and how many of those began at an exact tie (top-1 minus top-2 margin 0); live and prefill
# accuracy. The last line, when present, is the two fixed orders on the same token IDs: order B's cache against
# order A's live cache, each suffix decoded under its own order (order A's and order B's answers in the accuracy
# columns). Values have different row counts while their ledgers are being extended.

# %%
frame = ablation_frame(found)
save_table(frame.reset_index(names="comparison"), target / f"kernel_ablation_{dtype}",
           caption=f"Kernel ablation, profile {profile}, {dtype}: boundary-cache drift and suffix divergence per "
                   f"kernels value", source=SOURCE)
frame

# %% [markdown]
# The same lines as `scripts/kernel_ablation.py` writes them into `table.md` (its last column: rows written by a
# library whose commit `data/libraries.json` does not know, and how many of them part), and the two orders beside
# the default kernels on the problems each has.

# %%
unknown_library_rows = rows_of_unknown_libraries({v: found.folders[f"kernels-{dtype}-{v}"] for v in found.by_value})
display(Markdown(ablation_table(found.by_value, unknown_library_rows)))
display(Markdown(orders_table(found.orders, found.by_value) if found.orders or (
    ORDER_A in found.by_value and ORDER_B in found.by_value) else "No two-orders rows yet."))

# %% [markdown]
# ## What the rows say
# Read from the table above (printed, whatever it shows): which values keep the caches bit-identical on every
# row, which bring drift back, and whether the suffixes part there.

# %%
for value, rows in found.by_value.items():
    n, exact = len(rows), sum(r["drift"]["exact"] for r in rows)
    parted = sum(r["diverged"] for r in rows)
    state = "prefill = live bit for bit on every row" if exact == n else f"drift on {n - exact} of {n} rows"
    print(f"{value:32s} {state}; suffixes part on {parted} of {n}")
if found.orders:
    o = found.orders
    print(f"two orders ({ORDER_A} vs {ORDER_B}, same IDs): caches differ on "
          f"{sum(not r['drift']['exact'] for r in o)} of {len(o)} rows; suffixes part on {sum(r['diverged'] for r in o)}")
else:
    print("two orders: no rows in the ledgers yet")

# %% [markdown]
# ## Boundary-cache drift per value
# Each point is one row's relative L2 between the two boundary caches (prefill against live; for the two orders,
# order B against order A over the same IDs), on a log axis. Bit-identical caches (relative L2 exactly 0) sit on
# the bottom line, a decade below the smallest nonzero drift. Filled points are rows whose suffixes parted.

# %%
import math

groups = [(v, rows) for v, rows in found.by_value.items() if rows]
if found.orders:
    groups.append((f"{ORDER_B}\nvs {ORDER_A}\n(same IDs)", found.orders))
nonzero = [r["drift"]["rel_l2"] for _, rows in groups for r in rows if r["drift"]["rel_l2"] > 0]
FLOOR = 10.0 ** (math.floor(math.log10(min(nonzero))) - 1) if nonzero else 1e-6  # a decade below the smallest drift
fig, ax = plt.subplots(figsize=(max(7.5, 1.1 * len(groups)), 4))
for i, (label, rows) in enumerate(groups):
    for j, r in enumerate(rows):
        y = max(r["drift"]["rel_l2"], FLOOR)
        ax.scatter(i + 0.08 * (j - (len(rows) - 1) / 2), y, s=36, color="C3" if r["diverged"] else "C0",
                   facecolors=None if r["diverged"] else "none", zorder=3)
ax.axhline(FLOOR, color="0.6", lw=0.8, ls="--")
ax.text(-0.45, FLOOR * 1.3, "bit-identical", ha="left", va="bottom", fontsize=8, color="0.4")
ax.set_xlim(-0.5, len(groups) - 0.5)
ax.set_yscale("log")
ax.set_ylim(FLOOR / 2, 1)
ax.set_xticks(range(len(groups)), [g[0].replace("invariant-except-", "inv. except\n").replace("invariant-attention-block-128", "inv., attention\nblocks of 128") for g in groups], fontsize=8)
ax.set_ylabel("relative L2 of the boundary caches")
ax.set_title(f"Kernel ablation, {profile}, {dtype}: open = suffixes agree, filled = suffixes part", fontsize=10)
save_figure(fig, target / f"kernel_ablation_drift_{dtype}", source=SOURCE)
