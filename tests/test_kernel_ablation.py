"""The invariant-kernel attribution control (``experiments.kernel_ablation``): its rows on a tiny model fit their
records, two fixed orders are compared on the same IDs, and the committed ablation ledgers keep their keys and fit."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_CAPS, TINY_FORMAT, tiny_lm, tiny_problems
from kvreplay import kernels
from kvreplay.contract import Caps, resolve_format
from kvreplay.execution import resolve_contract
from kvreplay.experiments import kernel_ablation as ka
from kvreplay.ledger.records import RowSchemaError
from kvreplay.ledger.store import config_digest
from kvreplay.paths import ROOT
from kvreplay.problems import load_bank
from kvreplay.profiles import load_parameters
from kvreplay.runner import ArmSettings

COMMITTED = ROOT / "data" / "kernel_ablation" / "cpu"


def _lm(value: str, dtype=torch.float32):
    lm = tiny_lm("llama", dtype)
    lm.contract = resolve_contract(kernels=value)
    return lm, resolve_format(lm.tokenizer, TINY_FORMAT)


def test_ablation_and_orders_rows_fit_their_records():
    lm, fmt = _lm("invariant")
    p = tiny_problems(1)[0]
    row = ka.ablation_row(lm, fmt, p, TINY_CAPS)
    assert ka.check_rows("kernels", [row]) and row["drift"]["exact"] and not row["diverged"]  # by construction
    same = ka.orders_row(lm, fmt, p, TINY_CAPS, "invariant", "invariant")
    assert same["drift"]["exact"] and same["logits_exact"] and not same["diverged"]
    assert same["order_a"] == row["live"] and same["prefix"] == row["prefix"]
    two = ka.orders_row(lm, fmt, p, TINY_CAPS)
    assert ka.check_rows("orders", [two]) and two["kernels"] == {"order_a": ka.ORDER_A, "order_b": ka.ORDER_B}
    assert lm.contract.kernels == "invariant"  # restored
    assert two["order_a"] == row["live"]
    bad = dict(two, drift=dict(two["drift"], rel_l2=0))
    with pytest.raises(RowSchemaError, match="drift.rel_l2"):
        ka.check_rows("orders", [bad])


def test_orders_table_sets_the_orders_beside_default():
    def row(pid, exact, rel, div, tie, la, lb, key_a="live", key_b="prefill", prefix=(1, 2), suffix=(3,)):
        return {"problem_id": pid, "drift": {"exact": exact, "rel_l2": rel}, "diverged": div, "tie_initiated": tie,
                "prefix": list(prefix), key_a: {"predicted": la, "suffix": list(suffix)}, key_b: {"predicted": lb}}
    orders = [row("p1", False, 1e-3, True, True, "A", "B", "order_a", "order_b"),
              row("p2", True, 0.0, False, False, "C", "C", "order_a", "order_b")]
    by_value = {"default": [row("p1", False, 8e-3, True, False, "A", "A"), row("p9", False, 1.0, True, True, "A", "B")],
                "invariant": [row("p1", True, 0.0, False, False, "A", "A"), row("p2", True, 0.0, False, False, "C", "C")],
                "invariant-attention-block-128": [row("p1", True, 0.0, False, False, "B", "B", suffix=(4,)),
                                                  row("p2", True, 0.0, False, False, "C", "C")]}
    lines = ka.orders_table(orders, by_value).splitlines()
    assert lines[2].endswith("| 2 | 1/2 | 5.00e-04 [0.00e+00, 1.00e-03] | 1/2 (1) | 1/2 |")
    assert lines[3].startswith("| `default` prefill vs live (same problems) | 1 | 0/1 | 8.00e-03")  # p9 left out
    assert "(2/2 same boundary prefix) | 2 | - | - | 1/2 (-) | 1/2 |" in lines[4]


def test_the_ablation_table_counts_rows_of_a_library_of_no_known_commit():
    from kvreplay.report.provenance_pages import rows_of_unknown_libraries

    found = ka.load_ablation(COMMITTED, "bfloat16")
    marked = rows_of_unknown_libraries({v: found.folders[f"kernels-bfloat16-{v}"] for v in found.by_value})
    assert ka.ablation_table(found.by_value) == ka.ablation_table(found.by_value, {})  # no column without marks
    lines = ka.ablation_table(found.by_value, marked).splitlines()
    assert lines[0].endswith("| rows by a library of no known commit (of them part) |") and lines[1].count("---") == 8
    default = next(x for x in lines if x.startswith("| `default` |"))
    parted = sum(r["diverged"] for r in found.by_value["default"] if r["problem_id"] in marked["default"])
    assert default.endswith(f"| {len(marked['default'])} ({parted}) |")
    assert (COMMITTED / "table.md").read_text().count(default) == 1  # the committed table carries the column


def test_committed_ablation_ledgers_keep_their_keys_and_fit():
    """Every committed ablation ledger's folder is the key today's code computes for its value (so no existing
    value's key moved), and its rows fit their record."""
    folders = sorted(p for p in COMMITTED.iterdir() if p.is_dir())
    assert folders, COMMITTED
    params = load_parameters("cpu")
    caps = Caps(params.cap_branch, params.cap_merge, params.cap_answer)
    for folder in folders:
        manifest = json.loads((folder / "manifest.json").read_text())
        config = manifest["config"]
        problems = load_bank()[: len(config["problem_ids"])]
        kind = folder.name.split("-", 1)[0]
        value = config.get("execution", {}).get("kernels", kernels.DEFAULT)
        settings = ArmSettings(profile="cpu", dtype=config["dtype"], caps=caps, threads=config["threads"], kernels=value)
        ours = (settings.config("kernel_ablation", problems) if kind == "kernels"
                else settings.config("kernel_orders", problems) | {"orders": [ka.ORDER_A, ka.ORDER_B]})
        assert config_digest(ours) == manifest["config_digest"] and folder.name.endswith(manifest["config_digest"][:12])
        rows = [json.loads(line) for line in (folder / "rows.jsonl").read_text().splitlines()]
        ka.check_rows(kind, rows)
        assert all(r["kernels"] == value for r in rows) if kind == "kernels" else True


def _copy(tmp_path, *names):
    import shutil

    root = tmp_path / "cpu"
    for name in names:
        shutil.copytree(next(COMMITTED.glob(f"{name}-*")), root / next(COMMITTED.glob(f"{name}-*")).name)
    return root


def test_load_ablation_reads_the_committed_ledgers_and_refuses_damaged_ones(tmp_path):
    found = ka.load_ablation(COMMITTED, "bfloat16")
    assert list(found.by_value)[:2] == ["default", "invariant"] and all(found.by_value.values())
    frame = ka.ablation_frame(found)
    assert frame.loc["`default`: prefill vs live", "suffixes part"].startswith(
        f"{sum(r['diverged'] for r in found.by_value['default'])}/{len(found.by_value['default'])} (")
    from kvreplay.ledger.files import LedgerError

    root = _copy(tmp_path, "kernels-bfloat16-default", "kernels-bfloat16-invariant-except-norm")
    folder = next(root.glob("kernels-bfloat16-default-*"))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["config"]["threads"] = 3  # the config no longer has the folder's digest
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(LedgerError, match="config digest does not match"):
        ka.load_ablation(root, "bfloat16")
    root = _copy(tmp_path / "b", "kernels-bfloat16-default")
    rows = next(root.glob("*/rows.jsonl"))
    lines = rows.read_text().splitlines()
    rows.write_text("\n".join([lines[0].replace('"kernels":"default"', '"kernels":"invariant"'), *lines[1:]]) + "\n")
    with pytest.raises(LedgerError, match="computed under other kernels"):
        ka.load_ablation(root, "bfloat16")
    rows.write_text("\n".join([lines[0].replace('"diverged":', '"parted":'), *lines[1:]]) + "\n")
    with pytest.raises(RowSchemaError, match="kernel-ablation kernels ledger"):
        ka.load_ablation(root, "bfloat16")
    with pytest.raises(LedgerError, match="no ablation ledgers"):
        ka.load_ablation(tmp_path / "nowhere", "bfloat16")


def test_notebook_reads_the_committed_ledgers(tmp_path):
    """Notebook 09 (not part of make paper) runs on the committed ledgers: its table and figure are written."""
    import papermill

    out = papermill.execute_notebook(str(ROOT / "notebooks" / "09_kernel_ablation.ipynb"), str(tmp_path / "run.ipynb"),
                                     parameters={"profile": "cpu", "out": str(tmp_path)}, cwd=str(ROOT),
                                     progress_bar=False, kernel_name="python3")
    text = json.dumps(out["cells"])
    assert "prefill = live bit for bit on every row" in text and "[saved figure" in text
    assert {p.name for p in tmp_path.iterdir()} >= {"kernel_ablation_bfloat16.md", "kernel_ablation_drift_bfloat16.png"}
