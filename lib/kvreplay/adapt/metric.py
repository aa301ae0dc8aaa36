"""The checkpoint metric (:data:`~kvreplay.adapt.training.LETTER_METRIC`): the letter the staged template's first answer
position prefers, per MMLU problem and checkpoint, as an append-only ledger, and its accuracy summary."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from ..decoding.contract import (
    BlockFormat,
    load_spec,
    resolve_format,
)
from ..ledger.records import AdaptEvalRow, validate_row
from ..ledger.store import Ledger, run_rows
from ..model.models import LoadedModel, environment_record, load_model, load_role_table
from ..data.problems import Problem
from ..runner import ROW_ALGORITHM, model_key, problems_digest
from ..analysis.stats import mcnemar_exact, paired_bootstrap, wilson
from .training import CONSTRUCTION, LETTER_METRIC, letter_choice, training_contract

if TYPE_CHECKING:
    import pandas as pd
    from transformers import PretrainedConfig


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
    problem_set: str = "bank",
) -> tuple[list[AdaptEvalRow], Ledger]:
    """:data:`LETTER_METRIC` on ``problems`` under each checkpoint, in a resumable ledger ``adapt_eval-float32-<digest12>``.

    Args:
        tables: checkpoint name -> ``(role-table path or None, its sha256 or None)``; ``None`` is checkpoint 0.
        loader: returns the FP32 model, called only when rows remain (default: load ``model``).
        base_key: the model's identity in the ledger key (default: :func:`kvreplay.runner.model_key`).
        problem_set: what ``problems`` are, in the ledger key: ``"bank"`` (the MMLU bank, the one a profile's
            results page reads) or ``"heldout selection"`` (:mod:`kvreplay.adapt.selection`).

    Returns:
        ``(records in problem order, ledger)``. A finished ledger is read without loading the model.
    """
    config = {
        "experiment": "adapt_eval", "profile": profile, "problem_set": problem_set, "dtype": "float32", "metric": LETTER_METRIC,
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
    # torch types a module's attributes as Tensor | Module; a transformers model's config is its PretrainedConfig
    hidden: int = cast("PretrainedConfig", lm.model.config).hidden_size
    loaded = {name: load_table(path, hidden) for name, (path, _) in tables.items()}
    ledger = Ledger(root, "adapt_eval-float32", config, environment=environment_record(lm, threads) | {"format_digest": block_format.digest},
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


def accuracy_table(s: dict, labels: dict[str, str]) -> pd.DataFrame:
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
