"""The greedy tie rule (kvreplay.decoding.ties) in every decoder, on planted exact ties, and the tie-rule control."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch

from kvreplay.decoding import caches, decode, ties
from kvreplay import engine
from kvreplay.decoding.contract import ANSWER, MERGE, resolve_format
from kvreplay.decoding.settings import Decoding
from kvreplay.experiments.arms import ARMS
from kvreplay.experiments.live_vs_prefill import EXP1
from kvreplay.experiments.tie_rules import (
    EXP1_TIES,
    bf16_spacing,
    margin_bin,
    margin_units,
    tie_rule_summary,
    tie_rule_table,
    tie_steps,
)
from kvreplay.ledger.records import validate_rows
from kvreplay.notebook.profiles import load_parameters
from kvreplay.runner import ArmSettings, arm_environment
from kvreplay.analysis.stats import mcnemar_exact, wilson

from conftest import TINY_CAPS, TINY_FORMAT, tiny_lm, tiny_problems

TINY_ARM_DTYPE = "bfloat16"  # the tiny_arm fixture's default dtype in this module (conftest)

RULES = ("lowest", "highest", "hash:0", "hash:7")


@pytest.fixture(scope="module")
def lm_fmt():
    lm = tiny_lm("llama", torch.float32)
    return lm, resolve_format(lm.tokenizer, TINY_FORMAT)


def _tied(lm, fmt):
    """Two eligible content tokens ``a < b`` and one ineligible token."""
    vocab = lm.model.get_output_embeddings().weight.shape[0]
    both = fmt.content_mask(MERGE, "cpu", vocab) & fmt.content_mask(ANSWER, "cpu", vocab)
    ok = both.nonzero().flatten().tolist()
    bad = (~fmt.content_mask(MERGE, "cpu", vocab)).nonzero().flatten().tolist()[0]
    return ok[3], ok[10], bad, vocab


def _want(rule: str, a: int, b: int, position: int) -> int:
    r = ties.parse_tie_rule(rule)
    if r.kind == "lowest":
        return a
    if r.kind == "highest":
        return b
    return [a, b][ties.tie_hash(r.seed, position, [b, a]) % 2]


# ----------------------------------------------------------------------------- the rule itself


def test_rules_parse_and_bad_rules_are_refused():
    assert ties.parse_tie_rule("hash:42") == ties.TieRule("hash", 42) and ties.parse_tie_rule("hash:42").name == "hash:42"
    for bad in ("first", "hash", "hash:-1", "hash:x", f"hash:{2 ** 32}", 3):
        with pytest.raises(ValueError, match="unknown tie rule"):
            ties.parse_tie_rule(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tie_rules: unknown tie rule 'lowst'"):
        load_parameters("smoke", {"tie_rules": ["lowst"]})
    with pytest.raises(ValueError, match="listed twice"):
        load_parameters("smoke", {"tie_rules": ["highest", "highest"]})
    with pytest.raises(ValueError, match="tie_rule belongs to the execution contract"):
        load_parameters("smoke", {"tie_rule": "highest"})
    with pytest.raises(ValueError, match="unknown tie rule 'sideways'"):
        load_parameters("smoke", {"execution": {"tie_rule": "sideways"}})
    assert load_parameters("smoke", {"tie_rules": ["highest", "hash:0"]}).tie_rules == ("highest", "hash:0")


def test_the_hash_is_deterministic_and_depends_on_seed_position_and_the_tied_set():
    h = ties.tie_hash(0, 17, [5, 12])
    assert h == ties.tie_hash(0, 17, [12, 5]) == ties.tie_hash(0, 17, (5, 12, 12))  # a function of the set
    assert 0 <= h < 2 ** 32
    assert len({ties.tie_hash(s, 17, [5, 12]) for s in range(8)}) == 8
    assert len({ties.tie_hash(0, p, [5, 12]) for p in range(8)}) == 8
    assert len({ties.tie_hash(0, 17, s) for s in ([5, 12], [5, 13], [4, 12], [5, 12, 40])}) == 4
    # the device version is the reference, for every row of a batch (one tie each, at its own position)
    rows, gen = 40, torch.Generator().manual_seed(0)
    masked = torch.rand(rows, 64, generator=gen)
    sets = [sorted(torch.randperm(64, generator=gen)[: 2 + i % 4].tolist()) for i in range(rows)]
    for i, s in enumerate(sets):
        masked[i, s] = 3.0
    position = torch.arange(100, 100 + rows)
    got = ties.choose(masked, ties.parse_tie_rule("hash:9"), position).tolist()
    want = [s[ties.tie_hash(9, 100 + i, s) % len(s)] for i, s in enumerate(sets)]
    assert got == want
    assert ties.choose(masked, ties.parse_tie_rule("hash:9"), position).tolist() == got  # deterministic
    assert ties.choose(masked, ties.LOWEST).tolist() == [s[0] for s in sets]
    assert ties.choose(masked, ties.TieRule("highest")).tolist() == [s[-1] for s in sets]
    with pytest.raises(ValueError, match="needs the position"):
        ties.choose(masked, ties.TieRule("hash", 0))
    with pytest.raises(TypeError, match="a parsed TieRule is needed"):
        ties.choose(masked, "lowest")  # type: ignore[arg-type]  (decoders take rules parsed: Decoding.of)


@pytest.mark.parametrize("rule", RULES)
def test_each_rule_breaks_a_planted_tie_alike_in_the_eager_cursor_and_the_engine(lm_fmt, rule):
    """Two equal eligible maxima (an ineligible token higher): cursor, choice_stats and first_choice agree."""
    lm, fmt = lm_fmt
    a, b, bad, vocab = _tied(lm, fmt)
    logits = torch.linspace(-3, 3, vocab)
    logits[a] = logits[b] = 7.0
    logits[bad] = 9.0
    parsed = Decoding.of(TINY_CAPS, rule).tie_rule
    for position in (11, 12, 13, 14):
        cursor = decode.BlockCursor(fmt, TINY_CAPS, MERGE, tie_rule=parsed)
        token, _, margin, _ = cursor.step(logits, position=position)
        assert token == _want(rule, a, b, position) and margin == 0.0 and cursor.last_top == 7.0
        assert decode.first_eligible_argmax(fmt, logits, parsed, position) == token
        eligible = fmt.content_mask(MERGE, "cpu", vocab).expand(2, -1)
        stats = engine.choice_stats(logits.expand(2, -1), eligible, parsed, torch.full((2,), position), top=True)
        assert stats.tolist() == [[token] * 2, [margin] * 2, [1.0] * 2, [1.0] * 2, [7.0] * 2]
        eng = engine.StepEngine(lm, fmt, engine.EngineRun(batch=1, max_len=64), decoding=Decoding.of(TINY_CAPS, rule, top_logits=True))
        assert eng.first_choice(logits.expand(2, -1), MERGE, position) == stats.tolist()
    if rule == "lowest":  # the default is torch.argmax itself
        assert token == int(logits.masked_fill(~eligible[0], float("-inf")).argmax())


def _planting(lm, fmt):
    """A readout that sets two content tokens to the same top logit at every step (an ineligible one higher)."""
    a, b, bad, _ = _tied(lm, fmt)

    def plant(x: torch.Tensor) -> torch.Tensor:
        x = x.float().clone()
        top = x.amax(-1)
        x[:, a], x[:, b], x[:, bad] = top + 1, top + 1, top + 5
        return x

    return plant, (lambda lm, kwargs: plant(lm.model(**kwargs, logits_to_keep=1).logits[:, -1, :])), (a, b)


@pytest.mark.parametrize("rule", RULES)
def test_the_engine_step_breaks_every_planted_tie_as_the_eager_cursor_does(lm_fmt, rule):
    """The engine's eager step on planted ties equals the eager cursor on its logits; suffixes agree token for token."""
    lm, fmt = lm_fmt
    plant, readout, (a, b) = _planting(lm, fmt)
    problems = tiny_problems(3)
    lives = [decode.decode_live(lm, fmt, fmt.prompt_ids(p.question, p.options), TINY_CAPS) for p in problems]
    with torch.inference_mode():
        lives = [dataclasses.replace(s, logits=plant(s.logits)) for s in lives]
    decoding = Decoding.of(TINY_CAPS, rule, top_logits=True)
    eng = engine.StepEngine(lm, fmt, engine.EngineRun(batch=3, max_len=256), readout=readout, decoding=decoding)
    for slot, s in enumerate(lives):
        n = eng.admit(slot, s.cache, s.roles)
        eng.set_row_pair(slot, a, n, MERGE, MERGE)  # feed a content token at the next position
    with torch.inference_mode():
        logits, stats = eng.step()
    for slot, s in enumerate(lives):
        position = len(s.ids) + 1
        cursor = decode.BlockCursor(fmt, TINY_CAPS, MERGE, tie_rule=decoding.tie_rule)
        token, _, margin, _ = cursor.step(logits[2 * slot], position=position)
        assert token == _want(rule, a, b, position) == stats[0][2 * slot] == stats[0][2 * slot + 1]
        assert margin == stats[1][2 * slot] == 0.0 and cursor.last_top == stats[4][2 * slot]
    eager = [decode.decode_suffix(lm, fmt, caches.live_replica(s), decoding, readout=readout) for s in lives]
    batched = engine.decode_suffixes(lm, fmt, lives, decoding, readout=readout, run=engine.EngineRun(batch=2))
    for e, g in zip(eager, batched):
        assert e.tokens == g.tokens and e.margins == g.margins
        assert len(g.tops) == len(g.margins) and [t is None for t in g.tops] == [m is None for m in g.margins]
        chosen = [t for t, m in zip(e.tokens, e.margins) if m == 0.0]
        assert chosen and set(chosen) <= {a, b}
        if rule in ("lowest", "highest"):
            assert set(chosen) == {a if rule == "lowest" else b}
    if rule.startswith("hash"):
        assert {t for e in eager for t, m in zip(e.tokens, e.margins) if m == 0.0} == {a, b}  # by position


