"""Per-row experiment functions and their endpoint tables (paper §3.5–3.6, §4).

Rows are independent: each experiment maps a pure per-row function over
problem IDs in frozen order (:func:`kvreplay.ledger.run_rows`), so rows can
later be spread over processes without touching this code. Different
problems are never batched together.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pandas as pd
import torch

from . import caches, decode, drift, gates
from .contract import BlockFormat, Caps, ContractError
from .data import Problem
from .gates import GateError
from .ledger import canonical_json
from .models import ExecutionContract, LoadedModel, context_length
from .scoring import score_answer
from .stats import mcnemar_exact, paired_bootstrap, wilson

Hook = Callable[[dict[str, decode.Boundary]], None]


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What a row function needs besides the problem.

    Attributes:
        lm: loaded model (its dtype is the run's precision).
        fmt: resolved block format.
        caps: content caps.
        faults: optional hook called with the boundary states right after
            they are built and before any gate runs; tests use it to plant
            faults through the same runner the notebooks use.
        transplant_faults: optional hook called with
            ``(transplanted_state, recipient, donor, provenance)`` before the
            transplant gates run again (Experiment 4 tests).
        equivalence_ids: problem IDs on which a run in a lower precision also
            checks construction equivalence in float32 (the arm's preflight
            rows; :func:`construction_equivalence`). Float32 runs check it on
            every row from the row's own comparison.
        engine: the batch shape and step path of a batched runner
            (:class:`EngineRun`); ``None`` for the one-problem decoders of
            :mod:`kvreplay.decode`.
        memo: float32 construction-equivalence records already computed in
            this run, by problem ID and prefix (a batched runner computes a
            preflight problem twice for the composition gate; the check does
            not depend on the batch, so it runs once).
    """

    lm: LoadedModel
    fmt: BlockFormat
    caps: Caps
    faults: Hook | None = None
    transplant_faults: Callable | None = None
    equivalence_ids: frozenset = frozenset()
    engine: "EngineRun | None" = None
    memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class EngineRun:
    """How a batched runner drives :mod:`kvreplay.engine` (resolved from :class:`ArmSettings`).

    Attributes:
        step_path: the engine's step path, ``"eager"`` or ``"graph"``.
        batch: problems per batched step ``B`` (``2B`` rows).
        max_len: positions per row (the static cache's key dimension).
        verify_steps: steps of each engine checked against the eager step
            (gate ``graph_equals_eager``; 0 = none).
    """

    step_path: str
    batch: int
    max_len: int
    verify_steps: int = 0

    def kwargs(self) -> dict:
        """Keyword arguments of :func:`kvreplay.engine.decode_lives` / ``decode_suffixes`` / ``build_incrementals``."""
        return {"batch": self.batch, "step_path": self.step_path, "max_len": self.max_len,
                "verify_steps": self.verify_steps}


ROW_ALGORITHM = {"adapt_eval": 1, "exp1": 2, "exp2": 2, "exp2_controls": 1, "exp3": 2, "exp4": 2, "exp5": 2}
"""Row-algorithm version of each experiment, recorded in every ledger's environment.

Bump an experiment's number whenever a committed golden row of it would no
longer recompute byte for byte (a change to what a row computes or records);
a ledger written by another number is *stale*. A refactor that changes no bit
keeps the numbers. Version 2 (all experiments): greedy argmax with the lowest
token ID winning an exact tie, the ``nonfinite`` and ``equivalence`` gates,
tie accounting and predicted-letter endpoints in the records.
"""


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


def check_prompts(
    fmt: BlockFormat, problems: Sequence[Problem], max_positions: int | None = None, *, caps: Caps | None = None,
) -> None:
    """Build every prompt before a run so a bad problem fails before any row is decoded.

    With ``max_positions`` (the model's context, ``max_position_embeddings``)
    and ``caps``, also refuse a problem whose longest full sequence
    (:meth:`BlockFormat.max_sequence_length`: prompt + every delimiter +
    3 x branch cap + merge cap + answer cap, in tokens) needs more positions
    than the model has.

    Args:
        fmt: the resolved block format.
        problems: the arm's problems.
        max_positions: positions the model supports, or ``None`` to skip the length check.
        caps: content caps; required when ``max_positions`` is given.

    Raises:
        ContractError: naming the problem ID and its source line (and, for the
            length check, the positions needed and available).
        ValueError: ``max_positions`` given without ``caps``.
    """
    if max_positions is not None and caps is None:
        raise ValueError("check_prompts: max_positions needs the caps to bound the sequence length")
    for p in problems:
        try:
            ids = fmt.prompt_ids(p.question, p.options)
        except ContractError as e:
            raise ContractError(f"problem {p.problem_id} (line {p.source_line}): {e}") from e
        if max_positions is None:
            continue
        need = fmt.max_sequence_length(len(ids), caps)
        if need > max_positions:
            raise ContractError(
                f"problem {p.problem_id} ({p.source} line {p.source_line}): its full sequence can need {need} "
                f"positions (prompt {len(ids)} tokens + delimiters {fmt.delimiter_tokens()} + 3 x branch cap "
                f"{caps.branch} + merge cap {caps.merge} + answer cap {caps.answer}), but the model has only "
                f"{max_positions} (max_position_embeddings). Shorten the question, lower the caps, or leave the "
                f"problem out."
            )


def _arm_record(spec: RunSpec, problem: Problem, suffix: decode.Suffix) -> dict:
    tok = spec.lm.tokenizer
    text = spec.fmt.answer_prefix_text + tok.decode(suffix.answer)
    score = score_answer(text, problem.answer, problem.options)
    return {
        "suffix": suffix.tokens,
        "margins": suffix.margins,
        "merge_len": len(suffix.merge),
        "answer_len": len(suffix.answer),
        "answer_text": text,
        "predicted": score.predicted,
        "correct": score.correct,
        "rule": score.rule,
    }


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


def comparison(ref: decode.Boundary, other: decode.Boundary, per_tensor: bool) -> dict:
    """Drift of ``other`` against ``ref``: whole-cache aggregate, boundary logits, optionally every tensor."""
    rows = drift.cache_drift(gates.cache_tensors(ref.cache), gates.cache_tensors(other.cache))
    out = {"cache": drift.aggregate(rows), "logits": drift.logit_summary(ref.logits, other.logits)}
    if per_tensor:
        out["tensors"] = rows
    return out


_FP32_COPIES: dict[int, LoadedModel] = {}


def float32_copy(lm: LoadedModel) -> LoadedModel:
    """A float32 copy of a loaded model (same weights, upcast exactly), made once per model and kept."""
    import copy

    if lm.dtype == torch.float32:
        return lm
    key = id(lm.model)
    if key not in _FP32_COPIES:
        _FP32_COPIES.clear()  # one model at a time
        table = None if lm.role_table is None else lm.role_table.float()
        _FP32_COPIES[key] = dataclasses.replace(lm, model=copy.deepcopy(lm.model).to(dtype=torch.float32), dtype=torch.float32,
                                                role_table=table)
    return _FP32_COPIES[key]


def construction_equivalence(spec: RunSpec, problem: Problem, prefix: Sequence[int]) -> dict:
    """Construction-equivalence gate in float32 for one prefix (a check that the constructions compute one function).

    Builds the incremental (live call schedule, teacher-forced) and prefill
    boundary caches of ``prefix`` with a float32 copy of the run's model and
    requires their whole-cache relative L2 to stay within
    :data:`kvreplay.gates.EQUIVALENCE_TOLERANCE`: in float32 two correct
    constructions differ only by rounding, so a larger drift is a bug in a
    construction (wrong positions, roles or mask in one call), whatever the
    run's precision.

    In a batched run (``spec.engine`` set) the float32 incremental cache is
    rebuilt through the engine (:func:`kvreplay.engine.build_incrementals`,
    the run's step path and ``max_len``, one problem per step), which is the
    construction the run's own live boundaries come from; the result is kept
    in ``spec.memo``.

    Returns:
        ``{"dtype": "float32", "compared": "prefill_vs_incremental", "rel_l2", "tolerance"}`` for the ledger.

    Raises:
        GateError: gate ``equivalence`` (or ``nonfinite``, ``desync`` from the decoders).
    """
    key = (problem.problem_id, tuple(prefix))
    if key in spec.memo:
        if isinstance(spec.memo[key], GateError):
            raise spec.memo[key]
        return dict(spec.memo[key])
    try:
        out = _construction_equivalence(spec, problem, prefix)
    except GateError as e:
        spec.memo[key] = e
        raise
    spec.memo[key] = out
    return dict(out)


def _construction_equivalence(spec: RunSpec, problem: Problem, prefix: Sequence[int]) -> dict:
    lm32 = float32_copy(spec.lm)
    if spec.engine is None:
        inc = decode.build_incremental(lm32, spec.fmt, prefix, where=problem.problem_id)
    else:
        from . import engine

        inc = engine.build_incrementals(lm32, spec.fmt, [prefix], **(spec.engine.kwargs() | {"batch": 1}))[0]
    pre = decode.build_prefill(lm32, spec.fmt, prefix, where=problem.problem_id)
    for name, s in (("incremental (float32 check)", inc), ("prefill (float32 check)", pre)):
        gates.check_finite(name, caches.boundary_tensors(s))
    rel = drift.aggregate(drift.cache_drift(gates.cache_tensors(inc.cache), gates.cache_tensors(pre.cache)))["rel_l2"]
    gates.check_equivalence("prefill vs incremental (float32 copy of the model)", rel)
    return {"dtype": "float32", "compared": "prefill_vs_incremental", "rel_l2": rel,
            "tolerance": gates.EQUIVALENCE_TOLERANCE}


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


def matrix_row(spec: RunSpec, problem: Problem, rec: dict, ref: decode.Boundary) -> dict:
    """The matched four-arm matrix around a reference boundary state (paper §3.5, §3.6).

    Arms: the reference (``live`` in Experiment 1, ``incremental`` in
    Experiment 2), its deep-copy replica (verified), ``prefill`` (one call over
    z) and ``prefill_replica`` (an independent second call). Every arm
    continues through :func:`kvreplay.decode.decode_suffix`.

    Fills ``rec`` with ``boundary`` (drift of prefill against the reference,
    per tensor, and of each replica pair), ``first_token``, ``raw_argmax``,
    ``arms`` and ``endpoints``.

    Raises:
        GateError: the first gate that fails (callers record it).
    """
    states = matrix_states(spec, problem, rec, ref)
    arms = {n: decode.decode_suffix(spec.lm, spec.fmt, s, spec.caps) for n, s in states.items()}
    return matrix_arms(spec, problem, rec, ref.construction, arms)


