"""The batched decoders: live decoding, incremental rebuilds and suffixes of many problems through one engine.

:func:`decode_lives`, :func:`build_incrementals` and :func:`decode_suffixes` are the batched counterparts of
:mod:`kvreplay.decode`'s one-problem constructions. :func:`decode_chains` runs a problem's boundary construction
and then its suffixes in the same engine: boundary jobs and suffix jobs share the slots, and a freed slot takes
the next job at once. :func:`decode_forced` decodes a fixed number of tokens per boundary for the benchmark.
Each admits jobs into free slots of a :class:`~kvreplay.engine.step.StepEngine` and advances them one token per
step with the block state machine. A problem's bits do not depend on its slot or its companions, so the order in
which jobs enter the slots changes no bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .. import decode
from ..contract import BlockFormat, Caps
from ..decode import Boundary
from ..gates import GateError
from ..models import LoadedModel
from .run import EngineRun
from .scheduler import (
    _collect,
    _forced_work,
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
    caps: Caps,
    run: EngineRun = EngineRun(),
    *,
    on_gate_error: str = "raise",
    readout: decode.FP32Readout | None = None,
) -> list:
    """The shared suffix decoder for many boundary states at once (batched :func:`kvreplay.decode.decode_suffix`).

    Every boundary continues through merge and answer with the block state
    machine, caps, forced delimiters and structural mask of
    :func:`~kvreplay.decode.decode_suffix`, one token per step, ``batch``
    problems per step. A boundary's cache is copied into the engine (it is
    not consumed, unlike :func:`~kvreplay.decode.decode_suffix`).

    Args:
        lm: the loaded model.
        fmt: the block format.
        boundaries: states from :func:`~kvreplay.decode.build_incremental`,
            :func:`~kvreplay.decode.build_prefill`, :func:`~kvreplay.decode.decode_live`
            or :func:`decode_lives`: caches ``[2, kv_heads, |z|, head_dim]`` in
            the model dtype, roles ``[2, |z|]``, logits ``[2, vocab]``.
        caps: content caps (merge and answer are used).
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
        One :class:`~kvreplay.decode.Suffix` per boundary, in order (or a
        ``GateError`` with ``on_gate_error="return"``).

    Raises:
        GateError: ``desync`` (a problem's duplicate rows' logits differ),
            ``nonfinite`` (non-finite logits) or ``functional_state`` (a row's
            valid length, :meth:`StepEngine.check_valid_length`), with
            ``on_gate_error="raise"``; ``graph_equals_eager`` and ``attention_tolerance`` always raise.
        ContractError: a suffix did not close its answer block.
        ValueError: a bad ``run`` (batch, step path, ``max_len``, attention) or cache geometry.
    """
    if not boundaries:
        return []
    need = max(len(b.ids) for b in boundaries) + suffix_length_bound(fmt, caps)
    engine = new_engine(lm, fmt, run, need, readout)
    scheduler = _Scheduler(engine, on_gate_error, run.tolerance_check, run.fill_from)
    results, into = _collect(len(boundaries))
    for i, b in enumerate(boundaries):
        scheduler.submit(_suffix_work(engine, fmt, caps, i, b, into(i)))
    scheduler.run()
    return results


@torch.inference_mode()
def decode_lives(
    lm: LoadedModel,
    fmt: BlockFormat,
    prompts: Sequence[Sequence[int]],
    caps: Caps,
    run: EngineRun = EngineRun(),
    *,
    on_gate_error: str = "raise",
) -> list:
    """Live multi-branch decoding of many prompts at once (batched :func:`kvreplay.decode.decode_live`).

    Each prompt block is processed in one forward call of its duplicate pair
    (:func:`kvreplay.decode.forward`, ``DynamicCache``) and copied into the
    problem's rows; branches 1-3 and the merge opener then advance one token
    per batched step, as :func:`~kvreplay.decode.decode_live` schedules them.

    Args:
        prompts: token IDs of each prompt block (role 0).
        caps: content caps (branches stop at ``caps.branch``).
        run, on_gate_error: as in :func:`decode_suffixes` (``run.max_len`` defaults to the longest prompt plus
            :func:`live_length_bound`'s blocks; a live decode holds no boundary, so ``run.tolerance_check`` checks
            nothing).

    Returns:
        One live :class:`~kvreplay.decode.Boundary` per prompt: ``ids`` z,
        ``roles`` ``[2, |z|]``, a ``DynamicCache`` of copies ``[2, kv_heads,
        |z|, head_dim]``, the boundary ``logits`` ``[2, vocab]``, ``schedule``
        ``[prompt_len, 1, 1, ...]`` and ``positions`` ``[2, |z|]`` (0..|z|-1).
        A ``GateError`` in a prompt's place with ``on_gate_error="return"``.

    Raises:
        GateError: as in :func:`decode_suffixes`.
        ValueError: as in :func:`decode_suffixes`.
    """
    if not prompts:
        return []
    need = live_length_bound(fmt, caps, max(len(p) for p in prompts)) + 1
    engine = new_engine(lm, fmt, run, need)
    scheduler = _Scheduler(engine, on_gate_error, fill_from=run.fill_from)
    results, into = _collect(len(prompts))
    for i, p in enumerate(prompts):
        scheduler.submit(_live_work(engine, lm, fmt, caps, i, p, into(i)))
    scheduler.run()
    return results


@torch.inference_mode()
def build_incrementals(
    lm: LoadedModel,
    fmt: BlockFormat,
    prefixes: Sequence[Sequence[int]],
    run: EngineRun = EngineRun(),
    *,
    on_gate_error: str = "raise",
    readout: decode.FP32Readout | None = None,
) -> list:
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
        One ``"incremental"`` :class:`~kvreplay.decode.Boundary` per prefix,
        laid out as :func:`decode_lives` lays out its boundaries (a
        ``GateError`` in its place with ``on_gate_error="return"``).

    Raises:
        ContractError: a prefix that does not end at the boundary.
        GateError, ValueError: as in :func:`decode_suffixes`.
    """
    if not prefixes:
        return []
    parsed = [fmt.boundary_parse(z, where=f"prefix {i}") for i, z in enumerate(prefixes)]
    need = max(len(z) for z in prefixes) + 1
    engine = new_engine(lm, fmt, run, need, readout)
    scheduler = _Scheduler(engine, on_gate_error, fill_from=run.fill_from)
    results, into = _collect(len(prefixes))
    for i, (z, p) in enumerate(zip(prefixes, parsed)):
        scheduler.submit(_incremental_work(engine, lm, fmt, i, z, p, readout, into(i)))
    scheduler.run()
    return results


