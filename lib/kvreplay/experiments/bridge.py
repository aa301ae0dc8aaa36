"""Experiment 3: the incremental bridge and the saved-ledger audit (paper §4.3).

*Bridge*: on a panel of problems the live decode is repeated and the
incremental cache rebuilt from its saved prefix must equal the live cache bit
for bit, and so must their suffixes. *Audit*: the committed Experiment 1 and 2
ledgers must agree leaf by leaf wherever the two experiments computed the
same thing (the live arm of Experiment 1 against the incremental arm of
Experiment 2 on the same prefixes).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pandas as pd

from ..arm_facts import declared_in
from ..decoding import caches, decode
from .. import engine, gates
from ..engine import Measured
from ..gates import GateError
from ..ledger.records import BridgeRecord, Exp1Record, Exp2Record, arm_of
from ..data.problems import Problem
from ..runner import RunSpec, leaves
from ..runner.arms import Arm, ArmPlan, Chain
from .endpoints import require_gates
from .matrix import (
    arm_record,
    boundary_gates,
    comparison,
    decode_groups,
    equivalence_record,
    gate_failure,
    raise_gate_errors,
)
from .transplant import order_statistics


def bridge_row(spec: RunSpec, problem: Problem, saved_prefix: Sequence[int]) -> BridgeRecord:
    """Experiment 3 bridge for one problem (paper §3.7): new live boundary vs incremental from that prefix.

    Both constructions get verified replicas and pass the state, storage and
    duplicate gates; the endpoint (not a gate) is whether incremental equals
    live bit for bit on every layer, in the boundary logits and in the suffix.

    Returns:
        The ledger record (``gate_failure`` set on a gate failure).
    """
    lm, fmt = spec.lm, spec.fmt
    rec: dict[str, Any] = {"problem_id": problem.problem_id, "gate_failure": None}
    try:
        live = decode.decode_live(lm, fmt, fmt.prompt_ids(problem.question, problem.options), spec.decoding)
        z = live.ids
        rec.update(prefix_len=len(z), prefix=z, saved_prefix_len=len(saved_prefix), same_as_saved=z == list(saved_prefix))
        states = _bridge_states(spec, live, decode.build_incremental(lm, fmt, z, where=problem.problem_id))
        cmp = comparison(live, states["incremental"], per_tensor=True)
        rec["equivalence"] = equivalence_record(spec, problem, z)
        arms = {n: decode.decode_suffix(lm, fmt, s, spec.decoding) for n, s in states.items()}
        _bridge_endpoints(spec, problem, rec, cmp, arms)
    except GateError as e:
        rec["gate_failure"] = gate_failure(e)
    return cast(BridgeRecord, rec)  # built stage by stage; run_arm checks it against the record before appending


def bridge_chunk(spec: RunSpec, problems: Sequence[Problem], saved_prefixes: Sequence[Sequence[int]]) -> Measured[BridgeRecord]:
    """Experiment 3 bridge for a chunk of problems through the batched engine (the records of :func:`bridge_row`).

    The live boundaries come from :func:`kvreplay.engine.decode_lives` and the
    incremental rebuilds of their prefixes from :func:`kvreplay.engine.build_incrementals`,
    both at the arm's batch shape (``spec.engine``). This is the engine's bridge:
    every step of the rebuild has the live step's inputs, and a problem's bits
    do not depend on its slot or companions. Replicas, gates and comparisons are
    made one problem at a time; the four suffixes of every clean problem
    continue through one :func:`kvreplay.engine.decode_suffixes`.

    Returns:
        One record per problem, in order (``gate_failure`` set on a gate failure), with what the engines measured.

    Raises:
        ContractError: a prompt that breaks the block contract, or an unclosed answer block.
    """
    lm, fmt = spec.lm, spec.fmt
    prompts = [fmt.prompt_ids(p.question, p.options) for p in problems]
    lives = engine.decode_lives(lm, fmt, prompts, spec.decoding, run=spec.batched(), on_gate_error="return")
    ok = [i for i, x in enumerate(lives) if not isinstance(x, GateError)]
    rebuilt = engine.build_incrementals(lm, fmt, [lives[i].ids for i in ok], run=spec.batched(), on_gate_error="return")
    incs: list = list(lives)
    for i, x in zip(ok, rebuilt):
        incs[i] = x
    recs: list[dict[str, Any]] = [{"problem_id": p.problem_id, "gate_failure": None} for p in problems]
    pending = []
    for i, (p, live, inc, saved) in enumerate(zip(problems, lives, incs, saved_prefixes)):
        rec = recs[i]
        try:
            raise_gate_errors([live])
            z = live.ids
            rec.update(prefix_len=len(z), prefix=z, saved_prefix_len=len(saved), same_as_saved=z == list(saved))
            raise_gate_errors([inc])
            states = _bridge_states(spec, live, inc)
            cmp = comparison(live, states["incremental"], per_tensor=True)
            rec["equivalence"] = equivalence_record(spec, p, z)
            pending.append((i, states, cmp))
        except GateError as e:
            rec["gate_failure"] = gate_failure(e)
    decoded = decode_groups(spec, [list(states.values()) for _, states, _ in pending])
    for (i, states, cmp), suffixes in zip(pending, decoded):
        try:
            raise_gate_errors(suffixes)
            _bridge_endpoints(spec, problems[i], recs[i], cmp, dict(zip(states, suffixes)))
        except GateError as e:
            recs[i]["gate_failure"] = gate_failure(e)
    return cast(Measured[BridgeRecord], Measured(recs, lives.stats + rebuilt.stats + decoded.stats))  # as bridge_row's


def _bridge_states(spec: RunSpec, live: decode.Boundary, inc: decode.Boundary) -> dict[str, decode.Boundary]:
    """Live, incremental and their verified replicas, with every boundary gate (raises :class:`GateError`)."""
    states = {"live": live, "live_replica": caches.live_replica(live), "incremental": inc,
              "incremental_replica": caches.live_replica(inc)}
    if spec.faults:
        spec.faults(states)
    boundary_gates(states, spec.lm.dtype, [("live", "live_replica"), ("incremental", "incremental_replica")])
    return states


def _bridge_endpoints(spec: RunSpec, problem: Problem, rec: dict, cmp: dict, arms: dict[str, decode.Suffix]) -> None:
    """Suffix replica gates, arm records and the bridge endpoints of one row (raises :class:`GateError`)."""
    for a, b in (("live", "live_replica"), ("incremental", "incremental_replica")):
        gates.check_equal_sequences("suffix_replica", f"{a} vs {b}", arms[a].tokens, arms[b].tokens)
    rec["boundary"] = {"incremental_vs_live": cmp}
    rec["arms"] = {n: arm_record(spec, problem, s) for n, s in arms.items()}
    layers = {t["tensor"].split(".")[0] for t in cmp["tensors"]}
    rec["endpoints"] = {
        "cache_exact": cmp["cache"]["exact"],
        "layers": len(layers),
        "layers_exact": len(layers - {t["tensor"].split(".")[0] for t in cmp["tensors"] if not t["exact"]}),
        "logits_exact": cmp["logits"]["exact"],
        "suffix_exact": arms["live"].tokens == arms["incremental"].tokens,
    }


AUDIT_ARMS = {"live": "incremental", "live_replica": "incremental_replica", "prefill": "prefill", "prefill_replica": "prefill_replica"}
"""Experiment 1 arm -> the Experiment 2 arm that must reproduce it."""


BOUNDARY_RENAME = {"prefill_vs_live": "prefill_vs_incremental", "live_replica": "incremental_replica"}


def saved_ledger_audit(exp1: Sequence[Exp1Record], exp2: Sequence[Exp2Record]) -> dict:
    """Deterministic join of the Experiment 1 and 2 BF16 ledgers by problem ID (paper §3.7 audit).

    Compares problem order, prefix IDs, complete suffix arrays per arm
    (:data:`AUDIT_ARMS`), and every scalar cache/logit summary leaf the two
    ledgers share (Experiment 1's ``live`` names mapped to ``incremental``).

    Returns:
        counts: ``rows``, ``order_agrees``, ``prefix_agrees``, per-arm suffix
        agreement, ``cache_leaves``/``logit_leaves`` (common leaves per row) and
        the rows on which all of them agree.

    Raises:
        GateError: if either ledger has a failed row.
    """
    exp1_passed, exp2_passed = require_gates(exp1), require_gates(exp2)
    by2 = {r["problem_id"]: r for r in exp2_passed}
    rows = [(a, by2.get(a["problem_id"])) for a in exp1_passed]
    out = {
        "rows": len(exp1_passed),
        "order_agrees": [r["problem_id"] for r in exp1_passed] == [r["problem_id"] for r in exp2_passed],
        "prefix_agrees": sum(b is not None and a["prefix"] == b["prefix"] for a, b in rows),
        "suffix_agrees": {
            f"{x}→{y}": sum(b is not None and arm_of(a, x)["suffix"] == arm_of(b, y)["suffix"] for a, b in rows)
            for x, y in AUDIT_ARMS.items()
        },
    }
    cache_counts: set[int] = set()
    logit_counts: set[int] = set()
    cache_rows = logit_rows = 0
    for a, b in rows:
        if b is None:
            continue
        renamed = {BOUNDARY_RENAME.get(k, k): v for k, v in a["boundary"].items()}
        la = leaves(renamed)
        lb = leaves(b["boundary"])
        common = sorted(set(la) & set(lb))
        cache = [k for k in common if ".logits." not in k]
        logit = [k for k in common if ".logits." in k]
        cache_counts.add(len(cache))
        logit_counts.add(len(logit))
        cache_rows += all(la[k] == lb[k] for k in cache)
        logit_rows += all(la[k] == lb[k] for k in logit)
    out.update(
        cache_leaves=sorted(cache_counts), logit_leaves=sorted(logit_counts),
        cache_leaves_agree_rows=cache_rows, logit_leaves_agree_rows=logit_rows,
    )
    return out


REPLAY_FIELDS = ("device_name", "torch", "cpu_capability", "intra_op_threads", "engine.step_path", "engine.batch")
"""The recorded execution-contract fields :func:`replay_setting` compares between the bridge and Experiment 1."""


def replay_setting(bridge_env: dict, exp1_env: dict) -> str:
    """Where the bridge's new live decodes ran against Experiment 1's saved ones, read from both ledgers'
    ``environment.json`` (``execution_contract`` and ``library_sha256``), never assumed. One clause names the
    :data:`REPLAY_FIELDS` that differ, if any, and both library digests (12 hex digits) when they differ."""
    def field(env: dict, key: str) -> Any:
        value: Any = env.get("execution_contract", {})
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        return value

    differ = [k for k in REPLAY_FIELDS if field(bridge_env, k) != field(exp1_env, k)]
    where = (f"on Experiment 1's execution contract ({field(bridge_env, 'device_name')}, torch "
             f"{field(bridge_env, 'torch')})" if not differ else "under another execution contract than Experiment 1's ("
             + "; ".join(f"{k} {field(exp1_env, k)!r} there, {field(bridge_env, k)!r} here" for k in differ) + ")")
    a, b = bridge_env.get("library_sha256") or "none recorded", exp1_env.get("library_sha256") or "none recorded"
    lib = f"by Experiment 1's library ({a[:12]})" if a == b else f"by library {a[:12]}, Experiment 1's by {b[:12]}"
    return f"here the bridge ran {where}, its ledger created {lib}"


def bridge_summary(records: Sequence[BridgeRecord]) -> dict:
    """Experiment 3 bridge endpoints (paper §4.3) from its ledger records.

    Returns:
        ``n``, ``layers_exact`` (rows bit-exact on every layer), ``logits_exact``,
        ``suffix_exact``, ``same_as_saved``, ``prefix_len_range``, ``saved_prefix_len_range``.

    Raises:
        GateError: if any row failed a gate.
    """
    passed = require_gates(records)
    ep = [r["endpoints"] for r in passed]
    return {
        "n": len(passed),
        "layers_exact": sum(e["layers_exact"] == e["layers"] for e in ep),
        "layers": sorted({e["layers"] for e in ep}),
        "logits_exact": sum(e["logits_exact"] for e in ep),
        "suffix_exact": sum(e["suffix_exact"] for e in ep),
        "same_as_saved": sum(r["same_as_saved"] for r in passed),
        "prefix_len_range": (min(r["prefix_len"] for r in passed), max(r["prefix_len"] for r in passed)),
        "saved_prefix_len_range": (min(r["saved_prefix_len"] for r in passed), max(r["saved_prefix_len"] for r in passed)),
    }


def bridge_table(b: dict) -> pd.DataFrame:
    """Experiment 3 bridge table (same rows as notebook 03 writes to ``exp3_bridge``)."""
    n = b["n"]
    return pd.DataFrame({"bridge (BF16)": {
        "rows": str(n),
        "all gates pass (replicas, state, storage, duplicates)": f"{n}/{n}",
        "incremental bit-exact to live on every layer": f"{b['layers_exact']}/{n}",
        "boundary logits exact": f"{b['logits_exact']}/{n}",
        "complete suffix exact": f"{b['suffix_exact']}/{n}",
        "new prefix length (tokens)": f"{b['prefix_len_range'][0]}–{b['prefix_len_range'][1]}",
        "new prefix token-identical to the saved one": f"{b['same_as_saved']}/{n}",
    }})


def partial_table(rows: list[Any], folder: Path | None = None) -> pd.DataFrame:
    """The bridge table on the finished ``rows`` of a ledger (``python -m kvreplay.report.partial``; ``folder`` unused)."""
    return bridge_table(bridge_summary(rows))


def audit_table(audit: dict) -> pd.DataFrame:
    """Experiment 3 saved-ledger audit table (same rows as notebook 03 writes to ``table_exp3_audit``)."""
    n = audit["rows"]
    return pd.DataFrame({"audit (BF16)": {
        "rows joined by problem ID": str(n),
        "problem IDs and order agree": "yes" if audit["order_agrees"] else "no",
        "prefix IDs agree": f"{audit['prefix_agrees']}/{n}",
        **{f"suffix reproduced: {k}": f"{v}/{n}" for k, v in audit["suffix_agrees"].items()},
        "common scalar cache leaves per row": ", ".join(map(str, audit["cache_leaves"])),
        "rows on which every cache leaf agrees": f"{audit['cache_leaves_agree_rows']}/{n}",
        "common scalar logit leaves per row": ", ".join(map(str, audit["logit_leaves"])),
        "rows on which every logit leaf agrees": f"{audit['logit_leaves_agree_rows']}/{n}",
    }})


PANEL_RULE = "evenly spaced order statistics of saved BF16 prefix length, then problem ID"
"""How the bridge panel is drawn from the prefix bank (written to ``exp3_bridge_panel.json``)."""


def _prepare(chain: Chain) -> ArmPlan[BridgeRecord]:
    """The bridge under a session: its panel (``n_bridge`` rows, :data:`PANEL_RULE`), frozen and written first.

    Notes: ``panel_path``, ``panel_ids``.

    Raises:
        ReadOnlyLedgerError: under ``make paper`` on a profile computed elsewhere, a panel that would change.
    """
    fixed = chain.fixed
    panel = order_statistics(fixed.entries, chain.params.n_bridge, key=lambda e: (len(e["prefix"]), e["problem_id"]))
    ids = [e["problem_id"] for e in panel]
    path = chain.write_panel("exp3_bridge_panel", rule=PANEL_RULE, prefix_bank_sha256=fixed.sha256, problem_ids=ids,
                             saved_prefix_lengths=[len(e["prefix"]) for e in panel])
    return EXP3.plan([chain.by_id[i] for i in ids], key={"prefix_bank_sha256": fixed.sha256}, prefixes=fixed.prefixes,
                     preflight=0, notes={"panel_path": path, "panel_ids": ids})


EXP3: Arm[BridgeRecord] = Arm(
    declared_in(__name__), row=lambda spec, problem, plan: bridge_row(spec, problem, plan.prefix(problem)),
    chunk=lambda spec, problems, plan: bridge_chunk(spec, problems, plan.prefixes_of(problems)),
    prepare=_prepare,
    key=("prefix_bank_sha256",), prefixes=True, preflight=None)
"""Experiment 3's bridge (paper §4.3), BF16, on its frozen panel; the bank's digest keys the ledger."""
