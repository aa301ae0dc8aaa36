"""The cross-family table (kvreplay.report.cross_family) on committed ledgers and on a tiny random Gemma 3's drift
records: every cell is what each profile's results give; other problem sets are refused; one drift row per layer
kind; the results page of a pair's second profile shows it, or one line while the first's chain is missing."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
from kvreplay.analysis.drift import aggregate
from kvreplay.experiments.transplant import reported_ways
from kvreplay.paths import LEDGERS, ROOT
from kvreplay.report import cross_family as cf
from kvreplay.report import results_pages as rp
from kvreplay.report.markdown import rate
from kvreplay.report.results import load_reference, profile_results, profile_stats
from kvreplay.analysis.stats import wilson

_CACHE: dict = {}


def results(profile: str, ledger_root=LEDGERS, **stats):
    """A committed profile's results, computed once for this module (seconds each); as ``profile_results``."""
    if profile not in _CACHE:
        _CACHE[profile] = profile_results(profile, ledger_root, **(stats or profile_stats(profile)))
    return _CACHE[profile]


@pytest.fixture
def cached(monkeypatch):
    """The module's loads of a profile's results (a page's partner, the command's profiles) come from the cache."""
    monkeypatch.setattr(cf, "profile_results", results)


def expected_column(res) -> dict:
    """Row key -> the value each cell must hold, read from the profile's summaries (not from the module's code)."""
    S = res.summary
    out: dict = {}
    for d in res.precisions:
        s = S["exp1"][d]
        out[f"exp1.{d}.suffix"] = s["suffix"]
        out[f"exp1.{d}.tie_initiated"] = cf.Count(s["tie_initiated"], s["suffix"].k)
        out[f"exp1.{d}.nonzero_margin"] = cf.Count(s["suffix"].k - s["tie_initiated"], s["suffix"].k)
        for exp in ("exp1", "exp2"):
            out[f"{exp}.{d}.drift"] = S[exp][d]["drift_median"]
            out[f"{exp}.{d}.drift.full"] = S[exp][d]["drift_median"]  # SmolLM2: every layer is full attention
    for k in ("layers_exact", "logits_exact", "suffix_exact"):
        out[f"exp3.bridge.{k}"] = cf.Count(S["bridge"][k], S["bridge"]["n"])
    t = S["transplant"]
    for key in ("joint_recovery", "third_among_exact"):
        ways = reported_ways(t, t[key], t["counted_as_failure"][key])
        out |= {f"exp4.{key}" + (f".{w}" if w else ""): p for w, p in ways}
        if ways[0][0] == "":  # counting the failing rows changes nothing: the same rate under either way
            out |= {f"exp4.{key}.{w}": ways[0][1] for w in cf.WAYS}
    r = S["replication"]
    out |= {f"exp5.{k}": r[k] for k in ("divergence", "joint_recovery", "third_among_exact")}
    out["exp5.interpretation"] = r["interpretation"].label
    return out


