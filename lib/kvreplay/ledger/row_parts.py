"""The parts a ledger row is built from: JSON value types and the nested records the rows of :mod:`.records` hold.

Every record carries :data:`_CONFIG` itself (pydantic, strict, closed). Units are those of :mod:`.records`.
:mod:`.records` re-exports every name here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, ConfigDict, StringConstraints, with_config
from pydantic_core import PydanticCustomError
from typing_extensions import NotRequired, TypedDict  # pydantic needs typing_extensions' TypedDict before Python 3.12



_CONFIG = ConfigDict(extra="forbid", strict=True)
"""Every record below carries this config itself (a nested TypedDict would otherwise be checked only as strictly as
the record that holds it)."""


def _float_not_int(value: object) -> object:
    """Refuse an int (or bool) where the writers always write a float (strict pydantic alone takes ``1`` as ``1.0``)."""
    if isinstance(value, int):
        raise PydanticCustomError("float_type", "Input should be a float, not {kind}", {"kind": type(value).__name__})
    return value


Float = Annotated[float, BeforeValidator(_float_not_int)]
"""A JSON float (``NaN`` and ``Infinity`` included); an int is refused."""
TokenIds = list[int]
"""Token IDs, in order."""
Margins = list[Float | None]
"""Per decoded suffix step: top-1 minus top-2 eligible logit when the model chose the token (logits; exactly 0 is
a tie), ``None`` for a token the block format forced."""
Letter = Annotated[str, StringConstraints(pattern=r"^[A-Z]$")]
"""An answer letter."""
Rule = Literal["boxed", "answer_is", "leading_letter", "option_text", "numeric", "none"]
"""The answer matcher's rule that produced the prediction (``kvreplay.analysis.scoring``)."""
InterventionName = Annotated[
    str, StringConstraints(pattern=r"^(whole|keys_only|values_only|first_half|second_half|layer_\d{2,})$")]
"""A transplant intervention: ``whole`` (primary), ``keys_only``, ``values_only``, ``first_half``, ``second_half``,
``layer_NN`` (exploratory)."""


# ----------------------------------------------------------------------------- shared parts


@with_config(_CONFIG)
class GateFailure(TypedDict):
    """The failed integrity gate of a row (``kvreplay.experiments.matrix.gate_failure``)."""
    gate: str  # the gate's name, e.g. "desync", "replica", "storage", "equivalence"
    reason: str


@with_config(_CONFIG)
class TensorGeometry(TypedDict):
    """Recorded geometry of one tensor (``kvreplay.gates.geometry``)."""
    shape: list[int]
    stride: list[int]  # in elements
    dtype: str  # torch dtype without "torch.", e.g. "bfloat16"
    device: str  # e.g. "cpu", "cuda:0"
    inference: bool  # an inference-mode tensor


@with_config(_CONFIG)
class WholeTensorDiff(TypedDict):
    """A sliding-window layer's whole stored tensor against ``ref`` (every position, attended or not)."""
    exact: bool
    rel_l2: Float
    max_abs: Float
    n_diff: int
    numel: int


@with_config(_CONFIG)
class TensorDiff(TypedDict):
    """Drift of one tensor of ``other`` against ``ref`` (``kvreplay.analysis.drift.tensor_drift``), computed in float64.

    A model with sliding-window layers adds ``layer_kind`` to every K/V tensor; a sliding layer's drift fields
    describe its attended positions (``positions``, the last ``window - 1``), and ``full_tensor`` the whole tensor
    (``kvreplay.analysis.drift.cache_drift``). Rows of full-attention models have none of these keys."""
    tensor: str  # inventory name, e.g. "L00.key", "L27.value", "logits"
    exact: bool  # bit-identical
    max_abs: Float  # largest absolute difference
    l2_diff: Float  # ||other - ref||_2
    l2_ref: Float  # ||ref||_2
    rel_l2: Float  # l2_diff / l2_ref, dimensionless (0 when both are 0, Infinity when only ref is 0)
    n_diff: int  # differing elements
    numel: int  # elements
    ref_geometry: TensorGeometry  # of the stored tensor
    other_geometry: TensorGeometry
    layer_kind: NotRequired[Literal["full", "sliding"]]  # only for models with sliding-window layers
    window: NotRequired[int]  # sliding layers: the window, in positions
    positions: NotRequired[list[int]]  # sliding layers: [start, end) of the attended positions compared
    full_tensor: NotRequired[WholeTensorDiff]  # sliding layers: the whole stored tensor


