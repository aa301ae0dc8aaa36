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

import dataclasses
from collections import deque
from collections.abc import Callable, Sequence

import torch

from .. import decode
from ..contract import ANSWER, BRANCH1, MERGE, PROMPT, BlockFormat, Caps, ContractError
from ..decode import BlockCursor, Boundary, Suffix
from ..gates import GateError
from ..models import LoadedModel
from .attention import FLEX_BLOCK
from .step import StepEngine


class _Cursor(BlockCursor):
    """:class:`BlockCursor` split in two halves around a batched step.

    :meth:`prepare` applies the cap before the logits exist (so the step knows
    the structural mask); :meth:`BlockCursor.take` consumes the forced queue or accepts the
    token chosen on the device. Together they make the transitions of
    :meth:`BlockCursor.step`.
    """
    def prepare(self) -> int:
        """Apply the content cap; return the raw role whose structural mask the next choice uses."""
        if self.in_content and self.count >= self.caps.for_role(self.role):
            self._close()
        return self.role


class _Forced:
    """A cursor without blocks for the benchmark: ``n`` tokens, each the argmax over the whole vocabulary.

    The new tokens take role ``MERGE`` (so the step's mask is the one a suffix has); the choice uses role
    ``PROMPT``'s structural mask, which the engine leaves all-eligible.
    """
    def __init__(self, n: int):
        self.n, self.count, self.done, self.role = n, 0, n < 1, MERGE

    def prepare(self) -> int:
        return PROMPT

    def take(self, chosen: int, margin: float) -> tuple[int, int, float | None]:
        self.count += 1
        self.done = self.count >= self.n
        return chosen, MERGE, margin


@dataclasses.dataclass
class _Job:
    index: int
    cursor: _Cursor | _Forced
    ids: list[int]
    roles: list[int]
    work: "_Work"
    new: list[int] = dataclasses.field(default_factory=list)
    margins: list = dataclasses.field(default_factory=list)
    finishing: bool = False  # fed its last token: the next step's logits end it (a built boundary)


@dataclasses.dataclass
class _Work:
    """One job waiting for a slot: how it enters one, when it ends, what it gives back.

    ``admit(slot)`` loads the job's state into a slot and returns the job and its duplicate pair's first logits
    ``[2, vocab]``; ``finish(job, slot, logits)`` builds the result (``logits`` are the pair's logits of the step
    after the last feed for a job that ends after feeding, else ``None``); ``done(result)`` receives it, or the
    :class:`~kvreplay.gates.GateError` that stopped the job. ``builds`` marks a boundary construction (live or
    incremental), which ends once it has fed its merge opener; other jobs end when their cursor is done.
    """
    index: int
    admit: Callable[[int], tuple[_Job, torch.Tensor]]
    finish: Callable[[_Job, int, torch.Tensor | None], object]
    done: Callable[[object], None]
    builds: bool = False


def _check(stats: list[list[float]], row: int, job: _Job, position: int) -> None:
    if stats[3][row] != 1.0 or stats[3][row + 1] != 1.0:
        raise GateError("nonfinite", f"problem {job.index}: non-finite logits after the step ending at position "
                                     f"{position}")
    if stats[2][row] != 1.0:
        raise GateError("desync", f"problem {job.index}: duplicate rows' logits differ after the step ending at "
                                  f"position {position}")


