"""The batched decoders: live decoding, incremental rebuilds and suffixes of many problems through one engine.

:func:`decode_lives`, :func:`build_incrementals` and :func:`decode_suffixes` are the batched counterparts of
:mod:`kvreplay.decode`'s one-problem constructions; each admits problems into free slots of a
:class:`~kvreplay.engine.step.StepEngine`, advances them one token per step with the block state machine, and
hands a finished problem's slot to the next one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache

from .. import decode
from ..contract import ANSWER, BRANCH1, MERGE, PROMPT, BlockFormat, Caps, ContractError
from ..decode import BlockCursor, Boundary, Suffix
from ..gates import GateError
from ..models import LoadedModel
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


@dataclasses.dataclass
class _Job:
    index: int
    cursor: _Cursor
    ids: list[int]
    roles: list[int]
    new: list[int] = dataclasses.field(default_factory=list)
    margins: list = dataclasses.field(default_factory=list)
    finishing: bool = False  # fed its last token: the next step's logits end it (live boundary)


def _check(stats: list[list[float]], row: int, where: str, position: int) -> None:
    if stats[3][row] != 1.0 or stats[3][row + 1] != 1.0:
        raise GateError("nonfinite", f"{where}: non-finite logits after the step ending at position {position}")
    if stats[2][row] != 1.0:
        raise GateError("desync",
                        f"{where}: duplicate rows' logits differ after the step ending at position {position}")


def _drive(
    engine: StepEngine,
    n_jobs: int,
    admit: Callable[[int, int], tuple[_Job, torch.Tensor]],
    stop_after_feed: Callable[[_Cursor], bool],
    finish: Callable[[_Job, int, torch.Tensor | None], object],
    on_gate_error: str,
) -> list:
    """The slot scheduler shared by the batched decoders.

    ``admit(job_index, slot)`` loads a problem into a slot and returns its
    job and the duplicate pair's logits ``[2, vocab]``; ``finish(job, slot,
    logits)`` builds the result (``logits`` are the pair's last step logits
    for a job that ended after a feed, else ``None``).
    """
    if on_gate_error not in ("raise", "return"):
        raise ValueError(f"on_gate_error must be 'raise' or 'return', got {on_gate_error!r}")
    results: list = [None] * n_jobs
    slots: list[_Job | None] = [None] * engine.batch
    queue = list(range(n_jobs))
    queue.reverse()

    def fail(slot: int, err: GateError) -> None:
        job = slots[slot]
        slots[slot] = None
        engine.set_idle(slot)
        if on_gate_error == "raise":
            raise err
        results[job.index] = err

    def advance(slot: int, chosen: int, margin: float) -> None:
        """Take the next token of the job in ``slot`` and stage its feed (or finish the job)."""
        job = slots[slot]
        token, role, m = job.cursor.take(chosen, margin)
        job.new.append(token)
        job.margins.append(m)
        job.roles.append(role)
        if job.cursor.done:
            try:  # the last token was chosen, not fed: |ids| + |new| - 1 positions written
                engine.check_valid_length(slot, len(job.ids) + len(job.new) - 1, job.roles, f"problem {job.index}")
            except GateError as err:
                fail(slot, err)
                return
            results[job.index] = finish(job, slot, None)
            slots[slot] = None
            engine.set_idle(slot)
            return
        position = len(job.ids) + len(job.new) - 1
        if stop_after_feed(job.cursor):
            job.finishing = True
            engine.set_row_pair(slot, token, position, role, MERGE)
        else:
            engine.set_row_pair(slot, token, position, role, job.cursor.prepare())

    while True:
        for slot in range(engine.batch):
            while slots[slot] is None and queue:
                index = queue.pop()
                job, logits = admit(index, slot)
                slots[slot] = job
                stats = engine.first_choice(logits, job.cursor.prepare())
                try:
                    _check(stats, 0, f"problem {index}", len(job.ids) - 1)
                except GateError as err:
                    fail(slot, err)
                    continue
                advance(slot, int(stats[0][0]), stats[1][0])
        if all(j is None for j in slots):
            break
        logits, stats = engine.step()
        for slot, job in enumerate(slots):
            if job is None:
                continue
            r = 2 * slot
            try:
                _check(stats, r, f"problem {job.index}", len(job.ids) + len(job.new) - 1)
            except GateError as err:
                fail(slot, err)
                continue
            if job.finishing:
                try:  # every token was fed
                    engine.check_valid_length(slot, len(job.ids) + len(job.new), job.roles, f"problem {job.index}")
                except GateError as err:
                    fail(slot, err)
                    continue
                results[job.index] = finish(job, slot, logits[r : r + 2].clone())
                slots[slot] = None
                engine.set_idle(slot)
            else:
                advance(slot, int(stats[0][r]), stats[1][r])
    return results


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
        max_len = need
    if need > max_len:
        raise ValueError(f"max_len={max_len} is shorter than the {need} positions the longest problem may need")
    return StepEngine(lm, fmt, batch, max_len, step_path, verify_steps, readout, attention)


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
            ``|z|`` plus :func:`suffix_length_bound`. Fix it to compare runs over
            different problem sets bit for bit.
        on_gate_error: ``"raise"`` stops at the first failed gate; ``"return"``
            puts the :class:`~kvreplay.gates.GateError` in that problem's place
            and goes on with the others.
        verify_steps: steps checked against the eager step (:class:`StepEngine`).
        attention: the step's attention, ``"sdpa"`` or ``"grouped"`` (:data:`kvreplay.engine.ATTENTIONS`); part of the contract.
        readout: FP32 readout of every step's logits (:class:`StepEngine`); the
            boundaries' logits should come from constructions built with it.

    Returns:
        One :class:`~kvreplay.decode.Suffix` per boundary, in order (or a
        ``GateError`` with ``on_gate_error="return"``).

    Raises:
        GateError: ``desync`` (a problem's duplicate rows' logits differ),
            ``nonfinite`` (non-finite logits) or ``functional_state`` (a row's
            valid length, :meth:`StepEngine.check_valid_length`), with
            ``on_gate_error="raise"``; ``graph_equals_eager`` always raises.
        ContractError: a suffix did not close its answer block.
        ValueError: bad ``batch``, ``step_path``, ``max_len`` or cache geometry.
    """
    if not boundaries:
        return []
    need = max(len(b.ids) for b in boundaries) + suffix_length_bound(fmt, caps)
    engine = _engine(lm, fmt, batch, step_path, max_len, need, verify_steps, readout, attention)

    def admit(index: int, slot: int):
        b = boundaries[index]
        n = engine.admit(slot, b.cache, b.roles)
        if n != len(b.ids):
            raise ValueError(f"problem {index}: cache holds {n} positions, the prefix has {len(b.ids)}")
        return _Job(index, _Cursor(fmt, caps, MERGE), list(b.ids), b.roles[0].tolist()), b.logits

    def finish(job: _Job, slot: int, logits):
        b = boundaries[job.index]
        full = job.ids + job.new
        parsed = fmt.parse(full, where=f"{b.construction} suffix")
        if not parsed.complete:
            raise ContractError(f"{b.construction} suffix: the answer block was not closed")
        (m0, m1), (a0, a1) = parsed.content[MERGE], parsed.content[ANSWER]
        return Suffix(job.new, job.margins, full[m0:m1], full[a0:a1])

    return _drive(engine, len(boundaries), admit, lambda c: False, finish, on_gate_error)


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
) -> list:
    """Live multi-branch decoding of many prompts at once (batched :func:`kvreplay.decode.decode_live`).

    Each prompt block is processed in one forward call of its duplicate pair
    (:func:`kvreplay.decode.forward`, ``DynamicCache``) and copied into the
    problem's rows; branches 1-3 and the merge opener then advance one token
    per batched step, as :func:`~kvreplay.decode.decode_live` schedules them.

    Args:
        prompts: token IDs of each prompt block (role 0).
        caps: content caps (branches stop at ``caps.branch``).
        batch, step_path, max_len, on_gate_error, verify_steps, attention: as in :func:`decode_suffixes`
            (``max_len`` defaults to the longest prompt plus :func:`live_length_bound`'s blocks).

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
    dev = lm.device

    def admit(index: int, slot: int):
        ids = list(prompts[index])
        roles = torch.full((decode.BATCH, len(ids)), PROMPT, dtype=torch.long, device=dev)
        cache = DynamicCache(config=lm.model.config)
        logits = decode.forward(lm, cache, decode._as_batch(ids, dev), roles, 0)
        engine.admit(slot, cache, roles)
        cursor = _Cursor(fmt, caps, PROMPT, [(t, BRANCH1) for t in fmt.openers[BRANCH1]])
        return _Job(index, cursor, ids, [PROMPT] * len(ids)), logits

    def finish(job: _Job, slot: int, logits):
        z = job.ids + job.new
        n = len(z)
        roles = torch.tensor(job.roles, dtype=torch.long, device=dev).expand(decode.BATCH, -1).contiguous()
        positions = torch.arange(n, device=dev).expand(decode.BATCH, -1).contiguous()
        cache = engine.cache.to_dynamic(2 * slot, n, lm.model.config)
        schedule = [len(job.ids)] + [1] * len(job.new)
        return Boundary("live", z, roles, cache, logits, schedule, positions)

    return _drive(engine, len(prompts), admit, lambda c: c.role == MERGE and c.in_content, finish, on_gate_error)


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
        batch, step_path, max_len, on_gate_error, verify_steps, readout, attention: as in
            :func:`decode_suffixes` (``max_len`` defaults to the longest prefix plus one);
            with ``readout`` the prompt call and every step give FP32-readout logits
            and write the same keys/values as without it.

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
    dev = lm.device
    free = Caps(branch=1 << 30, merge=1 << 30, answer=1 << 30)  # every token is forced: no cap applies

    def admit(index: int, slot: int):
        z, p = list(prefixes[index]), parsed[index].prompt_len
        roles = torch.full((decode.BATCH, p), PROMPT, dtype=torch.long, device=dev)
        cache = DynamicCache(config=lm.model.config)
        logits = decode.forward(lm, cache, decode._as_batch(z[:p], dev), roles, 0, readout=readout)
        engine.admit(slot, cache, roles)
        cursor = _Cursor(fmt, free, PROMPT, list(zip(z[p:], parsed[index].roles[p:])))
        return _Job(index, cursor, z[:p], [PROMPT] * p), logits

    def finish(job: _Job, slot: int, logits):
        z = job.ids + job.new
        if z != list(prefixes[job.index]):
            raise ContractError(f"prefix {job.index}: teacher forcing stopped at {len(z)} tokens, not at its boundary")
        n = len(z)
        roles = torch.tensor(job.roles, dtype=torch.long, device=dev).expand(decode.BATCH, -1).contiguous()
        positions = torch.arange(n, device=dev).expand(decode.BATCH, -1).contiguous()
        cache = engine.cache.to_dynamic(2 * slot, n, lm.model.config)
        return Boundary("incremental", z, roles, cache, logits, [len(job.ids)] + [1] * len(job.new), positions)

    return _drive(engine, len(prefixes), admit, lambda c: c.role == MERGE and c.in_content, finish, on_gate_error)
