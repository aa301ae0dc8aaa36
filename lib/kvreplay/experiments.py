"""Per-row experiment functions and their endpoint tables (paper §3.5–3.6, §4).

Rows are independent: each experiment maps a pure per-row function over
problem IDs in frozen order (:func:`kvreplay.ledger.run_rows`), so rows can
later be spread over processes without touching this code. Different
problems are never batched together.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd
import torch

from . import caches, decode, drift, gates
from .contract import BlockFormat, Caps, ContractError
from .data import Problem
from .gates import GateError
from .ledger import canonical_json
from .models import LoadedModel
from .scoring import score_answer
from .stats import mcnemar_exact, paired_bootstrap, wilson

Hook = Callable[[dict[str, decode.Boundary]], None]


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What a row function needs besides the problem.

    Attributes:
        lm: loaded model (its dtype is the run's precision).
        fmt: resolved block format.
        caps: content caps.
        faults: optional hook called with the boundary states right after
            they are built and before any gate runs; tests use it to plant
            faults through the same runner the notebooks use.
    """

    lm: LoadedModel
    fmt: BlockFormat
    caps: Caps
    faults: Hook | None = None


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing suffix token (tokens after the boundary, 0-based), or None if identical.

    When one sequence is a strict prefix of the other, the index is the shorter length.
    """
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_prompts(fmt: BlockFormat, problems: Sequence[Problem]) -> None:
    """Build every prompt before a run so a bad problem fails before any row is decoded.

    Raises:
        ContractError: naming the problem ID.
    """
    for p in problems:
        try:
            fmt.prompt_ids(p.question, p.options)
        except ContractError as e:
            raise ContractError(f"problem {p.problem_id} (line {p.source_line}): {e}") from e


def _arm_record(spec: RunSpec, problem: Problem, suffix: decode.Suffix) -> dict:
    tok = spec.lm.tokenizer
    text = spec.fmt.answer_prefix_text + tok.decode(suffix.answer)
    score = score_answer(text, problem.answer, problem.options)
    return {
        "suffix": suffix.tokens,
        "margins": suffix.margins,
        "merge_len": len(suffix.merge),
        "answer_len": len(suffix.answer),
        "answer_text": text,
        "predicted": score.predicted,
        "correct": score.correct,
        "rule": score.rule,
    }


def boundary_gates(states: dict[str, decode.Boundary], dtype: torch.dtype, pairs: Sequence[tuple[str, str]]) -> None:
    """All boundary gates of a row, in a fixed order (dtype, functional state, desync, replicas, storage).

    Args:
        states: arm name -> boundary state.
        dtype: the run's dtype.
        pairs: replica pairs that must be exact.

    Raises:
        GateError: the first gate that fails.
    """
    for name, s in states.items():
        gates.check_dtype(name, caches.boundary_tensors(s), dtype)
    gates.check_functional_state(states)
    for name, s in states.items():
        gates.check_duplicates(name, caches.boundary_tensors(s))
    for a, b in pairs:
        gates.check_exact(f"{a} vs {b}", caches.boundary_tensors(states[a]), caches.boundary_tensors(states[b]))
    gates.check_disjoint({n: [t for _, t in caches.boundary_tensors(s)] for n, s in states.items()})


def comparison(ref: decode.Boundary, other: decode.Boundary, per_tensor: bool) -> dict:
    """Drift of ``other`` against ``ref``: whole-cache aggregate, boundary logits, optionally every tensor."""
    rows = drift.cache_drift(gates.cache_tensors(ref.cache), gates.cache_tensors(other.cache))
    out = {"cache": drift.aggregate(rows), "logits": drift.logit_summary(ref.logits, other.logits)}
    if per_tensor:
        out["tensors"] = rows
    return out


def exp1_row(spec: RunSpec, problem: Problem) -> dict:
    """Experiment 1 for one problem: the matched four-arm matrix (paper §3.5).

    Arms: ``live`` (the cache kept from greedy decoding to the boundary),
    ``live_replica`` (deep copy, verified), ``prefill`` (one call over z) and
    ``prefill_replica`` (an independent second call). All four continue
    through :func:`kvreplay.decode.decode_suffix`.

    Returns:
        The ledger record; on a gate failure, a record with ``gate_failure``
        ``{"gate", "reason"}`` and the prefix if it was reached.
    """
    lm, fmt = spec.lm, spec.fmt
    rec: dict = {"problem_id": problem.problem_id, "gate_failure": None}
    try:
        prompt = fmt.prompt_ids(problem.question, problem.options)
        live = decode.decode_live(lm, fmt, prompt, spec.caps)
        z = live.ids
        rec.update(prompt_len=len(prompt), prefix_len=len(z), prefix=z, schedule_calls=len(live.schedule))
        states = {
            "live": live,
            "live_replica": caches.live_replica(live),
            "prefill": decode.build_prefill(lm, fmt, z, where=problem.problem_id),
        }
        states["prefill_replica"] = decode.build_prefill(lm, fmt, z, where=problem.problem_id)
        states["prefill_replica"].construction = "prefill_replica"
        if spec.faults:
            spec.faults(states)
        boundary_gates(states, lm.dtype, [("live", "live_replica"), ("prefill", "prefill_replica")])
        rec["boundary"] = {
            "prefill_vs_live": comparison(live, states["prefill"], per_tensor=True),
            "live_replica": comparison(live, states["live_replica"], per_tensor=False),
            "prefill_replica": comparison(states["prefill"], states["prefill_replica"], per_tensor=False),
        }
        rec["first_token"] = {
            n: decode.first_eligible_argmax(fmt, s.logits[0]) for n, s in states.items()
        }
        rec["raw_argmax"] = {n: decode.raw_argmax(s.logits[0]) for n, s in states.items()}
        arms = {n: decode.decode_suffix(lm, fmt, s, spec.caps) for n, s in states.items()}
        for a, b in (("live", "live_replica"), ("prefill", "prefill_replica")):
            gates.check_equal_sequences("suffix_replica", f"{a} vs {b}", arms[a].tokens, arms[b].tokens)
        rec["arms"] = {n: _arm_record(spec, problem, s) for n, s in arms.items()}
        live_arm, pre_arm = rec["arms"]["live"], rec["arms"]["prefill"]
        rec["endpoints"] = {
            "boundary_exact": rec["boundary"]["prefill_vs_live"]["cache"]["exact"],
            "logits_exact": rec["boundary"]["prefill_vs_live"]["logits"]["exact"],
            "first_token_agree": rec["first_token"]["live"] == rec["first_token"]["prefill"],
            "suffix_differs": arms["live"].tokens != arms["prefill"].tokens,
            "merge_differs": arms["live"].merge != arms["prefill"].merge,
            "answer_differs": arms["live"].answer != arms["prefill"].answer,
            "label_differs": live_arm["correct"] != pre_arm["correct"],
            "first_divergence": first_divergence(arms["live"].tokens, arms["prefill"].tokens),
        }
    except GateError as e:
        rec["gate_failure"] = {"gate": e.gate, "reason": e.reason}
    return rec


def require_gates(records: Sequence[dict]) -> None:
    """Refuse to report endpoints unless every row passed every gate (gates are conjunctive).

    Raises:
        GateError: gate ``report``, naming the failed rows and their gates.
    """
    failed = [(r["problem_id"], r["gate_failure"]["gate"]) for r in records if r.get("gate_failure")]
    if failed:
        raise GateError("report", f"{len(failed)} row(s) failed integrity gates, endpoints withheld: {failed}")


def _rate(k: int, n: int) -> str:
    return wilson(k, n).pct() if n else "n/a"


def exp1_summary(records: Sequence[dict], dtype: str, seed: int = 20260729, n_resamples: int = 20000) -> dict:
    """Experiment 1 endpoints for one precision (paper §4.1), from ledger records alone.

    Returns:
        dict of counts, Wilson intervals (as :class:`~kvreplay.stats.Proportion`),
        the live-vs-prefill accuracy difference (prefill minus live, bootstrap),
        McNemar on correctness, first-divergence median/range and drift.

    Raises:
        GateError: if any row failed a gate.
    """
    require_gates(records)
    n = len(records)
    ep = [r["endpoints"] for r in records]
    live_c = [r["arms"]["live"]["correct"] for r in records]
    pre_c = [r["arms"]["prefill"]["correct"] for r in records]
    firsts = [e["first_divergence"] for e in ep if e["first_divergence"] is not None]
    drifts = [r["boundary"]["prefill_vs_live"]["cache"]["rel_l2"] for r in records]
    replicas_exact = sum(
        r["boundary"]["live_replica"]["cache"]["exact"] and r["boundary"]["prefill_replica"]["cache"]["exact"]
        for r in records
    )
    return {
        "dtype": dtype,
        "n": n,
        "replicas_exact": replicas_exact,
        "boundary_non_exact": sum(not e["boundary_exact"] for e in ep),
        "first_token_agree": sum(e["first_token_agree"] for e in ep),
        "suffix": wilson(sum(e["suffix_differs"] for e in ep), n),
        "merge": wilson(sum(e["merge_differs"] for e in ep), n),
        "answer": wilson(sum(e["answer_differs"] for e in ep), n),
        "label": wilson(sum(e["label_differs"] for e in ep), n),
        "first_divergence_median": statistics.median(firsts) if firsts else None,
        "first_divergence_range": (min(firsts), max(firsts)) if firsts else None,
        "first_divergence_quartiles": statistics.quantiles(firsts, n=4) if len(firsts) >= 2 else None,
        "accuracy_live": sum(live_c),
        "accuracy_prefill": sum(pre_c),
        "accuracy_diff": paired_bootstrap(live_c, pre_c, n_resamples=n_resamples, seed=seed) if n >= 2 else None,
        "mcnemar": mcnemar_exact(live_c, pre_c),
        "drift_median": statistics.median(drifts),
        "drift_range": (min(drifts), max(drifts)),
        "prefix_len_range": (min(r["prefix_len"] for r in records), max(r["prefix_len"] for r in records)),
    }


def exp1_table(summaries: Sequence[dict], cross_precision_identical: tuple[int, int] | None) -> pd.DataFrame:
    """Experiment 1 results table in the paper's terms, one column per precision."""
    rows: dict[str, dict] = {}
    for s in summaries:
        col = s["dtype"]
        n = s["n"]
        d = s["accuracy_diff"]
        mc = s["mcnemar"]
        rows.setdefault("rows", {})[col] = str(n)
        rows.setdefault("prefix length (tokens)", {})[col] = f"{s['prefix_len_range'][0]}–{s['prefix_len_range'][1]}"
        rows.setdefault("replica pairs exact", {})[col] = f"{s['replicas_exact']}/{n}"
        rows.setdefault("boundary cache non-bit-exact", {})[col] = f"{s['boundary_non_exact']}/{n}"
        rows.setdefault("first eligible argmax agrees", {})[col] = f"{s['first_token_agree']}/{n}"
        rows.setdefault("median relative L2 cache drift [range]", {})[col] = (
            f"{s['drift_median']:.3g} [{s['drift_range'][0]:.3g}, {s['drift_range'][1]:.3g}]"
        )
        for key, label in (("suffix", "suffix differs"), ("merge", "merge differs"), ("answer", "answer differs"),
                           ("label", "correctness label differs")):
            rows.setdefault(label, {})[col] = s[key].pct()
        fd = s["first_divergence_median"]
        rows.setdefault("first divergence, tokens after boundary: median (range)", {})[col] = (
            f"{fd:g} ({s['first_divergence_range'][0]}–{s['first_divergence_range'][1]})" if fd is not None else "none"
        )
        rows.setdefault("accuracy live / prefill", {})[col] = f"{s['accuracy_live']}/{n} vs {s['accuracy_prefill']}/{n}"
        rows.setdefault("prefill − live accuracy, pts [95% bootstrap CI]", {})[col] = (
            f"{100 * d.estimate:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]" if d else "n/a"
        )
        rows.setdefault("McNemar (live-only vs prefill-only correct), exact p", {})[col] = (
            f"{mc.b} vs {mc.c}, p = {mc.pvalue:.3g}"
        )
    if cross_precision_identical is not None:
        k, n = cross_precision_identical
        for col in rows["rows"]:
            rows.setdefault("boundary prefix token-identical across precisions", {})[col] = f"{k}/{n}"
    return pd.DataFrame(rows).T


