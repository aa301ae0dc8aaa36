"""Cache constructions, replicas and their verification (paper §3.2, §3.5).

Constructions are built in :mod:`kvreplay.decoding.decode` (``decode_live``,
``build_incremental``, ``build_prefill``). This module makes the
storage-isolated replicas the paper's replica floors need, and verifies them.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import torch

from .decode import Boundary
from ..gates import GateError, cache_tensors, check_disjoint, check_exact, geometry


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
        positions=state.positions.clone(),
        windows=state.windows,
    )
    verify_replica(state, rep)
    return rep


def boundary_tensors(state: Boundary) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a boundary state that arms compare: the cache inventory and the logits ``[2, vocab]``."""
    return [*cache_tensors(state.cache), ("logits", state.logits)]


def verify_replica(a: Boundary, b: Boundary) -> None:
    """A replica pair must be exact in every boundary tensor and share no storage.

    Raises:
        GateError: gate ``replica`` (tensors, or the layers' sliding windows) or ``storage``.
    """
    if a.windows != b.windows:
        raise GateError("replica", f"{a.construction} vs {b.construction}: sliding windows per layer differ")
    check_exact(f"{a.construction} vs {b.construction}", boundary_tensors(a), boundary_tensors(b))
    check_disjoint({a.construction: [t for _, t in boundary_tensors(a)], b.construction: [t for _, t in boundary_tensors(b)]})


def clone_boundary(state: Boundary, construction: str) -> Boundary:
    """A relabeled copy with fresh storage (used to plant faults and to build transplants)."""
    return dataclasses.replace(live_replica(state), construction=construction)


PARTS = ("key", "value")


@torch.inference_mode()
def transplant(
    recipient: Boundary, donor: Boundary, *, layers: Sequence[int] | None = None, parts: Sequence[str] = PARTS,
    label: str | None = None,
) -> tuple[Boundary, list[dict]]:
    """Replace chosen K/V tensors of a recipient state with storage-isolated copies from a donor (paper §3.8).

    Everything else of the recipient is kept: token IDs, roles, positions,
    boundary logits and every cache tensor not chosen. A copy is made of the
    recipient first, so neither source is modified.

    Args:
        recipient, donor: boundary states over the same prefix, caches
            ``[2, kv_heads, |z|, head_dim]`` per layer.
        layers: layer indices to replace (default: all).
        parts: ``("key",)``, ``("value",)`` or both.
        label: construction name of the result.

    Returns:
        ``(state, provenance)``: the new state, and one provenance entry per
        cache tensor ``{"tensor", "source", "layer", "part"}`` naming which
        construction it came from.

    Raises:
        GateError: any transplant gate (see :func:`verify_transplant`).
    """
    n = len(recipient.cache.layers)
    layers = list(range(n)) if layers is None else sorted(set(layers))
    out = clone_boundary(recipient, label or f"{recipient.construction}<-{donor.construction}")
    provenance = []
    for i in range(n):
        for part in PARTS:
            chosen = i in layers and part in parts
            if chosen:
                setattr(out.cache.layers[i], _ATTR[part], getattr(donor.cache.layers[i], _ATTR[part]).clone())
            provenance.append({"tensor": f"L{i:02d}.{part}", "source": donor.construction if chosen else recipient.construction,
                               "layer": i, "part": part})
    verify_transplant(out, recipient, donor, provenance)
    return out, provenance


_ATTR = {"key": "keys", "value": "values"}


def verify_transplant(state: Boundary, recipient: Boundary, donor: Boundary, provenance: Sequence[dict]) -> None:
    """Transplant gates: provenance, geometry, dtype, sequence length, no aliasing, kept recipient state.

    Every cache tensor must equal, bit for bit, the tensor of the construction
    its provenance names, with identical shape, stride, dtype and device. It
    must hold |z| positions (a sliding-window layer too: every construction keeps
    all positions) and share storage with neither source. Token IDs, roles,
    boundary logits and the layers' windows must be the recipient's, and the
    donor's windows the same.

    Raises:
        GateError: gate ``provenance``, ``dtype``, ``functional_state`` or ``storage``.
    """
    sources = {recipient.construction: dict(cache_tensors(recipient.cache)), donor.construction: dict(cache_tensors(donor.cache))}
    mine = dict(cache_tensors(state.cache))
    if len(provenance) != len(mine):
        raise GateError("provenance", f"{state.construction}: {len(provenance)} provenance entries for {len(mine)} tensors")
    for entry in provenance:
        name = entry["tensor"]
        src = sources[entry["source"]][name]
        t = mine[name]
        if t.dtype != src.dtype or t.dtype != recipient.logits.dtype:
            raise GateError("dtype", f"{state.construction}: {name} is {t.dtype}, source {src.dtype}")
        if geometry(t) != geometry(src):
            raise GateError("provenance", f"{state.construction}: {name} geometry {geometry(t)} differs from {entry['source']}")
        if t.shape[-2] != len(recipient.ids):
            raise GateError("functional_state", f"{state.construction}: {name} holds {t.shape[-2]} positions, |z| = {len(recipient.ids)}")
        if not torch.equal(t, src):
            raise GateError("provenance", f"{state.construction}: {name} does not equal its claimed source {entry['source']}")
    if not state.windows == recipient.windows == donor.windows:
        raise GateError("provenance", f"{state.construction}: sliding windows per layer differ (state {state.windows}, "
                                      f"recipient {recipient.windows}, donor {donor.windows})")
    if state.ids != recipient.ids or not torch.equal(state.roles, recipient.roles):
        raise GateError("functional_state", f"{state.construction}: token IDs or roles differ from the recipient")
    if not torch.equal(state.logits, recipient.logits):
        raise GateError("functional_state", f"{state.construction}: boundary logits are not the recipient's")
    check_disjoint({
        state.construction: [t for _, t in boundary_tensors(state)],
        f"source {recipient.construction}": [t for _, t in boundary_tensors(recipient)],
        f"source {donor.construction}": [t for _, t in boundary_tensors(donor)],
    })
