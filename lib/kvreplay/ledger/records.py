"""The schema of ledger rows: one typed record per kind of row the experiments write.

A ledger's ``rows.jsonl`` holds one JSON object per problem (:mod:`.store`). The rows stay plain dicts, written and
read byte for byte as before; this module *declares* their layout, as :class:`~typing.TypedDict` classes whose
field names are the JSON keys (the experiments' row, chunk and summary functions are annotated with them, e.g.
:data:`Exp1Record`, a test keeps those annotations equal to :data:`ROW_TYPES` and :data:`FAILED_ROW_TYPES`), and
checks a row against it at run time (:func:`validate_row`, pydantic in strict
mode: a missing key, an extra key or a wrong type is an error; ``True`` is not an int, ``1`` is not a bool nor a
float, since every writer writes its floats with ``float()``; JSON ``NaN`` and ``Infinity`` are floats). mypy checks
the reads statically (``tests/test_static_types.py``; ``python -m mypy`` from the repository root): a summary
narrows a ledger's rows to the passed layout with ``kvreplay.experiments.endpoints.require_gates``, and reads a key
known only at run time through :func:`arm_of`, :func:`comparison_of` or :func:`outcome_of`. Rows loaded as plain
dicts are typed by :func:`validate_rows` with a literal experiment (``validate_rows("exp1", rows)``); rows typed
``Any`` stay unchecked (docs/ARCHITECTURE.md, "Row records"). The parts the rows hold are declared in :mod:`.row_parts` and
re-exported here.

Row kinds, keyed by the ledger folder's experiment prefix (:data:`ROW_TYPES`):

* ``exp1`` (:class:`Exp1Row`): Experiment 1, the live cache of greedy decoding against a prefill of the same token
  IDs (paper §4.1), the four-arm matrix of paper §3.5 around the live boundary;
* ``exp1_ties`` (:class:`Exp1Row`): Experiment 1 under another greedy tie rule (the exploratory tie-rule control),
  every arm with its steps' ``top_logits``;
* ``exp1_length`` (:class:`Exp1Row`): Experiment 1 at another branch cap (the exploratory manipulated-length arm);
* ``exp2`` (:class:`Exp2Row`): Experiment 2, fixed BF16 prefixes, the incremental rebuild against prefill at each
  precision (paper §4.2), the same matrix around the incremental boundary;
* ``exp2_controls`` (:class:`ControlsRow`): Experiment 2's exploratory controls, the FP32 readout and the matched
  null perturbation of the incremental cache;
* ``exp3`` (:class:`BridgeRow`): Experiment 3, the incremental bridge (paper §3.6, §3.7, §4.3): a new live boundary
  against the incremental rebuild of its prefix;
* ``exp4`` (:class:`TransplantRow`): Experiment 4, boundary K/V transplants between the incremental and prefill
  caches (paper §3.8, §4.4);
* ``exp5`` (:class:`ReplicationRow`): Experiment 5, the whole-cache transplant replicated on a later checkpoint
  (paper §4.5), with each baseline's answer score;
* ``exp2_kernels`` (:class:`Exp2Row`): Experiment 2 under another kernels value (the exploratory kernel
  attribution);
* ``adapt_eval`` (:class:`AdaptEvalRow`): the answer-letter metric of each role-table checkpoint of the family
  Experiment 5's later checkpoint comes from (notebook 00; paper §3.1 role rows, §4.5).

A row whose integrity gate failed has ``gate_failure`` set (:class:`GateFailure`) and keeps only the fields of the
stages it finished; its layout is :data:`FAILED_ROW_TYPES` (``adapt_eval`` rows never fail a gate). Each of those
fields is optional on its own there: the stages' grouping (e.g. ``prefix`` comes with ``prefix_len``) is not checked.

The layouts are those of the row-algorithm versions declared beside each record's name in
:data:`kvreplay.arm_facts.ARM_FACTS`. Rows of an older version (a
*stale* ledger) may lack keys added since, e.g. ``equivalence`` or ``endpoints.tie_initiated``, and do not validate.

Units: token IDs and counts are ints; ``rel_l2`` is a relative L2 distance ``||other - ref|| / ||ref||``
(dimensionless, float64); ``max_abs``, ``l2_*`` and margins are in the tensor's own units (logits for the logits and
margins); positions such as ``first_divergence`` count suffix tokens after the boundary, 0-based.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, cast, overload

from pydantic import TypeAdapter, ValidationError, with_config
from typing_extensions import NotRequired, TypedDict  # pydantic needs typing_extensions' TypedDict before Python 3.12

from ..arm_facts import ARM_FACTS, Derived
from .row_parts import (  # noqa: F401  (the parts of a row; re-exported)
    AnswerScore, ArmSuffix, BridgeArms, BridgeBoundary, BridgeEndpoints, CacheDiff, Comparison, Endpoints,
    Equivalence, Float, GateFailure, IncrementalArmTokens, IncrementalArms, IncrementalBoundary, Intervention,
    InterventionName, Letter, LetterChoice, LiveArmTokens, LiveArms, LiveBoundary, LogitsDiff, Margins,
    NullPerturbation, PairMargins, PartialIntervention, PartialReplicationInterventions, ReplicaComparison,
    ReplicationInterventions, ReplicationScores, Rule, SuffixPair, TensorDiff, TensorGeometry, TokenIds,
    TransplantOutcome, WholeTensorDiff, _CONFIG,
)

__all__ = [
    "FAILED_ROW_TYPES", "ROW_TYPES", "RowSchemaError", "experiment_of", "validate_row",
    "validate_rows",
    # reads by a key known only at run time
    "AnyComparison", "arm_of", "comparison_of", "outcome_of",
    # value types
    "Float", "InterventionName", "Letter", "Margins", "Rule", "TokenIds",
    # shared parts
    "AnswerScore", "ArmSuffix", "BridgeArms", "BridgeBoundary", "BridgeEndpoints", "CacheDiff", "Comparison",
    "Endpoints", "Equivalence", "GateFailure", "IncrementalArms", "IncrementalArmTokens", "IncrementalBoundary",
    "Intervention", "LetterChoice", "LiveArms", "LiveArmTokens", "LiveBoundary", "LogitsDiff", "NullPerturbation",
    "PairMargins", "PartialIntervention", "PartialReplicationInterventions", "ReplicaComparison",
    "ReplicationInterventions", "ReplicationScores",
    "SuffixPair", "TensorDiff", "TensorGeometry", "TransplantOutcome", "WholeTensorDiff",
    # rows
    "AdaptEvalRow", "BridgeFailedRow", "BridgeRow", "ControlsFailedRow", "ControlsRow", "Exp1FailedRow", "Exp1Row",
    "Exp2FailedRow", "Exp2Row", "ReplicationFailedRow", "ReplicationRow", "TransplantFailedRow", "TransplantRow",
    # a row of either layout, as the row functions return them
    "BridgeRecord", "ControlsRecord", "Exp1Record", "Exp2Record", "ReplicationRecord", "TransplantRecord",
]

# ----------------------------------------------------------------------------- rows


@with_config(_CONFIG)
class Exp1Row(TypedDict):
    """Experiment 1 row (paper §4.1): live decoding to the merge boundary, then the four-arm matrix (``live_vs_prefill_row``)."""
    problem_id: str
    gate_failure: None
    prompt_len: int  # prompt tokens
    prefix_len: int  # tokens up to the boundary, prompt included
    prefix: TokenIds  # the boundary prefix z
    schedule_calls: int  # model calls of the live schedule
    boundary: LiveBoundary
    equivalence: Equivalence | None  # None on rows the float32 gate does not check
    first_token: LiveArmTokens  # first eligible argmax of each arm's boundary logits
    raw_argmax: LiveArmTokens  # unmasked argmax of each arm's boundary logits
    arms: LiveArms
    endpoints: Endpoints  # prefill against live


@with_config(_CONFIG)
class Exp1FailedRow(TypedDict):
    """An Experiment 1 row stopped by a gate: the fields of the stages finished before it (never ``arms``,
    ``endpoints``)."""
    problem_id: str
    gate_failure: GateFailure
    prompt_len: NotRequired[int]  # these four once the live boundary was reached
    prefix_len: NotRequired[int]
    prefix: NotRequired[TokenIds]
    schedule_calls: NotRequired[int]
    boundary: NotRequired[LiveBoundary]  # once the boundary gates passed
    equivalence: NotRequired[Equivalence | None]  # these three once the equivalence gate passed
    first_token: NotRequired[LiveArmTokens]
    raw_argmax: NotRequired[LiveArmTokens]


@with_config(_CONFIG)
class Exp2Row(TypedDict):
    """Experiment 2 row (fixed-prefix precision, paper §4.2): the incremental rebuild of a frozen BF16 prefix against
    prefill, four-arm matrix (``fixed_prefix_row``)."""
    problem_id: str
    gate_failure: None
    prompt_len: int
    prefix_len: int
    prefix: TokenIds
    schedule_calls: int  # model calls of the replayed live schedule
    boundary: IncrementalBoundary
    equivalence: Equivalence | None
    first_token: IncrementalArmTokens
    raw_argmax: IncrementalArmTokens
    arms: IncrementalArms
    endpoints: Endpoints  # prefill against incremental


@with_config(_CONFIG)
class Exp2FailedRow(TypedDict):
    """Experiment 2 row stopped by a gate (the stages of :class:`Exp1FailedRow`)."""
    problem_id: str
    gate_failure: GateFailure
    prompt_len: NotRequired[int]
    prefix_len: NotRequired[int]
    prefix: NotRequired[TokenIds]
    schedule_calls: NotRequired[int]
    boundary: NotRequired[IncrementalBoundary]
    equivalence: NotRequired[Equivalence | None]
    first_token: NotRequired[IncrementalArmTokens]
    raw_argmax: NotRequired[IncrementalArmTokens]


@with_config(_CONFIG)
class ControlsRow(TypedDict):
    """Experiment 2's exploratory controls on one frozen BF16 prefix (``controls_row``)."""
    problem_id: str
    gate_failure: None
    prefix_len: int
    baseline: SuffixPair  # plain BF16 decoding
    fp32_readout: SuffixPair  # the same BF16 caches, final norm and LM head in float32
    null_perturbation: NullPerturbation


