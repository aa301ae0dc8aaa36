"""Experiment 4: boundary K/V transplants between the incremental and prefill caches (paper §4.4).

A panel of divergent and exact rows is frozen from Experiment 2's BF16
ledger (order statistics, no outcome read). On it the donor's K/V of the chosen
layers replaces the recipient's, and the suffix decoded from the hybrid cache
is classified as following the donor, the recipient, or a third trajectory.
The whole-cache swap follows its donor by construction (an integrity check);
partial transplants localise the effect.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import pandas as pd

from ..arm_facts import declared_in
from ..decoding import caches, decode
from .. import engine, gates
from ..engine import Measured
from ..gates import GateError
from ..ledger.records import (
    Exp2Record,
    ReplicationFailedRow,
    ReplicationRecord,
    ReplicationRow,
    TransplantFailedRow,
    TransplantRecord,
    TransplantRow,
    outcome_of,
)
from ..data.problems import Problem
from ..runner import RunSpec
from ..runner.arms import Arm, ArmPlan, Chain
from ..analysis.stats import Proportion, wilson
from .endpoints import first_divergence, rate_text, require_gates, tie_initiated
from .matrix import (
    boundary_gates,
    decode_groups,
    equivalence_record,
    gate_failure,
    raise_gate_errors,
)


_Item = TypeVar("_Item")


def order_statistics(items: Sequence[_Item], k: int, key: Callable[[_Item], Any]) -> list[_Item]:
    """``k`` evenly spaced order statistics of ``items`` sorted by ``key`` (outcome-blind selection).

    Picks sorted positions ``round(i * (n - 1) / (k - 1))`` for ``i = 0..k-1``
    (all items if ``k >= n``), returned in sorted order.
    """
    srt = sorted(items, key=key)
    n = len(srt)
    if k >= n:
        return srt
    if k == 1:
        return [srt[(n - 1) // 2]]
    idx = sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})
    return [srt[i] for i in idx]


def transplant_table(s: dict, records: Sequence[TransplantRecord]) -> pd.DataFrame:
    """Experiment 4 registered endpoints with the power note (same rows as notebook 04 writes to ``exp4_table``).

    Rows that failed the precondition are reported by the summary's rule (:data:`PRECONDITION_RULES`): left
    out, counted as failures, or, with ``report_both`` and such rows present, each endpoint both ways (one untagged
    line where the two agree).

    Args:
        s: :func:`~kvreplay.experiments.transplant.transplant_summary` of ``records``.
        records: the Experiment 4 ledger records (their ``stratum`` is the frozen panel's).
    """
    ctl = wilson(0, s["exact"]) if s["exact"] else None
    n_div = sum(r["stratum"] == "divergent" for r in records)
    n_ex = sum(r["stratum"] == "exact" for r in records)
    table = {
        "panel rows (frozen divergent + exact)": f"{len(records)} ({n_div} + {n_ex})",
        "frozen stratum reproduced by new baselines": f"{s['prior_stratum_reproduced']}/{s['rows']}",
        "all gates pass (replicas, state, storage, argmax, provenance)": f"{s['rows']}/{len(records)}",
    }
    rule = s.get("precondition_failures", DEFAULT_PRECONDITION_RULE)
    ways = [("", s)]
    if s["ineligible"]:  # a line only where it has something to say (profiles without such rows keep their tables)
        ways = {"left_out": [(" [unmet precondition: row left out]", s)],
                "counted_as_failure": [(" [unmet precondition: counted as a failure]", s["counted_as_failure"])],
                "report_both": [(" [unmet precondition: row left out]", s),
                                (" [unmet precondition: counted as a failure]", s["counted_as_failure"])]}[rule]
        how = {"left_out": "left out of the endpoints below", "counted_as_failure": "counted as a failure below",
               "report_both": "each endpoint below left out and counted as a failure"}[rule]
        table[f"argmax precondition unmet (no transplant; {how}; rule exp4_precondition_failures: {rule})"] = "; ".join(
            f"{r['problem_id']} ({r['stratum']}: {r['reason']})" for r in s["ineligible"])
    endpoints: dict[str, str] = {}
    for label, e in (("donor recovery, prefill <- incremental (integrity check)", lambda w: w["recovery"]["prefill<-incremental"]),
                     ("donor recovery, incremental <- prefill (integrity check)", lambda w: w["recovery"]["incremental<-prefill"]),
                     ("joint bidirectional recovery (integrity check)", lambda w: w["joint_recovery"]),
                     ("third trajectory among exact controls", lambda w: w["third_among_exact"])):
        texts = {label + tag: rate_text(e(w)) for tag, w in ways}
        endpoints |= texts if len(set(texts.values())) == len(texts) else {label: next(iter(texts.values()))}
    return pd.DataFrame({"whole-cache transplant (BF16)": table | {
        "divergent rows (contemporaneous baselines): tie-initiated / not": f"{s['tie_initiated']} / {s['divergent'] - s['tie_initiated']}",
        **endpoints,
        "why recovery is an integrity check": ("token IDs, roles and positions are gated equal, so after a whole K/V swap "
                                               "the recipient must follow the donor unless decoding is nondeterministic"),
        "power note": (f"with {s['exact']} exact controls, 0 events would only exclude third-trajectory rates above "
                       f"{100 * ctl.high:.1f}% (Wilson upper bound)" if ctl else "no exact controls"),
    }})


def partial_table(rows: list[Any], folder: Path | None = None) -> pd.DataFrame:
    """The transplant table on the finished ``rows`` of a ledger (``python -m kvreplay.report.partial``; ``folder``
    unused).

    Raises:
        GateError: a row failed a gate other than the transplant's precondition.
    """
    return transplant_table(transplant_summary(rows), rows)


def freeze_transplant_panel(exp2_bf16: Sequence[Exp2Record], n_divergent: int, n_exact: int) -> list[dict]:
    """Freeze the transplant panel from Experiment 2's BF16 rows before any transplant is decoded (paper §3.8).

    Within the suffix-divergent and suffix-exact strata, takes evenly spaced
    order statistics after sorting by prefix length, then problem ID.

    Returns:
        ``[{"problem_id", "stratum": "divergent" | "exact", "prefix_len"}, ...]``, divergent first.

    Raises:
        GateError: if a source row failed a gate.
    """
    passed = require_gates(exp2_bf16)
    out = []
    for stratum, k in (("divergent", n_divergent), ("exact", n_exact)):
        pool = [r for r in passed if r["endpoints"]["suffix_differs"] == (stratum == "divergent")]
        for r in order_statistics(pool, k, key=lambda r: (r["prefix_len"], r["problem_id"])):
            out.append({"problem_id": r["problem_id"], "stratum": stratum, "prefix_len": r["prefix_len"]})
    return out


def interventions(n_layers: int, sweep: bool) -> list[tuple[str, str, list[int], tuple[str, ...]]]:
    """The transplant interventions: ``(name, primary|exploratory, layers, parts)``.

    Whole-cache is the registered primary endpoint; key-only, value-only,
    first/second half of the layers and (when ``sweep``) every single layer
    are exploratory localization.
    """
    every = list(range(n_layers))
    half = n_layers // 2
    out: list[tuple[str, str, list[int], tuple[str, ...]]] = [("whole", "primary", every, ("key", "value"))]
    out += [
        ("keys_only", "exploratory", every, ("key",)),
        ("values_only", "exploratory", every, ("value",)),
        ("first_half", "exploratory", every[:half], ("key", "value")),
        ("second_half", "exploratory", every[half:], ("key", "value")),
    ]
    if sweep:
        out += [(f"layer_{i:02d}", "exploratory", [i], ("key", "value")) for i in every]
    return out


PRECONDITION_GATE = "argmax"
"""The gate that is a transplant's registered precondition (paper §3.8): the raw next-token argmax at the
boundary must already agree between the incremental and prefill constructions. A row that fails it has its
panel place but no transplant (nothing after the boundary is decoded)."""


DECODED_FIELDS = ("baseline", "interventions", "equivalence", "scores")
"""Row fields written only after the precondition passed (a row stopped by it has none of them)."""


def split_precondition(
    records: Sequence[TransplantRecord] | Sequence[ReplicationRecord],
) -> tuple[list[TransplantRow | ReplicationRow], list[TransplantFailedRow | ReplicationFailedRow]]:
    """Split transplant rows by the registered precondition (paper §3.8), keeping ledger order.

    A row whose only recorded gate failure is :data:`PRECONDITION_GATE` (the boundary's raw argmax differs
    between constructions: typically an exact tie of the top two logits in one of them) is *ineligible*: it
    was frozen into the panel before any transplant, its boundary states passed their gates, and it was
    stopped before decoding. Endpoints are computed on the eligible rows and the ineligible ones are
    reported beside them. Any other gate failure is an integrity failure and withholds every endpoint.

    Returns:
        ``(eligible, ineligible)``, two lists of the given records.

    Raises:
        GateError: gate ``report``, if an eligible row failed any other gate, or a row recorded as stopped by
            the precondition holds decoded results (:data:`DECODED_FIELDS`).
    """
    def gate(r: TransplantRecord | ReplicationRecord) -> str | None:
        failure = r.get("gate_failure")
        return failure["gate"] if failure else None

    stopped = [r for r in records if gate(r) == PRECONDITION_GATE]
    ineligible = cast(list[TransplantFailedRow | ReplicationFailedRow], stopped)  # their gate_failure is set
    kept: list[TransplantRecord | ReplicationRecord] = [r for r in records if gate(r) != PRECONDITION_GATE]
    eligible = require_gates(kept)
    # the precondition is checked before anything past the boundary is decoded: a row holding decoded results
    # under this gate's name is not what the gate records, so it is an integrity failure like any other
    decoded = [r["problem_id"] for r in ineligible if any(r.get(k) for k in DECODED_FIELDS)]
    if decoded:
        raise GateError("report", f"row(s) {decoded} record the {PRECONDITION_GATE!r} precondition as failed but hold decoded "
                                  f"results ({', '.join(DECODED_FIELDS)}): endpoints withheld")
    return eligible, ineligible


def _outcome(suffix: list[int], donor: list[int], recipient: list[int]) -> str:
    if donor == recipient:
        return "baseline" if suffix == donor else "third"
    if suffix == donor:
        return "donor"
    if suffix == recipient:
        return "recipient"
    return "third"


def transplant_row(
    spec: RunSpec, problem: Problem, prefix: Sequence[int], stratum: str, sweep: bool, primary_only: bool = False,
) -> TransplantRecord:
    """Experiment 4 for one frozen panel row, BF16 (paper §3.8, plus the referee's localization).

    Builds incremental and prefill states, each twice with disjoint storage,
    continues the four baselines, then for every intervention in both
    directions (recipient prefill <- donor incremental, and the reverse)
    continues the transplanted state with the shared suffix decoder. The raw
    next-token argmax must already agree between constructions (a gate).
    With ``primary_only`` only the registered whole-cache transplant runs
    (Experiment 5's six arms: four baselines and two transplants).

    Returns:
        The ledger record; ``interventions[name][direction]`` holds ``outcome``
        (``donor``, ``recipient``, ``third``, or ``baseline`` when the two
        baselines agree) and the suffix.
    """
    lm, fmt = spec.lm, spec.fmt
    rec: dict[str, Any] = {"problem_id": problem.problem_id, "gate_failure": None, "stratum": stratum}
    try:
        inc = decode.build_incremental(lm, fmt, prefix, where=problem.problem_id)
        states, src = _transplant_states(spec, problem, prefix, inc, rec)
        suffixes = {n: decode.decode_suffix(lm, fmt, s, spec.decoding) for n, s in states.items()}
        base = _baseline(rec, suffixes)
        for name, recipient, donor, state, prov in _interventions(spec, rec, src, sweep, primary_only):
            hybrid = decode.decode_suffix(lm, fmt, state, spec.decoding)
            _record_intervention(rec, name, recipient, donor, hybrid.tokens, base, prov)
    except GateError as e:
        rec["gate_failure"] = gate_failure(e)
    return cast(TransplantRecord, rec)  # built stage by stage; run_arm checks it against the record before appending


def _transplant_states(spec: RunSpec, problem: Problem, prefix: Sequence[int], inc: decode.Boundary,
                       rec: dict) -> tuple[dict[str, decode.Boundary], dict[str, decode.Boundary]]:
    """The four gated baseline states around ``inc`` and pristine copies of the two constructions (the donors).

    Raises:
        GateError: a boundary gate, or ``argmax`` (raw next-token argmax differs between constructions).
    """
    lm, fmt = spec.lm, spec.fmt
    rec.update(prefix_len=len(prefix), prefix=list(prefix))
    states = {
        "incremental": inc,
        "incremental_replica": caches.live_replica(inc),
        "prefill": decode.build_prefill(lm, fmt, prefix, where=problem.problem_id),
    }
    states["prefill_replica"] = decode.build_prefill(lm, fmt, prefix, where=problem.problem_id)
    states["prefill_replica"].construction = "prefill_replica"
    if spec.faults:
        spec.faults(states)
    boundary_gates(states, lm.dtype, [("incremental", "incremental_replica"), ("prefill", "prefill_replica")])
    a_inc, a_pre = decode.raw_argmax(inc.logits[0]), decode.raw_argmax(states["prefill"].logits[0])
    if a_inc != a_pre:
        raise GateError("argmax", f"raw next-token argmax differs between constructions ({a_inc} vs {a_pre})")
    rec["equivalence"] = equivalence_record(spec, problem, prefix)
    # pristine sources for the transplants; the four baseline states are consumed by decoding
    src = {"incremental": caches.clone_boundary(inc, "incremental"), "prefill": caches.clone_boundary(states["prefill"], "prefill")}
    return states, src


def _baseline(rec: dict, suffixes: dict[str, decode.Suffix]) -> dict[str, list[int]]:
    """Record the four baselines (gate ``suffix_replica``); return arm -> suffix token IDs."""
    base = {n: x.tokens for n, x in suffixes.items()}
    for a, b in (("incremental", "incremental_replica"), ("prefill", "prefill_replica")):
        gates.check_equal_sequences("suffix_replica", f"{a} vs {b}", base[a], base[b])
    fd = first_divergence(base["incremental"], base["prefill"])
    rec["baseline"] = {"incremental": base["incremental"], "prefill": base["prefill"],
                       "margins": {n: suffixes[n].margins for n in ("incremental", "prefill")},
                       "suffix_differs": base["incremental"] != base["prefill"], "first_divergence": fd,
                       "tie_initiated": tie_initiated(suffixes["incremental"].margins, suffixes["prefill"].margins, fd)}
    return base


def _interventions(spec: RunSpec, rec: dict, src: dict[str, decode.Boundary], sweep: bool, primary_only: bool):
    """Yield ``(name, recipient, donor, transplanted state, provenance)`` in the record's order, registering each intervention."""
    rec["interventions"] = {}
    for name, kind, layers, parts in interventions(len(src["incremental"].cache.layers), sweep):
        if primary_only and kind != "primary":
            continue
        rec["interventions"][name] = {"kind": kind, "layers": layers, "parts": list(parts)}
        for recipient, donor in (("prefill", "incremental"), ("incremental", "prefill")):
            state, prov = caches.transplant(src[recipient], src[donor], layers=layers, parts=parts)
            if spec.transplant_faults:
                spec.transplant_faults(state, src[recipient], src[donor], prov)
                caches.verify_transplant(state, src[recipient], src[donor], prov)
            yield name, recipient, donor, state, prov


def _record_intervention(rec: dict, name: str, recipient: str, donor: str, suffix: list[int],
                         base: dict[str, list[int]], prov: Sequence[dict]) -> None:
    rec["interventions"][name][f"{recipient}<-{donor}"] = {
        "outcome": _outcome(suffix, base[donor], base[recipient]),
        "suffix": suffix,
        "donated_tensors": sum(p["source"] == donor for p in prov),
    }


def transplant_chunk(spec: RunSpec, problems: Sequence[Problem], prefixes: Sequence[Sequence[int]],
                     strata: Sequence[str], sweeps: Sequence[bool],
                     primary_only: bool = False) -> Measured[TransplantRecord]:
    """Experiment 4 for a chunk of panel rows through the batched engine (the records of :func:`transplant_row`).

    The incremental caches are rebuilt through :func:`kvreplay.engine.build_incrementals`
    (as Experiment 2's batched runner builds them); per problem, the prefill
    calls, every boundary gate and every transplanted state are made as one
    problem at a time. Then the four baselines and every transplant of every
    clean problem continue through one :func:`kvreplay.engine.decode_suffixes`
    (``spec.engine``). A gate failure is recorded in its problem's record only.

    Args:
        prefixes, strata, sweeps: per problem, its fixed prefix, frozen stratum and whether it gets the
            single-layer sweep.
        primary_only: only the whole-cache transplant (Experiment 5).

    Returns:
        One record per problem, in order, with what the engines measured.

    Raises:
        ContractError: a suffix did not close its answer block.
    """
    incs = engine.build_incrementals(spec.lm, spec.fmt, prefixes, run=spec.batched(), on_gate_error="return")
    recs: list[dict[str, Any]] = [{"problem_id": p.problem_id, "gate_failure": None, "stratum": s}
                                  for p, s in zip(problems, strata)]
    pending = []
    for i, (p, z, inc) in enumerate(zip(problems, prefixes, incs)):
        try:
            raise_gate_errors([inc])
            states, src = _transplant_states(spec, p, z, inc, recs[i])
            plan = list(_interventions(spec, recs[i], src, sweeps[i], primary_only))
            pending.append((i, list(states), plan, [*states.values(), *(x[3] for x in plan)]))
        except GateError as e:
            _failed(recs[i], e)
    decoded = decode_groups(spec, [boundaries for *_, boundaries in pending])
    for (i, names, plan, _), mine in zip(pending, decoded):
        rec = recs[i]
        try:
            raise_gate_errors(mine)
            base = _baseline(rec, dict(zip(names, mine)))
            for (name, recipient, donor, _, prov), x in zip(plan, mine[len(names):]):
                _record_intervention(rec, name, recipient, donor, x.tokens, base, prov)
        except GateError as e:
            _failed(rec, e)
    return cast(Measured[TransplantRecord], Measured(recs, incs.stats + decoded.stats))  # as transplant_row's


def _failed(rec: dict, e: GateError) -> None:
    """Record a gate failure in ``rec`` (its interventions are kept only once the baselines exist, as in :func:`transplant_row`)."""
    rec["gate_failure"] = gate_failure(e)
    if "baseline" not in rec:
        rec.pop("interventions", None)


DIRECTIONS = ("prefill<-incremental", "incremental<-prefill")


PRECONDITION_RULES = ("left_out", "counted_as_failure", "report_both")
"""How a table reports panel rows that failed the precondition (the profile's ``exp4_precondition_failures``):
left out of the endpoints, counted as failures, or both counts side by side."""

DEFAULT_PRECONDITION_RULE = "report_both"
"""The rule of a profile that declares none."""

RULE_TEXT = {"left_out": "is left out of every Experiment 4 endpoint",
             "counted_as_failure": "is counted as a failure in every Experiment 4 endpoint",
             "report_both": "each Experiment 4 endpoint is reported with it left out and with it counted as a failure"}
"""What each rule does to a row that failed the precondition, as the results pages say it."""


def transplant_summary(records: Sequence[TransplantRecord] | Sequence[ReplicationRecord],
                       precondition_failures: str = DEFAULT_PRECONDITION_RULE) -> dict:
    """Experiment 4 endpoints (paper §4.4): donor recovery among divergent rows, third trajectories among exact rows.

    Rows are grouped by their contemporaneous baselines (incremental vs
    prefill suffix), as registered; ``prior_stratum_reproduced`` counts rows
    whose frozen stratum the new baselines reproduce. Rows that did not meet
    the registered precondition (:func:`split_precondition`) are left out of
    every count and listed under ``ineligible``; ``rows`` counts the others.

    ``counted_as_failure`` holds the same Wilson intervals with each such row counted as a failure in its frozen
    stratum: not recovered (divergent), a third trajectory (exact). ``precondition_failures`` (one of
    :data:`PRECONDITION_RULES`) is kept for :func:`transplant_table`.

    Raises:
        GateError: if a row failed a gate other than the precondition.
        ValueError: an unknown ``precondition_failures``.
    """
    if precondition_failures not in PRECONDITION_RULES:
        raise ValueError(f"exp4_precondition_failures={precondition_failures!r}: expected one of {PRECONDITION_RULES}")
    eligible, ineligible = split_precondition(records)
    div = [r for r in eligible if r["baseline"]["suffix_differs"]]
    exact = [r for r in eligible if not r["baseline"]["suffix_differs"]]

    def whole(r: TransplantRow | ReplicationRow, direction: str) -> str:
        return outcome_of(r["interventions"]["whole"], direction)["outcome"]

    recovery = {d: wilson(sum(whole(r, d) == "donor" for r in div), len(div)) if div else None for d in DIRECTIONS}
    out: dict[str, Any] = {
        "rows": len(eligible),
        "prior_stratum_reproduced": sum(r["baseline"]["suffix_differs"] == (r["stratum"] == "divergent") for r in eligible),
        "divergent": len(div),
        "exact": len(exact),
        "recovery": recovery,
        "joint_recovery": wilson(sum(all(whole(r, d) == "donor" for d in DIRECTIONS) for r in div), len(div)) if div else None,
        "third_among_exact": wilson(sum(any(whole(r, d) == "third" for d in DIRECTIONS) for r in exact), len(exact)) if exact else None,
        "tie_initiated": sum(bool(r["baseline"].get("tie_initiated")) for r in div),
        "ineligible": [{"problem_id": r["problem_id"], "stratum": r["stratum"], "reason": r["gate_failure"]["reason"]}
                       for r in ineligible],
        "precondition_failures": precondition_failures,
    }
    u_div = sum(r["stratum"] == "divergent" for r in ineligible)
    u_ex = len(ineligible) - u_div
    n_div, n_ex = len(div) + u_div, len(exact) + u_ex

    def counted(p: Proportion | None, n: int, events: int = 0) -> Proportion | None:
        """``p`` with the rows that failed the precondition added to its denominator (and, as events, ``events``)."""
        return wilson((p.k if p is not None else 0) + events, n) if n else None

    out["counted_as_failure"] = {
        "recovery": {d: counted(recovery[d], n_div) for d in DIRECTIONS},
        "joint_recovery": counted(out["joint_recovery"], n_div),
        "third_among_exact": counted(out["third_among_exact"], n_ex, u_ex),
    }
    return out


def reported_ways(s: dict, left: Proportion | None, counted: Proportion | None) -> list[tuple[str, Proportion | None]]:
    """One Experiment 4 rate as the summary's ``precondition_failures`` rule reports it.

    ``left`` and ``counted`` are the rate with the rows failing the precondition left out and counted as failures
    (from ``s`` and ``s["counted_as_failure"]``). Returns ``[("", left)]`` where no row failed it or counting changes
    nothing, else ``("left_out", left)``, ``("counted_as_failure", counted)`` or both, in that order.
    """
    same = left is not None and counted is not None and (left.k, left.n) == (counted.k, counted.n)
    if not s["ineligible"] or same:
        return [("", left)]
    ways = {"left_out": [("left_out", left)], "counted_as_failure": [("counted_as_failure", counted)]}
    return ways.get(s["precondition_failures"], ways["left_out"] + ways["counted_as_failure"])


def localization_table(records: Sequence[TransplantRecord]) -> pd.DataFrame:
    """Per intervention, direction and stratum: how often the suffix follows the donor, the recipient, or neither.

    Divergent rows (the two baselines part) show which part of the cache
    carries the trajectory. Exact rows (the baselines agree) are the controls:
    there a partial transplant should leave the shared baseline (``baseline``),
    and a new trajectory (``third``) means the intervention itself moves the
    decoder. Rows that did not meet the precondition (:func:`split_precondition`) have no transplant and
    are left out.

    Raises:
        GateError: if a row failed a gate other than the precondition.
    """
    eligible = cast(list[TransplantRow], split_precondition(records)[0])  # Experiment 4's rows only
    table = []
    coarse = ("whole", "keys_only", "values_only", "first_half", "second_half")
    # a fixed order, whether the rows come from memory or from a ledger (whose JSON keys are sorted)
    names = sorted({n for r in eligible for n in r["interventions"]},
                   key=lambda n: (coarse.index(n), "") if n in coarse else (len(coarse), n))
    for stratum, want in (("divergent", True), ("exact", False)):
        group = [r for r in eligible if r["baseline"]["suffix_differs"] == want]
        for name in names:
            have = [r for r in group if name in r["interventions"]]
            if not have:
                continue
            for d in DIRECTIONS:
                outcomes = [outcome_of(r["interventions"][name], d)["outcome"] for r in have]
                table.append({
                    "intervention": name, "kind": have[0]["interventions"][name]["kind"], "stratum": stratum,
                    "direction": d, "rows": len(have), "follows donor": outcomes.count("donor"),
                    "follows recipient": outcomes.count("recipient"), "stays on the shared baseline": outcomes.count("baseline"),
                    "new (third) trajectory": outcomes.count("third"),
                })
    return pd.DataFrame(table)


PANEL_RULE = "within each Experiment 2 BF16 stratum, evenly spaced order statistics of prefix length then problem ID"
"""How the transplant panel is drawn (written to ``exp4_panel.json``; :func:`freeze_transplant_panel`)."""


def _stratum(plan: ArmPlan, problem: Problem) -> str:
    """A panel row's stratum, from the ledger key's panel."""
    return next(e["stratum"] for e in plan.key["panel"] if e["problem_id"] == problem.problem_id)


def _prepare(chain: Chain) -> ArmPlan[TransplantRecord]:
    """Experiment 4 under a session: its panel frozen from the chain's Experiment 2 BF16 ledger and written first.

    ``n_divergent`` and ``n_exact`` rows (:func:`freeze_transplant_panel`); the first ``n_sweep`` divergent rows
    also run the single-layer sweep. Notes: ``panel_path``, ``panel``, ``sweep``.

    Raises:
        MissingLedgerError: the Experiment 2 BF16 ledger is missing or unfinished.
        ReadOnlyLedgerError: under ``make paper`` on a profile computed elsewhere, a panel that would change.
    """
    fixed, p = chain.fixed, chain.params
    panel = freeze_transplant_panel(chain.upstream("exp2-bfloat16").records, p.n_divergent, p.n_exact)
    sweep = [e["problem_id"] for e in panel if e["stratum"] == "divergent"][:p.n_sweep]
    path = chain.write_panel("exp4_panel", rule=PANEL_RULE, prefix_bank_sha256=fixed.sha256, panel=panel, sweep=sweep)
    return EXP4.plan([chain.by_id[e["problem_id"]] for e in panel],
                     key={"prefix_bank_sha256": fixed.sha256, "panel": panel, "sweep": sweep},
                     prefixes=fixed.prefixes, preflight=0, notes={"panel_path": path, "panel": panel, "sweep": sweep})


EXP4: Arm[TransplantRecord] = Arm(
    declared_in(__name__),
    row=lambda spec, problem, plan: transplant_row(spec, problem, plan.prefix(problem), _stratum(plan, problem),
                                                   problem.problem_id in plan.key["sweep"]),
    chunk=lambda spec, problems, plan: transplant_chunk(
        spec, problems, plan.prefixes_of(problems), [_stratum(plan, q) for q in problems],
        [q.problem_id in plan.key["sweep"] for q in problems]),
    prepare=_prepare,
    key=("prefix_bank_sha256", "panel", "sweep"), prefixes=True, preflight=None)
"""Experiment 4 (paper §4.4), BF16, on its frozen panel; the bank's digest, the panel and the sweep rows key the ledger."""
