"""The kernel attribution (``experiments.kernel_ablation``): an arm like every other, one ledger per kernels value of
the profile, on pinned boundary prefixes, through Experiment 2's gates; its summary and declared contrasts."""

from __future__ import annotations

import json
import types

import pytest
from conftest import tiny_problems
from kvreplay.experiments.arms import ARMS
from kvreplay.experiments.fixed_prefix import EXP2
from kvreplay.experiments.kernel_ablation import EXP2_KERNELS, contrast_table, kernel_summary, kernel_table
from kvreplay.experiments.live_vs_prefill import EXP1
from kvreplay.gates import GateError
from kvreplay.ledger.lookup import PREFIX_BANK
from kvreplay.ledger.prefix_bank import write_prefix_bank
from kvreplay.ledger.records import validate_rows
from kvreplay.paper.chain import CHAIN
from kvreplay.notebook.profiles import KERNEL_CONTRASTS, load_parameters

TINY_ARM_DTYPE = "bfloat16"
VALUES = ("default", "invariant", "invariant-except-attention")


def _chain(values, prefixes=None):
    problems = tiny_problems(2)
    fixed = types.SimpleNamespace(rows=problems, sha256="ab" * 32,
                                  prefixes=prefixes or {p.problem_id: [1, 2, 3] for p in problems})
    return types.SimpleNamespace(params=types.SimpleNamespace(kernel_values=values, preflight_fixed=1), fixed=fixed)


def test_the_arm_is_planned_once_per_value_and_declared_in_the_profile():
    plans = EXP2_KERNELS.plans(_chain(VALUES))
    assert [dict(p.key) for p in plans] == [{"prefix_bank_sha256": "ab" * 32, "kernels": v} for v in VALUES]
    assert all(p.prefixes == plans[0].prefixes and p.preflight == 1 for p in plans)  # the same pinned inputs
    with pytest.raises(ValueError, match="once per value"):
        EXP2_KERNELS.prepare(_chain(VALUES))
    assert ARMS["exp2_kernels"] is EXP2_KERNELS and EXP2_KERNELS.row is EXP2.row and EXP2_KERNELS.prefixes
    assert EXP2_KERNELS.facts.reads == ("exp1-bfloat16",) and EXP2_KERNELS.dtypes == ("bfloat16",)
    smoke = load_parameters("smoke")
    assert set(smoke.kernel_values) >= {v for pair in KERNEL_CONTRASTS for v in pair}
    assert smoke.kernel_contrasts == KERNEL_CONTRASTS
    assert load_parameters("cpu").kernel_values == smoke.kernel_values  # declared, but its notebook is off the chain
    assert not [n for n in CHAIN if n.startswith("09")]  # so make paper computes nothing for it
    for overrides, match in (({"kernel_values": ["fastest"]}, "unknown kernels value"),
                             ({"kernel_values": ["default", "default"]}, "listed twice"),
                             ({"kernel_values": ["default", "invariant"]}, "kernel_contrasts"),
                             ({"kernel_values": ["default", "invariant"], "kernel_contrasts": [["default", "default"]]},
                              "kernel_contrasts")):
        with pytest.raises(ValueError, match=match):
            load_parameters("smoke", overrides)


