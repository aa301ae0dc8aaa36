"""Every ledger arm's facts, declared once as data: :data:`ARM_FACTS` (paper §3.9).

An arm is an experiment run at one or more precisions into ledgers ``<experiment>-<dtype>-<digest12>``. What the
layers above need to know about it without running it is declared here, once: the notebook that computes it, its
precisions, its row-algorithm version, the upstream ledgers its notebook reads, the record its rows have, and
what it is called. Everything else is derived from this table: ``runner.ROW_ALGORITHM``, ``ledger.records.ROW_TYPES``,
``ledger.lookup.LEDGER_SPECS``, the generated overloads of ``ledger.overloads``, ``paper_chain.CHAIN`` and
``notebook_arms``, the headings and tables of ``report.partial``, notebook 06's tables (``report.summary``,
``report.paper_tables``), ``experiments.arms.ARMS`` and the arm list of ``scripts/gpu_profile.py``. Its functions
(row, chunk, ledger-key entries, how a session prepares it) are declared in the module its facts name
(``kvreplay.runner.Arm``), which takes its name from here (:func:`declared_in`).

The derived tables are read-through views (:class:`Derived`): an entry added to :data:`ARM_FACTS` is seen by all
of them at once. This module imports nothing of the package (no torch): ``scripts/gpu_profile.py``'s parent
process reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, Literal, TypeVar, overload

DTYPE_LABELS = {"bfloat16": "BF16", "float32": "FP32"}
"""A precision's short name in titles."""


