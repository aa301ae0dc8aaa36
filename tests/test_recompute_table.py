"""The table that sets a recomputed arm's rows beside the earlier ones (kvreplay.report.recompute)."""

import pytest

from kvreplay.report.recompute import old_vs_new, table


def _rec(pid: str, live: list[int], prefill: list[int], failed: bool = False) -> dict:
    return {"problem_id": pid, "gate_failure": {"gate": "desync"} if failed else None,
            "arms": {"live": {"suffix": live}, "prefill": {"suffix": prefill}}}


def test_old_vs_new_counts_each_cell_on_the_common_clean_problems():
    old = [_rec("a", [1, 2], [1, 3]), _rec("b", [1], [1]), _rec("c", [1, 2], [1]), _rec("d", [5], [5]),
           _rec("e", [1], [2], failed=True), _rec("only-old", [1], [2])]
    new = [_rec("a", [1, 2], [1, 2]), _rec("b", [1], [2]), _rec("c", [1, 2], [1, 4]), _rec("d", [5], [5]),
           _rec("e", [1], [1])]
    r = old_vs_new(old, new)
    assert (r["problems"], r["gate_failures"], r["both"], r["old_only"], r["new_only"], r["neither"]) == (
        4, 1, 1, 1, 1, 1)
    assert (r["old_rate"].k, r["new_rate"].k, r["mcnemar_p"]) == (2, 2, 1.0)
    assert list(table(r, "sdpa-32", "flex-128").columns)[1:3] == ["part under sdpa-32", "part under flex-128"]
    with pytest.raises(ValueError, match="share no problem"):
        old_vs_new(old, [_rec("z", [1], [1])])


def test_another_pair_of_arms_is_compared_where_asked():
    """Experiment 2's fixed prefixes compare prefill with incremental: a record whose prefill and live agree but
    whose incremental parts counts as parting there."""
    rec = {"problem_id": "a", "gate_failure": None,
           "arms": {"live": {"suffix": [1]}, "prefill": {"suffix": [1]}, "incremental": {"suffix": [2]}}}
    assert old_vs_new([rec], [rec])["both"] == 0
    assert old_vs_new([rec], [rec], ("prefill", "incremental"))["both"] == 1
