"""``scripts/gpu_invariance.py`` runs on the CPU at tiny sizes and writes its report (outcomes are not asserted)."""

from __future__ import annotations

import importlib.util
import json

import torch
from conftest import TINY_FORMAT, tiny_lm, tiny_problems
from kvreplay.contract import resolve_format
from kvreplay.execution import resolve_contract
from kvreplay.paths import ROOT


def test_script_writes_its_report(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_invariance", ROOT / "scripts/gpu_invariance.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def load(dtype: str):
        lm = tiny_lm("qwen2", {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype])
        lm.contract = resolve_contract(kernels="invariant")
        return lm, resolve_format(lm.tokenizer, TINY_FORMAT)

    monkeypatch.setenv("OUT", str(tmp_path))
    path = mod.main(["--device", "cpu", "--rows", "1", "--caps", "2", "2", "1", "--sizes", "2", "3", "--dtypes", "float32",
                     "--engine-sizes", "2"], load=load, problems=tiny_problems(1))
    report = json.loads(path.read_text())
    assert [(r["dtype"], r["kernels"]) for r in report["runs"]] == [("float32", "invariant"), ("float32", "default")]
    row = report["runs"][0]["rows"][0]
    assert set(row["batch"]) == {"2", "3"} and {"live_vs_prefill", "live_vs_incremental", "rel_l2_prefill_vs_live"} <= set(row)
    assert report["runs"][0]["environment"]["contract"]["kernels"] == "invariant"
    assert row["engine"] == {"eager_vs_alone": [], "2": []}  # the engine's check, under invariant kernels