def write_prefix_bank(records: Sequence[dict], path: str | Path, source_ledger: str) -> str:
    """Write the BF16 boundary-prefix bank Experiments 2–4 read (paper §3.6).

    One JSON line per problem in frozen order: ``problem_id``, ``prompt_len``,
    ``prefix`` (token IDs of z). A manifest ``<path>.manifest.json`` records
    its sha256 and the ledger it came from.

    Returns:
        the bank's sha256.

    Raises:
        GateError: if a record has no prefix (a failed row).
    """
    import hashlib

    lines = []
    for r in records:
        if "prefix" not in r:
            raise GateError("report", f"row {r['problem_id']} has no boundary prefix; cannot write the prefix bank")
        lines.append(canonical_json({"problem_id": r["problem_id"], "prompt_len": r["prompt_len"], "prefix": r["prefix"]}))
    data = ("\n".join(lines) + "\n").encode()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    manifest = {"sha256": digest, "rows": len(lines), "source_ledger": source_ledger}
    Path(str(path) + ".manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return digest


# ----------------------------------------------------------------------------- running an experiment


def model_key(model: str) -> dict:
    """Cheap identity of a model for ledger keys, computed without loading it.

    The embedded model is keyed by its pinned GGUF digest; a ``.gguf`` file
    by its sha256; a local folder by the sha256 of each file in it.

    Raises:
        ModelLoadError: for an unknown path.
    """
    from .models import EMBEDDED, EMBEDDED_SHA256, ModelLoadError, file_sha256

    if model == EMBEDDED:
        return {"model": EMBEDDED, "sha256": EMBEDDED_SHA256}
    p = Path(model)
    if p.is_file():
        return {"model": str(model), "sha256": file_sha256(p)}
    if p.is_dir():
        return {"model": p.name, "files": {f.name: file_sha256(f) for f in sorted(p.iterdir()) if f.is_file()}}
    if "/" in model and not model.startswith((".", "/")):
        return {"model": model}  # a hub id: must already be in the local cache
    raise ModelLoadError(f"unknown model {model!r}: not 'embedded', a local folder, a .gguf file, or a hub id")


def problems_digest(problems: Sequence[Problem]) -> str:
    """sha256 of the problems' content in frozen order."""
    import hashlib

    payload = [[p.problem_id, p.question, list(p.options), p.answer] for p in problems]
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


def run_experiment1(
    problems: Sequence[Problem],
    *,
    profile: str,
    dtype: str,
    caps: Caps,
    model: str = "embedded",
    fmt: str = "chat_multibranch",
    role_table: str | None = None,
    threads: int = 2,
    sdpa_backends: Sequence[str] = ("math",),
    preflight: int = 1,
    ledger_root: str | Path,
    progress: bool = True,
    faults: Hook | None = None,
) -> tuple[list[dict], "Ledger"]:
    """Run (or resume, or reuse) Experiment 1 at one precision; returns its records and ledger.

    A ledger already complete for this scientific config is read without
    loading the model.

    Raises:
        GateError: ``preflight`` if a preflight row fails a gate.
        ModelLoadError, ContractError: bad model or problems, before any row.
    """
    from .contract import load_spec
    from .ledger import Ledger, run_rows
    from .models import execution_contract, load_model

    config = {
        "experiment": "exp1",
        "profile": profile,
        "dtype": dtype,
        "caps": dataclasses.asdict(caps),
        "model": model_key(model),
        "role_table": model_key(role_table) if role_table else None,
        "format": load_spec(fmt),
        "problems_sha256": problems_digest(problems),
        "problem_ids": [p.problem_id for p in problems],
        "threads": threads,
        "sdpa_backends": list(sdpa_backends),
        "preflight": preflight,
        "batch": decode.BATCH,
    }
    root = Path(ledger_root) / profile
    ids = [p.problem_id for p in problems]
    probe = Ledger(root, f"exp1-{dtype}", config)
    if probe.complete(ids):
        by_id = {r["problem_id"]: r for r in probe.records()}
        return [by_id[i] for i in ids], probe
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    lm = load_model(model, dtype, role_table=role_table, sdpa_backends=tuple(sdpa_backends))
    from .contract import resolve_format

    bf = resolve_format(lm.tokenizer, fmt)
    check_prompts(bf, problems)
    ledger = Ledger(root, f"exp1-{dtype}", config, environment=execution_contract(lm, threads) | {"format_digest": bf.digest})
    spec = RunSpec(lm=lm, fmt=bf, caps=caps, faults=faults)
    records = run_rows(
        ledger, list(problems), lambda p: exp1_row(spec, p), key=lambda p: p.problem_id,
        preflight=preflight, progress=progress, desc=f"Experiment 1 {dtype}",
    )
    return records, ledger
