"""An experiment arm's settings and what its per-row function receives (paper §3.9).

An *arm* is one experiment at one precision under one execution contract.
:class:`ArmSettings` holds everything that decides its bits (model, format,
caps, dtype, threads, SDPA backends, device, step path and batch shape) and
builds the ledger key from it; :class:`RunSpec` is what a per-row function
gets (the loaded model, format, caps, gates to run); the batched engine's
chunks are :mod:`kvreplay.runner.batched`'s. The run loop itself is
:func:`kvreplay.runner.loop.run_arm`. :data:`ROW_ALGORITHM` versions each
experiment's row function: a change to any bit of a committed row bumps it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeGuard

import torch

from ..decoding import decode, ties
from .. import engine
from ..model import kernels
from ..arm_facts import ARM_FACTS, Derived
from ..engine import EngineRun
from ..decoding.contract import BlockFormat, Caps, ContractError, load_spec, resolve_format
from ..decoding.settings import Decoding, parse_rule
from ..ledger.store import canonical_json
from ..model.execution import ExecutionContract, check_sdpa_on_device, device_type, resolve_contract
from ..model.models import (
    LoadedModel,
    ModelLoadError,
    attention_layout,
    check_cache_auditable,
    context_length,
    environment_record,
    self_check,
)
from ..paths import ROOT
from ..data.problems import Problem
from .ledger_keys import model_key, problems_digest, role_table_key  # noqa: F401  (re-exported)
from .row_checks import LIVE_CHECK_FRACTION, LIVE_CHECK_SALT, check_counts, check_prompts, live_check_ids  # re-exported

Hook = Callable[[dict[str, decode.Boundary]], None]


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What a row function needs besides the problem.

    Attributes:
        lm: loaded model (its dtype is the run's precision).
        fmt: resolved block format.
        decoding: caps, the parsed tie rule and top-logit recording as one value
            (:class:`~kvreplay.decoding.settings.Decoding`, :attr:`ArmSettings.decoding`); row and chunk functions pass it
            whole to the eager and the batched decoders.
        faults: optional hook called with the boundary states right after
            they are built and before any gate runs; tests use it to plant
            faults through the same runner the notebooks use.
        transplant_faults: optional hook called with
            ``(transplanted_state, recipient, donor, provenance)`` before the
            transplant gates run again (Experiment 4 tests).
        equivalence_ids: problem IDs on which a run in a lower precision also
            checks construction equivalence in float32 (the arm's preflight
            rows; :func:`kvreplay.experiments.matrix.construction_equivalence`). Float32 runs check it on
            every row from the row's own comparison.
        engine: the batch shape and step path of a batched runner
            (:class:`EngineRun`); ``None`` for the one-problem decoders of
            :mod:`kvreplay.decoding.decode`.
        memo: float32 construction-equivalence records already computed in
            this run, by problem ID and prefix (a batched runner computes a
            preflight problem twice for the composition gate; the check does
            not depend on the batch, so it runs once).
        live_check_ids: problem IDs whose live boundary a run below float32
            rebuilds and requires equal bit for bit (gate ``live_equals_incremental``;
            :func:`kvreplay.experiments.matrix.check_live`): the preflight rows and a
            declared sample (:func:`live_check_ids`). Experiments whose reference is not
            live ignore it.
        live_checks: the ``live_equals_incremental`` checks passed so far (``problem_id``,
            ``seconds``), for the arm's run log (:func:`kvreplay.runner.run_arm` empties it).

    Building a RunSpec checks the model (:func:`check_model`): a model that did not come through
    :func:`~kvreplay.model.models.load_model` gets the same checks here, once per model object.

    Raises:
        ModelLoadError: a model whose KV cache the protocol cannot audit, or that ignores the explicit
            4-D mask or position IDs (the messages of :func:`~kvreplay.model.models.load_model`).
    """
    lm: LoadedModel
    fmt: BlockFormat
    decoding: Decoding
    faults: Hook | None = None
    transplant_faults: Callable | None = None
    equivalence_ids: frozenset = frozenset()
    engine: EngineRun | None = None
    memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    live_check_ids: frozenset = frozenset()
    live_checks: list = dataclasses.field(default_factory=list, compare=False, repr=False)

    @property
    def caps(self) -> Caps:
        """The content caps (:attr:`decoding`'s)."""
        return self.decoding.caps

    def __post_init__(self):
        if not isinstance(self.decoding, Decoding):
            raise TypeError(f"RunSpec: decoding must be a Decoding (Decoding.of(caps, ...)), got {self.decoding!r}")
        check_model(self.lm)

    def check_problem(self, problem: Problem) -> None:
        """What the run loop checks before an arm, for one problem: its prompt and its longest sequence.

        Row and chunk functions call it first, so a direct call gets the run loop's errors before decoding.

        Raises:
            ContractError: the prompt breaks the block contract (a special token in its text), or its
                longest sequence needs more positions than the model has (:func:`check_prompts`).
        """
        check_prompts(self.fmt, [problem], context_length(self.lm.model.config), caps=self.caps)

    def check_prefix(self, problem: Problem, prefix: Sequence[int]) -> None:
        """A fixed boundary prefix z and its longest suffix must fit the model's positions.

        Raises:
            ContractError: naming the problem, its source line and the positions needed and available.
        """
        limit = context_length(self.lm.model.config)
        need = len(prefix) + engine.suffix_length_bound(self.fmt, self.caps)
        if limit is not None and need > limit:
            raise ContractError(
                f"problem {problem.problem_id} ({problem.where}): its prefix of {len(prefix)} tokens and longest "
                f"suffix (merge cap {self.caps.merge} + answer cap {self.caps.answer} + delimiters) can need {need} "
                f"positions, but the model has only {limit} (max_position_embeddings)")

    def batched(self) -> EngineRun:
        """This run's :class:`~kvreplay.engine.EngineRun`, which a chunk function passes to the engine's decoders.

        Raises:
            ValueError: a one-problem run (``engine`` is None), which has no batched runner to drive."""
        if self.engine is None:
            raise ValueError("this run has no engine (RunSpec.engine is None): a chunk function needs a batched run")
        return self.engine


