"""The chain's parameters, defined once: a typed model, and the profiles that set them.

Every notebook of the chain (00-08) starts with the same two parameters ::

    profile = "smoke"   # which notebooks/params file
    overrides = {}      # values replacing the profile's

and its setup call (:func:`kvreplay.notebook.session.open_session`) resolves them with
:func:`load_parameters` into one frozen :class:`ChainParameters`: the profile's
base, then the profile file's values, then ``overrides``, each name and
type checked before any model or data is read. ``make paper``
(:mod:`kvreplay.paper`) and ``scripts/gpu_profile.py`` pass the same two
values, so a parameter has one name, one type and one default, here.

The field defaults are the ``smoke`` profile (``notebooks/params/smoke.yaml``; a
test keeps the two equal), so a notebook opened and run as is runs in minutes.
A parameter a profile file leaves out comes from its **base** (:func:`base_of`):
the profile named by its ``base:`` key, else ``cpu`` (the committed laptop-scale
run), except for ``smoke`` and ``cpu`` themselves, whose base is the field defaults.
"""

from __future__ import annotations

import difflib
import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..model import kernels
from ..decoding.settings import parse_rule
from ..paths import PARAMS, ROOT
from ..runner import EXECUTION_KEYS, resolve_execution
from ..runner.spec import LIVE_CHECK_FRACTION

PROFILE_KEYS = ("notebooks", "done", "base")
"""Profile keys that are not chain parameters: the notebooks ``make paper`` runs (read by :mod:`kvreplay.paper`),
the rows finished per arm (a record for the reader) and the profile whose values fill what the file leaves out
(:func:`base_of`). :func:`load_parameters` skips them as parameters."""

DEFAULT_BASE = "cpu"
"""The base of a profile file without a ``base:`` key (a user's own profile): the committed ``cpu`` profile's values."""

FIELD_DEFAULTS = "defaults"
"""The base that means :class:`ChainParameters`' field defaults (the ``smoke`` values): that of ``smoke`` and ``cpu``."""

DEFAULTS_BASED = ("smoke", "cpu")
"""Profiles resolved over the field defaults when their file names no ``base:`` (``cpu`` lists what it changes)."""

DEFAULT_PROFILE = "smoke"
"""The profile a notebook opened as is runs (its ``profile`` parameter's default)."""

SEED = 20260729

KERNEL_VALUES = ("default", "invariant", "invariant-except-attention")
"""The kernel attribution's values where a profile lists none (``kernel_values``' default): those of
:data:`KERNEL_CONTRASTS`."""
KERNEL_CONTRASTS = (("default", "invariant"), ("default", "invariant-except-attention"),
                    ("invariant-except-attention", "invariant"))
"""The kernel attribution's primary contrasts (``kernel_contrasts``' default): every class in its default order
against none, attention alone in its default order against none, and every class against attention alone."""
MIN_HELDOUT = 100
"""Held-out selection rows (``adapt_selection.n_heldout``) a profile's recipe search needs at least, when the profile
scores the bank on that many rows or more (``n_adapt_eval``): a profile whose checkpoint numbers are results. A toy
profile (``smoke``, ``gemma_smoke``: 4 bank rows) only checks that the chain runs, and may select on fewer."""

RECIPE_KEYS = ("n_train", "steps", "lr", "batch", "letter_balanced", "checkpoints")
"""What a recipe may set besides its name; each key it leaves out takes the ``adapt_<key>`` parameter."""