# ----------------------------------------------------------------------------- keys, arm, report


def test_the_default_rule_adds_nothing_to_a_key_or_an_environment(tiny_arm, tmp_path, lm_fmt):
    problems = tiny_problems(2)
    plain, lowest = tiny_arm(), tiny_arm(tie_rule="lowest", top_logits=False)
    assert plain == lowest
    config = EXP1.plan(problems).config(plain)
    assert "tie_rule" not in config and "top_logits" not in config
    assert EXP1.plan(problems).folder(plain, tmp_path) == EXP1.plan(problems).folder(lowest, tmp_path)
    high = tiny_arm(tie_rule="highest")
    assert high.config("exp1", problems) == config | {"tie_rule": "highest"}
    again = ArmSettings.from_config(high.config("exp1", problems) | {"top_logits": True})
    assert (again.tie_rule, again.top_logits, ArmSettings.from_config(config).tie_rule) == ("highest", True, "lowest")
    lm, fmt = lm_fmt
    assert "tie_rule" not in arm_environment(lm, fmt, plain)
    assert arm_environment(lm, fmt, high)["tie_rule"] == "highest"
    assert plain.engine_run(fmt, problems) is None
    hashed = tiny_arm(step_path="engine-eager", tie_rule="hash:3")
    run = hashed.engine_run(fmt, problems)
    assert (hashed.decoding.tie_rule, hashed.decoding.top_logits) == (ties.TieRule("hash", 3), False)
    assert run.settings(hashed.decoding) == run.settings(Decoding.of(TINY_CAPS)) | {"tie_rule": "hash:3"}  # the run log
    with pytest.raises(ValueError, match="unknown tie rule"):
        tiny_arm(tie_rule="random")
    plan = EXP1_TIES.plan(problems, key={"tie_rule": "highest", "top_logits": True})
    assert plan.config(plain) == config | {"experiment": "exp1_ties", "tie_rule": "highest", "top_logits": True}
    assert plan.bind(plain) == dataclasses.replace(plain, tie_rule="highest", top_logits=True)


