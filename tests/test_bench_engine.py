"""``make bench``'s side-by-side section on tiny shapes (CPU): the engine and ``generate`` doing the same work.

What is asserted: the functions run end to end and report every field, both sides decode the saved
boundaries, the floors follow from the model's sizes, the end-to-end chunk passes its gates and counts its slot
occupancy, and the profile is a Markdown table. No time is asserted (speed is measured, never tested).
"""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import TINY_FORMAT, make_model, make_tokenizer
from kvreplay import bench
from kvreplay.decoding import decode
from kvreplay.decoding.contract import Caps
from kvreplay.data.problems import Problem
from kvreplay.runner import ArmSettings

CAPS = (3, 4, 2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    tok = make_tokenizer()
    make_model("llama", len(tok)).save_pretrained(root / "tiny-llama")
    tok.save_pretrained(root / "tiny-llama")
    (root / "tiny.yaml").write_text(yaml.safe_dump(TINY_FORMAT))
    lm, fmt = ArmSettings(profile="bench", dtype="bfloat16", caps=Caps(*CAPS), model=str(root / "tiny-llama"),
                          fmt=str(root / "tiny.yaml"), threads=1).load()
    problems = [Problem(f"p-{i:02d}", "test", i + 1, "Q" + "xy"[i % 2] * (2 * i) + "?", ("x", "y", f"z{i}", "w"),
                        "ABCD"[i % 4]) for i in range(4)]
    prefixes = [decode.decode_live(lm, fmt, fmt.prompt_ids(p.question, p.options), Caps(*CAPS)).ids for p in problems]
    return lm, fmt, problems, prefixes


def test_engine_and_generate_do_the_same_work_and_report_step_time_and_floor(tiny):
    lm, fmt, _, prefixes = tiny
    seen = []
    records = bench.engine_vs_generate(lm, fmt, prefixes, batches=(2,), new_tokens=(2, 4), step_path="eager",
                                       attentions=("flex", "grouped"), repeats=3, caps=CAPS, emit=seen.append)
    assert records == seen
    paths = [(r["path"], r["flags"]) for r in records]
    assert paths == [("engine", "engine"), ("engine-grouped", "engine"),
                     *[(p, f) for p in ("generate-dynamic", "generate-static", "generate-static-compile")
                       for f in bench.FLAG_SETS]]
    layout = bench.memory_layout(lm)
    for r in records:
        assert r["B"] == 2 and r["rows"] == 4 and r["caps"] == "3/4/2" and r["new_tokens"] == 4
        assert r["floor_ms"] == records[0]["floor_ms"] > 0  # the same work on every path
        if r["path"] == "generate-static-compile":
            assert "not run" in r["note"]  # transformers compiles generate on CUDA only
            continue
        assert "failed" not in r.get("note", ""), r
        # a difference of two timings: its sign is the machine's business (no time is asserted), its form is ours
        assert isinstance(r["ms_per_step"], float) and isinstance(r["x_floor"], float)
        assert r["ms_per_problem_step"] == pytest.approx(r["ms_per_step"] / 2, rel=1e-3, abs=1e-4)
        assert r["floor_ms_layout"] >= r["floor_ms"] * 0.999
    filled = 2 * sum(len(z) + 3 for z in prefixes[:2])  # both duplicates, the timed window's middle (tokens 2..4)
    assert records[0]["floor_ms"] == pytest.approx(bench.floor_ms(layout, filled, 4.3e12), abs=1e-4)
    assert records[0]["max_len"] % 128 == 0 and records[1]["max_len"] == max(map(len, prefixes[:2])) + 4
    with pytest.raises(ValueError, match="short < long"):
        bench.engine_vs_generate(lm, fmt, prefixes, batches=(2,), new_tokens=(4, 4))
    with pytest.raises(ValueError, match="unknown"):
        bench.engine_vs_generate(lm, fmt, prefixes, batches=(2,), hf=("vllm",))


def test_the_invariant_step_and_prefill_are_timed_beside_the_others(tiny):
    lm, fmt, _, prefixes = tiny
    records = bench.engine_vs_generate(lm, fmt, prefixes, batches=(1, 2), new_tokens=(2, 4), step_path="eager",
                                       attentions=("sdpa",), hf=(), repeats=1, caps=CAPS, invariant_tokens=(1, 2))
    assert [(r["path"], r["B"]) for r in records] == [("prefill", 1), ("prefill-invariant", 1), ("engine-sdpa", 1),
                                                      ("engine-invariant", 1), ("engine-sdpa", 2),
                                                      ("engine-invariant", 2)]
    assert all(isinstance(r.get("ms_per_step", r.get("ms")), float) for r in records)
    inv = records[-1]
    assert inv["step_path"] == "eager" and inv["new_tokens"] == 2 and inv["timed_steps"] == 1
    assert inv["floor_ms"] == records[-2]["floor_ms"]  # the same work as the other engine path of its B
    assert lm.contract.kernels == "default"  # restored
    with pytest.raises(ValueError, match="invariant_tokens"):
        bench.engine_vs_generate(lm, fmt, prefixes, batches=(2,), invariant_tokens=(2, 2))


@pytest.mark.slow  # 75 s under Triton's interpreter on 2 cores; the kernels' own checks run in test_kernels_fused
def test_the_fused_invariant_step_and_prefill_are_timed_beside_the_others(tiny):
    from kvreplay.model import kernels_fused

    if not kernels_fused.interpreted():
        pytest.skip("the fused kernels need TRITON_INTERPRET=1 on the CPU (tests/conftest.py sets it)")
    lm, fmt, _, prefixes = tiny
    records = bench.engine_vs_generate(lm, fmt, prefixes, batches=(1,), new_tokens=(2, 3), step_path="eager",
                                       attentions=("sdpa",), hf=(), repeats=1, caps=CAPS, invariant_tokens=(1, 2),
                                       invariant_values=("invariant-fused",))
    assert [(r["path"], r["B"]) for r in records] == [("prefill", 1), ("prefill-invariant-fused", 1),
                                                      ("engine-sdpa", 1), ("engine-invariant-fused", 1)]
    assert "fused kernels" in records[-1]["note"] and records[-1]["step_path"] == "eager"
    assert lm.contract.kernels == "default"  # restored
    with pytest.raises(ValueError, match="invariant_values"):
        bench.engine_vs_generate(lm, fmt, prefixes, batches=(1,), invariant_tokens=(1, 2),
                                 invariant_values=("invariant-except-linear",))


def test_forced_lengths_on_both_sides_and_the_saved_boundaries_are_reused(tiny, tmp_path):
    from kvreplay import engine

    lm, fmt, _, prefixes = tiny
    states = [decode.build_prefill(lm, fmt, z) for z in prefixes[:2]]
    forced = engine.decode_forced(lm, fmt, states, 5, run=engine.EngineRun(batch=2, attention="flex"))
    assert [len(t) for t in forced.tokens] == [5, 5] and (forced.steps, forced.busy_slot_steps, forced.batch) == (4, 8, 2)
    run = bench._hf_generate(lm, prefixes[:2], "dynamic", 5)
    out = run(5)
    assert out.shape[0] == 4 and out.shape[1] == max(map(len, prefixes[:2])) + 5  # 2 rows per problem, left-padded
    # the boundaries both sides read: saved once, then read back (the paper profile's prefix bank by default)
    file = tmp_path / "boundaries.json"
    first, source = bench.load_boundaries(file, 3)
    again, source2 = bench.load_boundaries(file, 3)
    assert file.is_file() and first == again and source == source2 and source["source"].endswith("prefix_bank_bf16.jsonl")
    with pytest.raises(ValueError, match="needed"):
        bench.load_boundaries(file, 10_000)
    merged = bench.merge_records(tmp_path / "r.json", [{"path": "engine", "B": 2, "ms_per_problem_step": 1.0}])
    merged = bench.merge_records(tmp_path / "r.json", [{"path": "engine", "B": 2, "ms_per_problem_step": 0.5},
                                                       {"path": "engine", "B": 4, "ms_per_problem_step": 0.4}])
    assert json.loads((tmp_path / "r.json").read_text()) == merged and [r["B"] for r in merged] == [2, 4]


def test_end_to_end_chunk_counts_occupancy_and_passes_its_gates(tiny):
    lm, fmt, problems, _ = tiny
    rec = bench.exp1_end_to_end(lm, fmt, problems, batch=2, caps=CAPS, attention="flex", step_path="eager")
    assert rec["gate_failures"] == 0 and rec["problems"] == 4 and rec["max_len"] % 128 == 0
    assert rec["checks"] == ["composition", "attention_tolerance"]  # the composition gate rides in the chunk
    assert 0 < rec["occupancy"] <= 1 and rec["busy_slot_steps"] <= 2 * rec["steps"]
    assert rec["problem_steps_per_s"] > 0 and rec["rows_per_hour"] >= rec["rows_per_hour_with_gates"] > 0


def test_step_profile_is_a_markdown_table(tiny):
    lm, fmt, _, prefixes = tiny
    text = bench.profile_step(lm, fmt, prefixes, batch=2, attention="flex", step_path="eager", steps=3, rows=5)
    lines = text.splitlines()
    assert lines[0].startswith("Engine step profile: B = 2") and lines[2].startswith("| op | calls |")
    assert len([x for x in lines if x.startswith("| `")]) == 5


def test_the_engine_page_renders_the_committed_bench_file():
    """docs/engine.md's engine-vs-generate block is exactly what the committed bench and suite files render."""
    import json

    from kvreplay.report import engine_bench

    text = engine_bench.DOC.read_text(encoding="utf-8")
    records = json.loads(engine_bench.BENCH_FILE.read_text(encoding="utf-8"))
    suite = json.loads(engine_bench.SUITE_FILE.read_text(encoding="utf-8"))
    assert engine_bench.render_doc(text, records, suite) == text
    readme = engine_bench.README.read_text(encoding="utf-8")
    assert engine_bench.render_readme(readme, records) == readme
    faster = [dict(r, ms_per_problem_step=r["ms_per_problem_step"] * 10) if r["path"] == "engine" else r
              for r in records]
    assert "at B = none of these" in engine_bench.side_by_side(faster)
    assert engine_bench.main(["--check"]) == 0
