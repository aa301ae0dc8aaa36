"""The slot scheduler and the jobs of the batched decoders (:mod:`kvreplay.engine.decoders`).

A job (a live decode, an incremental rebuild, a suffix, a forced decode) waits for a free slot of a
:class:`~kvreplay.engine.step.StepEngine` and enters it. It advances one token per step with the block state machine
(:class:`~kvreplay.decoding.decode.BlockCursor`); when it ends, :meth:`_Scheduler.run` yields its tag with its result or the
:class:`~kvreplay.gates.GateError` that stopped it. A problem's bits do not depend on its slot or its companions, so
the order of entry changes no bit.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch

from ..decoding import decode
from ..decoding.contract import ANSWER, BRANCH1, MERGE, PROMPT, BlockFormat, Caps, ContractError
from ..decoding.decode import BlockCursor, Boundary, Suffix
from ..decoding.settings import Decoding
from ..gates import GateError
from ..model.models import LoadedModel
from .run import EngineRun
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
    tops: list = dataclasses.field(default_factory=list)  # top-1 eligible logits, when the engine reads them
    finishing: bool = False  # fed its last token: the next step's logits end it (a built boundary)


@dataclasses.dataclass
class _Work:
    """One job waiting for a slot: how it enters one, when it ends, what it gives back.

    ``admit(slot)`` loads the job's state into a slot and returns the job and its duplicate pair's first logits
    ``[2, vocab]``; ``finish(job, slot, logits)`` builds the result (``logits`` are the pair's logits of the step
    after the last feed for a job that ends after feeding, else ``None``). :meth:`_Scheduler.run` yields ``tag``
    (``None``: ``index``) with the result, or with the :class:`~kvreplay.gates.GateError` that stopped the job.
    ``builds`` marks a boundary construction (live or incremental), which ends once it has fed its merge opener;
    other jobs end when their cursor is done.
    """
    index: int
    admit: Callable[[int], tuple[_Job, torch.Tensor]]
    finish: Callable[[_Job, int, torch.Tensor | None], object]
    tag: object = None
    builds: bool = False

    def __post_init__(self):
        if self.tag is None:
            self.tag = self.index


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
    stages the next. :meth:`run` yields each job's end as it happens; whoever iterates may submit more jobs then.

    ``on_gate_error="raise"`` stops at the first failed gate; ``"return"`` yields the ``GateError`` as the job's
    result and goes on. With ``tolerance_check`` the engine runs its ``attention_tolerance`` gate
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
        self._ended: deque[tuple[object, object]] = deque()  # (tag, result or GateError) not yet yielded

    def submit(self, work: _Work, urgent: bool = False) -> None:
        (self.urgent if urgent else self.waiting).append(work)

    def _fail(self, slot: int, err: GateError) -> None:
        job = self.slots[slot]
        self.slots[slot] = None
        self.engine.set_idle(slot)
        if self.on_gate_error == "raise":
            raise err
        self._ended.append((job.work.tag, err))

    def _end(self, slot: int, logits: torch.Tensor | None) -> None:
        job = self.slots[slot]
        result = job.work.finish(job, slot, logits)
        self.slots[slot] = None
        self.engine.set_idle(slot)
        self._ended.append((job.work.tag, result))

    def _yield_ended(self) -> Iterator[tuple[object, object]]:
        while self._ended:
            yield self._ended.popleft()

    def _advance(self, slot: int, chosen: int, margin: float, top: float | None = None) -> None:
        """Take the next token of the job in ``slot`` and stage its feed (or finish the job)."""
        engine, job = self.engine, self.slots[slot]
        token, role, m = job.cursor.take(chosen, margin)
        job.new.append(token)
        job.margins.append(m)
        if engine.top_logits:
            job.tops.append(None if m is None else top)
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

    def _admit(self, slot: int) -> None:
        """The next waiting job enters the free ``slot`` and takes its first token (or fails its first gate)."""
        engine = self.engine
        late = not self.urgent or (self.hold is not None and len(self.urgent) < self.hold)
        work = (self.waiting if self.waiting and late else self.urgent).popleft()
        job, logits = work.admit(slot)
        self.slots[slot] = job
        stats = engine.first_choice(logits, job.cursor.prepare(), len(job.ids))
        try:
            _check(stats, 0, job, len(job.ids) - 1)
        except GateError as err:
            self._fail(slot, err)
            return
        self._advance(slot, int(stats[0][0]), stats[1][0], stats[4][0] if engine.top_logits else None)

    def _stepped(self, slot: int, job: _Job, logits: torch.Tensor, stats: list[list[float]]) -> None:
        """The job in ``slot`` after a step: its gates, then its next token, or its end."""
        engine, r = self.engine, 2 * slot
        try:
            _check(stats, r, job, len(job.ids) + len(job.new) - 1)
            if job.finishing:  # every token was fed
                engine.check_valid_length(slot, len(job.ids) + len(job.new), job.roles, f"problem {job.index}")
        except GateError as err:
            self._fail(slot, err)
            return
        if job.finishing:
            self._end(slot, logits[r : r + 2].clone())
        else:
            self._advance(slot, int(stats[0][r]), stats[1][r], stats[4][r] if engine.top_logits else None)

    def run(self) -> Iterator[tuple[object, object]]:
        """Drive every submitted job to its end, one batched step at a time, yielding ``(tag, result)`` as each job
        ends (its result, or the ``GateError`` that stopped it). Jobs submitted meanwhile join the queue."""
        engine = self.engine
        while True:
            for slot in self.order:  # every free slot takes the next waiting job
                while self.slots[slot] is None and (self.urgent or self.waiting):
                    self._admit(slot)
                    yield from self._yield_ended()
            if all(j is None for j in self.slots):
                return
            if self.tolerance_check and not engine.stats.attention_checks:
                held = [j for j in self.slots if j is not None and not j.work.builds]
                if held:
                    engine.check_attention(f"problem {held[0].index}'s boundary in the engine")
            logits, stats = engine.step()
            for slot, job in enumerate(self.slots):
                if job is not None:
                    self._stepped(slot, job, logits, stats)
                    yield from self._yield_ended()


def suffix_length_bound(fmt: BlockFormat, caps: Caps) -> int:
    """Most tokens a suffix can hold: merge content and closer, answer opener, content and closer."""
    return (caps.merge + len(fmt.closers[MERGE]) + len(fmt.openers[ANSWER]) + caps.answer
            + len(fmt.closers[ANSWER]))


def live_length_bound(fmt: BlockFormat, caps: Caps, prompt_len: int) -> int:
    """Most tokens a live prefix z can hold: the prompt, three capped branch blocks, the merge opener."""
    branches = sum(len(fmt.openers[r]) + caps.branch + len(fmt.closers[r]) for r in (1, 2, 3))
    return prompt_len + branches + len(fmt.openers[MERGE])


def new_engine(lm: LoadedModel, fmt: BlockFormat, run: EngineRun, need: int, decoding: Decoding | None = None,
               readout: decode.FP32Readout | None = None) -> StepEngine:
    """A :class:`StepEngine` at ``run``'s settings choosing by ``decoding``: ``max_len`` defaults to ``need`` (whole
    blocks for ``flex``, :func:`~kvreplay.engine.run.engine_max_len`).

    Raises:
        ValueError: a fixed ``max_len`` below ``need``, or a setting :class:`StepEngine` refuses.
    """
    return StepEngine(lm, fmt, run, need=need, decoding=decoding, readout=readout)


# ------------------------------------------------------------------------------------------------ jobs
def _suffix_work(engine: StepEngine, fmt: BlockFormat, caps: Caps, index: int, b: Boundary, tag: object = None) -> _Work:
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
        return Suffix(job.new, job.margins, full[m0:m1], full[a0:a1], job.tops)

    work = _Work(index, admit, finish, tag)
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
               tag: object = None) -> _Work:
    dev = lm.device

    def admit(slot: int):
        ids = list(prompt)
        roles = torch.full((decode.BATCH, len(ids)), PROMPT, dtype=torch.long, device=dev)
        cache = decode.new_cache(lm)  # every layer keeps every position (a sliding layer's too)
        logits = decode.forward(lm, cache, decode._as_batch(ids, dev), roles, 0)
        engine.admit(slot, cache, roles)
        cursor = _Cursor(fmt, caps, PROMPT, [(t, BRANCH1) for t in fmt.openers[BRANCH1]])
        return _Job(index, cursor, ids, [PROMPT] * len(ids), work), logits

    work = _Work(index, admit, lambda job, slot, logits: _built(engine, lm, "live", job, slot, logits), tag,
                 builds=True)
    return work


def _forced_work(engine: StepEngine, index: int, b: Boundary, n: int) -> _Work:
    def admit(slot: int):
        engine.admit(slot, b.cache, b.roles)
        return _Job(index, _Forced(n), list(b.ids), b.roles[0].tolist(), work), b.logits

    work = _Work(index, admit, lambda job, slot, logits: job.new)
    return work


_FREE = Caps(branch=1 << 30, merge=1 << 30, answer=1 << 30)  # a teacher-forced rebuild: every token is forced


def _incremental_work(engine: StepEngine, lm: LoadedModel, fmt: BlockFormat, index: int, z: Sequence[int],
                      parsed, readout, tag: object = None) -> _Work:
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

    work = _Work(index, admit, finish, tag, builds=True)
    return work


def _in_order(scheduler: _Scheduler, n: int) -> list:
    """Every job's result by its tag, jobs tagged ``0..n-1`` (a ``GateError`` in a failed job's place)."""
    results: list = [None] * n
    for i, result in scheduler.run():
        results[i] = result  # type: ignore[index]
    return results
