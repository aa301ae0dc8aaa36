"""Controls of Experiment 2: the FP32 readout and the matched null perturbation.

*FP32 readout*: the same BF16 caches, with the final norm and LM head run in
float32, to see whether the divergence lives in the cache or in the coarse
BF16 logits. *Null perturbation*: the incremental cache plus structureless
noise matched to the prefill cache's relative L2 distance, to see whether a
cache change of the same size moves the greedy trajectory as often as the
prefill construction does.
"""

from __future__ import annotations

import statistics
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import pandas as pd
import torch

from ..arm_facts import declared_in
from ..decoding import caches, decode
from ..analysis import drift
from .. import engine, gates
from ..engine import Measured
from ..gates import GateError
from ..ledger.records import ControlsRecord, ControlsRow
from ..data.problems import Problem
from ..runner import RunSpec
from ..runner.arms import Arm, ArmPlan, Chain
from ..analysis.stats import wilson
from .endpoints import first_divergence, rate_text, require_gates, tie_initiated
from .matrix import decode_groups, gate_failure, raise_gate_errors


def _row_seed(seed: int, problem_id: str) -> int:
    import hashlib

    return int(hashlib.sha256(f"{seed}:{problem_id}".encode()).hexdigest()[:15], 16)


@torch.inference_mode()
def null_perturbation(state: decode.Boundary, reference: decode.Boundary, seed: int) -> tuple[decode.Boundary, dict]:
    """A copy of ``state`` perturbed like ``reference`` differs from it, but at random places (exploratory control).

    Let ``n`` be the number of elements of one duplicate row in which the two
    boundary caches differ, and ``|Δ|`` their absolute differences (float32).
    The copy gets ``n`` uniformly random element positions, drawn with replacement
    over all K and V tensors of one row (a sliding-window layer counts
    and draws over its attended positions only, :func:`kvreplay.analysis.drift.attended`).
    Each is shifted by a magnitude drawn from ``|Δ|`` with a random sign, computed in float32 and rounded to
    the cache dtype. Both duplicate rows get the same change. The boundary
    logits stay ``state``'s. Seeded (``torch.Generator``), so reruns are identical.

    Args:
        state: the boundary to perturb (``[2, kv_heads, |z|, head_dim]`` K/V per layer); not modified.
        reference: the other construction of the same boundary (same inventory and shapes).
        seed: generator seed.

    Returns:
        ``(perturbed copy, record)`` with ``elements_target`` (n), ``elements_changed`` (after rounding),
        ``rel_l2`` (whole-cache relative L2 of the perturbation) and ``real_rel_l2`` (of ``reference``).
    """
    inv_s = drift.attended(gates.cache_tensors(state.cache), state.windows)
    inv_r = drift.attended(gates.cache_tensors(reference.cache), reference.windows)
    deltas = torch.cat([(r[0].float() - s[0].float())[r[0] != s[0]].abs().flatten().cpu()  # drawn on the CPU generator
                        for (_, s), (_, r) in zip(inv_s, inv_r)])
    out = caches.clone_boundary(state, "null_perturbation")
    gen = torch.Generator().manual_seed(seed)
    n = int(deltas.numel())
    targets = [t for _, t in drift.attended(gates.cache_tensors(out.cache), out.windows)]  # views: written in place
    sizes = torch.tensor([t[0].numel() for t in targets])
    if n:
        flat = torch.randint(int(sizes.sum()), (n,), generator=gen)
        mags = deltas[torch.randint(n, (n,), generator=gen)]
        signs = torch.randint(2, (n,), generator=gen).float() * 2 - 1
        bounds = torch.cumsum(sizes, 0)
        which = torch.bucketize(flat, bounds, right=True)
        for i, t in enumerate(targets):
            sel = which == i
            if not bool(sel.any()):
                continue
            local = (flat[sel] - (bounds[i] - sizes[i])).to(t.device)
            row = t[0].reshape(-1).float()
            row.index_add_(0, local, (signs[sel] * mags[sel]).to(t.device))
            new = row.to(t.dtype).reshape(t[0].shape)
            t[0].copy_(new)
            t[1].copy_(new)
    agg = drift.aggregate(drift.cache_drift(inv_s, drift.attended(gates.cache_tensors(out.cache), out.windows)))
    real = drift.aggregate(drift.cache_drift(inv_s, inv_r))
    return out, {"seed": seed, "elements_target": n, "elements_changed": agg["n_diff"] // 2, "rel_l2": agg["rel_l2"],
                 "real_rel_l2": real["rel_l2"]}