class _Block(BaseModel):
    """A typed mapping inside a profile: frozen, strict, and an unknown key refused with the closest known one."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, value):
        if isinstance(value, Mapping):
            unknown = [k for k in value if k not in cls.model_fields]
            if unknown:
                hints = {k: difflib.get_close_matches(str(k), list(cls.model_fields), n=1) for k in unknown}
                named = ", ".join(f"{k!r}" + (f" (did you mean {hints[k][0]!r}?)" if hints[k] else "") for k in unknown)
                raise ValueError(f"{named}: not a key of {cls.__name__} (keys: {', '.join(cls.model_fields)})")
        return value


class AdaptRecipe(_Block):
    """One role-table training recipe of the search: a name and what it changes of the ``adapt_*`` parameters."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9.-]*$", description="the recipe's label: its checkpoint folder is "
                      "role-table-<name>-<digest12> (lower case, digits, '.', '-'), unique, not 'ckpt0'")
    n_train: int | None = Field(None, ge=1, description="training rows (left out: adapt_n_train)")
    steps: int | None = Field(None, ge=1, description="optimizer steps (left out: adapt_steps)")
    lr: float | None = Field(None, gt=0, description="learning rate (left out: adapt_lr)")
    batch: int | None = Field(None, ge=1, description="sequences per step (left out: adapt_batch)")
    letter_balanced: bool | None = Field(None, description="letter-balanced training rows (left out: "
                                         "adapt_letter_balanced)")
    checkpoints: tuple[int, int] | None = Field(None, description="[early, later] steps (left out: adapt_checkpoints; "
                                                "a recipe that changes steps gives them)")

    @field_validator("checkpoints", mode="before")
    @classmethod
    def _list_as_tuple(cls, value):
        return tuple(value) if isinstance(value, list) else value


class AdaptSelection(_Block):
    """Notebook 00's recipe search, declared before any recipe is evaluated (:mod:`kvreplay.adapt.selection`)."""

    n_heldout: int = Field(ge=1, description="held-out selection rows: MMLU rows after the bank in its frozen order, "
                           f"disjoint from it; at least {MIN_HELDOUT} when n_adapt_eval is {MIN_HELDOUT} or more")
    max_letter_share: float = Field(gt=0, le=1, description="largest share of held-out predictions one letter may take")
    min_accuracy: Literal["checkpoint0"] = Field("checkpoint0", description="held-out accuracy a recipe must reach: "
                                                 "checkpoint 0's (rows correct)")
    recipes: tuple[AdaptRecipe, ...] = Field(min_length=1, description="the recipes tried, in the order that breaks ties")

    @field_validator("recipes", mode="before")
    @classmethod
    def _list_as_tuple(cls, value):
        return tuple(value) if isinstance(value, list) else value

    @model_validator(mode="after")
    def _names(self):
        names = [r.name for r in self.recipes]
        if len(set(names)) != len(names) or "ckpt0" in names:
            raise ValueError(f"recipe names must be unique and not 'ckpt0', got {names}")
        return self


SMOKE_SELECTION = AdaptSelection(n_heldout=2, max_letter_share=0.6, recipes=(
    AdaptRecipe(name="smoke"), AdaptRecipe(name="smoke-balanced", letter_balanced=True)))
"""The ``smoke`` profile's recipe search (the field default): the base recipe, and the same letter-balanced."""


