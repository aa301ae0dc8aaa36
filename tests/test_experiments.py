"""Experiment 2 and 3 machinery on tiny models: selection, crossing statistics, bridge and audit."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_CAPS, tiny_lm, tiny_problems
from kvreplay.decoding.settings import Decoding
from kvreplay.experiments.bridge import bridge_row, saved_ledger_audit
from kvreplay.experiments.endpoints import first_divergence
from kvreplay.experiments.fixed_prefix import fixed_prefix_row, precision_crossing
from kvreplay.experiments.live_vs_prefill import live_vs_prefill_row
from kvreplay.experiments.transplant import order_statistics
from kvreplay.gates import GateError
from kvreplay.runner import RunSpec


def test_order_statistics_are_evenly_spaced_and_outcome_blind():
    items = [{"id": f"p{i}", "len": (i * 37) % 100} for i in range(20)]
    pick = order_statistics(items, 5, key=lambda e: (e["len"], e["id"]))
    srt = sorted(items, key=lambda e: (e["len"], e["id"]))
    assert pick == [srt[0], srt[5], srt[10], srt[14], srt[19]]  # round(i * 19 / 4)
    assert order_statistics(items, 50, key=lambda e: e["len"]) == srt


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def _rec(pid, suffix, answer, label, prefix=(1, 2)):
    return {"problem_id": pid, "gate_failure": None, "prefix": list(prefix),
            "arms": {"incremental": {"correct": True}, "prefill": {"correct": not label}},
            "endpoints": {"suffix_differs": suffix, "answer_differs": answer, "letter_differs": answer, "tie_initiated": False,
                          "label_differs": label}}


def test_precision_crossing_counts_direction():
    bf = [_rec(f"p{i}", i < 8, i < 3, i < 1) for i in range(10)]
    fp = [_rec(f"p{i}", False, False, False) for i in range(10)]
    c = precision_crossing(bf, fp, n_resamples=500)
    assert c["prefix_identical"] == 10
    assert c["suffix"]["change"].estimate == pytest.approx(-0.8)
    assert (c["suffix"]["mcnemar"].b, c["suffix"]["mcnemar"].c) == (8, 0)
    assert c["letter"]["change"].estimate == pytest.approx(-0.3)
    # accuracy effect of prefill (prefill minus incremental): -10 pts in BF16 (p0 wrong), 0 in FP32
    e = c["accuracy_effect"]
    assert e["bfloat16"] == pytest.approx(-0.1) and e["float32"] == 0
    assert e["change"].estimate == pytest.approx(0.1)
    with pytest.raises(GateError, match="paired"):
        precision_crossing(bf, list(reversed(fp)))


@pytest.fixture
def spec(tiny_format):
    lm = tiny_lm("qwen2", torch.bfloat16)
    return RunSpec(lm=lm, fmt=tiny_format(lm), decoding=Decoding.of(TINY_CAPS))


def test_bridge_row_is_exact_and_audit_joins(spec):
    problems = tiny_problems(2)
    exp1 = [live_vs_prefill_row(spec, p) for p in problems]
    exp2 = [fixed_prefix_row(spec, p, r["prefix"]) for p, r in zip(problems, exp1)]
    audit = saved_ledger_audit(exp1, exp2)
    assert audit["order_agrees"] and audit["prefix_agrees"] == 2
    assert all(v == 2 for v in audit["suffix_agrees"].values())
    assert audit["cache_leaves_agree_rows"] == 2 and audit["logit_leaves_agree_rows"] == 2
    assert audit["cache_leaves"][0] > 0 and audit["logit_leaves"][0] > 0
    exp2[1]["boundary"]["prefill_vs_incremental"]["cache"]["rel_l2"] += 1e-9  # a leaf that no longer agrees
    assert saved_ledger_audit(exp1, exp2)["cache_leaves_agree_rows"] == 1
    b = bridge_row(spec, problems[0], exp1[0]["prefix"])
    assert b["gate_failure"] is None
    assert b["endpoints"]["cache_exact"] and b["endpoints"]["layers_exact"] == b["endpoints"]["layers"] == 2
    assert b["endpoints"]["logits_exact"] and b["endpoints"]["suffix_exact"] and b["same_as_saved"]


def _transplant_spec(tiny_format, transplant_faults=None):
    lm = tiny_lm("llama", torch.bfloat16)
    return RunSpec(lm=lm, fmt=tiny_format(lm), decoding=Decoding.of(TINY_CAPS), transplant_faults=transplant_faults)


def test_transplant_row_outcomes(tiny_format):
    from kvreplay.experiments.transplant import (
        localization_table,
        transplant_row,
        transplant_summary,
    )

    spec = _transplant_spec(tiny_format)
    p = tiny_problems(1)[0]
    prefix = live_vs_prefill_row(spec, p)["prefix"]
    rec = transplant_row(spec, p, prefix, "exact", sweep=True)
    assert rec["gate_failure"] is None
    names = list(rec["interventions"])
    assert names[:5] == ["whole", "keys_only", "values_only", "first_half", "second_half"] and "layer_01" in names
    whole = rec["interventions"]["whole"]
    assert whole["prefill<-incremental"]["donated_tensors"] == 4 and whole["kind"] == "primary"
    if rec["baseline"]["suffix_differs"]:
        assert whole["prefill<-incremental"]["outcome"] in {"donor", "recipient", "third"}
    else:
        assert whole["prefill<-incremental"]["outcome"] in {"baseline", "third"}
    # a whole transplant gives the recipient exactly the donor's cache, so it must follow the donor's suffix
    assert whole["prefill<-incremental"]["suffix"] == rec["baseline"]["incremental"]
    assert whole["incremental<-prefill"]["suffix"] == rec["baseline"]["prefill"]
    s = transplant_summary([rec])
    assert s["rows"] == 1 and s["divergent"] + s["exact"] == 1
    assert not localization_table([rec]).empty or not rec["baseline"]["suffix_differs"]


def _alias(state, recipient, donor, prov):
    state.cache.layers[0].keys = donor.cache.layers[0].keys


def _wrong_layer(state, recipient, donor, prov):
    state.cache.layers[0].keys = donor.cache.layers[1].keys.clone()


def _wrong_dtype(state, recipient, donor, prov):
    state.cache.layers[1].values = state.cache.layers[1].values.to(torch.float32)


@pytest.mark.parametrize("fault, gate", [pytest.param(_alias, "storage", marks=pytest.mark.gate("storage")),
                                         pytest.param(_wrong_layer, "provenance", marks=pytest.mark.gate("provenance")),
                                         pytest.param(_wrong_dtype, "dtype", marks=pytest.mark.gate("dtype"))])
def test_faulty_transplant_is_caught(tiny_format, fault, gate):
    from kvreplay.experiments.transplant import transplant_row

    spec = _transplant_spec(tiny_format, transplant_faults=fault)
    p = tiny_problems(1)[0]
    prefix = live_vs_prefill_row(spec, p)["prefix"]
    rec = transplant_row(spec, p, prefix, "exact", sweep=False)
    assert rec["gate_failure"] is not None and rec["gate_failure"]["gate"] == gate, rec["gate_failure"]


def test_panel_is_frozen_by_stratum_and_length():
    from kvreplay.experiments.transplant import freeze_transplant_panel

    recs = [{"problem_id": f"p{i}", "gate_failure": None, "prefix_len": 100 + i, "endpoints": {"suffix_differs": i % 3 != 0}}
            for i in range(12)]
    panel = freeze_transplant_panel(recs, 3, 2)
    assert [e["stratum"] for e in panel] == ["divergent"] * 3 + ["exact"] * 2
    div = sorted((r for r in recs if r["endpoints"]["suffix_differs"]), key=lambda r: r["prefix_len"])
    assert [e["problem_id"] for e in panel[:3]] == [div[0]["problem_id"], div[4]["problem_id"], div[7]["problem_id"]]


def test_fixed_prefixes_are_digest_and_order_checked(tmp_path):
    from kvreplay.experiments.fixed_prefix import load_fixed_prefixes
    from kvreplay.ledger.prefix_bank import write_prefix_bank

    problems = tiny_problems(3)
    recs = [{"problem_id": p.problem_id, "prompt_len": 2, "prefix": [1, 2, i]} for i, p in enumerate(problems[:2])]
    path = tmp_path / "bank.jsonl"
    write_prefix_bank(recs, path, "src")
    fixed = load_fixed_prefixes(path, problems)
    assert [p.problem_id for p in fixed.rows] == [p.problem_id for p in problems[:2]]
    assert fixed.prefixes[problems[1].problem_id] == [1, 2, 1]
    with pytest.raises(GateError, match="source order"):
        load_fixed_prefixes(path, list(reversed(problems)))
    assert write_prefix_bank(recs, path, "src") == fixed.sha256  # the same bank again: written, same bytes
    with pytest.raises(FileExistsError, match="another prefix bank"):  # another row set never replaces it
        write_prefix_bank(recs[:1], path, "src")
    assert load_fixed_prefixes(path, problems).sha256 == fixed.sha256
    path.write_text(path.read_text().replace("[1,2,0]", "[1,2,9]"))
    with pytest.raises(GateError, match="manifest"):
        load_fixed_prefixes(path, problems)


def test_max_sequence_length_bounds_a_decoded_sequence(tiny_format):
    from kvreplay.decoding import decode
    from kvreplay.decoding.contract import ANSWER, BRANCH1

    lm = tiny_lm("llama")
    fmt = tiny_format(lm)
    prompt = fmt.prompt_ids("Q?", ["a", "b"])
    live = decode.decode_live(lm, fmt, prompt, TINY_CAPS)
    full = live.ids + decode.decode_suffix(lm, fmt, live, TINY_CAPS).tokens
    parsed = fmt.parse(full)
    content = sum(end - start for start, end in (parsed.content[r] for r in range(BRANCH1, ANSWER + 1)))
    assert len(full) == len(prompt) + fmt.delimiter_tokens() + content  # the delimiters are counted right
    bound = fmt.max_sequence_length(len(prompt), TINY_CAPS)
    assert len(full) <= bound == len(full) - content + 3 * TINY_CAPS.branch + TINY_CAPS.merge + TINY_CAPS.answer


def test_check_prompts_refuses_a_sequence_longer_than_the_context(tiny_format):
    from kvreplay.decoding.contract import ContractError
    from kvreplay.data.problems import Problem
    from kvreplay.runner import check_prompts

    fmt = tiny_format(tiny_lm("llama"))
    short = tiny_problems(1)
    need = fmt.max_sequence_length(len(fmt.prompt_ids(short[0].question, short[0].options)), TINY_CAPS)
    check_prompts(fmt, short, need, caps=TINY_CAPS)  # exactly enough positions
    check_prompts(fmt, short)  # no context given: only the block contract is checked
    with pytest.raises(ContractError, match=rf"problem tiny-00 \(test line 1\): its full sequence can need {need} "
                                            rf"positions .* the model has only {need - 1}"):
        check_prompts(fmt, short, need - 1, caps=TINY_CAPS)
    with pytest.raises(ValueError, match="needs the caps"):
        check_prompts(fmt, short, 100)
    long = Problem("long-1", "test", 7, " ".join(["word"] * 400) + "?", ("x", "y"), "A")
    with pytest.raises(ContractError, match=r"problem long-1 \(test line 7\)"):
        check_prompts(fmt, short + [long], 2048, caps=TINY_CAPS)


@pytest.fixture
def short_context_arm(tmp_path):
    import yaml
    from conftest import TINY_FORMAT, make_tokenizer
    from kvreplay.runner import ArmSettings
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )).save_pretrained(tmp_path / "tiny-llama-256")
    tok.save_pretrained(tmp_path / "tiny-llama-256")
    fmt = tmp_path / "tiny.yaml"
    fmt.write_text(yaml.safe_dump(TINY_FORMAT))
    return lambda **kw: ArmSettings(**(dict(profile="t", dtype="float32", caps=TINY_CAPS,
                                            model=str(tmp_path / "tiny-llama-256"), fmt=str(fmt), threads=1) | kw))


def test_run_arm_refuses_a_too_long_problem_before_any_ledger_exists(tmp_path, short_context_arm):
    from kvreplay.decoding.contract import ContractError
    from kvreplay.experiments.live_vs_prefill import EXP1
    from kvreplay.data.problems import Problem

    long = Problem("long-1", "test", 3, " ".join(["word"] * 400) + "?", ("x", "y"), "A")
    with pytest.raises(ContractError, match=r"problem long-1 \(test line 3\): its full sequence can need \d+ positions"
                                            r".*only 256 \(max_position_embeddings\)"):
        EXP1.run(short_context_arm(), tiny_problems(2) + [long], ledger_root=tmp_path / "ledgers", progress=False)
    assert not (tmp_path / "ledgers").exists()


def test_a_row_that_fails_only_the_transplant_precondition_is_named_and_left_out_of_the_endpoints():
    """The committed `paper` Experiment 4 ledger holds one panel row whose boundary raw argmax differs between
    the constructions (an exact top-2 tie in the prefill): the summaries leave it out and name it; any other
    gate failure still withholds every endpoint."""
    import copy

    from kvreplay.experiments.replication import outcome_frame
    from kvreplay.experiments.transplant import localization_table, split_precondition, transplant_summary, transplant_table
    from kvreplay.ledger.lookup import finished_rows
    from kvreplay.paths import LEDGERS
    from kvreplay.report.frames import transplant_outcomes

    (folder,) = sorted((LEDGERS / "paper").glob("exp4-bfloat16-*"))
    rows = finished_rows(folder)
    failed = [r for r in rows if r["gate_failure"]]
    assert [(r["problem_id"], r["gate_failure"]["gate"]) for r in failed] == [("mmlu-6bf0fb35afd9b0d6", "argmax")]
    eligible, ineligible = split_precondition(rows)
    assert ineligible == failed and len(eligible) == len(rows) - 1
    s = transplant_summary(rows)
    assert s["rows"] == len(rows) - 1 == s["divergent"] + s["exact"]
    assert [r["problem_id"] for r in s["ineligible"]] == ["mmlu-6bf0fb35afd9b0d6"]
    assert "4590 vs 504" in s["ineligible"][0]["reason"]
    table = transplant_table(s, rows).iloc[:, 0]
    assert table["all gates pass (replicas, state, storage, argmax, provenance)"] == f"{len(rows) - 1}/{len(rows)}"
    unmet = next(k for k in table.index if k.startswith("argmax precondition unmet"))
    assert "mmlu-6bf0fb35afd9b0d6" in table[unmet] and "report_both" in unmet
    assert len(localization_table(rows)) and len(transplant_outcomes(rows))
    assert len(outcome_frame(rows)) == len(rows) - 1
    # the same row failing any other gate is an integrity failure: nothing is reported
    broken = copy.deepcopy(rows)
    next(r for r in broken if r["gate_failure"])["gate_failure"]["gate"] = "replica"
    for summarise in (transplant_summary, localization_table, transplant_outcomes, split_precondition):
        with pytest.raises(GateError, match="endpoints withheld"):
            summarise(broken)
    # a row recorded under the precondition's name but holding decoded results is not what the gate writes
    tagged = copy.deepcopy(rows)
    tagged[0]["gate_failure"] = dict(failure := failed[0]["gate_failure"])
    assert tagged[0]["interventions"] and failure["gate"] == "argmax"
    with pytest.raises(GateError, match=r"hold decoded results"):
        transplant_summary(tagged)
    # the whole-panel views: notebook 06's run values and Experiment 5's table name the row and count it
    from kvreplay.experiments.replication import replication_summary, replication_table
    from kvreplay.report.paper_tables import RUN_VALUES

    n, d, e = len(rows), s["divergent"], s["exact"]  # the row left out is a divergent one
    assert d + e == n - 1 and failed[0]["stratum"] == "divergent"
    assert RUN_VALUES["exp4.gates"]({"transplant": s}) == f"{n - 1}/{n}"
    assert RUN_VALUES["exp4.panel"]({"transplant": s}).startswith(f"{n} ({d} + {e}, contemporaneous strata + 1 whose argmax")
    r5 = replication_summary(rows)
    assert r5["rows"] == n - 1 and [r["problem_id"] for r in r5["ineligible"]] == ["mmlu-6bf0fb35afd9b0d6"]
    assert f"over all {n} panel rows {d}/{n} to {d + 1}/{n}" in RUN_VALUES["exp5.divergence"]({"replication": r5})
    t5 = replication_table(r5, "checkpoint").iloc[:, 0]
    assert t5["panel rows (order statistics of prefix length)"].startswith(f"{n} ")
    assert t5["all gates pass (replicas, state, storage, argmax, provenance)"] == f"{n - 1}/{n}"
    assert t5["divergence over the whole panel, the rows left out counted as not / as divergent"].startswith(f"{d}/{n} ")


def test_experiment4_reports_a_precondition_failure_by_the_profiles_rule():
    """`exp4_precondition_failures`: the `paper` row left out (23/23), counted as a failure (23/24, Wilson
    [79.8, 99.3]), or both; a row of the exact stratum counts as a third trajectory."""
    import copy

    from kvreplay.experiments.transplant import DEFAULT_PRECONDITION_RULE, PRECONDITION_RULES, transplant_summary, transplant_table
    from kvreplay.ledger.lookup import finished_rows
    from kvreplay.paths import LEDGERS
    from kvreplay.notebook.profiles import ChainParameters, load_parameters

    field = ChainParameters.model_fields["exp4_precondition_failures"]
    assert field.default == DEFAULT_PRECONDITION_RULE and set(field.annotation.__args__) == set(PRECONDITION_RULES)
    assert {load_parameters(p).exp4_precondition_failures for p in ("cpu", "gpu", "paper")} == {"report_both"}
    (folder,) = sorted((LEDGERS / "paper").glob("exp4-bfloat16-*"))
    rows = finished_rows(folder)
    joint = "joint bidirectional recovery (integrity check)"
    left, counted = " [unmet precondition: row left out]", " [unmet precondition: counted as a failure]"
    both = transplant_table(s := transplant_summary(rows, "report_both"), rows).iloc[:, 0]
    assert (s["joint_recovery"].k, s["joint_recovery"].n) == (23, 23)
    c = s["counted_as_failure"]["joint_recovery"]
    assert (c.k, c.n, round(100 * c.low, 1), round(100 * c.high, 1)) == (23, 24, 79.8, 99.3)
    assert both[joint + left].startswith("23/23 ") and both[joint + counted].startswith("23/24 (95.8%")
    assert both["third trajectory among exact controls"].startswith("0/8 ")  # the same either way: one line
    only_left = transplant_table(transplant_summary(rows, "left_out"), rows).iloc[:, 0]
    assert only_left[joint + left].startswith("23/23 ") and joint + counted not in only_left.index
    only_counted = transplant_table(transplant_summary(rows, "counted_as_failure"), rows).iloc[:, 0]
    assert only_counted[joint + counted].startswith("23/24 ") and joint + left not in only_counted.index
    # the same row in the exact stratum: a third trajectory when counted
    exact = copy.deepcopy(rows)
    next(r for r in exact if r["gate_failure"])["stratum"] = "exact"
    t = transplant_summary(exact)["counted_as_failure"]
    assert (t["third_among_exact"].k, t["third_among_exact"].n) == (1, 9) and t["joint_recovery"].n == 23
    with pytest.raises(ValueError, match="exp4_precondition_failures='dropped'"):
        transplant_summary(rows, "dropped")


def test_a_panel_without_ineligible_rows_keeps_its_table():
    """The `gpu` profile's Experiment 4 rows all met the precondition: no extra line, and the counts as before."""
    from kvreplay.experiments.transplant import transplant_summary, transplant_table
    from kvreplay.ledger.lookup import finished_rows
    from kvreplay.paths import LEDGERS

    (folder,) = sorted((LEDGERS / "gpu").glob("exp4-bfloat16-*"))
    rows = finished_rows(folder)
    s = transplant_summary(rows)
    assert s["ineligible"] == [] and s["rows"] == len(rows) == 32
    table = transplant_table(s, rows).iloc[:, 0]
    assert not any(k.startswith("argmax precondition unmet") for k in table.index)
    assert table["all gates pass (replicas, state, storage, argmax, provenance)"] == "32/32"