def test_the_control_is_planned_once_per_rule_of_the_profile():
    chain = types.SimpleNamespace(params=types.SimpleNamespace(tie_rules=("highest", "hash:0"), n_rows=2, preflight=1),
                                  rows=tiny_problems)
    plans = EXP1_TIES.plans(chain)
    assert [dict(p.key) for p in plans] == [{"tie_rule": "highest", "top_logits": True},
                                            {"tie_rule": "hash:0", "top_logits": True}]
    assert [p.problem_id for p in plans[0].problems] == ["tiny-00", "tiny-01"] and plans[0].preflight == 1
    assert EXP1_TIES.plans(types.SimpleNamespace(params=types.SimpleNamespace(tie_rules=(), n_rows=2, preflight=1),
                                                 rows=tiny_problems)) == []
    with pytest.raises(ValueError, match="once per rule"):
        EXP1_TIES.prepare(chain)
    assert ARMS["exp1_ties"] is EXP1_TIES and EXP1_TIES.dtypes == ("bfloat16",) and EXP1_TIES.row is EXP1.row


@pytest.mark.parametrize("path", [{}, {"step_path": "engine-eager", "batch": 2}])
def test_a_tiny_control_arm_passes_every_gate_and_keys_its_rule(tmp_path, tiny_arm, path):
    problems = tiny_problems(3)
    plan = EXP1_TIES.plan(problems, key={"tie_rule": "hash:0", "top_logits": True}, preflight=1)
    records, ledger = plan.run(tiny_arm(**path), ledger_root=tmp_path, progress=False)
    assert [r["gate_failure"] for r in records] == [None] * 3
    assert validate_rows("exp1_ties", records) == records
    assert ledger.dir.name.startswith("exp1_ties-bfloat16-")
    manifest = json.loads((ledger.dir / "manifest.json").read_text())["config"]
    assert manifest["tie_rule"] == "hash:0" and manifest["top_logits"] is True
    env = json.loads((ledger.dir / "environment.json").read_text())["execution_contract"]
    assert env["tie_rule"] == "hash:0"
    for r in records:
        for arm in r["arms"].values():
            assert len(arm["top_logits"]) == len(arm["margins"])
            assert [t is None for t in arm["top_logits"]] == [m is None for m in arm["margins"]]
    from kvreplay.verify import verify_ledger  # make verify rebinds the rule from the manifest: bit for bit

    checks = verify_ledger(ledger.dir, rows=3, pick="first", problems=problems, model=str(tmp_path / "tiny-llama"))
    assert [(c.mode, c.ok) for c in checks] == [("bytes", True)] * 3
    from kvreplay.paper.chain import unfinished_arms

    params = load_parameters("smoke", {"tie_rules": ["hash:0", "highest"], "precisions": ["bfloat16"]})
    assert [x for x in unfinished_arms(["01_experiment1_live_vs_prefill.ipynb"], params, ledger.dir.parent)
            if "exp1_ties" in x] == ["01_experiment1_live_vs_prefill.ipynb: exp1_ties-bfloat16 (highest) (not started)"]
    default, _ = EXP1.run(tiny_arm(**path), problems, ledger_root=tmp_path, progress=False)
    assert all("top_logits" not in a for r in default for a in r["arms"].values())
    summary = tie_rule_summary(default, {"hash:0": records})
    assert list(summary) == ["lowest", "hash:0"] and summary["hash:0"]["n"] == 3
    assert summary["hash:0"]["one_spacing"] is not None or summary["hash:0"]["nonzero"] == 0
    assert summary["lowest"]["one_spacing"] is None or summary["lowest"]["nonzero"] == 0


