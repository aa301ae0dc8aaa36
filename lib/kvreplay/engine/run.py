"""The batched engine's settings as one object (:class:`EngineRun`), passed through every batched decoder."""

from __future__ import annotations

import dataclasses


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
        tie_rule: which of exactly tied eligible tokens is chosen (:mod:`kvreplay.ties`; ``lowest``: Hugging
            Face's argmax).
        top_logits: each suffix also keeps its steps' top-1 eligible logits (:attr:`kvreplay.decode.Suffix.tops`).
    """
    step_path: str = "eager"
    batch: int = 8
    max_len: int | None = None
    verify_steps: int = 0
    chunk: int | None = None
    attention: str = "sdpa"
    tolerance_check: bool = False
    fill_from: str = "first"
    tie_rule: str = "lowest"
    top_logits: bool = False

    @property
    def problems_per_chunk(self) -> int:
        """Problems handed to the engine at once by :class:`BatchedRows` (``chunk``, else ``batch``)."""
        return self.chunk or self.batch