class ChainParameters(BaseModel):
    """Every parameter of the notebook chain, with its type and its default (the ``smoke`` profile's value).

    Frozen: a notebook reads its resolved values (``session.params.n_rows``) and cannot change them on the way.
    Unknown names are refused (``extra="forbid"``); values are checked strictly (``"4"`` is not a whole number).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    profile: str = Field(DEFAULT_PROFILE, description="profile label: the ledger folder <ledger_root>/<profile>/ and the "
                         "figure folder <figures_root>/<profile>/ (the profile file's name)")
    # the model and the problems
    model: str = Field("embedded", description='the chain\'s base model (checkpoint 0 of the family): "embedded", a local '
                       "HF folder, a .gguf file, or a cached hub id")
    problems: str = Field("bank", description='"bank" (the frozen MMLU bank) or a path to a JSONL in the bank\'s format')
    format: str = Field("chat_multibranch", description="the block format (kvreplay.decoding.contract.resolve_format)")
    role_table: str | None = Field(None, description="checkpoint 0's role-table file (None: zero role rows)")
    # the protocol
    cap_branch: int = Field(8, ge=1, description="token cap of each branch block (paper: 768)")
    cap_merge: int = Field(8, ge=1, description="token cap of the merge block (paper: 512)")
    cap_answer: int = Field(4, ge=1, description="token cap of the answer block (paper: 64)")
    precisions: tuple[Literal["bfloat16", "float32"], ...] = Field(
        ("bfloat16", "float32"), min_length=1, description="the precisions of Experiments 1 and 2 (paper: both)")
    execution: dict[str, Any] = Field(
        default_factory=dict, description="the execution contract (README: \"The execution contract\"): threads, SDPA "
        "backends, device, determinism, TF32, Ray workers, step path and batch shape; a key left out takes its default in "
        'kvreplay.runner.EXECUTION_DEFAULTS, e.g. {"device": "cuda", "step_path": "graph", "batch": 32}. Notebook 00 '
        "trains and scores in FP32 on the CPU under its threads and sdpa_backends only")
    # Experiment 1 (notebook 01)
    n_rows: int = Field(1, ge=1, description="Experiment 1 problems, the first of the bank (paper: 200)")
    preflight: int = Field(1, description="Experiment 1 preflight rows per precision, at least 1 (paper: 8)")
    live_check_fraction: float = Field(
        LIVE_CHECK_FRACTION, ge=0, le=1, description="share of Experiment 1's rows after the preflight ones whose "
        "live boundary a BF16 arm rebuilds and requires equal bit for bit (gate live_equals_incremental; the "
        "preflight rows always), a sample drawn from the problem IDs before any row runs; not in the ledger key")
    tie_rules: tuple[str, ...] = Field(
        (), description="the tie-rule control (exploratory): Experiment 1 BF16 rerun under each of these greedy tie "
        "rules ('highest', 'hash:<seed>'; kvreplay.decoding.ties), contrasted with the chain's own; empty: not run")
    length_branch_caps: tuple[int, ...] = Field(
        (), description="the manipulated-length arm (exploratory): Experiment 1 BF16 rerun on the same problems with "
        "the branch cap set to each of these (content tokens per branch block), everything else as the chain's, "
        "contrasted with the chain's own cap_branch (kvreplay.experiments.prefix_length); empty: not run")
    kernel_values: tuple[str, ...] = Field(
        KERNEL_VALUES, description="the kernel attribution (exploratory, notebook 09): Experiment 2's fixed BF16 prefixes rebuilt "
        "and prefilled under each of these execution-contract kernels values (kvreplay.model.kernels.KERNELS), one ledger "
        "each, contrasted by kernel_contrasts; not in make paper's chain (docs/execution-contract.md); empty: none")
    kernel_contrasts: tuple[tuple[str, str], ...] = Field(
        KERNEL_CONTRASTS, description="the kernel attribution's primary contrasts, declared before any of its rows: "
        "pairs of kernel_values whose suffix divergence is compared on the same problems (exact McNemar)")
    record_top_logits: bool = Field(
        False, description="every arm's suffix records its steps' top-1 eligible logits (top_logits; adds "
        "top_logits: true to each ledger key), which the tie-margin histogram needs; the tie-rule control always does")
    # Experiment 2 (notebook 02) and its controls
    preflight_fixed: int = Field(1, description="preflight rows of Experiments 2 and 5, at least 1 (paper: 2)")
    exploratory_controls: bool = Field(True, description="run Experiment 2's exploratory controls (BF16, the "
                                       "profile's step path); False: skipped (a profile without their ledger)")
    # Experiments 3 and 4 (notebooks 03, 04)
    n_bridge: int = Field(1, ge=1, description="Experiment 3 bridge rows (paper: 12)")
    n_divergent: int = Field(1, ge=0, description="Experiment 4 panel: suffix-divergent rows (paper: 24)")
    n_exact: int = Field(1, ge=0, description="Experiment 4 panel: suffix-exact control rows (paper: 8)")
    n_sweep: int = Field(1, ge=0, description="divergent Experiment 4 rows that also get the single-layer sweep")
    exp4_precondition_failures: Literal["left_out", "counted_as_failure", "report_both"] = Field(
        "report_both", description="Experiment 4 panel rows that fail the transplant's argmax precondition: left out "
        "of the endpoints, counted as failures, or both counts in the table (a reporting rule, not in the ledger key)")
    # Experiment 5 (notebook 05)
    n_exp5: int = Field(1, ge=1, description="Experiment 5 panel rows (paper: 48)")
    replication_model: str | None = Field(None, description="None: the chain's model + the later role table of "
                                          "notebook 00; or any HF folder / .gguf / cached hub id")
    replication_role_table: str | None = Field(None, description="optional role-table file for the replication checkpoint")
    # the role-table adaptation (notebook 00)
    adapt_source: str = Field("openbookqa", description="training data (a kvreplay.data.bank.SOURCES key), disjoint "
                              "from the MMLU bank")
    adapt_n_train: int = Field(2, ge=1, description="training rows (of a recipe that does not set n_train)")
    adapt_n_heldout: int = Field(1, ge=1, description="held-out OpenBookQA rows of the training curve (every recipe)")
    adapt_steps: int = Field(2, ge=1, description="optimizer steps (of a recipe that does not set steps)")
    adapt_batch: int = Field(1, ge=1, description="sequences per step (of a recipe that does not set batch)")
    adapt_lr: float = Field(0.005, gt=0, description="learning rate (of a recipe that does not set lr)")
    adapt_checkpoints: tuple[int, int] = Field((1, 2), description="[early, later] steps whose role tables are saved "
                                               "(of a recipe that does not set checkpoints)")
    adapt_eval_every: int = Field(2, ge=1, description="held-out evaluation every this many steps")
    adapt_seed: int = Field(SEED, description="seed of the training run")
    adapt_letter_balanced: bool = Field(False, description="train on letter-balanced rows, kvreplay.adapt.balance_letters "
                                        "(of a recipe that does not set letter_balanced)")
    adapt_selection: AdaptSelection = Field(
        default_factory=lambda: SMOKE_SELECTION, description="notebook 00's recipe search: a criterion and the recipes "
        "tried on held-out MMLU rows, one chosen by a fixed rule (kvreplay.adapt.selection); each recipe's values over "
        "the adapt_* ones")
    n_adapt_eval: int = Field(2, ge=1, description="MMLU bank rows of the checkpoint-0 vs later accuracy table")
    # statistics
    n_resamples: int = Field(20000, ge=1, description="bootstrap replicates of every interval (paper: 20,000)")
    seed: int = Field(SEED, description="seed of the bootstrap and of the controls' null perturbation")
    # folders
    ledger_root: str | None = Field(None, description="the folder holding <profile>/ ledger folders (None: data/ledgers)")
    figures_root: str | None = Field(None, description="the folder holding <profile>/ tables and figures (None: figures)")
    checkpoint_root: str | None = Field(None, description="the role-table checkpoint folders (None: data/checkpoints)")

    @field_validator("precisions", "adapt_checkpoints", "tie_rules", "length_branch_caps", "kernel_values",
                     mode="before")
    @classmethod
    def _list_as_tuple(cls, value):
        """YAML and ``overrides`` give lists; the frozen model keeps tuples."""
        return tuple(value) if isinstance(value, list) else value

    @field_validator("kernel_contrasts", mode="before")
    @classmethod
    def _pairs_as_tuples(cls, value):
        """YAML gives a list of two-item lists; the frozen model keeps tuples."""
        return tuple(tuple(p) if isinstance(p, list) else p for p in value) if isinstance(value, list) else value

    @field_validator("execution", mode="before")
    @classmethod
    def _no_execution_is_the_defaults(cls, value):
        """``execution:`` with nothing under it (YAML null) is the empty mapping: every key at its default."""
        return {} if value is None else value

    @field_validator("tie_rules", mode="after")
    @classmethod
    def _known_tie_rules(cls, value: tuple[str, ...]):
        """Each rule parses (:func:`kvreplay.decoding.settings.parse_rule`), once; written as the ledger key writes it."""
        rules = tuple(parse_rule(r, "tie_rules").name for r in value)
        if len(set(rules)) != len(rules):
            raise ValueError(f"tie_rules: a rule is listed twice in {list(value)}")
        return rules

    @field_validator("preflight", "preflight_fixed", mode="after")
    @classmethod
    def _preflight_rows(cls, value: int, info):
        """At least one preflight row: the construction checks of a run below float32 run on the preflight rows."""
        if value < 1:
            checks = ("the float32 construction-equivalence gate and the live_equals_incremental gate"
                      if info.field_name == "preflight" else "the float32 construction-equivalence gate")
            raise ValueError(f"{info.field_name}: {value} would switch off the checks that run on preflight rows in a "
                             f"run below float32 ({checks}) and the abort of an arm on a failed preflight row; use "
                             "at least 1")
        return value

    @model_validator(mode="after")
    def _length_caps_differ_from_the_chain(self):
        """The manipulated-length arm's branch caps: positive, each once, none the chain's own (that arm is
        Experiment 1)."""
        caps = self.length_branch_caps
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in caps):
            raise ValueError(f"length_branch_caps: each cap must be a whole number of tokens >= 1, got {list(caps)}")
        if len(set(caps)) != len(caps):
            raise ValueError(f"length_branch_caps: a cap is listed twice in {list(caps)}")
        if self.cap_branch in caps:
            raise ValueError(f"length_branch_caps lists {self.cap_branch}, the chain's own cap_branch: Experiment 1 "
                             "is that arm already")
        return self

    @model_validator(mode="after")
    def _kernel_values_and_contrasts(self):
        """The kernel attribution's values: known, each once; every contrast a pair of two of them. (Whether a value
        runs on the profile's decode path is checked when its arm is planned, :meth:`kvreplay.runner.ArmPlan.bind`.)"""
        values = self.kernel_values
        if not values:
            return self
        for v in values:
            kernels.parse_kernels(v)  # ValueError naming the known values
        if len(set(values)) != len(values):
            raise ValueError(f"kernel_values: a value is listed twice in {list(values)}")
        for pair in self.kernel_contrasts:
            if len(pair) != 2 or pair[0] == pair[1] or not set(pair) <= set(values):
                raise ValueError(f"kernel_contrasts: {list(pair)} is not a pair of two of kernel_values "
                                 f"{list(values)}; declare the contrasts among the values the arm runs")
        return self

    @model_validator(mode="after")
    def _tie_rules_differ_from_the_chain(self):
        """The control's rules exclude the chain's own (``execution``'s ``tie_rule``): that arm is Experiment 1."""
        own = parse_rule(self.execution.get("tie_rule", "lowest"), "execution: tie_rule").name
        if own in self.tie_rules:
            raise ValueError(f"tie_rules lists {own!r}, the chain's own tie rule: Experiment 1 is that arm already")
        return self

    @model_validator(mode="after")
    def _checkpoints_fit(self):
        """The role-table checkpoints within the training (refused here, before notebook 00 starts, not by it)."""
        early, later = self.adapt_checkpoints
        if not 0 < early < later <= self.adapt_steps:
            raise ValueError(f"adapt_checkpoints={list(self.adapt_checkpoints)} must satisfy 0 < early < later <= "
                             f"adapt_steps ({self.adapt_steps})")
        selection = self.adapt_selection
        for recipe in selection.recipes:
            r = self.recipe(recipe)
            if not 0 < r["checkpoints"][0] < r["checkpoints"][1] <= r["steps"]:
                raise ValueError(f"adapt_selection recipe {recipe.name!r}: checkpoints {list(r['checkpoints'])} must "
                                 f"satisfy 0 < early < later <= steps ({r['steps']}); a recipe that changes steps "
                                 "gives its checkpoints")
        if selection.n_heldout < MIN_HELDOUT <= self.n_adapt_eval:
            raise ValueError(f"adapt_selection.n_heldout={selection.n_heldout}: a profile that scores the bank on "
                             f"{MIN_HELDOUT} rows or more (n_adapt_eval={self.n_adapt_eval}) chooses its recipe on at "
                             f"least {MIN_HELDOUT} held-out rows")
        return self

    def recipe(self, recipe: AdaptRecipe) -> dict[str, Any]:
        """A recipe's training values: its ``name`` and each of :data:`RECIPE_KEYS`, from ``adapt_<key>`` where it
        leaves the key out."""
        out: dict[str, Any] = {"name": recipe.name}
        for key in RECIPE_KEYS:
            given = getattr(recipe, key)
            out[key] = getattr(self, f"adapt_{key}") if given is None else given
        return out

    @property
    def contract(self) -> dict:
        """The execution contract: every key of :data:`~kvreplay.runner.EXECUTION_KEYS`, ``execution`` over the defaults."""
        return resolve_execution(f"profile {self.profile!r}", self.execution)


