"""Experiment 2: fixed integer prefixes, incremental against prefill, per precision (paper §4.2).

The BF16 boundary prefixes of Experiment 1 are frozen. For each precision
the incremental cache is rebuilt from them by replaying the live call
schedule with teacher forcing, and compared with a prefill of the same IDs
through the four-arm matrix. :func:`precision_crossing` pairs the two
precisions row by row (paired bootstrap differences, exact McNemar).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import pandas as pd

from ..arm_facts import declared_in
from ..decoding import decode
from .. import engine
from ..engine import Measured
from ..gates import GateError
from ..ledger.prefix_bank import read_prefix_bank
from ..ledger.records import Endpoints, Exp2Record, arm_of
from ..data.problems import Problem
from ..runner import RunSpec
from ..runner.arms import Arm, ArmPlan, Chain
from ..analysis.stats import mcnemar_exact, paired_bootstrap
from .endpoints import require_gates, with_derived_endpoints
from .matrix import gate_failure, matrix_chunk, matrix_pipeline, matrix_row


def fixed_prefix_row(spec: RunSpec, problem: Problem, prefix: Sequence[int]) -> Exp2Record:
    """Experiment 2 for one fixed BF16 prefix at the run's precision (paper §3.6).

    The incremental cache teacher-forces z through the live call schedule;
    it and prefill then form the four-arm matrix.

    Returns:
        The ledger record (``gate_failure`` set on a gate failure).

    Raises:
        ContractError: if the prefix does not end at the boundary.
    """
    rec: dict[str, Any] = {"problem_id": problem.problem_id, "gate_failure": None}
    try:
        inc = decode.build_incremental(spec.lm, spec.fmt, prefix, where=problem.problem_id)
        parsed = spec.fmt.boundary_parse(prefix, where=problem.problem_id)
        rec.update(prompt_len=parsed.prompt_len, prefix_len=len(inc.ids), prefix=inc.ids, schedule_calls=len(inc.schedule))
        matrix_row(spec, problem, rec, inc)
    except GateError as e:
        rec["gate_failure"] = gate_failure(e)
    return cast(Exp2Record, rec)  # built stage by stage; run_arm checks it against the record before appending


def fixed_prefix_chunk(spec: RunSpec, problems: Sequence[Problem], prefixes: Sequence[Sequence[int]]) -> Measured[Exp2Record]:
    """Experiment 2 for a chunk of fixed prefixes through the batched engine (the records of :func:`fixed_prefix_row`).

    Each incremental cache is rebuilt in the engine (teacher forcing of the live call schedule). Its matrix's
    suffixes decode in the same engine as soon as it is done (:func:`matrix_pipeline`). The records equal the
    phase-wise schedule's (:func:`kvreplay.engine.build_incrementals`, then :func:`matrix_chunk`) bit for bit.
    The records come with what the engine measured.

    Raises:
        ContractError: a prefix that does not end at the boundary.
        GateError: the engine's own gates (``graph_equals_eager``, ``attention_tolerance``).
    """
    heads = [_head(spec, z, p.problem_id) for z, p in zip(prefixes, problems)]
    return cast(Measured[Exp2Record], matrix_pipeline(spec, problems, "incremental", prefixes, heads))


def _head(spec: RunSpec, prefix: Sequence[int], pid: str):
    """The prefix fields of an Experiment 2 record, from the fixed prefix and its incremental boundary."""
    def fill(rec, inc):
        parsed = spec.fmt.boundary_parse(prefix, where=pid)
        rec.update(prompt_len=parsed.prompt_len, prefix_len=len(inc.ids), prefix=inc.ids,
                   schedule_calls=len(inc.schedule))
    return fill


def fixed_prefix_chunk_phased(spec: RunSpec, problems: Sequence[Problem],
                              prefixes: Sequence[Sequence[int]]) -> Measured[Exp2Record]:
    """:func:`fixed_prefix_chunk` phase by phase (every rebuild, then every suffix): the same records."""
    incs = engine.build_incrementals(spec.lm, spec.fmt, prefixes, run=spec.batched(), on_gate_error="return")
    heads = [_head(spec, z, p.problem_id) for z, p in zip(prefixes, problems)]
    recs = matrix_chunk(spec, problems, incs, heads)
    return cast(Measured[Exp2Record], Measured(recs, incs.stats + recs.stats))


@dataclasses.dataclass(frozen=True)
class FixedPrefixes:
    """The BF16 prefix bank joined to its problems (what Experiments 2–5 consume).

    Attributes:
        entries: bank lines (``problem_id``, ``prompt_len``, ``prefix``) in source order.
        sha256: the bank file's digest (part of every downstream ledger key).
        rows: the problems, in the bank's (= the problem bank's) source order.
        prefixes: problem ID -> boundary prefix z (token IDs).
    """
    entries: list[dict]
    sha256: str
    rows: list[Problem]
    prefixes: dict[str, list[int]]


def load_fixed_prefixes(path: str | Path, problems: Sequence[Problem]) -> FixedPrefixes:
    """Read the digest-checked prefix bank and join it to ``problems``, with no outcome-based filtering.

    Raises:
        FileNotFoundError: if notebook 01 has not written the bank.
        GateError: gate ``provenance`` if the bank fails its digest, names a
            problem not in ``problems``, or is not in their source order.
    """
    entries, digest = read_prefix_bank(path)
    by_id = {p.problem_id: p for p in problems}
    unknown = [e["problem_id"] for e in entries if e["problem_id"] not in by_id]
    if unknown:
        raise GateError("provenance", f"{path} names problems not in the problem set: {unknown[:5]}")
    rows = [by_id[e["problem_id"]] for e in entries]
    if [p.problem_id for p in rows] != [p.problem_id for p in problems[: len(rows)]]:
        raise GateError("provenance", f"{path} is not in the problem set's source order")
    return FixedPrefixes(entries, digest, rows, {e["problem_id"]: e["prefix"] for e in entries})


def _prepare(chain: Chain) -> ArmPlan[Exp2Record]:
    """Experiment 2 under a session: every prefix of the BF16 bank, ``preflight_fixed`` preflight rows."""
    fixed = chain.fixed
    return EXP2.plan(fixed.rows, key={"prefix_bank_sha256": fixed.sha256}, prefixes=fixed.prefixes,
                     preflight=chain.params.preflight_fixed)


EXP2: Arm[Exp2Record] = Arm(
    declared_in(__name__), row=lambda spec, problem, plan: fixed_prefix_row(spec, problem, plan.prefix(problem)),
    chunk=lambda spec, problems, plan: fixed_prefix_chunk(spec, problems, plan.prefixes_of(problems)),
    prepare=_prepare,
    key=("prefix_bank_sha256",), prefixes=True, preflight="preflight_fixed")
"""Experiment 2 (paper §3.6) at one precision on the fixed BF16 prefixes; the bank's digest keys the ledger."""


