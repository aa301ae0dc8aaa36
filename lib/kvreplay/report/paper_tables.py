"""The paper's own tables beside ours: related work, role visibility, numerical contract, setup, run against paper, artifact map.

The paper's numbers are data (``data/paper/reference.yaml``; Table 1 in
``data/paper/related_work.yaml``; the artifact map's rows in
``data/paper/artifacts.yaml``); this module only joins them with a
profile's ledgers and summaries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from ..arm_facts import ARM_FACTS
from ..decoding.contract import visibility_table
from ..experiments.endpoints import rate_text
from ..ledger.lookup import LEDGER_SPECS, LoadedLedger, ProfileLedgers
from ..paths import DATA

PAPER_DATA = DATA / "paper"


REFERENCE = PAPER_DATA / "reference.yaml"


RELATED_WORK = PAPER_DATA / "related_work.yaml"


def load_reference(path: str | Path = REFERENCE) -> dict:
    """The paper's reported numbers and setup (``data/paper/reference.yaml``)."""
    return yaml.safe_load(Path(path).read_text(encoding="utf-8"))


def related_work_table(path: str | Path = RELATED_WORK) -> pd.DataFrame:
    """Table 1: related-work overlap and separation, from ``data/paper/related_work.yaml``."""
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    return pd.DataFrame(data["works"]).set_index("work")


def visibility_frame() -> pd.DataFrame:
    """Table 2: role visibility, generated from :func:`kvreplay.decoding.contract.visibility_table` (never typed)."""
    return pd.DataFrame(visibility_table()).set_index("query role")


def _dataset(problem_ids: Sequence[str]) -> str:
    names = sorted({i.split("-", 1)[0] for i in problem_ids})
    return "/".join(n.upper() if n == "mmlu" else n for n in names)


def _short(digest: str | None, n: int = 16) -> str:
    return f"{digest[:n]}…" if digest else "—"


def _cache_geometry(ledger: LoadedLedger) -> str:
    for r in ledger.records:
        for cmp in r.get("boundary", {}).values():
            if "tensors" in cmp and cmp["tensors"]:
                g = cmp["tensors"][0]["ref_geometry"]
                shape = list(g["shape"])
                shape[2] = "|z|"
                return f"[{', '.join(map(str, shape))}] per layer, K and V; {g['dtype']} on {g['device']}"
    m = ledger.contract.get("model", {})
    if m.get("kv_heads") and m.get("head_dim"):
        return f"[{ledger.config['batch']}, {m['kv_heads']}, |z|, {m['head_dim']}] per layer, K and V (from the model)"
    return "—"


CONTRACT_ROWS = (
    ("ledger", "ledger folder"),
    ("dtype", "dtype"),
    ("model", "model"),
    ("geometry", "layers; KV heads; head dim"),
    ("cache_tensor", "boundary cache tensor"),
    ("model_sha256", "model file sha256 (first 16 hex)"),
    ("weights_sha256", "loaded weights sha256, this dtype (first 16 hex)"),
    ("role_table", "role table"),
    ("format", "block format (digest, first 16 hex)"),
    ("problems", "problems (sha256, first 16 hex)"),
    ("prefix_bank", "BF16 prefix bank sha256 (first 16 hex)"),
    ("caps", "caps branch / merge / answer"),
    ("batch", "physical batch (duplicate copies)"),
    ("preflight", "preflight rows"),
    ("versions", "torch / transformers / python"),
    ("device", "device"),
    ("attention", "attention implementation; SDPA backends used"),
    ("tf32", "TF32 matmul / cuDNN"),
    ("matmul_precision", "float32 matmul precision"),
    ("deterministic", "deterministic algorithms; CUBLAS workspace"),
    ("threads", "intra-op threads"),
    ("config_digest", "ledger config digest (first 16 hex)"),
    ("library", "library source sha256 (first 16 hex)"),
)
"""Table 3 rows: ``(key, label)``; keys index :func:`contract_column` and the paper column."""


