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
# **Which training recipe** (rows, steps, learning rate, batch, letter-balanced examples) is chosen on
# held-out MMLU rows that are neither in the bank nor in Experiment 5's panel: the profile declares the
# criterion, the held-out set's size and the recipes before any recipe is evaluated, and a fixed rule
# (`kvreplay.adapt.CHOICE_RULE`) picks one from the held-out numbers alone. The bank evaluation below is
# then reported for the chosen recipe, whatever it shows.
#
# Defaults are the `smoke` profile; `make paper` sets `profile` to the one it runs (`notebooks/params/<profile>.yaml`).

# %% tags=["parameters"]
profile = "smoke"  # which notebooks/params file: a profile name, or a path to a YAML file
overrides = {}     # values replacing the profile's, e.g. {"n_rows": 4, "execution": {"device": "cuda"}}

# %%
import kvreplay  # first: importing it sets the thread policy, which OpenMP reads once, when torch loads

import pandas as pd
import torch
from IPython.display import Markdown, display

from kvreplay import adapt
from kvreplay.decoding.contract import ROLE_NAMES, resolve_format
from kvreplay.ledger.files import read_environment, read_json
from kvreplay.model.models import load_tokenizer
from kvreplay.data.problems import load_bank
from kvreplay.report import figures
from kvreplay.report.files import contract_frame
from kvreplay.notebook.session import check_profile_model, open_session

# %%
session = open_session("notebooks/00_role_adaptation.ipynb", profile, overrides)
p = session.params
print(check_profile_model(p))  # the model, from its config and tokenizer, before anything loads or trains
recipes = session.adapt_recipes()  # one training config per declared recipe (the contract's threads and SDPA backends)
criterion = session.adapt_criterion()
bank = load_bank()  # the MMLU bank: the training source must be disjoint from it, and the letter metric runs on it
source_rows, source_sha256 = adapt.load_source(p.adapt_source)
adapt.assert_disjoint(source_rows, bank)  # every source row, not only the ones used: no ID or question text in common
print(f"{p.adapt_source}: {len(source_rows)} valid rows (sha256 {source_sha256[:12]}), disjoint from the "
      f"{len(bank)}-row MMLU bank; {len(recipes)} recipes declared")

# %% [markdown]
# ## The declared criterion and recipes
# Declared in the profile (`adapt_selection`) before any recipe is evaluated. A recipe's values it leaves out
# come from the `adapt_*` parameters; every recipe trains only role rows 8–13, and its checkpoint folder is
# keyed by its training config, so a finished recipe is reused, never retrained.

# %%
display(Markdown(
    f"- **Held-out selection set**: {criterion.n_heldout} MMLU rows: {adapt.HELDOUT_RULE}.\n"
    f"- **Criterion**: at most {criterion.max_letter_share:.0%} of the held-out predictions one letter, and held-out "
    f"accuracy at least checkpoint 0's (rows correct).\n"
    f"- **Rule**: {adapt.CHOICE_RULE}"))
pd.DataFrame([{"recipe": c.name, "training rows": c.n_train, "steps": c.steps, "batch": c.batch, "lr": c.lr,
               "letter-balanced": c.letter_balanced, "early, later step": f"{c.checkpoints[0]}, {c.checkpoints[1]}"}
              for c in recipes]).set_index("recipe")

# %% [markdown]
# ## The held-out selection set
# MMLU rows of the bank's own source, next in the bank's frozen order (problem IDs alone order them; no answer
# is read), with any row whose problem ID or question text is in the bank skipped. Experiment 5's panel is drawn
# from the bank (the first `n_rows` rows, through notebook 01's prefix bank), so the set is disjoint from it too;
# both are asserted here, by problem ID and question text, and a frozen panel on file is checked as well.

