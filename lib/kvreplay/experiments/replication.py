"""Experiment 5: the outcome-blind replication on a later checkpoint (paper §4.5).

The transplant result of Experiment 4 is replicated on a distinct later
checkpoint of the same family (by default the later role table of notebook
00, :mod:`kvreplay.adapt`), on a panel frozen without reading any outcome:

1. **Panel** (:func:`freeze_replication_panel`): ``n`` evenly spaced order
   statistics of the complete BF16 prefix bank (notebook 01), sorted by prefix
   length, then problem ID. The function receives only ``(problem ID, prefix
   length)`` pairs, so no suffix, answer or divergence label can reach it. The
   panel file is written before anything is decoded.
2. **Six arms per row** (:func:`replication_row`), BF16: incremental,
   incremental replica, prefill, prefill replica, and the two whole-cache
   transplants (prefill <- incremental, incremental <- prefill), through
   :func:`kvreplay.experiments.transplant.transplant_row` with only its registered primary
   intervention, so every gate of Experiment 4 applies unchanged.
3. **Endpoints** (:func:`replication_summary`): incremental/prefill suffix
   divergence over all rows; donor recovery per direction and jointly among
   the (contemporaneously) divergent rows; a new trajectory among the
   naturally exact rows; Wilson 95% intervals on each eligible set.
4. **Interpretation** (:func:`interpret`): the paper's frozen matrix, applied
   mechanically with its absolute thresholds (12 divergent, 6 exact rows) --
   the primary verdict. A secondary verdict with the thresholds scaled to the
   panel size (``ceil(12 n / 48)``, ``ceil(6 n / 48)``) is reported beside it,
   named so; it is not the paper's rule.
5. **Secondary**: decoded accuracy of the later checkpoint's incremental arm
   against checkpoint 0's (Experiment 2's BF16 incremental arm) on the same
   fixed prefixes and caps, with an exact McNemar test.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pandas as pd

from ..arm_facts import declared_in
from ..decoding import decode
from ..adapt import POINTER, CheckpointError, checkpoint, read_pointer
from ..decoding.contract import ANSWER, MERGE, ContractError, resolve_format
from .endpoints import rate_text, require_gates
from .matrix import arm_record
from .transplant import (
    DIRECTIONS,
    order_statistics,
    split_precondition,
    transplant_chunk,
    transplant_row,
    transplant_summary,
)
from ..engine import Measured
from ..gates import GateError
from ..ledger.files import read_manifest
from ..ledger.records import Exp2Record, ReplicationRecord, ReplicationRow, outcome_of
from ..model.models import file_sha256, load_tokenizer
from ..data.problems import Problem
from ..runner import RunSpec, model_key
from ..runner.arms import Arm, ArmPlan, Chain
from ..analysis.stats import mcnemar_exact, paired_bootstrap, wilson

# ----------------------------------------------------------------------------- the frozen interpretation matrix

REFERENCE_ROWS = 48
"""Panel size the paper's thresholds were frozen for."""
REFERENCE_DIVERGENT = 12
REFERENCE_EXACT = 6

STRONG = "strong replication"
CONDITIONAL = "conditional replication, underpowered control stratum"
CHECKPOINT_SENSITIVE = "checkpoint-sensitive recovery"
PROCEDURAL = "procedural-control failure"
UNDERPOWERED = "divergence-underpowered"
PRECEDENCE = (PROCEDURAL, CHECKPOINT_SENSITIVE, UNDERPOWERED, CONDITIONAL, STRONG)
"""Labels in the order they are tested; the first whose condition holds is the verdict.

Why this order (the paper lists the labels but not how they combine):

1. *procedural-control failure* first: a new trajectory in a row whose two
   constructions already agree means the transplant procedure itself moves the
   decoder, so no recovery count can be read as evidence about the cache.
2. *checkpoint-sensitive recovery* next: one divergent row whose suffix does
   not follow its donor in both directions is an observed counterexample; it
   needs no power, so it outranks the power labels.
3. *divergence-underpowered*: complete recovery on fewer divergent rows than
   the threshold is not a replication.
4. *conditional replication, underpowered control stratum*: everything held,
   but fewer exact controls than the threshold.
5. *strong replication*: everything held with both strata at or above threshold.
"""