ROW_ALGORITHM: Mapping[str, int] = Derived(lambda: {e: f.row_algorithm for e, f in ARM_FACTS.items()})
"""Row-algorithm version of each experiment (:attr:`kvreplay.arm_facts.ArmFacts.row_algorithm`: when to bump it)."""


_MODEL_CHECKS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def check_model(lm: LoadedModel) -> dict:
    """The checks :func:`~kvreplay.model.models.load_model` makes, for a model however it was built; once per model object.

    Refuses a KV cache the protocol cannot audit (:func:`~kvreplay.model.models.check_cache_auditable`: sliding-window,
    chunked, linear-attention or hybrid layers). Reuses the load self-check record a loaded model carries
    (``identity["self_check"]``), else runs :func:`~kvreplay.model.models.self_check` (the explicit 4-D mask and
    position IDs obeyed; five decodes of 8 tokens).

    Returns:
        The self-check record.

    Raises:
        ModelLoadError: the messages of :func:`~kvreplay.model.models.load_model`.
    """
    if lm.model in _MODEL_CHECKS:
        return _MODEL_CHECKS[lm.model]
    check_cache_auditable(lm.model, str(lm.identity.get("model", type(lm.model).__name__)))
    record = lm.identity.get("self_check")
    if not (isinstance(record, dict) and record.get("passed") is True):
        record = self_check(lm)
    _MODEL_CHECKS[lm.model] = record
    return record


ARM_STEP_PATHS = ("eager", "engine-eager", "graph")
"""Decode paths of an arm: :mod:`kvreplay.decoding.decode` (reference), the engine's op-by-op step, its CUDA graph."""