# %%
mmlu_rows, mmlu_sha256 = adapt.load_source("mmlu")
heldout = adapt.heldout_rows(mmlu_rows, bank, criterion.n_heldout)
panel_path = session.ledger_root / p.profile / "exp5_panel.json"
panel_ids = [e["problem_id"] for e in read_json(panel_path, "restore it (git checkout) or delete it, and the notebook freezes it again")["panel"]] if panel_path.is_file() else []
adapt.assert_heldout_disjoint(heldout, **{"the MMLU bank": bank, "Experiment 5's candidate rows": bank[:p.n_rows],
                                          "Experiment 5's frozen panel": panel_ids,
                                          f"the {p.adapt_source} rows": source_rows})
gold = pd.Series([q.answer for q in heldout]).value_counts().sort_index()
print(f"mmlu: {len(mmlu_rows)} valid rows (sha256 {mmlu_sha256[:12]}); held-out selection set: {len(heldout)} rows, "
      f"disjoint from the bank, Experiment 5's candidates and {'its frozen panel (' + str(len(panel_ids)) + ' rows)' if panel_ids else 'any panel (none frozen yet)'}; "
      f"gold letters " + ", ".join(f"{L} {n}" for L, n in gold.items()))

# %% [markdown]
# ## One training sequence
# The six blocks of a training row, rebuilt from its token IDs by the contract's parser. Branches and
# merge never see the gold answer; only the answer block holds it. Loss positions: merge and answer
# content plus each block's closing token (the tokens the model itself chooses there). A letter-balanced
# recipe trains on the same rows with their options rotated so that gold letters cycle A, B, C, D in
# training order (`kvreplay.adapt.BALANCE_RULE`); the first rows' gold letters are shown both ways.

# %%
fmt = resolve_format(load_tokenizer(p.model), p.format)
cfg0 = recipes[0]
train_rows, heldout_obqa = adapt.split_problems(source_rows, cfg0.n_train, cfg0.n_heldout)
first = adapt.training_rows(cfg0, train_rows)[0]
example = adapt.build_staged(fmt, first)
roles = example.roles[0].tolist()
blocks = []
for r, name in enumerate(ROLE_NAMES):
    pos = [i for i, x in enumerate(roles) if x == r]
    if r:  # content only: drop the block's opening and closing delimiters
        pos = pos[len(fmt.openers[r]): len(pos) - len(fmt.closers[r])]
    blocks.append({"block": name, "tokens (with delimiters)": roles.count(r),
                   "loss tokens": len(example.targets.get(r, [])),
                   "content": fmt._tokenizer.decode([example.ids[i] for i in pos])})
balanced = adapt.balance_letters(train_rows)
print(f"recipe {cfg0.name}, {first.problem_id}: {len(example.ids)} tokens; gold {first.answer}")
k = min(8, len(train_rows))
print(f"gold letters of the first {k} training rows, as split: " + " ".join(q.answer for q in train_rows[:k])
      + "; letter-balanced: " + " ".join(q.answer for q in balanced[:k]))
pd.DataFrame(blocks).set_index("block")

# %% [markdown]
# ## Train each recipe, score it on the held-out selection set, choose
# Each recipe's checkpoint folder is keyed by the sha256 of its training config (model key, format, data split
# and digests, construction, optimizer, steps, seed, threads): a finished folder is reused, and one whose files
# no longer match their manifest is refused. Checkpoint 0 and every recipe's later role table are scored with
# the letter metric (below) on the held-out selection set, in one resumable ledger; the rule above then chooses.
# The bank is not read until a recipe is chosen.

# %%
search = adapt.search_recipes(recipes, criterion, session.checkpoint_root, bank=bank, heldout=heldout, model=p.model,
                              fmt=p.format, profile=p.profile, ledger_root=session.ledger_root,
                              loader=session.training_model)
cfg, folder, manifest = search.configs[search.chosen], search.folder, search.manifest
tries = search.table()
session.save_table(tries, "adapt_selection",
                   caption=f"Role-table recipes on {criterion.n_heldout} held-out MMLU rows: teacher-forced "
                           "answer-letter accuracy and predicted letters; the recipe the declared rule chooses")
