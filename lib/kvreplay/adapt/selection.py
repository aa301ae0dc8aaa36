"""Choosing the role-table training recipe on held-out MMLU rows (notebook 00): the declared criterion, the held-out
selection set, the tries and the rule that picks one, fixed before any recipe is evaluated.

A profile declares (``adapt_selection``) a criterion and a list of recipes, each a training config of the family
(:class:`~kvreplay.adapt.training.AdaptConfig`: rows, steps, learning rate, batch, letter balance). Every recipe
trains only role rows 8..13; each is trained once per config and its folder reused (:func:`ensure_checkpoints`).
Checkpoint 0 and each recipe's *later* role table are scored with :data:`~kvreplay.adapt.training.LETTER_METRIC`
on the held-out selection set (:func:`heldout_rows`) in one resumable ledger (``problem_set`` ``"heldout
selection"``). :func:`choose` then applies :data:`CHOICE_RULE` to those numbers alone; the bank is not read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..data.bank import DEFAULT_SALT, select_bank
from ..ledger.records import AdaptEvalRow
from ..ledger.store import Ledger
from ..model.models import LoadedModel
from ..data.problems import Problem
from ..analysis.stats import Proportion, wilson
from .checkpoints import checkpoint, ensure_checkpoints
from .metric import run_letter_eval
from .training import AdaptConfig, _norm

if TYPE_CHECKING:
    import pandas as pd

CKPT0 = "ckpt0"
"""The evaluation ledgers' name of checkpoint 0 (no role rows); no recipe may take it."""
HELDOUT_SET = "heldout selection"
"""``problem_set`` of the held-out selection ledger (the bank's checkpoint-metric ledger has ``"bank"``)."""
HELDOUT_RULE = (
    "the MMLU source's valid rows in the bank's own frozen selection order (sha256(salt + problem_id) ascending, "
    "the bank's salt), after the bank's rows; a row whose problem ID or normalized question text is in the bank is "
    "skipped; the first n_heldout"
)
CHOICE_RULE = (
    "A recipe meets the criterion when at most max_letter_share of its held-out predictions are one letter and it "
    "answers at least as many held-out rows correctly as checkpoint 0. Among those that meet it: the most held-out "
    "rows correct, ties by listed order. If none meets it: among recipes at least as accurate as checkpoint 0, the "
    "lowest max-letter share (ties: more correct, then listed order); if none is, the most correct (ties: lower "
    "max-letter share, then listed order)."
)


@dataclasses.dataclass(frozen=True)
class Criterion:
    """What a recipe must do on the held-out selection set (declared in the profile before anything is evaluated).

    Attributes:
        n_heldout: held-out selection rows (:func:`heldout_rows`).
        max_letter_share: largest share of the held-out predictions one letter may take (a fraction).
        min_accuracy: ``"checkpoint0"``: at least checkpoint 0's held-out rows correct (the only rule).
    """
    n_heldout: int
    max_letter_share: float
    min_accuracy: str = "checkpoint0"

    def __post_init__(self):
        if self.n_heldout < 1 or not 0 < self.max_letter_share <= 1 or self.min_accuracy != "checkpoint0":
            raise ValueError(f"criterion {self}: n_heldout >= 1, 0 < max_letter_share <= 1, min_accuracy checkpoint0")


# ----------------------------------------------------------------------------- the held-out selection set


def heldout_rows(source: Sequence[Problem], bank: Sequence[Problem], n: int, *,
                 salt: str = DEFAULT_SALT) -> list[Problem]:
    """The held-out selection set (:data:`HELDOUT_RULE`): the source's rows that come after the bank in its order.

    Only problem IDs order the rows and only IDs and question texts skip them: no answer or outcome is read.

    Raises:
        ValueError: the bank is not the first rows of the source's frozen order (another source or salt), or
            fewer than ``n`` rows remain.
    """
    order = select_bank(source, len(source), salt=salt)
    if [p.problem_id for p in order[:len(bank)]] != [p.problem_id for p in bank]:
        raise ValueError("the bank is not the first rows of its source's frozen selection order: "
                         "the held-out selection set cannot continue it")
    ids, texts = {p.problem_id for p in bank}, {_norm(p.question) for p in bank}
    rest = [p for p in order[len(bank):] if p.problem_id not in ids and _norm(p.question) not in texts]
    if len(rest) < n:
        raise ValueError(f"the source has {len(rest)} rows after the bank, fewer than the {n} held-out rows asked for")
    return rest[:n]