def _row(pid, differs, fd=None, live=(), prefill=(), tops=True):
    def arm(m):
        a = {"margins": list(m)}
        if tops:
            a["top_logits"] = [None if x is None else 3.0 for x in m]  # BF16 spacing at 3.0: 2**-6
        return a
    return {"problem_id": pid, "gate_failure": None,
            "endpoints": {"suffix_differs": differs, "first_divergence": fd,
                          "tie_initiated": None if fd is None else (live[fd] == 0.0 or prefill[fd] == 0.0)},
            "arms": {"live": arm(live), "prefill": arm(prefill)}}


def test_the_report_counts_ties_gaps_intervals_and_mcnemar_on_hand_built_rows():
    s = 2.0 ** -6
    ref = [_row("a", True, 1, [1.0, 0.0, None], [1.0, s, None], tops=False),  # begun at a tie
           _row("b", True, 0, [s, 1.0], [2 * s, 1.0], tops=False),  # begun at a nonzero margin
           _row("c", False, None, [1.0, None], [1.0, None], tops=False),
           _row("d", False, None, [0.0, 1.0], [0.0, 1.0], tops=False)]
    other = [_row("a", False, None, [1.0, 0.0], [1.0, 0.0]),
             _row("b", True, 0, [s, 1.0], [3 * s, 1.0]),  # one BF16 spacing: no rule changes it
             _row("c", True, 0, [4 * s], [0.0]),
             _row("d", True, 1, [0.0, 2 * s], [0.0, 3 * s])]  # the smaller margin is two spacings
    summary = tie_rule_summary(ref, {"highest": other})
    lo, hi = summary["lowest"], summary["highest"]
    assert (lo["n"], lo["suffix"], lo["tie"], lo["nonzero"], lo["one_spacing"], lo["mcnemar"]) == \
        (4, wilson(2, 4), 1, 1, None, None)
    assert (hi["suffix"], hi["tie"], hi["nonzero"], hi["one_spacing"]) == (wilson(3, 4), 1, 2, 1)
    assert hi["mcnemar"] == mcnemar_exact([True, True, False, False], [False, True, True, True])
    assert (hi["mcnemar"].b, hi["mcnemar"].c) == (1, 2)
    table = tie_rule_table(summary)
    assert list(table.columns) == ["lowest (reference)", "highest"]
    assert table.loc["of which begun at a nonzero margin (no tie rule changes that step)", "highest"] == "2/3"
    assert table.iloc[4, 0] == "n/a (no top logits)" and table.iloc[4, 1] == "1/2"
    with pytest.raises(ValueError, match="not the reference's problems"):
        tie_rule_summary(ref, {"highest": other[::-1]})
    steps = tie_steps({"ref": ref, "other": other})
    assert steps["chosen tokens"].tolist() == [14, 14] and steps["exact-tie steps"].tolist() == [3, 5]
    assert steps["per 1,000 chosen tokens"].tolist() == [round(3000 / 14, 2), round(5000 / 14, 2)]
    assert steps["top-1 logits recorded"].tolist() == [False, True]
    units = margin_units({"ref": ref, "other": other})
    assert set(units["arm"]) == {"other"} and len(units) == 14
    assert sorted(units["units"].tolist())[:9] == [0.0] * 5 + [1.0, 2.0, 3.0, 3.0]
    assert margin_bin(0.0) == "0 (exact tie)" and margin_bin(1.0) == "1" and margin_bin(0.5) == "(0, 1)"
    assert margin_bin(1.5) == "(1, 2)" and margin_bin(3) == "[2, 4)" and margin_bin(100) == ">= 64"
    assert bf16_spacing([3.0, 8.0, -0.3, 1.0]).tolist() == [2 ** -6, 2 ** -4, 2 ** -9, 2 ** -7]