@dataclasses.dataclass(frozen=True)
class ArmFacts:
    """What is known about one experiment's arm before it runs.

    Attributes:
        experiment: the ledger label's first part (``exp1``, ``exp2_controls``, ...; ``adapt_eval`` is the
            checkpoint family's metric, not an arm of the chain).
        notebook: the file under ``notebooks/`` that computes it.
        dtypes: the precisions it runs at (``"bfloat16"``, ``"float32"``).
        row_algorithm: the version of its row function, recorded in every ledger's environment. Bump it whenever
            a committed golden row would no longer recompute byte for byte (a change to what a row computes or
            records; then look at its :attr:`record`); a ledger written by another number is *stale*. A refactor
            that changes no bit keeps it. Version 2: greedy argmax with the lowest token ID winning an exact tie,
            the ``nonfinite`` and ``equivalence`` gates, tie accounting and predicted-letter endpoints in the
            records. ``exp1_ties`` runs ``exp1``'s row function: its version follows.
        record: the name of its row's record in :mod:`kvreplay.ledger.records` (``"Exp1Row"``; the failed-row
            record, where there is one, is ``<name without Row>FailedRow``).
        what: one line naming it, for error messages, the artifact map and titles (the precision is appended).
        title: what ``python -m kvreplay.report.partial`` heads its table with (``None``: it has no table there).
        partial: how that report tabulates it: ``"suffix"`` (the suffix-divergence endpoint of both precisions,
            Experiment 1-like rows) or ``"one_arm"`` (its notebook's own summary table on its BF16 arm).
        reads: upstream ledgers (``<experiment>-<dtype>``) its notebook reads before computing it.
        read_by: the notebooks (by number, ``"06"``) that read its finished ledgers without computing any arm.
        per_precision: it runs at those of :attr:`dtypes` the chain's ``precisions`` lists (Experiments 1, 2 and
            the tie-rule control); else at all of :attr:`dtypes`.
        enabled_by: a chain parameter that must be non-empty for the chain to compute it (``None``: always).
        variants: a chain parameter listing its variants, one ledger each (the tie rules, the kernels values);
            ``None``: one ledger.
        variant_key: the ledger-key entry that tells its variants apart (``"tie_rule"``, ``"kernels"``); ``None``
            without variants.
        assembly: the paper assembly (notebooks 06 and 07, ``ledger.lookup.LEDGER_SPECS``) reads it.
        exploratory: not one of the paper's experiments (a control).
        chain: an arm of the notebook chain (``kvreplay.experiments.arms.ARMS`` declares its functions).
        module: the module under :mod:`kvreplay.experiments` that declares its functions (its
            :class:`kvreplay.runner.Arm`, named by :func:`declared_in`); a ``"one_arm"`` arm's module also has
            ``partial_table(rows, folder)``, its progress-report table.
        sets_cap: the content cap (a ``Caps`` field) that its :attr:`variant_key` entry sets (``"branch"``).
        tables: the results tables (file stems) its notebook writes once; notebook 06 recomputes and compares them.
        paper: the paper's number of the experiment it is (``1``-``5``); ``None``: not one of the paper's.
        paper_rows: the row counts of the setup table, as ``(reference key, part, ledger label)``: a count per
            part (``exp3``'s bridge and its audit of the Experiment 1 ledger).
        paper_note: what else separates this run from the paper's for its endpoints (notebook 06).
        make_paper: ``make paper``'s chain runs its notebook (notebook 09 runs outside it).
    """
    experiment: str
    notebook: str
    dtypes: tuple[str, ...]
    row_algorithm: int
    record: str
    what: str
    title: str | None = None
    partial: Literal["suffix", "one_arm"] | None = None
    reads: tuple[str, ...] = ()
    read_by: tuple[str, ...] = ()
    per_precision: bool = False
    enabled_by: str | None = None
    variants: str | None = None
    variant_key: str | None = None
    assembly: bool = False
    exploratory: bool = False
    chain: bool = True
    module: str | None = None
    sets_cap: str | None = None
    tables: tuple[str, ...] = ()
    paper: int | None = None
    paper_rows: tuple[tuple[str, str, str], ...] = ()
    paper_note: str | None = None
    make_paper: bool = True

    def labels(self, precisions: tuple[str, ...] | None = None) -> list[str]:
        """Its ledger labels ``<experiment>-<dtype>``; with the chain's ``precisions``, those the chain computes (in
        the order of ``precisions`` for a :attr:`per_precision` arm)."""
        dtypes = [d for d in precisions if d in self.dtypes] if precisions is not None and self.per_precision \
            else list(self.dtypes)
        return [f"{self.experiment}-{d}" for d in dtypes]

    def what_at(self, dtype: str) -> str:
        """:attr:`what` at one precision: ``"Experiment 1, live/prefill matrix, BF16"``."""
        return f"{self.what}, {DTYPE_LABELS.get(dtype, dtype)}"