@with_config(_CONFIG)
class ControlsFailedRow(TypedDict):
    """A controls row stopped by a gate: nothing is recorded before every suffix is decoded."""
    problem_id: str
    gate_failure: GateFailure
    prefix_len: int


@with_config(_CONFIG)
class BridgeRow(TypedDict):
    """Experiment 3 bridge row (paper §3.6, §3.7, §4.3): a new live boundary against the incremental rebuild of its
    prefix (``bridge_row``)."""
    problem_id: str
    gate_failure: None
    prefix_len: int  # the new live prefix
    prefix: TokenIds
    saved_prefix_len: int  # the problem's saved prefix (the BF16 prefix bank, from Experiment 1)
    same_as_saved: bool  # the new prefix is token-identical to the saved one
    equivalence: Equivalence | None
    boundary: BridgeBoundary
    arms: BridgeArms
    endpoints: BridgeEndpoints


@with_config(_CONFIG)
class BridgeFailedRow(TypedDict):
    """An Experiment 3 row stopped by a gate (never ``boundary``, ``arms``, ``endpoints``)."""
    problem_id: str
    gate_failure: GateFailure
    prefix_len: NotRequired[int]  # these four once the live boundary was reached
    prefix: NotRequired[TokenIds]
    saved_prefix_len: NotRequired[int]
    same_as_saved: NotRequired[bool]
    equivalence: NotRequired[Equivalence | None]  # once the boundary and equivalence gates passed