@with_config(_CONFIG)
class LogitsDiff(TensorDiff):
    """Drift of the boundary next-token logits ``[2, vocab]`` (``kvreplay.analysis.drift.logit_summary``); ``tensor`` is
    ``"logits"``. Argmax, margin and top-k read row 0; the argmax takes the lowest token ID on an exact tie."""
    argmax_ref: int  # token ID
    argmax_other: int
    argmax_agree: bool
    margin_ref: Float  # top-1 minus top-2 logit of ref, in logits
    margin_other: Float
    topk_ref: list[int]  # the 5 highest-scoring token IDs, best first
    topk_other: list[int]


@with_config(_CONFIG)
class CacheDiff(TypedDict):
    """Whole-cache drift over every K and V tensor (``kvreplay.analysis.drift.aggregate``)."""
    exact: bool  # every tensor bit-identical
    rel_l2: Float  # relative L2 over all tensors concatenated, dimensionless
    max_abs: Float
    n_diff: int  # differing elements, summed over tensors (both duplicate batch rows)
    numel: int
    scope: NotRequired[Literal["attended"]]  # models with sliding-window layers: sliding layers' attended positions only


@with_config(_CONFIG)
class Comparison(TypedDict):
    """A construction against the reference at the boundary, per tensor too (``matrix.comparison``, per_tensor)."""
    cache: CacheDiff
    logits: LogitsDiff
    tensors: list[TensorDiff]  # every K and V tensor, in layer order


@with_config(_CONFIG)
class ReplicaComparison(TypedDict):
    """A replica against its original (``matrix.comparison(per_tensor=False)``)."""
    cache: CacheDiff
    logits: LogitsDiff


@with_config(_CONFIG)
class LiveBoundary(TypedDict):
    """Experiment 1's boundary comparisons: prefill against live, and each replica pair."""
    prefill_vs_live: Comparison
    live_replica: ReplicaComparison  # live_replica against live
    prefill_replica: ReplicaComparison  # prefill_replica against prefill


@with_config(_CONFIG)
class IncrementalBoundary(TypedDict):
    """Experiment 2's boundary comparisons: prefill against incremental, and each replica pair."""
    prefill_vs_incremental: Comparison
    incremental_replica: ReplicaComparison
    prefill_replica: ReplicaComparison


@with_config(_CONFIG)
class BridgeBoundary(TypedDict):
    """Experiment 3's boundary comparison: the incremental rebuild against the new live boundary."""
    incremental_vs_live: Comparison


@with_config(_CONFIG)
class Equivalence(TypedDict):
    """The float32 construction-equivalence gate of a row (``matrix.equivalence_record``)."""
    dtype: Literal["float32"]
    compared: Literal["prefill_vs_live", "prefill_vs_incremental"]
    rel_l2: Float  # whole-cache relative L2 of the two float32 constructions
    tolerance: Float  # the gate's bound (kvreplay.gates.EQUIVALENCE_TOLERANCE)


@with_config(_CONFIG)
class AnswerScore(TypedDict):
    """The answer matcher's verdict on a decoded suffix (``kvreplay.analysis.scoring``)."""
    merge_len: int  # merge content tokens
    answer_len: int  # answer content tokens
    answer_text: str  # the format's answer prefix + the decoded answer content
    predicted: str | None  # an upper-case letter (or a canonical number); None when nothing was found
    correct: bool
    rule: Rule


@with_config(_CONFIG)
class ArmSuffix(AnswerScore):
    """One arm's continuation from its boundary through the closed answer block (``matrix.arm_record``)."""
    suffix: TokenIds  # every token after the boundary
    margins: Margins  # one per suffix token
    top_logits: NotRequired[Margins]  # top-1 eligible logit per step (None when forced); ledgers keyed top_logits only


@with_config(_CONFIG)
class LiveArms(TypedDict):
    """Experiment 1's four arms."""
    live: ArmSuffix
    live_replica: ArmSuffix
    prefill: ArmSuffix
    prefill_replica: ArmSuffix


@with_config(_CONFIG)
class IncrementalArms(TypedDict):
    """Experiment 2's four arms."""
    incremental: ArmSuffix
    incremental_replica: ArmSuffix
    prefill: ArmSuffix
    prefill_replica: ArmSuffix


@with_config(_CONFIG)
class BridgeArms(TypedDict):
    """Experiment 3's four arms."""
    live: ArmSuffix
    live_replica: ArmSuffix
    incremental: ArmSuffix
    incremental_replica: ArmSuffix


@with_config(_CONFIG)
class LiveArmTokens(TypedDict):
    """One token ID per Experiment 1 arm, read from its boundary logits."""
    live: int
    live_replica: int
    prefill: int
    prefill_replica: int


@with_config(_CONFIG)
class IncrementalArmTokens(TypedDict):
    """One token ID per Experiment 2 arm, read from its boundary logits."""
    incremental: int
    incremental_replica: int
    prefill: int
    prefill_replica: int