def _pair(a: decode.Suffix, b: decode.Suffix, names: tuple[str, str]) -> dict:
    fd = first_divergence(a.tokens, b.tokens)
    return {names[0]: a.tokens, names[1]: b.tokens, "margins": {names[0]: a.margins, names[1]: b.margins},
            "suffix_differs": a.tokens != b.tokens, "first_divergence": fd,
            "tie_initiated": tie_initiated(a.margins, b.margins, fd)}


def controls_row(spec: RunSpec, problem: Problem, prefix: Sequence[int], seed: int = 20260729) -> ControlsRecord:
    """Two exploratory controls on one fixed BF16 prefix that separate causes of a divergence.

    * **FP32 readout**: incremental and prefill are built again with
      :class:`~kvreplay.decoding.decode.FP32Readout` (their caches must equal the plain
      builds' bit for bit, gate ``readout``) and continued with the final norm
      and LM head in float32: does the suffix still part once BF16 logit
      granularity (and its exact ties) is taken away, on the same BF16 caches?
    * **Matched null perturbation** (:func:`null_perturbation`): the
      incremental cache perturbed at as many elements as really differ from
      prefill, with magnitudes drawn from this row's observed ``|Δ|`` at random
      places: how often does a cache change of that size move the trajectory?

    Both are compared with the plain BF16 baselines (incremental vs prefill),
    decoded here too. Gates: dtype, non-finite, functional state, duplicates
    in sync, disjoint storage, readout caches identical to the plain ones.

    Returns:
        The ledger record: ``baseline``, ``fp32_readout`` (each: both suffixes,
        margins, ``suffix_differs``, ``first_divergence``, ``tie_initiated``)
        and ``null_perturbation`` (its record, ``suffix``, ``moved``,
        ``first_divergence``, ``tie_initiated``); ``gate_failure`` on a gate failure.
    """
    lm, fmt = spec.lm, spec.fmt
    rec: dict[str, Any] = {"problem_id": problem.problem_id, "gate_failure": None, "prefix_len": len(prefix)}
    try:
        readout = _readout(lm)
        inc = decode.build_incremental(lm, fmt, prefix, where=problem.problem_id)
        inc_ro = decode.build_incremental(lm, fmt, prefix, where=problem.problem_id, readout=readout)
        states, null, null_rec = _controls_states(spec, problem, prefix, inc, inc_ro, readout, seed)
        plain = {c: decode.decode_suffix(lm, fmt, states[c], spec.decoding) for c in ("incremental", "prefill")}
        fp32 = {c: decode.decode_suffix(lm, fmt, states[f"{c}_fp32_readout"], spec.decoding, readout=readout)
                for c in ("incremental", "prefill")}
        moved = decode.decode_suffix(lm, fmt, null, spec.decoding)
        _controls_record(rec, plain, fp32, moved, null_rec)
    except GateError as e:
        rec["gate_failure"] = gate_failure(e)
    return cast(ControlsRecord, rec)  # built stage by stage; run_arm checks it against the record before appending


_READOUTS: "weakref.WeakKeyDictionary[torch.nn.Module, decode.FP32Readout]" = weakref.WeakKeyDictionary()


def _readout(lm) -> decode.FP32Readout:
    """The model's :class:`~kvreplay.decoding.decode.FP32Readout`, made once per live model object (float32 copies of norm
    and head); keyed by the object itself, not its ``id``, which a later model may reuse once this one is freed."""
    if lm.model not in _READOUTS:
        _READOUTS[lm.model] = decode.FP32Readout(lm)
    return _READOUTS[lm.model]


def _controls_states(spec: RunSpec, problem: Problem, prefix: Sequence[int], inc: decode.Boundary,
                     inc_ro: decode.Boundary, readout: decode.FP32Readout, seed: int):
    """The four gated boundary states of a controls row and its null perturbation.

    Returns:
        ``(states, null state, null perturbation record)``.

    Raises:
        GateError: dtype, non-finite, duplicates, functional state, ``readout`` or storage.
    """
    lm, fmt = spec.lm, spec.fmt
    states = {"incremental": inc, "prefill": decode.build_prefill(lm, fmt, prefix, where=problem.problem_id),
              "incremental_fp32_readout": inc_ro}
    states["prefill_fp32_readout"] = decode.build_prefill(lm, fmt, prefix, where=problem.problem_id, readout=readout)
    if spec.faults:
        spec.faults(states)
    for name, s in states.items():
        gates.check_dtype(name, [(n, t) for n, t in gates.cache_tensors(s.cache)], lm.dtype)
        gates.check_finite(name, caches.boundary_tensors(s))
        gates.check_duplicates(name, caches.boundary_tensors(s))
    gates.check_functional_state(states)
    for c in ("incremental", "prefill"):
        gates.check_exact(f"{c} vs {c}_fp32_readout caches", gates.cache_tensors(states[c].cache),
                          gates.cache_tensors(states[f"{c}_fp32_readout"].cache), gate="readout")
    null, null_rec = null_perturbation(states["incremental"], states["prefill"], _row_seed(seed, problem.problem_id))
    gates.check_disjoint({n: [t for _, t in gates.cache_tensors(s.cache)] for n, s in {**states, "null": null}.items()})
    return states, null, null_rec


