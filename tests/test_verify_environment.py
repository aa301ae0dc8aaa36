"""`make verify` compares bits wherever the recorded environment allows it, says up front where it cannot and why,
reports a bit difference on another GPU as "bits differ" (not a failure), and prints a summary when interrupted.

Environment records are the committed ledgers' own, edited to stand for another machine; the recomputation is
stubbed except in the last test, which recomputes a tiny model's rows.
"""

from __future__ import annotations

import copy
import json
import re
import signal
from types import SimpleNamespace

import pytest
from kvreplay import verify
from kvreplay.ledger.store import read_rows_text, row_lines
from kvreplay.paths import LEDGERS


def _ledger(profile: str, prefix: str):
    (folder,) = sorted((LEDGERS / profile).glob(f"{prefix}-*"))
    return folder


def _recorded(profile: str, prefix: str) -> dict:
    return json.loads((_ledger(profile, prefix) / "environment.json").read_text())["execution_contract"]


H200 = _recorded("paper", "exp1-bfloat16")  # written before SM count and cuBLAS were recorded


def _h100(**changes) -> dict:
    """The paper ledger's record as an H100 of the same capability, SM count, CUDA, torch, path and batch."""
    return copy.deepcopy(H200) | {"device_name": "NVIDIA H100 80GB HBM3", "gpu_sm_count": 132,
                                  "cublas": "nvidia-cublas==13.0.0.19"} | changes


def test_a_gpu_ledger_is_compared_bit_for_bit_on_another_gpu_of_the_same_fields():
    c = verify.compare_environments(H200, _h100())
    assert c.mode == "bits" and c.differs == ()
    assert c.unrecorded == ("gpu_sm_count", "cublas")  # named, not silently assumed
    assert "written on NVIDIA H200, recomputed on NVIDIA H100 80GB HBM3" in c.why
    assert "not recorded by the ledger: gpu_sm_count, cublas" in c.why
    same_card = verify.compare_environments(H200, copy.deepcopy(H200) | {"gpu_sm_count": 132})
    assert same_card.mode == "bytes"  # the kind of card that wrote it: a difference is a failure
    recorded = H200 | {"gpu_sm_count": 132, "cublas": "nvidia-cublas==13.0.0.19"}
    assert verify.compare_environments(recorded, _h100()).unrecorded == ()


@pytest.mark.parametrize("change, field", [
    ({"gpu_capability": "8.0"}, "gpu_capability"),
    ({"gpu_sm_count": 114}, "gpu_sm_count"),
    ({"torch": "2.12.0+cu130"}, "torch"),
    ({"cuda_runtime": "12.8"}, "cuda_runtime"),
    ({"engine": {"batch": 64, "max_len": 4077, "step_path": "graph"}}, "engine.batch"),
    ({"engine": {"batch": 32, "max_len": 4077, "step_path": "engine-eager"}}, "engine.step_path"),
])
def test_a_gpu_of_other_bit_relevant_fields_gets_the_portable_checks_naming_the_field(change, field):
    c = verify.compare_environments(H200 | {"gpu_sm_count": 132}, _h100(**change))
    assert c.mode == "portable" and c.differs == (field,)
    assert c.why.startswith(f"{field} ")


def test_a_cpu_ledger_needs_the_cpu_kind_isa_torch_and_threads_and_a_gpu_ledger_needs_a_gpu():
    cpu = _recorded("cpu", "exp1-bfloat16")
    assert verify.compare_environments(cpu, copy.deepcopy(cpu)).mode == "bytes"
    amx = cpu | {"cpu_isa_flags": ["amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2"],
                 "device_name": "Intel(R) Xeon(R) Processor"}
    c = verify.compare_environments(cpu, amx)
    assert c.mode == "portable" and c.differs == ("device_name", "cpu_isa_flags")
    no_gpu = verify.compare_environments(H200, cpu)
    assert no_gpu.mode == "portable" and "this machine has no GPU" in no_gpu.why and "graph path, B=32" in no_gpu.why


def _row(profile: str, prefix: str) -> tuple[dict, str]:
    line = row_lines(read_rows_text(_ledger(profile, prefix)))[0]
    return json.loads(line), line


