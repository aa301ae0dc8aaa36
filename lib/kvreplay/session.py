"""One setup call for an experiment notebook: its parameters, problems, caps, arm settings, upstream ledgers and outputs.

Every experiment notebook (01-05) starts the same way: its ``parameters``
cell (papermill injects a profile's values below it) is followed by ::

    session = open_session("notebooks/02_experiment2_fixed_prefix_precision.ipynb", globals())

which reads the declared parameters out of the notebook's namespace, checks
the ``execution`` parameter (the execution contract: a mapping over
:data:`~kvreplay.runner.EXECUTION_DEFAULTS`, see :func:`~kvreplay.runner.resolve_execution`)
and returns a :class:`Session`: the frozen problem bank, the caps, the ledger and
figure folders, :meth:`Session.settings` for an arm, the fixed BF16 prefix
bank of Experiments 2-5, upstream ledgers found by provenance
(:meth:`Session.upstream`; never re-run), frozen panels
(:meth:`Session.write_panel`) and tables and figures saved under the
profile's figure folder with their captions and producing notebook.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from . import paths
from .contract import Caps
from .experiments.fixed_prefix import FixedPrefixes, load_fixed_prefixes
from .ledger.lookup import PREFIX_BANK, LoadedLedger, find_chain_ledger
from .ledger.store import Ledger
from .problems import Problem, load_bank, load_problems
from .report.files import contract_frame, save_figure, save_table
from .report.summary import TABLE_CAPTIONS
from .runner import ArmSettings, resolve_execution

SETTINGS_PARAMETERS = {"model": "model", "format": "fmt", "role_table": "role_table"}
"""Notebook parameter -> :class:`~kvreplay.runner.ArmSettings` field, passed to every arm when the notebook declares
it; the execution contract's fields come from the ``execution`` parameter (:attr:`Session.execution`)."""

ENGINE_KEYS = ("step_path", "batch", "max_len", "chunk")
"""Execution-contract keys that drive the batched engine (left out of an arm without a batched runner)."""

REQUIRED = ("profile", "problems", "cap_branch", "cap_merge", "cap_answer", "execution", "ledger_root", "figures_root")
"""Parameters every experiment notebook declares."""


@dataclasses.dataclass
class Session:
    """What an experiment notebook works with, built once from its parameters.

    Attributes:
        notebook: the notebook's path from the repository root (named in every table and figure it saves).
        params: the notebook's declared parameters (name -> value), as injected.
        profile: the profile name (``smoke``, ``cpu``, ``gpu``, ``paper``).
        caps: the branch / merge / answer token caps.
        ledger_root: the folder holding ``<profile>/`` ledger folders.
        out_dir: ``<figures_root>/<profile>``, where tables and figures go.
        bank: the problems in frozen source order (the MMLU bank, or a JSONL in its format).
        execution: the execution contract, every key of :data:`~kvreplay.runner.EXECUTION_KEYS`: the
            ``execution`` parameter over :data:`~kvreplay.runner.EXECUTION_DEFAULTS`, checked.
    """
    notebook: str
    params: dict
    profile: str
    caps: Caps
    ledger_root: Path
    out_dir: Path
    bank: list[Problem]
    execution: dict

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
        """The :class:`~kvreplay.runner.ArmSettings` of one arm under this notebook's parameters.

        Args:
            dtype: ``"bfloat16"`` or ``"float32"``.
            preflight: preflight rows of the arm (a gate failure there aborts it).
            model, role_table: override the notebook's (Experiment 5's later checkpoint).
            batched: ``False`` for an experiment without a batched runner: the contract's ``step_path``,
                ``batch``, ``max_len`` and ``chunk`` are left out (the eager reference path).
        """
        kw = {field: self.params[name] for name, field in SETTINGS_PARAMETERS.items() if name in self.params}
        kw |= {k: v for k, v in self.execution.items() if batched or k not in ENGINE_KEYS}
        if model is not None:
            kw["model"] = model
        if role_table is not None:
            kw["role_table"] = role_table
        return ArmSettings(profile=self.profile, dtype=dtype, caps=self.caps, preflight=preflight, **kw)

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

    def write_panel(self, name: str, **doc) -> Path:
        """Write a frozen panel, ``<ledger_root>/<profile>/<name>.json``, before anything on it is decoded.

        ``doc`` holds the rule and the chosen problem IDs (and whatever else defines the panel); it is
        written as indented JSON with keys in the order given.
        """
        path = self.ledger_root / self.profile / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        return path

    def save_table(self, df: pd.DataFrame, stem: str, caption: str | None = None) -> list[Path]:
        """Save ``df`` as ``<out_dir>/<stem>.csv/.md/.tex`` (caption: :data:`~kvreplay.report.summary.TABLE_CAPTIONS` by default)."""
        return save_table(df, self.out_dir / stem, caption=caption or TABLE_CAPTIONS[stem], source=self.notebook)

    def save_figure(self, fig, stem: str) -> list[Path]:
        """Save ``fig`` as ``<out_dir>/<stem>.png/.pdf`` and show it inline."""
        return save_figure(fig, self.out_dir / stem, source=self.notebook)

    def contract(self, ledgers: Mapping[str, Ledger | LoadedLedger]) -> pd.DataFrame:
        """The execution contracts the arms ran under, one column per label (from each ledger's ``environment.json``)."""
        return contract_frame({label: json.loads((ledger.dir / "environment.json").read_text()) for label, ledger in ledgers.items()})


def open_session(notebook: str, namespace: Mapping[str, object]) -> Session:
    """Build a notebook's :class:`Session` from the names its ``parameters`` cell declares.

    Args:
        notebook: the notebook's path from the repository root, e.g. ``"notebooks/01_experiment1_live_vs_prefill.ipynb"``.
        namespace: the notebook's ``globals()``; only the parameter names are read.

    Raises:
        ValueError: a required parameter is missing (named), the notebook's path is not under ``notebooks/``,
            or the ``execution`` parameter is refused (:func:`~kvreplay.runner.resolve_execution`: an
            unknown key or a value of the wrong kind, named with the notebook, before anything is read).
        FileNotFoundError, MalformedProblemError, BankIntegrityError: the problem set cannot be read.
    """
    if not notebook.startswith("notebooks/"):
        raise ValueError(f"notebook path {notebook!r} is not under notebooks/")
    declared = set(REQUIRED) | set(SETTINGS_PARAMETERS)
    params = {k: namespace[k] for k in declared if k in namespace}
    missing = [k for k in REQUIRED if k not in params]
    if missing:
        raise ValueError(f"{notebook}: parameters {missing} are not set (the parameters cell declares them)")
    execution = resolve_execution(notebook, params["execution"])
    problems = params["problems"]
    bank = load_bank() if problems == "bank" else load_problems(problems)
    ledger_root = Path(params["ledger_root"]) if params["ledger_root"] else paths.LEDGERS
    out_dir = (Path(params["figures_root"]) if params["figures_root"] else paths.FIGURES) / params["profile"]
    caps = Caps(branch=params["cap_branch"], merge=params["cap_merge"], answer=params["cap_answer"])
    return Session(notebook, params, params["profile"], caps, ledger_root, out_dir, bank, execution)
