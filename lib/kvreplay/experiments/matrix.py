"""The four-arm matrix of Experiments 1 and 2: reference, its replica, prefill and its replica (paper §3.5).

For one problem and one boundary (the live or incremental cache at the end
of the merge block), the prefill cache is built from the same token IDs in
one call, and each arm gets a storage-isolated replica. The gates run: roles,
positions, token IDs, replicas bit-exact, storage disjoint. A run below float32 adds
the float32 construction-equivalence gate on preflight rows and, with a live reference,
the ``live_equals_incremental`` gate on the preflight rows and a declared sample (:func:`check_live`).
Every arm continues greedily, and the record keeps the boundary comparisons and the decoded endpoints.
:func:`matrix_summary` and :func:`matrix_table` turn the records of an arm into
its endpoint table, with the rows whose drift is far outside the arm's own
distribution flagged (:func:`drift_outliers`); they live in
:mod:`kvreplay.experiments.matrix_summary`.

Every construction of a row is pinned to one function. A float32 run compares
prefill with the reference on every row (:func:`equivalence_record`); a run
below float32 compares incremental with prefill in a float32 copy of the model
(:func:`construction_equivalence`) and live with its incremental rebuild bit
for bit (:func:`check_live`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from ..decoding import caches, decode
from ..analysis import drift
from .. import engine, gates
from ..engine import Measured
from ..gates import GateError
from ..data.problems import Problem
from ..runner import RunSpec
from ..runner.equivalence import (  # re-exported: the float32 construction-equivalence check lives in the runner
    _FP32_COPIES,
    EQUIVALENCE_BATCH,
    construction_equivalence,
    construction_equivalences,
    float32_copy,
)
from ..runner.equivalence import boundary_windows as _windows
from ..analysis.scoring import score_answer
from .endpoints import divergence_endpoints
from .matrix_summary import DRIFT_OUTLIER_FACTOR, drift_outliers, matrix_summary, matrix_table  # re-exported


def arm_record(spec: RunSpec, problem: Problem, suffix: decode.Suffix) -> dict:
    """One arm's suffix record (``ArmSuffix``); with ``spec.decoding.top_logits`` also its steps' top-1 eligible logits."""
    tok = spec.lm.tokenizer
    text = spec.fmt.answer_prefix_text + cast(str, tok.decode(suffix.answer))  # one flat ID list decodes to one str
    score = score_answer(text, problem.answer, problem.options)
    rec = {
        "suffix": suffix.tokens,
        "margins": suffix.margins,
        "merge_len": len(suffix.merge),
        "answer_len": len(suffix.answer),
        "answer_text": text,
        "predicted": score.predicted,
        "correct": score.correct,
        "rule": score.rule,
    }
    if spec.decoding.top_logits:
        if len(suffix.tops) != len(suffix.margins):
            raise ValueError(f"problem {problem.problem_id}: {len(suffix.tops)} top-1 logits for "
                             f"{len(suffix.margins)} suffix steps (a decoder that did not record them)")
        rec["top_logits"] = suffix.tops
    return rec


def boundary_gates(states: dict[str, decode.Boundary], dtype: torch.dtype, pairs: Sequence[tuple[str, str]]) -> None:
    """All boundary gates of a row, in a fixed order (dtype, non-finite, functional state, desync, replicas, storage).

    Args:
        states: arm name -> boundary state.
        dtype: the run's dtype.
        pairs: replica pairs that must be exact.

    Raises:
        GateError: the first gate that fails.
    """
    for name, s in states.items():
        gates.check_dtype(name, caches.boundary_tensors(s), dtype)
    for name, s in states.items():
        gates.check_finite(name, caches.boundary_tensors(s))
    gates.check_functional_state(states)
    for name, s in states.items():
        gates.check_duplicates(name, caches.boundary_tensors(s))
    for a, b in pairs:
        gates.check_exact(f"{a} vs {b}", caches.boundary_tensors(states[a]), caches.boundary_tensors(states[b]))
    gates.check_disjoint({n: [t for _, t in caches.boundary_tensors(s)] for n, s in states.items()})


def comparison(ref: decode.Boundary, other: decode.Boundary, per_tensor: bool) -> dict[str, Any]:
    """Drift of ``other`` against ``ref``: whole-cache aggregate, boundary logits, optionally every tensor.

    With sliding-window layers (``ref.windows``) the drift is the attended state's (:func:`kvreplay.analysis.drift.cache_drift`).
    """
    rows = drift.cache_drift(gates.cache_tensors(ref.cache), gates.cache_tensors(other.cache), _windows(ref, other))
    out: dict[str, Any] = {"cache": drift.aggregate(rows), "logits": drift.logit_summary(ref.logits, other.logits)}
    if per_tensor:
        out["tensors"] = rows
    return out


def equivalence_record(spec: RunSpec, problem: Problem, prefix: Sequence[int], own: dict | None = None,
                       own_name: str = "") -> dict | None:
    """The construction-equivalence check of one row, or None when this row is not checked.

    A float32 run checks every row from its own comparison ``own`` (whole-cache
    drift of prefill against the reference); a lower-precision run checks its
    :attr:`RunSpec.equivalence_ids` rows with :func:`construction_equivalence`.

    Raises:
        GateError: gate ``equivalence``.
    """
    if spec.lm.dtype == torch.float32 and own is not None:
        rel = own["cache"]["rel_l2"]
        gates.check_equivalence(f"{own_name} (float32 run)", rel)
        return {"dtype": "float32", "compared": own_name, "rel_l2": rel, "tolerance": gates.EQUIVALENCE_TOLERANCE}
    if problem.problem_id in spec.equivalence_ids:
        return construction_equivalence(spec, problem, prefix)
    return None


def live_check_due(spec: RunSpec, problem: Problem, ref: decode.Boundary) -> bool:
    """Whether this row's reference gets the ``live_equals_incremental`` gate: a live reference, a run below
    float32, and a problem among :attr:`RunSpec.live_check_ids` (float32 runs check every row through
    :func:`equivalence_record` instead)."""
    return ref.construction == "live" and spec.lm.dtype != torch.float32 and problem.problem_id in spec.live_check_ids


def rebuild_lives(spec: RunSpec, problems: Sequence[Problem], lives: Sequence[decode.Boundary]) -> Measured:
    """The incremental rebuild of live boundaries through the path that made them (paper §3.6, the bridge).

    Eager runs: :func:`kvreplay.decoding.decode.build_incremental`, one problem at a time. Batched runs
    (``spec.engine``): :func:`kvreplay.engine.build_incrementals` at the run's batch shape
    (``spec.engine``, :meth:`~kvreplay.runner.RunSpec.batched`), every prefix in one call. A problem's bits
    do not depend on its slot or companions (the ``composition`` gate), so the rebuild's bits are live's when both compute one function.

    Returns:
        Per live boundary, its ``"incremental"`` :class:`~kvreplay.decoding.decode.Boundary` (caches
        ``[2, kv_heads, |z|, head_dim]``, logits ``[2, vocab]``, the run's dtype) or the ``GateError`` that stopped it,
        with the engine's ``stats`` (none for an eager run).
    """
    if spec.engine is not None:
        return engine.build_incrementals(spec.lm, spec.fmt, [live.ids for live in lives], run=spec.batched(), on_gate_error="return")
    out: Measured = Measured()
    for p, live in zip(problems, lives):
        try:
            out.append(decode.build_incremental(spec.lm, spec.fmt, live.ids, where=p.problem_id))
        except GateError as e:
            out.append(e)
    return out


def check_live(spec: RunSpec, problem: Problem, live: decode.Boundary, rebuilt=None, seconds: float = 0.0) -> None:
    """The ``live_equals_incremental`` gate of one row: live's boundary equals its incremental rebuild bit for bit.

    The rebuild replays the live call schedule from live's token IDs by teacher forcing
    (:func:`rebuild_lives`) and must give every cache tensor and the boundary logits bit for bit. With the
    float32 check of incremental against prefill (:func:`construction_equivalence`), this pins live,
    incremental and prefill to one function in a run below float32. A pass adds nothing to the row; it is
    appended to :attr:`RunSpec.live_checks` for the arm's run log.

    Args:
        live: the live boundary (caches ``[2, kv_heads, |z|, head_dim]``, logits ``[2, vocab]``), before any suffix.
        rebuilt: its rebuild, or the ``GateError`` that stopped it (from :func:`rebuild_lives`); ``None``: rebuilt here.
        seconds: time already spent on ``rebuilt`` (a chunk's joint rebuild, shared), for the run log.

    Raises:
        GateError: ``live_equals_incremental`` naming the first tensor that differs, or the rebuild's own gate
            (``desync``, ``nonfinite``).
    """
    t0 = time.perf_counter()
    if rebuilt is None:
        rebuilt = rebuild_lives(spec, [problem], [live])[0]
    if isinstance(rebuilt, GateError):
        raise rebuilt
    gates.check_live_equals_incremental(live, rebuilt, f"problem {problem.problem_id}")
    spec.live_checks.append({"gate": "live_equals_incremental", "problem_id": problem.problem_id,
                             "seconds": round(seconds + time.perf_counter() - t0, 3)})


def matrix_row(spec: RunSpec, problem: Problem, rec: dict, ref: decode.Boundary) -> dict:
    """The matched four-arm matrix around a reference boundary state (paper §3.5, §3.6).

    Arms: the reference (``live`` in Experiment 1, ``incremental`` in
    Experiment 2), its deep-copy replica (verified), ``prefill`` (one call over
    z) and ``prefill_replica`` (an independent second call). Every arm
    continues through :func:`kvreplay.decoding.decode.decode_suffix`.

    Fills ``rec`` with ``boundary`` (drift of prefill against the reference,
    per tensor, and of each replica pair), ``first_token``, ``raw_argmax``,
    ``arms`` and ``endpoints``.

    Raises:
        GateError: the first gate that fails (callers record it).
    """
    states = matrix_states(spec, problem, rec, ref)
    arms = {n: decode.decode_suffix(spec.lm, spec.fmt, s, spec.decoding) for n, s in states.items()}
    return matrix_arms(spec, problem, rec, ref.construction, arms)


def matrix_states(spec: RunSpec, problem: Problem, rec: dict, ref: decode.Boundary, rebuilt=None,
                  seconds: float = 0.0) -> dict[str, decode.Boundary]:
    """The four boundary states of the matrix, gated and summarised (:func:`matrix_row` up to the suffixes).

    Checks that the prefix and its longest suffix fit the model (:meth:`RunSpec.check_prefix`), builds the
    reference's replica and the two prefill calls, runs the fault hook, :func:`boundary_gates` and, when due
    (:func:`live_check_due`), :func:`check_live`, and fills ``rec`` with ``boundary``,
    ``equivalence``, ``first_token`` and ``raw_argmax``.

    Args:
        rebuilt, seconds: the live reference's incremental rebuild made ahead (:func:`rebuild_lives`), and its time;
            ``None``: rebuilt here when due.

    Returns:
        arm name -> boundary state (caches ``[2, kv_heads, |z|, head_dim]``), in the arms' order.

    Raises:
        GateError: the first gate that fails.
        ContractError: the prefix and its longest suffix need more positions than the model has.
    """
    lm, fmt = spec.lm, spec.fmt
    r = ref.construction
    z = ref.ids
    spec.check_prefix(problem, z)
    states = {
        r: ref,
        f"{r}_replica": caches.live_replica(ref),
        "prefill": decode.build_prefill(lm, fmt, z, where=problem.problem_id),
    }
    states["prefill_replica"] = decode.build_prefill(lm, fmt, z, where=problem.problem_id)
    states["prefill_replica"].construction = "prefill_replica"
    if spec.faults:
        spec.faults(states)
    boundary_gates(states, lm.dtype, [(r, f"{r}_replica"), ("prefill", "prefill_replica")])
    if live_check_due(spec, problem, ref):
        check_live(spec, problem, ref, rebuilt, seconds)
    key = f"prefill_vs_{r}"
    rec["boundary"] = {
        key: comparison(ref, states["prefill"], per_tensor=True),
        f"{r}_replica": comparison(ref, states[f"{r}_replica"], per_tensor=False),
        "prefill_replica": comparison(states["prefill"], states["prefill_replica"], per_tensor=False),
    }
    rec["equivalence"] = equivalence_record(spec, problem, z, rec["boundary"][key], key)
    rec["first_token"] = {n: decode.first_eligible_argmax(fmt, s.logits[0], spec.decoding.tie_rule, len(s.ids)) for n, s in states.items()}
    rec["raw_argmax"] = {n: decode.raw_argmax(s.logits[0]) for n, s in states.items()}
    return states


def matrix_arms(spec: RunSpec, problem: Problem, rec: dict, r: str, arms: dict[str, decode.Suffix]) -> dict:
    """The matrix's suffix gates and endpoints from the four arms' suffixes (:func:`matrix_row` after decoding).

    Args:
        r: the reference construction (``live`` or ``incremental``).
        arms: arm name -> its :class:`~kvreplay.decoding.decode.Suffix`, in the arms' order.

    Returns:
        ``rec``, with ``arms`` and ``endpoints``.

    Raises:
        GateError: ``suffix_replica``.
    """
    for a, b in ((r, f"{r}_replica"), ("prefill", "prefill_replica")):
        gates.check_equal_sequences("suffix_replica", f"{a} vs {b}", arms[a].tokens, arms[b].tokens)
    rec["arms"] = {n: arm_record(spec, problem, s) for n, s in arms.items()}
    key = f"prefill_vs_{r}"
    rec["endpoints"] = {
        "boundary_exact": rec["boundary"][key]["cache"]["exact"],
        "logits_exact": rec["boundary"][key]["logits"]["exact"],
        "first_token_agree": rec["first_token"][r] == rec["first_token"]["prefill"],
        **divergence_endpoints(arms[r], arms["prefill"], rec["arms"][r], rec["arms"]["prefill"]),
    }
    return rec


def gate_failure(e: GateError) -> dict:
    """The ledger's ``gate_failure`` field for a failed gate: ``{"gate", "reason"}``."""
    return {"gate": e.gate, "reason": e.reason}


def raise_gate_errors(results: Sequence) -> None:
    """Raise the first :class:`~kvreplay.gates.GateError` among a problem's engine results (in their order), if any."""
    for x in results:
        if isinstance(x, GateError):
            raise x


def decode_groups(spec: RunSpec, groups: Sequence[Sequence[decode.Boundary]],
                  readout: decode.FP32Readout | None = None) -> Measured[list]:
    """Every boundary of every group through one :func:`kvreplay.engine.decode_suffixes` (``spec.engine``), regrouped.

    Args:
        groups: per problem, its boundary states (caches ``[2, kv_heads, |z|, head_dim]``), in decoding order.
        readout: FP32 readout of every step's logits (the controls), else the model's head.

    Returns:
        Per group, one :class:`~kvreplay.decoding.decode.Suffix` per boundary, or the ``GateError`` that stopped it; with the
        engine's ``stats``.

    Raises:
        ContractError: a suffix did not close its answer block.
    """
    flat = [b for g in groups for b in g]
    decoded = engine.decode_suffixes(spec.lm, spec.fmt, flat, spec.decoding, run=spec.batched(), on_gate_error="return", readout=readout)
    out = iter(decoded)
    return Measured([[next(out) for _ in g] for g in groups], decoded.stats)


def matrix_chunk(spec: RunSpec, problems: Sequence[Problem], refs: Sequence, heads: Sequence[Callable]) -> Measured[dict]:
    """The four-arm matrix of a chunk of problems, phase by phase: boundaries given, then every suffix in one decode.

    The batched runners of Experiments 1 and 2 use :func:`matrix_pipeline` (one engine for boundaries and
    suffixes, the same bits); this phase-wise schedule is its reference in the tests.

    The live references due for :func:`check_live` are first rebuilt together
    (:func:`rebuild_lives`, one engine call at the run's batch shape). Per
    problem, in order: its reference boundary (or the ``GateError`` that
    stopped it); ``heads[i](rec, ref)`` (the experiment's prefix fields);
    :func:`matrix_states` (replica, the two prefill calls and every boundary
    gate, as one problem at a time). Then every arm of every problem still
    clean continues through :func:`kvreplay.engine.decode_suffixes` in one
    batched decode (``spec.engine``), and :func:`matrix_arms` finishes each
    record. A record has exactly the keys :func:`matrix_row` gives it; a
    gate failure of one problem (boundary, suffix) is recorded in its record
    only, the first failing arm in the arms' order.

    Returns:
        One record per problem, in order, with what this call's engines measured (the references given were
        built before it: their engines' stats are the caller's to add).

    Raises:
        ContractError: a suffix did not close its answer block.
    """
    recs: list[dict] = [{"problem_id": p.problem_id, "gate_failure": None} for p in problems]
    due = [i for i, (p, ref) in enumerate(zip(problems, refs)) if not isinstance(ref, GateError)
           and live_check_due(spec, p, ref)]
    t0 = time.perf_counter()
    rebuilds = rebuild_lives(spec, [problems[i] for i in due], [refs[i] for i in due])
    rebuilt = dict(zip(due, rebuilds))
    share = (time.perf_counter() - t0) / max(1, len(due))
    pending: list[tuple[int, dict]] = []
    for i, (p, ref, head, rec) in enumerate(zip(problems, refs, heads, recs)):
        try:
            if isinstance(ref, GateError):
                raise ref
            head(rec, ref)
            pending.append((i, matrix_states(spec, p, rec, ref, rebuilt.pop(i, None), share)))
        except GateError as e:
            rec["gate_failure"] = gate_failure(e)
    decoded = decode_groups(spec, [list(states.values()) for _, states in pending])
    for (i, states), suffixes in zip(pending, decoded):
        rec = recs[i]
        try:
            raise_gate_errors(suffixes)
            matrix_arms(spec, problems[i], rec, refs[i].construction, dict(zip(states, suffixes)))
        except GateError as e:
            rec["gate_failure"] = gate_failure(e)
    return Measured(recs, rebuilds.stats + decoded.stats)


def matrix_pipeline(spec: RunSpec, problems: Sequence[Problem], construction: str, starts: Sequence[Sequence[int]],
                    heads: Sequence[Callable]) -> Measured[dict]:
    """The four-arm matrix of a chunk with one engine for boundaries and suffixes, its slots kept full.

    The records of :func:`matrix_chunk`, bit for bit at the same batch shape, by another schedule
    (:func:`kvreplay.engine.decode_chains`). Every problem's reference boundary is built in the engine
    (``construction`` ``"live"`` from its prompt, ``"incremental"`` from its prefix; ``starts`` gives them).
    As soon as one is, ``heads[i](rec, ref)`` and :func:`matrix_states` (replica, the two prefill calls, every
    boundary gate) run between two steps. A live reference due for :func:`check_live` is first rebuilt by
    teacher forcing in the same engine (``decode_chains(rebuild=...)``), ahead of new boundaries. Its four arms' suffixes then join the engine's queue (they go first
    once ``4 * batch`` of them wait), and a slot a job leaves takes the next job at once. When its four suffixes are
    done, :func:`matrix_arms` finishes the record. A gate failure of one problem is recorded in its record only,
    the first failing arm in the arms' order, as in :func:`matrix_chunk`.

    Returns:
        One record per problem, in order, with what the engine measured (:func:`kvreplay.engine.decode_chains`).

    Raises:
        ContractError: a prompt or prefix that breaks the block contract, or an unclosed answer block.
        GateError: ``graph_equals_eager`` or ``attention_tolerance`` (the engine's own gates).
    """
    recs: list[dict] = [{"problem_id": p.problem_id, "gate_failure": None} for p in problems]
    arm_names: dict[int, list[str]] = {}

    def continue_with(i: int, ref, rebuilt=None) -> list[decode.Boundary]:
        rec = recs[i]
        try:
            if isinstance(ref, GateError):
                raise ref
            heads[i](rec, ref)
            states = matrix_states(spec, problems[i], rec, ref, rebuilt)
        except GateError as e:
            rec["gate_failure"] = gate_failure(e)
            return []
        arm_names[i] = list(states)
        return list(states.values())

    def finished(i: int, suffixes: list) -> None:
        if not suffixes:
            return  # stopped at its boundary: the failure is in its record already
        rec = recs[i]
        try:
            raise_gate_errors(suffixes)
            matrix_arms(spec, problems[i], rec, construction, dict(zip(arm_names.pop(i), suffixes)))
        except GateError as e:
            rec["gate_failure"] = gate_failure(e)

    stats = engine.decode_chains(spec.lm, spec.fmt, spec.decoding, construction, starts, continue_with, finished, run=spec.batched(), rebuild=lambda i, ref: live_check_due(spec, problems[i], ref))
    return Measured(recs, stats)