@with_config(_CONFIG)
class Endpoints(TypedDict):
    """The matrix's endpoints, prefill against the reference arm (``matrix.matrix_arms``,
    ``endpoints.divergence_endpoints``)."""
    boundary_exact: bool  # boundary caches bit-identical
    logits_exact: bool  # boundary logits bit-identical
    first_token_agree: bool  # first eligible argmax agrees
    suffix_differs: bool
    merge_differs: bool
    answer_differs: bool  # any answer content token differs
    letter_differs: bool  # the extracted prediction differs
    label_differs: bool  # correctness differs
    first_divergence: int | None  # index of the first differing suffix token (0-based); None when the suffixes agree
    tie_initiated: bool | None  # either arm's margin exactly 0 at first_divergence; None without a divergence


@with_config(_CONFIG)
class BridgeEndpoints(TypedDict):
    """Experiment 3's endpoints: is the incremental rebuild bit-exact to the live boundary?"""
    cache_exact: bool
    layers: int  # layers in the cache
    layers_exact: int  # layers whose K and V are both bit-exact
    logits_exact: bool
    suffix_exact: bool  # the live and incremental suffixes agree


@with_config(_CONFIG)
class PairMargins(TypedDict):
    """Both constructions' per-step margins."""
    incremental: Margins
    prefill: Margins


@with_config(_CONFIG)
class SuffixPair(TypedDict):
    """The incremental and prefill suffixes from one boundary (``controls._pair``, ``transplant._baseline``)."""
    incremental: TokenIds
    prefill: TokenIds
    margins: PairMargins
    suffix_differs: bool
    first_divergence: int | None  # first differing suffix token (0-based), None when the suffixes agree
    tie_initiated: bool | None  # None without a divergence


@with_config(_CONFIG)
class NullPerturbation(TypedDict):
    """The incremental cache perturbed as much as prefill differs from it, at random places
    (``controls.null_perturbation``)."""
    seed: int  # the row's generator seed
    elements_target: int  # elements of one duplicate row where incremental and prefill differ
    elements_changed: int  # elements the perturbation changed (after rounding to the cache dtype)
    rel_l2: Float  # whole-cache relative L2 of the perturbation
    real_rel_l2: Float  # whole-cache relative L2 of prefill against incremental
    suffix: TokenIds  # decoded from the perturbed cache
    margins: Margins
    moved: bool  # the suffix differs from the plain incremental one
    first_divergence: int | None  # against the plain incremental suffix
    tie_initiated: bool | None


@with_config(_CONFIG)
class TransplantOutcome(TypedDict):
    """One direction of a transplant (``transplant._record_intervention``)."""
    outcome: Literal["donor", "recipient", "third", "baseline"]  # whose suffix it follows; "baseline": the two agree
    suffix: TokenIds  # decoded from the hybrid cache
    donated_tensors: int  # tensors taken from the donor


Intervention = TypedDict("Intervention", {
    "kind": Literal["primary", "exploratory"],
    "layers": list[int],  # transplanted layers
    "parts": list[Literal["key", "value"]],
    "prefill<-incremental": TransplantOutcome,  # recipient <- donor
    "incremental<-prefill": TransplantOutcome,
})
Intervention.__doc__ = "One transplant intervention and its outcome in both directions (``transplant._interventions``)."
Intervention.__pydantic_config__ = _CONFIG  # type: ignore[attr-defined]

PartialIntervention = TypedDict("PartialIntervention", {
    "kind": Literal["primary", "exploratory"],
    "layers": list[int],
    "parts": list[Literal["key", "value"]],
    "prefill<-incremental": NotRequired[TransplantOutcome],
    "incremental<-prefill": NotRequired[TransplantOutcome],
})
PartialIntervention.__doc__ = ("An intervention of a gate-failed row: a direction is missing when its transplant or "
                               "decoding failed a gate (``transplant.transplant_row``).")
PartialIntervention.__pydantic_config__ = _CONFIG  # type: ignore[attr-defined]


@with_config(_CONFIG)
class ReplicationInterventions(TypedDict):
    """Experiment 5 runs only the registered primary intervention."""
    whole: Intervention


@with_config(_CONFIG)
class PartialReplicationInterventions(TypedDict):
    """Experiment 5's intervention in a gate-failed row."""
    whole: PartialIntervention


@with_config(_CONFIG)
class ReplicationScores(TypedDict):
    """Experiment 5's answer score of each baseline suffix (``replication.score_suffix``)."""
    incremental: AnswerScore
    prefill: AnswerScore


@with_config(_CONFIG)
class LetterChoice(TypedDict):
    """The answer-letter metric under one checkpoint (``kvreplay.adapt.letter_choice``)."""
    logits: dict[Letter, Float]  # each option letter's next-token logit
    predicted: Letter  # the highest logit, the earlier letter on a tie
    correct: bool