def test_every_cell_is_what_each_profiles_results_give():
    """`paper` and `gpu` (SmolLM2 both, the same 200 problems at other caps): each profile's cells are its summaries'
    numbers, the paper's column is reference.yaml's, and no row is left out or added."""
    a, b = results("paper"), results("gpu")
    t = cf.family_table(a, b)
    want_a, want_b = expected_column(a), expected_column(b)
    keys = [r.key for r in t.rows]
    assert len(keys) == len(set(keys)) and set(keys) <= set(want_a) | set(want_b) | {"exp4.joint_recovery",
                                                                                     "exp4.third_among_exact"}
    for r in t.rows:
        for got, want in ((r.a, want_a.get(r.key)), (r.b, want_b.get(r.key))):
            if ".drift." in r.key:  # recomputed from the per-tensor sums: the row's stored aggregate to the last bit
                assert got == pytest.approx(want, rel=1e-12), r.key
            else:
                assert got == want, r.key
    # both profiles' rows of each endpoint are there: tie splits and drift of both precisions, every reported way
    assert {f"exp1.{d}.{k}" for d in ("bfloat16", "float32") for k in ("suffix", "tie_initiated", "nonzero_margin")} <= set(keys)
    assert {f"exp{e}.{d}.drift.full" for e in (1, 2) for d in ("bfloat16", "float32")} <= set(keys)
    assert not any(k.endswith(".sliding") for k in keys)  # SmolLM2 has no sliding layer
    assert {"exp4.joint_recovery.left_out", "exp4.joint_recovery.counted_as_failure"} <= set(keys)  # paper: report_both
    ref = {e["id"]: e for e in load_reference()["endpoints"]}
    v = ref["exp1.bf16.suffix"]["value"]
    assert t.row("exp1.bfloat16.suffix").paper == wilson(v["k"], v["n"])
    assert t.row("exp1.float32.suffix").paper == wilson(0, 200)
    assert t.row("exp2.bfloat16.drift").paper == ref["exp2.drift"]["value"]["bfloat16"]
    assert t.row("exp1.bfloat16.drift").paper is None and t.row("exp1.bfloat16.tie_initiated").paper is None
    assert t.row("exp3.bridge.layers_exact").paper == cf.Count(12, 12)
    assert t.row("exp5.interpretation").paper == ref["exp5.interpretation"]["paper"]
    frame = t.frame()
    assert list(frame.columns) == ["endpoint", "the paper", "paper", "gpu"] and list(frame.index) == keys
    assert frame.loc["exp1.bfloat16.suffix", "gpu"] == b.summary["exp1"]["bfloat16"]["suffix"]
    assert frame.loc["exp1.bfloat16.suffix", "paper"] == a.summary["exp1"]["bfloat16"]["suffix"]
    # the sides: model, caps, precisions, devices and library digests as each profile's ledgers record them
    assert (t.a.caps, t.b.caps) == (a.caps, b.caps) and t.a.precisions == tuple(a.precisions)
    assert t.a.model["file"] == t.b.model["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert t.a.problems_sha256 == t.b.problems_sha256 and t.a.library_digests and t.b.devices == ("NVIDIA H200",)


def test_the_markdown_shows_the_cells():
    a, b = results("paper"), results("gpu")
    text = "\n".join(cf.render(cf.family_table(a, b), a.reference))
    s = b.summary["exp1"]["bfloat16"]
    assert f"| {rate(a.summary['exp1']['bfloat16']['suffix'])} | {rate(s['suffix'])} |" in text
    assert f"| not reported | 66/{a.summary['exp1']['bfloat16']['suffix'].k} | {s['tie_initiated']}/{s['suffix'].k} |" in text
    assert "| 768 / 512 / 64 | 48 / 160 / 12 | 768 / 512 / 64 |" in text
    assert "| 30 full | 30 full | — |" in text


def test_profiles_with_other_problems_are_refused():
    with pytest.raises(ValueError, match=r"profiles 'cpu' and 'gpu' do not hold the same problems \(16 and 200"):
        cf.family_table(results("cpu"), results("gpu"))
    with pytest.raises(ValueError, match="got 'gpu' twice"):
        cf.family_table(results("gpu"), results("gpu"))
    b = results("gpu")
    ledger = b.ledgers["exp1-bfloat16"]
    config = dict(ledger.config, problems_sha256="0" * 64)
    other = dataclasses.replace(b, profile="other", ledgers=dict(
        b.ledgers, **{"exp1-bfloat16": dataclasses.replace(ledger, manifest=dict(ledger.manifest, config=config))}))
    with pytest.raises(ValueError, match="'paper' and 'other' hold the same problem IDs with other content"):
        cf.family_table(results("paper"), other)


def _tiny_gemma_records(comparison: str) -> list[dict]:
    """Two rows' boundary drift of a tiny random Gemma 3 (four layers, one global), as Experiment 1 or 2 rows hold it."""
    from conftest import TINY_CAPS, TINY_FORMAT, tiny_lm, tiny_problems
    from kvreplay.decoding import decode
    from kvreplay.decoding.contract import resolve_format
    from kvreplay.experiments.matrix import comparison as compare

    lm = tiny_lm("gemma3")
    fmt = resolve_format(lm.tokenizer, TINY_FORMAT)
    rows = []
    for p in tiny_problems(2):
        live = decode.decode_live(lm, fmt, fmt.prompt_ids(p.question, p.options), TINY_CAPS)
        cmp = compare(live, decode.build_prefill(lm, fmt, live.ids), per_tensor=True)
        rows.append({"problem_id": p.problem_id, "gate_failure": None, "boundary": {comparison: cmp}})
    return rows


@pytest.fixture(scope="module")
def gemma_records() -> dict[str, list[dict]]:
    return {c: _tiny_gemma_records(c) for c in ("prefill_vs_live", "prefill_vs_incremental")}


def test_drift_by_layer_kind_of_a_tiny_gemma3(gemma_records):
    """One median per layer kind, each a row's relative L2 over that kind's K and V tensors (sliding: attended)."""
    records = gemma_records["prefill_vs_live"]
    by_kind = cf.drift_by_kind(records)
    assert list(by_kind) == ["full", "sliding"]
    for kind in by_kind:
        per_row = sorted(aggregate([t for t in r["boundary"]["prefill_vs_live"]["tensors"] if t["layer_kind"] == kind])["rel_l2"]
                         for r in records)
        assert by_kind[kind] == pytest.approx(sum(per_row) / 2, rel=1e-12)  # the median of two rows
    assert by_kind["sliding"] != by_kind["full"]


def test_a_gemma_profile_gets_one_drift_row_per_layer_kind(gemma_records):
    """A profile whose drift records name full and sliding layers, set beside SmolLM2's: one row per kind, the
    sliding row empty on SmolLM2's side."""
    b = results("gpu")
    ledgers = dict(b.ledgers)
    for exp, cmp in (("exp1", "prefill_vs_live"), ("exp2", "prefill_vs_incremental")):
        for d in b.precisions:
            ledgers[f"{exp}-{d}"] = dataclasses.replace(b.ledgers[f"{exp}-{d}"], records=gemma_records[cmp])
    gemma = dataclasses.replace(b, profile="tiny-gemma3", ledgers=ledgers)
    t = cf.family_table(results("paper"), gemma)
    for exp, cmp in (("exp1", "prefill_vs_live"), ("exp2", "prefill_vs_incremental")):
        for d in b.precisions:
            kinds = cf.drift_by_kind(gemma_records[cmp], cmp)
            rows = [r for r in t.rows if r.key.startswith(f"{exp}.{d}.drift.")]
            assert [r.key.rsplit(".", 1)[1] for r in rows] == ["full", "sliding"]
            assert [r.b for r in rows] == [kinds["full"], kinds["sliding"]]
            assert rows[1].a is None and rows[1].endpoint.endswith("sliding-window layers (attended positions)")
    text = "\n".join(cf.render(t, b.reference))
    assert "sliding-window layers (attended positions) | not reported | — |" in text


def _copy(tmp_path, profile: str):
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copy(rp.page_path(profile), rp.page_path(profile, tmp_path))
    return tmp_path


def test_the_page_of_a_pairs_second_profile_shows_the_table(tmp_path, monkeypatch, cached):
    """Declared as a pair, `gpu`'s page gains the section (found by `check`, written by `regenerate`) after its own
    sections, which stay as they are."""
    monkeypatch.setattr(cf, "FAMILY_PAIRS", (("paper", "gpu"),))
    res = results("gpu")
    families = cf.family_results(res)
    assert families is not None and families.table is not None and families.first == "paper"
    page = rp.results_page(res, families)
    committed = rp.page_path("gpu").read_text()
    assert page.startswith(committed) and "\n## Across model families\n" in page[len(committed):]
    assert "`python -m kvreplay.report.cross_family paper gpu`" in page
    root = _copy(tmp_path, "gpu")
    diffs = rp.check("gpu", root, res)
    assert len(diffs) == 1 and diffs[0].startswith("docs/results-gpu.md: ")
    assert [p.name for p in rp.regenerate("gpu", root, res)] == ["results-gpu.md"]
    assert rp.page_path("gpu", root).read_text() == page and rp.check("gpu", root, res) == []


def test_a_missing_partner_is_one_line_and_no_pair_is_nothing(monkeypatch):
    res = results("cpu")
    assert cf.family_results(res) is None and cf.families_section(None, res.reference) == []
    monkeypatch.setattr(cf, "FAMILY_PAIRS", (("nosuch", "cpu"),))
    families = cf.family_results(res, LEDGERS)
    assert families == cf.Families("nosuch", "cpu", None)
    section = cf.families_section(families, res.reference)
    assert section[0] == "## Across model families" and len([x for x in section if x]) == 2
    assert "`data/ledgers/nosuch/`" in section[2]
    assert rp.results_page(res, families).endswith("\n".join(section).rstrip("\n") + "\n")


def test_the_gemma_page_pairs_with_the_paper_profile():
    """gemma's results page reads the `paper` ledgers too (its up-to-date stamp with them), and a committed profile."""
    from kvreplay.paper.chain import EXECUTED_PROFILES

    assert ("paper", "gemma") in cf.FAMILY_PAIRS and cf.partners("gemma") == ["paper"] and cf.partners("paper") == []
    assert "gemma" in EXECUTED_PROFILES


def test_the_results_stamp_reads_the_partners_ledgers(monkeypatch):
    from kvreplay import paper

    alone = paper._results_inputs("cpu", LEDGERS / "cpu", [])
    monkeypatch.setattr(cf, "FAMILY_PAIRS", (("gpu", "cpu"),))
    assert paper._results_inputs("cpu", LEDGERS / "cpu", []) != alone


def test_the_cli(capsys, cached):
    assert cf.main(["paper", "gpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## Across model families\n") and "| **Exp 1 BF16: suffixes part, prefill vs live** |" in out
    assert cf.main(["cpu", "gpu"]) == 2
    assert "error: profiles 'cpu' and 'gpu' do not hold the same problems" in capsys.readouterr().err
    assert cf.main(["paper", "nosuch"]) == 2
    assert "error: " in capsys.readouterr().err
