"""Paper assembly from ledgers alone: tables, figure data, the artifact map and the drift explorer.

Notebooks 06 (tables) and 07 (figures) load no model: everything they show is
recomputed from a profile's finished ledgers with the same summary functions
the experiment notebooks use (:mod:`kvreplay.experiments`, :mod:`kvreplay.replication`).
Notebook 08 (the drift explorer) also reads the ledgers, and can rebuild the boundary caches of
one row on demand (:func:`load_for_ledger`, :func:`rebuild_pair`).

Ledgers are found by folder name, ``<ledger_root>/<profile>/<experiment>-<dtype>-<digest12>/``
(:data:`LEDGER_SPECS`). When a profile holds several folders for one
experiment (an older config left behind), the one that belongs to the current
chain is chosen by provenance, never by date: Experiment 1 BF16 is the ledger
the prefix bank names as its source; Experiment 1 FP32 has the same config
except its dtype; Experiments 2–5 carry the prefix bank's sha256 in their
config. A missing, incomplete or ambiguous ledger raises
:class:`MissingLedgerError` naming the notebook that writes it.

The paper's own numbers live in one data file, ``data/paper/reference.yaml``;
Table 1 (related work) in ``data/paper/related_work.yaml``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pandas as pd
import yaml

from .contract import visibility_table
from .experiments import (  # noqa: F401  (bridge/audit/transplant tables are re-exported)
    DIRECTIONS, rate_text, audit_table, bridge_summary, bridge_table, crossing_table, localization_table, matrix_summary, matrix_table, precision_crossing, require_gates, saved_ledger_audit, transplant_summary, transplant_table,
)
from .ledger import canonical_json
from .paths import DATA
from .replication import accuracy_table as replication_accuracy_table
from .replication import accuracy_vs_checkpoint0, describe_checkpoint, replication_summary, replication_table
from .stats import wilson

PAPER_DATA = DATA / "paper"
REFERENCE = PAPER_DATA / "reference.yaml"
RELATED_WORK = PAPER_DATA / "related_work.yaml"
PREFIX_BANK = "prefix_bank_bf16.jsonl"


class MissingLedgerError(FileNotFoundError):
    """A ledger the assembly needs is absent, unfinished or ambiguous; the message names the notebook to run."""


# ----------------------------------------------------------------------------- finding and loading ledgers


@dataclasses.dataclass(frozen=True)
class LedgerSpec:
    """Which ledger an assembly needs and which notebook writes it.

    Attributes:
        experiment: folder-name prefix (``exp1`` ... ``exp5``).
        dtype: ``bfloat16`` or ``float32``.
        notebook: the notebook that writes it (under ``notebooks/``).
        what: one line for error messages and the artifact map.
    """

    experiment: str
    dtype: str
    notebook: str
    what: str

    @property
    def key(self) -> str:
        return f"{self.experiment}-{self.dtype}"


_NB = {
    "exp1": "01_experiment1_live_vs_prefill.ipynb",
    "exp2": "02_experiment2_fixed_prefix_precision.ipynb",
    "exp3": "03_experiment3_bridge_and_audit.ipynb",
    "exp4": "04_experiment4_cache_transplant.ipynb",
    "exp5": "05_experiment5_replication.ipynb",
}
LEDGER_SPECS: dict[str, LedgerSpec] = {
    s.key: s
    for s in (
        LedgerSpec("exp1", "bfloat16", _NB["exp1"], "Experiment 1, live/prefill matrix, BF16"),
        LedgerSpec("exp1", "float32", _NB["exp1"], "Experiment 1, live/prefill matrix, FP32"),
        LedgerSpec("exp2", "bfloat16", _NB["exp2"], "Experiment 2, fixed-prefix matrix, BF16"),
        LedgerSpec("exp2", "float32", _NB["exp2"], "Experiment 2, fixed-prefix matrix, FP32"),
        LedgerSpec("exp3", "bfloat16", _NB["exp3"], "Experiment 3, live/incremental bridge, BF16"),
        LedgerSpec("exp4", "bfloat16", _NB["exp4"], "Experiment 4, cache transplants, BF16"),
        LedgerSpec("exp5", "bfloat16", _NB["exp5"], "Experiment 5, replication on a later checkpoint, BF16"),
    )
}
"""Every ledger the paper assembly reads, keyed ``<experiment>-<dtype>``."""


@dataclasses.dataclass
class LoadedLedger:
    """One finished ledger folder read from disk.

    Attributes:
        key: ``<experiment>-<dtype>`` (a :data:`LEDGER_SPECS` key).
        dir: the folder.
        manifest: ``manifest.json`` (``schema_version``, ``name``, ``config_digest``, ``config``).
        environment: ``environment.json`` (``execution_contract``, ``library_sha256``), ``{}`` if absent.
        records: the rows, in the config's frozen ``problem_ids`` order.
    """

    key: str
    dir: Path
    manifest: dict
    environment: dict
    records: list[dict]

    @property
    def config(self) -> dict:
        return self.manifest["config"]

    @property
    def contract(self) -> dict:
        """The execution contract recorded when the ledger was written."""
        return self.environment.get("execution_contract", {})

    @property
    def rows_path(self) -> Path:
        return self.dir / "rows.jsonl"


def _read_rows(folder: Path) -> list[dict]:
    path = folder / "rows.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # a row cut off mid-write: the ledger is unfinished, not corrupt
                break
            raise
    return out


def ledger_progress(folder: str | Path) -> tuple[int, int]:
    """``(finished, expected)`` rows of a ledger folder: records present for the manifest's ``problem_ids``."""
    folder = Path(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    ids = manifest["config"]["problem_ids"]
    done = {r.get("problem_id") for r in _read_rows(folder)}
    return sum(i in done for i in ids), len(ids)


def read_ledger(folder: str | Path, key: str | None = None) -> LoadedLedger:
    """Read a ledger folder (manifest, environment, rows) with its rows in frozen order.

    Raises:
        MissingLedgerError: if the folder has no manifest or is unfinished.
    """
    folder = Path(folder)
    mpath = folder / "manifest.json"
    if not mpath.is_file():
        raise MissingLedgerError(f"{folder} is not a ledger (no manifest.json)")
    manifest = json.loads(mpath.read_text())
    epath = folder / "environment.json"
    env = json.loads(epath.read_text()) if epath.is_file() else {}
    by_id = {r["problem_id"]: r for r in _read_rows(folder)}
    ids = manifest["config"]["problem_ids"]
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise MissingLedgerError(f"ledger {folder} is unfinished: {len(ids) - len(missing)}/{len(ids)} rows")
    key = key or "-".join(folder.name.split("-")[:2])
    return LoadedLedger(key=key, dir=folder, manifest=manifest, environment=env, records=[by_id[i] for i in ids])


def _run_hint(spec: LedgerSpec, profile: str) -> str:
    return (f"run notebooks/{spec.notebook} for profile {profile!r} first "
            f"(make paper PROFILE={profile}, or papermill with -f notebooks/params/{profile}.yaml)")


def find_ledger(
    root: str | Path, profile: str, key: str, *, match: Callable[[dict], bool] | None = None, why: str = ""
) -> LoadedLedger:
    """The one finished ledger ``<root>/<profile>/<key>-*`` that belongs to the current chain.

    Args:
        root: the ledger root (``data/ledgers`` by default in the notebooks).
        profile: profile name (a folder under ``root``).
        key: a :data:`LEDGER_SPECS` key, e.g. ``"exp2-float32"``.
        match: optional predicate on a candidate's manifest (provenance); only
            finished candidates it accepts are kept.
        why: what ``match`` checks, for the error message.

    Raises:
        MissingLedgerError: no folder, none finished, none matching, or more
            than one matching; the message names the notebook that writes it.
    """
    spec = LEDGER_SPECS[key]
    base = Path(root) / profile
    folders = sorted(p for p in base.glob(f"{key}-*") if (p / "manifest.json").is_file())
    if not folders:
        raise MissingLedgerError(f"no {spec.what} ledger ({key}-*) under {base}: {_run_hint(spec, profile)}")
    progress = {p: ledger_progress(p) for p in folders}
    finished = [p for p in folders if progress[p][0] == progress[p][1]]
    if not finished:
        state = ", ".join(f"{p.name} {d}/{n} rows" for p, (d, n) in progress.items())
        raise MissingLedgerError(f"{spec.what} ledger under {base} is unfinished ({state}): {_run_hint(spec, profile)}")
    if match is not None:
        finished = [p for p in finished if match(json.loads((p / "manifest.json").read_text()))]
        if not finished:
            raise MissingLedgerError(
                f"no finished {spec.what} ledger under {base} matches {why or 'the chain'} "
                f"(found {[p.name for p in folders]}): {_run_hint(spec, profile)}"
            )
    if len(finished) > 1:
        raise MissingLedgerError(
            f"{len(finished)} finished {spec.what} ledgers under {base} match ({[p.name for p in finished]}); "
            f"move the stale ones away or {_run_hint(spec, profile)}"
        )
    return read_ledger(finished[0], key)


def _without(config: dict, *keys: str) -> dict:
    return {k: v for k, v in config.items() if k not in keys}


@dataclasses.dataclass
class ProfileLedgers:
    """A profile's finished ledgers for the paper assembly.

    Attributes:
        root: ledger root; profile: profile name.
        prefix_bank_sha256: sha256 of ``prefix_bank_bf16.jsonl`` (the BF16 prefixes Experiments 2–4 read).
        ledgers: :data:`LEDGER_SPECS` key -> :class:`LoadedLedger`.
    """

    root: Path
    profile: str
    prefix_bank_sha256: str
    ledgers: dict[str, LoadedLedger]

    def __getitem__(self, key: str) -> LoadedLedger:
        return self.ledgers[key]

    def records(self, key: str) -> list[dict]:
        return self.ledgers[key].records

    @property
    def precisions(self) -> list[str]:
        return [k.split("-", 1)[1] for k in self.ledgers if k.startswith("exp1-")]


def _bank(root: Path, profile: str) -> dict | None:
    path = root / profile / f"{PREFIX_BANK}.manifest.json"
    return json.loads(path.read_text()) if path.is_file() else None


def find_chain_ledger(root: str | Path, profile: str, key: str) -> LoadedLedger:
    """The finished ledger for ``key`` that belongs to the profile's current chain (provenance, not dates).

    Experiment 1 BF16 is the ledger the BF16 prefix bank names as its source
    (the only finished one if there is no bank yet); Experiment 1 at another
    precision has the same config as Experiment 1 BF16 except its dtype;
    Experiments 2–5 carry the bank's sha256 in their config.

    Raises:
        MissingLedgerError: naming the notebook that writes the missing ledger.
    """
    root = Path(root)
    spec = LEDGER_SPECS[key]
    bank = _bank(root, profile)
    if key == "exp1-bfloat16":
        if bank is None:
            return find_ledger(root, profile, key)
        source = bank["source_ledger"]
        return find_ledger(root, profile, key, match=lambda m: f"{m['name']}-{m['config_digest'][:12]}" == source,
                           why=f"the prefix bank's source ledger {source}")
    if spec.experiment == "exp1":
        base = _without(find_chain_ledger(root, profile, "exp1-bfloat16").config, "dtype")
        return find_ledger(root, profile, key, match=lambda m: _without(m["config"], "dtype") == base,
                           why="the Experiment 1 BF16 config (same problems, caps, model, format, threads)")
    if bank is None:
        raise MissingLedgerError(
            f"no BF16 prefix bank at {root / profile / PREFIX_BANK}, which {spec.what} reads: "
            f"{_run_hint(LEDGER_SPECS['exp1-bfloat16'], profile)}"
        )
    return find_ledger(root, profile, key, match=lambda m: m["config"].get("prefix_bank_sha256") == bank["sha256"],
                       why=f"the prefix bank (sha256 {bank['sha256'][:12]})")


def load_profile(root: str | Path, profile: str, precisions: Sequence[str] = ("bfloat16", "float32")) -> ProfileLedgers:
    """Find and read every ledger the paper assembly needs for one profile (no model is loaded).

    Needs Experiments 1 and 2 at each of ``precisions`` (which must include
    ``bfloat16``: the prefix bank is BF16), Experiments 3, 4 and 5, each
    chosen by :func:`find_chain_ledger`.

    Raises:
        MissingLedgerError: naming the notebook to run for the first ledger that is missing.
        ValueError: if ``precisions`` lacks ``bfloat16``.
    """
    if "bfloat16" not in precisions:
        raise ValueError(f"precisions {list(precisions)} must include 'bfloat16' (Experiments 2-4 read the BF16 prefix bank)")
    root = Path(root)
    if _bank(root, profile) is None:
        raise MissingLedgerError(
            f"no BF16 prefix bank at {root / profile / PREFIX_BANK}: {_run_hint(LEDGER_SPECS['exp1-bfloat16'], profile)}"
        )
    keys = [k for k, s in LEDGER_SPECS.items() if s.experiment in ("exp3", "exp4", "exp5") or s.dtype in precisions]
    led = {k: find_chain_ledger(root, profile, k) for k in keys}
    return ProfileLedgers(root=root, profile=profile, prefix_bank_sha256=_bank(root, profile)["sha256"], ledgers=led)


# ----------------------------------------------------------------------------- results from ledgers


def summarize(pl: ProfileLedgers, *, seed: int = 20260729, n_resamples: int = 20000) -> dict:
    """Every endpoint of Experiments 1–5 recomputed from the ledgers with the library's summary functions.

    Returns:
        ``exp1`` / ``exp2``: dtype -> :func:`~kvreplay.experiments.matrix_summary`;
        ``exp1_cross``: ``(prefixes token-identical across precisions, rows)`` or None;
        ``crossing``: :func:`~kvreplay.experiments.precision_crossing` or None;
        ``bridge``: :func:`bridge_summary`; ``audit``: :func:`~kvreplay.experiments.saved_ledger_audit`;
        ``transplant``: :func:`~kvreplay.experiments.transplant_summary`;
        ``replication``: :func:`~kvreplay.replication.replication_summary`;
        ``replication_accuracy``: :func:`~kvreplay.replication.accuracy_vs_checkpoint0`;
        ``replication_checkpoint``: the replication checkpoint's description (from the Exp 5 ledger key);
        ``rows``: rows per ledger key.

    Raises:
        GateError: if any row of any ledger failed a gate (endpoints are withheld).
    """
    prec = pl.precisions
    kw = {"seed": seed, "n_resamples": n_resamples}
    out: dict = {
        "exp1": {d: matrix_summary(pl.records(f"exp1-{d}"), d, "live", **kw) for d in prec},
        "exp2": {d: matrix_summary(pl.records(f"exp2-{d}"), d, "incremental", **kw) for d in prec},
        "exp1_cross": None,
        "crossing": None,
    }
    if {"bfloat16", "float32"} <= set(prec):
        a, b = pl.records("exp1-bfloat16"), pl.records("exp1-float32")
        out["exp1_cross"] = (sum(x["prefix"] == y["prefix"] for x, y in zip(a, b)), len(a))
        out["crossing"] = precision_crossing(pl.records("exp2-bfloat16"), pl.records("exp2-float32"), **kw)
    out["bridge"] = bridge_summary(pl.records("exp3-bfloat16"))
    out["audit"] = saved_ledger_audit(pl.records("exp1-bfloat16"), pl.records("exp2-bfloat16"))
    out["transplant"] = transplant_summary(pl.records("exp4-bfloat16"))
    out["replication"] = replication_summary(pl.records("exp5-bfloat16"))
    out["replication_accuracy"] = accuracy_vs_checkpoint0(pl.records("exp2-bfloat16"), pl.records("exp5-bfloat16"), **kw)
    out["replication_checkpoint"] = describe_checkpoint(pl["exp5-bfloat16"].config["checkpoint"])
    out["rows"] = {k: len(v.records) for k, v in pl.ledgers.items()}
    return out


def results_tables(pl: ProfileLedgers, results: dict) -> dict[str, pd.DataFrame]:
    """The Experiments 1–4 results tables, keyed by file stem (built by the library's table functions).

    Keys: ``table_exp1_matrix``, ``table_exp2_matrix``, ``table_exp2_crossing`` (both
    precisions only), ``table_exp3_bridge``, ``table_exp3_audit``,
    ``table5_exp4_transplant``, ``table_exp4_localization``, ``table_exp5_replication``,
    ``table_exp5_accuracy``, ``table_first_divergence``.
    """
    cross2 = results["crossing"]
    out = {
        "table_exp1_matrix": matrix_table(list(results["exp1"].values()), results["exp1_cross"]),
        "table_exp2_matrix": matrix_table(
            list(results["exp2"].values()), (cross2["prefix_identical"], cross2["n"]) if cross2 else None
        ),
    }
    if cross2:
        out["table_exp2_crossing"] = crossing_table(cross2)
    out["table_exp3_bridge"] = bridge_table(results["bridge"])
    out["table_exp3_audit"] = audit_table(results["audit"])
    out["table5_exp4_transplant"] = transplant_table(results["transplant"], pl.records("exp4-bfloat16"))
    loc = localization_table(pl.records("exp4-bfloat16"))
    out["table_exp4_localization"] = loc.set_index(["intervention", "stratum", "direction"]) if len(loc) else loc
    out["table_exp5_replication"] = replication_table(results["replication"], results["replication_checkpoint"])
    out["table_exp5_accuracy"] = replication_accuracy_table(results["replication_accuracy"])
    out["table_first_divergence"] = first_divergence_table(results)
    return out


TABLES_BY_EXPERIMENTS = {
    "table_exp1_matrix": "01_experiment1_live_vs_prefill.ipynb",
    "table_exp2_matrix": "02_experiment2_fixed_prefix_precision.ipynb",
    "table_exp2_crossing": "02_experiment2_fixed_prefix_precision.ipynb",
    "table_exp3_bridge": "03_experiment3_bridge_and_audit.ipynb",
    "table_exp3_audit": "03_experiment3_bridge_and_audit.ipynb",
    "table5_exp4_transplant": "04_experiment4_cache_transplant.ipynb",
    "table_exp4_localization": "04_experiment4_cache_transplant.ipynb",
    "table_exp5_replication": "05_experiment5_replication.ipynb",
    "table_exp5_accuracy": "05_experiment5_replication.ipynb",
}
"""Results table -> the experiment notebook that writes it (once). Notebook 06 recomputes each from the
ledger rows and checks it is byte-identical to the written CSV; it writes only the tables not listed here."""

TABLE_CAPTIONS = {
    "table_exp1_matrix": "Experiment 1: matched live/prefill matrix",
    "table_exp2_matrix": "Experiment 2: fixed-prefix 2x2, prefill vs incremental per precision",
    "table_exp2_crossing": "Experiment 2: paired FP32 minus BF16 change in disagreement",
    "table_exp3_bridge": "Experiment 3: live/incremental bridge",
    "table_exp3_audit": "Experiment 3: saved-ledger audit",
    "table5_exp4_transplant": "Table 5 / Experiment 4: whole-cache transplantation (registered endpoints)",
    "table_exp4_localization": "Experiment 4 (exploratory): partial transplants, divergent rows and exact controls",
    "table_exp5_replication": "Experiment 5: outcome-blind replication on a later checkpoint (frozen interpretation matrix)",
    "table_exp5_accuracy": "Experiment 5 (secondary): decoded accuracy, later checkpoint vs checkpoint 0, same prefixes",
    "table_first_divergence": "First divergence, tokens after the boundary: quartiles (referee minor comment 3)",
}
"""Caption of every results table (the experiment notebooks and notebook 06 use the same text)."""


def same_as_saved(df: pd.DataFrame, csv: str | Path) -> bool | None:
    """Whether ``df`` serializes to exactly the CSV an experiment notebook saved (None if that file is absent)."""
    csv = Path(csv)
    if not csv.is_file():
        return None
    return df.to_csv() == csv.read_text(encoding="utf-8")


def first_divergence_table(results: dict) -> pd.DataFrame:
    """Quartiles of the first-divergence position (tokens after the boundary), per experiment and precision.

    The referee asked for the distribution next to the paper's median and range.
    """
    rows = {}
    for exp, label in (("exp1", "Exp 1 prefill vs live"), ("exp2", "Exp 2 prefill vs incremental")):
        for d, s in results[exp].items():
            q = s["first_divergence_quartiles"]
            rng = s["first_divergence_range"]
            rows[f"{label}, {d}"] = {
                "rows": s["n"],
                "divergent rows": s["suffix"].k,
                "tie-initiated": s["tie_initiated"],
                "not tie-initiated": s["suffix"].k - s["tie_initiated"],
                "min": rng[0] if rng else "",
                "Q1": f"{q[0]:g}" if q else "",
                "median": f"{s['first_divergence_median']:g}" if s["first_divergence_median"] is not None else "",
                "Q3": f"{q[2]:g}" if q else "",
                "max": rng[1] if rng else "",
            }
    return pd.DataFrame(rows).T


# ----------------------------------------------------------------------------- paper-facing tables


def load_reference(path: str | Path = REFERENCE) -> dict:
    """The paper's reported numbers and setup (``data/paper/reference.yaml``)."""
    return yaml.safe_load(Path(path).read_text(encoding="utf-8"))


def related_work_table(path: str | Path = RELATED_WORK) -> pd.DataFrame:
    """Table 1: related-work overlap and separation, from ``data/paper/related_work.yaml``."""
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    return pd.DataFrame(data["works"]).set_index("work")


def visibility_frame() -> pd.DataFrame:
    """Table 2: role visibility, generated from :func:`kvreplay.contract.visibility_table` (never typed)."""
    return pd.DataFrame(visibility_table()).set_index("query role")


def _dataset(problem_ids: Sequence[str]) -> str:
    names = sorted({i.split("-", 1)[0] for i in problem_ids})
    return "/".join(n.upper() if n == "mmlu" else n for n in names)


def _short(digest: str | None, n: int = 16) -> str:
    return f"{digest[:n]}…" if digest else "—"


def _cache_geometry(led: LoadedLedger) -> str:
    for r in led.records:
        for cmp in r.get("boundary", {}).values():
            if "tensors" in cmp and cmp["tensors"]:
                g = cmp["tensors"][0]["ref_geometry"]
                shape = list(g["shape"])
                shape[2] = "|z|"
                return f"[{', '.join(map(str, shape))}] per layer, K and V; {g['dtype']} on {g['device']}"
    m = led.contract.get("model", {})
    if m.get("kv_heads") and m.get("head_dim"):
        return f"[{led.config['batch']}, {m['kv_heads']}, |z|, {m['head_dim']}] per layer, K and V (from the model)"
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


def contract_column(led: LoadedLedger) -> dict[str, str]:
    """One ledger's column of Table 3 (numerical contract), from its manifest.json and environment.json."""
    c, e = led.config, led.contract
    m = e.get("model", {})
    caps = c["caps"]
    cfg_model = c.get("model", {})
    fmt = c.get("format", {})
    return {
        "ledger": led.dir.name,
        "dtype": c["dtype"],
        "model": f"{m.get('file') or m.get('model') or cfg_model.get('model')} ({m.get('architecture', '?')})",
        "geometry": f"{m.get('layers', '?')} layers; {m.get('kv_heads', '?')} KV heads; head dim {m.get('head_dim', '?')}",
        "cache_tensor": _cache_geometry(led),
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
        "config_digest": _short(led.manifest["config_digest"]),
        "library": _short(led.environment.get("library_sha256")),
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


def contract_table(pl: ProfileLedgers, reference: dict) -> pd.DataFrame:
    """Table 3: the numerical contract of every ledger of the run, beside the paper's."""
    paper = paper_contract_column(reference)
    cols = {"paper": {label: paper.get(key, "—") for key, label in CONTRACT_ROWS}}
    for k, led in pl.ledgers.items():
        col = contract_column(led)
        cols[k] = {label: col[key] for key, label in CONTRACT_ROWS}
    return pd.DataFrame(cols)


def _reduction(cross: dict, key: str) -> str:
    c, m = cross[key]["change"], cross[key]["mcnemar"]
    red = lambda x: -100 * x + 0.0  # noqa: E731  (the paper's sign: BF16 minus FP32; + 0.0 turns -0.0 into 0.0)
    ci = f"{red(c.estimate):.1f} [{red(c.high):.1f}, {red(c.low):.1f}]" if c else "n/a"
    return f"{ci}; p = {m.pvalue:.3g}"


def _fd(s: dict) -> str:
    if s["first_divergence_median"] is None:
        return "no divergence"
    lo, hi = s["first_divergence_range"]
    return f"median {s['first_divergence_median']:g} (range {lo}-{hi})"


def _acc_diff(s: dict) -> str:
    d = s["accuracy_diff"]
    return f"{100 * d.estimate:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]" if d else "n/a"


def _both(results: dict, exp: str, f: Callable[[dict], str]) -> str:
    return "; ".join(f"{d} {f(s)}" for d, s in results[exp].items())


def _kn(k, n) -> str:
    return f"{k}/{n}"


def _leaves_agree(audit: dict, kind: str) -> str:
    leaves = ", ".join(map(str, audit[f"{kind}_leaves"]))
    return f"{leaves} leaves; {_kn(audit[f'{kind}_leaves_agree_rows'], audit['rows'])}"


RUN_VALUES: dict[str, Callable[[dict], str]] = {
    "exp1.replicas_exact": lambda R: _both(R, "exp1", lambda s: _kn(s["replicas_exact"], s["n"])),
    "exp1.bf16.boundary_non_exact": lambda R: _kn(R["exp1"]["bfloat16"]["boundary_non_exact"], R["exp1"]["bfloat16"]["n"]),
    "exp1.bf16.first_token_agree": lambda R: _kn(R["exp1"]["bfloat16"]["first_token_agree"], R["exp1"]["bfloat16"]["n"]),
    "exp1.bf16.suffix": lambda R: R["exp1"]["bfloat16"]["suffix"].pct(),
    "exp1.bf16.answer": lambda R: R["exp1"]["bfloat16"]["answer"].pct(),
    "exp1.bf16.label": lambda R: R["exp1"]["bfloat16"]["label"].pct(),
    "exp1.bf16.first_divergence": lambda R: _fd(R["exp1"]["bfloat16"]),
    "exp1.bf16.accuracy": lambda R: (lambda s: f"{s['accuracy_ref']}/{s['n']} vs {s['accuracy_prefill']}/{s['n']}")(R["exp1"]["bfloat16"]),
    "exp1.bf16.accuracy_diff": lambda R: _acc_diff(R["exp1"]["bfloat16"]),
    "exp1.bf16.mcnemar": lambda R: (lambda m: f"{m.b} vs {m.c}, p = {m.pvalue:.3g}")(R["exp1"]["bfloat16"]["mcnemar"]),
    "exp1.fp32.decoded": lambda R: (lambda s: f"{s['suffix'].k} / {s['answer'].k} / {s['label'].k} of {s['n']}")(R["exp1"]["float32"]),
    "exp1.cross_precision_prefix": lambda R: _kn(*R["exp1_cross"]),
    "exp2.prefix_identical": lambda R: _kn(R["crossing"]["prefix_identical"], R["crossing"]["n"]),
    "exp2.prefix_len": lambda R: "{}-{}".format(*R["exp2"]["bfloat16"]["prefix_len_range"]),
    "exp2.replicas_exact": lambda R: _both(R, "exp2", lambda s: _kn(s["replicas_exact"], s["n"])),
    "exp2.bf16.suffix": lambda R: _kn(R["exp2"]["bfloat16"]["suffix"].k, R["exp2"]["bfloat16"]["n"]),
    "exp2.bf16.answer": lambda R: _kn(R["exp2"]["bfloat16"]["answer"].k, R["exp2"]["bfloat16"]["n"]),
    "exp2.bf16.label": lambda R: _kn(R["exp2"]["bfloat16"]["label"].k, R["exp2"]["bfloat16"]["n"]),
    "exp2.fp32.suffix": lambda R: R["exp2"]["float32"]["suffix"].pct(),
    "exp2.fp32.answer": lambda R: R["exp2"]["float32"]["answer"].pct(),
    "exp2.fp32.label": lambda R: R["exp2"]["float32"]["label"].pct(),
    "exp2.reduction.suffix": lambda R: _reduction(R["crossing"], "suffix"),
    "exp2.reduction.answer": lambda R: _reduction(R["crossing"], "answer"),
    "exp2.reduction.label": lambda R: _reduction(R["crossing"], "label"),
    "exp2.accuracy": lambda R: _both(R, "exp2", lambda s: f"{s['accuracy_ref']}/{s['n']} vs {s['accuracy_prefill']}/{s['n']}"),
    "exp2.drift": lambda R: _both(R, "exp2", lambda s: f"{s['drift_median']:.4g}"),
    "exp3.bridge.layers_exact": lambda R: _kn(R["bridge"]["layers_exact"], R["bridge"]["n"]),
    "exp3.bridge.logits_exact": lambda R: _kn(R["bridge"]["logits_exact"], R["bridge"]["n"]),
    "exp3.bridge.suffix_exact": lambda R: _kn(R["bridge"]["suffix_exact"], R["bridge"]["n"]),
    "exp3.bridge.prefix_len": lambda R: "{}-{}".format(*R["bridge"]["prefix_len_range"]),
    "exp3.bridge.same_as_saved": lambda R: _kn(R["bridge"]["same_as_saved"], R["bridge"]["n"]),
    "exp3.audit.order": lambda R: f"{'yes' if R['audit']['order_agrees'] else 'no'} ({R['audit']['rows']} rows)",
    "exp3.audit.suffix": lambda R: _kn(min(R["audit"]["suffix_agrees"].values()), R["audit"]["rows"]),
    "exp3.audit.cache_leaves": lambda R: _leaves_agree(R["audit"], "cache"),
    "exp3.audit.logit_leaves": lambda R: _leaves_agree(R["audit"], "logit"),
    "exp4.panel": lambda R: (lambda t: f"{t['rows']} ({t['divergent']} + {t['exact']}, contemporaneous strata)")(R["transplant"]),
    "exp4.gates": lambda R: _kn(R["transplant"]["rows"], R["transplant"]["rows"]),
    "exp4.recovery.prefill_from_incremental": lambda R: rate_text(R["transplant"]["recovery"]["prefill<-incremental"]),
    "exp4.recovery.incremental_from_prefill": lambda R: rate_text(R["transplant"]["recovery"]["incremental<-prefill"]),
    "exp4.joint_recovery": lambda R: rate_text(R["transplant"]["joint_recovery"]),
    "exp4.third_among_exact": lambda R: rate_text(R["transplant"]["third_among_exact"]),
    "exp5.divergence": lambda R: R["replication"]["divergence"].pct(),
    "exp5.joint_recovery": lambda R: rate_text(R["replication"]["joint_recovery"]),
    "exp5.third_among_exact": lambda R: rate_text(R["replication"]["third_among_exact"]),
    "exp5.interpretation": lambda R: (lambda i, j: f"{i.label} (thresholds ≥ {i.min_divergent} divergent, ≥ {i.min_exact} "
                                                   f"exact, as the paper; n = {i.n}); scaled to the panel: {j.label}")(
        R["replication"]["interpretation"], R["replication"]["interpretation_scaled"]),
}
"""Reference endpoint id (``reference.yaml``) -> this run's value, from :func:`summarize`'s results."""

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


def setup_of_run(pl: ProfileLedgers) -> dict:
    """What this run used (model, data, caps, hardware), read from the Experiment 1 BF16 manifest and environment."""
    led = pl["exp1-bfloat16"]
    c, e = led.config, led.contract
    m = e.get("model", {})
    return {
        "model": m.get("file") or m.get("model") or c["model"].get("model"),
        "geometry": f"{m.get('layers', '?')} layers, {m.get('kv_heads', '?')} KV heads, head dim {m.get('head_dim', '?')}",
        "dataset": _dataset(c["problem_ids"]),
        "caps": c["caps"],
        "hardware": f"{e.get('device', '?')} ({e.get('device_name', '?')}), {c['threads']} threads, SDPA {'/'.join(c['sdpa_backends'])}",
        "precisions": ", ".join(pl.precisions),
        "rows": {
            "exp1": len(led.records),
            "exp2": len(pl.records("exp2-bfloat16")),
            "exp3": len(pl.records("exp3-bfloat16")),
            "exp3_audit": len(led.records),
            "exp4": len(pl.records("exp4-bfloat16")),
            "exp5": len(pl.records("exp5-bfloat16")),
        },
    }


def setup_table(pl: ProfileLedgers, reference: dict) -> pd.DataFrame:
    """The setups side by side (model, data, caps, hardware, precisions, rows per experiment)."""
    run, paper = setup_of_run(pl), reference["setup"]
    caps = lambda c: f"{c['branch']} / {c['merge']} / {c['answer']}"  # noqa: E731
    rows = {
        "model": (f"{paper['model']} ({paper['layers']} layers, {paper['kv_heads']} KV heads, head dim {paper['head_dim']})",
                  f"{run['model']} ({run['geometry']})"),
        "data": (paper["dataset"], run["dataset"]),
        "caps branch / merge / answer": (caps(paper["caps"]), caps(run["caps"])),
        "hardware": (f"{paper['hardware']}; {paper['attention']}", run["hardware"]),
        "precisions": (paper["precisions"], run["precisions"]),
    }
    for k, label in (("exp1", "rows, Exp 1"), ("exp2", "rows, Exp 2"), ("exp3", "rows, Exp 3 bridge"),
                     ("exp3_audit", "rows, Exp 3 audit"), ("exp4", "rows, Exp 4 panel"), ("exp5", "rows, Exp 5")):
        rows[label] = (str(paper["rows"].get(k, "—")), str(run["rows"].get(k, NOT_RUN)))
    return pd.DataFrame(rows, index=["paper", "this run"]).T


def what_differs(experiment: int, run: dict, paper: dict) -> str:
    """Short note of what separates this run from the paper for one experiment's endpoints."""
    if experiment not in (1, 2, 3, 4, 5):
        return f"experiment {experiment} not built yet"
    key = f"exp{experiment}"
    parts = []
    if str(run["model"]) != paper["model"]:
        parts.append(f"model ({run['model']} vs {paper['model_short']})")
    n_run = run["rows"][key] if experiment != 3 else f"{run['rows']['exp3']} bridge / {run['rows']['exp3_audit']} audit"
    n_pap = paper["rows"][key] if experiment != 3 else f"{paper['rows']['exp3']} bridge / {paper['rows']['exp3_audit']} audit"
    if run["dataset"] != paper["dataset"] or str(n_run) != str(n_pap):
        parts.append(f"data ({n_run} {run['dataset']} vs {n_pap} {paper['dataset']} rows)")
    rc, pc = run["caps"], paper["caps"]
    if rc != pc:
        parts.append(f"caps ({rc['branch']}/{rc['merge']}/{rc['answer']} vs {pc['branch']}/{pc['merge']}/{pc['answer']})")
    parts.append(f"hardware ({run['hardware']} vs {paper['hardware']})")
    if experiment == 5:
        parts.append("later checkpoint (role rows trained here on OpenBookQA vs the paper's later training checkpoint)")
    return "; ".join(parts)


def vs_paper_table(pl: ProfileLedgers, results: dict, reference: dict) -> pd.DataFrame:
    """Each endpoint's value in the paper and in this run, with what differs between the two setups."""
    run = setup_of_run(pl)
    rows = []
    for e in reference["endpoints"]:
        rows.append({
            "id": e["id"], "experiment": e["experiment"], "endpoint": e["endpoint"], "paper": e["paper"],
            "this run": run_value(results, e["id"]), "what differs": what_differs(e["experiment"], run, reference["setup"]),
        })
    return pd.DataFrame(rows).set_index("id")


# ----------------------------------------------------------------------------- the artifact map

ARTIFACTS: list[dict] = [
    # Experiment 1
    {"id": "exp1.replicas_exact",
     "ledgers": ("exp1-bfloat16", "exp1-float32"),
     "fields": "boundary.live_replica.cache.exact, boundary.prefill_replica.cache.exact",
     "function": "experiments.matrix_summary", "table": "table_exp1_matrix"},
    {"id": "exp1.bf16.boundary_non_exact",
     "ledgers": ("exp1-bfloat16",),
     "fields": "endpoints.boundary_exact",
     "function": "experiments.matrix_summary", "table": "table_exp1_matrix"},
    {"id": "exp1.bf16.first_token_agree",
     "ledgers": ("exp1-bfloat16",),
     "fields": "endpoints.first_token_agree (from first_token.live, first_token.prefill)",
     "function": "experiments.matrix_summary", "table": "table_exp1_matrix"},
    {"id": "exp1.bf16.suffix",
     "ledgers": ("exp1-bfloat16",),
     "fields": "endpoints.suffix_differs (arms.live.suffix vs arms.prefill.suffix)",
     "function": "experiments.matrix_summary -> stats.wilson", "table": "table_exp1_matrix"},
    {"id": "exp1.merge", "statistic": "merge differs (both precisions)",
     "ledgers": ("exp1-bfloat16", "exp1-float32"),
     "fields": "endpoints.merge_differs",
     "function": "experiments.matrix_summary -> stats.wilson", "table": "table_exp1_matrix"},
    {"id": "exp1.bf16.answer",
     "ledgers": ("exp1-bfloat16",),
     "fields": "endpoints.answer_differs",
     "function": "experiments.matrix_summary -> stats.wilson", "table": "table_exp1_matrix"},
    {"id": "exp1.bf16.label",
     "ledgers": ("exp1-bfloat16",),
     "fields": "endpoints.label_differs (arms.live.correct vs arms.prefill.correct)",
     "function": "experiments.matrix_summary -> stats.wilson", "table": "table_exp1_matrix"},
    {"id": "exp1.bf16.first_divergence",
     "ledgers": ("exp1-bfloat16",),
     "fields": "endpoints.first_divergence",
     "function": "experiments.matrix_summary", "table": "table_exp1_matrix, table_first_divergence, fig_first_divergence"},
    {"id": "exp1.bf16.accuracy",
     "ledgers": ("exp1-bfloat16",),
     "fields": "arms.live.correct, arms.prefill.correct",
     "function": "experiments.matrix_summary", "table": "table_exp1_matrix"},
    {"id": "exp1.bf16.accuracy_diff",
     "ledgers": ("exp1-bfloat16",),
     "fields": "arms.live.correct, arms.prefill.correct (paired by problem_id)",
     "function": "experiments.matrix_summary -> stats.paired_bootstrap", "table": "table_exp1_matrix"},
    {"id": "exp1.bf16.mcnemar",
     "ledgers": ("exp1-bfloat16",),
     "fields": "arms.live.correct, arms.prefill.correct (paired by problem_id)",
     "function": "experiments.matrix_summary -> stats.mcnemar_exact", "table": "table_exp1_matrix"},
    {"id": "exp1.fp32.decoded",
     "ledgers": ("exp1-float32",),
     "fields": "endpoints.suffix_differs, endpoints.answer_differs, endpoints.label_differs",
     "function": "experiments.matrix_summary", "table": "table_exp1_matrix"},
    {"id": "exp1.drift", "statistic": "median relative L2 cache drift [range], prefill vs live",
     "ledgers": ("exp1-bfloat16", "exp1-float32"),
     "fields": "boundary.prefill_vs_live.cache.rel_l2",
     "function": "experiments.matrix_summary (drift.aggregate when written)", "table": "table_exp1_matrix"},
    {"id": "exp1.cross_precision_prefix",
     "ledgers": ("exp1-bfloat16", "exp1-float32"),
     "fields": "prefix (paired by problem_id)",
     "function": "assemble.summarize", "table": "table_exp1_matrix"},
    # Experiment 2
    {"id": "exp2.prefix_identical",
     "ledgers": ("exp2-bfloat16", "exp2-float32"),
     "fields": "prefix (paired by problem_id)",
     "function": "experiments.precision_crossing", "table": "table_exp2_matrix, table_exp2_crossing"},
    {"id": "exp2.prefix_len",
     "ledgers": ("exp2-bfloat16",),
     "fields": "prefix_len",
     "function": "experiments.matrix_summary", "table": "table_exp2_matrix"},
    {"id": "exp2.replicas_exact",
     "ledgers": ("exp2-bfloat16", "exp2-float32"),
     "fields": "boundary.incremental_replica.cache.exact, boundary.prefill_replica.cache.exact",
     "function": "experiments.matrix_summary", "table": "table_exp2_matrix"},
    {"id": "exp2.bf16.suffix",
     "ledgers": ("exp2-bfloat16",),
     "fields": "endpoints.suffix_differs",
     "function": "experiments.matrix_summary", "table": "table_exp2_matrix"},
    {"id": "exp2.bf16.answer",
     "ledgers": ("exp2-bfloat16",),
     "fields": "endpoints.answer_differs",
     "function": "experiments.matrix_summary", "table": "table_exp2_matrix"},
    {"id": "exp2.bf16.label",
     "ledgers": ("exp2-bfloat16",),
     "fields": "endpoints.label_differs",
     "function": "experiments.matrix_summary", "table": "table_exp2_matrix"},
    {"id": "exp2.fp32.suffix",
     "ledgers": ("exp2-float32",),
     "fields": "endpoints.suffix_differs",
     "function": "experiments.matrix_summary -> stats.wilson", "table": "table_exp2_matrix"},
    {"id": "exp2.fp32.answer",
     "ledgers": ("exp2-float32",),
     "fields": "endpoints.answer_differs",
     "function": "experiments.matrix_summary -> stats.wilson", "table": "table_exp2_matrix"},
    {"id": "exp2.fp32.label",
     "ledgers": ("exp2-float32",),
     "fields": "endpoints.label_differs",
     "function": "experiments.matrix_summary -> stats.wilson", "table": "table_exp2_matrix"},
    {"id": "exp2.reduction.suffix",
     "ledgers": ("exp2-bfloat16", "exp2-float32"),
     "fields": "endpoints.suffix_differs (paired by problem_id)",
     "function": "experiments.precision_crossing -> stats.paired_bootstrap, stats.mcnemar_exact", "table": "table_exp2_crossing"},
    {"id": "exp2.reduction.answer",
     "ledgers": ("exp2-bfloat16", "exp2-float32"),
     "fields": "endpoints.answer_differs (paired by problem_id)",
     "function": "experiments.precision_crossing -> stats.paired_bootstrap, stats.mcnemar_exact", "table": "table_exp2_crossing"},
    {"id": "exp2.reduction.label",
     "ledgers": ("exp2-bfloat16", "exp2-float32"),
     "fields": "endpoints.label_differs (paired by problem_id)",
     "function": "experiments.precision_crossing -> stats.paired_bootstrap, stats.mcnemar_exact", "table": "table_exp2_crossing"},
    {"id": "exp2.accuracy",
     "ledgers": ("exp2-bfloat16", "exp2-float32"),
     "fields": "arms.incremental.correct, arms.prefill.correct",
     "function": "experiments.matrix_summary", "table": "table_exp2_matrix"},
    {"id": "exp2.drift",
     "ledgers": ("exp2-bfloat16", "exp2-float32"),
     "fields": "boundary.prefill_vs_incremental.cache.rel_l2",
     "function": "experiments.matrix_summary", "table": "table_exp2_matrix"},
    {"id": "exp2.layer_drift", "statistic": "per-layer median relative L2, K and V, BF16 vs FP32",
     "ledgers": ("exp2-bfloat16", "exp2-float32"),
     "fields": "boundary.prefill_vs_incremental.tensors[].tensor, .rel_l2",
     "function": "reporting.drift_by_layer", "table": "fig_layer_drift"},
    {"id": "exp2.first_divergence", "statistic": "first-divergence quartiles, Exp 2",
     "ledgers": ("exp2-bfloat16", "exp2-float32"),
     "fields": "endpoints.first_divergence",
     "function": "experiments.matrix_summary", "table": "table_first_divergence, fig_first_divergence"},
    {"id": "near_tie", "statistic": "top-1 minus top-2 margin at the first divergent step vs at non-divergent steps",
     "ledgers": ("exp1-bfloat16", "exp2-bfloat16"),
     "fields": "arms.<reference arm>.margins, endpoints.first_divergence",
     "function": "assemble.divergence_margins", "table": "fig_near_tie"},
    # Experiment 3
    {"id": "exp3.bridge.layers_exact",
     "ledgers": ("exp3-bfloat16",),
     "fields": "endpoints.layers_exact, endpoints.layers",
     "function": "experiments.bridge_summary", "table": "table_exp3_bridge"},
    {"id": "exp3.bridge.logits_exact",
     "ledgers": ("exp3-bfloat16",),
     "fields": "endpoints.logits_exact",
     "function": "experiments.bridge_summary", "table": "table_exp3_bridge"},
    {"id": "exp3.bridge.suffix_exact",
     "ledgers": ("exp3-bfloat16",),
     "fields": "endpoints.suffix_exact",
     "function": "experiments.bridge_summary", "table": "table_exp3_bridge"},
    {"id": "exp3.bridge.prefix_len",
     "ledgers": ("exp3-bfloat16",),
     "fields": "prefix_len",
     "function": "experiments.bridge_summary", "table": "table_exp3_bridge"},
    {"id": "exp3.bridge.same_as_saved",
     "ledgers": ("exp3-bfloat16",),
     "fields": "same_as_saved (prefix vs the prefix bank)",
     "function": "experiments.bridge_summary", "table": "table_exp3_bridge"},
    {"id": "exp3.audit.order",
     "ledgers": ("exp1-bfloat16", "exp2-bfloat16"),
     "fields": "problem_id (row order)",
     "function": "experiments.saved_ledger_audit", "table": "table_exp3_audit"},
    {"id": "exp3.audit.suffix",
     "ledgers": ("exp1-bfloat16", "exp2-bfloat16"),
     "fields": "arms.{live,live_replica,prefill,prefill_replica}.suffix vs "
               "arms.{incremental,incremental_replica,prefill,prefill_replica}.suffix",
     "function": "experiments.saved_ledger_audit", "table": "table_exp3_audit"},
    {"id": "exp3.audit.cache_leaves",
     "ledgers": ("exp1-bfloat16", "exp2-bfloat16"),
     "fields": "every scalar leaf under boundary.* outside .logits (live names mapped to incremental)",
     "function": "experiments.saved_ledger_audit", "table": "table_exp3_audit"},
    {"id": "exp3.audit.logit_leaves",
     "ledgers": ("exp1-bfloat16", "exp2-bfloat16"),
     "fields": "every scalar leaf under boundary.*.logits",
     "function": "experiments.saved_ledger_audit", "table": "table_exp3_audit"},
    # Experiment 4
    {"id": "exp4.panel",
     "ledgers": ("exp4-bfloat16",),
     "fields": "stratum, baseline.suffix_differs (panel file exp4_panel.json)",
     "function": "experiments.transplant_summary", "table": "table5_exp4_transplant"},
    {"id": "exp4.gates",
     "ledgers": ("exp4-bfloat16",),
     "fields": "gate_failure",
     "function": "experiments.require_gates", "table": "table5_exp4_transplant"},
    {"id": "exp4.recovery.prefill_from_incremental",
     "ledgers": ("exp4-bfloat16",),
     "fields": "interventions.whole.prefill<-incremental.outcome, baseline.suffix_differs",
     "function": "experiments.transplant_summary -> stats.wilson", "table": "table5_exp4_transplant, fig_transplants"},
    {"id": "exp4.recovery.incremental_from_prefill",
     "ledgers": ("exp4-bfloat16",),
     "fields": "interventions.whole.incremental<-prefill.outcome, baseline.suffix_differs",
     "function": "experiments.transplant_summary -> stats.wilson", "table": "table5_exp4_transplant, fig_transplants"},
    {"id": "exp4.joint_recovery",
     "ledgers": ("exp4-bfloat16",),
     "fields": "interventions.whole.*.outcome, baseline.suffix_differs",
     "function": "experiments.transplant_summary -> stats.wilson", "table": "table5_exp4_transplant"},
    {"id": "exp4.third_among_exact",
     "ledgers": ("exp4-bfloat16",),
     "fields": "interventions.whole.*.outcome on rows with baseline.suffix_differs false",
     "function": "experiments.transplant_summary -> stats.wilson", "table": "table5_exp4_transplant, fig_transplants"},
    {"id": "exp4.localization",
     "statistic": "partial transplants (keys, values, halves, single layers), divergent rows and exact controls: follows donor / recipient / stays on the baseline / new trajectory",
     "ledgers": ("exp4-bfloat16",),
     "fields": "interventions.<name>.<direction>.outcome, interventions.<name>.kind",
     "function": "experiments.localization_table", "table": "table_exp4_localization, fig_transplants"},
    # Experiment 5
    {"id": "exp5.panel", "statistic": "outcome-blind panel: order statistics of prefix length (file exp5_panel.json)",
     "ledgers": ("exp5-bfloat16",),
     "fields": "problem_id, prefix_len; manifest.json config.panel, config.prefix_bank_sha256, config.checkpoint",
     "function": "replication.freeze_replication_panel", "table": "table_exp5_replication"},
    {"id": "exp5.divergence",
     "ledgers": ("exp5-bfloat16",),
     "fields": "baseline.suffix_differs (baseline.incremental vs baseline.prefill)",
     "function": "replication.replication_summary -> stats.wilson", "table": "table_exp5_replication"},
    {"id": "exp5.recovery", "statistic": "donor recovery per direction among divergent rows (Exp 5)",
     "ledgers": ("exp5-bfloat16",),
     "fields": "interventions.whole.<direction>.outcome, baseline.suffix_differs",
     "function": "replication.replication_summary -> stats.wilson", "table": "table_exp5_replication"},
    {"id": "exp5.joint_recovery",
     "ledgers": ("exp5-bfloat16",),
     "fields": "interventions.whole.<both directions>.outcome == donor, baseline.suffix_differs",
     "function": "replication.replication_summary -> stats.wilson", "table": "table_exp5_replication"},
    {"id": "exp5.third_among_exact",
     "ledgers": ("exp5-bfloat16",),
     "fields": "interventions.whole.<direction>.outcome == third, baseline.suffix_differs == false",
     "function": "replication.replication_summary -> stats.wilson", "table": "table_exp5_replication"},
    {"id": "exp5.interpretation",
     "ledgers": ("exp5-bfloat16",),
     "fields": "the counts above and the panel size",
     "function": "replication.interpret (absolute thresholds 12 and 6, PRECEDENCE; scaled_thresholds secondary)", "table": "table_exp5_replication"},
    {"id": "exp5.accuracy", "statistic": "decoded accuracy on the panel, later checkpoint vs checkpoint 0 (secondary)",
     "ledgers": ("exp2-bfloat16", "exp5-bfloat16"),
     "fields": "exp2 arms.incremental.correct; exp5 scores.incremental.correct (paired by problem_id)",
     "function": "replication.accuracy_vs_checkpoint0 -> stats.mcnemar_exact", "table": "table_exp5_accuracy"},
    # contract tables
    {"id": "table2", "statistic": "Table 2, role visibility",
     "ledgers": (),
     "fields": "kvreplay.contract.VISIBILITY (code, not a ledger)",
     "function": "contract.visibility_table", "table": "table2_role_visibility"},
    {"id": "table3", "statistic": "Table 3, numerical contract",
     "ledgers": tuple(LEDGER_SPECS),
     "fields": "manifest.json: config; environment.json: execution_contract, library_sha256",
     "function": "assemble.contract_table", "table": "table3_numerical_contract"},
]

"""For every reported statistic: ledgers (keys), record fields, the library function, and the output files."""


def artifact_map(pl: ProfileLedgers, reference: dict, tables_notebook: str, figures_notebook: str) -> pd.DataFrame:
    """Where every reported statistic comes from: ledger files and fields, function, outputs and notebooks.

    Ledger paths are relative to the ledger root; ``fig_*`` outputs are made by
    ``figures_notebook``, ``table*`` by ``tables_notebook``.
    """
    labels = {e["id"]: e["endpoint"] for e in reference["endpoints"]}
    rows = []
    for a in ARTIFACTS:
        files = []
        nbs = []
        for k in a["ledgers"]:
            led = pl.ledgers.get(k)
            files.append(f"{pl.profile}/{led.dir.name}/rows.jsonl" if led else f"{k}-* (not run)")
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
        if e["id"] not in {a["id"] for a in ARTIFACTS}:
            rows.append({"id": e["id"], "statistic": e["endpoint"], "ledger files": "— (not run here)", "record fields": "—",
                         "computed by": "—", "output (figures/<profile>/)": "table_vs_paper", "reproduced by": tables_notebook,
                         "ledger written by": "—"})
    return pd.DataFrame(rows).set_index("id")


# ----------------------------------------------------------------------------- figure data


def first_divergence_frame(groups: Mapping[str, Sequence[dict]]) -> pd.DataFrame:
    """First-divergence positions of divergent rows, long form: ``group``, ``problem_id``, ``first_divergence``."""
    rows = [
        {"group": g, "problem_id": r["problem_id"], "first_divergence": r["endpoints"]["first_divergence"]}
        for g, recs in groups.items() for r in recs if r["endpoints"]["first_divergence"] is not None
    ]
    return pd.DataFrame(rows, columns=["group", "problem_id", "first_divergence"])


def divergence_margins(records: Sequence[dict], ref: str) -> pd.DataFrame:
    """Top-1 minus top-2 eligible-logit margins by step kind (the near-tie figure).

    For each row, every model-chosen suffix step (forced tokens have no
    margin) before the first divergence is ``shared`` (the reference arm's
    margin; both arms share that history), as is every step of a row whose
    suffixes never differ. At the first divergence the margin is the smaller
    of the reference and prefill arms' margins (the arm closer to a tie), and
    the kind is ``first divergence, exact tie`` when it is exactly 0 (a
    tie-initiated divergence) and ``first divergence, margin > 0`` otherwise.
    Steps after the first divergence are dropped: the two trajectories no
    longer share a history there.

    Returns:
        DataFrame ``problem_id``, ``step``, ``margin``, ``kind``.

    Raises:
        GateError: if any row failed a gate.
    """
    require_gates(records)
    rows = []
    for r in records:
        fd = r["endpoints"]["first_divergence"]
        margins = r["arms"][ref]["margins"]
        other = r["arms"]["prefill"]["margins"]
        stop = len(margins) if fd is None else min(fd + 1, len(margins))
        for i in range(stop):
            m = margins[i]
            if i == fd:
                both = [x for x in (m, other[i] if i < len(other) else None) if x is not None]
                if not both:
                    continue
                m = min(both)
                kind = "first divergence, exact tie" if m == 0 else "first divergence, margin > 0"
            elif m is None:
                continue
            else:
                kind = "shared"
            rows.append({"problem_id": r["problem_id"], "step": i, "margin": m, "kind": kind})
    return pd.DataFrame(rows, columns=["problem_id", "step", "margin", "kind"])


def margin_percentiles(df: pd.DataFrame) -> list[float]:
    """For each first-divergence margin, the share (%) of shared-step margins at or below it."""
    shared = df.loc[df["kind"] == "shared", "margin"].to_numpy()
    if not len(shared):
        return []
    return [float(100 * (shared <= m).mean()) for m in df.loc[df["kind"].str.startswith("first divergence"), "margin"]]


def transplant_outcomes(records: Sequence[dict]) -> pd.DataFrame:
    """Counts of transplant outcomes per contemporaneous stratum, intervention and direction.

    Returns:
        DataFrame ``stratum`` (``divergent``/``exact`` by the new baselines), ``intervention``,
        ``kind`` (primary/exploratory), ``direction``, ``outcome`` (``donor``, ``recipient``,
        ``third``, ``baseline``) and ``rows``.

    Raises:
        GateError: if any row failed a gate.
    """
    require_gates(records)
    counts: dict[tuple, int] = {}
    for r in records:
        stratum = "divergent" if r["baseline"]["suffix_differs"] else "exact"
        for name, iv in r["interventions"].items():
            for d in DIRECTIONS:
                key = (stratum, name, iv["kind"], d, iv[d]["outcome"])
                counts[key] = counts.get(key, 0) + 1
    rows = [dict(zip(("stratum", "intervention", "kind", "direction", "outcome"), k), rows=v) for k, v in counts.items()]
    return pd.DataFrame(rows, columns=["stratum", "intervention", "kind", "direction", "outcome", "rows"])


# ----------------------------------------------------------------------------- drift explorer

COMPARISONS: dict[str, dict[str, tuple[str, str]]] = {
    "exp1": {"prefill_vs_live": ("live", "prefill"), "live_replica": ("live", "live_replica"),
             "prefill_replica": ("prefill", "prefill_replica")},
    "exp2": {"prefill_vs_incremental": ("incremental", "prefill"), "incremental_replica": ("incremental", "incremental_replica"),
             "prefill_replica": ("prefill", "prefill_replica")},
}
"""Experiment -> comparison (the ledger's ``boundary`` key) -> ``(reference arm, other arm)``."""


def comparison_arms(experiment: str, comparison: str) -> tuple[str, str]:
    """``(reference arm, other arm)`` of a comparison.

    Raises:
        ValueError: naming the comparisons available for the experiment.
    """
    if experiment not in COMPARISONS:
        raise ValueError(f"experiment {experiment!r}: the explorer reads {sorted(COMPARISONS)}")
    if comparison not in COMPARISONS[experiment]:
        raise ValueError(f"comparison {comparison!r} is not in {experiment}; choose one of {sorted(COMPARISONS[experiment])}")
    return COMPARISONS[experiment][comparison]


def pick_row(records: Sequence[dict], problem: str | None, experiment: str) -> dict:
    """The row to explore: ``problem`` if given, else the first row whose suffixes differ, else the first row.

    Raises:
        KeyError: if ``problem`` is not in the ledger (naming the IDs that are).
    """
    if problem is not None:
        for r in records:
            if r["problem_id"] == problem:
                return r
        raise KeyError(f"problem {problem!r} is not in the {experiment} ledger; it has {[r['problem_id'] for r in records]}")
    for r in records:
        if r.get("endpoints", {}).get("suffix_differs"):
            return r
    return records[0]


def layer_drift_frame(tensors: Sequence[dict]) -> pd.DataFrame:
    """Per-tensor ledger summaries (``boundary.<cmp>.tensors``) as a frame.

    Returns:
        DataFrame ``layer``, ``kind`` (key/value), ``rel_l2``, ``max_abs``, ``n_diff``, ``exact``.
    """
    rows = []
    for t in tensors:
        layer, kind = t["tensor"].split(".")
        rows.append({"layer": int(layer[1:]), "kind": kind, "rel_l2": t["rel_l2"], "max_abs": t["max_abs"],
                     "n_diff": t["n_diff"], "exact": t["exact"]})
    return pd.DataFrame(rows, columns=["layer", "kind", "rel_l2", "max_abs", "n_diff", "exact"])


def model_for_ledger(led: LoadedLedger, model: str | None = None) -> str:
    """The ``model`` argument that reloads the ledger's model (``model`` overrides it).

    Raises:
        ValueError: if the ledger keyed a local folder (only its name is recorded) and no ``model`` is given.
    """
    if model:
        return model
    key = led.config["model"]
    if key.get("model") == "embedded" or "sha256" in key or "files" not in key:
        return key["model"]
    raise ValueError(f"ledger {led.dir.name} was written with the local model folder {key['model']!r}; pass its path as `model`")


def load_for_ledger(led: LoadedLedger, model: str | None = None):
    """Load the ledger's model and block format exactly as its config says (dtype, threads, SDPA backends, role table,
    and the execution contract's device, determinism and TF32: a ledger computed on CUDA needs a CUDA device).

    Returns:
        ``(LoadedModel, BlockFormat)``.

    Raises:
        GateError: gate ``provenance`` if the resolved format's digest differs from the ledger's.
        ModelLoadError: the ledger was computed on CUDA and this machine has none.
    """
    from .contract import resolve_format
    from .gates import GateError
    from .models import load_model

    from .models import ExecutionContract

    c = led.config
    execution = c.get("execution", {})
    contract = ExecutionContract(
        device=execution.get("device", "cpu"), sdpa_backends=tuple(c["sdpa_backends"]),
        deterministic=execution.get("deterministic"), allow_tf32=execution.get("allow_tf32", False), threads=c["threads"],
    )
    role = c.get("role_table")
    table = None
    if role:
        from .paths import ROOT

        table = Path(role["model"]) if Path(role["model"]).is_absolute() else ROOT / role["model"]
    lm = load_model(model_for_ledger(led, model), c["dtype"], role_table=table, contract=contract)
    if role and lm.identity["role_table_sha256"] != role["sha256"]:
        raise GateError("provenance", f"role table {table} has sha256 {lm.identity['role_table_sha256']}, the ledger keyed {role['sha256']}")
    fmt = resolve_format(lm.tokenizer, c["format"])
    want = led.contract.get("format_digest")
    if want and fmt.digest != want:
        raise GateError("provenance", f"resolved format digest {fmt.digest[:12]} differs from the ledger's {want[:12]}")
    return lm, fmt


def rebuild_pair(lm, fmt, prefix: Sequence[int], ref: str, other: str, *, where: str = "prefix"):
    """Rebuild the two boundary states of one comparison from a ledger prefix z.

    ``live`` and ``incremental`` are both rebuilt by teacher-forcing the live
    call schedule (:func:`kvreplay.decode.build_incremental`; Experiment 3
    shows it bit-identical to live decoding); ``prefill`` and
    ``prefill_replica`` are independent one-call forwards; ``*_replica`` of a
    teacher-forced state is its verified deep copy. The row's boundary gates
    (dtype, state, duplicates, replica exactness, disjoint storage) run on the pair.

    Returns:
        ``(ref_state, other_state)`` :class:`~kvreplay.decode.Boundary` objects,
        caches ``[2, kv_heads, |z|, head_dim]`` per layer.

    Raises:
        GateError: a failed gate. ContractError: a prefix that does not end at the boundary.
    """
    from . import caches, decode
    from .experiments import boundary_gates

    built: dict = {}

    def get(name: str):
        if name not in built:
            if name in ("live", "incremental"):
                s = decode.build_incremental(lm, fmt, prefix, where=where)
            elif name in ("prefill", "prefill_replica"):
                s = decode.build_prefill(lm, fmt, prefix, where=where)
            elif name.endswith("_replica"):
                s = caches.live_replica(get(name[: -len("_replica")]))
            else:
                raise ValueError(f"unknown construction {name!r}")
            s.construction = name
            built[name] = s
        return built[name]

    a, b = get(ref), get(other)
    pairs = [(ref, other)] if other == f"{ref}_replica" else []
    boundary_gates({ref: a, other: b}, lm.dtype, pairs)
    return a, b


def fingerprint_matches(ledger_summary: dict, rebuilt: dict) -> dict[str, bool]:
    """Whether a rebuilt comparison (:func:`kvreplay.experiments.comparison`) equals the ledger's, part by part.

    Compares ``cache``, ``logits`` and (when the ledger has them) ``tensors`` after a JSON round trip.
    """
    norm = lambda x: json.loads(canonical_json(x))  # noqa: E731
    return {k: norm(ledger_summary[k]) == norm(rebuilt[k]) for k in ("cache", "logits", "tensors") if k in ledger_summary}


def drift_maps(
    ref: Sequence[tuple[str, object]], other: Sequence[tuple[str, object]], row: int = 0
) -> dict[tuple[str, str], pd.DataFrame]:
    """Per-head and per-position relative L2 drift of each layer's K and V (one duplicate row).

    Args:
        ref, other: cache inventories ``[("L00.key", [batch, kv_heads, seq, head_dim]), ...]``
            (:func:`kvreplay.gates.cache_tensors`), same names and shapes.
        row: which duplicate copy to read (both are bit-identical by the desync gate).

    Returns:
        ``{(kind, "head"): DataFrame [layers, kv_heads], (kind, "position"): DataFrame [layers, seq]}``
        for ``kind`` in ``key``/``value``; each cell is ``||other - ref|| / ||ref||`` over the
        remaining axes (NaN where the reference norm is 0), computed in float64.
    """
    import torch

    out: dict[tuple[str, str], dict[int, list[float]]] = {}
    for (name, a), (name_b, b) in zip(ref, other):
        if name != name_b or a.shape != b.shape:
            raise ValueError(f"inventories differ at {name} / {name_b}")
        layer, kind = name.split(".")
        r = a[row].detach().to(torch.float64)  # [kv_heads, seq, head_dim]
        d = b[row].detach().to(torch.float64) - r
        for axis, dims in (("head", (1, 2)), ("position", (0, 2))):
            num = torch.linalg.vector_norm(d, dim=dims)
            den = torch.linalg.vector_norm(r, dim=dims)
            rel = torch.where(den > 0, num / den.clamp_min(1e-300), torch.full_like(num, math.nan))
            out.setdefault((kind, axis), {})[int(layer[1:])] = rel.tolist()
    frames = {}
    for key, by_layer in out.items():
        df = pd.DataFrame.from_dict(by_layer, orient="index").sort_index()
        df.index.name = "layer"
        df.columns.name = key[1]
        frames[key] = df
    return frames


def token_text(tokenizer, token: int) -> str:
    """One token decoded, with whitespace made visible (for side-by-side tables)."""
    return repr(tokenizer.decode([int(token)]))[1:-1]


def suffix_alignment(
    tokenizer, a: Sequence[int], b: Sequence[int], margins_a: Sequence, margins_b: Sequence,
    first: int | None, before: int = 8, after: int = 12,
) -> pd.DataFrame:
    """Two suffixes side by side around their first divergence.

    Shows ``before`` steps before and ``after`` steps after it, or the first
    ``before + after + 1`` steps when the suffixes never differ.

    Returns:
        DataFrame indexed by ``step`` with each arm's token text and margin and ``same``.
    """
    n = max(len(a), len(b))
    lo, hi = (0, min(n, before + after + 1)) if first is None else (max(0, first - before), min(n, first + after + 1))
    rows = []
    for i in range(lo, hi):
        ta = a[i] if i < len(a) else None
        tb = b[i] if i < len(b) else None
        rows.append({
            "step": i,
            "reference": token_text(tokenizer, ta) if ta is not None else "",
            "margin (reference)": margins_a[i] if i < len(margins_a) else None,
            "other": token_text(tokenizer, tb) if tb is not None else "",
            "margin (other)": margins_b[i] if i < len(margins_b) else None,
            "same": ta == tb,
        })
    return pd.DataFrame(rows).set_index("step")


def topk_frame(tokenizer, ref_logits, other_logits, k: int = 10) -> pd.DataFrame:
    """Boundary logits ``[vocab]`` of two states on the union of each one's top-k tokens.

    Returns:
        DataFrame indexed by token ID: ``text``, ``reference``, ``other``, ``other - reference``,
        rank in each; sorted by the reference logit.
    """
    import torch

    r, o = ref_logits.float(), other_logits.float()
    ids = sorted(set(torch.topk(r, k).indices.tolist()) | set(torch.topk(o, k).indices.tolist()))
    rank_r = {int(t): i + 1 for i, t in enumerate(torch.topk(r, 2 * k).indices.tolist())}
    rank_o = {int(t): i + 1 for i, t in enumerate(torch.topk(o, 2 * k).indices.tolist())}
    rows = [{"token": t, "text": token_text(tokenizer, t), "reference": float(r[t]), "other": float(o[t]),
             "other - reference": float(o[t] - r[t]), "rank (reference)": rank_r.get(t), "rank (other)": rank_o.get(t)}
            for t in ids]
    return pd.DataFrame(rows).set_index("token").sort_values("reference", ascending=False)


def load_tokenizer(model: str):
    """The tokenizer alone (no weights), for decoding ledger token IDs when nothing is rebuilt."""
    import os

    from transformers import AutoTokenizer

    from .models import EMBEDDED, embedded_model_path, quiet_loading

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with quiet_loading():
        if model == EMBEDDED:
            p = embedded_model_path()
            return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        if str(model).endswith(".gguf"):
            p = Path(model)
            return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        return AutoTokenizer.from_pretrained(model)