def contract_column(ledger: LoadedLedger) -> dict[str, str]:
    """One ledger's column of Table 3 (numerical contract), from its manifest.json and environment.json."""
    c, e = ledger.config, ledger.contract
    m = e.get("model", {})
    caps = c["caps"]
    cfg_model = c.get("model", {})
    fmt = c.get("format", {})
    return {
        "ledger": ledger.dir.name,
        "dtype": c["dtype"],
        "model": f"{m.get('file') or m.get('model') or cfg_model.get('model')} ({m.get('architecture', '?')})",
        "geometry": f"{m.get('layers', '?')} layers; {m.get('kv_heads', '?')} KV heads; head dim {m.get('head_dim', '?')}",
        "cache_tensor": _cache_geometry(ledger),
        "model_sha256": _short(m.get("file_sha256") or cfg_model.get("sha256")),
        "weights_sha256": _short(m.get("weights_sha256")),
        "role_table": "none (stock model: zero role rows)" if c.get("role_table") is None else _short(m.get("role_table_sha256")),
        "format": f"{fmt.get('name', '?')} ({_short(e.get('format_digest'))})",
        "problems": f"{len(c['problem_ids'])} {_dataset(c['problem_ids'])} rows ({_short(c['problems_sha256'])})",
        "prefix_bank": _short(c.get("prefix_bank_sha256")),
        "caps": f"{caps['branch']} / {caps['merge']} / {caps['answer']}",
        "batch": str(c["batch"]),
        "preflight": str(c["preflight"]),
        "versions": f"{e.get('torch', '?')} / {e.get('transformers', '?')} / {e.get('python', '?')}",
        "device": f"{e.get('device', '?')} ({e.get('device_name', '?')})",
        "attention": f"{e.get('attn_implementation', '?')}; {', '.join(e.get('sdpa_backends_used', c.get('sdpa_backends', [])))}",
        "tf32": f"{e.get('tf32_matmul', '?')} / {e.get('tf32_cudnn', '?')}",
        "matmul_precision": str(e.get("float32_matmul_precision", "?")),
        "deterministic": f"{e.get('deterministic_algorithms', '?')}; {e.get('cublas_workspace_config')}",
        "threads": str(c["threads"]),
        "config_digest": _short(ledger.manifest["config_digest"]),
        "library": _short(ledger.environment.get("library_sha256")),
    }


def paper_contract_column(reference: dict) -> dict[str, str]:
    """The paper's column of Table 3, from ``reference.yaml``'s ``setup`` (— where the paper is silent or redacted)."""
    s = reference["setup"]
    caps = s["caps"]
    return {
        "dtype": s["precisions"],
        "model": s["model"],
        "geometry": f"{s['layers']} layers; {s['kv_heads']} KV heads; head dim {s['head_dim']}",
        "cache_tensor": f"[{s['batch']}, {s['kv_heads']}, |z|, {s['head_dim']}] per layer, K and V",
        "role_table": s["role_table"],
        "problems": f"{s['rows']['exp1']} {s['dataset']} rows",
        "caps": f"{caps['branch']} / {caps['merge']} / {caps['answer']}",
        "batch": str(s["batch"]),
        "preflight": f"{s['preflight']['exp1']} (Exp 1), {s['preflight']['exp2']} (Exp 2)",
        "device": s["hardware"],
        "attention": s["attention"],
    }


def contract_table(profile_ledgers: ProfileLedgers, reference: dict) -> pd.DataFrame:
    """Table 3: the numerical contract of every ledger of the run, beside the paper's."""
    paper = paper_contract_column(reference)
    cols = {"paper": {label: paper.get(key, "—") for key, label in CONTRACT_ROWS}}
    for k, ledger in profile_ledgers.ledgers.items():
        col = contract_column(ledger)
        cols[k] = {label: col[key] for key, label in CONTRACT_ROWS}
    return pd.DataFrame(cols)


def _reduction(cross: dict, key: str) -> str:
    c, m = cross[key]["change"], cross[key]["mcnemar"]
    red = lambda x: -100 * x + 0.0  # noqa: E731  (the paper's sign: BF16 minus FP32; + 0.0 turns -0.0 into 0.0)
    ci = f"{red(c.estimate):.1f} [{red(c.high):.1f}, {red(c.low):.1f}]" if c else "n/a"
    return f"{ci}; p = {m.pvalue:.3g}"


