"""The batched decoders: live decoding, incremental rebuilds and suffixes of many problems through one engine.

:func:`decode_lives`, :func:`build_incrementals` and :func:`decode_suffixes` are the batched counterparts of
:mod:`kvreplay.decoding.decode`'s one-problem constructions. :func:`decode_chains` runs a problem's boundary construction
and then its suffixes in the same engine: boundary jobs and suffix jobs share the slots, and a freed slot takes
the next job at once. :func:`decode_forced` decodes a fixed number of tokens per boundary for the benchmark.
Each admits jobs into free slots of a :class:`~kvreplay.engine.step.StepEngine` and advances them one token per
step with the block state machine. The decoders that choose tokens take the run's
:class:`~kvreplay.decoding.settings.Decoding` whole (caps, the parsed tie rule, top-logit recording), as the eager ones do.
A problem's bits do not depend on its slot or its companions, so the order in which jobs enter the slots changes no
bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from ..decoding import decode
from ..decoding.contract import BlockFormat, Caps
from ..decoding.decode import Boundary
from ..decoding.settings import Decoding
from ..gates import GateError
from ..model.models import LoadedModel
from .run import EngineRun, EngineStats, Measured
from .scheduler import (
    _forced_work,
    _in_order,
    _incremental_work,
    _live_work,
    _Scheduler,
    _suffix_work,
    live_length_bound,
    new_engine,
    suffix_length_bound,
)
from .step import StepEngine


# -------------------------------------------------------------------------------------------- the decoders
@torch.inference_mode()
def decode_suffixes(
    lm: LoadedModel,
    fmt: BlockFormat,
    boundaries: Sequence[Boundary],
    decoding: Decoding | Caps,
    run: EngineRun = EngineRun(),
    *,
    on_gate_error: str = "raise",
    readout: decode.FP32Readout | None = None,
) -> Measured:
    """The shared suffix decoder for many boundary states at once (batched :func:`kvreplay.decoding.decode.decode_suffix`).

    Every boundary continues through merge and answer with the block state
    machine, caps, forced delimiters and structural mask of
    :func:`~kvreplay.decoding.decode.decode_suffix`, one token per step, ``batch``
    problems per step. A boundary's cache is copied into the engine (it is
    not consumed, unlike :func:`~kvreplay.decoding.decode.decode_suffix`).

    Args:
        lm: the loaded model.
        fmt: the block format.
        boundaries: states from :func:`~kvreplay.decoding.decode.build_incremental`,
            :func:`~kvreplay.decoding.decode.build_prefill`, :func:`~kvreplay.decoding.decode.decode_live`
            or :func:`decode_lives`: caches ``[2, kv_heads, |z|, head_dim]`` in
            the model dtype, roles ``[2, |z|]``, logits ``[2, vocab]``.
        decoding: the run's :class:`~kvreplay.decoding.settings.Decoding` (merge and answer caps, tie rule, top logits), or
            content caps alone (the ``lowest`` rule).
        run: the engine's settings (:class:`~kvreplay.engine.EngineRun`: step path, batch shape, attention,
            checks, slot order). ``run.max_len`` defaults to the longest ``|z|`` plus :func:`suffix_length_bound`
            (for ``flex`` rounded up to a multiple of 128); fix it to compare runs over different problems bit
            for bit. With ``run.tolerance_check`` the gate ``attention_tolerance`` runs before the first step.
        on_gate_error: ``"raise"`` stops at the first failed gate; ``"return"``
            puts the :class:`~kvreplay.gates.GateError` in that problem's place
            and goes on with the others.
        readout: FP32 readout of every step's logits (:class:`StepEngine`); the
            boundaries' logits should come from constructions built with it.

    Returns:
        One :class:`~kvreplay.decoding.decode.Suffix` per boundary, in order (or a
        ``GateError`` with ``on_gate_error="return"``), as a
        :class:`~kvreplay.engine.run.Measured` list whose ``stats`` is what the call's engine measured.

    Raises:
        GateError: ``desync`` (a problem's duplicate rows' logits differ),
            ``nonfinite`` (non-finite logits) or ``functional_state`` (a row's
            valid length, :meth:`StepEngine.check_valid_length`), with
            ``on_gate_error="raise"``; ``graph_equals_eager`` and ``attention_tolerance`` always raise.
        ContractError: a suffix did not close its answer block.
        ValueError: a bad ``run`` (batch, step path, ``max_len``, attention) or cache geometry.
    """
    if not boundaries:
        return Measured()
    d = Decoding.given(decoding)
    need = max(len(b.ids) for b in boundaries) + suffix_length_bound(fmt, d.caps)
    engine = new_engine(lm, fmt, run, need, d, readout)
    scheduler = _Scheduler(engine, on_gate_error, run.tolerance_check, run.fill_from)
    for i, b in enumerate(boundaries):
        scheduler.submit(_suffix_work(engine, fmt, d.caps, i, b))
    return Measured(_in_order(scheduler, len(boundaries)), engine.stats)


@torch.inference_mode()
def decode_lives(
    lm: LoadedModel,
    fmt: BlockFormat,
    prompts: Sequence[Sequence[int]],
    decoding: Decoding | Caps,
    run: EngineRun = EngineRun(),
    *,
    on_gate_error: str = "raise",
) -> Measured:
    """Live multi-branch decoding of many prompts at once (batched :func:`kvreplay.decoding.decode.decode_live`).

    Each prompt block is processed in one forward call of its duplicate pair
    (:func:`kvreplay.decoding.decode.forward`, ``DynamicCache``) and copied into the
    problem's rows; branches 1-3 and the merge opener then advance one token
    per batched step, as :func:`~kvreplay.decoding.decode.decode_live` schedules them.

    Args:
        prompts: token IDs of each prompt block (role 0).
        decoding: as in :func:`decode_suffixes` (branches stop at ``caps.branch``).
        run, on_gate_error: as in :func:`decode_suffixes` (``run.max_len`` defaults to the longest prompt plus
            :func:`live_length_bound`'s blocks; a live decode holds no boundary, so ``run.tolerance_check`` checks
            nothing).

    Returns:
        One live :class:`~kvreplay.decoding.decode.Boundary` per prompt: ``ids`` z,
        ``roles`` ``[2, |z|]``, a ``DynamicCache`` of copies ``[2, kv_heads,
        |z|, head_dim]``, the boundary ``logits`` ``[2, vocab]``, ``schedule``
        ``[prompt_len, 1, 1, ...]`` and ``positions`` ``[2, |z|]`` (0..|z|-1).
        A ``GateError`` in a prompt's place with ``on_gate_error="return"``. With the engine's ``stats``, as in
        :func:`decode_suffixes`.

    Raises:
        GateError: as in :func:`decode_suffixes`.
        ValueError: as in :func:`decode_suffixes`.
    """
    if not prompts:
        return Measured()
    d = Decoding.given(decoding)
    need = live_length_bound(fmt, d.caps, max(len(p) for p in prompts)) + 1
    engine = new_engine(lm, fmt, run, need, d)
    scheduler = _Scheduler(engine, on_gate_error, fill_from=run.fill_from)
    for i, p in enumerate(prompts):
        scheduler.submit(_live_work(engine, lm, fmt, d.caps, i, p))
    return Measured(_in_order(scheduler, len(prompts)), engine.stats)


@torch.inference_mode()
def build_incrementals(
    lm: LoadedModel,
    fmt: BlockFormat,
    prefixes: Sequence[Sequence[int]],
    run: EngineRun = EngineRun(),
    *,
    on_gate_error: str = "raise",
    readout: decode.FP32Readout | None = None,
) -> Measured:
    """Teacher-forced replay of the live call schedule through the engine (batched incremental construction).

    Each prefix z is rebuilt exactly as :func:`decode_lives` built it. The
    prompt block goes in one forward call of the duplicate pair; every later
    token of z, up to the merge opener, goes in its own batched step with its raw role.
    The logits of the step after the last token are the boundary
    logits. At the same batch shape (``batch``, ``max_len``) and slot, an
    engine-live boundary and the incremental rebuild of its prefix must be
    bit-identical (the bridge under the engine). Every input of every step is
    the same, and a problem's bits do not depend on its companions.

    Args:
        prefixes: boundary prefixes z (token IDs ending right after the merge opener).
        run, on_gate_error, readout: as in :func:`decode_suffixes` (``run.max_len`` defaults to the longest
            prefix plus one; ``run.tolerance_check`` checks nothing); with ``readout`` the prompt call and every
            step give FP32-readout logits and write the same keys/values as without it.

    Returns:
        One ``"incremental"`` :class:`~kvreplay.decoding.decode.Boundary` per prefix,
        laid out as :func:`decode_lives` lays out its boundaries (a
        ``GateError`` in its place with ``on_gate_error="return"``), with the engine's ``stats`` as in
        :func:`decode_suffixes`.

    Raises:
        ContractError: a prefix that does not end at the boundary.
        GateError, ValueError: as in :func:`decode_suffixes`.
    """
    if not prefixes:
        return Measured()
    parsed = [fmt.boundary_parse(z, where=f"prefix {i}") for i, z in enumerate(prefixes)]
    need = max(len(z) for z in prefixes) + 1
    engine = new_engine(lm, fmt, run, need, readout=readout)  # teacher forced: no token is chosen, no tie rule
    scheduler = _Scheduler(engine, on_gate_error, fill_from=run.fill_from)
    for i, (z, p) in enumerate(zip(prefixes, parsed)):
        scheduler.submit(_incremental_work(engine, lm, fmt, i, z, p, readout))
    return Measured(_in_order(scheduler, len(prefixes)), engine.stats)


@torch.inference_mode()
def decode_chains(
    lm: LoadedModel,
    fmt: BlockFormat,
    decoding: Decoding | Caps,
    construction: str,
    starts: Sequence[Sequence[int]],
    continue_with: Callable[..., Sequence[Boundary]],
    finished: Callable[[int, list], None],
    run: EngineRun = EngineRun(),
    *,
    hold: int | None = None,
    rebuild: Callable[[int, Boundary], bool] | None = None,
) -> EngineStats:
    """Boundary constructions and their suffixes through one engine, with a slot's next job entering at once.

    Every problem's boundary is built as :func:`decode_lives` builds it (``construction="live"``, ``starts`` the
    prompts) or :func:`build_incrementals` (``"incremental"``, ``starts`` the prefixes z). When it is done,
    ``continue_with(i, boundary)`` runs between two steps (e.g. the four-arm matrix's replica, prefill calls and
    boundary gates). It returns the boundary states whose suffixes the same engine then decodes, as
    :func:`decode_suffixes` would. Boundaries not yet started take free slots first while fewer than ``hold``
    suffixes wait (long chains start early); beyond that the suffixes go first (bounded memory). When all of problem
    ``i``'s suffixes are done, ``finished(i, suffixes)`` gets them in the order ``continue_with`` gave. At the same
    batch shape (``batch``, ``max_len``) every boundary and suffix is bit-identical to the phase-wise decoders'
    (:func:`decode_lives` or :func:`build_incrementals`, then :func:`decode_suffixes`): a problem's bits depend
    neither on its slot nor on its companions.

    Args:
        decoding: as in :func:`decode_suffixes`.
        construction: ``"live"`` or ``"incremental"``.
        starts: per problem its prompt block (live) or its prefix z (incremental).
        continue_with: ``(i, Boundary or GateError) -> boundary states`` (an empty list: nothing to decode; a
            ``GateError`` is the one that stopped the construction).
        finished: ``(i, [Suffix or GateError, ...])``, once per problem (an empty list when nothing was decoded).
        hold: waiting suffix jobs from which they go before new boundaries (default ``run.batch``; ``0``:
            suffixes always first). Its default bounds the states held beside those in the slots, also in a chunk
            of many more problems than slots. No bit depends on it.
        rebuild: ``(i, boundary) -> bool``: when true for a built boundary, the same engine also rebuilds it from
            its token IDs by teacher forcing (the incremental construction, ahead of new boundaries). Then
            ``continue_with(i, boundary, rebuilt)`` gets the rebuild (or the ``GateError`` that stopped it) as
            a third argument. At one batch shape the two are bit-identical when both compute one function.
        run: as in :func:`decode_suffixes`; ``run.max_len`` defaults to the longest boundary a start can give
            plus :func:`suffix_length_bound`.

    Returns:
        What this call's engine measured (:class:`~kvreplay.engine.run.EngineStats`: steps, slot-steps, busy
        slot-steps, verified steps, attention checks, key positions, graph capture time).

    Raises:
        ContractError: a prefix that does not end at the boundary, or a suffix that did not close its answer block.
        GateError: ``graph_equals_eager``, ``attention_tolerance``; any other gate goes to the callbacks.
        ValueError: an unknown construction, ``continue_with`` giving states after a failed construction, or as
            in :func:`decode_suffixes`.
    """
    if construction not in ("live", "incremental"):
        raise ValueError(f"construction must be 'live' or 'incremental', got {construction!r}")
    if not starts:
        return EngineStats()
    d = Decoding.given(decoding)
    parsed: list = []
    if construction == "live":
        longest = live_length_bound(fmt, d.caps, max(len(p) for p in starts))
    else:
        parsed = [fmt.boundary_parse(z, where=f"prefix {i}") for i, z in enumerate(starts)]
        longest = max(len(z) for z in starts)
    engine = new_engine(lm, fmt, run, longest + suffix_length_bound(fmt, d.caps), d)
    scheduler = _Scheduler(engine, "return", run.tolerance_check, run.fill_from, run.batch if hold is None else hold)
    for i, start in enumerate(starts):  # jobs are tagged (stage, problem, ...): "built", "rebuilt" or "suffix"
        scheduler.submit(_live_work(engine, lm, fmt, d.caps, i, start, ("built", i)) if construction == "live"
                         else _incremental_work(engine, lm, fmt, i, start, parsed[i], None, ("built", i)))
    suffixes: dict[int, list] = {}  # problem -> its suffixes so far (None: not ended yet)
    for (stage, i, *more), result in scheduler.run():  # a job ended, between two steps
        if stage == "suffix":
            suffixes[i][more[0]] = result
            if all(r is not None for r in suffixes[i]):
                finished(i, suffixes.pop(i))
        elif stage == "built" and rebuild is not None and isinstance(result, Boundary) and rebuild(i, result):
            again = fmt.boundary_parse(result.ids, where=f"problem {i} (rebuild of its boundary)")
            scheduler.submit(_incremental_work(engine, lm, fmt, i, result.ids, again, None, ("rebuilt", i, result)),
                             urgent=True)
        else:  # a boundary (and its rebuild) done: the states to continue, their suffixes ahead of new boundaries
            boundary, extra = (result, ()) if stage == "built" else (more[0], (result,))
            states = list(continue_with(i, boundary, *extra))
            if isinstance(boundary, GateError) and states:
                raise ValueError(f"problem {i}: continue_with gave states to decode after a failed construction")
            if not states:
                finished(i, [])
                continue
            suffixes[i] = [None] * len(states)
            for k, b in enumerate(states):
                scheduler.submit(_suffix_work(engine, fmt, d.caps, i, b, ("suffix", i, k)), urgent=True)
    return engine.stats


@dataclasses.dataclass(frozen=True)
class ForcedDecode:
    """What :func:`decode_forced` returns: the tokens and what this call's steps measured.

    Attributes:
        tokens: per boundary, in the order given, its ``new_tokens`` token IDs.
        steps: batched steps this call ran.
        busy_slot_steps: the slots that held a problem, summed over those steps.
        batch: the engine's problems per step ``B`` (``busy_slot_steps / (steps * batch)`` is the occupancy).
    """
    tokens: list[list[int]]
    steps: int
    busy_slot_steps: int
    batch: int


@torch.inference_mode()
def decode_forced(
    lm: LoadedModel,
    fmt: BlockFormat,
    boundaries: Sequence[Boundary],
    new_tokens: int,
    run: EngineRun = EngineRun(),
    *,
    engine: StepEngine | None = None,
) -> ForcedDecode:
    """Exactly ``new_tokens`` greedy tokens after each boundary, no blocks: the benchmark's like-for-like decode.

    The engine's step, scheduler and gates (``nonfinite``, ``desync``, ``functional_state``) as in
    :func:`decode_suffixes`, but no delimiter is forced and no cap or structural mask applies. Each token is the
    argmax over the whole vocabulary (lowest ID on a tie) and takes the merge block's role. So every row decodes
    the same number of tokens, as Hugging Face ``generate`` with ``min_new_tokens = max_new_tokens``.

    Args:
        boundaries: the states to continue (caches ``[2, kv_heads, |z|, head_dim]``).
        new_tokens: tokens per boundary (at least 1).
        run: as in :func:`decode_suffixes` (``run.max_len`` defaults to the longest ``|z|`` plus ``new_tokens``;
            its checks and slot order are not used); ignored when ``engine`` is given.
        engine: an engine to run in (its captured graph is reused; its slots must be free), else a new one.

    Returns:
        A :class:`ForcedDecode`: the tokens per boundary, and the steps and busy slot-steps of this call.

    Raises:
        GateError: any gate (they all raise here).
        ValueError: ``new_tokens < 1``, or as in :func:`decode_suffixes`.
    """
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be at least 1, got {new_tokens}")
    if engine is None:
        need = max(len(b.ids) for b in boundaries) + new_tokens
        engine = new_engine(lm, fmt, run, need)
    steps, busy = engine.stats.steps, engine.stats.busy_slot_steps
    scheduler = _Scheduler(engine, "raise")
    for i, b in enumerate(boundaries):
        scheduler.submit(_forced_work(engine, i, b, new_tokens))
    results = _in_order(scheduler, len(boundaries))
    return ForcedDecode(results, engine.stats.steps - steps, engine.stats.busy_slot_steps - busy, engine.batch)