class _Scheduler:
    """The slot scheduler every batched decoder drives: a queue of jobs, ``B`` slots, one step at a time.

    Before each step every free slot takes the next waiting job. New boundary constructions go first while
    fewer than ``hold`` suffix jobs (``urgent``) wait, so long chains start early; from ``hold`` waiting suffix
    jobs on, those go first, which bounds the boundary states held in memory (``hold=None``: suffix jobs always
    first). After each step every busy slot checks its rows (gates ``nonfinite``, ``desync``), takes its token and
    stages the next; a job that ends hands its result to its ``done`` callback, which may submit more jobs.

    ``on_gate_error="raise"`` stops at the first failed gate; ``"return"`` gives the ``GateError`` to the
    job's ``done`` and goes on. With ``tolerance_check`` the engine runs its ``attention_tolerance`` gate
    (:meth:`StepEngine.check_attention`) before the first step in which a slot continues from a boundary.
    ``fill_from="last"`` hands out free slots from the last one down (the ``composition`` gate's run alone).
    """
    def __init__(self, engine: StepEngine, on_gate_error: str = "raise", tolerance_check: bool = False,
                 fill_from: str = "first", hold: int | None = None):
        if on_gate_error not in ("raise", "return"):
            raise ValueError(f"on_gate_error must be 'raise' or 'return', got {on_gate_error!r}")
        if fill_from not in ("first", "last"):
            raise ValueError(f"fill_from must be 'first' or 'last', got {fill_from!r}")
        self.engine, self.on_gate_error = engine, on_gate_error
        self.order = range(engine.batch) if fill_from == "first" else range(engine.batch - 1, -1, -1)
        self.tolerance_check = tolerance_check and engine.attention != "sdpa"
        self.slots: list[_Job | None] = [None] * engine.batch
        self.urgent: deque[_Work] = deque()
        self.waiting: deque[_Work] = deque()
        self.hold = hold

    def submit(self, work: _Work, urgent: bool = False) -> None:
        (self.urgent if urgent else self.waiting).append(work)

    def _fail(self, slot: int, err: GateError) -> None:
        job = self.slots[slot]
        self.slots[slot] = None
        self.engine.set_idle(slot)
        if self.on_gate_error == "raise":
            raise err
        job.work.done(err)

    def _end(self, slot: int, logits: torch.Tensor | None) -> None:
        job = self.slots[slot]
        result = job.work.finish(job, slot, logits)
        self.slots[slot] = None
        self.engine.set_idle(slot)
        job.work.done(result)

    def _advance(self, slot: int, chosen: int, margin: float) -> None:
        """Take the next token of the job in ``slot`` and stage its feed (or finish the job)."""
        engine, job = self.engine, self.slots[slot]
        token, role, m = job.cursor.take(chosen, margin)
        job.new.append(token)
        job.margins.append(m)
        job.roles.append(role)
        if job.cursor.done:
            try:  # the last token was chosen, not fed: |ids| + |new| - 1 positions written
                engine.check_valid_length(slot, len(job.ids) + len(job.new) - 1, job.roles, f"problem {job.index}")
            except GateError as err:
                self._fail(slot, err)
                return
            self._end(slot, None)
            return
        position = len(job.ids) + len(job.new) - 1
        if job.work.builds and job.cursor.role == MERGE and job.cursor.in_content:
            job.finishing = True  # the merge opener is fed now; the next step's logits are the boundary's
            engine.set_row_pair(slot, token, position, role, MERGE)
        else:
            engine.set_row_pair(slot, token, position, role, job.cursor.prepare())

    def _fill(self) -> None:
        engine = self.engine
        for slot in self.order:
            while self.slots[slot] is None and (self.urgent or self.waiting):
                late = not self.urgent or (self.hold is not None and len(self.urgent) < self.hold)
                work = (self.waiting if self.waiting and late else self.urgent).popleft()
                job, logits = work.admit(slot)
                self.slots[slot] = job
                stats = engine.first_choice(logits, job.cursor.prepare())
                try:
                    _check(stats, 0, job, len(job.ids) - 1)
                except GateError as err:
                    self._fail(slot, err)
                    continue
                self._advance(slot, int(stats[0][0]), stats[1][0])

    def run(self) -> None:
        """Drive every submitted job (and every job their callbacks submit) to its end."""
        engine = self.engine
        while True:
            self._fill()
            if all(j is None for j in self.slots):
                return
            if self.tolerance_check and engine.attention_check is None:
                held = [j for j in self.slots if j is not None and not j.work.builds]
                if held:
                    engine.check_attention(f"problem {held[0].index}'s boundary in the engine")
            logits, stats = engine.step()
            for slot, job in enumerate(self.slots):
                if job is None:
                    continue
                r = 2 * slot
                try:
                    _check(stats, r, job, len(job.ids) + len(job.new) - 1)
                except GateError as err:
                    self._fail(slot, err)
                    continue
                if job.finishing:
                    try:  # every token was fed
                        engine.check_valid_length(slot, len(job.ids) + len(job.new), job.roles, f"problem {job.index}")
                    except GateError as err:
                        self._fail(slot, err)
                        continue
                    self._end(slot, logits[r : r + 2].clone())
                else:
                    self._advance(slot, int(stats[0][r]), stats[1][r])