def _first_divergence_text(s: dict) -> str:
    if s["first_divergence_median"] is None:
        return "no divergence"
    lo, hi = s["first_divergence_range"]
    return f"median {s['first_divergence_median']:g} (range {lo}-{hi})"


def _acc_diff(s: dict) -> str:
    d = s["accuracy_diff"]
    return f"{100 * d.estimate:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]" if d else "n/a"


def _both(results: dict, exp: str, f: Callable[[dict], str]) -> str:
    return "; ".join(f"{d} {f(s)}" for d, s in results[exp].items())


def _count_text(k, n) -> str:
    return f"{k}/{n}"


def _unmet_text(summary: dict) -> str:
    """``""``, or ``" + k whose argmax precondition was unmet: <ids>"`` for rows left out of the transplant endpoints."""
    if not summary["ineligible"]:
        return ""
    ids = ", ".join(r["problem_id"] for r in summary["ineligible"])
    return f" + {len(summary['ineligible'])} whose argmax precondition was unmet, left out: {ids}"


def _unmet_divergence_text(summary: dict) -> str:
    """``""``, or the divergence over the whole panel with the rows whose precondition was unmet counted either way."""
    u = len(summary["ineligible"])
    if not u:
        return ""
    k, n = summary["divergent"], summary["rows"] + u
    return f"; over all {n} panel rows {k}/{n} to {k + u}/{n} (the {u} left out, unmet argmax precondition, not / all divergent)"


def _transplant_rate(t: dict, pick: Callable[[dict], Any]) -> str:
    """An Experiment 4 rate (``pick`` of the summary) by the profile's ``exp4_precondition_failures`` rule: with rows
    whose precondition was unmet, left out, counted as failures, or both (``report_both``)."""
    left, counted = rate_text(pick(t)), rate_text(pick(t["counted_as_failure"]))
    if not t["ineligible"] or left == counted:
        return left
    return {"left_out": f"{left} (unmet precondition left out)",
            "counted_as_failure": f"{counted} (unmet precondition counted as a failure)",
            "report_both": f"{left} left out; {counted} counted as a failure"}[t["precondition_failures"]]


def _leaves_agree(audit: dict, kind: str) -> str:
    leaves = ", ".join(map(str, audit[f"{kind}_leaves"]))
    return f"{leaves} leaves; {_count_text(audit[f'{kind}_leaves_agree_rows'], audit['rows'])}"