FIELDS = tuple(ChainParameters.model_fields)
"""The chain's parameter names, in the order they are declared."""


def profile_path(profile: str | Path) -> Path:
    """The YAML file of a profile: ``notebooks/params/<profile>.yaml`` for a name, else the path as given.

    Raises:
        FileNotFoundError: no such file; names the profiles that exist.
    """
    text = str(profile)
    path = Path(text) if text.endswith((".yaml", ".yml")) or "/" in text else PARAMS / f"{text}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in PARAMS.glob("*.yaml"))
        raise FileNotFoundError(f"unknown profile {text!r}: no {path}; profiles: {known}")
    return path


def read_profile(profile: str | Path) -> dict:
    """A profile file's mapping as written (parameters and :data:`PROFILE_KEYS`), unchecked.

    Raises:
        FileNotFoundError: see :func:`profile_path`.
        ValueError: the file is not valid YAML (the parser's message, with the file), or does not hold a mapping.
    """
    path = profile_path(profile)
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"profile {path}: not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"profile {path}: expected a mapping of parameter names to values, got {type(doc).__name__}")
    return doc


def _check_names(names, where: str) -> None:
    """Refuse names that are not chain parameters: an execution-contract key at the top level, or a typo."""
    flat = [k for k in names if k in EXECUTION_KEYS]
    if flat:
        raise ValueError(f"{where}: {', '.join(map(str, flat))} {'belongs' if len(flat) == 1 else 'belong'} to the "
                         f"execution contract: put {'it' if len(flat) == 1 else 'them'} under "
                         "`execution:` (README: The execution contract)")
    unknown = [k for k in names if k not in FIELDS]
    if unknown:
        hints = {k: difflib.get_close_matches(str(k), FIELDS, n=1) for k in unknown}
        named = ", ".join(f"{k!r}" + (f" (did you mean {hints[k][0]!r}?)" if hints[k] else "") for k in unknown)
        raise ValueError(f"{where}: {named} is not a chain parameter (kvreplay.notebook.profiles.ChainParameters), so it would "
                         "be dropped without effect")


