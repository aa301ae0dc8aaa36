"""The cross-hardware table counts token-identical prefixes and suffixes on the rows two profiles share."""

import json

from kvreplay.report.cross_hardware import compare, cross_hardware_table, exp1_records


def _row(pid, prefix, live, prefill, gate=None):
    return {"problem_id": pid, "prefix": prefix, "gate_failure": gate,
            "arms": {"live": {"suffix": live}, "prefill": {"suffix": prefill}},
            "endpoints": {"suffix_differs": live != prefill}}


def _ledger(root, profile, dtype, rows, tag="abc"):
    from kvreplay.ledger.store import Ledger

    ledger = Ledger(root / profile, f"exp1-{dtype}", {"problem_ids": [r["problem_id"] for r in rows], "tag": tag})
    (ledger.dir / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_counts_on_shared_rows(tmp_path):
    _ledger(tmp_path, "a", "bfloat16", [_row("p1", [1, 2], [3], [3]), _row("p2", [1, 2], [3, 4], [3, 5]),
                                         _row("p3", [7], [1], [1]), _row("only-a", [0], [0], [0])])
    _ledger(tmp_path, "b", "bfloat16", [_row("p1", [1, 2], [3], [9]), _row("p2", [1, 9], [3, 4], [3, 5]),
                                         _row("p3", [7], [1], [1], gate={"gate": "x", "reason": "y"})])
    c = compare(exp1_records(tmp_path, "a", "bfloat16"), exp1_records(tmp_path, "b", "bfloat16"))
    assert c == {"rows": 2, "prefix_same": 1, "live_same": 1, "prefill_same": 0, "divergent_a": 1, "divergent_b": 2}
    t = cross_hardware_table(tmp_path, setups=(("a", "A"), ("b", "B"), ("c", "C")), precisions=("bfloat16",))
    assert list(t.index) == [("A (`a`) vs B (`b`)", "bfloat16")]  # pairs with no shared row are left out
    assert t.iloc[0]["boundary prefix same"] == "1/2"
    assert t.iloc[0]["suffixes diverge (first / second setup)"] == "1/2 / 2/2"