def matrix_states(spec: RunSpec, problem: Problem, rec: dict, ref: decode.Boundary) -> dict[str, decode.Boundary]:
    """The four boundary states of the matrix, gated and summarised (:func:`matrix_row` up to the suffixes).

    Builds the reference's replica and the two prefill calls, runs the fault
    hook and :func:`boundary_gates`, and fills ``rec`` with ``boundary``,
    ``equivalence``, ``first_token`` and ``raw_argmax``.

    Returns:
        arm name -> boundary state (caches ``[2, kv_heads, |z|, head_dim]``), in the arms' order.

    Raises:
        GateError: the first gate that fails.
    """
    lm, fmt = spec.lm, spec.fmt
    r = ref.construction
    z = ref.ids
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
    key = f"prefill_vs_{r}"
    rec["boundary"] = {
        key: comparison(ref, states["prefill"], per_tensor=True),
        f"{r}_replica": comparison(ref, states[f"{r}_replica"], per_tensor=False),
        "prefill_replica": comparison(states["prefill"], states["prefill_replica"], per_tensor=False),
    }
    rec["equivalence"] = equivalence_record(spec, problem, z, rec["boundary"][key], key)
    rec["first_token"] = {n: decode.first_eligible_argmax(fmt, s.logits[0]) for n, s in states.items()}
    rec["raw_argmax"] = {n: decode.raw_argmax(s.logits[0]) for n, s in states.items()}
    return states


def matrix_arms(spec: RunSpec, problem: Problem, rec: dict, r: str, arms: dict[str, decode.Suffix]) -> dict:
    """The matrix's suffix gates and endpoints from the four arms' suffixes (:func:`matrix_row` after decoding).

    Args:
        r: the reference construction (``live`` or ``incremental``).
        arms: arm name -> its :class:`~kvreplay.decode.Suffix`, in the arms' order.

    Returns:
        ``rec``, with ``arms`` and ``endpoints``.

    Raises:
        GateError: ``suffix_replica``.
    """
    for a, b in ((r, f"{r}_replica"), ("prefill", "prefill_replica")):
        gates.check_equal_sequences("suffix_replica", f"{a} vs {b}", arms[a].tokens, arms[b].tokens)
    rec["arms"] = {n: _arm_record(spec, problem, s) for n, s in arms.items()}
    key = f"prefill_vs_{r}"
    rec["endpoints"] = {
        "boundary_exact": rec["boundary"][key]["cache"]["exact"],
        "logits_exact": rec["boundary"][key]["logits"]["exact"],
        "first_token_agree": rec["first_token"][r] == rec["first_token"]["prefill"],
        **divergence_endpoints(arms[r], arms["prefill"], rec["arms"][r], rec["arms"]["prefill"]),
    }
    return rec


def exp1_row(spec: RunSpec, problem: Problem) -> dict:
    """Experiment 1 for one problem: live decoding to the boundary, then the four-arm matrix (paper §3.5).

    Returns:
        The ledger record; on a gate failure, a record with ``gate_failure``
        ``{"gate", "reason"}`` (and the prefix if the boundary was reached).
    """
    rec: dict = {"problem_id": problem.problem_id, "gate_failure": None}
    try:
        prompt = spec.fmt.prompt_ids(problem.question, problem.options)
        live = decode.decode_live(spec.lm, spec.fmt, prompt, spec.caps)
        rec.update(prompt_len=len(prompt), prefix_len=len(live.ids), prefix=live.ids, schedule_calls=len(live.schedule))
        matrix_row(spec, problem, rec, live)
    except GateError as e:
        rec["gate_failure"] = {"gate": e.gate, "reason": e.reason}
    return rec


def exp2_row(spec: RunSpec, problem: Problem, prefix: Sequence[int]) -> dict:
    """Experiment 2 for one fixed BF16 prefix at the run's precision (paper §3.6).

    The incremental cache teacher-forces z through the live call schedule;
    it and prefill then form the four-arm matrix.

    Returns:
        The ledger record (``gate_failure`` set on a gate failure).

    Raises:
        ContractError: if the prefix does not end at the boundary.
    """
    rec: dict = {"problem_id": problem.problem_id, "gate_failure": None}
    try:
        inc = decode.build_incremental(spec.lm, spec.fmt, prefix, where=problem.problem_id)
        parsed = spec.fmt.boundary_parse(prefix, where=problem.problem_id)
        rec.update(prompt_len=parsed.prompt_len, prefix_len=len(inc.ids), prefix=inc.ids, schedule_calls=len(inc.schedule))
        matrix_row(spec, problem, rec, inc)
    except GateError as e:
        rec["gate_failure"] = {"gate": e.gate, "reason": e.reason}
    return rec


def _failure(e: GateError) -> dict:
    return {"gate": e.gate, "reason": e.reason}


def matrix_chunk(spec: RunSpec, problems: Sequence[Problem], refs: Sequence, heads: Sequence[Callable]) -> list[dict]:
    """The four-arm matrix of a chunk of problems, suffixes decoded together through the engine.

    Per problem, in order: its reference boundary (or the ``GateError`` that
    stopped it), ``heads[i](rec, ref)`` (the experiment's prefix fields),
    :func:`matrix_states` (replica, the two prefill calls and every boundary
    gate, as one problem at a time); then every arm of every problem still
    clean continues through :func:`kvreplay.engine.decode_suffixes` in one
    batched decode (``spec.engine``), and :func:`matrix_arms` finishes each
    record. A record has exactly the keys :func:`matrix_row` gives it; a
    gate failure of one problem (boundary, suffix) is recorded in its record
    only, the first failing arm in the arms' order.

    Returns:
        One record per problem, in order.

    Raises:
        ContractError: a suffix did not close its answer block.
    """
    from . import engine

    recs: list[dict] = [{"problem_id": p.problem_id, "gate_failure": None} for p in problems]
    pending: list[tuple[int, dict]] = []
    for i, (p, ref, head, rec) in enumerate(zip(problems, refs, heads, recs)):
        try:
            if isinstance(ref, GateError):
                raise ref
            head(rec, ref)
            pending.append((i, matrix_states(spec, p, rec, ref)))
        except GateError as e:
            rec["gate_failure"] = _failure(e)
    flat = [s for _, states in pending for s in states.values()]
    suffixes = engine.decode_suffixes(spec.lm, spec.fmt, flat, spec.caps, on_gate_error="return",
                                      **spec.engine.kwargs())
    k = 0
    for i, states in pending:
        arms = dict(zip(states, suffixes[k : k + len(states)]))
        k += len(states)
        rec = recs[i]
        try:
            for s in arms.values():
                if isinstance(s, GateError):
                    raise s
            matrix_arms(spec, problems[i], rec, refs[i].construction, arms)
        except GateError as e:
            rec["gate_failure"] = _failure(e)
    return recs


def exp1_chunk(spec: RunSpec, problems: Sequence[Problem]) -> list[dict]:
    """Experiment 1 for a chunk of problems through the batched engine (the records of :func:`exp1_row`).

    Live boundaries of the whole chunk come from :func:`kvreplay.engine.decode_lives`;
    then :func:`matrix_chunk`. Bits may differ from :func:`exp1_row` (another
    cache layout and batch shape: the ledger key says which), the layout does not.

    Raises:
        ContractError: a prompt that breaks the block contract, or an unclosed answer block.
    """
    from . import engine

    prompts = [spec.fmt.prompt_ids(p.question, p.options) for p in problems]
    lives = engine.decode_lives(spec.lm, spec.fmt, prompts, spec.caps, on_gate_error="return", **spec.engine.kwargs())

    def head(prompt):
        return lambda rec, live: rec.update(prompt_len=len(prompt), prefix_len=len(live.ids), prefix=live.ids,
                                            schedule_calls=len(live.schedule))

    return matrix_chunk(spec, problems, lives, [head(x) for x in prompts])


def exp2_chunk(spec: RunSpec, problems: Sequence[Problem], prefixes: Sequence[Sequence[int]]) -> list[dict]:
    """Experiment 2 for a chunk of fixed prefixes through the batched engine (the records of :func:`exp2_row`).

    The incremental caches are rebuilt through :func:`kvreplay.engine.build_incrementals`
    (teacher forcing of the live call schedule), then :func:`matrix_chunk`.

    Raises:
        ContractError: a prefix that does not end at the boundary.
    """
    from . import engine

    incs = engine.build_incrementals(spec.lm, spec.fmt, prefixes, on_gate_error="return", **spec.engine.kwargs())

    def head(prefix, pid):
        def fill(rec, inc):
            parsed = spec.fmt.boundary_parse(prefix, where=pid)
            rec.update(prompt_len=parsed.prompt_len, prefix_len=len(inc.ids), prefix=inc.ids,
                       schedule_calls=len(inc.schedule))
        return fill

    return matrix_chunk(spec, problems, incs, [head(z, p.problem_id) for z, p in zip(prefixes, problems)])


def require_gates(records: Sequence[dict]) -> None:
    """Refuse to report endpoints unless every row passed every gate (gates are conjunctive).

    Raises:
        GateError: gate ``report``, naming the failed rows and their gates.
    """
    failed = [(r["problem_id"], r["gate_failure"]["gate"]) for r in records if r.get("gate_failure")]
    if failed:
        raise GateError("report", f"{len(failed)} row(s) failed integrity gates, endpoints withheld: {failed}")


def _with_derived_endpoints(rec: dict, ref: str) -> dict:
    """A row's endpoints; rows of row-algorithm version 1 (which recorded neither ``letter_differs`` nor
    ``tie_initiated``) get them derived from the arms' recorded predictions and margins, as version 2 computes them."""
    ep = rec["endpoints"]
    if "letter_differs" in ep and "tie_initiated" in ep:
        return ep
    a, b = rec["arms"][ref], rec["arms"]["prefill"]
    return ep | {"letter_differs": a["predicted"] != b["predicted"],
                 "tie_initiated": tie_initiated(a["margins"], b["margins"], ep["first_divergence"])}


