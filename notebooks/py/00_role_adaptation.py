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
# # Checkpoint family — role-table adaptation (checkpoint 0, early, later)
#
# *Paper §3.1 (role-embedding rows 8–13 of an adapted checkpoint) and §4.5 (Experiment 5 runs on a
# distinct later checkpoint of the same family).* Checkpoint 0 is the embedded model with a zero role
# table, the model of Experiments 1–4. This notebook makes the later checkpoints **reproducibly, offline,
# on CPU**: it trains only role rows 8..13 (every base weight frozen and checked bit-unchanged) with a
# merge-targeted objective — the loss falls on the merge and answer tokens of multi-branch sequences
# built with the block contract (same delimiters, roles, positions and visibility mask as the decoders)
# from OpenBookQA problems that are disjoint from the MMLU bank, with the gold answer in the answer
# block. The role table is saved at an earlier and a later step, with digests, the training config and
# the loss curves; Experiment 5 (notebook 05) loads the later one as base model + role table, checked
# by digest. Construction, objective and metric are documented in `kvreplay.adapt`.
#
# Defaults are the `smoke` profile; `make paper` sets `profile` to the one it runs (`notebooks/params/<profile>.yaml`).

# %% tags=["parameters"]
profile = "smoke"  # which notebooks/params file: a profile name, or a path to a YAML file
overrides = {}     # values replacing the profile's, e.g. {"n_rows": 4, "execution": {"device": "cuda"}}

# %%
import json

import pandas as pd
from IPython.display import Markdown, display

from kvreplay import adapt
from kvreplay.contract import ROLE_NAMES, resolve_format
from kvreplay.models import load_tokenizer
from kvreplay.problems import load_bank
from kvreplay.report import figures
from kvreplay.report.files import contract_frame
from kvreplay.session import open_session

# %%
session = open_session("notebooks/00_role_adaptation.ipynb", profile, overrides)
p = session.params
cfg = session.adapt_config()  # the adapt_* parameters, with the contract's threads and SDPA backends
bank = load_bank()  # the MMLU bank: the training source must be disjoint from it, and the letter metric runs on it
source_rows, source_sha256 = adapt.load_source(p.adapt_source)
train_rows, heldout_rows = adapt.split_problems(source_rows, p.adapt_n_train, p.adapt_n_heldout)
adapt.assert_disjoint(source_rows, bank)  # every source row, not only the ones used: no ID or question text in common
print(f"{p.adapt_source}: {len(source_rows)} valid rows (sha256 {source_sha256[:12]}), disjoint from the "
      f"{len(bank)}-row MMLU bank; {len(train_rows)} train, {len(heldout_rows)} held out")


# %% [markdown]
# ## One training sequence
# The six blocks of a training row, rebuilt from its token IDs by the contract's parser. Branches and
# merge never see the gold answer; only the answer block holds it. Loss positions: merge and answer
# content plus each block's closing token (the tokens the model itself chooses there).

# %%
fmt = resolve_format(load_tokenizer(p.model), p.format)
example = adapt.build_staged(fmt, train_rows[0])
roles = example.roles[0].tolist()
blocks = []
for r, name in enumerate(ROLE_NAMES):
    pos = [i for i, x in enumerate(roles) if x == r]
    if r:  # content only: drop the block's opening and closing delimiters
        pos = pos[len(fmt.openers[r]): len(pos) - len(fmt.closers[r])]
    blocks.append({"block": name, "tokens (with delimiters)": roles.count(r),
                   "loss tokens": len(example.targets.get(r, [])),
                   "content": fmt._tokenizer.decode([example.ids[i] for i in pos])})
print(f"{train_rows[0].problem_id}: {len(example.ids)} tokens; gold {train_rows[0].answer}")
pd.DataFrame(blocks).set_index("block")

# %% [markdown]
# ## Train, or reuse the finished checkpoints
# The checkpoint folder is keyed by the sha256 of the training config (model key, format, data split and
# digests, optimizer, steps, seed, threads): a profile with the same training config reuses it, and a
# folder whose files no longer match their manifest is refused.

# %%
folder, manifest = adapt.ensure_checkpoints(cfg, session.checkpoint_root, bank=bank, loader=session.training_model)
pointer = adapt.write_pointer(session.ledger_root / p.profile / adapt.POINTER, folder, manifest)
family = {name: adapt.checkpoint(folder, name) for name in adapt.CHECKPOINT_NAMES}  # digests checked
print(folder)
pd.DataFrame({name: {"step": c.step, "file": c.path.name, "sha256": c.sha256[:16] + "…",
                     "bytes": c.path.stat().st_size}
              for name, c in family.items()}).T

# %% [markdown]
# ## Execution contract
# As recorded when the role table was trained (`environment.json` beside the manifest).

# %%
contract_frame({"role-table training (FP32)": json.loads((folder / "environment.json").read_text())})

# %% [markdown]
# ## Training curve
# Training loss per step (one sequence per step unless `adapt_batch` says otherwise) and the same
# objective on the held-out OpenBookQA rows; right: on the held-out rows, how often the answer letter
# with the highest logit at the first answer position is the gold one (the checkpoint metric below).