def suffix_length_bound(fmt: BlockFormat, caps: Caps) -> int:
    """Most tokens a suffix can hold: merge content and closer, answer opener, content and closer."""
    return (caps.merge + len(fmt.closers[MERGE]) + len(fmt.openers[ANSWER]) + caps.answer
            + len(fmt.closers[ANSWER]))


def live_length_bound(fmt: BlockFormat, caps: Caps, prompt_len: int) -> int:
    """Most tokens a live prefix z can hold: the prompt, three capped branch blocks, the merge opener."""
    branches = sum(len(fmt.openers[r]) + caps.branch + len(fmt.closers[r]) for r in (1, 2, 3))
    return prompt_len + branches + len(fmt.openers[MERGE])


def _engine(lm, fmt, batch, step_path, max_len, need: int, verify_steps: int = 0, readout=None,
            attention: str = "sdpa") -> StepEngine:
    if max_len is None:
        max_len = -(-need // FLEX_BLOCK) * FLEX_BLOCK if attention == "flex" else need
    if need > max_len:
        raise ValueError(f"max_len={max_len} is shorter than the {need} positions the longest problem may need")
    return StepEngine(lm, fmt, batch, max_len, step_path, verify_steps, readout, attention)


# ------------------------------------------------------------------------------------------------ jobs
def _suffix_work(engine: StepEngine, fmt: BlockFormat, caps: Caps, index: int, b: Boundary,
                 done: Callable[[object], None]) -> _Work:
    def admit(slot: int):
        n = engine.admit(slot, b.cache, b.roles)
        if n != len(b.ids):
            raise ValueError(f"problem {index}: cache holds {n} positions, the prefix has {len(b.ids)}")
        return _Job(index, _Cursor(fmt, caps, MERGE), list(b.ids), b.roles[0].tolist(), work), b.logits

    def finish(job: _Job, slot: int, logits):
        full = job.ids + job.new
        parsed = fmt.parse(full, where=f"{b.construction} suffix")
        if not parsed.complete:
            raise ContractError(f"{b.construction} suffix: the answer block was not closed")
        (m0, m1), (a0, a1) = parsed.content[MERGE], parsed.content[ANSWER]
        return Suffix(job.new, job.margins, full[m0:m1], full[a0:a1])

    work = _Work(index, admit, finish, done)
    return work


def _built(engine: StepEngine, lm: LoadedModel, construction: str, job: _Job, slot: int, logits) -> Boundary:
    """The boundary a live or incremental job built: copies of its rows, roles, positions, call schedule."""
    dev = lm.device
    z = job.ids + job.new
    n = len(z)
    roles = torch.tensor(job.roles, dtype=torch.long, device=dev).expand(decode.BATCH, -1).contiguous()
    positions = torch.arange(n, device=dev).expand(decode.BATCH, -1).contiguous()
    cache = engine.cache.to_dynamic(2 * slot, n, lm.model.config)
    return Boundary(construction, z, roles, cache, logits, [len(job.ids)] + [1] * len(job.new), positions,
                    lm.layout.windows)


def _live_work(engine: StepEngine, lm: LoadedModel, fmt: BlockFormat, caps: Caps, index: int, prompt: Sequence[int],
               done: Callable[[object], None]) -> _Work:
    dev = lm.device

    def admit(slot: int):
        ids = list(prompt)
        roles = torch.full((decode.BATCH, len(ids)), PROMPT, dtype=torch.long, device=dev)
        cache = decode.new_cache(lm)  # every layer keeps every position (a sliding layer's too)
        logits = decode.forward(lm, cache, decode._as_batch(ids, dev), roles, 0)
        engine.admit(slot, cache, roles)
        cursor = _Cursor(fmt, caps, PROMPT, [(t, BRANCH1) for t in fmt.openers[BRANCH1]])
        return _Job(index, cursor, ids, [PROMPT] * len(ids), work), logits

    work = _Work(index, admit, lambda job, slot, logits: _built(engine, lm, "live", job, slot, logits), done,
                 builds=True)
    return work


def _forced_work(engine: StepEngine, index: int, b: Boundary, n: int, done: Callable[[object], None]) -> _Work:
    def admit(slot: int):
        engine.admit(slot, b.cache, b.roles)
        return _Job(index, _Forced(n), list(b.ids), b.roles[0].tolist(), work), b.logits

    work = _Work(index, admit, lambda job, slot, logits: job.new, done)
    return work


_FREE = Caps(branch=1 << 30, merge=1 << 30, answer=1 << 30)  # a teacher-forced rebuild: every token is forced


def _incremental_work(engine: StepEngine, lm: LoadedModel, fmt: BlockFormat, index: int, z: Sequence[int],
                      parsed, readout, done: Callable[[object], None]) -> _Work:
    dev = lm.device
    z = list(z)

    def admit(slot: int):
        p = parsed.prompt_len
        roles = torch.full((decode.BATCH, p), PROMPT, dtype=torch.long, device=dev)
        cache = decode.new_cache(lm)
        logits = decode.forward(lm, cache, decode._as_batch(z[:p], dev), roles, 0, readout=readout)
        engine.admit(slot, cache, roles)
        cursor = _Cursor(fmt, _FREE, PROMPT, list(zip(z[p:], parsed.roles[p:])))
        return _Job(index, cursor, z[:p], [PROMPT] * p, work), logits

    def finish(job: _Job, slot: int, logits) -> Boundary:
        if job.ids + job.new != z:
            raise ContractError(f"prefix {index}: teacher forcing stopped at {len(job.ids) + len(job.new)} tokens, "
                                f"not at its boundary")
        return _built(engine, lm, "incremental", job, slot, logits)

    work = _Work(index, admit, finish, done, builds=True)
    return work


def _collect(n: int) -> tuple[list, Callable[[int], Callable[[object], None]]]:
    results: list = [None] * n

    def into(i: int) -> Callable[[object], None]:
        def done(result: object) -> None:
            results[i] = result
        return done

    return results, into


# -------------------------------------------------------------------------------------------- the decoders
@torch.inference_mode()
def decode_suffixes(
    lm: LoadedModel,
    fmt: BlockFormat,
    boundaries: Sequence[Boundary],
    caps: Caps,
    *,
    batch: int = 8,
    step_path: str = "eager",
    max_len: int | None = None,
    on_gate_error: str = "raise",
    verify_steps: int = 0,
    readout: decode.FP32Readout | None = None,
    attention: str = "sdpa",
    tolerance_check: bool = False,
    fill_from: str = "first",
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
        batch: problems per step (``2 * batch`` rows); part of the batch shape.
        step_path: ``"eager"`` or ``"graph"`` (CUDA graph; CUDA only).
        max_len: positions per row, part of the batch shape; default the longest
            ``|z|`` plus :func:`suffix_length_bound` (for ``attention="flex"`` rounded up to a multiple of
            128). Fix it to compare runs over different problem sets bit for bit.
        on_gate_error: ``"raise"`` stops at the first failed gate; ``"return"``
            puts the :class:`~kvreplay.gates.GateError` in that problem's place
            and goes on with the others.
        verify_steps: steps checked against the eager step (:class:`StepEngine`).
        attention: the step's attention, ``"sdpa"``, ``"grouped"`` or ``"flex"``
            (:data:`kvreplay.engine.ATTENTIONS`); part of the contract.
        tolerance_check: run the gate ``attention_tolerance`` before the first step
            (:meth:`StepEngine.check_attention`; nothing for ``"sdpa"``).
        fill_from: ``"first"`` (default) or ``"last"``: the free slot a waiting problem takes first (no bit
            depends on it; the ``composition`` gate's run alone takes the last).
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
        ValueError: bad ``batch``, ``step_path``, ``max_len`` or cache geometry.
    """
    if not boundaries:
        return []
    need = max(len(b.ids) for b in boundaries) + suffix_length_bound(fmt, caps)
    engine = _engine(lm, fmt, batch, step_path, max_len, need, verify_steps, readout, attention)
    scheduler = _Scheduler(engine, on_gate_error, tolerance_check, fill_from)
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
    *,
    batch: int = 8,
    step_path: str = "eager",
    max_len: int | None = None,
    on_gate_error: str = "raise",
    verify_steps: int = 0,
    attention: str = "sdpa",
    tolerance_check: bool = False,
    fill_from: str = "first",
) -> list:
    """Live multi-branch decoding of many prompts at once (batched :func:`kvreplay.decode.decode_live`).

    Each prompt block is processed in one forward call of its duplicate pair
    (:func:`kvreplay.decode.forward`, ``DynamicCache``) and copied into the
    problem's rows; branches 1-3 and the merge opener then advance one token
    per batched step, as :func:`~kvreplay.decode.decode_live` schedules them.

    Args:
        prompts: token IDs of each prompt block (role 0).
        caps: content caps (branches stop at ``caps.branch``).
        batch, step_path, max_len, on_gate_error, verify_steps, attention, fill_from: as in
            :func:`decode_suffixes` (``max_len`` defaults to the longest prompt plus :func:`live_length_bound`'s
            blocks).
        tolerance_check: accepted for a uniform call; a live decode holds no boundary, so nothing is checked.

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
    engine = _engine(lm, fmt, batch, step_path, max_len, need, verify_steps, attention=attention)
    scheduler = _Scheduler(engine, on_gate_error, fill_from=fill_from)
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
    *,
    batch: int = 8,
    step_path: str = "eager",
    max_len: int | None = None,
    on_gate_error: str = "raise",
    verify_steps: int = 0,
    readout: decode.FP32Readout | None = None,
    attention: str = "sdpa",
    tolerance_check: bool = False,
    fill_from: str = "first",
) -> list:
    """Teacher-forced replay of the live call schedule through the engine (batched incremental construction).

    Each prefix z is rebuilt exactly as :func:`decode_lives` built it: the
    prompt block in one forward call of the duplicate pair, then every later
    token of z fed in its own batched step with its raw role, up to the merge
    opener; the logits of the step after the last token are the boundary
    logits. At the same batch shape (``batch``, ``max_len``) and slot, an
    engine-live boundary and the incremental rebuild of its prefix must be
    bit-identical (the bridge under the engine): every input of every step is
    the same, and a problem's bits do not depend on its companions.

    Args:
        prefixes: boundary prefixes z (token IDs ending right after the merge opener).
        batch, step_path, max_len, on_gate_error, verify_steps, readout, attention, fill_from: as in
            :func:`decode_suffixes` (``max_len`` defaults to the longest prefix plus one);
            with ``readout`` the prompt call and every step give FP32-readout logits
            and write the same keys/values as without it.
        tolerance_check: as in :func:`decode_lives` (nothing is checked).

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
    engine = _engine(lm, fmt, batch, step_path, max_len, need, verify_steps, readout, attention)
    scheduler = _Scheduler(engine, on_gate_error, fill_from=fill_from)
    results, into = _collect(len(prefixes))
    for i, (z, p) in enumerate(zip(prefixes, parsed)):
        scheduler.submit(_incremental_work(engine, lm, fmt, i, z, p, readout, into(i)))
    scheduler.run()
    return results


@torch.inference_mode()
def decode_chains(
    lm: LoadedModel,
    fmt: BlockFormat,
    caps: Caps,
    construction: str,
    starts: Sequence[Sequence[int]],
    continue_with: Callable[..., Sequence[Boundary]],
    finished: Callable[[int, list], None],
    *,
    batch: int = 8,
    step_path: str = "eager",
    max_len: int | None = None,
    verify_steps: int = 0,
    attention: str = "sdpa",
    tolerance_check: bool = False,
    fill_from: str = "first",
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
        hold: waiting suffix jobs from which they go before new boundaries (default ``4 * batch``: the states of
            about ``batch`` problems wait; ``0``: suffixes always first). No bit depends on it.
        rebuild: ``(i, boundary) -> bool``: when true for a built boundary, the same engine also rebuilds it from
            its token IDs by teacher forcing (the incremental construction, ahead of new boundaries), and
            ``continue_with(i, boundary, rebuilt)`` gets the rebuild (or the ``GateError`` that stopped it) as
            a third argument; at one batch shape the two are bit-identical when both compute one function.
        batch, step_path, max_len, verify_steps, attention, tolerance_check, fill_from: as in
            :func:`decode_suffixes`;
            ``max_len`` defaults to the longest boundary a start can give plus :func:`suffix_length_bound`.

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
        return {"steps": 0, "busy_slot_steps": 0, "batch": batch}
    if construction == "live":
        parsed = None
        longest = live_length_bound(fmt, caps, max(len(p) for p in starts))
    else:
        parsed = [fmt.boundary_parse(z, where=f"prefix {i}") for i, z in enumerate(starts)]
        longest = max(len(z) for z in starts)
    engine = _engine(lm, fmt, batch, step_path, max_len, longest + suffix_length_bound(fmt, caps), verify_steps,
                     attention=attention)
    scheduler = _Scheduler(engine, "return", tolerance_check, fill_from, 4 * batch if hold is None else hold)

    def built(i: int) -> Callable[[object], None]:
        def done(boundary: object) -> None:
            if rebuild is not None and isinstance(boundary, Boundary) and rebuild(i, boundary):
                again = fmt.boundary_parse(boundary.ids, where=f"problem {i} (rebuild of its boundary)")
                scheduler.submit(_incremental_work(engine, lm, fmt, i, boundary.ids, again, None,
                                                   lambda rebuilt: proceed(i, boundary, (rebuilt,))), urgent=True)
                return
            proceed(i, boundary, ())
        return done

    def proceed(i: int, boundary: object, extra: tuple) -> None:
        states = list(continue_with(i, boundary, *extra))  # type: ignore[arg-type, call-arg]
        if isinstance(boundary, GateError) and states:
            raise ValueError(f"problem {i}: continue_with gave states to decode after a failed construction")
        if not states:
            finished(i, [])
            return
        suffixes: list = [None] * len(states)
        left = [len(states)]

        def one(k: int) -> Callable[[object], None]:
            def got(result: object) -> None:
                suffixes[k] = result
                left[0] -= 1
                if not left[0]:
                    finished(i, suffixes)
            return got

        for k, b in enumerate(states):
            scheduler.submit(_suffix_work(engine, fmt, caps, i, b, one(k)), urgent=True)

    for i, start in enumerate(starts):
        if parsed is None:
            scheduler.submit(_live_work(engine, lm, fmt, caps, i, start, built(i)))
        else:
            scheduler.submit(_incremental_work(engine, lm, fmt, i, start, parsed[i], None, built(i)))
    scheduler.run()
    return {"steps": engine.steps, "busy_slot_steps": engine.busy_slot_steps, "batch": engine.batch}


@torch.inference_mode()
def decode_forced(
    lm: LoadedModel,
    fmt: BlockFormat,
    boundaries: Sequence[Boundary],
    new_tokens: int,
    *,
    batch: int = 8,
    step_path: str = "eager",
    max_len: int | None = None,
    attention: str = "sdpa",
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
        batch, step_path, max_len, attention: as in :func:`decode_suffixes` (``max_len`` defaults to the longest
            ``|z|`` plus ``new_tokens``); ignored when ``engine`` is given.
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
        engine = _engine(lm, fmt, batch, step_path, max_len, need, attention=attention)
    steps, busy = engine.steps, engine.busy_slot_steps
    scheduler = _Scheduler(engine, "raise")
    results, into = _collect(len(boundaries))
    for i, b in enumerate(boundaries):
        scheduler.submit(_forced_work(engine, i, b, new_tokens, into(i)))
    scheduler.run()
    return results, {"steps": engine.steps - steps, "busy_slot_steps": engine.busy_slot_steps - busy,
                     "batch": engine.batch}