def _differs(endpoints: Endpoints, key: str) -> bool:
    """``endpoints[f"{key}_differs"]`` for a key known at run time (``suffix``, ``answer``, ``letter``, ``label``)."""
    return cast(Mapping[str, bool], endpoints)[f"{key}_differs"]


def precision_crossing(bf16: Sequence[Exp2Record], fp32: Sequence[Exp2Record], seed: int = 20260729,
                       n_resamples: int = 20000) -> dict:
    """Problem-paired FP32-minus-BF16 change in each disagreement indicator (paper §4.2).

    Returns:
        per indicator (``suffix``, ``answer``, ``letter``, ``label``): the
        paired bootstrap difference (FP32 minus BF16; the paper reports the
        reduction, its negative) and the exact McNemar test; ``accuracy_effect``:
        the accuracy effect of the construction (prefill minus reference
        accuracy) in each precision and its problem-paired change FP32 minus
        BF16 (bootstrap; the paper: -1.0 pts [-5.5, +3.5]). Plus
        ``prefix_identical``, the number of rows whose integer prefix is
        identical across precisions.

    Raises:
        GateError: if rows are not paired by problem ID in the same order, or a row failed a gate.
    """
    bf16_passed, fp32_passed = require_gates(bf16), require_gates(fp32)
    if [r["problem_id"] for r in bf16_passed] != [r["problem_id"] for r in fp32_passed]:
        raise GateError("report", "BF16 and FP32 rows are not paired in the same problem order")
    out: dict[str, Any] = {"n": len(bf16_passed),
                           "prefix_identical": sum(a["prefix"] == b["prefix"] for a, b in zip(bf16_passed, fp32_passed))}
    ref = (next(k for k in bf16_passed[0]["arms"] if not k.startswith("prefill") and not k.endswith("_replica"))
           if bf16_passed else "")
    effect = {d: [int(r["arms"]["prefill"]["correct"]) - int(arm_of(r, ref)["correct"]) for r in rows]
              for d, rows in (("bfloat16", bf16_passed), ("float32", fp32_passed))}
    out["accuracy_effect"] = {
        "bfloat16": sum(effect["bfloat16"]) / len(bf16_passed), "float32": sum(effect["float32"]) / len(fp32_passed),
        "change": paired_bootstrap(effect["bfloat16"], effect["float32"], n_resamples=n_resamples, seed=seed)
        if len(bf16_passed) >= 2 else None,
    }
    for key in ("suffix", "answer", "letter", "label"):
        a = [_differs(with_derived_endpoints(r, ref), key) for r in bf16_passed]  # version-1 rows: derived, as elsewhere
        b = [_differs(with_derived_endpoints(r, ref), key) for r in fp32_passed]
        out[key] = {
            "change": paired_bootstrap(a, b, n_resamples=n_resamples, seed=seed) if len(a) >= 2 else None,
            "mcnemar": mcnemar_exact(a, b),
        }
    return out


def crossing_table(cross: dict) -> pd.DataFrame:
    """Paired FP32 − BF16 change table (percentage points, bootstrap CI, McNemar)."""
    rows = {}
    for key, label in (("suffix", "suffix disagreement"), ("answer", "answer-block disagreement (any token)"),
                       ("letter", "predicted-letter disagreement"), ("label", "correctness-label disagreement")):
        c, m = cross[key]["change"], cross[key]["mcnemar"]
        rows[label] = {
            "FP32 − BF16, pts [95% bootstrap CI]": f"{100 * c.estimate:+.1f} [{100 * c.low:+.1f}, {100 * c.high:+.1f}]" if c else "n/a",
            "McNemar: BF16-only vs FP32-only, exact p": f"{m.b} vs {m.c}, p = {m.pvalue:.3g}",
        }
    e = cross["accuracy_effect"]
    c = e["change"]
    rows["accuracy effect of prefill (prefill − reference accuracy)"] = {
        "FP32 − BF16, pts [95% bootstrap CI]": (f"{100 * c.estimate:+.1f} [{100 * c.low:+.1f}, {100 * c.high:+.1f}]" if c else "n/a")
        + f" (BF16 {100 * e['bfloat16']:+.1f}, FP32 {100 * e['float32']:+.1f})",
        "McNemar: BF16-only vs FP32-only, exact p": "",
    }
    rows["integer prefix identical across precision"] = {
        "FP32 − BF16, pts [95% bootstrap CI]": f"{cross['prefix_identical']}/{cross['n']}",
        "McNemar: BF16-only vs FP32-only, exact p": "",
    }
    return pd.DataFrame(rows).T
