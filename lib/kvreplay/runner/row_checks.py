"""What an arm checks before its first row is decoded: which rows get the live check, and that every prompt
builds and fits the model's context (paper §3.9). Re-exported by :mod:`kvreplay.runner.spec`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from ..decoding.contract import BlockFormat, Caps, ContractError
from ..data.problems import Problem


LIVE_CHECK_FRACTION = 1.0
"""Default share of an arm's non-preflight rows whose live boundary is checked (``ArmSettings.live_check_fraction``).

Every row. The check replays the live call schedule once more: as many forward calls (engine: steps) as live
decoding. Measured with the embedded model in BF16 on 2 CPU cores (eager path): +25 to +54 % forward calls per
row at the cpu profile's caps (36 s of checks on 121 s of three rows, +30 %), +51 % at smoke caps; the engine's
eager path at smoke caps (B = 2): +51 % calls. On the engine a smaller fraction saves little: a chunk's sampled
problems are rebuilt together, and a step with idle slots costs as much as a full one.
"""

LIVE_CHECK_SALT = "live_equals_incremental"
"""Salt of the live-check sample's hash (:func:`live_check_ids`)."""


def live_check_ids(problem_ids: Sequence[str], preflight: int, fraction: float) -> frozenset[str]:
    """The rows whose live boundary is checked (gate ``live_equals_incremental``), fixed before any row is computed.

    The first ``preflight`` rows always; any other row when ``u < fraction``, where ``u`` in [0, 1) is the first
    64 bits of sha256(``"live_equals_incremental:<problem_id>"``) over 2**64. Outcome-blind, and a problem's
    membership does not depend on the other problems or their order.

    Args:
        problem_ids: the arm's problems in frozen order.
        preflight: the arm's preflight rows.
        fraction: the share of the other rows to sample, in [0, 1] (1: every row).

    Raises:
        ValueError: ``fraction`` outside [0, 1].
    """
    import hashlib

    if not 0 <= fraction <= 1:
        raise ValueError(f"live_check_fraction must lie in [0, 1], got {fraction!r}")

    def drawn(pid: str) -> bool:
        u = int(hashlib.sha256(f"{LIVE_CHECK_SALT}:{pid}".encode()).hexdigest()[:16], 16) / 2**64
        return u < fraction

    return frozenset(list(problem_ids)[:preflight]) | frozenset(p for p in problem_ids if drawn(p))


