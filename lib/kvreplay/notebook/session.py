"""One setup call for a notebook of the chain: its parameters, problems, caps, arm settings, upstream ledgers and outputs.

Every notebook (00-08) has the same ``parameters`` cell, ``profile = "smoke"``
and ``overrides = {}`` (papermill injects other values below it), and starts ::

    session = open_session("notebooks/02_experiment2_fixed_prefix_precision.ipynb", profile, overrides)
    p = session.params

which resolves the two into the chain's parameters
(:func:`kvreplay.notebook.profiles.load_parameters`: names, types and the ``execution``
contract checked before anything is read). It prints the values that matter and
returns a :class:`Session`. A session holds the parameters, the problem bank (read when first
used), the caps, the ledger, figure and checkpoint folders, and
:meth:`Session.settings` for an arm. It also gives the fixed BF16 prefix bank of Experiments
2-5, upstream ledgers found by provenance (:meth:`Session.upstream`; never
re-run) and frozen panels (:meth:`Session.write_panel`). Tables and figures are
saved under the profile's figure folder with their captions and producing
notebook.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd

from .. import paths
from ..adapt import AdaptConfig, Criterion
from ..decoding.contract import Caps
from ..experiments.fixed_prefix import FixedPrefixes, load_fixed_prefixes
from ..ledger.lookup import PREFIX_BANK, LoadedLedger, find_chain_ledger
from ..ledger.files import atomic_write, read_environment
from ..ledger.prefix_bank import write_prefix_bank
from ..ledger.records import Exp1Record
from ..runner.heartbeat import Heartbeat
from ..ledger.store import TERMINAL_PROGRESS, Ledger, unchanged_when_read_only
from ..model.models import EMBEDDED_MODELS, LoadedModel, ModelLoadError, check_model, context_length, load_model
from ..data.problems import Problem, load_bank, load_problems
from .profiles import DEFAULT_PROFILE, AdaptRecipe, ChainParameters, describe, load_parameters
from ..report.files import contract_frame, save_figure, save_table
from ..report.summary import TABLE_CAPTIONS
from ..runner import ENGINE_KEYS, Arm, ArmPlan, ArmSettings, resolve_execution

R = TypeVar("R", bound=Mapping[str, Any])

SHARED_CHECKPOINT_PROFILES = ("cpu", "gpu", "paper", "gemma", "smoke", "gemma_smoke")
"""Profiles shipped in ``notebooks/params/`` whose role-table folders lie directly under ``data/checkpoints/`` (the
committed ones, and the smoke profiles' ignored ``role-table-smoke-*``); any other profile's go to
``data/checkpoints/<profile>/`` (:attr:`Session.checkpoint_root`)."""

WHOLE_TABLES = {"display.max_rows": None, "display.max_columns": None, "display.max_colwidth": None}
"""pandas display options :func:`open_session` sets: a notebook shows every row, column and whole cell text of a
table (executed copies and their HTML are read, not scrolled in a kernel; pandas would cut at 60 rows and 50
characters)."""


@dataclasses.dataclass
class Session:
    """What a notebook works with, built once from its parameters.

    Attributes:
        notebook: the notebook's path from the repository root (named in every table and figure it saves).
        params: the chain's parameters, resolved from the notebook's ``profile`` and ``overrides`` (frozen).
        execution: the execution contract, every key of :data:`~kvreplay.runner.EXECUTION_KEYS`: the
            ``execution`` parameter over :data:`~kvreplay.runner.EXECUTION_DEFAULTS`, checked.
    """
    notebook: str
    params: ChainParameters
    execution: dict
    _training_model: LoadedModel | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def profile(self) -> str:
        """The profile label (``smoke``, ``cpu``, ``gpu``, ``paper``): the ledger and figure folders' name."""
        return self.params.profile

    @property
    def caps(self) -> Caps:
        """The branch / merge / answer token caps."""
        return Caps(branch=self.params.cap_branch, merge=self.params.cap_merge, answer=self.params.cap_answer)

    @property
    def ledger_root(self) -> Path:
        """The folder holding ``<profile>/`` ledger folders (``ledger_root``, default ``data/ledgers``)."""
        return Path(self.params.ledger_root) if self.params.ledger_root else paths.LEDGERS

    @property
    def out_dir(self) -> Path:
        """``<figures_root>/<profile>``, where tables and figures go (``figures_root`` default: ``figures``)."""
        return (Path(self.params.figures_root) if self.params.figures_root else paths.FIGURES) / self.profile

    @property
    def checkpoint_root(self) -> Path:
        """The role-table checkpoint folders: ``checkpoint_root`` when set. Else ``data/checkpoints`` for the
        profiles shipped with the repository (:data:`SHARED_CHECKPOINT_PROFILES`, whose committed pointers name
        folders there), and ``data/checkpoints/<profile>`` for any other: a profile of your own never writes
        beside the committed folders under look-alike names."""
        if self.params.checkpoint_root:
            return Path(self.params.checkpoint_root)
        return paths.CHECKPOINTS if self.profile in SHARED_CHECKPOINT_PROFILES else paths.CHECKPOINTS / self.profile

    @functools.cached_property
    def bank(self) -> list[Problem]:
        """The problems in frozen source order (the MMLU bank, or a JSONL in its format), read on first use.

        Raises:
            FileNotFoundError, MalformedProblemError, BankIntegrityError: the problem set cannot be read.
        """
        problems = self.params.problems
        return load_bank() if problems == "bank" else load_problems(problems)

    @property
    def by_id(self) -> dict[str, Problem]:
        """Problem ID -> problem."""
        return {p.problem_id: p for p in self.bank}

    def rows(self, n: int) -> list[Problem]:
        """The first ``n`` problems of the bank (frozen order).

        Raises:
            ValueError: ``n`` is larger than the bank.
        """
        if n > len(self.bank):
            raise ValueError(f"{self.notebook}: n_rows={n} but the problem set has {len(self.bank)} problems")
        return self.bank[:n]

    def settings(self, dtype: str, preflight: int, *, model: str | None = None, role_table: str | None = None,
                 batched: bool = True) -> ArmSettings:
        """The :class:`~kvreplay.runner.ArmSettings` of one arm under these parameters (model, format, role table,
        caps, execution contract, the share of rows whose live boundary is checked).

        Args:
            dtype: ``"bfloat16"`` or ``"float32"``.
            preflight: preflight rows of the arm (a gate failure there aborts it).
            model, role_table: override the parameters' (Experiment 5's later checkpoint).
            batched: ``False`` for an experiment without a batched runner: the contract's ``step_path``,
                ``batch``, ``max_len``, ``chunk`` and ``attention`` are left out (the eager reference path).
        """
        kw: dict[str, Any] = {"model": self.params.model, "fmt": self.params.format,
                              "role_table": self.params.role_table}
        kw |= {k: v for k, v in self.execution.items() if batched or k not in ENGINE_KEYS}
        if model is not None:
            kw["model"] = model
        if role_table is not None:
            kw["role_table"] = role_table
        return ArmSettings(profile=self.profile, dtype=dtype, caps=self.caps, preflight=preflight,
                           live_check_fraction=self.params.live_check_fraction,
                           top_logits=self.params.record_top_logits, **kw)

    def plan(self, arm: Arm[R]) -> ArmPlan[R]:
        """An arm under these parameters: its problems, prefixes and key entries; its panel frozen and written first.

        Raises:
            whatever the arm's ``prepare`` raises before any row is decoded (a missing prefix bank or upstream
            ledger, ``ReadOnlyLedgerError`` for a panel that would change, a checkpoint that cannot be resolved).
        """
        return arm.prepare(self)

    def plans(self, arm: Arm[R]) -> list[ArmPlan[R]]:
        """Every plan of an arm under these parameters (:meth:`~kvreplay.runner.Arm.plans`): one, or one per variant.

        The tie-rule control gives one plan per rule of ``tie_rules`` (none when it is empty)."""
        return arm.plans(self)

    def arm_settings(self, plan: ArmPlan[Any], dtype: str) -> ArmSettings:
        """The :class:`~kvreplay.runner.ArmSettings` of a planned arm at one precision (:meth:`settings`).

        The preflight rows are the plan's, else the parameter the arm names (``Arm.preflight``), else none.
        """
        preflight = plan.preflight
        if preflight is None:
            preflight = getattr(self.params, plan.arm.preflight) if plan.arm.preflight else 0
        return self.settings(dtype, preflight, model=plan.model, role_table=plan.role_table)

    def run(self, arm: Arm[R] | ArmPlan[R], dtype: str, *, progress: bool = True) -> tuple[list[R], Ledger]:
        """Run, resume or reuse one arm at one precision under these parameters: its records and ledger.

        Args:
            arm: an arm's declaration (planned here: :meth:`plan`) or its plan.
            dtype: ``"bfloat16"`` or ``"float32"`` (one of the arm's precisions).

        Raises:
            ValueError: a precision the arm does not run at; and the errors of :meth:`plan` and
                :func:`~kvreplay.runner.run_arm` (gates, bad problems, read-only ledgers).

        Under ``make paper`` (:data:`~kvreplay.ledger.store.TERMINAL_PROGRESS`) an arm still running after a minute
        prints a line a minute on the terminal with its phase and step (:class:`~kvreplay.runner.heartbeat.Heartbeat`).
        """
        plan = arm if isinstance(arm, ArmPlan) else self.plan(arm)
        if progress and os.environ.get(TERMINAL_PROGRESS) == "1" and sys.__stderr__ is not None:
            # make paper's terminal (never the notebook, whose executed copy stays byte-identical): a line a minute
            with Heartbeat(f"{plan.arm.experiment}-{dtype}", stream=sys.__stderr__):
                return plan.run(self.arm_settings(plan, dtype), ledger_root=self.ledger_root, progress=progress)
        return plan.run(self.arm_settings(plan, dtype), ledger_root=self.ledger_root, progress=progress)

    def write_prefix_bank(self, records: Sequence[Exp1Record], ledger: Ledger) -> tuple[Path, str]:
        """Freeze the boundary prefixes of :data:`~kvreplay.arm_facts.PREFIX_BANK_SOURCE`'s finished rows into this
        profile's prefix bank, the one Experiments 2-5 read (:meth:`fixed`); notebook 01 and
        ``scripts/gpu_profile.py`` write it this way.

        Returns:
            the bank's path and its sha256.

        Raises:
            the errors of :func:`~kvreplay.ledger.prefix_bank.write_prefix_bank` (a failed row, a bank that would
            change under ``KV_LEDGERS_READ_ONLY``).
        """
        path = self.ledger_root / self.profile / PREFIX_BANK
        return path, write_prefix_bank(records, path, ledger.dir.name)

    @functools.cached_property
    def fixed(self) -> FixedPrefixes:
        """The BF16 prefix bank of notebook 01 joined to the problems (digest and order checked).

        Raises:
            FileNotFoundError: notebook 01 has not written the bank for this profile.
            GateError: gate ``provenance`` (see :func:`~kvreplay.experiments.fixed_prefix.load_fixed_prefixes`).
        """
        return load_fixed_prefixes(self.ledger_root / self.profile / PREFIX_BANK, self.bank)

    def upstream(self, key: str) -> LoadedLedger:
        """A finished upstream ledger of this profile's chain, found by provenance (nothing is re-run).

        Args:
            key: ``<experiment>-<dtype>``, e.g. ``"exp2-bfloat16"``.

        Raises:
            MissingLedgerError: the ledger is missing, unfinished or ambiguous; names the notebook that writes it.
        """
        return find_chain_ledger(self.ledger_root, self.profile, key)

    def adapt_config(self, recipe: AdaptRecipe) -> AdaptConfig:
        """A role-table training config of notebook 00: ``recipe``'s values over the profile's ``adapt_*`` ones
        (:meth:`~kvreplay.notebook.profiles.ChainParameters.recipe`), its model, format and seed. Training runs in FP32 on the
        CPU whatever the device, under the ``execution`` contract's threads and SDPA backends.

        Raises:
            ValueError: checkpoints not ``0 < early < later <= steps``, or a non-positive size.
        """
        p, ex, r = self.params, self.execution, self.params.recipe(recipe)
        return AdaptConfig(name=r["name"], model=p.model, fmt=p.format, source=p.adapt_source,
                           n_train=r["n_train"], n_heldout=p.adapt_n_heldout, steps=r["steps"],
                           batch=r["batch"], lr=r["lr"], checkpoints=r["checkpoints"],
                           eval_every=p.adapt_eval_every, seed=p.adapt_seed, threads=ex["threads"],
                           sdpa_backends=tuple(ex["sdpa_backends"]), letter_balanced=r["letter_balanced"])

    def adapt_recipes(self) -> list[AdaptConfig]:
        """The training configs of notebook 00's recipe search (``adapt_selection.recipes``), in the profile's order."""
        return [self.adapt_config(r) for r in self.params.adapt_selection.recipes]

    def adapt_criterion(self) -> Criterion:
        """The recipe search's criterion as the profile declares it (``adapt_selection``)."""
        s = self.params.adapt_selection
        return Criterion(s.n_heldout, s.max_letter_share, s.min_accuracy)

    def training_model(self) -> LoadedModel:
        """The base model in float32 on the CPU under the training contract (:meth:`adapt_recipes`' threads and SDPA backends),
        for notebook 00's training and letter metric: loaded on the first call only (a notebook whose checkpoints and
        ledger exist loads none).

        Raises:
            ModelLoadError: the model cannot be loaded offline.
        """
        if self._training_model is None:
            self._training_model = load_model(self.params.model, "float32", contract=self.adapt_recipes()[0].contract())
        return self._training_model

    def write_panel(self, name: str, *, sort_keys: bool = False, **doc) -> Path:
        """Write a frozen panel, ``<ledger_root>/<profile>/<name>.json``, before anything on it is decoded.

        The one writer of panel files (notebooks 03-05). ``doc`` holds the rule and the chosen problem IDs
        (and whatever else defines the panel, e.g. :func:`kvreplay.experiments.replication.panel_doc`); it
        is written as indented JSON, keys in the order given or, with ``sort_keys``, sorted.

        Raises:
            ReadOnlyLedgerError: :data:`~kvreplay.ledger.store.READ_ONLY_ENV` is ``1`` and the file would change or
                be created (``make paper`` on a profile computed on a GPU; with the same bytes there, nothing is
                written).
        """
        path = self.ledger_root / self.profile / f"{name}.json"
        text = json.dumps(doc, indent=1, sort_keys=sort_keys) + "\n"
        if unchanged_when_read_only({path: text}, "this frozen panel"):  # make paper on a profile computed elsewhere
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, text)  # never a partial panel after a full disk or a kill
        return path

    def save_table(self, df: pd.DataFrame, stem: str, caption: str | None = None) -> list[Path]:
        """Save ``df`` as ``<out_dir>/<stem>.csv/.md/.tex`` (caption: :data:`~kvreplay.report.summary.TABLE_CAPTIONS` by default)."""
        return save_table(df, self.out_dir / stem, caption=caption or TABLE_CAPTIONS[stem], source=self.notebook)

    def save_figure(self, fig, stem: str) -> list[Path]:
        """Save ``fig`` as ``<out_dir>/<stem>.png/.pdf`` and show it inline."""
        return save_figure(fig, self.out_dir / stem, source=self.notebook)

    def contract(self, ledgers: Mapping[Any, Ledger | LoadedLedger]) -> pd.DataFrame:
        """The execution contracts the arms ran under, one column per label (from each ledger's ``environment.json``).

        Args:
            ledgers: column label (e.g. a precision, ``"bfloat16"``) -> the arm's ledger.
        """
        return contract_frame({label: read_environment(ledger.dir) for label, ledger in ledgers.items()})


