"""What the invariant-kernel reference (:mod:`kvreplay.model.kernels`) and its fused Triton kernels
(:mod:`kvreplay.model.kernels_fused`) share: the pinned attention key-block size and the error raised for what the contract
does not cover. Its own module so that neither kernels module imports the other at load time."""

from __future__ import annotations

ATTENTION_BLOCK = 64
"""Key positions per attention block (anchored at key 0): pinned, part of the ``invariant`` contract's bits."""


class KernelContractError(ValueError):
    """A model, an input or a value the invariant-kernel contract does not cover (raised before any row)."""