def check_counts(settings: Any) -> None:
    """Refuse counts of an :class:`~kvreplay.runner.spec.ArmSettings` that no profile could hold
    (:class:`kvreplay.notebook.profiles.ChainParameters`): ``preflight`` below 0; a cap, ``batch``, ``chunk`` or ``workers``
    below 1; any of them not a whole number.

    Raises:
        ValueError: naming the field and its value.
    """
    caps = settings.caps
    for name, value, least in (("preflight", settings.preflight, 0), ("batch", settings.batch, 1),
                               ("workers", settings.workers, 1), ("chunk", 1 if settings.chunk is None else settings.chunk, 1),
                               ("caps.branch", caps.branch, 1), ("caps.merge", caps.merge, 1),
                               ("caps.answer", caps.answer, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"ArmSettings: {name} must be a whole number of at least {least}, got {value!r}")


def check_prompts(
    fmt: BlockFormat, problems: Sequence[Problem], max_positions: int | None = None, *, caps: Caps | None = None,
) -> None:
    """Build every prompt before a run so a bad problem fails before any row is decoded.

    With ``max_positions`` (the model's context) and ``caps``, refuse also a problem whose longest full sequence
    (:meth:`BlockFormat.max_sequence_length`: prompt + every delimiter +
    3 x branch cap + merge cap + answer cap, in tokens) needs more positions
    than the model has.

    Args:
        fmt: the resolved block format.
        problems: the arm's problems.
        max_positions: positions the model supports (``max_position_embeddings``), or ``None`` to skip the length check.
        caps: content caps; required when ``max_positions`` is given.

    Raises:
        ContractError: naming the problem ID, its file and line (:attr:`~kvreplay.data.problems.Problem.where`)
            and, for the length check, the positions needed and available.
        ValueError: ``max_positions`` given without ``caps``.
    """
    if max_positions is not None and caps is None:
        raise ValueError("check_prompts: max_positions needs the caps to bound the sequence length")
    for p in problems:
        try:
            ids = fmt.prompt_ids(p.question, p.options)
        except ContractError as e:
            raise ContractError(f"problem {p.problem_id} ({p.where}): {e}") from e
        if max_positions is None:
            continue
        assert caps is not None  # refused above: max_positions is given, so caps is too
        need = fmt.max_sequence_length(len(ids), caps)
        if need > max_positions:
            raise ContractError(
                f"problem {p.problem_id} ({p.where}): its full sequence can need {need} "
                f"positions (prompt {len(ids)} tokens + delimiters {fmt.delimiter_tokens()} + 3 x branch cap "
                f"{caps.branch} + merge cap {caps.merge} + answer cap {caps.answer}), but the model has only "
                f"{max_positions} (max_position_embeddings). Shorten the question, lower the caps, or leave the "
                f"problem out."
            )


EQUIVALENCE_SAMPLE_SIZE = 2
"""Non-preflight rows per 32 rows of a chunk (and at least this many) whose boundary prefix gets the float32
construction-equivalence check in a run below float32 (:func:`sample_size`; docs/gates.md)."""

EQUIVALENCE_SAMPLE_PER = 32
"""The chunk rows that each :data:`EQUIVALENCE_SAMPLE_SIZE` sampled rows cover."""

EQUIVALENCE_SAMPLE_SALT = "construction_equivalence"
"""Salt (the seed) of the equivalence sample's draw (:func:`equivalence_sample`)."""

EAGER_SAMPLE_CHUNK = 8
"""Rows of an eager run that form one chunk of the equivalence sample (a batched run: its engine chunk)."""


def sample_size(rows: int) -> int:
    """Rows of a chunk of ``rows`` rows that get the sampled check: ceil(2 * rows / 32), at least 2 (200 rows: 13)."""
    return max(EQUIVALENCE_SAMPLE_SIZE, -(-EQUIVALENCE_SAMPLE_SIZE * rows // EQUIVALENCE_SAMPLE_PER))


def equivalence_sample(records: Sequence[Mapping[str, Any]], skip: frozenset[str] = frozenset(),
                       size: int | None = None) -> list[str]:
    """The problem IDs of one chunk's rows whose prefix gets the sampled float32 equivalence check.

    Candidates: rows with a ``prefix`` (token IDs), no ``gate_failure`` and an ID not in ``skip`` (the preflight
    rows, checked inside their rows). The longest prefix comes first (ties: the smaller ID), then the others in
    the order of sha256(``"construction_equivalence:<problem_id>"``), up to ``size`` rows in all (default
    :func:`sample_size` of the chunk's rows).
    """
    import hashlib

    size = sample_size(len(records)) if size is None else size
    rows = [r for r in records if r.get("prefix") and not r.get("gate_failure") and r["problem_id"] not in skip]
    if not rows or size < 1:
        return []
    longest = min(rows, key=lambda r: (-len(r["prefix"]), r["problem_id"]))["problem_id"]
    drawn = sorted((r["problem_id"] for r in rows if r["problem_id"] != longest),
                   key=lambda pid: hashlib.sha256(f"{EQUIVALENCE_SAMPLE_SALT}:{pid}".encode()).hexdigest())
    return [longest, *drawn[: size - 1]]


def check_chunk(records: Sequence[Mapping[str, Any]], spec: Any, problems: Mapping[str, Any], skip: frozenset[str],
                log: Callable[..., None]) -> None:
    """The sampled float32 check of one chunk's ``records``, logged as an ``equivalence_sample`` event.

    The event names every row of the chunk (``rows``), ``passed``, and each sampled row's ``problem_id``,
    ``prefix_len``, ``rel_l2`` (or ``error``) and ``seconds`` (rows checked together share the call's seconds).

    The check is :func:`kvreplay.runner.equivalence.construction_equivalences` (imported, never registered).

    Raises:
        GateError: the first sampled row's failure, after logging ``passed: false``.
    """
    import time

    from .equivalence import construction_equivalences

    rows = [r["problem_id"] for r in records]
    ids = equivalence_sample(records, skip)
    by_id = {r["problem_id"]: r for r in records}
    t0 = time.perf_counter()
    results = construction_equivalences(spec, [(problems[pid], by_id[pid]["prefix"]) for pid in ids]) if ids else []
    seconds = round(time.perf_counter() - t0, 3)
    checks = [{"problem_id": pid, "prefix_len": len(by_id[pid]["prefix"]), "seconds": seconds}
              | ({"error": str(out)} if isinstance(out, Exception) else {"rel_l2": out["rel_l2"]})
              for pid, out in zip(ids, results, strict=True)]
    failed = [out for out in results if isinstance(out, Exception)]
    log(event="equivalence_sample", passed=not failed, checks=checks, rows=rows)
    if failed:
        raise failed[0]


def sampled_equivalence(mapper: Callable[[list[Any]], Iterable[Mapping[str, Any]]], spec: Any,
                        problems: Mapping[str, Any], skip: frozenset[str], chunk: int,
                        log: Callable[..., None], key: Callable[[Any], str] = lambda p: p.problem_id,
                        ) -> Callable[[list[Any]], Iterator[Mapping[str, Any]]]:
    """``mapper`` with the sampled float32 construction-equivalence check after each chunk of ``chunk`` records.

    Before the first record of a chunk is yielded (and so appended), the run log gets an ``equivalence_pending``
    event naming the chunk's rows. Until a passing ``equivalence_sample`` event names them again, every reader
    refuses them, and the arm's next run re-checks them (:mod:`kvreplay.ledger.checked`). Records pass through
    unchanged, each yielded before its chunk is checked (:func:`check_chunk`), so a crash loses no more.

    Raises:
        GateError: the check's (``equivalence``), after logging ``passed: false``; the chunk's rows stay in the
            ledger, refused by every reader and by the arm.
    """
    def mapped(items: list[Any]) -> Iterator[Mapping[str, Any]]:
        held: list[Mapping[str, Any]] = []
        for n, rec in enumerate(mapper(items)):
            if n % chunk == 0:
                log(event="equivalence_pending", rows=[key(it) for it in items[n: n + chunk]])
            yield rec
            held.append(rec)
            if len(held) == chunk:
                check_chunk(held, spec, problems, skip, log)
                held = []
        if held:
            check_chunk(held, spec, problems, skip, log)

    return mapped


def recheck_pending(records: Sequence[Mapping[str, Any]], spec: Any, problems: Mapping[str, Any],
                    skip: frozenset[str], chunk: int, log: Callable[..., None]) -> None:
    """The sampled check of committed rows whose check never ran (a kill, Ctrl-C or crash before it), in chunks of
    ``chunk`` rows in ledger order, before any new row of the arm (:func:`check_chunk`).

    Raises:
        GateError: as :func:`check_chunk`; the chunk's rows are then failed for good.
    """
    for i in range(0, len(records), chunk):
        check_chunk(records[i: i + chunk], spec, problems, skip, log)


def failed_equivalence_samples(events: Iterable[Mapping[str, Any]]) -> list[str]:
    """The rows of every chunk whose sampled equivalence check failed, from a ledger's run-log events."""
    return [pid for e in events if e.get("event") == "equivalence_sample" and e.get("passed") is False
            for pid in e.get("rows", [])]