@with_config(_CONFIG)
class TransplantRow(TypedDict):
    """Experiment 4 row (cache transplant, paper §4.4) on a frozen panel row (``transplant_row``)."""
    problem_id: str
    gate_failure: None
    stratum: Literal["divergent", "exact"]  # the frozen panel's stratum (from Experiment 2)
    prefix_len: int
    prefix: TokenIds
    equivalence: Equivalence | None
    baseline: SuffixPair  # the contemporaneous incremental and prefill suffixes
    interventions: dict[InterventionName, Intervention]


@with_config(_CONFIG)
class TransplantFailedRow(TypedDict):
    """An Experiment 4 row stopped by a gate; ``interventions`` only once ``baseline`` exists (row by row: may be
    partial; the batched runner drops it)."""
    problem_id: str
    gate_failure: GateFailure
    stratum: Literal["divergent", "exact"]
    prefix_len: NotRequired[int]
    prefix: NotRequired[TokenIds]
    equivalence: NotRequired[Equivalence | None]
    baseline: NotRequired[SuffixPair]
    interventions: NotRequired[dict[InterventionName, PartialIntervention]]


@with_config(_CONFIG)
class ReplicationRow(TypedDict):
    """Experiment 5 row (replication on a later checkpoint, paper §4.5): Experiment 4's six arms with the whole-cache
    transplant only, plus each baseline's answer score (``replication_row``)."""
    problem_id: str
    gate_failure: None
    stratum: Literal["panel"]  # the panel is not stratified
    prefix_len: int
    prefix: TokenIds
    equivalence: Equivalence | None
    baseline: SuffixPair
    interventions: ReplicationInterventions
    scores: ReplicationScores