def base_of(profile: str | Path) -> str:
    """The base of a profile: its file's ``base:`` (a profile name or YAML path, or ``defaults``), else
    :data:`DEFAULT_BASE` (``cpu``), or :data:`FIELD_DEFAULTS` for :data:`DEFAULTS_BASED` (``smoke``, ``cpu``).

    Raises:
        FileNotFoundError, ValueError: as :func:`read_profile`; ``base:`` that is not a non-empty string.
    """
    path = profile_path(profile)
    doc = read_profile(path)
    if "base" not in doc:
        return FIELD_DEFAULTS if path.stem in DEFAULTS_BASED else DEFAULT_BASE
    base = doc["base"]
    if not (isinstance(base, str) and base):
        raise ValueError(f"profile {_shown(path)}: `base:` must name a profile (e.g. cpu) or be `defaults`, got {base!r}")
    return base


def _file_values(profile: str | Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A profile file's parameter values over its base's (recursively), names checked, values not yet typed."""
    path = profile_path(profile)
    where = f"profile {_shown(path)}"
    if path.resolve() in seen:
        chain = " -> ".join(_shown(p) for p in (*seen, path.resolve()))
        raise ValueError(f"{where}: its `base:` chain returns to itself ({chain})")
    doc = {k: v for k, v in read_profile(path).items() if k not in PROFILE_KEYS}
    _check_names(doc, where)
    if doc.get("profile", path.stem) != path.stem:
        raise ValueError(f"{where}: its `profile: {doc['profile']}` differs from the file's name {path.stem!r}")
    base = base_of(path)
    if base == FIELD_DEFAULTS:
        under: dict[str, Any] = {}
    else:
        try:
            under = _file_values(base, (*seen, path.resolve()))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{where}: base {base!r}: {e}") from None
        under.pop("profile", None)
    return under | doc


def load_parameters(profile: str | Path = DEFAULT_PROFILE, overrides: Mapping[str, Any] | None = None) -> ChainParameters:
    """Resolve a notebook's ``profile`` and ``overrides`` parameters into the chain's parameters.

    The values are :class:`ChainParameters`' defaults, then the base's values (:func:`base_of`: ``cpu`` unless the
    file names another with ``base:``), then the profile file's (its :data:`PROFILE_KEYS` skipped), then
    ``overrides`` (a value replaces the profile's whole: an ``execution`` override replaces its mapping).
    ``profile`` defaults to the file's name (``cpu`` for ``notebooks/params/cpu.yaml``); an override may relabel
    it. Nothing but the profile file and its bases' files is read.

    Args:
        profile: a profile name (``notebooks/params/<name>.yaml``) or a path to a YAML file.
        overrides: parameter name -> value, over the profile's.

    Returns:
        the frozen, checked parameters.

    Raises:
        FileNotFoundError: no such profile or base (the known ones are named).
        ValueError: naming the profile file. Refused: a key that is not a chain parameter (with the closest
            name), in the file, its base or ``overrides``; an execution-contract key outside ``execution``; a
            file whose ``profile:`` differs from its name; a ``base:`` chain that returns to itself. Also a
            value of the wrong type or range, and an execution contract that
            :func:`~kvreplay.runner.resolve_execution` refuses.
    """
    path = profile_path(profile)
    where = f"profile {_shown(path)}"
    doc = _file_values(path)
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ValueError(f"overrides must be a mapping of parameter names to values, not {type(overrides).__name__} "
                         f"{overrides!r} (papermill: -y 'overrides: {{n_rows: 4}}', not -p overrides ...)")
    overrides = dict(overrides or {})
    if overrides:
        _check_names(overrides, f"{where}, overrides")
        where += f" with overrides {overrides}"
    try:
        params = ChainParameters(**(doc | {"profile": path.stem} | overrides))
    except ValidationError as e:
        errors = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}, got {err['input']!r}" if err["loc"]
                           else err["msg"] for err in e.errors())  # a check across parameters: its message says it all
        raise ValueError(f"{where}: {errors}") from None
    resolve_execution(where, params.execution)
    return params


def _shown(path: Path) -> str:
    """A path as shown to a reader: relative to the repository when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def profile_sha256(profile: str | Path) -> str:
    """sha256 of a profile file's bytes."""
    return hashlib.sha256(profile_path(profile).read_bytes()).hexdigest()


def describe(params: ChainParameters, profile: str | Path, overrides: Mapping[str, Any] | None = None) -> str:
    """One line of the resolved values a reader of an executed notebook needs.

    It gives the profile file, its sha256 prefix and its base (:func:`base_of`), the overrides, model, problems,
    rows, caps, precisions and the ``execution`` mapping as given (its other keys take
    :data:`~kvreplay.runner.EXECUTION_DEFAULTS`)."""
    given = ", ".join(f"{k}={v}" for k, v in params.contract.items() if k in params.execution)
    base = base_of(profile)
    parts = [f"profile {params.profile} ({_shown(profile_path(profile))}, sha256 {profile_sha256(profile)[:12]}; "
             f"the rest from {'the smoke defaults' if base == FIELD_DEFAULTS else f'base {base}'})",
             "overrides " + (", ".join(f"{k}={v}" for k, v in (overrides or {}).items()) or "none"),
             f"model {params.model}", f"problems {params.problems}",
             f"rows {params.n_rows} (preflight {params.preflight})",
             f"caps {params.cap_branch}/{params.cap_merge}/{params.cap_answer}",
             f"precisions {', '.join(params.precisions)}",
             f"execution {given}, other keys default" if given else "execution: every key default"]
    return "; ".join(parts)