def _whole(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


EXECUTION_KINDS: dict[str, tuple[str, Callable[[object], bool]]] = {
    "threads": ("a whole number of at least 1", lambda v: _whole(v) and v >= 1),
    "sdpa_backends": ("a non-empty list of SDPA backend names",
                      lambda v: isinstance(v, (list, tuple)) and bool(v) and all(isinstance(b, str) and b for b in v)),
    "device": ("a device name such as 'cpu', 'cuda' or 'cuda:0'", lambda v: isinstance(v, str) and bool(v)),
    "deterministic": ("true, false or null", lambda v: v is None or isinstance(v, bool)),
    "allow_tf32": ("true or false", lambda v: isinstance(v, bool)),
    "workers": ("a whole number", _whole),
    "ray_address": ("null or a Ray cluster address string", lambda v: v is None or isinstance(v, str)),
    "step_path": (f"one of {ARM_STEP_PATHS}", lambda v: isinstance(v, str)),
    "batch": ("a whole number", _whole),
    "max_len": ("null or a whole number", lambda v: v is None or _whole(v)),
    "chunk": ("null or a whole number", lambda v: v is None or _whole(v)),
    "attention": (f"one of {engine.ATTENTIONS}", lambda v: isinstance(v, str)),
    "tie_rule": ("'lowest', 'highest' or 'hash:<seed>'", lambda v: isinstance(v, str)),
    "kernels": (f"one of {list(kernels.KERNELS)}", lambda v: isinstance(v, str)),
}
"""The execution contract's keys (the :class:`ArmSettings` fields the notebooks' ``execution`` parameter sets),
each with the kind of value it takes: a description and a check (ranges are :func:`check_execution`'s)."""

EXECUTION_KEYS = tuple(EXECUTION_KINDS)
"""The execution contract's keys, in the order of :data:`EXECUTION_KINDS`."""

ENGINE_KEYS = ("step_path", "batch", "max_len", "chunk", "attention")
"""The execution-contract keys that drive the batched engine (the eager path leaves them at their defaults)."""


def check_execution(contract: dict) -> None:
    """Refuse an execution contract (every key of :data:`EXECUTION_KEYS`) whose values do not fit together.

    Raises:
        ValueError: an unknown device, or an SDPA backend unknown or missing on it; ``workers`` below 1 or not whole;
            ``ray_address`` not a non-empty string or None; an unknown step path; ``graph`` on a non-CUDA device;
            ``batch`` below 1; ``max_len`` below 2; ``chunk`` below 1; a batch shape, chunk or an attention other than
            ``"sdpa"`` given with ``step_path="eager"``; an unknown attention; ``attention="flex"`` with a ``max_len``
            that is not a multiple of 128; an unknown ``tie_rule``; a ``kernels`` value unknown or off its paths
            (:func:`kvreplay.model.kernels.check_step_path`).
    """
    c = contract
    parse_rule(c.get("tie_rule", ties.DEFAULT_TIE_RULE))  # ValueError naming the rules
    kernels.check_step_path(c.get("kernels", kernels.DEFAULT), c["step_path"], c["attention"])  # ValueError
    kind = device_type(c["device"])  # ValueError naming an unknown device
    if not _whole(c["workers"]) or c["workers"] < 1:
        raise ValueError(f"workers must be a whole number of at least 1, got {c['workers']!r}")
    if c["ray_address"] is not None and (not isinstance(c["ray_address"], str) or not c["ray_address"]):
        raise ValueError(f"ray_address must be None or a Ray cluster address such as 'auto' or 'host:6379', "
                         f"got {c['ray_address']!r}")
    check_sdpa_on_device(c["sdpa_backends"], c["device"])
    if c["step_path"] not in ARM_STEP_PATHS:
        raise ValueError(f"unknown step path {c['step_path']!r}; use one of {ARM_STEP_PATHS}")
    if not _whole(c["batch"]) or c["batch"] < 1:
        raise ValueError(f"batch (problems per step) must be a whole number of at least 1, got {c['batch']!r}")
    if c["max_len"] is not None and (not _whole(c["max_len"]) or c["max_len"] < 2):
        raise ValueError(f"max_len must be None or a whole number of at least 2, got {c['max_len']!r}")
    if c["chunk"] is not None and (not _whole(c["chunk"]) or c["chunk"] < 1):
        raise ValueError(f"chunk (problems per chunk) must be None or a whole number of at least 1, got {c['chunk']!r}")
    if c["step_path"] == "eager" and (c["batch"] != EXECUTION_DEFAULTS["batch"] or c["max_len"] is not None or c["chunk"] is not None):
        raise ValueError("batch, max_len and chunk drive the batched engine: they need step_path 'engine-eager' "
                         "or 'graph' (the eager path decodes one problem at a time)")
    if c["step_path"] == "graph" and kind != "cuda":
        raise ValueError(f"step path 'graph' replays CUDA graphs: it needs device 'cuda', not {c['device']!r}")
    if c["attention"] not in engine.ATTENTIONS:
        raise ValueError(f"unknown attention {c['attention']!r}; use one of {engine.ATTENTIONS}")
    if c["step_path"] == "eager" and c["attention"] != "sdpa":
        raise ValueError(f"attention {c['attention']!r} is the batched engine's: it needs step_path 'engine-eager' or "
                         f"'graph' (the eager path calls the model's own SDPA)")
    if c["attention"] == "flex" and c["max_len"] is not None and c["max_len"] % engine.FLEX_BLOCK:
        raise ValueError(f"attention 'flex' reads the cache in blocks of {engine.FLEX_BLOCK} positions: max_len "
                         f"{c['max_len']} must be a multiple of {engine.FLEX_BLOCK} (or null: the arm's longest "
                         f"sequence, rounded up)")


@dataclasses.dataclass(frozen=True)
class ArmSettings:
    """Everything that fixes an arm's numerics besides its rows (part of every ledger key).

    Attributes mirror the notebooks' parameters: ``profile``, ``dtype``, ``caps``, ``model`` (``"embedded"``, folder,
    ``.gguf`` or cached hub id), ``fmt`` (block format name or YAML path), ``role_table`` (path or None),
    ``preflight`` (rows), ``live_check_fraction``, and the execution contract. ``live_check_fraction`` is the share of
    the rows after the preflight ones whose live boundary a run below float32 checks (gate
    ``live_equals_incremental``; :func:`live_check_ids`). It is not part of the key: a row that passes records nothing
    more. The execution contract: ``threads`` (intra-op threads), ``sdpa_backends``, the CUDA side
    (:class:`~kvreplay.model.execution.ExecutionContract`: ``device``, ``deterministic``, ``allow_tf32``, ``kernels``:
    :mod:`kvreplay.model.kernels`), and the fields below. The notebooks take the contract as one mapping
    parameter, ``execution``, over these fields' defaults (:data:`EXECUTION_DEFAULTS`, checked by
    :func:`resolve_execution`).

    Where the rows run is not part of the key: the rows are identical bit for bit however many actors compute them.
    ``workers`` is the number of Ray row actors (:mod:`kvreplay.runner.actors`; on CUDA one per GPU, shared when there
    are more actors than GPUs; 1 = in this process, without Ray). ``ray_address`` is an existing Ray cluster to run
    them on (``"auto"``, ``"host:port"`` or ``"ray://host:10001"``; ``None``: the one in ``$RAY_ADDRESS``, else a
    local cluster started for them).

    The decode path is part of the contract too:

    * ``step_path``: ``"eager"`` (default, the reference): one problem at a time through :mod:`kvreplay.decoding.decode`
      (``DynamicCache``, one forward call per token); ``"engine-eager"``: the batched engine (:mod:`kvreplay.engine`)
      with its op-by-op step (runs on the CPU); ``"graph"``: the engine with its step replayed as a CUDA graph.
    * ``batch``: problems per batched step ``B`` (the engine's ``2B`` rows);
    * ``max_len``: positions per row of the engine's static cache, or ``None``
      for the arm's bound. That bound is the longest full sequence any of its problems
      can reach (:meth:`~kvreplay.decoding.contract.BlockFormat.max_sequence_length`
      of its prompt at the caps), so one arm has one batch shape.
    * ``chunk``: problems the batched runner gives the engine at once, ``None``
      for ``batch``. More problems than slots keep the slots busy (a finished
      problem's slot takes the next one); rows are appended when their chunk
      ends, so a chunk should fit in the time a run has. It changes no bit
      (the ``composition`` gate checks that a problem's bits do not depend on
      its companions) and is not part of the ledger key.
    * ``attention``: the engine step's attention. ``"sdpa"`` (default: the
      model's SDPA call under ``sdpa_backends``); ``"grouped"``
      (:func:`kvreplay.engine.grouped_attention`: the math backend's float32
      arithmetic without repeating key/value heads; faster, other bits); or
      ``"flex"`` (:func:`kvreplay.engine.flex_attention_step`: FlexAttention
      over the filled blocks of the cache, compiled on CUDA; fastest, other
      bits; ``max_len`` a multiple of 128, ``None`` rounds the arm's bound up).

    The engine's bits depend on the batch shape ``(B, max_len)`` and differ
    from the eager path's. So a non-eager step path adds
    ``{"engine": {"step_path", "batch", "max_len"}}`` to the ledger key (the
    policy name ``"longest_sequence"`` for ``max_len=None``; the resolved
    length is recorded in the environment). ``"attention"`` joins that
    entry when it is not ``"sdpa"``. The defaults add nothing.
    ``batch`` and ``max_len`` are refused with the eager path (they would not
    be used). Every arm of an experiment should run under the same contract.

    ``caps``, ``tie_rule`` and ``top_logits`` (parameter ``record_top_logits``) key the ledger as their
    :attr:`decoding` writes them (:meth:`kvreplay.decoding.settings.Decoding.key`: at their defaults, nothing).

    Raises:
        ValueError: an execution contract :func:`check_execution` refuses; ``live_check_fraction`` outside
            [0, 1]. Refused: an unknown device, step path or ``attention``; ``workers``, ``batch``, ``max_len``
            or ``chunk`` out of range; a batch shape, or an attention other than ``"sdpa"``, with the eager path;
            ``graph`` off CUDA; ``"flex"`` with a ``max_len`` not a multiple of 128.
    """
    profile: str
    dtype: str
    caps: Caps
    model: str = "embedded"
    fmt: str = "chat_multibranch"
    role_table: str | None = None
    threads: int = 2
    sdpa_backends: tuple[str, ...] = ("math",)
    preflight: int = 1
    device: str = "cpu"
    deterministic: bool | None = None
    allow_tf32: bool = False
    workers: int = 1
    step_path: str = "eager"
    batch: int = 8
    max_len: int | None = None
    ray_address: str | None = None
    chunk: int | None = None
    attention: str = "sdpa"
    live_check_fraction: float = LIVE_CHECK_FRACTION
    tie_rule: str = ties.DEFAULT_TIE_RULE
    top_logits: bool = False
    kernels: str = kernels.DEFAULT

    def __post_init__(self):
        check_execution({k: getattr(self, k) for k in EXECUTION_KEYS})
        self.decoding  # noqa: B018 (built once here: an unknown tie rule or a non-bool top_logits is refused)
        f = self.live_check_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
            raise ValueError(f"live_check_fraction must be a number in [0, 1], got {f!r}")
        check_counts(self)  # preflight, caps, batch, chunk, workers: values no profile could hold

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "ArmSettings":
        """The settings that wrote a ledger, from the scientific config in its ``manifest.json`` (:meth:`config`).

        What the key leaves out takes its default: ``workers``, ``ray_address``, ``chunk`` and
        ``live_check_fraction`` (no bit depends on them), and the execution contract's CPU defaults. The model is
        the key's name (the embedded model, a ``.gguf`` path or a hub id; a local folder is keyed by its name
        only); a role table inside the repository is found from its relative path.

        Raises:
            ValueError: a contract :func:`check_execution` refuses.
        """
        execution, path = config.get("execution", {}), config.get("engine") or {}
        role = config.get("role_table")
        table = None
        if role:
            table = role["model"] if Path(role["model"]).is_absolute() else str(ROOT / role["model"])
        engine_keys: dict[str, Any] = {}
        if path:
            engine_keys = {"step_path": path["step_path"], "batch": path["batch"],
                           "max_len": None if path["max_len"] == "longest_sequence" else path["max_len"],
                           "attention": path.get("attention", "sdpa")}
        decoding = Decoding.from_key(config)
        return cls(profile=config["profile"], dtype=config["dtype"], caps=decoding.caps,
                   model=config["model"]["model"], fmt=config["format"], role_table=table, threads=config["threads"],
                   sdpa_backends=tuple(config["sdpa_backends"]), preflight=config["preflight"],
                   **{k: execution[k] for k in ("device", "deterministic", "allow_tf32", "kernels") if k in execution},
                   **engine_keys, tie_rule=decoding.tie_rule.name, top_logits=decoding.top_logits)

    def eager(self) -> "ArmSettings":
        """These settings on the eager reference path (:mod:`kvreplay.decoding.decode`): the engine keys at their defaults."""
        defaults: dict[str, Any] = {k: EXECUTION_DEFAULTS[k] for k in ENGINE_KEYS}
        return dataclasses.replace(self, **defaults)

    def engine_key(self) -> dict | None:
        """The ledger-key entry of the decode path: ``None`` for the eager path, else step path and batch shape."""
        if self.step_path == "eager":
            return None
        key = {"step_path": self.step_path, "batch": self.batch,
               "max_len": self.max_len if self.max_len is not None else "longest_sequence"}
        if self.attention != "sdpa":
            key["attention"] = self.attention
        return key

    def engine_run(self, fmt: BlockFormat, problems: Sequence[Problem], config=None) -> "EngineRun | None":
        """The resolved engine settings of a batched arm (``None`` on the eager path).

        ``max_len=None`` resolves to the longest full sequence any of the arm's problems can reach, rounded up to
        a multiple of 128 for ``attention="flex"``.

        Args:
            config: the loaded model's ``transformers`` config, when known: its layers must be full or
                sliding-window attention (:func:`kvreplay.model.models.attention_layout`), which the engine masks as
                the eager decoders do.

        Raises:
            ContractError: a prompt breaks the block contract.
            ValueError: a fixed ``max_len`` shorter than the longest sequence a problem can reach, or a model
                whose layer types have no attention layout.
        """
        if self.step_path == "eager":
            return None
        if config is not None:
            try:
                attention_layout(config)
            except ModelLoadError as e:
                raise ValueError(f"step_path {self.step_path!r}: the batched engine cannot mask this model: {e}") from None
        need = max(fmt.max_sequence_length(len(fmt.prompt_ids(p.question, p.options)), self.caps) for p in problems)
        if self.max_len is not None and self.max_len < need:
            raise ValueError(f"max_len={self.max_len} is shorter than the {need} positions the arm's longest problem "
                             f"can reach at caps {dataclasses.astuple(self.caps)}")
        return EngineRun("graph" if self.step_path == "graph" else "eager", self.batch,
                         self.max_len if self.max_len is not None else engine.engine_max_len(need, self.attention),
                         chunk=self.chunk, attention=self.attention)

    def contract(self, device: str | None = None) -> ExecutionContract:
        """The execution contract of this arm (``device`` overrides, e.g. a worker's GPU)."""
        return resolve_contract(device=device or self.device, sdpa_backends=self.sdpa_backends, kernels=self.kernels,
                                deterministic=self.deterministic, allow_tf32=self.allow_tf32, threads=self.threads)

    def config(self, experiment: str, problems: Sequence[Problem]) -> dict:
        """The scientific config that keys the ledger (CPU defaults add no key, so CPU ledgers keep their digests)."""

        config = {
            "experiment": experiment,
            "profile": self.profile,
            "dtype": self.dtype,
            "model": model_key(self.model),
            "role_table": role_table_key(self.role_table) if self.role_table else None,
            "format": load_spec(self.fmt),
            "problems_sha256": problems_digest(problems),
            "problem_ids": [p.problem_id for p in problems],
            "threads": self.threads,
            "sdpa_backends": list(self.sdpa_backends),
            "preflight": self.preflight,
            "batch": decode.BATCH,
        }
        execution = self.contract().key()
        if execution:
            config["execution"] = execution
        if self.engine_key() is not None:
            config["engine"] = self.engine_key()
        return config | self.decoding.key()

    @functools.cached_property
    def decoding(self) -> Decoding:
        """Its :class:`~kvreplay.decoding.settings.Decoding`, built once (:meth:`Decoding.of` checks each setting); its
        entries key the ledger and its rows are decoded by it."""
        return Decoding.of(self.caps, self.tie_rule, self.top_logits)

    def run_spec(self, lm: LoadedModel, fmt: BlockFormat, run: "EngineRun | None" = None, **kw: Any) -> "RunSpec":
        """The :class:`RunSpec` of this arm on a loaded model: its :attr:`decoding` and ``run``."""
        return RunSpec(lm, fmt, self.decoding, engine=run, **kw)

    def load(self, device: str | None = None) -> tuple[LoadedModel, BlockFormat]:
        """Fix the seed, load the model at this precision under the arm's contract (:func:`.kept.load_kept`: once
        within :func:`~kvreplay.runner.keep_models`), resolve the format."""
        from .kept import load_kept

        torch.manual_seed(0)
        lm = load_kept(self.model, self.dtype, self.role_table, self.contract(device))
        return lm, resolve_format(lm.tokenizer, self.fmt)


EXECUTION_DEFAULTS: Mapping[str, object] = MappingProxyType(
    {k: {f.name: f.default for f in dataclasses.fields(ArmSettings)}[k] for k in EXECUTION_KEYS})
"""The execution contract a notebook runs under where its ``execution`` parameter leaves a key out: the
:class:`ArmSettings` defaults (threads 2, math SDPA, CPU, deterministic per device, TF32 off, one worker,
no Ray address, the eager step path, batch 8, no ``max_len`` or ``chunk``, the model's SDPA attention), read from
its fields."""


def resolve_execution(notebook: str, execution: Mapping | None) -> dict:
    """A notebook's execution contract: its ``execution`` parameter over :data:`EXECUTION_DEFAULTS`, checked.

    Called before anything is loaded or decoded, so a bad contract stops the notebook in its setup cell.

    Args:
        notebook: the notebook's path (named in every error).
        execution: the ``execution`` parameter (a mapping of contract keys; ``None`` or ``{}``: the defaults).

    Returns:
        Every key of :data:`EXECUTION_KEYS`, in that order (``sdpa_backends`` as a tuple).

    Raises:
        ValueError: naming the notebook and the key: ``execution`` is not a mapping, a key is not a contract
            key, a value is not of its key's kind (:data:`EXECUTION_KINDS`), or the values do not fit
            together (:func:`check_execution`).
    """
    if execution is None:
        execution = {}
    if not isinstance(execution, Mapping):
        raise ValueError(f"{notebook}: the execution parameter must be a mapping of execution-contract keys "
                         f"({', '.join(EXECUTION_KEYS)}), got {type(execution).__name__} {execution!r}")
    for key, value in execution.items():
        if key not in EXECUTION_KINDS:
            near = difflib.get_close_matches(str(key), EXECUTION_KEYS, n=1)
            raise ValueError(f"{notebook}: unknown execution key {key!r}"
                             + (f" (did you mean {near[0]!r}?)" if near else "")
                             + f"; the execution contract's keys are {', '.join(EXECUTION_KEYS)}")
        kind, ok = EXECUTION_KINDS[key]
        if not ok(value):
            raise ValueError(f"{notebook}: execution key {key!r} must be {kind}, got {value!r}")
    contract = {k: execution.get(k, EXECUTION_DEFAULTS[k]) for k in EXECUTION_KEYS}
    contract["sdpa_backends"] = tuple(contract["sdpa_backends"])
    try:
        check_execution(contract)
    except ValueError as e:
        raise ValueError(f"{notebook}: execution: {e}") from None
    return contract


def arm_environment(lm: LoadedModel, fmt: BlockFormat, settings: ArmSettings, run: "EngineRun | None" = None) -> dict:
    """What a ledger's ``environment.json`` records for an arm: the execution contract as applied, and the format digest.

    The contract's ``device`` is the arm's setting (``"cuda"``), not a worker's
    GPU, so a ledger's environment does not depend on which worker recorded it.
    A batched arm adds ``engine``: its step path, ``batch`` and the resolved
    ``max_len`` (the eager path adds nothing), and an attention other than ``sdpa``; ``flex`` also records
    its block size, pinned kernel options, implementation and the torch and Triton versions
    (:func:`kvreplay.engine.flex_environment`).
    """
    env = environment_record(lm, settings.threads) | {"format_digest": fmt.digest}
    if "contract" in env:
        env["contract"]["device"] = settings.device
    if settings.decoding.tie_rule != ties.LOWEST:  # the rule as the ledger key writes it
        env["tie_rule"] = settings.decoding.tie_rule.name
    if run is not None:
        env["engine"] = {"step_path": settings.step_path, "batch": run.batch, "max_len": run.max_len}
        if run.attention != "sdpa":
            env["engine"]["attention"] = run.attention
        if run.attention == "flex":
            cfg: Any = lm.model.config
            heads = cfg.num_attention_heads
            kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
            env["engine"]["flex"] = engine.flex_environment(2 * run.batch, kv_heads, heads // kv_heads, lm.device)
    return env