# %%
train_curve = pd.DataFrame(manifest["curve"]["train"])
held_curve = pd.DataFrame(manifest["curve"]["heldout"])
fig = figures.adaptation_curve(train_curve, held_curve, {name: c.step for name, c in family.items()},
                               n_heldout=len(heldout_rows),
                               title=f"Role-table adaptation ({p.profile}): rows 8-13 only, FP32, "
                                     f"lr {p.adapt_lr}, {p.adapt_steps} steps")
session.save_figure(fig, "adapt_training_curve")
curve_table = held_curve.set_index("step")
session.save_table(curve_table, "adapt_curve",
                   caption="Role-table adaptation: held-out loss and answer-letter accuracy")
curve_table

# %% [markdown]
# ## Answer accuracy on the MMLU bank: checkpoint 0 vs the later checkpoint
# The metric (`kvreplay.adapt.LETTER_METRIC`): the same staged template is teacher-forced through the
# answer opener — branches and merge are gold-blind, so nothing leaks — and the prediction is the option
# letter whose token has the highest logit at the first answer position; one FP32 forward per problem and
# checkpoint, in a resumable ledger. Wilson 95% intervals; paired difference by percentile bootstrap;
# exact two-sided McNemar on the discordant problems (direction, not equivalence). This is a cheap
# checkpoint metric, not the decoded accuracy of the experiments (notebook 05 reports that on its panel).

# %%
eval_rows = bank[:p.n_adapt_eval]
later = family["later"]
records, eval_ledger = adapt.run_letter_eval(
    eval_rows, {"ckpt0": (None, None), "later": (str(later.path), later.sha256)}, model=p.model, fmt=p.format,
    profile=p.profile, ledger_root=session.ledger_root, threads=cfg.threads, sdpa_backends=cfg.sdpa_backends,
    loader=session.training_model,
)
acc = adapt.accuracy_summary(records, "ckpt0", "later", seed=p.seed, n_resamples=p.n_resamples)
labels = {"ckpt0": "checkpoint 0 (zero role table)", "later": f"later checkpoint (step {later.step})"}
acc_table = adapt.accuracy_table(acc, labels)
session.save_table(acc_table, "adapt_accuracy",
                   caption="Checkpoint 0 vs the later checkpoint: "
                           "teacher-forced answer-letter accuracy on the MMLU bank")
print(eval_ledger.dir.name)
acc_table

# %% [markdown]
# ## Integrity assertions

# %%
assert manifest["base_model"]["unchanged_after_training"]
assert family["early"].sha256 != family["later"].sha256, "the early and later role tables are identical"
import torch
t_later = torch.load(later.path, weights_only=True)
assert tuple(t_later.shape)[0] == 14 and not t_later[:8].any() and t_later[8:].any(), (
    "rows 0..7 must stay zero, rows 8..13 trained")
assert [r["problem_id"] for r in records] == [p.problem_id for p in eval_rows]
assert pointer["checkpoints"]["later"]["sha256"] == later.sha256
print("checkpoint family verified (sha256): " + ", ".join(f"{k} {v.sha256[:12]}…" for k, v in family.items()))

# %% [markdown]
# ## What this shows

# %%
first, last = train_curve.iloc[0], train_curve.iloc[-1]
h0, h1 = held_curve.iloc[0], held_curve.iloc[-1]
m = acc["mcnemar"]
lines = [
    f"- Only role rows 8–13 were trained ({p.adapt_steps} steps, lr {p.adapt_lr}, FP32, {cfg.threads} threads); "
    f"the base weights' sha256 is unchanged ({manifest['base_model']['weights_sha256_float32'][:12]}…).",
    f"- Training loss {first.loss:.3f} at step 1 → {last.loss:.3f} at step {int(last.step)}; "
    f"held-out loss {h0.loss:.3f} → {h1.loss:.3f} "
    f"(held-out letter accuracy {h0.letter_accuracy:.2f} → {h1.letter_accuracy:.2f} on {len(heldout_rows)} rows).",
    f"- MMLU bank ({acc['n']} rows), teacher-forced answer letter: checkpoint 0 {acc['acc_a'].pct()}, "
    f"later {acc['acc_b'].pct()}; "
    f"McNemar {m.b} vs {m.c}, p = {m.pvalue:.3g}; "
    f"the two checkpoints pick the same letter on {acc['predicted_same']}/{acc['n']}.",
    "- Letter prior: " + "; ".join(
        f"{labels.get(k, k)} predicts its most frequent letter on {max(c.values())}/{acc['n']} rows "
        f"({', '.join(f'{L} {n}' for L, n in c.items())})"
        for k, c in acc["letters"].items() if k != "gold")
    + f"; gold letters {', '.join(f'{L} {n}' for L, n in acc['letters']['gold'].items())}.",
    f"- Experiment 5 (notebook 05) runs on the later checkpoint: base model + `{later.path.name}` "
    f"(sha256 {later.sha256[:12]}…).",
]
display(Markdown("\n".join(lines)))
