"""Paper assembly (kvreplay.report, kvreplay.ledger.lookup) on small synthetic ledgers: no model, a few seconds.

The ledgers are written with the real :class:`kvreplay.ledger.Ledger` and
prefix-bank writer, so folder names, manifests and row order are the ones the
experiment notebooks produce.
"""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
from kvreplay.decoding.contract import VISIBILITY
from kvreplay.gates import GateError
from kvreplay.ledger.lookup import (
    LEDGER_SPECS,
    PREFIX_BANK,
    MissingLedgerError,
    load_profile_ledgers,
)
from kvreplay.ledger.prefix_bank import write_prefix_bank
from kvreplay.ledger.store import Ledger
from kvreplay.report.rebuild import (
    comparison_arms,
    drift_maps,
    fingerprint_matches,
    model_for_ledger,
    pick_row,
    suffix_alignment,
    token_text,
    topk_frame,
)
from kvreplay.report.frames import (
    divergence_margins,
    first_divergence_frame,
    layer_drift_frame,
    margin_percentiles,
    transplant_outcomes,
)
from kvreplay.report.paper_tables import (
    NOT_RUN,
    RUN_VALUES,
    artifact_map,
    contract_table,
    load_reference,
    related_work_table,
    run_value,
    setup_table,
    visibility_frame,
    vs_paper_table,
)
from kvreplay.report.summary import results_tables, same_as_saved, summarize

PROFILE = "synthetic"
IDS = ["mmlu-aaaa", "mmlu-bbbb", "mmlu-cccc", "mmlu-dddd"]
DIVERGES = {"mmlu-aaaa": True, "mmlu-bbbb": False, "mmlu-cccc": True, "mmlu-dddd": False}
MARGINS = [1.0, None, 0.5, 0.01, 2.0, 3.0]
ENV = {"torch": "t", "transformers": "x", "python": "3", "device": "cpu", "device_name": "CPU", "intra_op_threads": 2,
       "attn_implementation": "sdpa", "sdpa_backends_used": ["math"], "tf32_matmul": False, "tf32_cudnn": False,
       "float32_matmul_precision": "highest", "deterministic_algorithms": False, "cublas_workspace_config": None,
       "format_digest": "f" * 64,
       "model": {"model": "embedded", "file": "tiny.gguf", "architecture": "Llama", "layers": 2, "heads": 2, "kv_heads": 1,
                 "head_dim": 4, "file_sha256": "a" * 64, "weights_sha256": "b" * 64, "role_table_sha256": None}}


VOCAB = 16
"""Vocabulary of the synthetic boundary logits ``[2, VOCAB]`` (the suffixes' token IDs 10-15 fit in it)."""
EQUIVALENCE_TOLERANCE = 1e-4
"""``kvreplay.gates.EQUIVALENCE_TOLERANCE``, as a float32 row records it."""


def _geometry(shape: list[int], dtype: str) -> dict:
    """A contiguous tensor's recorded geometry (``records.TensorGeometry``)."""
    stride = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    return {"shape": shape, "stride": stride, "dtype": dtype, "device": "cpu", "inference": True}


def _summary(rel: float, n: int = 8) -> dict:
    """Whole-cache drift (``records.CacheDiff``)."""
    return {"exact": rel == 0, "rel_l2": rel, "max_abs": rel, "n_diff": 0 if rel == 0 else n, "numel": n}


def _tensor(name: str, rel: float, seq: int, dtype: str = "bfloat16") -> dict:
    """One K or V tensor's drift (``records.TensorDiff``), shape ``[2, 1, seq, 4]``."""
    g = _geometry([2, 1, seq, 4], dtype)
    return {"tensor": name, "exact": rel == 0, "max_abs": rel, "l2_diff": rel, "l2_ref": 1.0, "rel_l2": rel,
            "n_diff": 0 if rel == 0 else 3, "numel": 8 * seq, "ref_geometry": g, "other_geometry": g}