def test_a_tiny_kernel_arm_pins_its_inputs_passes_every_gate_and_verifies(tmp_path, tiny_arm):
    problems = tiny_problems(3)
    settings = tiny_arm()
    live, source = EXP1.run(settings, problems, ledger_root=tmp_path, progress=False)  # the reference live decode
    bank = write_prefix_bank(live, tmp_path / settings.profile / PREFIX_BANK, source.dir.name)  # as notebook 01 does
    pinned = {r["problem_id"]: r["prefix"] for r in live}
    records, ledgers = {}, {}
    for v in VALUES:
        plan = EXP2_KERNELS.plan(problems, key={"prefix_bank_sha256": bank, "kernels": v}, prefixes=pinned)
        assert plan.bind(settings).kernels == v
        records[v], ledgers[v] = plan.run(settings, ledger_root=tmp_path, progress=False)
    assert len({led.dir for led in ledgers.values()}) == len(VALUES)
    engine = EXP2_KERNELS.plan(problems, key={"prefix_bank_sha256": bank, "kernels": "invariant-except-linear"},
                               prefixes=pinned)
    with pytest.raises(ValueError, match="eager decoders only"):  # refused before any row: its bits would need B = 1
        engine.run(tiny_arm(step_path="engine-eager"), ledger_root=tmp_path, progress=False)
    for v, rows in records.items():
        assert [r["gate_failure"] for r in rows] == [None] * 3, v
        assert validate_rows("exp2_kernels", rows) == rows
        assert [r["prefix"] for r in rows] == [pinned[p.problem_id] for p in problems]  # the same IDs in every value
        folder = ledgers[v].dir
        assert folder.name.startswith("exp2_kernels-bfloat16-")
        config = json.loads((folder / "manifest.json").read_text())["config"]
        assert config["kernels"] == v and config.get("execution", {}).get("kernels", "default") == v
        env = json.loads((folder / "environment.json").read_text())
        assert env["execution_contract"]["contract"].get("kernels", "default") == v and env["row_algorithm"] == 2
        events = [json.loads(x) for x in (folder / "runlog.jsonl").read_text().splitlines()]
        assert {"start", "end"} <= {e["event"] for e in events}
        assert all(e["library_sha256"] == ledgers[v].library for e in events)
    # under invariant kernels prefill equals the replay by construction, so no suffix parts
    assert all(r["endpoints"]["boundary_exact"] and not r["endpoints"]["suffix_differs"] for r in records["invariant"])
    from kvreplay.verify import verify_ledger  # make verify reloads the model under the ledger's kernels value

    checks = verify_ledger(ledgers["invariant-except-attention"].dir, rows=1, pick="first", problems=problems,
                           model=str(tmp_path / "tiny-llama"))
    assert [(c.mode, c.ok) for c in checks] == [("bytes", True)]
    summary, contrasts = kernel_summary(records, KERNEL_CONTRASTS)
    assert list(summary) == list(VALUES) and summary["invariant"].replay_exact == 3
    assert summary["invariant"].suffix.k == 0 and max(summary["invariant"].rel_l2) == 0
    assert [(c.a, c.b, c.n) for c in contrasts] == [(*pair, 3) for pair in KERNEL_CONTRASTS]
    assert list(kernel_table(summary).index) == [f"`{v}`" for v in VALUES]
    assert len(contrast_table(contrasts)) == 3


def _row(pid, differs, exact=False, tie=False, rel=1e-3):
    return {"problem_id": pid, "gate_failure": None,
            "boundary": {"prefill_vs_incremental": {"cache": {"rel_l2": 0.0 if exact else rel}}},
            "endpoints": {"boundary_exact": exact, "suffix_differs": differs, "tie_initiated": tie if differs else None}}


def test_the_summary_pairs_problems_and_counts_ties_on_hand_built_rows():
    default = [_row("a", True, tie=True), _row("b", True), _row("c", False), _row("d", True, tie=True)]
    invariant = [_row(x, False, exact=True) for x in "abcd"]
    except_attention = [_row("a", True, tie=True), _row("b", False), _row("c", True), _row("d", False)]
    by_value = {"default": default, "invariant": invariant, "invariant-except-attention": except_attention}
    summary, contrasts = kernel_summary(by_value, KERNEL_CONTRASTS + (("default", "invariant-except-linear"),))
    assert (summary["default"].suffix.k, summary["default"].tie, summary["default"].replay_exact) == (3, 2, 0)
    assert (summary["invariant"].suffix.k, summary["invariant"].replay_exact) == (0, 4)
    assert [(c.mcnemar.b, c.mcnemar.c) for c in contrasts] == [(3, 0), (2, 1), (2, 0)]  # a value without rows: left out
    assert contrasts[0].mcnemar.pvalue == pytest.approx(0.25)
    with pytest.raises(ValueError, match="not the same problems"):
        kernel_summary({"default": default, "invariant": invariant[:3]}, KERNEL_CONTRASTS)
    failed = dict(default[0], gate_failure={"gate": "desync", "reason": "x"})
    with pytest.raises(GateError):
        kernel_summary({"default": [failed, *default[1:]]}, ())