def matrix_summary(
    records: Sequence[dict], dtype: str, ref: str = "live", seed: int = 20260729, n_resamples: int = 20000
) -> dict:
    """Endpoints of the four-arm matrix at one precision (paper §4.1, §4.2), from ledger records alone.

    ``ref`` is the reference construction (``live`` or ``incremental``); prefill is compared against it.

    Returns:
        dict of counts, Wilson intervals (as :class:`~kvreplay.stats.Proportion`)
        for suffix, merge, answer-block, predicted-letter and label
        disagreement, ``tie_initiated`` (divergent rows whose first divergence
        is tie-initiated), the live-vs-prefill accuracy difference (prefill minus live, bootstrap),
        McNemar on correctness, first-divergence median/range and drift.

    Raises:
        GateError: if any row failed a gate.
    """
    require_gates(records)
    n = len(records)
    ep = [_with_derived_endpoints(r, ref) for r in records]
    live_c = [r["arms"][ref]["correct"] for r in records]
    pre_c = [r["arms"]["prefill"]["correct"] for r in records]
    firsts = [e["first_divergence"] for e in ep if e["first_divergence"] is not None]
    drifts = [r["boundary"][f"prefill_vs_{ref}"]["cache"]["rel_l2"] for r in records]
    replicas_exact = sum(
        r["boundary"][f"{ref}_replica"]["cache"]["exact"] and r["boundary"]["prefill_replica"]["cache"]["exact"]
        for r in records
    )
    return {
        "dtype": dtype,
        "ref": ref,
        "n": n,
        "replicas_exact": replicas_exact,
        "boundary_non_exact": sum(not e["boundary_exact"] for e in ep),
        "first_token_agree": sum(e["first_token_agree"] for e in ep),
        "suffix": wilson(sum(e["suffix_differs"] for e in ep), n),
        "merge": wilson(sum(e["merge_differs"] for e in ep), n),
        "answer": wilson(sum(e["answer_differs"] for e in ep), n),
        "letter": wilson(sum(e["letter_differs"] for e in ep), n),
        "label": wilson(sum(e["label_differs"] for e in ep), n),
        "tie_initiated": sum(bool(e["tie_initiated"]) for e in ep),
        "first_divergence_median": statistics.median(firsts) if firsts else None,
        "first_divergence_range": (min(firsts), max(firsts)) if firsts else None,
        "first_divergence_quartiles": statistics.quantiles(firsts, n=4) if len(firsts) >= 2 else None,
        "accuracy_ref": sum(live_c),
        "accuracy_prefill": sum(pre_c),
        "accuracy_diff": paired_bootstrap(live_c, pre_c, n_resamples=n_resamples, seed=seed) if n >= 2 else None,
        "mcnemar": mcnemar_exact(live_c, pre_c),
        "drift_median": statistics.median(drifts),
        "drift_range": (min(drifts), max(drifts)),
        "prefix_len_range": (min(r["prefix_len"] for r in records), max(r["prefix_len"] for r in records)),
    }


def matrix_table(summaries: Sequence[dict], cross_precision_identical: tuple[int, int] | None) -> pd.DataFrame:
    """Results table of the four-arm matrix in the paper's terms, one column per precision."""
    rows: dict[str, dict] = {}
    for s in summaries:
        col = s["dtype"]
        n = s["n"]
        d = s["accuracy_diff"]
        mc = s["mcnemar"]
        rows.setdefault("rows", {})[col] = str(n)
        rows.setdefault("prefix length (tokens)", {})[col] = f"{s['prefix_len_range'][0]}–{s['prefix_len_range'][1]}"
        rows.setdefault("replica pairs exact", {})[col] = f"{s['replicas_exact']}/{n}"
        rows.setdefault("boundary cache non-bit-exact", {})[col] = f"{s['boundary_non_exact']}/{n}"
        rows.setdefault("first eligible argmax agrees", {})[col] = f"{s['first_token_agree']}/{n}"
        rows.setdefault("median relative L2 cache drift [range]", {})[col] = (
            f"{s['drift_median']:.3g} [{s['drift_range'][0]:.3g}, {s['drift_range'][1]:.3g}]"
        )
        for key, label in (("suffix", "suffix differs"), ("merge", "merge differs"),
                           ("answer", "answer block differs (any token)"), ("letter", "predicted letter differs"),
                           ("label", "correctness label differs")):
            rows.setdefault(label, {})[col] = s[key].pct()
        rows.setdefault("suffix differs: tie-initiated / not (either arm's top-1 − top-2 margin exactly 0 at the first "
                        "divergent step)", {})[col] = f"{s['tie_initiated']} / {s['suffix'].k - s['tie_initiated']}"
        fd = s["first_divergence_median"]
        rows.setdefault("first divergence, tokens after boundary: median (range)", {})[col] = (
            f"{fd:g} ({s['first_divergence_range'][0]}–{s['first_divergence_range'][1]})" if fd is not None else "none"
        )
        ref = s["ref"]
        rows.setdefault(f"accuracy {ref} / prefill", {})[col] = f"{s['accuracy_ref']}/{n} vs {s['accuracy_prefill']}/{n}"
        rows.setdefault(f"prefill − {ref} accuracy, pts [95% bootstrap CI]", {})[col] = (
            f"{100 * d.estimate:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]" if d else "n/a"
        )
        rows.setdefault(f"McNemar ({ref}-only vs prefill-only correct), exact p", {})[col] = (
            f"{mc.b} vs {mc.c}, p = {mc.pvalue:.3g}"
        )
    if cross_precision_identical is not None:
        k, n = cross_precision_identical
        for col in rows["rows"]:
            rows.setdefault("boundary prefix token-identical across precisions", {})[col] = f"{k}/{n}"
    return pd.DataFrame(rows).T