def assert_heldout_disjoint(heldout: Sequence[Problem], **others: Sequence[Problem] | Sequence[str]) -> None:
    """Fail closed unless the held-out selection set shares no problem ID and no question text with each other set.

    Args:
        heldout: the held-out selection rows.
        others: name -> problems, or problem IDs (e.g. a frozen panel's), that must not overlap it.

    Raises:
        ValueError: naming the set and the overlapping problem IDs.
    """
    for name, rows in others.items():
        ids = {r if isinstance(r, str) else r.problem_id for r in rows}
        texts = {_norm(r.question) for r in rows if not isinstance(r, str)}
        clash = [p.problem_id for p in heldout if p.problem_id in ids or _norm(p.question) in texts]
        if clash:
            raise ValueError(f"the held-out selection set overlaps {name}: {clash[:5]} ({len(clash)} rows); "
                             "no recipe may be chosen on rows it is later judged on")


# ----------------------------------------------------------------------------- tries and the rule


@dataclasses.dataclass(frozen=True)
class Try:
    """One checkpoint on the held-out selection set.

    Attributes:
        name: ``ckpt0`` or the recipe's name; correct: rows whose predicted letter is the gold one; n: rows;
        letters: predicted letter -> rows (every option letter, zeros included).
    """
    name: str
    correct: int
    n: int
    letters: dict[str, int]

    @property
    def accuracy(self) -> Proportion:
        """Held-out accuracy with its Wilson 95% interval."""
        return wilson(self.correct, self.n)

    @property
    def max_share(self) -> float:
        """Share of the rows taken by the most predicted letter."""
        return max(self.letters.values()) / self.n

    @property
    def top_letter(self) -> str:
        """The most predicted letter (ties: the earlier letter)."""
        return max(sorted(self.letters), key=lambda L: self.letters[L])

    def meets(self, criterion: Criterion, ckpt0: Try) -> bool:
        """Whether this try meets ``criterion`` against checkpoint 0's try."""
        return self.max_share <= criterion.max_letter_share and self.correct >= ckpt0.correct


def letter_try(records: Sequence[AdaptEvalRow], name: str) -> Try:
    """Checkpoint ``name``'s :class:`Try` from evaluation-ledger rows."""
    letters = {L: 0 for L in sorted(records[0]["checkpoints"][name]["logits"])} if records else {}
    for r in records:
        letters[r["checkpoints"][name]["predicted"]] += 1
    return Try(name, sum(r["checkpoints"][name]["correct"] for r in records), len(records), letters)


def choose(tries: Sequence[Try], ckpt0: Try, criterion: Criterion) -> tuple[int, bool]:
    """Apply :data:`CHOICE_RULE`: the index of the chosen try and whether it meets the criterion.

    Raises:
        ValueError: no tries.
    """
    if not tries:
        raise ValueError("no recipe was tried")
    order = range(len(tries))
    met = [i for i in order if tries[i].meets(criterion, ckpt0)]
    if met:
        return min(met, key=lambda i: (-tries[i].correct, i)), True
    accurate = [i for i in order if tries[i].correct >= ckpt0.correct]
    if accurate:
        return min(accurate, key=lambda i: (tries[i].max_share, -tries[i].correct, i)), False
    return min(order, key=lambda i: (-tries[i].correct, tries[i].max_share, i)), False


# ----------------------------------------------------------------------------- the search