ARM_FACTS: dict[str, ArmFacts] = {f.experiment: f for f in (
    ArmFacts("exp1", "01_experiment1_live_vs_prefill.ipynb", ("bfloat16", "float32"), 2, "Exp1Row",
             "Experiment 1, live/prefill matrix", title="live vs prefill", partial="suffix",
             read_by=("06", "07", "08"), per_precision=True, assembly=True, module="live_vs_prefill",
             tables=("table_exp1_matrix",), paper=1, paper_rows=(("exp1", "", "exp1-bfloat16"),)),
    ArmFacts("exp1_ties", "01_experiment1_live_vs_prefill.ipynb", ("bfloat16",), 2, "Exp1Row",
             "Experiment 1 under another greedy tie rule (exploratory)", per_precision=True, enabled_by="tie_rules",
             variants="tie_rules", variant_key="tie_rule", exploratory=True, module="tie_rules"),
    ArmFacts("exp1_length", "01_experiment1_live_vs_prefill.ipynb", ("bfloat16",), 2, "Exp1Row",
             "Experiment 1 at another branch cap (exploratory, manipulated prefix length)", per_precision=True,
             enabled_by="length_branch_caps", variants="length_branch_caps", variant_key="cap_branch",
             exploratory=True, module="length_arm", sets_cap="branch"),
    ArmFacts("exp2", "02_experiment2_fixed_prefix_precision.ipynb", ("bfloat16", "float32"), 2, "Exp2Row",
             "Experiment 2, fixed-prefix matrix", title="incremental vs prefill, fixed BF16 prefixes",
             partial="suffix", reads=("exp1-bfloat16",), read_by=("06", "07", "08"), per_precision=True,
             assembly=True, module="fixed_prefix", tables=("table_exp2_matrix", "table_exp2_crossing"), paper=2,
             paper_rows=(("exp2", "", "exp2-bfloat16"),)),
    ArmFacts("exp2_controls", "02_experiment2_fixed_prefix_precision.ipynb", ("bfloat16",), 1, "ControlsRow",
             "Experiment 2's controls on the fixed prefixes (exploratory)", reads=("exp1-bfloat16",),
             read_by=("06", "07"), enabled_by="exploratory_controls", exploratory=True, module="controls"),
    ArmFacts("exp3", "03_experiment3_bridge_and_audit.ipynb", ("bfloat16",), 2, "BridgeRow",
             "Experiment 3, live/incremental bridge",
             title="the incremental bridge (new live boundary vs its incremental rebuild)", partial="one_arm",
             reads=("exp1-bfloat16", "exp2-bfloat16"), read_by=("06", "07"), assembly=True, module="bridge",
             tables=("table_exp3_bridge", "table_exp3_audit"), paper=3,
             paper_rows=(("exp3", "bridge", "exp3-bfloat16"), ("exp3_audit", "audit", "exp1-bfloat16"))),
    ArmFacts("exp4", "04_experiment4_cache_transplant.ipynb", ("bfloat16",), 2, "TransplantRow",
             "Experiment 4, cache transplants", title="boundary K/V transplants between incremental and prefill",
             partial="one_arm", reads=("exp2-bfloat16",), read_by=("06", "07"), assembly=True, module="transplant",
             tables=("table5_exp4_transplant", "table_exp4_localization"), paper=4,
             paper_rows=(("exp4", "panel", "exp4-bfloat16"),)),
    ArmFacts("exp5", "05_experiment5_replication.ipynb", ("bfloat16",), 2, "ReplicationRow",
             "Experiment 5, replication on a later checkpoint",
             title="whole-cache transplants on the later checkpoint", partial="one_arm", reads=("exp2-bfloat16",),
             read_by=("06", "07"), assembly=True, module="replication",
             tables=("table_exp5_replication", "table_exp5_accuracy"), paper=5,
             paper_rows=(("exp5", "", "exp5-bfloat16"),),
             paper_note="later checkpoint (role rows trained here on OpenBookQA vs the paper's later training "
                        "checkpoint)"),
    ArmFacts("exp2_kernels", "09_kernel_ablation.ipynb", ("bfloat16",), 2, "Exp2Row",
             "Experiment 2's fixed prefixes under another kernels value (exploratory, kernel attribution)",
             reads=("exp1-bfloat16",), enabled_by="kernel_values", variants="kernel_values", variant_key="kernels",
             exploratory=True, module="kernel_ablation", make_paper=False),
    ArmFacts("adapt_eval", "00_role_adaptation.ipynb", ("float32",), 1, "AdaptEvalRow",
             "the checkpoint family's letter metric", chain=False),
)}
"""Experiment -> its facts, in chain order (the order notebooks, reports and scripts list arms in)."""

READERS = {"06": "06_tables.ipynb", "07": "07_figures.ipynb", "08": "08_drift_explorer.ipynb"}
"""The notebooks that compute no arm but read finished ledgers (:attr:`ArmFacts.read_by` names them by number)."""

PREFIX_BANK_SOURCE = "exp1-bfloat16"
"""The arm whose finished rows' boundary prefixes notebook 01 freezes into the prefix bank that Experiments 2-5 read
(``session.Session.write_prefix_bank``)."""

V = TypeVar("V")
T = TypeVar("T")