def _logits(rel: float, dtype: str = "bfloat16") -> dict:
    """Boundary logits drift (``records.LogitsDiff``), shape ``[2, VOCAB]``; both argmaxes are token 10."""
    g = _geometry([2, VOCAB], dtype)
    top = [10, 11, 12, 13, 14]
    return {"tensor": "logits", "exact": rel == 0, "max_abs": rel, "l2_diff": rel, "l2_ref": 1.0, "rel_l2": rel,
            "n_diff": 0 if rel == 0 else 8, "numel": 2 * VOCAB, "ref_geometry": g, "other_geometry": g,
            "argmax_ref": 10, "argmax_other": 10, "argmax_agree": True, "margin_ref": 1.0, "margin_other": 1.0,
            "topk_ref": top, "topk_other": list(top)}


def _comparison(rel: float, seq: int, dtype: str = "bfloat16") -> dict:
    """A construction against its reference, per tensor too (``records.Comparison``): 2 layers, K and V."""
    return {"cache": _summary(rel), "logits": _logits(rel, dtype),
            "tensors": [_tensor(f"L{i:02d}.{k}", rel * (i + 1), seq, dtype) for i in range(2) for k in ("key", "value")]}


def _replica(dtype: str = "bfloat16") -> dict:
    """A replica against its original, bit-identical (``records.ReplicaComparison``)."""
    return {"cache": _summary(0.0), "logits": _logits(0.0, dtype)}


def _equivalence(compared: str, rel: float) -> dict:
    """The float32 construction-equivalence record (``records.Equivalence``), as a float32 run writes on every row."""
    return {"dtype": "float32", "compared": compared, "rel_l2": rel, "tolerance": EQUIVALENCE_TOLERANCE}


TIED = "mmlu-aaaa"
"""The divergent row whose first divergence is tie-initiated (its prefill arm's margin there is exactly 0)."""


def _score(predicted: str, correct: bool) -> dict:
    """The answer matcher's verdict (``records.AnswerScore``) on an answer block "The answer is: <letter>"."""
    return {"merge_len": 3, "answer_len": 1, "answer_text": f"The answer is: {predicted}", "predicted": predicted,
            "correct": correct, "rule": "answer_is"}


def _arm(suffix: list[int], correct: bool, margins: list | None = None, predicted: str = "A") -> dict:
    """One arm's continuation (``records.ArmSuffix``)."""
    return {"suffix": suffix, "margins": (margins or MARGINS)[: len(suffix)]} | _score(predicted, correct)


def matrix_record(pid: str, ref: str, prefix: list[int], rel: float, dtype: str = "bfloat16") -> dict:
    """An Experiment 1 (``ref="live"``) or 2 (``ref="incremental"``) row; divergent rows part at suffix step 3.

    A float32 row carries the equivalence record of its own comparison (as a float32 run writes on every row); a
    bfloat16 row none (this synthetic run checks no BF16 row)."""
    div = DIVERGES[pid]
    base = [10, 11, 12, 13, 14, 15]
    other = base[:3] + [99, 98, 97] if div else list(base)
    c_ref, c_pre = True, not (div and pid == "mmlu-cccc")
    tied = MARGINS[:3] + [0.0] + MARGINS[4:] if pid == TIED else MARGINS
    pred = "B" if not c_pre else "A"
    return {
        "problem_id": pid, "gate_failure": None, "prompt_len": 2, "prefix_len": len(prefix), "prefix": prefix,
        "schedule_calls": len(prefix) - 1,
        "boundary": {
            f"prefill_vs_{ref}": _comparison(rel, len(prefix), dtype),
            f"{ref}_replica": _replica(dtype),
            "prefill_replica": _replica(dtype),
        },
        "equivalence": _equivalence(f"prefill_vs_{ref}", rel) if dtype == "float32" else None,
        "first_token": {a: 10 for a in (ref, f"{ref}_replica", "prefill", "prefill_replica")},
        "raw_argmax": {a: 10 for a in (ref, f"{ref}_replica", "prefill", "prefill_replica")},
        "arms": {ref: _arm(base, c_ref), f"{ref}_replica": _arm(base, c_ref), "prefill": _arm(other, c_pre, tied, pred),
                 "prefill_replica": _arm(other, c_pre, tied, pred)},
        "endpoints": {"boundary_exact": rel == 0, "logits_exact": rel == 0, "first_token_agree": True, "suffix_differs": div,
                      "merge_differs": div, "answer_differs": not c_pre, "letter_differs": pred != "A",
                      "label_differs": c_ref != c_pre, "first_divergence": 3 if div else None,
                      "tie_initiated": (pid == TIED) if div else None},
    }


