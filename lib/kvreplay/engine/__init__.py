"""Batched decode engine: many problems per forward call, one-token step replayable as a CUDA graph.

The decoders of :mod:`kvreplay.decoding.decode` run one problem as a physical batch of
two duplicate rows, one forward call per token, through a ``DynamicCache``.
This module runs ``B`` problems at once. The batch holds ``2B`` rows (problem
in slot ``s`` owns rows ``2s`` and ``2s + 1``), and every row has its own write
position in a static KV cache (:class:`RowCache`). One batched one-token
step (:class:`StepEngine`) advances every problem by one token. Everything the
step reads lives in static buffers that are updated in place, so on CUDA the
step is captured once in a ``torch.cuda.CUDAGraph`` and replayed
(``step_path="graph"``); ``step_path="eager"`` runs the same code directly. Every batched decoder takes its
settings as one :class:`EngineRun` (step path, batch shape, attention, checks, slot order).

What stays as in :mod:`kvreplay.decoding.decode`:

* prompt blocks and prefills are one forward call per problem (its two
  duplicates) through :func:`kvreplay.decoding.decode.forward` and a ``DynamicCache``;
  the resulting keys/values are copied into the problem's rows;
* every step passes an explicit boolean 4-D mask (causal AND role visibility
  of Table 2, via :func:`kvreplay.decoding.contract.visibility_matrix`), explicit
  position IDs counting from 0, and input embeddings plus the role-embedding
  rows of ``lm.role_table`` when it is set;
* the block state machine, structural logits mask, forced delimiters and caps
  are those of :class:`kvreplay.decoding.decode.BlockCursor`. Greedy choice is the
  argmax over eligible tokens (an exact tie goes to the lowest token ID), the
  margin is top-1 minus top-2 eligible logit (float32);
* the duplicate rows of every problem must agree bit for bit after every
  step (gate ``desync``), and logits must be finite (gate ``nonfinite``).

What differs: keys beyond a row's length are zero padding hidden by the mask,
and the key dimension of every attention call is the cache's ``max_len``.
Results are reproducible bit for bit for a given *batch shape* (rows,
``max_len``), attention, dtype and device, whatever the companions of a problem
and its slot. Across batch shapes, and against the ``DynamicCache`` decoders,
the bits may differ (the kernels' reduction order depends on the shapes). So
the step path, batch shape and attention belong in any key that records results.

The step's attention (:data:`ATTENTIONS`) is the model's SDPA call, :func:`grouped_attention`, or
:func:`flex_attention_step`: FlexAttention over the blocks each row has filled, compiled on CUDA, its block
mask :class:`FlexMask` updated in place every step. An attention of the engine's own is checked against math
SDPA on every layer (:meth:`StepEngine.check_attention`, gate ``attention_tolerance``). Sliding-window layers
get the eager decoders' per-type masks (:func:`kvreplay.model.models.layer_masks`; for ``flex`` a sliding
:class:`FlexMask` that reads from the window's first block), over caches that keep every position.

One slot scheduler drives every decoder: a free slot takes the next waiting job before each step.
:func:`decode_chains` lets a problem's suffix jobs follow its boundary construction in the same engine, so the
slots stay full. Each decoder returns what its engine measured (:class:`EngineStats`, the slot occupancy
among it) with its results, as a :class:`Measured` list. ``docs/engine.md`` describes it all for users.

Host synchronisation: one device-to-host read per step (chosen tokens,
margins, duplicate and finiteness flags of every row together), plus one per
problem admitted.
"""

from __future__ import annotations

from .attention import (
    ATTENTIONS,
    FLEX_BLOCK,
    TOLERANCE,
    FlexMask,
    flex_attention_step,
    flex_environment,
    flex_kernel_options,
    flex_reference,
    grouped_attention,
    reference_attention,
    use_attention,
)
from .cache import RowCache, RowLayer
from .run import EngineRun, EngineStats, Measured, engine_max_len
from .decoders import (
    ForcedDecode,
    build_incrementals,
    decode_chains,
    decode_forced,
    decode_lives,
    decode_suffixes,
    live_length_bound,
    suffix_length_bound,
)
from .step import STEP_PATHS, StepEngine, choice_stats

__all__ = [
    "ATTENTIONS", "FLEX_BLOCK", "STEP_PATHS", "TOLERANCE",
    "EngineRun", "EngineStats", "Measured", "engine_max_len", "FlexMask", "ForcedDecode", "RowCache", "RowLayer", "StepEngine", "build_incrementals", "choice_stats", "decode_chains",
    "decode_forced", "decode_lives", "decode_suffixes", "flex_attention_step", "flex_environment",
    "flex_kernel_options", "flex_reference", "grouped_attention", "live_length_bound", "reference_attention",
    "suffix_length_bound", "use_attention",
]