def test_the_margin_histogram_draws_one_bar_group_per_arm():
    import matplotlib

    matplotlib.use("Agg")
    from kvreplay.experiments.tie_rules import BINS
    from kvreplay.report import figures

    s = 2.0 ** -6
    rows = [_row("a", True, 0, [0.0, s, 3 * s], [s, 100 * s, None]), _row("b", False, None, [0.5 * s], [0.5 * s])]
    units = margin_units({"x": rows, "y": rows[:1]})
    fig = figures.tie_margins(units, BINS, title="t")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == list(BINS)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["x (n = 7; 1 exact ties)", "y (n = 5; 1 exact ties)"]
    assert len(ax.patches) == 2 * len(BINS)


def test_notebook_01_computes_the_control_only_when_the_profile_lists_rules():
    from kvreplay.paper.chain import notebook_arms

    name = "01_experiment1_live_vs_prefill.ipynb"
    assert notebook_arms(name, load_parameters("smoke")) == ["exp1-bfloat16", "exp1-float32"]
    assert notebook_arms(name, load_parameters("smoke", {"tie_rules": ["highest"]}))[-1] == "exp1_ties-bfloat16"
    assert "exp1_ties-bfloat16" not in notebook_arms(name, load_parameters(
        "smoke", {"tie_rules": ["highest"], "precisions": ["float32"]}))
    with pytest.raises(ValueError, match="the chain's own tie rule"):
        load_parameters("smoke", {"tie_rules": ["highest"], "execution": {"tie_rule": "highest"}})
    with pytest.raises(ValueError, match="the chain's own tie rule"):
        load_parameters("smoke", {"tie_rules": ["lowest"]})