def bridge_record(pid: str, prefix: list[int]) -> dict:
    return {"problem_id": pid, "gate_failure": None, "prefix_len": len(prefix), "prefix": prefix,
            "saved_prefix_len": len(prefix), "same_as_saved": True, "equivalence": None,
            "boundary": {"incremental_vs_live": _comparison(0.0, len(prefix))},
            "arms": {a: _arm([1, 2], True) for a in ("live", "live_replica", "incremental", "incremental_replica")},
            "endpoints": {"cache_exact": True, "layers": 2, "layers_exact": 2, "logits_exact": True, "suffix_exact": True}}


def transplant_record(pid: str, prefix: list[int]) -> dict:
    div = DIVERGES[pid]
    inc, pre = [1, 2, 3], ([1, 9, 9] if div else [1, 2, 3])
    ivs = {}
    for name, kind, parts in (("whole", "primary", ["key", "value"]), ("keys_only", "exploratory", ["key"])):
        iv = {"kind": kind, "layers": [0, 1], "parts": parts}
        for d in ("prefill<-incremental", "incremental<-prefill"):
            donor = inc if d.endswith("incremental") else pre
            if not div:
                outcome, suffix = "baseline", inc
            elif name == "whole":
                outcome, suffix = "donor", donor
            else:
                outcome, suffix = "third", [7, 7, 7]
            iv[d] = {"outcome": outcome, "suffix": suffix, "donated_tensors": 2 * len(parts)}  # 2 layers
        ivs[name] = iv
    return {"problem_id": pid, "gate_failure": None, "stratum": "divergent" if div else "exact", "prefix_len": len(prefix),
            "prefix": prefix, "equivalence": None, "baseline": {"incremental": inc, "prefill": pre, "suffix_differs": div,
                                           "margins": {"incremental": [1.0, 0.5, 0.5], "prefill": [1.0, 0.0 if pid == TIED else 0.5, 0.5]},
                                           "first_divergence": 1 if div else None, "tie_initiated": (pid == TIED) if div else None},
            "interventions": ivs}


def replication_record(pid: str, prefix: list[int]) -> dict:
    """An Experiment 5 row: divergent rows recover in both directions; incremental correct except mmlu-cccc."""
    rec = transplant_record(pid, prefix)
    rec["stratum"] = "panel"
    del rec["interventions"]["keys_only"]
    rec["scores"] = {a: _score("A", pid != "mmlu-cccc") for a in ("incremental", "prefill")}
    return rec


EXP5_CHECKPOINT = {"kind": "later role table (notebook 00)", "model": {"model": "embedded", "sha256": "a" * 64},
                   "role_table_step": 64, "role_table_sha256": "e" * 64, "checkpoint_config_digest": "d" * 64}


def _config(experiment: str, dtype: str, ids: list[str], **extra) -> dict:
    return {"experiment": experiment, "profile": PROFILE, "dtype": dtype, "caps": {"branch": 8, "merge": 8, "answer": 4},
            "model": {"model": "embedded", "sha256": "a" * 64}, "role_table": None, "format": {"name": "fmt"},
            "problems_sha256": "c" * 64, "problem_ids": ids, "threads": 2, "sdpa_backends": ["math"], "preflight": 1,
            "batch": 2} | extra


def _write(root, name, dtype, records, **extra) -> Ledger:
    ledger = Ledger(root / PROFILE, f"{name}-{dtype}", _config(name, dtype, [r["problem_id"] for r in records], **extra),
                 environment=ENV | {"dtype": dtype})
    for r in records:
        ledger.append(r)
    return ledger


PREFIX = {pid: [1, 2, 3 + i, 4] for i, pid in enumerate(IDS)}