def open_session(notebook: str, profile: str | Path = DEFAULT_PROFILE, overrides: Mapping[str, Any] | None = None, *,
                 quiet: bool = False) -> Session:
    """Build a notebook's :class:`Session` from its two parameters, print the resolved values that matter, and set
    pandas to show tables whole (:data:`WHOLE_TABLES`).

    Args:
        notebook: the notebook's path from the repository root, e.g. ``"notebooks/01_experiment1_live_vs_prefill.ipynb"``.
        profile: the notebook's ``profile`` parameter: a profile name (``notebooks/params/<name>.yaml``) or a YAML path.
        overrides: the notebook's ``overrides`` parameter: parameter name -> value, over the profile's.
        quiet: do not print the one-line summary (:func:`kvreplay.notebook.profiles.describe`).

    Raises:
        ValueError: naming the notebook: its path is not under ``notebooks/``, or the parameters are refused
            (:func:`~kvreplay.notebook.profiles.load_parameters`: an unknown name with the closest known one, a value of the
            wrong type, or an execution contract :func:`~kvreplay.runner.resolve_execution` refuses), before
            anything is read.
        FileNotFoundError: no such profile.
    """
    if not notebook.startswith("notebooks/"):
        raise ValueError(f"notebook path {notebook!r} is not under notebooks/")
    try:
        params = load_parameters(profile, overrides)
    except ValueError as e:
        raise ValueError(f"{notebook}: {e}") from None
    session = Session(notebook, params, resolve_execution(notebook, params.execution))
    for option, value in WHOLE_TABLES.items():
        pd.set_option(option, value)
    if not quiet:
        print(describe(params, profile, overrides))
    return session