class _Chains:
    """What :func:`decode_chains` does when a job of a problem ends, between two steps of its scheduler.

    A built boundary (:meth:`boundary_done`) is rebuilt first when ``rebuild`` asks (:meth:`rebuilt_done`), then
    handed to ``continue_with``; its states' suffix jobs join the queue ahead of new boundaries
    (:meth:`suffix_done`); once all of them ended, ``finished`` gets them in order.
    """

    def __init__(self, engine, scheduler: _Scheduler, lm: LoadedModel, fmt: BlockFormat, caps: Caps,
                 continue_with: Callable[..., Sequence[Boundary]], finished: Callable[[int, list], None],
                 rebuild: Callable[[int, Boundary], bool] | None):
        self.engine, self.scheduler, self.lm, self.fmt, self.caps = engine, scheduler, lm, fmt, caps
        self.continue_with, self.finished, self.rebuild = continue_with, finished, rebuild
        self.suffixes: dict[int, list] = {}  # problem -> its suffixes so far (None: not ended yet)

    def boundary_done(self, i: int) -> Callable[[object], None]:
        """The end of problem ``i``'s construction: a :class:`Boundary` or the ``GateError`` that stopped it."""
        def done(boundary: object) -> None:
            if self.rebuild is not None and isinstance(boundary, Boundary) and self.rebuild(i, boundary):
                again = self.fmt.boundary_parse(boundary.ids, where=f"problem {i} (rebuild of its boundary)")
                self.scheduler.submit(_incremental_work(self.engine, self.lm, self.fmt, i, boundary.ids, again, None,
                                                        self.rebuilt_done(i, boundary)), urgent=True)
            else:
                self.proceed(i, boundary, ())
        return done

    def rebuilt_done(self, i: int, boundary: Boundary) -> Callable[[object], None]:
        """The end of the incremental rebuild of problem ``i``'s ``boundary`` (or its ``GateError``)."""
        return lambda rebuilt: self.proceed(i, boundary, (rebuilt,))

    def proceed(self, i: int, boundary: object, extra: tuple) -> None:
        """``continue_with``, then the suffix jobs of the states it gives (none: ``finished(i, [])`` at once)."""
        states = list(self.continue_with(i, boundary, *extra))
        if isinstance(boundary, GateError) and states:
            raise ValueError(f"problem {i}: continue_with gave states to decode after a failed construction")
        if not states:
            self.finished(i, [])
            return
        self.suffixes[i] = [None] * len(states)
        for k, b in enumerate(states):
            self.scheduler.submit(_suffix_work(self.engine, self.fmt, self.caps, i, b, self.suffix_done(i, k)),
                                  urgent=True)

    def suffix_done(self, i: int, k: int) -> Callable[[object], None]:
        """The end of problem ``i``'s ``k``-th suffix; the last one hands them all to ``finished``."""
        def done(result: object) -> None:
            got = self.suffixes[i]
            got[k] = result
            if all(r is not None for r in got):
                del self.suffixes[i]
                self.finished(i, got)
        return done