def _changed_cache(rec: dict) -> dict:
    """The record with one number changed somewhere after its token IDs (a last-bit difference in a cache)."""
    new = copy.deepcopy(rec)
    paths = verify.leaves(new)
    where = next(k for k, v in paths.items() if isinstance(v, float) and "suffix" not in k and "margin" not in k)
    node: object = new
    parts = where.replace("]", "").replace("[", ".").split(".")
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, list) else node[p]  # type: ignore[index]
    last = parts[-1]
    if isinstance(node, list):
        node[int(last)] += 1.0
    else:
        node[last] += 1.0  # type: ignore[index]
    return new


def test_bits_that_differ_on_another_gpu_are_reported_not_failed():
    old, line = _row("paper", "exp1-bfloat16")
    bits = verify.compare_environments(H200, _h100())
    same = verify.judge_row("L", old, copy.deepcopy(old), line, bits, float32=False, seconds=2.5)
    assert (same.mode, same.ok, same.parted, same.bits_differ, same.seconds) == ("bits", True, None, False, 2.5)
    assert same.detail.startswith("byte-identical (written on NVIDIA H200")
    new = _changed_cache(old)
    differ = verify.judge_row("L", old, new, line, bits, float32=False)
    assert differ.ok and differ.bits_differ and differ.parted == verify.first_difference(old, new)
    assert differ.detail.startswith(f"bits differ first at {differ.parted} (not a gate failure); gates pass")
    owed = verify.judge_row("L", old, new, line, dataclass_replace(bits, mode="bytes"), float32=False)
    assert not owed.ok and owed.detail == f"differs first at {owed.parted}"  # on the writer's kind: a failure
    gate = dict(new, gate_failure={"gate": "prefix_equal", "reason": "x"})
    assert not verify.judge_row("L", old, gate, line, bits, float32=False).ok


def test_float32_token_ids_still_count_where_bits_are_not_owed():
    old, line = _row("gpu", "exp1-float32")
    portable = verify.compare_environments(H200, _recorded("cpu", "exp1-float32"))
    new = copy.deepcopy(old)
    assert verify.judge_row("L", old, new, line, portable, float32=True).ok
    suffix = next(k for k, v in verify.leaves(new).items() if "suffix[" in k and isinstance(v, int))
    arm = suffix.split(".suffix[")[0].split(".")
    node = new
    for p in arm:
        node = node[p]
    node["suffix"][0] += 1
    bad = verify.judge_row("L", old, new, line, portable, float32=True)
    assert not bad.ok and "float32 token IDs differ first at" in bad.detail and "BF16" not in bad.detail


def dataclass_replace(c, **kw):
    import dataclasses

    return dataclasses.replace(c, **kw)


def _fake_rows(calls: list, then=None):
    def fake(folder, rows, *, pick, report=None, **kw):
        check = verify.RowCheck(folder.name, "mmlu-x", "bytes", True, None, "byte-identical", seconds=1.25)
        calls.append(folder.name)
        report(check)
        if then is not None:
            then()
        return [check]
    return fake


