"""Each experiment arm declared once: its row and chunk functions, its inputs and its ledger key (paper §3.9).

An :class:`Arm` is the one declaration of an experiment's arm, made in its module under
:mod:`kvreplay.experiments` (``EXP1`` in :mod:`~kvreplay.experiments.live_vs_prefill`, ...). It names the
per-row and per-chunk functions, the entries it adds to the ledger key, whether each problem needs a fixed
prefix, and how a notebook's session prepares it (panels frozen, upstream ledgers read). An
:class:`ArmPlan` is an arm bound to its inputs: the problems in frozen order, the fixed prefixes and the key
entries. Notebooks (:meth:`kvreplay.notebook.session.Session.run`), ``make verify``, ``make bench`` and
``scripts/gpu_profile.py`` all run an arm through its plan, so each arm is wired in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Generic, Protocol, TypeVar

from ..arm_facts import ARM_FACTS, ArmFacts, Derived, facts
from ..engine import Measured
from ..gates import GateError
from ..ledger.lookup import LoadedLedger
from ..ledger.store import Ledger
from ..data.problems import Problem
from .loop import run_arm
from .spec import ArmSettings, Hook, RunSpec

R = TypeVar("R", bound=Mapping[str, Any])
"""An arm's row record (:mod:`kvreplay.ledger.records`, e.g. ``Exp1Record``)."""

SETTING_ENTRIES = ("tie_rule", "top_logits", "kernels")
"""Ledger-key entries of an arm that are also :class:`ArmSettings` fields: a plan's entry sets the field
(:meth:`ArmPlan.bind`)."""

CAP_ENTRIES: Mapping[str, str] = Derived(lambda: {str(f.variant_key): f.sets_cap for f in ARM_FACTS.values()
                                                  if f.sets_cap is not None})
"""Ledger-key entries of an arm that set one of the content caps (:class:`~kvreplay.decoding.contract.Caps` field), from each
arm's :attr:`~kvreplay.arm_facts.ArmFacts.sets_cap`: the manipulated-length arm's branch cap (:meth:`ArmPlan.bind`)."""


class Chain(Protocol):
    """What an arm's ``prepare`` reads from a notebook's session (:class:`kvreplay.notebook.session.Session` is one)."""

    @property
    def params(self) -> Any: ...  # noqa: D102 (the chain's parameters, kvreplay.notebook.profiles.ChainParameters)

    @property
    def fixed(self) -> Any: ...  # noqa: D102 (the BF16 prefix bank, kvreplay.experiments.fixed_prefix.FixedPrefixes)

    @property
    def by_id(self) -> dict[str, Problem]: ...  # noqa: D102

    @property
    def ledger_root(self) -> Path: ...  # noqa: D102

    def rows(self, n: int) -> list[Problem]: ...  # noqa: D102

    def upstream(self, key: str) -> LoadedLedger: ...  # noqa: D102

    def write_panel(self, name: str, *, sort_keys: bool = False, **doc: Any) -> Path: ...  # noqa: D102