@torch.inference_mode()
def decode_chains(
    lm: LoadedModel,
    fmt: BlockFormat,
    caps: Caps,
    construction: str,
    starts: Sequence[Sequence[int]],
    continue_with: Callable[..., Sequence[Boundary]],
    finished: Callable[[int, list], None],
    run: EngineRun = EngineRun(),
    *,
    hold: int | None = None,
    rebuild: Callable[[int, Boundary], bool] | None = None,
) -> dict[str, int]:
    """Boundary constructions and their suffixes through one engine, with a slot's next job entering at once.

    Every problem's boundary is built as :func:`decode_lives` builds it (``construction="live"``, ``starts`` the
    prompts) or :func:`build_incrementals` (``"incremental"``, ``starts`` the prefixes z). When it is done,
    ``continue_with(i, boundary)`` runs between two steps (e.g. the four-arm matrix's replica, prefill calls and
    boundary gates). It returns the boundary states whose suffixes the same engine then decodes, as
    :func:`decode_suffixes` would. Boundaries not yet started take free slots first while fewer than ``hold``
    suffixes wait (long chains start early); beyond that the suffixes go first (bounded memory). When all of problem ``i``'s suffixes are done, ``finished(i, suffixes)`` gets them in the order
    ``continue_with`` gave. At the same batch shape (``batch``, ``max_len``) every boundary and suffix is
    bit-identical to the phase-wise decoders' (:func:`decode_lives` or :func:`build_incrementals`, then
    :func:`decode_suffixes`): a problem's bits depend neither on its slot nor on its companions.

    Args:
        construction: ``"live"`` or ``"incremental"``.
        starts: per problem its prompt block (live) or its prefix z (incremental).
        continue_with: ``(i, Boundary or GateError) -> boundary states`` (an empty list: nothing to decode; a
            ``GateError`` is the one that stopped the construction).
        finished: ``(i, [Suffix or GateError, ...])``, once per problem (an empty list when nothing was decoded).
        hold: waiting suffix jobs from which they go before new boundaries (default ``4 * run.batch``: the states of
            about ``batch`` problems wait; ``0``: suffixes always first). No bit depends on it.
        rebuild: ``(i, boundary) -> bool``: when true for a built boundary, the same engine also rebuilds it from
            its token IDs by teacher forcing (the incremental construction, ahead of new boundaries). Then
            ``continue_with(i, boundary, rebuilt)`` gets the rebuild (or the ``GateError`` that stopped it) as
            a third argument. At one batch shape the two are bit-identical when both compute one function.
        run: as in :func:`decode_suffixes`; ``run.max_len`` defaults to the longest boundary a start can give
            plus :func:`suffix_length_bound`.

    Returns:
        ``{"steps", "busy_slot_steps", "batch"}`` of the engine (slot occupancy: ``busy_slot_steps / (steps *
        batch)``).

    Raises:
        ContractError: a prefix that does not end at the boundary, or a suffix that did not close its answer block.
        GateError: ``graph_equals_eager``, ``attention_tolerance``; any other gate goes to the callbacks.
        ValueError: an unknown construction, or as in :func:`decode_suffixes`.
    """
    if construction not in ("live", "incremental"):
        raise ValueError(f"construction must be 'live' or 'incremental', got {construction!r}")
    if not starts:
        return {"steps": 0, "busy_slot_steps": 0, "batch": run.batch}
    if construction == "live":
        parsed = None
        longest = live_length_bound(fmt, caps, max(len(p) for p in starts))
    else:
        parsed = [fmt.boundary_parse(z, where=f"prefix {i}") for i, z in enumerate(starts)]
        longest = max(len(z) for z in starts)
    engine = new_engine(lm, fmt, run, longest + suffix_length_bound(fmt, caps))
    scheduler = _Scheduler(engine, "return", run.tolerance_check, run.fill_from, 4 * run.batch if hold is None else hold)
    chains = _Chains(engine, scheduler, lm, fmt, caps, continue_with, finished, rebuild)
    for i, start in enumerate(starts):
        if parsed is None:
            scheduler.submit(_live_work(engine, lm, fmt, caps, i, start, chains.boundary_done(i)))
        else:
            scheduler.submit(_incremental_work(engine, lm, fmt, i, start, parsed[i], None, chains.boundary_done(i)))
    scheduler.run()  # a job's end calls a step of `chains`, which may submit the problem's next jobs
    return {"steps": engine.steps, "busy_slot_steps": engine.busy_slot_steps, "batch": engine.batch}


@torch.inference_mode()
def decode_forced(
    lm: LoadedModel,
    fmt: BlockFormat,
    boundaries: Sequence[Boundary],
    new_tokens: int,
    run: EngineRun = EngineRun(),
    *,
    engine: StepEngine | None = None,
) -> tuple[list[list[int]], dict[str, int]]:
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
        ``(tokens per boundary, {"steps", "busy_slot_steps", "batch"})`` of this call.

    Raises:
        GateError: any gate (they all raise here).
        ValueError: ``new_tokens < 1``, or as in :func:`decode_suffixes`.
    """
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be at least 1, got {new_tokens}")
    if engine is None:
        need = max(len(b.ids) for b in boundaries) + new_tokens
        engine = new_engine(lm, fmt, run, need)
    steps, busy = engine.steps, engine.busy_slot_steps
    scheduler = _Scheduler(engine, "raise")
    results, into = _collect(len(boundaries))
    for i, b in enumerate(boundaries):
        scheduler.submit(_forced_work(engine, i, b, new_tokens, into(i)))
    scheduler.run()
    return results, {"steps": engine.steps - steps, "busy_slot_steps": engine.busy_slot_steps - busy,
                     "batch": engine.batch}