RUN_VALUES: dict[str, Callable[[dict], str]] = {
    "exp1.replicas_exact": lambda R: _both(R, "exp1", lambda s: _count_text(s["replicas_exact"], s["n"])),
    "exp1.bf16.boundary_non_exact": lambda R: _count_text(R["exp1"]["bfloat16"]["boundary_non_exact"], R["exp1"]["bfloat16"]["n"]),
    "exp1.bf16.first_token_agree": lambda R: _count_text(R["exp1"]["bfloat16"]["first_token_agree"], R["exp1"]["bfloat16"]["n"]),
    "exp1.bf16.suffix": lambda R: R["exp1"]["bfloat16"]["suffix"].pct(),
    "exp1.bf16.answer": lambda R: R["exp1"]["bfloat16"]["answer"].pct(),
    "exp1.bf16.label": lambda R: R["exp1"]["bfloat16"]["label"].pct(),
    "exp1.bf16.first_divergence": lambda R: _first_divergence_text(R["exp1"]["bfloat16"]),
    "exp1.bf16.accuracy": lambda R: (lambda s: f"{s['accuracy_ref']}/{s['n']} vs {s['accuracy_prefill']}/{s['n']}")(R["exp1"]["bfloat16"]),
    "exp1.bf16.accuracy_diff": lambda R: _acc_diff(R["exp1"]["bfloat16"]),
    "exp1.bf16.mcnemar": lambda R: (lambda m: f"{m.b} vs {m.c}, p = {m.pvalue:.3g}")(R["exp1"]["bfloat16"]["mcnemar"]),
    "exp1.fp32.decoded": lambda R: (lambda s: f"{s['suffix'].k} / {s['answer'].k} / {s['label'].k} of {s['n']}")(R["exp1"]["float32"]),
    "exp1.cross_precision_prefix": lambda R: _count_text(*R["exp1_cross"]),
    "exp2.prefix_identical": lambda R: _count_text(R["crossing"]["prefix_identical"], R["crossing"]["n"]),
    "exp2.prefix_len": lambda R: "{}-{}".format(*R["exp2"]["bfloat16"]["prefix_len_range"]),
    "exp2.replicas_exact": lambda R: _both(R, "exp2", lambda s: _count_text(s["replicas_exact"], s["n"])),
    "exp2.bf16.suffix": lambda R: _count_text(R["exp2"]["bfloat16"]["suffix"].k, R["exp2"]["bfloat16"]["n"]),
    "exp2.bf16.answer": lambda R: _count_text(R["exp2"]["bfloat16"]["answer"].k, R["exp2"]["bfloat16"]["n"]),
    "exp2.bf16.label": lambda R: _count_text(R["exp2"]["bfloat16"]["label"].k, R["exp2"]["bfloat16"]["n"]),
    "exp2.fp32.suffix": lambda R: R["exp2"]["float32"]["suffix"].pct(),
    "exp2.fp32.answer": lambda R: R["exp2"]["float32"]["answer"].pct(),
    "exp2.fp32.label": lambda R: R["exp2"]["float32"]["label"].pct(),
    "exp2.reduction.suffix": lambda R: _reduction(R["crossing"], "suffix"),
    "exp2.reduction.answer": lambda R: _reduction(R["crossing"], "answer"),
    "exp2.reduction.label": lambda R: _reduction(R["crossing"], "label"),
    "exp2.accuracy": lambda R: _both(R, "exp2", lambda s: f"{s['accuracy_ref']}/{s['n']} vs {s['accuracy_prefill']}/{s['n']}"),
    "exp2.drift": lambda R: _both(R, "exp2", lambda s: f"{s['drift_median']:.4g}"),
    "exp3.bridge.layers_exact": lambda R: _count_text(R["bridge"]["layers_exact"], R["bridge"]["n"]),
    "exp3.bridge.logits_exact": lambda R: _count_text(R["bridge"]["logits_exact"], R["bridge"]["n"]),
    "exp3.bridge.suffix_exact": lambda R: _count_text(R["bridge"]["suffix_exact"], R["bridge"]["n"]),
    "exp3.bridge.prefix_len": lambda R: "{}-{}".format(*R["bridge"]["prefix_len_range"]),
    "exp3.bridge.same_as_saved": lambda R: _count_text(R["bridge"]["same_as_saved"], R["bridge"]["n"]),
    "exp3.audit.order": lambda R: f"{'yes' if R['audit']['order_agrees'] else 'no'} ({R['audit']['rows']} rows)",
    "exp3.audit.suffix": lambda R: _count_text(min(R["audit"]["suffix_agrees"].values()), R["audit"]["rows"]),
    "exp3.audit.cache_leaves": lambda R: _leaves_agree(R["audit"], "cache"),
    "exp3.audit.logit_leaves": lambda R: _leaves_agree(R["audit"], "logit"),
    "exp4.panel": lambda R: (lambda t: f"{t['rows'] + len(t['ineligible'])} ({t['divergent']} + {t['exact']}, contemporaneous "
                             f"strata{_unmet_text(t)})")(R["transplant"]),
    "exp4.gates": lambda R: _count_text(R["transplant"]["rows"], R["transplant"]["rows"] + len(R["transplant"]["ineligible"])),
    "exp4.recovery.prefill_from_incremental": lambda R: _transplant_rate(R["transplant"], lambda t: t["recovery"]["prefill<-incremental"]),
    "exp4.recovery.incremental_from_prefill": lambda R: _transplant_rate(R["transplant"], lambda t: t["recovery"]["incremental<-prefill"]),
    "exp4.joint_recovery": lambda R: _transplant_rate(R["transplant"], lambda t: t["joint_recovery"]),
    "exp4.third_among_exact": lambda R: _transplant_rate(R["transplant"], lambda t: t["third_among_exact"]),
    "exp5.divergence": lambda R: R["replication"]["divergence"].pct() + _unmet_divergence_text(R["replication"]),
    "exp5.joint_recovery": lambda R: rate_text(R["replication"]["joint_recovery"]),
    "exp5.third_among_exact": lambda R: rate_text(R["replication"]["third_among_exact"]),
    "exp5.interpretation": lambda R: (lambda i, j: f"{i.label} (thresholds ≥ {i.min_divergent} divergent, ≥ {i.min_exact} "
                                                   f"exact, as the paper; n = {i.n}); scaled to the panel: {j.label}")(
        R["replication"]["interpretation"], R["replication"]["interpretation_scaled"]),
}
"""Reference endpoint id (``reference.yaml``) -> this run's value, from :func:`kvreplay.report.summary.summarize`'s results."""


