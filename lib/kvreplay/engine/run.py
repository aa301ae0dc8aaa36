"""The batched engine's settings as one object (:class:`EngineRun`), passed through every batched decoder, and what
its engines measured (:class:`EngineStats`), returned with their results (:class:`Measured`). What the decoders choose
by (caps, tie rule, top logits) is not here: they take it as one :class:`~kvreplay.decoding.settings.Decoding`, as the eager
decoders do."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TypeVar

from ..decoding.settings import Decoding

FLEX_BLOCK = 128
"""Positions per block of the ``flex`` attention's block mask (:mod:`kvreplay.engine.attention` reads the cache in
such blocks): a ``flex`` engine's ``max_len`` is a multiple of it."""


def engine_max_len(need: int, attention: str) -> int:
    """The positions per row an engine needs for sequences of at most ``need`` positions: ``need``, for ``flex``
    rounded up to whole :data:`FLEX_BLOCK` blocks (the mask hides the padding). The one place this is computed."""
    return -(-need // FLEX_BLOCK) * FLEX_BLOCK if attention == "flex" else need


@dataclasses.dataclass
class EngineStats:
    """What an engine measured; ``a + b`` sums two (a chunk's engines, the calls of a run).

    An engine keeps its own (:attr:`kvreplay.engine.StepEngine.stats`); a batched decoder returns its engine's with
    its results (:class:`Measured`), and a chunk function returns the sum of its decoders'.

    Attributes:
        steps: batched steps run.
        slot_steps: their slots (steps x ``batch``).
        busy_slot_steps: the slots that held a problem; ``busy_slot_steps / slot_steps`` is the slot occupancy.
        verified_steps: steps checked against the eager step (gate ``graph_equals_eager``).
        attention_checks: every ``attention_tolerance`` record passed, in order
            (:meth:`kvreplay.engine.StepEngine.check_attention`).
        kv_positions: key positions the busy rows attend to, summed over steps and busy slots (one row of each
            duplicate pair: a slot at position ``p`` adds ``p + 1``). With the model's per-position K/V bytes it
            gives the bytes a step must read at the least (the memory floor, ``scripts/gpu_profile.py``).
        capture_s: seconds spent capturing CUDA graphs (their first step, compiles of a new shape included).
    """
    steps: int = 0
    slot_steps: int = 0
    busy_slot_steps: int = 0
    verified_steps: int = 0
    attention_checks: list[dict] = dataclasses.field(default_factory=list)
    kv_positions: int = 0
    capture_s: float = 0.0

    @property
    def occupancy(self) -> float | None:
        """``busy_slot_steps / slot_steps`` (the share of the batch's slots that held a problem), ``None`` without
        steps."""
        return self.busy_slot_steps / self.slot_steps if self.slot_steps else None

    def __add__(self, other: "EngineStats") -> "EngineStats":
        """The two summed field by field (attention checks: ``self``'s, then ``other``'s)."""
        if not isinstance(other, EngineStats):
            return NotImplemented
        return EngineStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)})

    def chunk_event(self, problems: int, seconds: float) -> dict:
        """A chunk's run-log entry: ``{"problems", "seconds", "steps", "slot_steps", "busy_slot_steps",
        "occupancy", "kv_positions", "capture_s"}`` (seconds to 3 decimals, occupancy to 4, ``None`` without steps)."""
        occupancy = self.occupancy
        return {"problems": problems, "seconds": round(seconds, 3), "steps": self.steps, "slot_steps": self.slot_steps,
                "busy_slot_steps": self.busy_slot_steps,
                "occupancy": round(occupancy, 4) if occupancy is not None else None,
                "kv_positions": self.kv_positions, "capture_s": round(self.capture_s, 3)}


@dataclasses.dataclass(frozen=True)
class EngineRun:
    """How the batched decoders run: one object through :func:`decode_suffixes` and the others (paper §3.9).

    A runner resolves it once from its arm's settings (:meth:`kvreplay.runner.ArmSettings.engine_run`).

    Attributes:
        step_path: the engine's step path, ``"eager"`` or ``"graph"``.
        batch: problems per batched step ``B`` (``2B`` rows).
        max_len: positions per row (the static cache's key dimension); ``None``: what the call's problems need.
        verify_steps: steps of each engine checked against the eager step
            (gate ``graph_equals_eager``; 0 = none).
        chunk: problems per chunk of :class:`BatchedRows` (``None``: ``batch``); with more problems
            than slots, a slot freed by a finished problem takes the next one, so a chunk no longer
            waits on its longest row with the other slots idle. Not in the ledger key: a problem's
            bits do not depend on its companions (the ``composition`` gate).
        attention: the step's attention, ``"sdpa"``, ``"grouped"`` or ``"flex"`` (:data:`kvreplay.engine.ATTENTIONS`).
        tolerance_check: run the gate ``attention_tolerance`` on the first step that holds a boundary
            (:meth:`kvreplay.engine.StepEngine.check_attention`); the preflight runs of :class:`BatchedRows` set it.
        fill_from: ``"first"`` or ``"last"``: which free slot a waiting job takes first. The ``composition``
            gate's run alone fills from the last, so its problem sits in another slot than in its chunk. Not in
            the ledger key: no bit depends on the slot.
    """
    step_path: str = "eager"
    batch: int = 8
    max_len: int | None = None
    verify_steps: int = 0
    chunk: int | None = None
    attention: str = "sdpa"
    tolerance_check: bool = False
    fill_from: str = "first"

    def settings(self, decoding: Decoding) -> dict:
        """The run log's ``engine`` entry: every field, then the tie rule's name and ``top_logits`` of the
        ``decoding`` the decoders were given."""
        return dataclasses.asdict(self) | {"tie_rule": decoding.tie_rule.name, "top_logits": decoding.top_logits}

    def max_len_for(self, need: int) -> int:
        """:attr:`max_len`, else what sequences of ``need`` positions take (:func:`engine_max_len`).

        Raises:
            ValueError: a fixed :attr:`max_len` below ``need``."""
        max_len = self.max_len if self.max_len is not None else engine_max_len(need, self.attention)
        if need > max_len:
            raise ValueError(f"max_len={max_len} is shorter than the {need} positions the longest problem may need")
        return max_len

    @property
    def problems_per_chunk(self) -> int:
        """Problems handed to the engine at once by :class:`BatchedRows` (``chunk``, else ``batch``)."""
        return self.chunk or self.batch


T = TypeVar("T")


class Measured(list[T]):
    """A batched call's results, in the order given, with what the engines that computed them measured.

    A list (indexing, iteration and comparison as a list's; a slice or ``list(...)`` drops :attr:`stats`).
    The batched decoders return one (:func:`kvreplay.engine.decode_suffixes` and the others), and so does a
    chunk function (:class:`kvreplay.runner.BatchedRows` logs its :attr:`stats` per chunk).

    Attributes:
        stats: the :class:`EngineStats` of the call's engines, summed.
    """
    def __init__(self, results: Iterable[T] = (), stats: EngineStats | None = None):
        super().__init__(results)
        self.stats = stats if stats is not None else EngineStats()