def _longest(sequences) -> tuple[int, str]:
    """The longest of ``(tokens, what)`` pairs (``(0, "")`` for none)."""
    return max(sequences, default=(0, ""), key=lambda x: x[0])


def check_profile_model(params: ChainParameters) -> str:
    """Check a profile's models when the profile is read, before any weight is loaded or anything trains.

    Each of ``model`` and ``replication_model`` must pass :func:`~kvreplay.model.models.check_model` (found offline, a
    readable config, a causal decoder, a plain key/value cache, SDPA). A model that is not embedded must also hold
    every sequence of the chain within ``max_position_embeddings``. Its tokenizer and the block format are built, and
    every row's longest full sequence counted (prompt + delimiters + caps, the manipulated-length arm's largest
    branch cap included). Notebook 00's role-table sequences of every recipe are counted as well.

    Returns:
        one line saying what was checked (model, positions needed and available).

    Raises:
        ModelLoadError: naming the model, the rule it breaks and what to change; or an error of the problem set or
            block format (file and line, the format's rule).
    """
    from ..adapt import balance_letters, build_staged, heldout_rows, load_source, split_problems
    from ..decoding.contract import resolve_format
    from ..model.models import load_tokenizer, read_config

    models = [m for m in (params.model, params.replication_model) if m is not None]
    configs = {m: check_model(m) for m in models}
    model = params.model
    if model in EMBEDDED_MODELS:
        return f"model {model}: embedded, digest-checked at load"
    limit = context_length(configs[model] if configs[model] is not None else read_config(model))
    if limit is None:
        return f"model {model}: a causal decoder with a plain KV cache (its config states no context length)"
    fmt = resolve_format(load_tokenizer(model), params.format)
    bank = load_bank() if params.problems == "bank" else load_problems(params.problems)
    branch = max((params.cap_branch, *params.length_branch_caps))
    caps = Caps(branch=branch, merge=params.cap_merge, answer=params.cap_answer)
    rows = bank[:max(params.n_rows, params.n_adapt_eval)]
    need = 0
    for name in models:  # the chain's rows, and Experiment 5's on a replication model of your own
        if name in EMBEDDED_MODELS:
            continue
        config = configs[name]
        positions = limit if name == model else context_length(config) if config is not None else None
        if positions is None:
            continue
        form = fmt if name == model else resolve_format(load_tokenizer(name), params.format)
        longest_row, what = _longest((form.max_sequence_length(len(form.prompt_ids(p.question, p.options)), caps),
                                      f"problem {p.problem_id} ({p.where})") for p in rows)
        if longest_row > positions:
            raise ModelLoadError(
                f"model {name!r} has {positions} positions (max_position_embeddings) but profile {params.profile!r} "
                f"needs {longest_row}: {what}, prompt + delimiters + 3 x branch cap {branch} + merge cap "
                f"{params.cap_merge} + answer cap {params.cap_answer}. Lower the caps, use a problem set of shorter "
                "questions, or a model with a longer context")
        need = max(need, longest_row) if name == model else need
    trains = params.replication_model is None
    if trains:  # notebook 00 trains and scores role tables on whole staged sequences (no caps)
        source, _ = load_source(params.adapt_source)
        staged = []
        for recipe in params.adapt_selection.recipes:
            r = params.recipe(recipe)
            train, held = split_problems(source, r["n_train"], params.adapt_n_heldout)
            staged += [*(balance_letters(train) if r["letter_balanced"] else train), *held]
        mmlu, _ = load_source("mmlu")
        mmlu_bank = bank if params.problems == "bank" else load_bank()  # notebook 00 scores the MMLU bank
        staged += [*heldout_rows(mmlu, mmlu_bank, params.adapt_selection.n_heldout), *mmlu_bank[:params.n_adapt_eval]]
        seen = {(p.problem_id, p.options): p for p in staged}  # a letter-balanced row: the same ID, options rotated
        longest, where = _longest((len(build_staged(fmt, p).ids), f"{p.problem_id} ({p.where})") for p in seen.values())
        if longest > limit:
            raise ModelLoadError(
                f"model {model!r} has {limit} positions (max_position_embeddings) but notebook 00's role-table "
                f"training of profile {params.profile!r} builds a {longest}-token sequence ({where}). Use a model with "
                "a longer context, or give replication_model (and its role table) so that notebook 00 trains nothing")
        need = max(need, longest)
    return (f"model {model}: a causal decoder with a plain KV cache; the longest sequence needs {need} of its {limit} "
            f"positions{' (notebook 00 included)' if trains else ''}")