def build_chain(root, skip: tuple[str, ...] = ()) -> dict[str, Ledger]:
    """Synthetic ledgers for Experiments 1–5 (both precisions) plus the prefix bank, under ``root/synthetic``."""
    out = {}
    e1 = [matrix_record(p, "live", PREFIX[p], 0.01) for p in IDS]
    out["exp1-bfloat16"] = _write(root, "exp1", "bfloat16", e1)
    sha = write_prefix_bank(e1, root / PROFILE / PREFIX_BANK, out["exp1-bfloat16"].dir.name)
    if "exp1-float32" not in skip:
        out["exp1-float32"] = _write(root, "exp1", "float32", [matrix_record(p, "live", PREFIX[p], 1e-6, "float32") for p in IDS])
    for d, rel in (("bfloat16", 0.01), ("float32", 1e-6)):
        if f"exp2-{d}" not in skip:
            recs = [matrix_record(p, "incremental", PREFIX[p], rel, d) for p in IDS]
            if d == "float32":  # FP32: no decoded disagreement
                for r in recs:
                    r["arms"]["prefill"] = r["arms"]["prefill_replica"] = r["arms"]["incremental"]
                    r["endpoints"].update(suffix_differs=False, merge_differs=False, answer_differs=False, letter_differs=False,
                                          label_differs=False, first_divergence=None, tie_initiated=None)
            out[f"exp2-{d}"] = _write(root, "exp2", d, recs, prefix_bank_sha256=sha)
    if "exp3-bfloat16" not in skip:
        out["exp3-bfloat16"] = _write(root, "exp3", "bfloat16", [bridge_record(p, PREFIX[p]) for p in IDS[:2]], prefix_bank_sha256=sha)
    if "exp4-bfloat16" not in skip:
        out["exp4-bfloat16"] = _write(root, "exp4", "bfloat16", [transplant_record(p, PREFIX[p]) for p in IDS], prefix_bank_sha256=sha)
    if "exp5-bfloat16" not in skip:
        panel = [{"problem_id": p, "prefix_len": len(PREFIX[p])} for p in IDS]
        out["exp5-bfloat16"] = _write(root, "exp5", "bfloat16", [replication_record(p, PREFIX[p]) for p in IDS],
                                      prefix_bank_sha256=sha, panel=panel, checkpoint=EXP5_CHECKPOINT)
    return out


@pytest.fixture
def chain(tmp_path):
    return tmp_path, build_chain(tmp_path)


# ----------------------------------------------------------------------------- finding ledgers


def test_load_profile_finds_every_ledger_in_frozen_order(chain):
    root, written = chain
    profile_ledgers = load_profile_ledgers(root, PROFILE)
    assert list(profile_ledgers.ledgers) == list(LEDGER_SPECS)
    assert profile_ledgers.precisions == ["bfloat16", "float32"]
    for k, ledger in profile_ledgers.ledgers.items():
        assert ledger.dir == written[k].dir
        assert [r["problem_id"] for r in ledger.records] == ledger.config["problem_ids"]
    assert profile_ledgers["exp1-bfloat16"].contract["device"] == "cpu"


@pytest.mark.parametrize("missing", ["exp1-float32", "exp2-bfloat16", "exp2-float32", "exp3-bfloat16", "exp4-bfloat16",
                                     "exp5-bfloat16"])
def test_missing_ledger_names_its_notebook(tmp_path, missing):
    build_chain(tmp_path, skip=(missing,))
    with pytest.raises(MissingLedgerError) as e:
        load_profile_ledgers(tmp_path, PROFILE)
    assert LEDGER_SPECS[missing].notebook in str(e.value)
    assert missing in str(e.value)


def test_missing_profile_or_bank_names_notebook_01(tmp_path):
    with pytest.raises(MissingLedgerError, match="01_experiment1_live_vs_prefill"):
        load_profile_ledgers(tmp_path, PROFILE)


def test_unfinished_ledger_is_reported_with_its_progress(chain):
    root, written = chain
    rows = written["exp4-bfloat16"].rows_path
    lines = rows.read_text().splitlines(keepends=True)
    rows.write_text("".join(lines[:-1]) + lines[-1][:10])  # last row cut mid-write
    with pytest.raises(MissingLedgerError, match=r"unfinished .*3/4 rows.*04_experiment4"):
        load_profile_ledgers(root, PROFILE)


def test_stale_ledger_of_another_config_is_ignored_but_two_matching_are_ambiguous(chain):
    root, written = chain
    sha = written["exp2-bfloat16"].config["prefix_bank_sha256"]
    _write(root, "exp2", "bfloat16", [matrix_record(p, "incremental", PREFIX[p], 0.01) for p in IDS],
           prefix_bank_sha256="0" * 64)  # an older bank: not part of this chain
    profile_ledgers = load_profile_ledgers(root, PROFILE)
    assert profile_ledgers["exp2-bfloat16"].dir == written["exp2-bfloat16"].dir
    _write(root, "exp2", "bfloat16", [matrix_record(p, "incremental", PREFIX[p], 0.01) for p in IDS],
           prefix_bank_sha256=sha, preflight=2)  # same bank, another config
    with pytest.raises(MissingLedgerError, match="2 finished"):
        load_profile_ledgers(root, PROFILE)