def scaled_thresholds(n: int) -> tuple[int, int]:
    """``(min divergent rows, min exact rows)`` for a panel of ``n`` rows: ``ceil(12 n / 48)`` and ``ceil(6 n / 48)``.

    Raises:
        ValueError: if ``n`` is not positive.
    """
    if n < 1:
        raise ValueError(f"panel size must be positive, got {n}")
    return -(-REFERENCE_DIVERGENT * n // REFERENCE_ROWS), -(-REFERENCE_EXACT * n // REFERENCE_ROWS)


@dataclasses.dataclass(frozen=True)
class Interpretation:
    """The frozen matrix's verdict on one Experiment 5 run.

    Attributes:
        label: one of :data:`PRECEDENCE`.
        reason: the counts that decided it, in words.
        n: panel rows; min_divergent, min_exact: the thresholds applied.
        divergent, exact, recovered, novel: the counts the matrix reads.
        scaled: True when the thresholds were scaled to the panel (the
            secondary verdict), False for the paper's absolute 12 and 6.
    """
    label: str
    reason: str
    n: int
    min_divergent: int
    min_exact: int
    divergent: int
    exact: int
    recovered: int
    novel: int
    scaled: bool = False

    def thresholds_text(self) -> str:
        if self.scaled:
            return (f"≥ {self.min_divergent} divergent and ≥ {self.min_exact} exact rows for n = {self.n} "
                    f"(scaled to the panel as ceil(12·n/48), ceil(6·n/48); secondary, not the paper's rule)")
        return f"≥ {self.min_divergent} divergent and ≥ {self.min_exact} exact rows (the paper's frozen thresholds; n = {self.n})"


def interpret(n: int, divergent: int, exact: int, recovered: int, novel: int, *, scaled: bool = False) -> Interpretation:
    """Apply the frozen interpretation matrix mechanically (see :data:`PRECEDENCE` for the order).

    The primary verdict uses the paper's absolute thresholds (12 divergent and
    6 exact rows, whatever the panel size); ``scaled=True`` gives the secondary
    verdict with :func:`scaled_thresholds`.

    Args:
        n: panel rows (``divergent + exact``).
        divergent: rows whose incremental and prefill suffixes differ.
        exact: rows whose suffixes agree (the controls).
        recovered: divergent rows whose transplanted suffix follows the donor in both directions.
        novel: exact rows with a new (third) trajectory in either direction.

    Raises:
        ValueError: inconsistent counts.
    """
    if divergent + exact != n or not 0 <= recovered <= divergent or not 0 <= novel <= exact:
        raise ValueError(f"inconsistent counts: n={n}, divergent={divergent}, exact={exact}, recovered={recovered}, novel={novel}")
    t_div, t_ex = scaled_thresholds(n) if scaled else (REFERENCE_DIVERGENT, REFERENCE_EXACT)
    if novel:
        label, why = PROCEDURAL, f"{novel} of {exact} exact control(s) took a new trajectory after a transplant"
    elif recovered < divergent:
        label, why = CHECKPOINT_SENSITIVE, f"donor recovery failed on {divergent - recovered} of {divergent} divergent row(s)"
    elif divergent < t_div:
        label, why = UNDERPOWERED, f"{divergent} divergent row(s), fewer than the {t_div} required"
    elif exact < t_ex:
        label, why = CONDITIONAL, (f"recovery on all {divergent} divergent rows in both directions and no new trajectory, "
                                   f"but only {exact} exact control(s), fewer than the {t_ex} required")
    else:
        label, why = STRONG, (f"recovery on all {divergent} divergent rows (≥ {t_div}) in both directions and no new "
                              f"trajectory among {exact} exact controls (≥ {t_ex})")
    return Interpretation(label, why, n, t_div, t_ex, divergent, exact, recovered, novel, scaled)


# ----------------------------------------------------------------------------- the outcome-blind panel

PANEL_RULE = (
    "evenly spaced order statistics (sorted positions round(i (N - 1) / (n - 1)), i = 0..n-1) of the complete BF16 "
    "prefix bank sorted by prefix length, then problem ID; only problem IDs and prefix lengths are read"
)


def panel_candidates(entries: Sequence[dict]) -> list[tuple[str, int]]:
    """``(problem ID, prefix length)`` of every prefix-bank entry: all the panel may read."""
    return [(str(e["problem_id"]), len(e["prefix"])) for e in entries]


def freeze_replication_panel(candidates: Sequence[tuple[str, int]], n: int) -> list[dict]:
    """Freeze the Experiment 5 panel from ``(problem ID, prefix length)`` pairs alone (paper §4.5).

    Returns:
        ``[{"problem_id", "prefix_len"}, ...]`` in sorted (length, ID) order; all candidates if ``n`` exceeds them.

    Raises:
        TypeError: if a candidate is not a ``(str, int)`` pair (records carrying outcomes are refused).
        ValueError: if ``n`` is not positive or an ID repeats.
    """
    if n < 1:
        raise ValueError(f"panel size must be positive, got {n}")
    for c in candidates:
        if not (isinstance(c, tuple) and len(c) == 2 and isinstance(c[0], str) and isinstance(c[1], int)):
            raise TypeError(f"panel candidates must be (problem_id, prefix_length) pairs, got {c!r}")
    if len({c[0] for c in candidates}) != len(candidates):
        raise ValueError("panel candidates repeat a problem ID")
    picks = order_statistics(list(candidates), n, key=lambda c: (c[1], c[0]))
    return [{"problem_id": pid, "prefix_len": length} for pid, length in picks]


def panel_doc(panel: Sequence[dict], *, n_requested: int, prefix_bank_sha256: str, checkpoint: dict) -> dict:
    """What the frozen panel file holds: rule, requested and frozen size, prefix-bank digest, the replication
    checkpoint's record and the rows (written by :meth:`kvreplay.notebook.session.Session.write_panel` with sorted keys)."""
    return {"rule": PANEL_RULE, "n_requested": n_requested, "n": len(panel), "prefix_bank_sha256": prefix_bank_sha256,
            "checkpoint": checkpoint, "panel": list(panel)}


# ----------------------------------------------------------------------------- the replication checkpoint


@dataclasses.dataclass(frozen=True)
class ReplicationCheckpoint:
    """The checkpoint Experiment 5 runs under.

    Attributes:
        model: ``model`` argument for :class:`~kvreplay.runner.ArmSettings`.
        role_table: role-table file (or None for a stock checkpoint).
        description: one line for tables.
        record: JSON-able provenance (what it is, digests), written to the panel file and the ledger key.
    """
    model: str
    role_table: str | None
    description: str
    record: dict


def resolve_checkpoint(chain_model: str, replication_model: str | None, replication_role_table: str | None,
                       pointer_path: str | Path) -> ReplicationCheckpoint:
    """Which checkpoint Experiment 5 uses.

    Default (both arguments None): the chain's base model plus the *later*
    role table of notebook 00 (found through the profile's pointer file,
    checked against the checkpoint manifest's sha256 and base-model key). A
    ``replication_model`` (any HF folder, ``.gguf`` or cached hub id) replaces
    it, with ``replication_role_table`` (optional) as its role table; a
    ``replication_role_table`` alone runs on the chain's base model.

    Raises:
        CheckpointError: missing pointer, a role table that fails its digest, or a base model that is
            not the one the table was trained on.
        FileNotFoundError: a given role-table file that does not exist.
    """
    if replication_model is None and replication_role_table is None:
        folder, pointer = read_pointer(pointer_path)
        ck = checkpoint(folder, "later")
        if ck.base_model["key"] != model_key(chain_model):
            raise CheckpointError(f"the later role table was trained on {ck.base_model['key']}, "
                                  f"but the chain runs {model_key(chain_model)}")
        rec = {"kind": "later role table (notebook 00)", "model": model_key(chain_model), "role_table_step": ck.step,
               "role_table_sha256": ck.sha256, "checkpoint_config_digest": pointer["config_digest"]}
        return ReplicationCheckpoint(chain_model, str(ck.path), describe_checkpoint(rec), rec)
    model = replication_model or chain_model
    if replication_role_table is not None and not Path(replication_role_table).is_file():
        raise FileNotFoundError(f"replication role table not found: {replication_role_table}")
    sha = file_sha256(replication_role_table) if replication_role_table else None
    rec = {"kind": "user-given checkpoint", "model": model_key(model), "role_table_sha256": sha}
    return ReplicationCheckpoint(str(model), replication_role_table, describe_checkpoint(rec), rec)


def describe_checkpoint(record: dict) -> str:
    """One line naming the replication checkpoint, from its provenance record (also stored in the ledger key)."""
    model = record["model"].get("model", "?")
    sha = record.get("role_table_sha256")
    if record["kind"].startswith("later role table"):
        return (f"{model} + later role table of notebook 00 (step {record['role_table_step']}, "
                f"sha256 {record['role_table_sha256'][:12]}…)")
    return f"{model}" + (f" + given role table (sha256 {sha[:12]}…)" if sha else " (given checkpoint, no role table)")


def check_same_format(model: str, fmt: str, expected_digest: str | None) -> None:
    """The replication checkpoint must resolve the block format to the chain's token IDs (prefixes are token IDs).

    Raises:
        ContractError: naming both digests when the tokenizer or format differs.
    """
    if expected_digest is None:
        return
    got = resolve_format(load_tokenizer(model), fmt).digest
    if got != expected_digest:
        raise ContractError(
            f"the replication checkpoint {model!r} resolves the block format to digest {got[:12]}, the chain's "
            f"prefixes were made with {expected_digest[:12]}: Experiment 5 needs a checkpoint of the same family "
            "(same tokenizer and delimiters)"
        )


# ----------------------------------------------------------------------------- one row


def replication_row(spec: RunSpec, problem: Problem, prefix: Sequence[int]) -> ReplicationRecord:
    """Experiment 5 for one panel row: the six arms, every Experiment 4 gate, and each baseline's answer score.

    Returns:
        The :func:`~kvreplay.experiments.transplant.transplant_row` record (``stratum`` ``"panel"``: the panel is not
        stratified; rows are grouped by their contemporaneous baselines) plus ``scores[arm]`` for the
        incremental and prefill baselines (``answer_text``, ``predicted``, ``correct``, ``rule``).
    """
    rec = cast(dict[str, Any], transplant_row(spec, problem, prefix, "panel", sweep=False, primary_only=True))
    if rec["gate_failure"] is None:
        rec["scores"] = {arm: score_suffix(spec, problem, prefix, rec["baseline"][arm]) for arm in ("incremental", "prefill")}
    return cast(ReplicationRecord, rec)  # run_arm checks it against the record before appending


def replication_chunk(spec: RunSpec, problems: Sequence[Problem],
                      prefixes: Sequence[Sequence[int]]) -> Measured[ReplicationRecord]:
    """Experiment 5 for a chunk of panel rows through the batched engine (the records of :func:`replication_row`).

    :func:`~kvreplay.experiments.transplant.transplant_chunk` with the whole-cache transplant only, then each
    clean row's baseline scores; with what the engines measured.
    """
    recs = cast(Measured[dict[str, Any]], transplant_chunk(spec, problems, prefixes, ["panel"] * len(problems),
                                                        [False] * len(problems), primary_only=True))
    for rec, p, z in zip(recs, problems, prefixes):
        if rec["gate_failure"] is None:
            rec["scores"] = {arm: score_suffix(spec, p, z, rec["baseline"][arm]) for arm in ("incremental", "prefill")}
    return cast(Measured[ReplicationRecord], recs)  # as replication_row's


def score_suffix(spec: RunSpec, problem: Problem, prefix: Sequence[int], suffix: Sequence[int]) -> dict:
    """Answer score of a decoded suffix, by the same matcher and fields as every other arm."""

    full = list(prefix) + list(suffix)
    parsed = spec.fmt.parse(full, where=f"{problem.problem_id} suffix")
    merge, answer = parsed.content[MERGE], parsed.content[ANSWER]
    if merge is None or answer is None:
        raise ContractError(f"{problem.problem_id}: the decoded suffix does not hold both a merge and an answer block")
    (m0, m1), (a0, a1) = merge, answer
    arm = arm_record(spec, problem, decode.Suffix(list(suffix), [], full[m0:m1], full[a0:a1]))
    return {k: arm[k] for k in ("answer_text", "predicted", "correct", "rule", "merge_len", "answer_len")}


# ----------------------------------------------------------------------------- endpoints and tables


def replication_summary(records: Sequence[ReplicationRecord]) -> dict:
    """Experiment 5 endpoints and the interpretation, from ledger records alone.

    Returns:
        ``rows``, ``divergent``, ``exact``; ``divergence`` (Wilson over all rows); ``recovery`` per
        direction and ``joint_recovery`` among divergent rows; ``third_among_exact`` (a new trajectory
        among exact rows; Wilson, None for an empty stratum); ``interpretation`` (the paper's absolute
        thresholds: the primary verdict); ``interpretation_scaled`` (thresholds scaled to the panel:
        secondary); ``tie_initiated`` (divergent rows whose first divergence is tie-initiated);
        ``prefix_len_range``.

    Rows that did not meet the transplant's registered precondition (the boundary's raw argmax differs
    between constructions, :func:`~kvreplay.experiments.transplant.split_precondition`) are left out of
    every count, ``rows`` included, and listed under ``ineligible``.

    Raises:
        GateError: if a row failed a gate other than the precondition (endpoints are withheld).
    """
    t = transplant_summary(records)  # splits off the ineligible rows itself, and lists them
    n = t["rows"]
    recovered = t["joint_recovery"].k if t["joint_recovery"] else 0
    novel = t["third_among_exact"].k if t["third_among_exact"] else 0
    return {
        "rows": n, "divergent": t["divergent"], "exact": t["exact"],
        "divergence": wilson(t["divergent"], n),
        "recovery": t["recovery"], "joint_recovery": t["joint_recovery"], "third_among_exact": t["third_among_exact"],
        "interpretation": interpret(n, t["divergent"], t["exact"], recovered, novel),
        "interpretation_scaled": interpret(n, t["divergent"], t["exact"], recovered, novel, scaled=True),
        "tie_initiated": t["tie_initiated"],
        "ineligible": t["ineligible"],
        "prefix_len_range": (min(r["prefix_len"] for r in records), max(r["prefix_len"] for r in records)),
    }


def replication_table(s: dict, checkpoint: str) -> pd.DataFrame:
    """Experiment 5 table: endpoints with Wilson intervals, the primary verdict (absolute thresholds) and the scaled one."""
    i, j = s["interpretation"], s["interpretation_scaled"]
    ctl = wilson(0, s["exact"]) if s["exact"] else None
    lo, hi = s["prefix_len_range"]
    return pd.DataFrame({"Experiment 5 (BF16, later checkpoint)": {
        "replication checkpoint": checkpoint,
        "panel rows (order statistics of prefix length)": f"{s['rows'] + len(s['ineligible'])} (prefixes {lo}–{hi} tokens)",
        "all gates pass (replicas, state, storage, argmax, provenance)": f"{s['rows']}/{s['rows'] + len(s['ineligible'])}",
        **({"argmax precondition unmet (no transplant; left out of every line below)": "; ".join(
            f"{r['problem_id']} ({r['reason']})" for r in s["ineligible"])} if s["ineligible"] else {}),
        "incremental/prefill suffix divergence": s["divergence"].pct(),
        **({"divergence over the whole panel, the rows left out counted as not / as divergent": (
            f"{wilson(s['divergent'], s['rows'] + len(s['ineligible'])).pct()} to "
            f"{wilson(s['divergent'] + len(s['ineligible']), s['rows'] + len(s['ineligible'])).pct()}")}
           if s["ineligible"] else {}),
        "of which tie-initiated (either arm's top-1 minus top-2 margin exactly 0 at the first divergent step)":
            f"{s['tie_initiated']}/{s['divergent']}",
        "donor recovery, prefill <- incremental (integrity check)": rate_text(s["recovery"]["prefill<-incremental"]),
        "donor recovery, incremental <- prefill (integrity check)": rate_text(s["recovery"]["incremental<-prefill"]),
        "joint bidirectional recovery (integrity check)": rate_text(s["joint_recovery"]),
        "new trajectory among exact controls": rate_text(s["third_among_exact"]),
        "thresholds (the paper's, absolute)": i.thresholds_text(),
        "interpretation (frozen matrix)": i.label,
        "decided by": i.reason,
        "secondary: interpretation with thresholds scaled to the panel": f"{j.label} ({j.thresholds_text()})",
        "power note": (f"with {s['exact']} exact controls, 0 events would only exclude new-trajectory rates above "
                       f"{100 * ctl.high:.1f}% (Wilson upper bound)" if ctl else "no exact controls"),
    }})


def partial_table(rows: list[Any], folder: Path | None = None) -> pd.DataFrame:
    """The replication table on the finished ``rows`` of the ledger ``folder``, its checkpoint named from the folder's
    manifest (``python -m kvreplay.report.partial``).

    Raises:
        ValueError: no ``folder``, or its manifest's config names no replication checkpoint.
        GateError: a row failed a gate other than the transplant's precondition.
    """
    if folder is None:
        raise ValueError("Experiment 5's table names its checkpoint from the ledger folder's manifest: pass folder")
    checkpoint = read_manifest(folder)["config"].get("checkpoint")
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{Path(folder) / 'manifest.json'}: its config names no replication checkpoint (`checkpoint`)")
    return replication_table(replication_summary(rows), describe_checkpoint(checkpoint))


def accuracy_vs_checkpoint0(exp2_bf16: Sequence[Exp2Record], exp5: Sequence[ReplicationRecord], *,
                            seed: int = 20260729,
                            n_resamples: int = 20000) -> dict:
    """Secondary: decoded accuracy, later checkpoint (Exp 5 incremental) vs checkpoint 0 (Exp 2 BF16 incremental), same prefixes and caps.

    Returns:
        ``n``, ``ckpt0``/``later`` (Wilson), ``diff`` (paired bootstrap, later minus checkpoint 0),
        ``mcnemar`` (``b``: checkpoint-0-only correct, ``c``: later-only correct), ``answers_differ``,
        and ``suffix_len`` (checkpoint -> median, min, max of the incremental suffix length in tokens
        after the boundary: a shorter suffix leaves fewer steps at which two constructions can part).

    Raises:
        GateError: if a row failed a gate (other than the transplant's precondition, whose rows have no
            scores and are left out) or a panel row is missing from Experiment 2.
    """
    exp2_passed = require_gates(exp2_bf16)
    exp5_eligible = cast(list[ReplicationRow], split_precondition(exp5)[0])  # Experiment 5's rows only
    by_id = {r["problem_id"]: r for r in exp2_passed}
    missing = [r["problem_id"] for r in exp5_eligible if r["problem_id"] not in by_id]
    if missing:
        raise GateError("report", f"panel rows missing from the Experiment 2 BF16 ledger: {missing}")
    a = [by_id[r["problem_id"]]["arms"]["incremental"]["correct"] for r in exp5_eligible]
    b = [r["scores"]["incremental"]["correct"] for r in exp5_eligible]
    n = len(exp5_eligible)
    diff_answer = sum(by_id[r["problem_id"]]["arms"]["incremental"]["predicted"] != r["scores"]["incremental"]["predicted"]
                      for r in exp5_eligible)
    lengths = {"ckpt0": [len(by_id[r["problem_id"]]["arms"]["incremental"]["suffix"]) for r in exp5_eligible],
               "later": [len(r["baseline"]["incremental"]) for r in exp5_eligible]}
    return {"n": n, "ckpt0": wilson(sum(a), n), "later": wilson(sum(b), n),
            "diff": paired_bootstrap(a, b, n_resamples=n_resamples, seed=seed) if n >= 2 else None,
            "mcnemar": mcnemar_exact(a, b), "answers_differ": diff_answer,
            "suffix_len": {k: (statistics.median(v), min(v), max(v)) for k, v in lengths.items()}}


def accuracy_table(acc: dict) -> pd.DataFrame:
    """The secondary accuracy table of Experiment 5."""
    d, m = acc["diff"], acc["mcnemar"]
    return pd.DataFrame({"decoded accuracy on the panel (BF16 incremental arm)": {
        "panel rows (same fixed prefixes and caps)": str(acc["n"]),
        "checkpoint 0 (Experiment 2)": acc["ckpt0"].pct(),
        "later checkpoint (Experiment 5)": acc["later"].pct(),
        "later − checkpoint 0, pts [95% paired bootstrap CI]": (
            f"{100 * d.estimate:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]" if d else "n/a"),
        "McNemar: checkpoint-0-only vs later-only correct, exact p": f"{m.b} vs {m.c}, p = {m.pvalue:.3g}",
        "predicted answer differs": f"{acc['answers_differ']}/{acc['n']}",
        "incremental suffix length, median (range), checkpoint 0 vs later": " vs ".join(
            f"{m:g} ({lo}–{hi})" for m, lo, hi in (acc["suffix_len"]["ckpt0"], acc["suffix_len"]["later"])),
    }})


def outcome_frame(records: Sequence[ReplicationRecord]) -> pd.DataFrame:
    """Per row: prefix length, contemporaneous stratum and each direction's whole-cache outcome (for the figure).

    Rows that did not meet the transplant's precondition have no outcome and are left out.

    Raises:
        GateError: if a row failed a gate other than the precondition.
    """
    rows = []
    for r in split_precondition(records)[0]:
        row = {"problem_id": r["problem_id"], "prefix_len": r["prefix_len"],
               "stratum": "divergent" if r["baseline"]["suffix_differs"] else "exact"}
        for d in DIRECTIONS:
            row[d] = outcome_of(r["interventions"]["whole"], d)["outcome"]
        rows.append(row)
    return pd.DataFrame(rows, columns=["problem_id", "prefix_len", "stratum", *DIRECTIONS])


# ----------------------------------------------------------------------------- the arm


def chain_checkpoint(chain: Chain) -> ReplicationCheckpoint:
    """The replication checkpoint of a session's chain (:func:`resolve_checkpoint` of its parameters and pointer file).

    Raises:
        CheckpointError, FileNotFoundError: as :func:`resolve_checkpoint`.
    """
    p = chain.params
    return resolve_checkpoint(p.model, p.replication_model, p.replication_role_table,
                              chain.ledger_root / p.profile / POINTER)


def _prepare(chain: Chain) -> ArmPlan[ReplicationRecord]:
    """Experiment 5 under a session: the checkpoint, the panel (frozen from prefix lengths alone) written first.

    ``n_exp5`` rows (:func:`freeze_replication_panel`), ``preflight_fixed`` preflight rows, the checkpoint's model and
    role table. Checkpoint 0's Experiment 2 BF16 ledger is read, and a checkpoint of another model must resolve the
    block format to the chain's digest. Notes: ``checkpoint``, ``panel_path``, ``panel``, ``exp2``, ``chain_format``.

    Raises:
        CheckpointError, FileNotFoundError: the checkpoint cannot be resolved (:func:`resolve_checkpoint`).
        MissingLedgerError: the Experiment 2 BF16 ledger is missing or unfinished.
        ContractError: the checkpoint's block format differs from the chain's (:func:`check_same_format`).
        ReadOnlyLedgerError: under ``make paper`` on a profile computed elsewhere, a panel that would change.
    """
    fixed, p = chain.fixed, chain.params
    ckpt = chain_checkpoint(chain)
    panel = freeze_replication_panel(panel_candidates(fixed.entries), p.n_exp5)
    path = chain.write_panel("exp5_panel", sort_keys=True, **panel_doc(
        panel, n_requested=p.n_exp5, prefix_bank_sha256=fixed.sha256, checkpoint=ckpt.record))
    exp2 = chain.upstream("exp2-bfloat16")  # checkpoint 0, for the secondary accuracy comparison
    chain_format = exp2.contract.get("format_digest")
    if ckpt.model != p.model:
        check_same_format(ckpt.model, p.format, chain_format)
    return EXP5.plan([chain.by_id[e["problem_id"]] for e in panel],
                     key={"prefix_bank_sha256": fixed.sha256, "panel": panel, "checkpoint": ckpt.record},
                     prefixes=fixed.prefixes, preflight=p.preflight_fixed, model=ckpt.model, role_table=ckpt.role_table,
                     notes={"checkpoint": ckpt, "panel_path": path, "panel": panel, "exp2": exp2,
                            "chain_format": chain_format})


EXP5: Arm[ReplicationRecord] = Arm(
    declared_in(__name__), row=lambda spec, problem, plan: replication_row(spec, problem, plan.prefix(problem)),
    chunk=lambda spec, problems, plan: replication_chunk(spec, problems, plan.prefixes_of(problems)),
    prepare=_prepare,
    key=("prefix_bank_sha256", "panel", "checkpoint"), prefixes=True, preflight="preflight_fixed")
"""Experiment 5 (paper §4.5), BF16, under the later checkpoint on its frozen panel.

The bank's digest, the panel and the checkpoint's record key the ledger."""