NOT_RUN = "not run here"


def run_value(results: dict, endpoint_id: str) -> str:
    """This run's value of one reference endpoint, or :data:`NOT_RUN` (no ledger for it, e.g. Experiment 5)."""
    f = RUN_VALUES.get(endpoint_id)
    if f is None:
        return NOT_RUN
    try:
        return f(results)
    except (KeyError, TypeError):  # a precision or experiment this profile did not run
        return NOT_RUN


def setup_of_run(profile_ledgers: ProfileLedgers) -> dict:
    """What this run used (model, data, caps, hardware), read from the Experiment 1 BF16 manifest and environment."""
    ledger = profile_ledgers["exp1-bfloat16"]
    c, e = ledger.config, ledger.contract
    m = e.get("model", {})
    return {
        "model": m.get("file") or m.get("model") or c["model"].get("model"),
        "geometry": f"{m.get('layers', '?')} layers, {m.get('kv_heads', '?')} KV heads, head dim {m.get('head_dim', '?')}",
        "dataset": _dataset(c["problem_ids"]),
        "caps": c["caps"],
        "hardware": f"{e.get('device', '?')} ({e.get('device_name', '?')}), {c['threads']} threads, SDPA {'/'.join(c['sdpa_backends'])}",
        "precisions": ", ".join(profile_ledgers.precisions),
        "rows": {key: len(profile_ledgers.records(label)) for key, _, label in setup_rows()},
    }


def setup_table(profile_ledgers: ProfileLedgers, reference: dict) -> pd.DataFrame:
    """The setups side by side (model, data, caps, hardware, precisions, rows per experiment)."""
    run, paper = setup_of_run(profile_ledgers), reference["setup"]
    caps = lambda c: f"{c['branch']} / {c['merge']} / {c['answer']}"  # noqa: E731
    rows = {
        "model": (f"{paper['model']} ({paper['layers']} layers, {paper['kv_heads']} KV heads, head dim {paper['head_dim']})",
                  f"{run['model']} ({run['geometry']})"),
        "data": (paper["dataset"], run["dataset"]),
        "caps branch / merge / answer": (caps(paper["caps"]), caps(run["caps"])),
        "hardware": (f"{paper['hardware']}; {paper['attention']}", run["hardware"]),
        "precisions": (paper["precisions"], run["precisions"]),
    }
    for k, label, _ in setup_rows():
        rows[label] = (str(paper["rows"].get(k, "—")), str(run["rows"].get(k, NOT_RUN)))
    return pd.DataFrame(rows, index=["paper", "this run"]).T


def setup_rows() -> list[tuple[str, str, str]]:
    """The setup table's row counts, ``(reference key, line label, ledger label)``, from each paper experiment's
    :attr:`~kvreplay.arm_facts.ArmFacts.paper_rows` in chain order (``("exp3_audit", "rows, Exp 3 audit",
    "exp1-bfloat16")``)."""
    return [(key, f"rows, Exp {f.paper} {part}".rstrip(), label) for f in ARM_FACTS.values() if f.paper is not None
            for key, part, label in f.paper_rows]