def test_it_says_up_front_when_bf16_bits_cannot_be_compared_here_and_why(monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(verify, "verify_ledger", _fake_rows(calls))
    amx = {"cpu_isa_flags": ["amx_bf16", "avx512_bf16"], "device_name": "Intel(R) Xeon(R) Processor"}
    monkeypatch.setattr(verify, "expected_environment", lambda rec, threads: dict(rec) | amx)
    assert verify.main(["--profile", "cpu", "--only", "exp1-bfloat16", "exp1-float32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("BF16 bits cannot be compared on this machine for exp1-bfloat16-")
    assert "exp1-float32-" in lines[1] and "device_name 'AMD EPYC' in the ledger, 'Intel(R) Xeon(R) Processor' here" \
        in lines[1] and "cpu_isa_flags" in lines[1]
    assert "the float32 ledgers' token IDs (exp1-float32-" in lines[1]
    assert lines[2].startswith("One line per row") and lines[3].startswith("OK ")  # before any row
    monkeypatch.setattr(verify, "expected_environment", lambda rec, threads: dict(rec))
    assert verify.main(["--profile", "cpu", "--only", "exp1-bfloat16"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("Bits compared byte for byte (a difference fails) in "
                                                              "exp1-bfloat16-")


def test_a_gpu_profile_on_a_machine_without_a_gpu_says_so_before_any_model(monkeypatch, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    calls: list = []
    monkeypatch.setattr(verify, "verify_ledger", _fake_rows(calls))
    assert verify.main(["--profile", "paper", "--only", "exp1-bfloat16"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith("BF16 bits cannot be compared on this machine for exp1-bfloat16-c902497e8e11: written on "
                           "NVIDIA H200 (graph path, B=32); this machine has no GPU")


def test_each_row_shows_its_time_and_what_remains_and_an_interrupt_ends_with_a_summary(monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(verify, "expected_environment", lambda rec, threads: dict(rec))
    monkeypatch.setattr(verify, "verify_ledger", _fake_rows(calls, then=lambda: signal.raise_signal(signal.SIGINT)
                                                            if len(calls) == 2 else None))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a library loaded earlier left another handler
    try:
        rc = verify.main(["--profile", "cpu", "--only", "exp1-bfloat16", "exp1-float32", "exp3"])
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # and gets it back
    finally:
        signal.signal(signal.SIGINT, previous)
    out = capsys.readouterr().out.splitlines()
    assert rc == 130 and len(calls) == 2  # SIGINT (Ctrl-C) stopped it inside the second ledger
    rows = [x for x in out if x.startswith("OK ")]
    # the row's own time comes from the fake; "so far" is this process's wall clock (loaded CI: not always 0 s)
    assert re.search(r"byte-identical \[1\.2 s; 1 of 3 done, 2 left, \d+ s so far\]$", rows[0]), rows[0]
    assert "[1.2 s; 2 of 3 done, 1 left, " in rows[1]
    assert out[-1].startswith("interrupted after 2 of 3 rows: 2 of 2 recomputed rows match byte for byte; "
                              "1 not recomputed (")


def test_the_summary_counts_bits_that_differ_apart_from_failures():
    rows = [verify.RowCheck("L", "a", "bits", True, "arms.prefill.cache[0]", "bits differ ..."),
            verify.RowCheck("L", "b", "bits", True, None, "byte-identical"),
            verify.RowCheck("L", "c", "portable", True, None, "gates pass"),
            verify.RowCheck("L", "d", "bytes", False, "x", "differs first at x")]
    text = verify.summary(rows, 4, 12.0)
    assert text.startswith("1 of 4 recomputed rows match byte for byte; 1 pass with bits that differ on another GPU")
    assert "; 1 pass the portable checks" in text and text.endswith("; 1 do not (12 s)")


def test_gpu_ledgers_record_sm_count_and_cublas(monkeypatch):
    import torch
    from kvreplay.model import models

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(multi_processor_count=132))
    rec = models.gpu_record(torch.device("cuda", 0))
    assert rec["gpu_capability"] == "9.0" and rec["gpu_sm_count"] == 132
    assert set(rec) == {"cuda_runtime", "gpu_capability", "gpu_sm_count", "cublas"}
    assert rec["cublas"] is None or rec["cublas"].lower().startswith("nvidia-cublas")


def test_a_recomputed_tiny_row_carries_its_time_and_a_bit_difference_on_another_gpu_passes(tmp_path, tiny_arm,
                                                                                          monkeypatch):
    from kvreplay.experiments.live_vs_prefill import EXP1
    from kvreplay.ledger.store import ROWS
    from kvreplay.data.problems import Problem

    problems = [Problem(f"p-{i:02d}", "test", i + 1, "Q" + "xyz"[i % 3] * (2 * i) + "?", ("x", "y", "z", "w"), "A")
                for i in range(2)]
    _, ledger = EXP1.run(tiny_arm(dtype="bfloat16"), problems, ledger_root=tmp_path, progress=False)
    model = str(tmp_path / "tiny-llama")
    lines = (ledger.dir / ROWS).read_text().splitlines()
    rec = _changed_cache(json.loads(lines[1]))
    lines[1] = json.dumps(rec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    (ledger.dir / ROWS).write_text("\n".join(lines) + "\n")
    checks = verify.verify_ledger(ledger.dir, rows=2, pick="first", problems=problems, model=model)
    assert [(c.mode, c.ok) for c in checks] == [("bytes", True), ("bytes", False)]  # this machine wrote it
    assert all(c.seconds > 0 for c in checks)
    other_gpu = verify.Comparison("bits", (), (), "written on GPU A, recomputed on GPU B")
    monkeypatch.setattr(verify, "compare_environments", lambda recorded, current: other_gpu)
    checks = verify.verify_ledger(ledger.dir, rows=2, pick="first", problems=problems, model=model)
    assert [(c.mode, c.ok, c.bits_differ) for c in checks] == [("bits", True, False), ("bits", True, True)]
    assert checks[1].detail.startswith("bits differ first at ")