def test_precisions_must_include_bf16_and_may_skip_fp32(tmp_path):
    build_chain(tmp_path, skip=("exp1-float32", "exp2-float32"))
    profile_ledgers = load_profile_ledgers(tmp_path, PROFILE, precisions=("bfloat16",))
    assert profile_ledgers.precisions == ["bfloat16"]
    results = summarize(profile_ledgers, n_resamples=200)
    assert results["crossing"] is None
    assert "table_exp2_crossing" not in results_tables(profile_ledgers, results)
    assert run_value(results, "exp2.fp32.suffix") == NOT_RUN
    with pytest.raises(ValueError, match="bfloat16"):
        load_profile_ledgers(tmp_path, PROFILE, precisions=("float32",))


# ----------------------------------------------------------------------------- results and tables


def test_summarize_recomputes_every_endpoint(chain):
    root, _ = chain
    profile_ledgers = load_profile_ledgers(root, PROFILE)
    R = summarize(profile_ledgers, n_resamples=500)
    assert R["exp1"]["bfloat16"]["suffix"].k == 2 and R["exp1"]["bfloat16"]["n"] == 4
    assert R["exp1"]["bfloat16"]["label"].k == 1
    assert R["exp1_cross"] == (4, 4)
    assert R["exp2"]["float32"]["suffix"].k == 0
    assert R["crossing"]["suffix"]["change"].estimate == pytest.approx(-0.5)
    assert R["bridge"] == R["bridge"] | {"n": 2, "layers_exact": 2, "logits_exact": 2, "suffix_exact": 2, "same_as_saved": 2}
    assert R["audit"]["prefix_agrees"] == 4 and R["audit"]["cache_leaves_agree_rows"] == 4
    t = R["transplant"]
    assert (t["divergent"], t["exact"]) == (2, 2)
    assert t["joint_recovery"].k == 2 and t["third_among_exact"].k == 0
    r5 = R["replication"]
    assert (r5["divergent"], r5["exact"], r5["joint_recovery"].k) == (2, 2, 2)
    assert r5["interpretation"].label == "divergence-underpowered"  # the paper's absolute thresholds: 12 and 6
    assert r5["interpretation_scaled"].label == "strong replication"  # secondary, scaled to n = 4: 1 and 1
    assert (R["replication_accuracy"]["ckpt0"].k, R["replication_accuracy"]["later"].k) == (4, 3)
    assert "later role table of notebook 00 (step 64" in R["replication_checkpoint"]

    tables = results_tables(profile_ledgers, R)
    assert set(tables) == {"table_exp1_matrix", "table_exp2_matrix", "table_exp2_crossing", "table_exp3_bridge",
                           "table_exp3_audit", "table5_exp4_transplant", "table_exp4_localization", "table_exp5_replication",
                           "table_exp5_accuracy", "table_first_divergence"}
    t5 = tables["table_exp5_replication"].iloc[:, 0]
    assert t5["interpretation (frozen matrix)"] == "divergence-underpowered"
    assert t5["secondary: interpretation with thresholds scaled to the panel"].startswith("strong replication")
    assert t5["incremental/prefill suffix divergence"].startswith("2/4")
    assert tables["table_exp1_matrix"].loc["suffix differs", "bfloat16"].startswith("2/4")
    assert tables["table_exp3_bridge"].loc["incremental bit-exact to live on every layer", "bridge (BF16)"] == "2/2"
    assert tables["table5_exp4_transplant"].loc["panel rows (frozen divergent + exact)"].iloc[0] == "4 (2 + 2)"
    loc = tables["table_exp4_localization"]
    assert loc.loc[("keys_only", "divergent", "prefill<-incremental"), "new (third) trajectory"] == 2
    assert loc.loc[("keys_only", "exact", "prefill<-incremental"), "stays on the shared baseline"] == 2  # controls included
    fd = tables["table_first_divergence"]
    assert fd.loc["Exp 1 prefill vs live, bfloat16", "median"] == "3"
    assert fd.loc["Exp 2 prefill vs incremental, float32", "divergent rows"] == 0


