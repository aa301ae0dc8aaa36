"""The committed ledgers of the earlier, unpaired kernel ablation (``report.kernel_ablation_legacy``): read and checked
as written, damaged copies refused, and their ``table.md`` rendered from them with the rows of a library no commit
has marked."""

from __future__ import annotations

import json
import shutil

import pytest
from kvreplay.ledger.files import LedgerError, LedgerLineError
from kvreplay.ledger.records import RowSchemaError
from kvreplay.paths import ROOT
from kvreplay.report import kernel_ablation_legacy as legacy

COMMITTED = ROOT / "data" / "kernel_ablation" / "cpu"


def _copy(root, *names):
    for name in names:
        folder = next(COMMITTED.glob(f"{name}-*"))
        shutil.copytree(folder, root / folder.name)
    return root


def test_the_committed_ledgers_fit_their_records_and_table_md_is_theirs(tmp_path, capsys):
    found = legacy.load_ablation(COMMITTED, "bfloat16")
    assert list(found.by_value)[:2] == ["default", "invariant"] and all(found.by_value.values())
    assert found.orders and all(r["kernels"] == {"order_a": legacy.ORDER_A, "order_b": legacy.ORDER_B}
                                for r in found.orders)
    assert set(legacy.load_ablation(COMMITTED, "float32").by_value) == {"default", "invariant"}
    assert legacy.main(["--check"]) == 0, capsys.readouterr().out  # the committed table.md is the ledgers'
    root = _copy(tmp_path / "cpu", "kernels-bfloat16-default", "kernels-bfloat16-invariant")
    (root / "table.md").write_text("typed by hand\n")
    assert legacy.main(["--root", str(root), "--check"]) == 1 and "differs" in capsys.readouterr().out
    assert legacy.main(["--root", str(root)]) == 0 and legacy.main(["--root", str(root), "--check"]) == 0
    text = (root / "table.md").read_text()
    assert "`python -m kvreplay.report.kernel_ablation_legacy`" in text and "first 16 bank problems" in text
    assert "Two fixed orders" not in text  # no orders ledger in the copy
    shutil.rmtree(next(root.glob("kernels-bfloat16-default-*")))
    assert legacy.main(["--root", str(root)]) == 2 and "no kernels-bfloat16-default ledger" in capsys.readouterr().err


def test_the_ablation_table_counts_rows_of_a_library_of_no_known_commit():
    found = legacy.load_ablation(COMMITTED, "bfloat16")
    marked = legacy.rows_of_unknown_libraries({v: found.folders[f"kernels-bfloat16-{v}"] for v in found.by_value})
    assert legacy.ablation_table(found.by_value) == legacy.ablation_table(found.by_value, {})  # no column without marks
    lines = legacy.ablation_table(found.by_value, marked).splitlines()
    assert lines[0].endswith("| rows by a library of no known commit (of them part) |") and lines[1].count("---") == 8
    default = next(x for x in lines if x.startswith("| `default` |"))
    parted = sum(r["diverged"] for r in found.by_value["default"] if r["problem_id"] in marked["default"])
    assert marked["default"] and default.endswith(f"| {len(marked['default'])} ({parted}) |")
    assert (COMMITTED / "table.md").read_text().count(default) == 1  # the committed table carries the column


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
    lines = legacy.orders_table(orders, by_value).splitlines()
    assert lines[2].endswith("| 2 | 1/2 | 5.00e-04 [0.00e+00, 1.00e-03] | 1/2 (1) | 1/2 |")
    assert lines[3].startswith("| `default` prefill vs live (same problems) | 1 | 0/1 | 8.00e-03")  # p9 left out
    assert "(2/2 same boundary prefix) | 2 | - | - | 1/2 (-) | 1/2 |" in lines[4]


def test_damaged_copies_are_refused(tmp_path):
    root = _copy(tmp_path / "a", "kernels-bfloat16-default", "kernels-bfloat16-invariant-except-norm")
    folder = next(root.glob("kernels-bfloat16-default-*"))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["config"]["threads"] = 3  # the config no longer has the folder's digest
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(LedgerError, match="config_digest"):
        legacy.load_ablation(root, "bfloat16")
    root = _copy(tmp_path / "b", "kernels-bfloat16-default")
    rows = next(root.glob("*/rows.jsonl"))
    lines = rows.read_text().splitlines()
    rows.write_text("\n".join([lines[0].replace('"kernels":"default"', '"kernels":"invariant"'), *lines[1:]]) + "\n")
    with pytest.raises(LedgerError, match="computed under other kernels"):
        legacy.load_ablation(root, "bfloat16")
    rows.write_text("\n".join([lines[0].replace('"diverged":', '"parted":'), *lines[1:]]) + "\n")
    with pytest.raises(RowSchemaError, match="kernel-ablation kernels ledger"):
        legacy.load_ablation(root, "bfloat16")
    rows.write_text("\n".join(lines) + "\n")
    first = json.loads(lines[0])["problem_id"]
    with (rows.parent / "runlog.jsonl").open("a") as log:  # a sampled check that failed on the first row
        log.write(json.dumps({"event": "equivalence_sample", "passed": False, "rows": [first]}) + "\n")
    with pytest.raises(LedgerLineError, match="sampled float32"):
        legacy.load_ablation(root, "bfloat16")
    with pytest.raises(LedgerError, match="no kernel-ablation ledgers"):
        legacy.load_ablation(tmp_path / "nowhere", "bfloat16")