@dataclasses.dataclass
class Search:
    """The recipe search's outcome.

    Attributes:
        configs: the recipes' training configs, in listed order; folders, manifests: each one's checkpoint folder.
        criterion: the declared criterion; heldout: the held-out selection rows.
        records, ledger: the held-out evaluation (checkpoint 0 and each recipe's later role table).
        ckpt0, tries: checkpoint 0's and each recipe's :class:`Try`; chosen: index of the chosen recipe;
        met: whether it meets the criterion.
    """
    configs: list[AdaptConfig]
    folders: list[Path]
    manifests: list[dict]
    criterion: Criterion
    heldout: list[Problem]
    records: list[AdaptEvalRow]
    ledger: Ledger
    ckpt0: Try
    tries: list[Try]
    chosen: int
    met: bool

    @property
    def folder(self) -> Path:
        """The chosen recipe's checkpoint folder."""
        return self.folders[self.chosen]

    @property
    def manifest(self) -> dict:
        """The chosen recipe's manifest."""
        return self.manifests[self.chosen]

    def table(self) -> pd.DataFrame:
        """The tries: checkpoint 0, then each recipe's config, held-out accuracy, letters and the rule's verdict."""
        import pandas as pd

        def row(t: Try, cfg: AdaptConfig | None, i: int | None) -> dict:
            return {"recipe": t.name,
                    "training rows": cfg.n_train if cfg else "", "steps": cfg.steps if cfg else "",
                    "batch": cfg.batch if cfg else "", "lr": f"{cfg.lr:g}" if cfg else "",
                    "letter-balanced": ("yes" if cfg.letter_balanced else "no") if cfg else "",
                    "held-out accuracy [Wilson 95%]": t.accuracy.pct(),
                    "predicted letters": ", ".join(f"{L} {k}" for L, k in t.letters.items()),
                    "max-letter share": f"{t.max_share:.2f} ({t.top_letter})",
                    "meets criterion": "reference" if cfg is None else ("yes" if t.meets(self.criterion, self.ckpt0)
                                                                         else "no"),
                    "chosen": "" if i is None else ("chosen" if i == self.chosen else "")}

        rows = [row(self.ckpt0, None, None)] + [row(t, c, i) for i, (t, c) in enumerate(zip(self.tries, self.configs))]
        return pd.DataFrame(rows).set_index("recipe")


def search_recipes(
    configs: Sequence[AdaptConfig], criterion: Criterion, root: str | Path, *, bank: Sequence[Problem],
    heldout: Sequence[Problem], model: str, fmt: str | dict, profile: str, ledger_root: str | Path,
    loader: Callable[[], LoadedModel] | None = None, problems: Sequence[Problem] | None = None,
    base_key: dict | None = None, progress: bool = True,
) -> Search:
    """Train (or reuse) every recipe, score checkpoint 0 and each later role table on the held-out set, and choose.

    Args:
        configs: the recipes, in listed order (unique names, none ``ckpt0``); criterion: the declared criterion.
        root: checkpoint root; bank: the MMLU bank (the training data must be disjoint from it).
        heldout: the held-out selection rows (:func:`heldout_rows`; checked disjoint from ``bank`` here).
        model, fmt, profile, ledger_root: as :func:`~kvreplay.adapt.metric.run_letter_eval`.
        loader, problems, base_key, progress: as :func:`~kvreplay.adapt.checkpoints.ensure_checkpoints`.

    Returns:
        the :class:`Search`. Finished folders and a finished ledger are read without loading the model.

    Raises:
        ValueError: repeated or reserved recipe names, a held-out set of another size than the criterion's or
            overlapping the bank, training data overlapping the bank.
        CheckpointError: a folder whose files do not match its manifest.
    """
    names = [c.name for c in configs]
    if len(set(names)) != len(names) or CKPT0 in names or not names:
        raise ValueError(f"recipe names must be unique, at least one, and not {CKPT0!r}: {names}")
    if len(heldout) != criterion.n_heldout:
        raise ValueError(f"{len(heldout)} held-out rows, the criterion declares {criterion.n_heldout}")
    assert_heldout_disjoint(heldout, **{"the MMLU bank": bank})
    folders, manifests = [], []
    for cfg in configs:
        folder, manifest = ensure_checkpoints(cfg, root, bank=bank, progress=progress, loader=loader,
                                              problems=problems, base_key=base_key)
        folders.append(folder)
        manifests.append(manifest)
    later = {cfg.name: checkpoint(f, "later") for cfg, f in zip(configs, folders)}
    tables: dict[str, tuple[str | None, str | None]] = {CKPT0: (None, None)}
    tables |= {name: (str(c.path), c.sha256) for name, c in later.items()}
    first = configs[0]
    records, ledger = run_letter_eval(heldout, tables, model=model, fmt=fmt, profile=profile, ledger_root=ledger_root,
                                      threads=first.threads, sdpa_backends=first.sdpa_backends, progress=progress,
                                      loader=loader, base_key=base_key, problem_set=HELDOUT_SET)
    ckpt0 = letter_try(records, CKPT0)
    tries = [letter_try(records, name) for name in names]
    chosen, met = choose(tries, ckpt0, criterion)
    return Search(list(configs), folders, manifests, criterion, list(heldout), records, ledger, ckpt0, tries,
                  chosen, met)