print(f"{search.ledger.dir.name}: chosen {cfg.name} — "
      + ("it meets the criterion" if search.met else "NO recipe meets the criterion; the rule's closest is kept"))
tries

# %% [markdown]
# ## The chosen recipe's checkpoints
# Its folder becomes the profile's checkpoint family: `role_adaptation.json` names it, and Experiment 5 loads
# its later role table.

# %%
pointer = adapt.write_pointer(session.ledger_root / p.profile / adapt.POINTER, folder, manifest)
family = {name: adapt.checkpoint(folder, name) for name in adapt.CHECKPOINT_NAMES}  # digests checked
print(folder)
pd.DataFrame({name: {"step": c.step, "file": c.path.name, "sha256": c.sha256[:16] + "…",
                     "bytes": c.path.stat().st_size}
              for name, c in family.items()}).T

# %% [markdown]
# ## Execution contract
# As recorded when the chosen role table was trained (`environment.json` beside the manifest).

# %%
contract_frame({"role-table training (FP32)": read_environment(folder)})

# %% [markdown]
# ## Training curve
# The chosen recipe: training loss per step (the mean over its batch) and the same objective on the held-out
# OpenBookQA rows; right: on those rows, how often the answer letter with the highest logit at the first answer
# position is the gold one (the checkpoint metric below).

# %%
train_curve = pd.DataFrame(manifest["curve"]["train"])
held_curve = pd.DataFrame(manifest["curve"]["heldout"])
fig = figures.adaptation_curve(train_curve, held_curve, {name: c.step for name, c in family.items()},
                               n_heldout=len(heldout_obqa),
                               title=f"Role-table adaptation ({p.profile}, recipe {cfg.name}): rows 8-13 only, FP32, "
                                     f"lr {cfg.lr:g}, {cfg.steps} steps of {cfg.batch}")
session.save_figure(fig, "adapt_training_curve")
curve_table = held_curve.set_index("step")
session.save_table(curve_table, "adapt_curve",
                   caption="Role-table adaptation: held-out loss and answer-letter accuracy")
curve_table

# %% [markdown]
# ## Answer accuracy on the MMLU bank: checkpoint 0 vs the chosen later checkpoint
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
labels = {"ckpt0": "checkpoint 0 (zero role table)", "later": f"later checkpoint ({cfg.name}, step {later.step})"}
acc_table = adapt.accuracy_table(acc, labels)
session.save_table(acc_table, "adapt_accuracy",
                   caption="Checkpoint 0 vs the later checkpoint: "
                           "teacher-forced answer-letter accuracy on the MMLU bank")
print(eval_ledger.dir.name)
acc_table

# %% [markdown]
# ## Integrity assertions

# %%
assert all(m["base_model"]["unchanged_after_training"] for m in search.manifests)
assert all(m["config"]["trainable_rows"] == list(range(8, 14)) for m in search.manifests), "a recipe trained other rows"
assert family["early"].sha256 != family["later"].sha256, "the early and later role tables are identical"
t_later = torch.load(later.path, weights_only=True)
assert tuple(t_later.shape)[0] == 14 and not t_later[:8].any() and t_later[8:].any(), (
    "rows 0..7 must stay zero, rows 8..13 trained")
assert [r["problem_id"] for r in search.records] == [q.problem_id for q in heldout]
assert not {q.problem_id for q in heldout} & {q.problem_id for q in eval_rows}, "selection rows in the bank evaluation"
assert search.tries[search.chosen].name == cfg.name == manifest["config"]["name"]
assert [r["problem_id"] for r in records] == [q.problem_id for q in eval_rows]
assert pointer["checkpoints"]["later"]["sha256"] == later.sha256
print("checkpoint family verified (sha256): " + ", ".join(f"{k} {v.sha256[:12]}…" for k, v in family.items()))

# %% [markdown]
# ## What this shows