@with_config(_CONFIG)
class ReplicationFailedRow(TypedDict):
    """An Experiment 5 row stopped by a gate (:class:`TransplantFailedRow`'s stages; never ``scores``)."""
    problem_id: str
    gate_failure: GateFailure
    stratum: Literal["panel"]
    prefix_len: NotRequired[int]
    prefix: NotRequired[TokenIds]
    equivalence: NotRequired[Equivalence | None]
    baseline: NotRequired[SuffixPair]
    interventions: NotRequired[PartialReplicationInterventions]


@with_config(_CONFIG)
class AdaptEvalRow(TypedDict):
    """Answer-letter accuracy of one problem under each role-table checkpoint (``adapt.letter_row``); no gates."""
    problem_id: str
    gold: Letter
    gate_failure: None
    checkpoints: dict[str, LetterChoice]  # checkpoint name ("ckpt0": no role rows, "later", ...) -> its choice


ROW_TYPES: Mapping[str, type] = Derived(lambda: {e: _RECORD_TYPES[f.record] for e, f in ARM_FACTS.items()})
"""Experiment (ledger folder prefix) -> the layout of its rows that passed every gate (its
:attr:`~kvreplay.arm_facts.ArmFacts.record`)."""

Exp1Record = Exp1Row | Exp1FailedRow
"""What :func:`kvreplay.experiments.live_vs_prefill.live_vs_prefill_row` returns and Experiment 1's summaries read."""
Exp2Record = Exp2Row | Exp2FailedRow
"""What :func:`kvreplay.experiments.fixed_prefix.fixed_prefix_row` returns and Experiment 2's summaries read."""
ControlsRecord = ControlsRow | ControlsFailedRow
"""What :func:`kvreplay.experiments.controls.controls_row` returns and :func:`~kvreplay.experiments.controls.controls_summary` reads."""
BridgeRecord = BridgeRow | BridgeFailedRow
"""What :func:`kvreplay.experiments.bridge.bridge_row` returns and :func:`~kvreplay.experiments.bridge.bridge_summary` reads."""
TransplantRecord = TransplantRow | TransplantFailedRow
"""What :func:`kvreplay.experiments.transplant.transplant_row` returns and its summary reads."""
ReplicationRecord = ReplicationRow | ReplicationFailedRow
"""What :func:`kvreplay.experiments.replication.replication_row` returns and its summary reads."""

_Entry = TypeVar("_Entry")


def _by_name(entries: Mapping[str, _Entry], name: str, what: str) -> _Entry:
    """``entries[name]``; a missing name raises ``KeyError`` naming ``what`` and the names there are."""
    if name not in entries:
        raise KeyError(f"{what}: no {name!r}; there are {', '.join(entries)}")
    return entries[name]


def arm_of(row: Exp1Row | Exp2Row, arm: str) -> ArmSuffix:
    """One arm of a matrix row by name, when the name is known only at run time (e.g. ``live`` or
    ``incremental``, a summary's ``ref``); a literal name reads as ``row["arms"]["live"]`` instead.

    Raises:
        KeyError: the row has no such arm (Experiment 1 rows have ``live*`` and ``prefill*``, Experiment 2 rows
            ``incremental*`` and ``prefill*``).
    """
    return _by_name(cast(Mapping[str, ArmSuffix], row["arms"]), arm, f"{row['problem_id']} arms")


