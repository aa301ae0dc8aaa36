"""The float32 construction-equivalence check (paper §3.5): a boundary prefix's incremental rebuild against its
prefill, both in a float32 copy of the run's model, within :data:`kvreplay.gates.EQUIVALENCE_TOLERANCE`.

Preflight rows carry it in their row (:func:`kvreplay.experiments.matrix.equivalence_record`); a sample of every
chunk's other rows gets it from the run loop (:func:`kvreplay.runner.row_checks.check_chunk`), which imports it from
here: no registry an import could leave empty. ``spec`` is a :class:`kvreplay.runner.spec.RunSpec`.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..decoding import caches, decode
from ..analysis import drift
from .. import engine, gates
from ..gates import GateError
from ..model.models import LoadedModel
from ..data.problems import Problem


def boundary_windows(a: decode.Boundary, b: decode.Boundary) -> tuple[int | None, ...] | None:
    """The layers' sliding windows of two boundary states (the functional-state gate keeps them equal)."""
    if a.windows != b.windows:
        raise GateError("functional_state", f"{b.construction}: sliding windows per layer differ from {a.construction}")
    return a.windows


_FP32_COPIES: "weakref.WeakKeyDictionary[torch.nn.Module, LoadedModel]" = weakref.WeakKeyDictionary()


def float32_copy(lm: LoadedModel) -> LoadedModel:
    """A float32 copy of a loaded model (same weights, upcast exactly), made once per live model object and kept.

    Keyed by the model object itself (weakly), not its ``id``, which a later model may reuse once this one is freed.
    """
    import copy

    if lm.dtype == torch.float32:
        return lm
    if lm.model not in _FP32_COPIES:
        _FP32_COPIES.clear()  # one model at a time
        table = None if lm.role_table is None else lm.role_table.float()
        _FP32_COPIES[lm.model] = dataclasses.replace(lm, model=copy.deepcopy(lm.model).to(dtype=torch.float32),
                                                     dtype=torch.float32, role_table=table)
    return _FP32_COPIES[lm.model]


def construction_equivalence(spec: Any, problem: Problem, prefix: Sequence[int]) -> dict:
    """Construction-equivalence gate in float32 for one prefix (a check that the constructions compute one function).

    Builds the incremental (live call schedule, teacher-forced) and prefill
    boundary caches of ``prefix`` with a float32 copy of the run's model and
    requires their whole-cache relative L2 (a sliding layer: its attended
    positions) to stay within
    :data:`kvreplay.gates.EQUIVALENCE_TOLERANCE`. In float32 two correct
    constructions differ only by rounding, so a larger drift is a bug in a
    construction (wrong positions, roles or mask in one call), whatever the
    run's precision.

    In a batched run (``spec.engine`` set) the float32 incremental cache is
    rebuilt through the engine (:func:`kvreplay.engine.build_incrementals`,
    the run's step path and ``max_len``, one problem per step). That is the
    construction the run's own live boundaries come from; the result is kept
    in ``spec.memo``.

    Returns:
        ``{"dtype": "float32", "compared": "prefill_vs_incremental", "rel_l2", "tolerance"}`` for the ledger.

    Raises:
        GateError: gate ``equivalence`` (or ``nonfinite``, ``desync`` from the decoders).
    """
    key = (problem.problem_id, tuple(prefix))
    if key in spec.memo:
        if isinstance(spec.memo[key], GateError):
            raise spec.memo[key]
        return dict(spec.memo[key])
    try:
        out = _construction_equivalence(spec, problem, prefix)
    except GateError as e:
        spec.memo[key] = e
        raise
    spec.memo[key] = out
    return dict(out)


EQUIVALENCE_BATCH = 16
"""Slots of the engine call that rebuilds a chunk's sampled prefixes in float32 (:func:`construction_equivalences`):
one fixed shape for every arm, so a process compiles (or captures) it once; idle slots are fine."""


def construction_equivalences(spec: Any, items: Sequence[tuple[Problem, Sequence[int]]]) -> list[dict | GateError]:
    """:func:`construction_equivalence` of several prefixes at once: the sampled check of a chunk's rows.

    Eager runs check one prefix after another. Batched runs rebuild every float32 incremental in one engine call
    at :data:`EQUIVALENCE_BATCH` slots (more prefixes refill the slots), then build each prefill alone. At that
    fixed shape a prefix's bits do not depend on its companions, so each row's ``rel_l2`` is the one it gets
    checked alone at that shape.

    Returns:
        per item, in order, the record of :func:`construction_equivalence` or the ``GateError`` it raised.
    """
    out: list[dict | GateError | None] = [None] * len(items)
    todo = []
    for i, (problem, prefix) in enumerate(items):
        key = (problem.problem_id, tuple(prefix), "sampled")
        if key in spec.memo:
            out[i] = spec.memo[key] if isinstance(spec.memo[key], GateError) else dict(spec.memo[key])
        else:
            todo.append(i)
    lm32 = float32_copy(spec.lm)
    incs: list = []
    if todo and spec.engine is not None:
        run = dataclasses.replace(spec.batched(), batch=EQUIVALENCE_BATCH)
        incs = engine.build_incrementals(lm32, spec.fmt, [items[i][1] for i in todo], run=run, on_gate_error="return")
    for j, i in enumerate(todo):
        problem, prefix = items[i]
        try:
            if spec.engine is None:
                res: dict | GateError = _construction_equivalence(spec, problem, prefix)
            elif isinstance(incs[j], GateError):
                res = incs[j]
            else:
                res = _compare(lm32, spec, problem, prefix, incs[j])
        except GateError as e:
            res = e
        spec.memo[(problem.problem_id, tuple(prefix), "sampled")] = res
        out[i] = res if isinstance(res, GateError) else dict(res)
    return [r for r in out if r is not None]


def _construction_equivalence(spec: Any, problem: Problem, prefix: Sequence[int]) -> dict:
    lm32 = float32_copy(spec.lm)
    if spec.engine is None:
        inc = decode.build_incremental(lm32, spec.fmt, prefix, where=problem.problem_id)
    else:
        inc = engine.build_incrementals(lm32, spec.fmt, [prefix], run=dataclasses.replace(spec.batched(), batch=1))[0]
    return _compare(lm32, spec, problem, prefix, inc)


def _compare(lm32: Any, spec: Any, problem: Problem, prefix: Sequence[int], inc: Any) -> dict:
    """The float32 prefill of ``prefix`` against its incremental rebuild ``inc``, through the ``equivalence`` gate."""
    pre = decode.build_prefill(lm32, spec.fmt, prefix, where=problem.problem_id)
    for name, s in (("incremental (float32 check)", inc), ("prefill (float32 check)", pre)):
        gates.check_finite(name, caches.boundary_tensors(s))
    rel = drift.aggregate(drift.cache_drift(gates.cache_tensors(inc.cache), gates.cache_tensors(pre.cache),
                                            boundary_windows(inc, pre)))["rel_l2"]
    gates.check_equivalence("prefill vs incremental (float32 copy of the model)", rel)
    return {"dtype": "float32", "compared": "prefill_vs_incremental", "rel_l2": rel,
            "tolerance": gates.EQUIVALENCE_TOLERANCE}