def _controls_record(rec: dict, plain: dict, fp32: dict, moved: decode.Suffix, null_rec: dict) -> None:
    rec["baseline"] = _pair(plain["incremental"], plain["prefill"], ("incremental", "prefill"))
    rec["fp32_readout"] = _pair(fp32["incremental"], fp32["prefill"], ("incremental", "prefill"))
    fd = first_divergence(plain["incremental"].tokens, moved.tokens)
    rec["null_perturbation"] = null_rec | {
        "suffix": moved.tokens, "margins": moved.margins, "moved": fd is not None, "first_divergence": fd,
        "tie_initiated": tie_initiated(plain["incremental"].margins, moved.margins, fd),
    }


def controls_chunk(spec: RunSpec, problems: Sequence[Problem], prefixes: Sequence[Sequence[int]],
                   seed: int = 20260729) -> Measured[ControlsRecord]:
    """The exploratory controls for a chunk of fixed prefixes through the batched engine (records of :func:`controls_row`).

    The incremental caches are rebuilt through :func:`kvreplay.engine.build_incrementals`,
    once plainly (as Experiment 2's batched runner builds them) and once with
    the FP32 readout (same keys/values: gate ``readout``). Prefills, gates and
    the null perturbation are made one problem at a time; the plain and null
    suffixes of every clean problem continue through one
    :func:`kvreplay.engine.decode_suffixes`, the FP32-readout ones through
    another with the readout. A gate failure is recorded in its problem's record only.

    Returns:
        One record per problem, in order, with what the engines measured.
    """
    lm, fmt = spec.lm, spec.fmt
    readout = _readout(lm)
    incs = engine.build_incrementals(lm, fmt, prefixes, run=spec.batched(), on_gate_error="return")
    incs_ro = engine.build_incrementals(lm, fmt, prefixes, run=spec.batched(), on_gate_error="return", readout=readout)
    recs: list[dict[str, Any]] = [{"problem_id": p.problem_id, "gate_failure": None, "prefix_len": len(z)}
                                  for p, z in zip(problems, prefixes)]
    pending = []
    for i, (p, z, inc, inc_ro) in enumerate(zip(problems, prefixes, incs, incs_ro)):
        try:
            raise_gate_errors([inc, inc_ro])
            pending.append((i, *_controls_states(spec, p, z, inc, inc_ro, readout, seed)))
        except GateError as e:
            recs[i]["gate_failure"] = gate_failure(e)
    plain = decode_groups(spec, [[st["incremental"], st["prefill"], null] for _, st, null, _ in pending])
    fp32 = decode_groups(spec, [[st["incremental_fp32_readout"], st["prefill_fp32_readout"]] for _, st, _, _ in pending],
                         readout=readout)
    for (i, _, _, null_rec), (a, b, moved), (c, d) in zip(pending, plain, fp32):
        try:
            raise_gate_errors([a, b, moved, c, d])
            _controls_record(recs[i], {"incremental": a, "prefill": b}, {"incremental": c, "prefill": d}, moved, null_rec)
        except GateError as e:
            recs[i]["gate_failure"] = gate_failure(e)
    stats = incs.stats + incs_ro.stats + plain.stats + fp32.stats
    return cast(Measured[ControlsRecord], Measured(recs, stats))  # as controls_row's