class Derived(Mapping[str, V], Generic[V]):
    """A read-only mapping recomputed from :data:`ARM_FACTS` at each read (a handful of entries): a table derived
    from the facts that sees an arm added to them (``Derived(lambda: {...})``)."""

    def __init__(self, build: Callable[[], dict[str, V]]):
        self._build = build

    def __getitem__(self, key: str) -> V:
        return self._build()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._build())

    def __len__(self) -> int:
        return len(self._build())

    def __repr__(self) -> str:
        return repr(self._build())

    def __eq__(self, other: Any) -> bool:
        return dict(self._build()) == (dict(other) if isinstance(other, Mapping) else other)

    __hash__ = None  # type: ignore[assignment]


class DerivedList(Sequence[T], Generic[T]):
    """A read-only list recomputed from :data:`ARM_FACTS` at each read, like :class:`Derived`."""

    def __init__(self, build: Callable[[], list[T]]):
        self._build = build

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> list[T]: ...
    def __getitem__(self, index: int | slice) -> T | list[T]:
        return self._build()[index]

    def __len__(self) -> int:
        return len(self._build())

    def __repr__(self) -> str:
        return repr(self._build())

    def __eq__(self, other: Any) -> bool:
        return self._build() == (list(other) if isinstance(other, Sequence) else other)

    __hash__ = None  # type: ignore[assignment]


def chain_notebooks() -> list[str]:
    """The notebooks ``make paper`` runs, in dependency order (by number): each arm's with :attr:`ArmFacts.make_paper`
    (the checkpoint family's 00 included), then :data:`READERS`."""
    return sorted({f.notebook for f in ARM_FACTS.values() if f.make_paper} | set(READERS.values()))


def declared_in(module: str) -> str:
    """The experiment whose functions the module ``module`` (``__name__`` of a module under
    :mod:`kvreplay.experiments`) declares (:attr:`ArmFacts.module`): how an ``Arm`` names its experiment.

    Raises:
        ValueError: no arm, or more than one, names that module.
    """
    short = module.rsplit(".", 1)[-1]
    found = [f.experiment for f in ARM_FACTS.values() if f.module == short]
    if len(found) != 1:
        raise ValueError(f"{len(found)} arms of ARM_FACTS name the module {short!r} (expected one): {found}")
    return found[0]


def chain_facts() -> list[ArmFacts]:
    """The arms of the notebook chain, in chain order (``adapt_eval`` left out)."""
    return [f for f in ARM_FACTS.values() if f.chain]


def facts(experiment: str) -> ArmFacts:
    """One experiment's facts.

    Raises:
        ValueError: no arm is declared for ``experiment`` (naming those that are).
    """
    if experiment not in ARM_FACTS:
        raise ValueError(f"no arm is declared for experiment {experiment!r}; arms: {', '.join(ARM_FACTS)}")
    return ARM_FACTS[experiment]


def arm_labels() -> list[str]:
    """Every ledger label ``<experiment>-<dtype>`` of the chain's arms, in chain order (what
    ``scripts/gpu_profile.py`` computes)."""
    return [label for f in chain_facts() for label in f.labels()]


def notebook_labels(notebook: str, precisions: tuple[str, ...], enabled: Callable[[str], Any]) -> list[str]:
    """The ledger labels a notebook reads or computes, upstream first, each once.

    Args:
        notebook: a notebook's file name (only its first two characters, its number, are compared).
        precisions: the chain's ``precisions``.
        enabled: chain parameter name -> its value (an arm whose :attr:`ArmFacts.enabled_by` value is empty is
            left out).
    """
    out: list[str] = []
    for f in chain_facts():
        if f.enabled_by is not None and not enabled(f.enabled_by):
            continue
        if f.notebook[:2] == notebook[:2]:
            out += [*f.reads, *f.labels(precisions)]
        elif notebook[:2] in f.read_by:
            out += f.labels(precisions)
    return list(dict.fromkeys(out))