def what_differs(experiment: int, run: dict, paper: dict) -> str:
    """Short note of what separates this run from the paper for one experiment's endpoints (by the paper's number,
    :attr:`~kvreplay.arm_facts.ArmFacts.paper`)."""
    declared = [f for f in ARM_FACTS.values() if f.paper == experiment]
    if not declared:
        return f"experiment {experiment} not built yet"
    (f,) = declared
    parts = []
    if str(run["model"]) != paper["model"]:
        parts.append(f"model ({run['model']} vs {paper['model_short']})")

    def count(rows: dict) -> str:
        if len(f.paper_rows) == 1:
            return str(rows[f.paper_rows[0][0]])
        return " / ".join(f"{rows[key]} {part}" for key, part, _ in f.paper_rows)

    n_run, n_pap = count(run["rows"]), count(paper["rows"])
    if run["dataset"] != paper["dataset"] or n_run != n_pap:
        parts.append(f"data ({n_run} {run['dataset']} vs {n_pap} {paper['dataset']} rows)")
    rc, pc = run["caps"], paper["caps"]
    if rc != pc:
        parts.append(f"caps ({rc['branch']}/{rc['merge']}/{rc['answer']} vs {pc['branch']}/{pc['merge']}/{pc['answer']})")
    parts.append(f"hardware ({run['hardware']} vs {paper['hardware']})")
    if f.paper_note is not None:
        parts.append(f.paper_note)
    return "; ".join(parts)


def vs_paper_table(profile_ledgers: ProfileLedgers, results: dict, reference: dict) -> pd.DataFrame:
    """Each endpoint's value in the paper and in this run, with what differs between the two setups."""
    run = setup_of_run(profile_ledgers)
    rows = []
    for e in reference["endpoints"]:
        rows.append({
            "id": e["id"], "experiment": e["experiment"], "endpoint": e["endpoint"], "paper": e["paper"],
            "this run": run_value(results, e["id"]), "what differs": what_differs(e["experiment"], run, reference["setup"]),
        })
    return pd.DataFrame(rows).set_index("id")


ARTIFACTS_FILE = PAPER_DATA / "artifacts.yaml"
"""The artifact map's rows as data: id, ledgers, record fields, computing function (under ``kvreplay``), outputs."""


def load_artifacts(path: str | Path = ARTIFACTS_FILE) -> list[dict]:
    """The artifact map's entries (``id``, optional ``statistic``, ``ledgers``, ``fields``, ``function``, ``table``).

    Raises:
        ValueError: an entry names a ledger key not in :data:`~kvreplay.ledger.lookup.LEDGER_SPECS`.
    """
    entries = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    for e in entries:
        unknown = [k for k in e["ledgers"] if k not in LEDGER_SPECS]
        if unknown:
            raise ValueError(f"{path}: entry {e['id']!r} names unknown ledgers {unknown}")
    return entries


def artifact_map(profile_ledgers: ProfileLedgers, reference: dict, tables_notebook: str, figures_notebook: str) -> pd.DataFrame:
    """Where every reported statistic comes from: ledger files and fields, function, outputs and notebooks.

    Ledger paths are relative to the ledger root; ``fig_*`` outputs are made by
    ``figures_notebook``, ``table*`` by ``tables_notebook``.
    """
    labels = {e["id"]: e["endpoint"] for e in reference["endpoints"]}
    artifacts = load_artifacts()
    rows = []
    for a in artifacts:
        files = []
        nbs = []
        for k in a["ledgers"]:
            ledger = profile_ledgers.ledgers.get(k)
            files.append(f"{profile_ledgers.profile}/{ledger.dir.name}/{ledger.rows_path.name}" if ledger else f"{k}-* (not run)")
            nb = f"notebooks/{LEDGER_SPECS[k].notebook}"
            if nb not in nbs:
                nbs.append(nb)
        outs = [t.strip() for t in a["table"].split(",")]
        made_by = sorted({figures_notebook if o.startswith("fig_") else tables_notebook for o in outs})
        rows.append({
            "id": a["id"],
            "statistic": a.get("statistic") or labels.get(a["id"], a["id"]),
            "ledger files": "; ".join(files) if files else "—",
            "record fields": a["fields"],
            "computed by": f"kvreplay.{a['function']}",
            "output (figures/<profile>/)": ", ".join(outs),
            "reproduced by": "; ".join(made_by),
            "ledger written by": "; ".join(nbs) if nbs else "—",
        })
    for e in reference["endpoints"]:
        if e["id"] not in {a["id"] for a in artifacts}:
            rows.append({"id": e["id"], "statistic": e["endpoint"], "ledger files": "— (not run here)", "record fields": "—",
                         "computed by": "—", "output (figures/<profile>/)": "table_vs_paper", "reproduced by": tables_notebook,
                         "ledger written by": "—"})
    return pd.DataFrame(rows).set_index("id")