def test_gate_failure_withholds_endpoints(chain):
    root, written = chain
    rows = written["exp1-bfloat16"].rows_path
    recs = [json.loads(x) for x in rows.read_text().splitlines()]
    # a row stopped by a gate after its live boundary was reached: only that stage's fields (records.Exp1FailedRow)
    recs[1] = {"problem_id": recs[1]["problem_id"], "gate_failure": {"gate": "desync", "reason": "planted"}} | {
        k: recs[1][k] for k in ("prompt_len", "prefix_len", "prefix", "schedule_calls")}
    rows.write_text("".join(json.dumps(r) + "\n" for r in recs))
    profile_ledgers = load_profile_ledgers(root, PROFILE)
    with pytest.raises(GateError, match="desync"):
        summarize(profile_ledgers, n_resamples=100)


def test_same_as_saved_compares_csv_bytes(tmp_path):
    df = pd.DataFrame({"a": {"x": "1/2"}})
    assert same_as_saved(df, tmp_path / "none.csv") is None
    df.to_csv(tmp_path / "t.csv")
    assert same_as_saved(df, tmp_path / "t.csv") is True
    assert same_as_saved(pd.DataFrame({"a": {"x": "2/2"}}), tmp_path / "t.csv") is False


def test_paper_tables_from_data_and_code(chain):
    root, _ = chain
    profile_ledgers = load_profile_ledgers(root, PROFILE)
    ref = load_reference()
    t1 = related_work_table()
    assert len(t1) >= 5 and {"studies", "overlap", "separation"} <= set(t1.columns)
    t2 = visibility_frame()
    assert list(t2["raw role"]) == sorted(VISIBILITY)
    assert "branch" not in t2.loc["answer", "may attend to"]  # the answer never sees branch tokens
    t3 = contract_table(profile_ledgers, ref)
    assert list(t3.columns) == ["paper", *LEDGER_SPECS]
    assert t3.loc["boundary cache tensor", "exp1-bfloat16"].startswith("[2, 1, |z|, 4]")
    assert t3.loc["caps branch / merge / answer", "paper"] == "768 / 512 / 64"
    assert t3.loc["BF16 prefix bank sha256 (first 16 hex)", "exp2-float32"] != "—"


def test_vs_paper_and_artifact_map_cover_every_reference_endpoint(chain):
    root, _ = chain
    profile_ledgers = load_profile_ledgers(root, PROFILE)
    ref = load_reference()
    R = summarize(profile_ledgers, n_resamples=200)
    ids = [e["id"] for e in ref["endpoints"]]
    assert len(ids) == len(set(ids))
    assert set(ids) == set(RUN_VALUES), set(ids) ^ set(RUN_VALUES)
    vs = vs_paper_table(profile_ledgers, R, ref)
    assert list(vs.index) == ids
    assert all(vs.loc[i, "this run"] != NOT_RUN for i in ids)
    assert vs.loc["exp5.interpretation", "this run"].startswith("divergence-underpowered (thresholds ≥ 12 divergent")
    assert "later checkpoint" in vs.loc["exp5.divergence", "what differs"]
    assert vs.loc["exp1.bf16.suffix", "this run"].startswith("2/4")
    assert vs.loc["exp2.reduction.suffix", "this run"].startswith("50.0")  # reduction reported as positive, as the paper does
    assert "caps (8/8/4 vs 768/512/64)" in vs.loc["exp1.bf16.suffix", "what differs"]
    assert "4 MMLU vs 200 GPQA Main rows" in vs.loc["exp1.bf16.suffix", "what differs"]
    amap = artifact_map(profile_ledgers, ref, "notebooks/06_tables.ipynb", "notebooks/07_figures.ipynb")
    assert set(ids) <= set(amap.index)
    assert amap.loc["exp1.bf16.suffix", "ledger files"] == f"{PROFILE}/{profile_ledgers['exp1-bfloat16'].dir.name}/rows.jsonl"
    assert amap.loc["near_tie", "reproduced by"] == "notebooks/07_figures.ipynb"
    assert amap.loc["exp4.joint_recovery", "ledger written by"] == "notebooks/04_experiment4_cache_transplant.ipynb"
    assert amap.loc["exp5.accuracy", "ledger written by"] == (
        "notebooks/02_experiment2_fixed_prefix_precision.ipynb; notebooks/05_experiment5_replication.ipynb")
    setup = setup_table(profile_ledgers, ref)
    assert setup.loc["rows, Exp 5", "this run"] == "4"


