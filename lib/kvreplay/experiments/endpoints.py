"""Decoded endpoints shared by every experiment: first divergence, exact ties, gate checks (paper §3.6).

A suffix pair *diverges* at its first differing token. The divergence is
*tie-initiated* when, at that step, one arm's top-1 and top-2 logits were
exactly equal (greedy decoding then takes the lowest token ID, so a last-bit
change of the cache can flip it).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, TypeVar, overload

from ..decoding import decode
from ..gates import GateError
from ..ledger.records import (
    AdaptEvalRow,
    BridgeRecord,
    BridgeRow,
    ControlsRecord,
    ControlsRow,
    Endpoints,
    Exp1Record,
    Exp1Row,
    Exp2Record,
    Exp2Row,
    ReplicationRecord,
    ReplicationRow,
    TransplantRecord,
    TransplantRow,
    arm_of,
)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing suffix token (tokens after the boundary, 0-based), or None if identical.

    When one sequence is a strict prefix of the other, the index is the shorter length.
    """
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def is_tie(margins: Sequence[float | None], step: int | None) -> bool:
    """True when ``margins[step]`` is exactly 0: the greedy choice at that step was an exact tie of the top two logits.

    Forced steps (margin ``None``) and steps past the end are not ties.
    """
    return step is not None and step < len(margins) and margins[step] is not None and margins[step] == 0.0


def tie_initiated(margins_a: Sequence[float | None], margins_b: Sequence[float | None], step: int | None) -> bool | None:
    """Whether a first divergence at ``step`` is *tie-initiated*: either arm's margin there is exactly 0.

    Returns ``None`` when there is no divergence (``step`` is None).
    """
    if step is None:
        return None
    return is_tie(margins_a, step) or is_tie(margins_b, step)


def divergence_endpoints(a: "decode.Suffix", b: "decode.Suffix", rec_a: dict, rec_b: dict) -> dict:
    """Disagreement endpoints of two arms' suffixes (paper §4.1), with tie accounting and the predicted letter.

    Returns:
        ``suffix_differs``, ``merge_differs``, ``answer_differs`` (any answer
        token differs), ``letter_differs`` (the extracted answer letter
        differs), ``label_differs`` (correctness differs), ``first_divergence``
        (tokens after the boundary, or None), ``tie_initiated`` (either arm's
        top-1 minus top-2 margin is exactly 0 at the first divergent step;
        None without a divergence).
    """
    fd = first_divergence(a.tokens, b.tokens)
    return {
        "suffix_differs": a.tokens != b.tokens,
        "merge_differs": a.merge != b.merge,
        "answer_differs": a.answer != b.answer,
        "letter_differs": rec_a["predicted"] != rec_b["predicted"],
        "label_differs": rec_a["correct"] != rec_b["correct"],
        "first_divergence": fd,
        "tie_initiated": tie_initiated(a.margins, b.margins, fd),
    }


# An empty sequence fits every overload below (mypy's overload-overlap); any row of it picks exactly one.
@overload
def require_gates(records: Sequence[Exp1Record]) -> list[Exp1Row]: ...  # type: ignore[overload-overlap]
@overload
def require_gates(records: Sequence[Exp2Record]) -> list[Exp2Row]: ...  # type: ignore[overload-overlap]
@overload
def require_gates(records: Sequence[ControlsRecord]) -> list[ControlsRow]: ...  # type: ignore[overload-overlap]
@overload
def require_gates(records: Sequence[BridgeRecord]) -> list[BridgeRow]: ...
@overload
def require_gates(records: Sequence[TransplantRecord]) -> list[TransplantRow]: ...
@overload
def require_gates(records: Sequence[ReplicationRecord]) -> list[ReplicationRow]: ...
@overload
def require_gates(
    records: Sequence[TransplantRecord | ReplicationRecord]) -> list[TransplantRow | ReplicationRow]: ...
@overload
def require_gates(records: Sequence[AdaptEvalRow]) -> list[AdaptEvalRow]: ...
def require_gates(records: Sequence[Any]) -> list[Any]:
    """Refuse to report endpoints unless every row passed every gate (gates are conjunctive).

    Args:
        records: an experiment's ledger rows (:mod:`kvreplay.ledger.records`), each passed or failed.

    Returns:
        the same rows, as a list typed as rows that passed every gate (e.g. ``list[Exp1Row]`` for
        ``Sequence[Exp1Record]``), so a summary reads their stages without a check per row.

    Raises:
        GateError: gate ``report``, naming the failed rows and their gates.
    """
    failed = [(r["problem_id"], r["gate_failure"]["gate"]) for r in records if r.get("gate_failure")]
    if failed:
        raise GateError("report", f"{len(failed)} row(s) failed integrity gates, endpoints withheld: {failed}")
    return list(records)


K = TypeVar("K", bound=Hashable)


def paired_with_reference(reference: Sequence[Exp1Record], others: Mapping[K, Sequence[Exp1Record]], reference_key: K,
                          what: str) -> dict[K, list[Exp1Row]]:
    """Experiment 1's rows and those of the arms rerun beside it (a tie rule, a branch cap), gated and paired.

    Returns:
        ``reference_key`` -> the reference's rows, then each key of ``others`` -> its rows: every arm on the
        reference's problems in the reference's order, so a row pairs with its reference row (exact McNemar).

    Raises:
        GateError: a row failed a gate (``report``).
        ValueError: ``others`` holds ``reference_key`` (its arm is Experiment 1 itself), or an arm's problems
            differ from the reference's; ``what`` names the key in the message (e.g. ``"tie rule"``).
    """
    if reference_key in others:
        raise ValueError(f"{what} {reference_key!r} is the chain's own: its arm is Experiment 1 itself")
    ids = [r["problem_id"] for r in reference]
    out: dict[K, list[Exp1Row]] = {}
    for key, records in {reference_key: reference, **others}.items():
        out[key] = require_gates(records)
        if [r["problem_id"] for r in out[key]] != ids:
            raise ValueError(f"{what} {key!r}: its rows are not the reference's problems in the same order")
    return out


def with_derived_endpoints(rec: Exp1Row | Exp2Row, ref: str) -> Endpoints:
    """A row's endpoints; rows of row-algorithm version 1 (which recorded neither ``letter_differs`` nor
    ``tie_initiated``) get them derived from the arms' recorded predictions and margins, as version 2 computes them."""
    ep = rec["endpoints"]
    if "letter_differs" in ep and "tie_initiated" in ep:
        return ep
    a, b = arm_of(rec, ref), rec["arms"]["prefill"]
    return ep | {"letter_differs": a["predicted"] != b["predicted"],
                 "tie_initiated": tie_initiated(a["margins"], b["margins"], ep["first_divergence"])}


def rate_text(p) -> str:
    """``k/n (rate; Wilson CI)`` of a Proportion, or a note when the stratum is empty."""
    return p.pct() if p is not None else "n/a (no rows in this stratum)"