def controls_summary(records: Sequence[ControlsRecord]) -> dict:
    """Endpoints of the exploratory controls from their ledger records.

    Returns:
        ``n``; ``baseline``, ``fp32_readout``, ``null_moved`` (Wilson over all
        rows); ``*_ties`` (tie-initiated first divergences among them);
        ``fp32_readout_among_divergent`` (rows whose plain BF16 baselines part
        and that still part under FP32 readout, with the number of such rows);
        ``null_moved_among_exact``; medians of the perturbation size against
        the real construction difference.

    Raises:
        GateError: if a row failed a gate.
    """
    passed = require_gates(records)
    n = len(passed)
    div = [r for r in passed if r["baseline"]["suffix_differs"]]
    ex = [r for r in passed if not r["baseline"]["suffix_differs"]]

    def count(rows: Sequence[ControlsRow], f: Callable[[ControlsRow], object]) -> int:
        return sum(bool(f(r)) for r in rows)

    return {
        "n": n,
        "baseline": wilson(count(passed, lambda r: r["baseline"]["suffix_differs"]), n),
        "baseline_ties": count(div, lambda r: r["baseline"]["tie_initiated"]),
        "fp32_readout": wilson(count(passed, lambda r: r["fp32_readout"]["suffix_differs"]), n),
        "fp32_readout_ties": count(passed, lambda r: r["fp32_readout"]["tie_initiated"]),
        "fp32_readout_among_divergent": wilson(count(div, lambda r: r["fp32_readout"]["suffix_differs"]), len(div)) if div else None,
        "null_moved": wilson(count(passed, lambda r: r["null_perturbation"]["moved"]), n),
        "null_ties": count(passed, lambda r: r["null_perturbation"]["tie_initiated"]),
        "null_moved_among_exact": wilson(count(ex, lambda r: r["null_perturbation"]["moved"]), len(ex)) if ex else None,
        "null_elements_median": statistics.median(r["null_perturbation"]["elements_changed"] for r in passed),
        "real_elements_median": statistics.median(r["null_perturbation"]["elements_target"] for r in passed),
        "null_rel_l2_median": statistics.median(r["null_perturbation"]["rel_l2"] for r in passed),
        "real_rel_l2_median": statistics.median(r["null_perturbation"]["real_rel_l2"] for r in passed),
    }


def controls_table(c: dict) -> pd.DataFrame:
    """The exploratory controls table (labelled exploratory: not in the paper)."""
    n = c["n"]
    return pd.DataFrame({"exploratory controls (BF16 caches, fixed prefixes)": {
        "rows": str(n),
        "plain BF16: incremental vs prefill suffix differs": c["baseline"].pct(),
        "plain BF16: of which tie-initiated": f"{c['baseline_ties']}/{c['baseline'].k}",
        "FP32 readout (same BF16 caches; final norm and LM head in float32): suffix differs": c["fp32_readout"].pct(),
        "FP32 readout: of which tie-initiated": f"{c['fp32_readout_ties']}/{c['fp32_readout'].k}",
        "FP32 readout: still differs among rows whose plain BF16 suffixes differ": rate_text(c["fp32_readout_among_divergent"]),
        "matched null perturbation of the incremental cache: trajectory moved": c["null_moved"].pct(),
        "null perturbation: of which tie-initiated": f"{c['null_ties']}/{c['null_moved'].k}",
        "null perturbation: moved among rows whose plain BF16 suffixes agree": rate_text(c["null_moved_among_exact"]),
        "elements changed per row, median: null vs real (one duplicate row)":
            f"{c['null_elements_median']:,.0f} vs {c['real_elements_median']:,.0f}",
        "whole-cache relative L2, median: null vs real": f"{c['null_rel_l2_median']:.3g} vs {c['real_rel_l2_median']:.3g}",
    }})


def _prepare(chain: Chain) -> ArmPlan[ControlsRecord]:
    """The controls under a session: every prefix of the BF16 bank, the chain's seed, ``preflight_fixed`` rows."""
    fixed = chain.fixed
    return EXP2_CONTROLS.plan(fixed.rows, key={"prefix_bank_sha256": fixed.sha256, "seed": chain.params.seed},
                              prefixes=fixed.prefixes, preflight=chain.params.preflight_fixed)


EXP2_CONTROLS: Arm[ControlsRecord] = Arm(
    declared_in(__name__),
    row=lambda spec, problem, plan: controls_row(spec, problem, plan.prefix(problem), plan.key["seed"]),
    chunk=lambda spec, problems, plan: controls_chunk(spec, problems, plan.prefixes_of(problems), plan.key["seed"]),
    prepare=_prepare,
    key=("prefix_bank_sha256", "seed"), prefixes=True, preflight="preflight_fixed")
"""The exploratory controls (:func:`controls_row`) on the fixed BF16 prefixes, BF16 only; ledger ``exp2_controls``.

The bank's digest and the null perturbation's seed key the ledger."""