@dataclasses.dataclass(frozen=True)
class Arm(Generic[R]):
    """The one declaration of an experiment arm (paper §3.9).

    Attributes:
        experiment: the ledger label's experiment (``exp1``, ``exp2``, ``exp2_controls``, ``exp3``-``exp5``).
        row: ``(spec, problem, plan) -> record``, the per-row function on the eager path.
        chunk: ``(spec, problems, plan) -> records``, the batched engine's per-chunk function (a
            :class:`~kvreplay.engine.Measured` list: the records with what the chunk's engines measured).
        key: the names of the entries the arm adds to its ledger key, beyond :meth:`ArmSettings.config`.
        prefixes: each problem needs its fixed BF16 boundary prefix (Experiments 2-5).
        live_check: below float32, sampled rows carry the ``live_equals_incremental`` gate (:func:`run_arm`).
        preflight: the chain parameter giving its preflight rows (``None``: none).
        prepare: ``(chain) -> plan`` under a session's parameters: panels frozen and written, upstream read.
        variants: ``(chain) -> plans`` for an arm run once per declared variant (the tie-rule control: one plan
            per rule of the profile's ``tie_rules``); ``None``: one plan, ``prepare``'s.
    """
    experiment: str
    row: Callable[[RunSpec, Problem, "ArmPlan[R]"], R]
    chunk: Callable[[RunSpec, Sequence[Problem], "ArmPlan[R]"], Measured[R]]
    prepare: Callable[[Chain], "ArmPlan[R]"]
    key: tuple[str, ...] = ()
    prefixes: bool = False
    live_check: bool = False
    preflight: str | None = "preflight"
    variants: Callable[[Chain], Sequence["ArmPlan[R]"]] | None = None

    @property
    def facts(self) -> ArmFacts:
        """Its facts as data (:data:`kvreplay.arm_facts.ARM_FACTS`): notebook, precisions, row algorithm, record.

        Raises:
            ValueError: none is declared for :attr:`experiment`."""
        return facts(self.experiment)

    @property
    def notebook(self) -> str:
        """The notebook that runs it, ``notebooks/<name>.ipynb`` (its facts')."""
        return f"notebooks/{self.facts.notebook}"

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The precisions the chain runs it at (its facts')."""
        return self.facts.dtypes

    def plans(self, chain: Chain) -> list["ArmPlan[R]"]:
        """Every plan of this arm under a session: :attr:`variants`' plans, else ``[prepare(chain)]``."""
        return list(self.variants(chain)) if self.variants is not None else [self.prepare(chain)]

    def plan(self, problems: Sequence[Problem], *, key: Mapping[str, Any] | None = None,
             prefixes: Mapping[str, Sequence[int]] | None = None, preflight: int | None = None,
             model: str | None = None, role_table: str | None = None,
             notes: Mapping[str, Any] | None = None) -> "ArmPlan[R]":
        """This arm bound to its inputs, checked before any row is decoded.

        Args:
            problems: the arm's problems in frozen order.
            key: the entries named by :attr:`key`, exactly those.
            prefixes: problem ID -> fixed boundary prefix z (token IDs), for an arm with :attr:`prefixes`.
            preflight, model, role_table: settings of the arm under a session (``None``: the session's).
            notes: what a notebook shows beside the run (a panel's path, a checkpoint).

        Raises:
            ValueError: key entries other than :attr:`key`, or prefixes given to an arm without them.
            GateError: ``provenance``, a problem without a fixed prefix.
        """
        given = dict(key or {})
        if set(given) != set(self.key):
            raise ValueError(f"arm {self.experiment}: its ledger key adds {sorted(self.key)}, got {sorted(given)}")
        if not self.prefixes and prefixes:
            raise ValueError(f"arm {self.experiment} takes no fixed prefixes")
        table = {pid: list(z) for pid, z in (prefixes or {}).items()}
        missing = [p.problem_id for p in problems if self.prefixes and p.problem_id not in table]
        if missing:
            raise GateError("provenance", f"prefix bank has no prefix for {missing}")
        return ArmPlan(self, tuple(problems), MappingProxyType({k: given[k] for k in self.key}),
                       MappingProxyType({p.problem_id: table[p.problem_id] for p in problems if self.prefixes}),
                       preflight, model, role_table, MappingProxyType(dict(notes or {})))

    def run(self, settings: ArmSettings, problems: Sequence[Problem], *, ledger_root: str | Path,
            key: Mapping[str, Any] | None = None, prefixes: Mapping[str, Sequence[int]] | None = None,
            progress: bool = True, faults: Hook | None = None) -> tuple[list[R], Ledger]:
        """:meth:`plan`, then :meth:`ArmPlan.run`: records and ledger (the errors of both)."""
        return self.plan(problems, key=key, prefixes=prefixes).run(settings, ledger_root=ledger_root,
                                                                   progress=progress, faults=faults)


@dataclasses.dataclass(frozen=True)
class ArmPlan(Generic[R]):
    """An :class:`Arm` bound to its inputs (built by :meth:`Arm.plan`).

    Attributes:
        arm: the declaration.
        problems: the problems in frozen order.
        key: the entries the arm adds to its ledger key.
        prefixes: problem ID -> fixed boundary prefix z (token IDs); empty for Experiment 1.
        preflight, model, role_table: the arm's settings under a session (``None``: the session's).
        notes: what a notebook shows beside the run; never sent to row actors.
    """
    arm: Arm[R]
    problems: tuple[Problem, ...]
    key: Mapping[str, Any]
    prefixes: Mapping[str, list[int]]
    preflight: int | None = None
    model: str | None = None
    role_table: str | None = None
    notes: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def experiment(self) -> str:
        """The arm's experiment (its ledger label's first part)."""
        return self.arm.experiment

    def prefix(self, problem: Problem) -> list[int]:
        """The fixed prefix z of one problem (token IDs)."""
        return self.prefixes[problem.problem_id]

    def prefixes_of(self, problems: Sequence[Problem]) -> list[list[int]]:
        """The fixed prefixes of a chunk's problems, in their order."""
        return [self.prefixes[p.problem_id] for p in problems]

    def _bare(self) -> "ArmPlan[R]":
        """This plan without its notes: what row functions (and Ray row actors) receive."""
        return dataclasses.replace(self, notes=MappingProxyType({})) if self.notes else self

    def row_function(self) -> Callable[[RunSpec, Problem], R]:
        """``(spec, problem) -> record``, the arm's row function bound to these inputs."""
        arm, plan = self.arm, self._bare()
        return lambda spec, problem: arm.row(spec, problem, plan)

    def chunk_function(self) -> Callable[[RunSpec, Sequence[Problem]], Measured[R]]:
        """``(spec, problems) -> records``, the arm's chunk function bound to these inputs."""
        arm, plan = self.arm, self._bare()
        return lambda spec, problems: arm.chunk(spec, problems, plan)

    def bind(self, settings: ArmSettings) -> ArmSettings:
        """The settings this plan runs under: a key entry named in :data:`SETTING_ENTRIES` sets that field.

        The tie-rule control keys ``tie_rule`` and ``top_logits``; its rows are decoded under them. The kernel
        attribution keys ``kernels``: its model is loaded under that execution-contract value. An entry of
        :data:`CAP_ENTRIES` sets that cap (the manipulated-length arm's ``cap_branch``)."""
        given: dict[str, Any] = {k: self.key[k] for k in SETTING_ENTRIES if k in self.key}
        caps = {field: self.key[k] for k, field in CAP_ENTRIES.items() if k in self.key}
        if caps:
            given["caps"] = dataclasses.replace(settings.caps, **caps)
        return dataclasses.replace(settings, **given) if given else settings

    def config(self, settings: ArmSettings) -> dict:
        """The scientific config that keys the arm's ledger: :meth:`ArmSettings.config` (of :meth:`bind`) plus
        :attr:`key`."""
        return self.bind(settings).config(self.experiment, self.problems) | dict(self.key)

    def label(self, settings: ArmSettings) -> str:
        """The ledger folder's name without its digest: ``<experiment>-<dtype>``."""
        return f"{self.experiment}-{settings.dtype}"

    def folder(self, settings: ArmSettings, ledger_root: str | Path) -> Path:
        """The arm's ledger folder, ``<ledger_root>/<profile>/<experiment>-<dtype>-<digest12>`` (nothing is read)."""
        return Ledger.folder(Path(ledger_root) / settings.profile, self.label(settings), self.config(settings))

    def run(self, settings: ArmSettings, *, ledger_root: str | Path, progress: bool = True,
            faults: Hook | None = None) -> tuple[list[R], Ledger]:
        """Run, resume or reuse the arm's ledger (:func:`~kvreplay.runner.run_arm`, with its errors).

        Raises:
            ValueError: ``settings.dtype`` is not one of the arm's precisions; an arm with preflight rows
                (``Arm.preflight``) given ``settings.preflight < 1`` below float32, as the profile refuses it; and
                those of :func:`run_arm`.
        """
        if settings.dtype not in self.arm.dtypes:
            raise ValueError(f"arm {self.experiment} runs at {', '.join(self.arm.dtypes)}, not {settings.dtype}")
        if self.arm.preflight is not None and settings.preflight < 1 and settings.dtype != "float32":
            raise ValueError(f"arm {self.experiment} {settings.dtype}: preflight {settings.preflight} would switch off "
                             "the construction checks of a run below float32 and the abort on a failed preflight row "
                             f"(the profile's {self.arm.preflight!r} refuses it too); use 1 or more")
        settings = self.bind(settings)
        return run_arm(self.experiment, settings, self.problems, self.row_function(), ledger_root=ledger_root,
                       extra_config=dict(self.key), progress=progress, faults=faults, chunk=self.chunk_function(),
                       live_check=self.arm.live_check)