# ----------------------------------------------------------------------------- figure data


def test_divergence_margins_label_steps_and_drop_after_divergence(chain):
    root, _ = chain
    recs = load_profile_ledgers(root, PROFILE).records("exp1-bfloat16")
    df = divergence_margins(recs, "live")
    div = df[df.problem_id == "mmlu-aaaa"]
    assert list(div.step) == [0, 2, 3]  # step 1 forced (no margin), steps 4+ after the divergence
    # the tied prefill arm (margin exactly 0) decides: the smaller margin of the two arms at the first divergence
    assert list(div.kind) == ["shared", "shared", "first divergence, exact tie"]
    assert div.loc[div.kind == "first divergence, exact tie", "margin"].item() == 0.0
    other = df[df.problem_id == "mmlu-cccc"]
    assert other.loc[other.step == 3, "kind"].item() == "first divergence, margin > 0"
    assert other.loc[other.step == 3, "margin"].item() == 0.01
    same = df[df.problem_id == "mmlu-bbbb"]
    assert list(same.step) == [0, 2, 3, 4, 5] and set(same.kind) == {"shared"}
    pct = margin_percentiles(df)
    # shared margins: 2 per divergent row, 5 per identical row; 0.01 also occurs at step 3 of the 2 identical rows
    assert pct == [0.0, pytest.approx(100 * 2 / 14)]


def test_first_divergence_frame_and_transplant_outcomes(chain):
    root, _ = chain
    profile_ledgers = load_profile_ledgers(root, PROFILE)
    fd = first_divergence_frame({"a": profile_ledgers.records("exp1-bfloat16"), "b": profile_ledgers.records("exp2-float32")})
    assert list(fd.group) == ["a", "a"] and set(fd.first_divergence) == {3}
    out = transplant_outcomes(profile_ledgers.records("exp4-bfloat16"))
    whole = out[(out.intervention == "whole") & (out.stratum == "divergent")]
    assert set(whole.outcome) == {"donor"} and whole.rows.sum() == 4  # 2 rows x 2 directions
    assert out[(out.stratum == "exact")].outcome.unique().tolist() == ["baseline"]
    assert out.rows.sum() == 4 * 2 * 2  # rows x interventions x directions


# ----------------------------------------------------------------------------- explorer helpers


def test_comparison_arms_and_pick_row(chain):
    root, _ = chain
    assert comparison_arms("exp1", "prefill_vs_live") == ("live", "prefill")
    assert comparison_arms("exp2", "incremental_replica") == ("incremental", "incremental_replica")
    with pytest.raises(ValueError, match="prefill_vs_incremental"):
        comparison_arms("exp2", "prefill_vs_live")
    recs = load_profile_ledgers(root, PROFILE).records("exp1-bfloat16")
    assert pick_row(recs, None, "exp1")["problem_id"] == "mmlu-aaaa"
    assert pick_row(recs, "mmlu-dddd", "exp1")["problem_id"] == "mmlu-dddd"
    with pytest.raises(KeyError, match="mmlu-aaaa"):
        pick_row(recs, "nope", "exp1")
    df = layer_drift_frame(recs[0]["boundary"]["prefill_vs_live"]["tensors"])
    assert list(df.layer) == [0, 0, 1, 1] and list(df.kind) == ["key", "value"] * 2


