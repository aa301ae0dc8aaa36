"""Cache constructions, replicas and their verification (paper §3.2, §3.5).

Constructions are built in :mod:`kvreplay.decode` (``decode_live``,
``build_incremental``, ``build_prefill``). This module makes the
storage-isolated replicas the paper's replica floors need, and verifies them.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from .decode import Boundary
from .gates import cache_tensors, check_disjoint, check_exact


@torch.inference_mode()
def live_replica(state: Boundary) -> Boundary:
    """Deep copy of a whole boundary state under inference mode (the live replica).

    Returns a :class:`Boundary` whose cache tensors ``[2, kv_heads, |z|, head_dim]``
    are new storages with equal values, geometry and inference status.

    Raises:
        GateError: gate ``replica`` (inventory, values, metadata or inference
            status changed) or ``storage`` (any tensor aliases the source).
    """
    rep = Boundary(
        construction=f"{state.construction}_replica",
        ids=list(state.ids),
        roles=state.roles.clone(),
        cache=copy.deepcopy(state.cache),
        logits=state.logits.clone(),
        schedule=list(state.schedule),
    )
    verify_replica(state, rep)
    return rep


def boundary_tensors(state: Boundary) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a boundary state that arms compare: the cache inventory and the logits ``[2, vocab]``."""
    return [*cache_tensors(state.cache), ("logits", state.logits)]


def verify_replica(a: Boundary, b: Boundary) -> None:
    """A replica pair must be exact in every boundary tensor and share no storage.

    Raises:
        GateError: gate ``replica`` or ``storage``.
    """
    check_exact(f"{a.construction} vs {b.construction}", boundary_tensors(a), boundary_tensors(b))
    check_disjoint({a.construction: [t for _, t in boundary_tensors(a)], b.construction: [t for _, t in boundary_tensors(b)]})


def clone_boundary(state: Boundary, construction: str) -> Boundary:
    """A relabeled copy with fresh storage (used to plant faults and to build transplants)."""
    return dataclasses.replace(live_replica(state), construction=construction)