@with_config(_CONFIG)
class AnyComparison(TypedDict):
    """What :func:`comparison_of` returns: a :class:`Comparison` or a :class:`ReplicaComparison`, read by a name
    known only at run time; ``tensors`` is there for a construction against the reference (test ``"tensors" in``)."""
    cache: CacheDiff
    logits: LogitsDiff
    tensors: NotRequired[list[TensorDiff]]


def comparison_of(row: Exp1Row | Exp2Row, name: str) -> AnyComparison:
    """One boundary comparison of a matrix row by name, when the name is known only at run time (e.g.
    ``prefill_vs_live`` or ``incremental_replica``).

    Raises:
        KeyError: the row has no such comparison.
    """
    boundary = cast(Mapping[str, AnyComparison], row["boundary"])
    return _by_name(boundary, name, f"{row['problem_id']} boundary comparisons")


def outcome_of(intervention: Intervention, direction: str) -> TransplantOutcome:
    """One direction of a transplant by name, when the name is known only at run time
    (``"prefill<-incremental"`` or ``"incremental<-prefill"``, recipient <- donor).

    Raises:
        KeyError: no such direction.
    """
    return _by_name(cast(Mapping[str, TransplantOutcome], intervention), direction, "transplant directions")


FAILED_ROW_TYPES: Mapping[str, type] = Derived(lambda: {
    e: _RECORD_TYPES[f.record.removesuffix("Row") + "FailedRow"] for e, f in ARM_FACTS.items()
    if f.record.removesuffix("Row") + "FailedRow" in _RECORD_TYPES})
"""Experiment -> the layout of its rows whose ``gate_failure`` is set (``adapt_eval`` has no gates)."""

_RECORD_TYPES: dict[str, type] = {t.__name__: t for t in (
    Exp1Row, Exp1FailedRow, Exp2Row, Exp2FailedRow, ControlsRow, ControlsFailedRow, BridgeRow, BridgeFailedRow,
    TransplantRow, TransplantFailedRow, ReplicationRow, ReplicationFailedRow, AdaptEvalRow)}
"""Every row record by name (what :attr:`kvreplay.arm_facts.ArmFacts.record` names)."""


# ----------------------------------------------------------------------------- validation