def test_drift_maps_per_head_and_position():
    g = torch.Generator().manual_seed(0)
    ref = [(f"L{i:02d}.{k}", torch.randn(2, 3, 5, 4, generator=g)) for i in range(2) for k in ("key", "value")]
    other = [(n, t.clone()) for n, t in ref]
    other[0][1][:, 1, 2, :] += 1.0  # L00.key: head 1, position 2
    maps = drift_maps(ref, other)
    head, pos = maps[("key", "head")], maps[("key", "position")]
    assert head.shape == (2, 3) and pos.shape == (2, 5)
    r = ref[0][1][0].double()
    assert head.loc[0, 1] == pytest.approx(2.0 / r[1].norm().item())  # ||[1,1,1,1]|| = 2
    assert pos.loc[0, 2] == pytest.approx(2.0 / r[:, 2].norm().item())
    assert head.drop(index=0).eq(0).all().all() and (head.loc[0].drop(1) == 0).all()
    assert maps[("value", "head")].eq(0).all().all()
    zero = [(n, torch.zeros_like(t)) for n, t in ref]
    assert math.isnan(drift_maps(zero, zero)[("key", "head")].iloc[0, 0])


def test_fingerprint_matches_after_json_round_trip():
    ledger = {"cache": {"exact": False, "rel_l2": 0.1}, "logits": {"topk_ref": [1, 2]}}
    rebuilt = {"cache": {"exact": False, "rel_l2": 0.1}, "logits": {"topk_ref": (1, 2)}, "tensors": []}
    assert fingerprint_matches(ledger, rebuilt) == {"cache": True, "logits": True}
    rebuilt["cache"]["rel_l2"] = 0.1000001
    assert fingerprint_matches(ledger, rebuilt)["cache"] is False


class _Tok:
    def decode(self, ids):
        return "".join(f"<{i}>" if i != 0 else "\n" for i in ids)


def test_suffix_alignment_and_topk_frame():
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9]
    al = suffix_alignment(_Tok(), a, b, MARGINS, MARGINS, first=3, before=2, after=1)
    assert list(al.index) == [1, 2, 3, 4]
    assert list(al.same) == [True, True, False, False]
    assert al.loc[3, "reference"] == "<4>" and al.loc[3, "other"] == "<9>"
    assert token_text(_Tok(), 0) == "\\n"
    assert len(suffix_alignment(_Tok(), a, a, MARGINS, MARGINS, first=None)) == 6
    ref = torch.tensor([0.0, 5.0, 4.0, 1.0])
    oth = torch.tensor([0.0, 4.0, 5.0, 1.0])
    tk = topk_frame(_Tok(), ref, oth, k=1)
    assert list(tk.index) == [1, 2]
    assert tk.loc[2, "other - reference"] == 1.0 and tk.loc[1, "rank (other)"] == 2


def test_model_for_ledger(chain):
    root, _ = chain
    ledger = load_profile_ledgers(root, PROFILE)["exp1-bfloat16"]
    assert model_for_ledger(ledger) == "embedded"
    assert model_for_ledger(ledger, "/x/y.gguf") == "/x/y.gguf"
    ledger.manifest["config"]["model"] = {"model": "mine", "files": {"config.json": "0"}}
    with pytest.raises(ValueError, match="pass its path"):
        model_for_ledger(ledger)


def test_artifact_map_names_functions_that_exist(tmp_path):
    """Every 'computed by' path of data/paper/artifacts.yaml is a real function under kvreplay; a bad entry is refused."""
    import importlib
    import re

    import yaml

    from kvreplay.report.paper_tables import load_artifacts

    entries = load_artifacts()
    assert entries and len({e["id"] for e in entries}) == len(entries)
    for e in entries:
        for path in re.findall(r"(?<![\w.])((?:[a-z_]+\.)+[A-Za-z_]\w*)", e["function"]):
            module, name = path.rsplit(".", 1)
            assert callable(getattr(importlib.import_module(f"kvreplay.{module}"), name)), f"{e['id']}: kvreplay.{path}"
    bad = tmp_path / "artifacts.yaml"
    bad.write_text(yaml.safe_dump([{**entries[0], "ledgers": ["exp9-bfloat16"]}]))
    with pytest.raises(ValueError, match="exp9-bfloat16"):
        load_artifacts(bad)


def test_a_misspelled_ledger_key_names_the_closest_known_one():
    """The drift explorer's `precision = "bf16"` ended in a bare KeyError: now it names what exists."""
    from kvreplay.ledger.lookup import find_chain_ledger
    from kvreplay.paths import LEDGERS

    with pytest.raises(KeyError, match=r"'exp1-bf16' is not a ledger of the chain \(did you mean 'exp1-bfloat16'\?\)"):
        find_chain_ledger(LEDGERS, "cpu", "exp1-bf16")
