"""``python -m kvreplay.bench invariance`` (:mod:`kvreplay.bench.invariance`) runs on the CPU at tiny sizes, unit by unit: each finished unit is written at once,
a rerun keeps them, a unit file of other settings is refused, and ``--budget-s`` stops cleanly (outcomes are not
asserted)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time

import pytest
import torch
from conftest import TINY_FORMAT, tiny_lm, tiny_problems
from kvreplay.decoding.contract import Caps, resolve_format
from kvreplay.model.execution import resolve_contract
from kvreplay.paths import ROOT


def _script():
    from kvreplay.bench import invariance as bench_invariance

    return bench_invariance


def _loader(calls: list):
    def load(dtype: str):
        calls.append(dtype)
        lm = tiny_lm("qwen2", {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype])
        lm.contract = resolve_contract(kernels="invariant")
        return lm, resolve_format(lm.tokenizer, TINY_FORMAT)
    return load


ARGS = ["--device", "cpu", "--rows", "1", "--caps", "2", "2", "1", "--sizes", "3", "2", "--dtypes", "float32"]


def test_script_writes_each_unit_and_its_report(tmp_path, capsys):
    mod, calls = _script(), []
    path = mod.main([*ARGS, "--out", str(tmp_path)], load=_loader(calls), problems=tiny_problems(1))
    report = json.loads(path.read_text())
    assert [(r["dtype"], r["kernels"]) for r in report["runs"]] == [("float32", "invariant"), ("float32", "default")]
    row = report["runs"][0]["rows"][0]
    assert set(row["batch"]) == {"2", "3"} and report["stopped"] is None
    assert {"live_vs_prefill", "live_vs_incremental", "rel_l2_prefill_vs_live", "boundary_ids"} <= set(row["construction"])
    assert report["runs"][0]["environment"]["contract"]["kernels"] == "invariant"
    pid = tiny_problems(1)[0].problem_id
    files = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "units").rglob("*.json"))
    assert files == [f"units/float32/{v}/{pid}/{c}.json" for v in ("default", "invariant")
                     for c in ("batch-2", "batch-3", "construction")]
    out = capsys.readouterr().out
    assert "[1/6] float32 invariant" in out and "batch-2: start" in out  # the smallest batch first
    # a rerun keeps every unit and loads no model
    calls.clear()
    again = json.loads(mod.main([*ARGS, "--out", str(tmp_path)], load=_loader(calls), problems=tiny_problems(1)).read_text())
    assert calls == [] and again["runs"] == report["runs"]
    assert "kept" in capsys.readouterr().out
    # a unit file of other settings (other caps) is refused, naming it
    with pytest.raises(SystemExit, match="construction.json: a unit of other settings"):
        mod.main([*ARGS[:4], "--caps", "3", "2", "1", "--sizes", "2", "--dtypes", "float32", "--out", str(tmp_path)],
                 load=_loader(calls), problems=tiny_problems(1))


def test_whole_runs_the_construction_first(tmp_path, capsys):
    mod = _script()
    path = mod.main([*ARGS, "--whole", "--values", "invariant", "--out", str(tmp_path)], load=_loader([]),
                    problems=tiny_problems(1))
    row = json.loads(path.read_text())["runs"][0]["rows"][0]
    assert set(row["batch"]) == {"2", "3"} and row["construction"]["boundary"] == len(row["construction"]["boundary_ids"])
    assert "[1/3] float32 invariant tiny-00 construction: start" in capsys.readouterr().out


def test_budget_stops_cleanly(tmp_path):
    mod = _script()

    def slow(dtype: str):
        time.sleep(5)
        raise AssertionError("the budget should have stopped the load")

    path = mod.main([*ARGS, "--out", str(tmp_path), "--budget-s", "0.5"], load=slow, problems=tiny_problems(1))
    report = json.loads(path.read_text())
    assert report["stopped"].startswith("budget: 0.5 s reached during a unit") and not (tmp_path / "units").exists()
    units = mod.Units(tmp_path, Caps(2, 2, 1), [2], False, budget_s=10.0)
    units.longest = {"construction": 20.0, "batch": 0.1}
    assert units.may_start("batch-2") and not units.may_start("construction")


def test_engine_sizes_add_the_batched_engines_check_as_a_unit(tmp_path):
    mod = _script()
    path = mod.main([*ARGS, "--values", "invariant", "--engine-sizes", "2", "--out", str(tmp_path)],
                    load=_loader([]), problems=tiny_problems(1))
    row = json.loads(path.read_text())["runs"][0]["rows"][0]
    assert row["engine"] == {"eager_vs_alone": [], "2": []}  # the engine's check, under invariant kernels
    assert (tmp_path / "units" / "float32" / "invariant" / tiny_problems(1)[0].problem_id / "engine.json").is_file()


@pytest.mark.parametrize("name", ["invariance", "engine-suite", "ray"])
def test_every_bench_subcommand_reaches_its_module(name, capsys):
    """`python -m kvreplay.bench <subcommand> --help` prints the subcommand's own help (its module imports)."""
    from kvreplay.bench import main

    with pytest.raises(SystemExit) as stop:
        main([name, "--help"])
    assert stop.value.code == 0 and "usage:" in capsys.readouterr().out