class RowSchemaError(ValueError):
    """A ledger row does not fit its experiment's schema.

    Attributes:
        experiment: the experiment the row was checked as.
        problem_id: the row's ``problem_id`` (None if it has none).
        row_type: the record it was checked against (a :data:`FAILED_ROW_TYPES` one when its ``gate_failure`` is set).
        path: where the first error is, e.g. ``arms.live.margins[3]`` (``<row>`` for the row itself).
        errors: every error, as pydantic reports them (``loc``, ``msg``, ``type``, ``input``).
    """

    def __init__(self, experiment: str, problem_id: object, row_type: type, path: str, errors: list[dict[str, Any]]):
        self.experiment, self.problem_id, self.row_type, self.path, self.errors = (
            experiment, problem_id, row_type, path, errors)
        first = errors[0]
        got = "" if first["type"] == "missing" else f" (got {_short(first.get('input'))})"
        more = f" (and {len(errors) - 1} more error{'s' * (len(errors) > 2)})" if len(errors) > 1 else ""
        who = f"problem_id {problem_id!r}" if problem_id is not None else "a row without problem_id"
        super().__init__(f"{experiment} ledger, {who}, as {row_type.__name__}: {path}: {first['msg']}{got}{more}")


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _path(loc: Iterable[int | str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<row>"


_Row = TypeVar("_Row", bound=Mapping[str, Any])


@functools.cache
def _adapter(row_type: type) -> TypeAdapter:
    return TypeAdapter(row_type)


def validate_row(experiment: str, row: _Row) -> _Row:
    """Check one row against its experiment's schema (:data:`FAILED_ROW_TYPES` when its ``gate_failure`` is set).

    Args:
        experiment: a :data:`ROW_TYPES` key (see :func:`experiment_of`).
        row: the row as read from the ledger.

    Returns:
        ``row`` itself, unchanged.

    Raises:
        RowSchemaError: a missing or extra key, or a value of the wrong type; the message names the experiment,
            the row's ``problem_id`` and the first error's path.
        ValueError: an unknown experiment.
    """
    if experiment not in ROW_TYPES:
        raise ValueError(f"unknown experiment {experiment!r}; known: {', '.join(sorted(ROW_TYPES))}")
    failed = isinstance(row, dict) and row.get("gate_failure") is not None and experiment in FAILED_ROW_TYPES
    row_type = FAILED_ROW_TYPES[experiment] if failed else ROW_TYPES[experiment]
    try:
        _adapter(row_type).validate_python(row)
    except ValidationError as e:
        errors = cast(list[dict[str, Any]], e.errors(include_url=False))
        pid = row.get("problem_id") if isinstance(row, Mapping) else None
        raise RowSchemaError(experiment, pid, row_type, _path(errors[0]["loc"]), errors) from None
    return row


# A literal experiment types the rows as its record.
# <generated: validate_rows> by python -m kvreplay.ledger.overloads from kvreplay.arm_facts.ARM_FACTS
@overload
def validate_rows(experiment: Literal["exp1"], rows: Iterable[Any]) -> list[Exp1Record]: ...
@overload
def validate_rows(experiment: Literal["exp1_ties"], rows: Iterable[Any]) -> list[Exp1Record]: ...
@overload
def validate_rows(experiment: Literal["exp1_length"], rows: Iterable[Any]) -> list[Exp1Record]: ...
@overload
def validate_rows(experiment: Literal["exp2"], rows: Iterable[Any]) -> list[Exp2Record]: ...
@overload
def validate_rows(experiment: Literal["exp2_controls"], rows: Iterable[Any]) -> list[ControlsRecord]: ...
@overload
def validate_rows(experiment: Literal["exp3"], rows: Iterable[Any]) -> list[BridgeRecord]: ...
@overload
def validate_rows(experiment: Literal["exp4"], rows: Iterable[Any]) -> list[TransplantRecord]: ...
@overload
def validate_rows(experiment: Literal["exp5"], rows: Iterable[Any]) -> list[ReplicationRecord]: ...
@overload
def validate_rows(experiment: Literal["exp2_kernels"], rows: Iterable[Any]) -> list[Exp2Record]: ...
@overload
def validate_rows(experiment: Literal["adapt_eval"], rows: Iterable[Any]) -> list[AdaptEvalRow]: ...
# </generated: validate_rows>
@overload
def validate_rows(experiment: str, rows: Iterable[_Row]) -> list[_Row]: ...
def validate_rows(experiment: str, rows: Iterable[Any]) -> list[Any]:
    """:func:`validate_row` on every row, in order.

    With a literal experiment the result is typed as its record, e.g. ``validate_rows("exp1", rows)`` is
    ``list[Exp1Record]`` (then ``kvreplay.experiments.endpoints.require_gates`` gives ``list[Exp1Row]``): the way
    to read rows you loaded yourself with the static check on.

    Returns:
        the rows themselves, as a list.

    Raises:
        RowSchemaError: at the first row that does not fit.
        ValueError: an unknown experiment.
    """
    return [validate_row(experiment, r) for r in rows]


_FOLDER = re.compile(r"^(?P<experiment>[a-z0-9_]+)-(?P<dtype>[a-z0-9]+)-(?P<digest>[0-9a-f]+)$")


def experiment_of(folder_name: str | Path) -> str:
    """The experiment of a ledger folder ``<experiment>-<dtype>-<digest12>`` (a name or a path).

    Example: ``experiment_of("exp2_controls-bfloat16-2057f13994a1") == "exp2_controls"``.

    Raises:
        ValueError: a name of another shape, or an experiment without a schema.
    """
    name = Path(folder_name).name
    m = _FOLDER.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not a ledger folder name (<experiment>-<dtype>-<digest>)")
    if m["experiment"] not in ROW_TYPES:
        raise ValueError(f"{name!r}: no row schema for experiment {m['experiment']!r}; "
                         f"known: {', '.join(sorted(ROW_TYPES))}")
    return m["experiment"]