def write_prefix_bank(records: Sequence[dict], path: str | Path, source_ledger: str) -> str:
    """Write the BF16 boundary-prefix bank Experiments 2–4 read (paper §3.6).

    One JSON line per problem in frozen order: ``problem_id``, ``prompt_len``,
    ``prefix`` (token IDs of z). A manifest ``<path>.manifest.json`` records
    its sha256 and the ledger it came from.

    Returns:
        the bank's sha256.

    Raises:
        GateError: if a record has no prefix (a failed row).
    """
    import hashlib

    lines = []
    for r in records:
        if "prefix" not in r:
            raise GateError("report", f"row {r['problem_id']} has no boundary prefix; cannot write the prefix bank")
        lines.append(canonical_json({"problem_id": r["problem_id"], "prompt_len": r["prompt_len"], "prefix": r["prefix"]}))
    data = ("\n".join(lines) + "\n").encode()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    manifest = {"sha256": digest, "rows": len(lines), "source_ledger": source_ledger}
    Path(str(path) + ".manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return digest


# ----------------------------------------------------------------------------- running an experiment


def model_key(model: str) -> dict:
    """Cheap identity of a model for ledger keys, computed without loading it.

    The embedded model is keyed by its pinned GGUF digest; a ``.gguf`` file
    by its sha256; a local folder by the sha256 of each file in it.

    Raises:
        ModelLoadError: for an unknown path.
    """
    from .models import EMBEDDED, EMBEDDED_SHA256, ModelLoadError, file_sha256, looks_like_path

    if model == EMBEDDED:
        return {"model": EMBEDDED, "sha256": EMBEDDED_SHA256}
    p = Path(model).expanduser()
    if p.is_file():
        return {"model": str(model), "sha256": file_sha256(p)}
    if p.is_dir():
        return {"model": p.name, "files": {f.name: file_sha256(f) for f in sorted(p.iterdir()) if f.is_file()}}
    if looks_like_path(model) or model.endswith(".gguf"):
        raise ModelLoadError(f"unknown model {model!r}: no such file or folder")
    return {"model": model}  # a hub id: it must already be in the local cache (checked when loading)


def role_table_key(path: str | Path) -> dict:
    """Identity of a role-table file for ledger keys: its sha256, and its path relative to the repository
    root when it lies inside it (so a clone elsewhere keys the same table the same way).

    Raises:
        ModelLoadError: if the file does not exist.
    """
    from .models import ModelLoadError, file_sha256
    from .paths import ROOT

    p = Path(path).expanduser()
    if not p.is_file():
        raise ModelLoadError(f"role table not found: {path}")
    try:
        name = str(p.resolve().relative_to(ROOT))
    except ValueError:
        name = str(path)
    return {"model": name, "sha256": file_sha256(p)}


def problems_digest(problems: Sequence[Problem]) -> str:
    """sha256 of the problems' content in frozen order."""
    import hashlib

    payload = [[p.problem_id, p.question, list(p.options), p.answer] for p in problems]
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


ARM_STEP_PATHS = ("eager", "engine-eager", "graph")
"""Decode paths of an arm: :mod:`kvreplay.decode` (reference), the engine's op-by-op step, its CUDA graph."""

GRAPH_CHECK_STEPS = 256
"""Steps of each engine (live, suffix) of the composition run checked against the eager step on the graph path."""


@dataclasses.dataclass(frozen=True)
class ArmSettings:
    """Everything that fixes an arm's numerics besides its rows (part of every ledger key).

    Attributes mirror the notebooks' parameters: ``profile``, ``dtype``,
    ``caps``, ``model`` (``"embedded"``, folder, ``.gguf`` or cached hub id),
    ``fmt`` (block format name or YAML path), ``role_table`` (path or None),
    ``threads`` (intra-op threads), ``sdpa_backends``, ``preflight`` (rows),
    and the CUDA side of the contract (:class:`~kvreplay.models.ExecutionContract`):
    ``device``, ``deterministic``, ``allow_tf32``.

    Where the rows run is not part of the key, because the rows are identical
    bit for bit however many actors compute them: ``workers`` is the number of
    Ray row actors (:mod:`kvreplay.parallel`; on CUDA one per GPU, sharing the
    GPUs when there are more actors than GPUs; 1 = in this process, without
    Ray), and ``ray_address`` an existing Ray cluster to run them on
    (``"auto"``, ``"host:port"`` or ``"ray://host:10001"``; ``None``: the one
    in ``$RAY_ADDRESS``, else a local cluster started for them).

    The decode path is part of the contract too:

    * ``step_path``: ``"eager"`` (default, the reference): one problem at a
      time through :mod:`kvreplay.decode` (``DynamicCache``, one forward call
      per token); ``"engine-eager"``: the batched engine
      (:mod:`kvreplay.engine`) with its op-by-op step (runs on the CPU);
      ``"graph"``: the engine with its step replayed as a CUDA graph (CUDA only).
    * ``batch``: problems per batched step ``B`` (the engine's ``2B`` rows);
    * ``max_len``: positions per row of the engine's static cache, or ``None``
      for the arm's bound: the longest full sequence any of the arm's problems
      can reach (:meth:`~kvreplay.contract.BlockFormat.max_sequence_length`
      of its prompt at the caps), so one arm has one batch shape.

    The engine's bits depend on the batch shape ``(B, max_len)`` and differ
    from the eager path's, so a non-eager step path adds
    ``{"engine": {"step_path", "batch", "max_len"}}`` to the ledger key (the
    policy name ``"longest_sequence"`` for ``max_len=None``; the resolved
    length is recorded in the environment). The defaults add nothing.
    ``batch`` and ``max_len`` are refused with the eager path (they would not
    be used). Every arm of an experiment should run under the same contract.

    Raises:
        ValueError: ``workers`` below 1 or not whole; ``ray_address`` not a
            non-empty string or None; an unknown step path;
            ``graph`` on a non-CUDA device; ``batch`` below 1; ``max_len``
            below 2; a batch shape given with ``step_path="eager"``.
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

    def __post_init__(self):
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be a whole number of at least 1, got {self.workers!r}")
        if self.ray_address is not None and (not isinstance(self.ray_address, str) or not self.ray_address):
            raise ValueError(f"ray_address must be None or a Ray cluster address such as 'auto' or 'host:6379', "
                             f"got {self.ray_address!r}")
        if self.step_path not in ARM_STEP_PATHS:
            raise ValueError(f"unknown step path {self.step_path!r}; use one of {ARM_STEP_PATHS}")
        if not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch (problems per step) must be a whole number of at least 1, got {self.batch!r}")
        if self.max_len is not None and (not isinstance(self.max_len, int) or self.max_len < 2):
            raise ValueError(f"max_len must be None or a whole number of at least 2, got {self.max_len!r}")
        if self.step_path == "eager" and (self.batch != 8 or self.max_len is not None):
            raise ValueError("batch and max_len are the engine's batch shape: they need step_path 'engine-eager' "
                             "or 'graph' (the eager path decodes one problem at a time)")
        if self.step_path == "graph" and self.contract().device_type != "cuda":
            raise ValueError(f"step path 'graph' replays CUDA graphs: it needs device 'cuda', not {self.device!r}")

    def engine_key(self) -> dict | None:
        """The ledger-key entry of the decode path: ``None`` for the eager path, else step path and batch shape."""
        if self.step_path == "eager":
            return None
        return {"step_path": self.step_path, "batch": self.batch,
                "max_len": self.max_len if self.max_len is not None else "longest_sequence"}

    def engine_run(self, fmt: BlockFormat, problems: Sequence[Problem]) -> "EngineRun | None":
        """The resolved engine settings of a batched arm (``None`` on the eager path).

        Raises:
            ContractError: a prompt breaks the block contract.
            ValueError: a fixed ``max_len`` shorter than the longest sequence a problem can reach.
        """
        if self.step_path == "eager":
            return None
        need = max(fmt.max_sequence_length(len(fmt.prompt_ids(p.question, p.options)), self.caps) for p in problems)
        if self.max_len is not None and self.max_len < need:
            raise ValueError(f"max_len={self.max_len} is shorter than the {need} positions the arm's longest problem "
                             f"can reach at caps {dataclasses.astuple(self.caps)}")
        return EngineRun("graph" if self.step_path == "graph" else "eager", self.batch,
                         self.max_len if self.max_len is not None else need)

    def contract(self, device: str | None = None) -> ExecutionContract:
        """The execution contract of this arm (``device`` overrides, e.g. a worker's GPU)."""
        return ExecutionContract(
            device=device or self.device, sdpa_backends=tuple(self.sdpa_backends), deterministic=self.deterministic,
            allow_tf32=self.allow_tf32, threads=self.threads,
        )

    def config(self, experiment: str, problems: Sequence[Problem]) -> dict:
        """The scientific config that keys the ledger (CPU defaults add no key, so CPU ledgers keep their digests)."""
        from .contract import load_spec

        config = {
            "experiment": experiment,
            "profile": self.profile,
            "dtype": self.dtype,
            "caps": dataclasses.asdict(self.caps),
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
        return config

    def load(self, device: str | None = None) -> tuple[LoadedModel, BlockFormat]:
        """Apply the execution contract, fix the seed, load the model at this precision, resolve the format."""
        from .contract import resolve_format
        from .models import load_model

        contract = self.contract(device)
        contract.apply()
        torch.manual_seed(0)
        lm = load_model(self.model, self.dtype, role_table=self.role_table, contract=contract)
        return lm, resolve_format(lm.tokenizer, self.fmt)


def run_arm(
    name: str,
    settings: ArmSettings,
    problems: Sequence[Problem],
    row: Callable[[RunSpec, Problem], dict],
    *,
    ledger_root: str | Path,
    extra_config: dict | None = None,
    progress: bool = True,
    faults: Hook | None = None,
    chunk: Callable[[RunSpec, Sequence[Problem]], list[dict]] | None = None,
) -> tuple[list[dict], "Ledger"]:
    """Run, resume or reuse one experiment arm: ``row`` mapped over ``problems`` in frozen order.

    With a non-eager ``settings.step_path`` the arm runs through the batched
    engine instead: ``chunk(spec, problems)`` (e.g. :func:`exp1_chunk`)
    computes the records of up to ``settings.batch`` problems at a time
    (:class:`BatchedRows`), appended in problem order as in a sequential run;
    the first preflight problem also passes the ``composition`` gate (and,
    on the graph path, ``graph_equals_eager``).

    With ``settings.workers > 1`` (and more than one row, or chunk, to
    compute) the rows run on Ray actors (:class:`kvreplay.parallel.RowActors`:
    one per GPU or CPU worker, each with its own model; on the batched path
    each computes whole chunks), and this process loads no model; records are
    appended in problem order, so the ledger's bytes equal a sequential run's.

    The ledger lives in ``<ledger_root>/<profile>/<name>-<dtype>-<digest12>/``
    and records :data:`ROW_ALGORITHM` ``[name]``. A ledger already complete
    for this scientific config is read without loading the model. The first
    ``settings.preflight`` rows are preflight rows: a gate failure there
    aborts the arm, and in a run below float32 they also carry the float32
    construction-equivalence gate (:func:`construction_equivalence`).

    Raises:
        GateError: ``preflight`` if a preflight row fails a gate; ``composition``
            or ``graph_equals_eager`` (batched arms) before any row is appended.
        ModelLoadError, ContractError: bad model or problems (a prompt that
            breaks the block contract, or a sequence longer than the model's
            context), before any row and before the ledger folder is created.
        ValueError: a non-eager step path for an experiment without a batched
            runner (``chunk`` None); a ``max_len`` too short for the arm's
            problems; ``workers`` the Ray cluster cannot hold (too few CPUs
            or GPUs), or an explicit ``cuda:N`` with ``workers > 1``.
        RuntimeError: a row actor failed to start (its cause is named), or
            every row actor died (finished rows stay in the ledger).
    """
    from .ledger import Ledger, run_rows

    if settings.step_path != "eager" and chunk is None:
        raise ValueError(f"experiment {name!r} has no batched runner: step path {settings.step_path!r} is "
                         f"refused (use step_path='eager'; batched runners exist for exp1 and exp2)")

    config = settings.config(name, problems) | (extra_config or {})
    root = Path(ledger_root) / settings.profile
    ids = [p.problem_id for p in problems]
    label = f"{name}-{settings.dtype}"
    version = ROW_ALGORITHM.get(name)
    done: set[str] = set()
    if Ledger.folder(root, label, config).is_dir():
        probe = Ledger(root, label, config, row_algorithm=version)
        if probe.complete(ids):  # nothing to compute: no model, no actors; the one line a finished ledger gets
            from .ledger import row_bar

            row_bar(len(ids), len(ids), f"{name} {settings.dtype}", progress)
            by_id = {r["problem_id"]: r for r in probe.records()}
            return [by_id[i] for i in ids], probe
        done = probe.done_keys()
    todo = [p for p in problems if p.problem_id not in done]
    equivalence_ids = frozenset(ids[: settings.preflight])
    first = problems[0].problem_id if settings.preflight > 0 and problems else None  # composition gate (batched)
    groups = len(todo) if settings.step_path == "eager" else -(-len(todo) // settings.batch)
    if settings.workers > 1 and groups > 1:
        # the actors load the model; this process loads none (a second copy would sit on the first GPU)
        from .parallel import RowActors

        with RowActors(settings, row, chunk=chunk, workers=min(settings.workers, groups), faults=faults,
                       equivalence_ids=equivalence_ids) as pool:
            environment, run = pool.prepare(problems)  # prompts checked and contract recorded inside an actor
            ledger = Ledger(root, label, config, environment=environment, row_algorithm=version)
            ledger.log(event="workers", workers=pool.workers, devices=pool.devices, ray=pool.cluster["address"],
                       ray_started=pool.cluster["started"], startup_s=pool.startup)
            if run is not None:
                ledger.log(event="engine", **dataclasses.asdict(run))
            mapper = pool.mapper(todo, key=lambda p: p.problem_id, run=run, composition_id=first)
            try:
                records = run_rows(
                    ledger, list(problems), None, key=lambda p: p.problem_id, mapper=mapper,
                    preflight=settings.preflight, progress=progress, desc=f"{name} {settings.dtype} x{pool.workers}",
                )
            finally:
                for event in pool.events:
                    ledger.log(**event)
            if mapper.checks:
                ledger.log(event="gates", checks=mapper.checks)
        return records, ledger
    lm, bf = settings.load()
    check_prompts(bf, problems, context_length(lm.model.config), caps=settings.caps)  # before the ledger folder exists
    run = settings.engine_run(bf, problems)
    ledger = Ledger(root, label, config, environment=arm_environment(lm, bf, settings, run), row_algorithm=version)
    spec = RunSpec(lm=lm, fmt=bf, caps=settings.caps, faults=faults, equivalence_ids=equivalence_ids, engine=run)
    if run is None:
        mapper, row_fn = None, (lambda p: row(spec, p))
    else:
        mapper, row_fn = BatchedRows(spec, chunk, todo, composition_id=first), None
        ledger.log(event="engine", **dataclasses.asdict(run))
    records = run_rows(
        ledger, list(problems), row_fn, key=lambda p: p.problem_id, mapper=mapper,
        preflight=settings.preflight, progress=progress, desc=f"{name} {settings.dtype}",
    )
    if mapper is not None and mapper.checks:
        ledger.log(event="gates", checks=mapper.checks)
    return records, ledger


class BatchedRows:
    """A :func:`kvreplay.ledger.run_rows` mapper that computes rows a chunk of ``B`` problems at a time.

    Called with items in problem order, it yields their records in that
    order. Each chunk is the next ``spec.engine.batch`` problems of ``todo``
    (the arm's rows still to compute) from the first item not computed yet,
    so the preflight call computes its chunk's other problems ahead; their
    records are held and yielded (and appended) only when
    :func:`~kvreplay.ledger.run_rows` asks for them, after the preflight rows
    passed. A problem's bits do not depend on which chunk it falls in (the
    batch shape is the arm's), which the ``composition`` gate checks.

    Composition gate: when a chunk holds ``composition_id`` (the first
    preflight problem), that problem's record is computed again alone (a
    chunk of one at the same ``B`` and ``max_len``, the other slots idle) and
    must equal its record inside the chunk, byte for byte in canonical JSON.
    On the graph path that alone run also checks the first
    :data:`GRAPH_CHECK_STEPS` steps of each engine against the eager step
    (gate ``graph_equals_eager``).

    Args:
        spec: the arm's run spec (``spec.engine`` set).
        chunk: ``(spec, problems) -> records`` (:func:`exp1_chunk`, ...).
        todo: the problems to compute, in order.
        composition_id: problem ID of the composition gate, or ``None``.

    Raises (while iterating):
        GateError: ``composition`` or ``graph_equals_eager``.
    """

    def __init__(self, spec: RunSpec, chunk: Callable, todo: Sequence[Problem], composition_id: str | None = None):
        self.spec, self.chunk, self.todo = spec, chunk, list(todo)
        self.position = {p.problem_id: i for i, p in enumerate(self.todo)}
        self.composition_id = composition_id
        self.held: dict[str, dict] = {}
        self.chunks: list[list[str]] = []
        self.checks: list[dict] = []  # the preflight gates passed: gate, problem, seconds, steps checked

    def __call__(self, items) -> Iterator[dict]:
        for it in items:
            if it.problem_id not in self.held:
                start = self.position[it.problem_id]
                group = [p for p in self.todo[start : start + self.spec.engine.batch] if p.problem_id not in self.held]
                records = self.chunk(self.spec, group)
                self.chunks.append([p.problem_id for p in group])
                ids = [p.problem_id for p in group]
                if self.composition_id in ids:
                    i = ids.index(self.composition_id)
                    self.check_composition(group[i], records[i], len(group))
                self.held.update(zip(ids, records))
            yield self.held.pop(it.problem_id)

    def check_composition(self, problem: Problem, record: dict, size: int) -> None:
        """The composition gate (and, on the graph path, ``graph_equals_eager``) on one problem.

        Raises:
            GateError: ``composition`` naming the first differing leaf, or ``graph_equals_eager``.
        """
        run = self.spec.engine
        verify = GRAPH_CHECK_STEPS if run.step_path == "graph" else 0
        spec = dataclasses.replace(self.spec, engine=dataclasses.replace(run, verify_steps=verify), memo=self.spec.memo)
        import time

        from . import engine

        t0, verified0 = time.perf_counter(), engine.VERIFIED_STEPS[0]
        alone = self.chunk(spec, [problem])[0]
        seconds = round(time.perf_counter() - t0, 3)
        if verify:
            self.checks.append({"gate": "graph_equals_eager", "problem_id": problem.problem_id,
                                "steps_checked": engine.VERIFIED_STEPS[0] - verified0, "seconds": seconds})
        if canonical_json(alone) != canonical_json(record):
            a, b = _leaves(alone), _leaves(record)
            where = next((k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)), "?")
            raise GateError("composition", f"problem {problem.problem_id}: its record computed alone (B={run.batch}, "
                            f"max_len={run.max_len}, other slots idle) differs from its record in a chunk of {size} "
                            f"problems, first at {where!r}; a problem's bits depend on its companions")
        self.checks.append({"gate": "composition", "problem_id": problem.problem_id, "chunk": size,
                            "batch": run.batch, "max_len": run.max_len, "seconds": seconds})



def arm_environment(lm: LoadedModel, fmt: BlockFormat, settings: ArmSettings, run: "EngineRun | None" = None) -> dict:
    """What a ledger's ``environment.json`` records for an arm: the execution contract as applied, and the format digest.

    The contract's ``device`` is the arm's setting (``"cuda"``), not a worker's
    GPU, so a ledger's environment does not depend on which worker recorded it.
    A batched arm adds ``engine``: its step path, ``batch`` and the resolved
    ``max_len`` (the eager path adds nothing).
    """
    from .models import execution_contract

    env = execution_contract(lm, settings.threads) | {"format_digest": fmt.digest}
    if "contract" in env:
        env["contract"]["device"] = settings.device
    if run is not None:
        env["engine"] = {"step_path": settings.step_path, "batch": run.batch, "max_len": run.max_len}
    return env


def run_experiment1(
    problems: Sequence[Problem], settings: ArmSettings, *, ledger_root: str | Path, progress: bool = True,
    faults: Hook | None = None,
) -> tuple[list[dict], "Ledger"]:
    """Experiment 1 (paper §3.5) at one precision: records and ledger (see :func:`run_arm`; batched: :func:`exp1_chunk`)."""
    return run_arm("exp1", settings, problems, exp1_row, ledger_root=ledger_root, progress=progress, faults=faults,
                   chunk=exp1_chunk)


# ----------------------------------------------------------------------------- Experiment 2


def read_prefix_bank(path: str | Path) -> tuple[list[dict], str]:
    """Read the BF16 boundary-prefix bank written by notebook 01 and check its digest.

    Returns:
        ``(entries, sha256)``; each entry has ``problem_id``, ``prompt_len``, ``prefix``.

    Raises:
        FileNotFoundError: if notebook 01 has not written the bank for this profile.
        GateError: gate ``provenance`` if the file does not match its manifest.
    """
    import hashlib

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prefix bank at {path}: run notebook 01 (Experiment 1) for this profile first")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    manifest = json.loads(Path(str(path) + ".manifest.json").read_text())
    if manifest["sha256"] != digest:
        raise GateError("provenance", f"{path} has sha256 {digest}, its manifest says {manifest['sha256']}")
    return [json.loads(x) for x in data.decode().splitlines() if x], digest


@dataclasses.dataclass(frozen=True)
class FixedPrefixes:
    """The BF16 prefix bank joined to its problems (what Experiments 2–4 consume).

    Attributes:
        entries: bank lines (``problem_id``, ``prompt_len``, ``prefix``) in source order.
        sha256: the bank file's digest (part of every downstream ledger key).
        rows: the problems, in the bank's (= the problem bank's) source order.
        prefixes: problem ID -> boundary prefix z (token IDs).
    """

    entries: list[dict]
    sha256: str
    rows: list[Problem]
    prefixes: dict[str, list[int]]


def load_fixed_prefixes(path: str | Path, problems: Sequence[Problem]) -> FixedPrefixes:
    """Read the digest-checked prefix bank and join it to ``problems``, with no outcome-based filtering.

    Raises:
        FileNotFoundError: if notebook 01 has not written the bank.
        GateError: gate ``provenance`` if the bank fails its digest, names a
            problem not in ``problems``, or is not in their source order.
    """
    entries, digest = read_prefix_bank(path)
    by_id = {p.problem_id: p for p in problems}
    unknown = [e["problem_id"] for e in entries if e["problem_id"] not in by_id]
    if unknown:
        raise GateError("provenance", f"{path} names problems not in the problem set: {unknown[:5]}")
    rows = [by_id[e["problem_id"]] for e in entries]
    if [p.problem_id for p in rows] != [p.problem_id for p in problems[: len(rows)]]:
        raise GateError("provenance", f"{path} is not in the problem set's source order")
    return FixedPrefixes(entries, digest, rows, {e["problem_id"]: e["prefix"] for e in entries})


def run_experiment2(
    problems: Sequence[Problem], prefixes: dict[str, list[int]], bank_sha256: str, settings: ArmSettings, *,
    ledger_root: str | Path, progress: bool = True, faults: Hook | None = None,
) -> tuple[list[dict], "Ledger"]:
    """Experiment 2 (paper §3.6) at one precision on fixed prefixes: records and ledger.

    Args:
        problems: the problems, in the bank's source order.
        prefixes: problem ID -> BF16 boundary prefix z (token IDs).
        bank_sha256: digest of the prefix bank (part of the ledger key).
    """
    missing = [p.problem_id for p in problems if p.problem_id not in prefixes]
    if missing:
        raise GateError("provenance", f"prefix bank has no prefix for {missing}")
    return run_arm(
        "exp2", settings, problems, lambda spec, p: exp2_row(spec, p, prefixes[p.problem_id]),
        ledger_root=ledger_root, extra_config={"prefix_bank_sha256": bank_sha256}, progress=progress, faults=faults,
        chunk=lambda spec, ps: exp2_chunk(spec, ps, [prefixes[p.problem_id] for p in ps]),
    )


def precision_crossing(bf16: Sequence[dict], fp32: Sequence[dict], seed: int = 20260729, n_resamples: int = 20000) -> dict:
    """Problem-paired FP32-minus-BF16 change in each disagreement indicator (paper §4.2).

    Returns:
        per indicator (``suffix``, ``answer``, ``letter``, ``label``): the
        paired bootstrap difference (FP32 minus BF16; the paper reports the
        reduction, its negative) and the exact McNemar test; ``accuracy_effect``:
        the accuracy effect of the construction (prefill minus reference
        accuracy) in each precision and its problem-paired change FP32 minus
        BF16 (bootstrap; the paper: -1.0 pts [-5.5, +3.5]); plus
        ``prefix_identical``, the number of rows whose integer prefix is
        identical across precisions.

    Raises:
        GateError: if rows are not paired by problem ID in the same order, or a row failed a gate.
    """
    require_gates(bf16)
    require_gates(fp32)
    if [r["problem_id"] for r in bf16] != [r["problem_id"] for r in fp32]:
        raise GateError("report", "BF16 and FP32 rows are not paired in the same problem order")
    out = {"n": len(bf16), "prefix_identical": sum(a["prefix"] == b["prefix"] for a, b in zip(bf16, fp32))}
    ref = next(k for k in bf16[0]["arms"] if not k.startswith("prefill") and not k.endswith("_replica")) if bf16 else None
    effect = {d: [int(r["arms"]["prefill"]["correct"]) - int(r["arms"][ref]["correct"]) for r in rows]
              for d, rows in (("bfloat16", bf16), ("float32", fp32))}
    out["accuracy_effect"] = {
        "bfloat16": sum(effect["bfloat16"]) / len(bf16), "float32": sum(effect["float32"]) / len(fp32),
        "change": paired_bootstrap(effect["bfloat16"], effect["float32"], n_resamples=n_resamples, seed=seed)
        if len(bf16) >= 2 else None,
    }
    for key in ("suffix", "answer", "letter", "label"):
        a = [_with_derived_endpoints(r, ref)[f"{key}_differs"] for r in bf16]  # version-1 rows: derived, as elsewhere
        b = [_with_derived_endpoints(r, ref)[f"{key}_differs"] for r in fp32]
        out[key] = {
            "change": paired_bootstrap(a, b, n_resamples=n_resamples, seed=seed) if len(a) >= 2 else None,
            "mcnemar": mcnemar_exact(a, b),
        }
    return out


def crossing_table(cross: dict) -> pd.DataFrame:
    """Paired FP32 − BF16 change table (percentage points, bootstrap CI, McNemar)."""
    rows = {}
    for key, label in (("suffix", "suffix disagreement"), ("answer", "answer-block disagreement (any token)"),
                       ("letter", "predicted-letter disagreement"), ("label", "correctness-label disagreement")):
        c, m = cross[key]["change"], cross[key]["mcnemar"]
        rows[label] = {
            "FP32 − BF16, pts [95% bootstrap CI]": f"{100 * c.estimate:+.1f} [{100 * c.low:+.1f}, {100 * c.high:+.1f}]" if c else "n/a",
            "McNemar: BF16-only vs FP32-only, exact p": f"{m.b} vs {m.c}, p = {m.pvalue:.3g}",
        }
    e = cross["accuracy_effect"]
    c = e["change"]
    rows["accuracy effect of prefill (prefill − reference accuracy)"] = {
        "FP32 − BF16, pts [95% bootstrap CI]": (f"{100 * c.estimate:+.1f} [{100 * c.low:+.1f}, {100 * c.high:+.1f}]" if c else "n/a")
        + f" (BF16 {100 * e['bfloat16']:+.1f}, FP32 {100 * e['float32']:+.1f})",
        "McNemar: BF16-only vs FP32-only, exact p": "",
    }
    rows["integer prefix identical across precision"] = {
        "FP32 − BF16, pts [95% bootstrap CI]": f"{cross['prefix_identical']}/{cross['n']}",
        "McNemar: BF16-only vs FP32-only, exact p": "",
    }
    return pd.DataFrame(rows).T


# ----------------------------------------------------------------------------- Experiment 3


def order_statistics(items: Sequence, k: int, key: Callable) -> list:
    """``k`` evenly spaced order statistics of ``items`` sorted by ``key`` (outcome-blind selection).

    Picks sorted positions ``round(i * (n - 1) / (k - 1))`` for ``i = 0..k-1``
    (all items if ``k >= n``), returned in sorted order.
    """
    srt = sorted(items, key=key)
    n = len(srt)
    if k >= n:
        return srt
    if k == 1:
        return [srt[(n - 1) // 2]]
    idx = sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})
    return [srt[i] for i in idx]


def bridge_row(spec: RunSpec, problem: Problem, saved_prefix: Sequence[int]) -> dict:
    """Experiment 3 bridge for one problem (paper §3.7): new live boundary vs incremental from that prefix.

    Both constructions get verified replicas and pass the state, storage and
    duplicate gates; the endpoint (not a gate) is whether incremental equals
    live bit for bit on every layer, in the boundary logits and in the suffix.

    Returns:
        The ledger record (``gate_failure`` set on a gate failure).
    """
    lm, fmt = spec.lm, spec.fmt
    rec: dict = {"problem_id": problem.problem_id, "gate_failure": None}
    try:
        live = decode.decode_live(lm, fmt, fmt.prompt_ids(problem.question, problem.options), spec.caps)
        z = live.ids
        rec.update(prefix_len=len(z), prefix=z, saved_prefix_len=len(saved_prefix), same_as_saved=z == list(saved_prefix))
        states = {"live": live, "live_replica": caches.live_replica(live)}
        states["incremental"] = decode.build_incremental(lm, fmt, z, where=problem.problem_id)
        states["incremental_replica"] = caches.live_replica(states["incremental"])
        if spec.faults:
            spec.faults(states)
        boundary_gates(states, lm.dtype, [("live", "live_replica"), ("incremental", "incremental_replica")])
        cmp = comparison(live, states["incremental"], per_tensor=True)
        rec["equivalence"] = equivalence_record(spec, problem, z)
        arms = {n: decode.decode_suffix(lm, fmt, s, spec.caps) for n, s in states.items()}
        for a, b in (("live", "live_replica"), ("incremental", "incremental_replica")):
            gates.check_equal_sequences("suffix_replica", f"{a} vs {b}", arms[a].tokens, arms[b].tokens)
        rec["boundary"] = {"incremental_vs_live": cmp}
        rec["arms"] = {n: _arm_record(spec, problem, s) for n, s in arms.items()}
        layers = {t["tensor"].split(".")[0] for t in cmp["tensors"]}
        rec["endpoints"] = {
            "cache_exact": cmp["cache"]["exact"],
            "layers": len(layers),
            "layers_exact": len(layers - {t["tensor"].split(".")[0] for t in cmp["tensors"] if not t["exact"]}),
            "logits_exact": cmp["logits"]["exact"],
            "suffix_exact": arms["live"].tokens == arms["incremental"].tokens,
        }
    except GateError as e:
        rec["gate_failure"] = {"gate": e.gate, "reason": e.reason}
    return rec


def _leaves(obj, prefix: str = "") -> dict[str, object]:
    """Flatten nested dicts/lists into ``path -> scalar``."""
    out: dict[str, object] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(_leaves(v, f"{prefix}[{i}]"))
    else:
        out[prefix] = obj
    return out


AUDIT_ARMS = {"live": "incremental", "live_replica": "incremental_replica", "prefill": "prefill", "prefill_replica": "prefill_replica"}
"""Experiment 1 arm -> the Experiment 2 arm that must reproduce it."""
BOUNDARY_RENAME = {"prefill_vs_live": "prefill_vs_incremental", "live_replica": "incremental_replica"}


def saved_ledger_audit(exp1: Sequence[dict], exp2: Sequence[dict]) -> dict:
    """Deterministic join of the Experiment 1 and 2 BF16 ledgers by problem ID (paper §3.7 audit).

    Compares problem order, prefix IDs, complete suffix arrays per arm
    (:data:`AUDIT_ARMS`), and every scalar cache/logit summary leaf the two
    ledgers share (Experiment 1's ``live`` names mapped to ``incremental``).

    Returns:
        counts: ``rows``, ``order_agrees``, ``prefix_agrees``, per-arm suffix
        agreement, ``cache_leaves``/``logit_leaves`` (common leaves per row) and
        the rows on which all of them agree.

    Raises:
        GateError: if either ledger has a failed row.
    """
    require_gates(exp1)
    require_gates(exp2)
    by2 = {r["problem_id"]: r for r in exp2}
    rows = [(a, by2.get(a["problem_id"])) for a in exp1]
    out = {
        "rows": len(exp1),
        "order_agrees": [r["problem_id"] for r in exp1] == [r["problem_id"] for r in exp2],
        "prefix_agrees": sum(b is not None and a["prefix"] == b["prefix"] for a, b in rows),
        "suffix_agrees": {
            f"{x}→{y}": sum(b is not None and a["arms"][x]["suffix"] == b["arms"][y]["suffix"] for a, b in rows)
            for x, y in AUDIT_ARMS.items()
        },
    }
    cache_counts, logit_counts, cache_rows, logit_rows = set(), set(), 0, 0
    for a, b in rows:
        if b is None:
            continue
        renamed = {BOUNDARY_RENAME.get(k, k): v for k, v in a["boundary"].items()}
        la = _leaves(renamed)
        lb = _leaves(b["boundary"])
        common = sorted(set(la) & set(lb))
        cache = [k for k in common if ".logits." not in k]
        logit = [k for k in common if ".logits." in k]
        cache_counts.add(len(cache))
        logit_counts.add(len(logit))
        cache_rows += all(la[k] == lb[k] for k in cache)
        logit_rows += all(la[k] == lb[k] for k in logit)
    out.update(
        cache_leaves=sorted(cache_counts), logit_leaves=sorted(logit_counts),
        cache_leaves_agree_rows=cache_rows, logit_leaves_agree_rows=logit_rows,
    )
    return out


def bridge_summary(records: Sequence[dict]) -> dict:
    """Experiment 3 bridge endpoints (paper §4.3) from its ledger records.

    Returns:
        ``n``, ``layers_exact`` (rows bit-exact on every layer), ``logits_exact``,
        ``suffix_exact``, ``same_as_saved``, ``prefix_len_range``, ``saved_prefix_len_range``.

    Raises:
        GateError: if any row failed a gate.
    """
    require_gates(records)
    ep = [r["endpoints"] for r in records]
    return {
        "n": len(records),
        "layers_exact": sum(e["layers_exact"] == e["layers"] for e in ep),
        "layers": sorted({e["layers"] for e in ep}),
        "logits_exact": sum(e["logits_exact"] for e in ep),
        "suffix_exact": sum(e["suffix_exact"] for e in ep),
        "same_as_saved": sum(r["same_as_saved"] for r in records),
        "prefix_len_range": (min(r["prefix_len"] for r in records), max(r["prefix_len"] for r in records)),
        "saved_prefix_len_range": (min(r["saved_prefix_len"] for r in records), max(r["saved_prefix_len"] for r in records)),
    }


def bridge_table(b: dict) -> pd.DataFrame:
    """Experiment 3 bridge table (same rows as notebook 03 writes to ``exp3_bridge``)."""
    n = b["n"]
    return pd.DataFrame({"bridge (BF16)": {
        "rows": str(n),
        "all gates pass (replicas, state, storage, duplicates)": f"{n}/{n}",
        "incremental bit-exact to live on every layer": f"{b['layers_exact']}/{n}",
        "boundary logits exact": f"{b['logits_exact']}/{n}",
        "complete suffix exact": f"{b['suffix_exact']}/{n}",
        "new prefix length (tokens)": f"{b['prefix_len_range'][0]}–{b['prefix_len_range'][1]}",
        "new prefix token-identical to the saved one": f"{b['same_as_saved']}/{n}",
    }})


def audit_table(audit: dict) -> pd.DataFrame:
    """Experiment 3 saved-ledger audit table (same rows as notebook 03 writes to ``table_exp3_audit``)."""
    n = audit["rows"]
    return pd.DataFrame({"audit (BF16)": {
        "rows joined by problem ID": str(n),
        "problem IDs and order agree": "yes" if audit["order_agrees"] else "no",
        "prefix IDs agree": f"{audit['prefix_agrees']}/{n}",
        **{f"suffix reproduced: {k}": f"{v}/{n}" for k, v in audit["suffix_agrees"].items()},
        "common scalar cache leaves per row": ", ".join(map(str, audit["cache_leaves"])),
        "rows on which every cache leaf agrees": f"{audit['cache_leaves_agree_rows']}/{n}",
        "common scalar logit leaves per row": ", ".join(map(str, audit["logit_leaves"])),
        "rows on which every logit leaf agrees": f"{audit['logit_leaves_agree_rows']}/{n}",
    }})


def rate_text(p) -> str:
    """``k/n (rate; Wilson CI)`` of a Proportion, or a note when the stratum is empty."""
    return p.pct() if p is not None else "n/a (no rows in this stratum)"


def transplant_table(s: dict, records: Sequence[dict]) -> pd.DataFrame:
    """Experiment 4 registered endpoints with the power note (same rows as notebook 04 writes to ``exp4_table``).

    Args:
        s: :func:`~kvreplay.experiments.transplant_summary` of ``records``.
        records: the Experiment 4 ledger records (their ``stratum`` is the frozen panel's).
    """
    ctl = wilson(0, s["exact"]) if s["exact"] else None
    n_div = sum(r["stratum"] == "divergent" for r in records)
    n_ex = sum(r["stratum"] == "exact" for r in records)
    return pd.DataFrame({"whole-cache transplant (BF16)": {
        "panel rows (frozen divergent + exact)": f"{s['rows']} ({n_div} + {n_ex})",
        "frozen stratum reproduced by new baselines": f"{s['prior_stratum_reproduced']}/{s['rows']}",
        "all gates pass (replicas, state, storage, argmax, provenance)": f"{s['rows']}/{s['rows']}",
        "divergent rows (contemporaneous baselines): tie-initiated / not": f"{s['tie_initiated']} / {s['divergent'] - s['tie_initiated']}",
        "donor recovery, prefill <- incremental (integrity check)": rate_text(s["recovery"]["prefill<-incremental"]),
        "donor recovery, incremental <- prefill (integrity check)": rate_text(s["recovery"]["incremental<-prefill"]),
        "joint bidirectional recovery (integrity check)": rate_text(s["joint_recovery"]),
        "third trajectory among exact controls": rate_text(s["third_among_exact"]),
        "why recovery is an integrity check": ("token IDs, roles and positions are gated equal, so after a whole K/V swap "
                                               "the recipient must follow the donor unless decoding is nondeterministic"),
        "power note": (f"with {s['exact']} exact controls, 0 events would only exclude third-trajectory rates above "
                       f"{100 * ctl.high:.1f}% (Wilson upper bound)" if ctl else "no exact controls"),
    }})



# ----------------------------------------------------------------------------- Experiment 4


def freeze_transplant_panel(exp2_bf16: Sequence[dict], n_divergent: int, n_exact: int) -> list[dict]:
    """Freeze the transplant panel from Experiment 2's BF16 rows before any transplant is decoded (paper §3.8).

    Within the suffix-divergent and suffix-exact strata, takes evenly spaced
    order statistics after sorting by prefix length, then problem ID.

    Returns:
        ``[{"problem_id", "stratum": "divergent" | "exact", "prefix_len"}, ...]``, divergent first.

    Raises:
        GateError: if a source row failed a gate.
    """
    require_gates(exp2_bf16)
    out = []
    for stratum, k in (("divergent", n_divergent), ("exact", n_exact)):
        pool = [r for r in exp2_bf16 if r["endpoints"]["suffix_differs"] == (stratum == "divergent")]
        for r in order_statistics(pool, k, key=lambda r: (r["prefix_len"], r["problem_id"])):
            out.append({"problem_id": r["problem_id"], "stratum": stratum, "prefix_len": r["prefix_len"]})
    return out


def interventions(n_layers: int, sweep: bool) -> list[tuple[str, str, list[int], tuple[str, ...]]]:
    """The transplant interventions: ``(name, primary|exploratory, layers, parts)``.

    Whole-cache is the registered primary endpoint; key-only, value-only,
    first/second half of the layers and (when ``sweep``) every single layer
    are exploratory localization.
    """
    every = list(range(n_layers))
    half = n_layers // 2
    out = [("whole", "primary", every, ("key", "value"))]
    out += [
        ("keys_only", "exploratory", every, ("key",)),
        ("values_only", "exploratory", every, ("value",)),
        ("first_half", "exploratory", every[:half], ("key", "value")),
        ("second_half", "exploratory", every[half:], ("key", "value")),
    ]
    if sweep:
        out += [(f"layer_{i:02d}", "exploratory", [i], ("key", "value")) for i in every]
    return out


def _outcome(suffix: list[int], donor: list[int], recipient: list[int]) -> str:
    if donor == recipient:
        return "baseline" if suffix == donor else "third"
    if suffix == donor:
        return "donor"
    if suffix == recipient:
        return "recipient"
    return "third"


def transplant_row(
    spec: RunSpec, problem: Problem, prefix: Sequence[int], stratum: str, sweep: bool, primary_only: bool = False,
) -> dict:
    """Experiment 4 for one frozen panel row, BF16 (paper §3.8, plus the referee's localization).

    Builds incremental and prefill states, each twice with disjoint storage,
    continues the four baselines, then for every intervention in both
    directions (recipient prefill <- donor incremental, and the reverse)
    continues the transplanted state with the shared suffix decoder. The raw
    next-token argmax must already agree between constructions (a gate).
    With ``primary_only`` only the registered whole-cache transplant runs
    (Experiment 5's six arms: four baselines and two transplants).

    Returns:
        The ledger record; ``interventions[name][direction]`` holds ``outcome``
        (``donor``, ``recipient``, ``third``, or ``baseline`` when the two
        baselines agree) and the suffix.
    """
    lm, fmt = spec.lm, spec.fmt
    rec: dict = {"problem_id": problem.problem_id, "gate_failure": None, "stratum": stratum}
    try:
        inc = decode.build_incremental(lm, fmt, prefix, where=problem.problem_id)
        rec.update(prefix_len=len(prefix), prefix=list(prefix))
        states = {
            "incremental": inc,
            "incremental_replica": caches.live_replica(inc),
            "prefill": decode.build_prefill(lm, fmt, prefix, where=problem.problem_id),
        }
        states["prefill_replica"] = decode.build_prefill(lm, fmt, prefix, where=problem.problem_id)
        states["prefill_replica"].construction = "prefill_replica"
        if spec.faults:
            spec.faults(states)
        boundary_gates(states, lm.dtype, [("incremental", "incremental_replica"), ("prefill", "prefill_replica")])
        a_inc, a_pre = decode.raw_argmax(inc.logits[0]), decode.raw_argmax(states["prefill"].logits[0])
        if a_inc != a_pre:
            raise GateError("argmax", f"raw next-token argmax differs between constructions ({a_inc} vs {a_pre})")
        rec["equivalence"] = equivalence_record(spec, problem, prefix)
        # pristine sources for the transplants; the four baseline states are consumed by decoding
        src = {"incremental": caches.clone_boundary(inc, "incremental"), "prefill": caches.clone_boundary(states["prefill"], "prefill")}
        suffixes = {n: decode.decode_suffix(lm, fmt, s, spec.caps) for n, s in states.items()}
        base = {n: x.tokens for n, x in suffixes.items()}
        for a, b in (("incremental", "incremental_replica"), ("prefill", "prefill_replica")):
            gates.check_equal_sequences("suffix_replica", f"{a} vs {b}", base[a], base[b])
        fd = first_divergence(base["incremental"], base["prefill"])
        rec["baseline"] = {"incremental": base["incremental"], "prefill": base["prefill"],
                           "margins": {n: suffixes[n].margins for n in ("incremental", "prefill")},
                           "suffix_differs": base["incremental"] != base["prefill"], "first_divergence": fd,
                           "tie_initiated": tie_initiated(suffixes["incremental"].margins, suffixes["prefill"].margins, fd)}
        rec["interventions"] = {}
        for name, kind, layers, parts in interventions(len(inc.cache.layers), sweep):
            if primary_only and kind != "primary":
                continue
            rec["interventions"][name] = {"kind": kind, "layers": layers, "parts": list(parts)}
            for recipient, donor in (("prefill", "incremental"), ("incremental", "prefill")):
                state, prov = caches.transplant(src[recipient], src[donor], layers=layers, parts=parts)
                if spec.transplant_faults:
                    spec.transplant_faults(state, src[recipient], src[donor], prov)
                    caches.verify_transplant(state, src[recipient], src[donor], prov)
                suffix = decode.decode_suffix(lm, fmt, state, spec.caps).tokens
                rec["interventions"][name][f"{recipient}<-{donor}"] = {
                    "outcome": _outcome(suffix, base[donor], base[recipient]),
                    "suffix": suffix,
                    "donated_tensors": sum(p["source"] == donor for p in prov),
                }
    except GateError as e:
        rec["gate_failure"] = {"gate": e.gate, "reason": e.reason}
    return rec


DIRECTIONS = ("prefill<-incremental", "incremental<-prefill")


def transplant_summary(records: Sequence[dict]) -> dict:
    """Experiment 4 endpoints (paper §4.4): donor recovery among divergent rows, third trajectories among exact rows.

    Rows are grouped by their contemporaneous baselines (incremental vs
    prefill suffix), as registered; ``prior_stratum_reproduced`` counts rows
    whose frozen stratum the new baselines reproduce.

    Raises:
        GateError: if any row failed a gate.
    """
    require_gates(records)
    div = [r for r in records if r["baseline"]["suffix_differs"]]
    exact = [r for r in records if not r["baseline"]["suffix_differs"]]
    whole = lambda r, d: r["interventions"]["whole"][d]["outcome"]  # noqa: E731
    out = {
        "rows": len(records),
        "prior_stratum_reproduced": sum(r["baseline"]["suffix_differs"] == (r["stratum"] == "divergent") for r in records),
        "divergent": len(div),
        "exact": len(exact),
        "recovery": {d: wilson(sum(whole(r, d) == "donor" for r in div), len(div)) if div else None for d in DIRECTIONS},
        "joint_recovery": wilson(sum(all(whole(r, d) == "donor" for d in DIRECTIONS) for r in div), len(div)) if div else None,
        "third_among_exact": wilson(sum(any(whole(r, d) == "third" for d in DIRECTIONS) for r in exact), len(exact)) if exact else None,
        "tie_initiated": sum(bool(r["baseline"].get("tie_initiated")) for r in div),
    }
    return out


def localization_table(records: Sequence[dict]) -> pd.DataFrame:
    """Per intervention, direction and stratum: how often the suffix follows the donor, the recipient, or neither.

    Divergent rows (the two baselines part) show which part of the cache
    carries the trajectory; exact rows (the baselines agree) are the controls:
    there a partial transplant should leave the shared baseline (``baseline``),
    and a new trajectory (``third``) means the intervention itself moves the
    decoder.
    """
    require_gates(records)
    rows = []
    coarse = ("whole", "keys_only", "values_only", "first_half", "second_half")
    # a fixed order, whether the records come from memory or from a ledger (whose JSON keys are sorted)
    names = sorted({n for r in records for n in r["interventions"]},
                   key=lambda n: (coarse.index(n), "") if n in coarse else (len(coarse), n))
    for stratum, want in (("divergent", True), ("exact", False)):
        group = [r for r in records if r["baseline"]["suffix_differs"] == want]
        for name in names:
            have = [r for r in group if name in r["interventions"]]
            if not have:
                continue
            for d in DIRECTIONS:
                outcomes = [r["interventions"][name][d]["outcome"] for r in have]
                rows.append({
                    "intervention": name, "kind": have[0]["interventions"][name]["kind"], "stratum": stratum,
                    "direction": d, "rows": len(have), "follows donor": outcomes.count("donor"),
                    "follows recipient": outcomes.count("recipient"), "stays on the shared baseline": outcomes.count("baseline"),
                    "new (third) trajectory": outcomes.count("third"),
                })
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- exploratory controls (Experiment 2 prefixes)


def _row_seed(seed: int, problem_id: str) -> int:
    import hashlib

    return int(hashlib.sha256(f"{seed}:{problem_id}".encode()).hexdigest()[:15], 16)


@torch.inference_mode()
def null_perturbation(state: decode.Boundary, reference: decode.Boundary, seed: int) -> tuple[decode.Boundary, dict]:
    """A copy of ``state`` perturbed like ``reference`` differs from it, but at random places (exploratory control).

    Let ``n`` be the number of elements of one duplicate row in which the two
    boundary caches differ, and ``|Δ|`` their absolute differences (float32).
    The copy gets ``n`` uniformly random element positions (drawn over all K
    and V tensors of one row, with replacement), each shifted by a magnitude
    drawn from ``|Δ|`` with a random sign, computed in float32 and rounded to
    the cache dtype; both duplicate rows get the same change. The boundary
    logits stay ``state``'s. Seeded (``torch.Generator``), so reruns are identical.

    Args:
        state: the boundary to perturb (``[2, kv_heads, |z|, head_dim]`` K/V per layer); not modified.
        reference: the other construction of the same boundary (same inventory and shapes).
        seed: generator seed.

    Returns:
        ``(perturbed copy, record)`` with ``elements_target`` (n), ``elements_changed`` (after rounding),
        ``rel_l2`` (whole-cache relative L2 of the perturbation) and ``real_rel_l2`` (of ``reference``).
    """
    inv_s, inv_r = gates.cache_tensors(state.cache), gates.cache_tensors(reference.cache)
    deltas = torch.cat([(r[0].float() - s[0].float())[r[0] != s[0]].abs().flatten() for (_, s), (_, r) in zip(inv_s, inv_r)])
    out = caches.clone_boundary(state, "null_perturbation")
    gen = torch.Generator().manual_seed(seed)
    n = int(deltas.numel())
    targets = [t for _, t in gates.cache_tensors(out.cache)]
    sizes = torch.tensor([t[0].numel() for t in targets])
    if n:
        flat = torch.randint(int(sizes.sum()), (n,), generator=gen)
        mags = deltas[torch.randint(n, (n,), generator=gen)]
        signs = torch.randint(2, (n,), generator=gen).float() * 2 - 1
        bounds = torch.cumsum(sizes, 0)
        which = torch.bucketize(flat, bounds, right=True)
        for i, t in enumerate(targets):
            sel = which == i
            if not bool(sel.any()):
                continue
            local = (flat[sel] - (bounds[i] - sizes[i])).to(t.device)
            row = t[0].reshape(-1).float()
            row.index_add_(0, local, (signs[sel] * mags[sel]).to(t.device))
            new = row.to(t.dtype).reshape(t[0].shape)
            t[0].copy_(new)
            t[1].copy_(new)
    agg = drift.aggregate(drift.cache_drift(inv_s, gates.cache_tensors(out.cache)))
    real = drift.aggregate(drift.cache_drift(inv_s, inv_r))
    return out, {"seed": seed, "elements_target": n, "elements_changed": agg["n_diff"] // 2, "rel_l2": agg["rel_l2"],
                 "real_rel_l2": real["rel_l2"]}


def _pair(a: decode.Suffix, b: decode.Suffix, names: tuple[str, str]) -> dict:
    fd = first_divergence(a.tokens, b.tokens)
    return {names[0]: a.tokens, names[1]: b.tokens, "margins": {names[0]: a.margins, names[1]: b.margins},
            "suffix_differs": a.tokens != b.tokens, "first_divergence": fd,
            "tie_initiated": tie_initiated(a.margins, b.margins, fd)}


def controls_row(spec: RunSpec, problem: Problem, prefix: Sequence[int], seed: int = 20260729) -> dict:
    """Two exploratory controls on one fixed BF16 prefix that separate causes of a divergence.

    * **FP32 readout**: incremental and prefill are built again with
      :class:`~kvreplay.decode.FP32Readout` (their caches must equal the plain
      builds' bit for bit, gate ``readout``) and continued with the final norm
      and LM head in float32: does the suffix still part once BF16 logit
      granularity (and its exact ties) is taken away, on the same BF16 caches?
    * **Matched null perturbation** (:func:`null_perturbation`): the
      incremental cache perturbed at as many elements as really differ from
      prefill, with magnitudes drawn from this row's observed ``|Δ|`` at random
      places: how often does a cache change of that size move the trajectory?

    Both are compared with the plain BF16 baselines (incremental vs prefill),
    decoded here too. Gates: dtype, non-finite, functional state, duplicates
    in sync, disjoint storage, readout caches identical to the plain ones.

    Returns:
        The ledger record: ``baseline``, ``fp32_readout`` (each: both suffixes,
        margins, ``suffix_differs``, ``first_divergence``, ``tie_initiated``)
        and ``null_perturbation`` (its record, ``suffix``, ``moved``,
        ``first_divergence``, ``tie_initiated``); ``gate_failure`` on a gate failure.
    """
    lm, fmt = spec.lm, spec.fmt
    rec: dict = {"problem_id": problem.problem_id, "gate_failure": None, "prefix_len": len(prefix)}
    try:
        readout = decode.FP32Readout(lm)
        states = {
            "incremental": decode.build_incremental(lm, fmt, prefix, where=problem.problem_id),
            "prefill": decode.build_prefill(lm, fmt, prefix, where=problem.problem_id),
        }
        states["incremental_fp32_readout"] = decode.build_incremental(lm, fmt, prefix, where=problem.problem_id, readout=readout)
        states["prefill_fp32_readout"] = decode.build_prefill(lm, fmt, prefix, where=problem.problem_id, readout=readout)
        if spec.faults:
            spec.faults(states)
        for name, s in states.items():
            gates.check_dtype(name, [(n, t) for n, t in gates.cache_tensors(s.cache)], lm.dtype)
            gates.check_finite(name, caches.boundary_tensors(s))
            gates.check_duplicates(name, caches.boundary_tensors(s))
        gates.check_functional_state(states)
        for c in ("incremental", "prefill"):
            gates.check_exact(f"{c} vs {c}_fp32_readout caches", gates.cache_tensors(states[c].cache),
                              gates.cache_tensors(states[f"{c}_fp32_readout"].cache), gate="readout")
        null, null_rec = null_perturbation(states["incremental"], states["prefill"], _row_seed(seed, problem.problem_id))
        gates.check_disjoint({n: [t for _, t in gates.cache_tensors(s.cache)] for n, s in {**states, "null": null}.items()})
        plain = {c: decode.decode_suffix(lm, fmt, states[c], spec.caps) for c in ("incremental", "prefill")}
        fp32 = {c: decode.decode_suffix(lm, fmt, states[f"{c}_fp32_readout"], spec.caps, readout=readout)
                for c in ("incremental", "prefill")}
        moved = decode.decode_suffix(lm, fmt, null, spec.caps)
        rec["baseline"] = _pair(plain["incremental"], plain["prefill"], ("incremental", "prefill"))
        rec["fp32_readout"] = _pair(fp32["incremental"], fp32["prefill"], ("incremental", "prefill"))
        fd = first_divergence(plain["incremental"].tokens, moved.tokens)
        rec["null_perturbation"] = null_rec | {
            "suffix": moved.tokens, "margins": moved.margins, "moved": fd is not None, "first_divergence": fd,
            "tie_initiated": tie_initiated(plain["incremental"].margins, moved.margins, fd),
        }
    except GateError as e:
        rec["gate_failure"] = {"gate": e.gate, "reason": e.reason}
    return rec


def controls_summary(records: Sequence[dict]) -> dict:
    """Endpoints of the exploratory controls from their ledger records.

    Returns:
        ``n``; ``baseline``, ``fp32_readout``, ``null_moved`` (Wilson over all
        rows); ``*_ties`` (tie-initiated first divergences among them);
        ``fp32_readout_among_divergent`` (rows whose plain BF16 baselines part
        and that still part under FP32 readout, with the number of such rows);
        ``null_moved_among_exact``; medians of the perturbation size against
        the real construction difference.

    Raises:
        GateError: if a row failed a gate.
    """
    require_gates(records)
    n = len(records)
    div = [r for r in records if r["baseline"]["suffix_differs"]]
    ex = [r for r in records if not r["baseline"]["suffix_differs"]]
    count = lambda rows, f: sum(bool(f(r)) for r in rows)  # noqa: E731
    return {
        "n": n,
        "baseline": wilson(count(records, lambda r: r["baseline"]["suffix_differs"]), n),
        "baseline_ties": count(div, lambda r: r["baseline"]["tie_initiated"]),
        "fp32_readout": wilson(count(records, lambda r: r["fp32_readout"]["suffix_differs"]), n),
        "fp32_readout_ties": count(records, lambda r: r["fp32_readout"]["tie_initiated"]),
        "fp32_readout_among_divergent": wilson(count(div, lambda r: r["fp32_readout"]["suffix_differs"]), len(div)) if div else None,
        "null_moved": wilson(count(records, lambda r: r["null_perturbation"]["moved"]), n),
        "null_ties": count(records, lambda r: r["null_perturbation"]["tie_initiated"]),
        "null_moved_among_exact": wilson(count(ex, lambda r: r["null_perturbation"]["moved"]), len(ex)) if ex else None,
        "null_elements_median": statistics.median(r["null_perturbation"]["elements_changed"] for r in records),
        "real_elements_median": statistics.median(r["null_perturbation"]["elements_target"] for r in records),
        "null_rel_l2_median": statistics.median(r["null_perturbation"]["rel_l2"] for r in records),
        "real_rel_l2_median": statistics.median(r["null_perturbation"]["real_rel_l2"] for r in records),
    }


def controls_table(c: dict) -> pd.DataFrame:
    """The exploratory controls table (labelled exploratory: not in the paper)."""
    n = c["n"]
    return pd.DataFrame({"exploratory controls (BF16 caches, fixed prefixes)": {
        "rows": str(n),
        "plain BF16: incremental vs prefill suffix differs": c["baseline"].pct(),
        "plain BF16: of which tie-initiated": f"{c['baseline_ties']}/{c['baseline'].k}",
        "FP32 readout (same BF16 caches; final norm and LM head in float32): suffix differs": c["fp32_readout"].pct(),
        "FP32 readout: of which tie-initiated": f"{c['fp32_readout_ties']}/{c['fp32_readout'].k}",
        "FP32 readout: still differs among rows whose plain BF16 suffixes differ": rate_text(c["fp32_readout_among_divergent"]),
        "matched null perturbation of the incremental cache: trajectory moved": c["null_moved"].pct(),
        "null perturbation: of which tie-initiated": f"{c['null_ties']}/{c['null_moved'].k}",
        "null perturbation: moved among rows whose plain BF16 suffixes agree": rate_text(c["null_moved_among_exact"]),
        "elements changed per row, median: null vs real (one duplicate row)":
            f"{c['null_elements_median']:,.0f} vs {c['real_elements_median']:,.0f}",
        "whole-cache relative L2, median: null vs real": f"{c['null_rel_l2_median']:.3g} vs {c['real_rel_l2_median']:.3g}",
    }})


def run_controls(
    problems: Sequence[Problem], prefixes: dict[str, list[int]], bank_sha256: str, settings: ArmSettings, *,
    ledger_root: str | Path, seed: int = 20260729, progress: bool = True, faults: Hook | None = None,
) -> tuple[list[dict], "Ledger"]:
    """The exploratory controls (:func:`controls_row`) on the fixed BF16 prefixes: records and ledger ``exp2_controls``."""
    missing = [p.problem_id for p in problems if p.problem_id not in prefixes]
    if missing:
        raise GateError("provenance", f"prefix bank has no prefix for {missing}")
    return run_arm(
        "exp2_controls", settings, problems, lambda spec, p: controls_row(spec, p, prefixes[p.problem_id], seed),
        ledger_root=ledger_root, extra_config={"prefix_bank_sha256": bank_sha256, "seed": seed}, progress=progress,
        faults=faults,
    )