# %%
first_step, last_step = train_curve.iloc[0], train_curve.iloc[-1]
h0, h1 = held_curve.iloc[0], held_curve.iloc[-1]
m = acc["mcnemar"]
chosen, ck0 = search.tries[search.chosen], search.ckpt0
meeting = [t.name for t in search.tries if t.meets(criterion, ck0)]
bank_later, bank_ck0 = adapt.letter_try(records, "later"), adapt.letter_try(records, "ckpt0")
ck0_top_right = sum(r["checkpoints"]["ckpt0"]["correct"] and r["checkpoints"]["ckpt0"]["predicted"] == bank_ck0.top_letter
                    for r in records)
lines = [
    f"- {len(recipes)} recipes were tried on {len(heldout)} held-out MMLU rows outside the bank; checkpoint 0 answers "
    f"{ck0.accuracy.pct()} there, predicting {ck0.top_letter} on {ck0.max_share:.0%}. "
    + (f"{len(meeting)} met the declared criterion (at most {criterion.max_letter_share:.0%} one letter, accuracy at "
       f"least checkpoint 0's): {', '.join(meeting)}; the rule chose **{cfg.name}**, held-out {chosen.accuracy.pct()}, "
       f"its most predicted letter {chosen.top_letter} on {chosen.max_share:.0%}."
       if search.met else
       f"**No recipe met the declared criterion** (at most {criterion.max_letter_share:.0%} one letter and accuracy at "
       f"least checkpoint 0's): training only the role rows did not get there with these recipes. The rule kept the "
       f"closest, **{cfg.name}**: held-out {chosen.accuracy.pct()}, its most predicted letter {chosen.top_letter} on "
       f"{chosen.max_share:.0%}."),
    f"- Only role rows 8–13 were trained ({cfg.steps} steps of {cfg.batch}, lr {cfg.lr:g}, "
    f"{'letter-balanced' if cfg.letter_balanced else 'as split'}, FP32, {cfg.threads} threads); the base weights' "
    f"sha256 is unchanged ({manifest['base_model']['weights_sha256_float32'][:12]}…).",
    f"- Training loss {first_step.loss:.3f} at step 1 → {last_step.loss:.3f} at step {int(last_step.step)}; "
    f"held-out OpenBookQA loss {h0.loss:.3f} → {h1.loss:.3f} "
    f"(letter accuracy {h0.letter_accuracy:.2f} → {h1.letter_accuracy:.2f} on {len(heldout_obqa)} rows).",
    f"- MMLU bank ({acc['n']} rows, not used to choose), teacher-forced answer letter: checkpoint 0 "
    f"{acc['acc_a'].pct()}, later {acc['acc_b'].pct()}; McNemar {m.b} vs {m.c}, p = {m.pvalue:.3g}; "
    f"the two checkpoints pick the same letter on {acc['predicted_same']}/{acc['n']}.",
    f"- The same criterion on the bank (reported, not used to choose): the chosen later checkpoint "
    f"{'meets' if bank_later.meets(criterion, bank_ck0) else 'does not meet'} it there: "
    f"{bank_later.max_share:.0%} of its predictions are its most frequent letter {bank_later.top_letter}, and it answers "
    f"{bank_later.correct} rows correctly against checkpoint 0's {bank_ck0.correct}, of which {ck0_top_right} are "
    f"checkpoint 0's one letter {bank_ck0.top_letter} ({bank_ck0.letters[bank_ck0.top_letter]} predictions; "
    f"{acc['letters']['gold'].get(bank_ck0.top_letter, 0)} gold).",
    "- Letter prior on the bank: " + "; ".join(
        f"{labels.get(k, k)} predicts its most frequent letter on {max(c.values())}/{acc['n']} rows "
        f"({', '.join(f'{L} {n}' for L, n in c.items())})"
        for k, c in acc["letters"].items() if k != "gold")
    + f"; gold letters {', '.join(f'{L} {n}' for L, n in acc['letters']['gold'].items())}.",
    f"- Experiment 5 (notebook 05) runs on the later checkpoint: base model + `{later.path.name}` of "
    f"`{folder.name}` (sha256 {later.sha256[:12]}…).",
]
display(Markdown("\n".join(lines)))
