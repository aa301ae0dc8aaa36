"""The README's headline block and docs/results-<profile>.md against what the committed ledgers give
(kvreplay.report.results, kvreplay.report.results_pages): no model; about a minute (three profiles' summaries)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from kvreplay.paths import LEDGERS, ROOT
from kvreplay.report import results_pages as rp
from kvreplay.report.results import REFERENCE, load_reference, profile_results
from kvreplay.analysis.stats import wilson

PROFILES = ("cpu", "gpu", "paper")
_CACHE: dict = {}


def results(profile: str):
    """Each committed profile's results, computed once for this module (seconds each)."""
    if profile not in _CACHE:
        print(f"\n[results of {profile} from data/ledgers/{profile}/]", flush=True)
        _CACHE[profile] = profile_results(profile, **rp.profile_stats(profile))
    return _CACHE[profile]


@pytest.mark.parametrize("profile", PROFILES)
def test_the_committed_pages_are_what_the_ledgers_give(profile):
    """docs/results-<profile>.md (and, for `paper`, the README's block) equal their regeneration byte for byte."""
    assert rp.check(profile, ROOT, results(profile)) == [], (
        f"regenerate with `make paper PROFILE={profile}` or `python -m kvreplay.report.results_pages --profile {profile}`")


def test_the_headline_states_what_the_ledgers_say():
    """The facts the README must show, read from the committed `paper` ledgers through the block itself."""
    block = rp.headline_block(results("paper"))
    assert block in (ROOT / "README.md").read_text()
    for text in ("| 76/200 (38.0% [31.6, 44.9]) | 166/200 (83.0% [77.2, 87.6]) | no |", "| 66 of 76 |",
                 "| 0/200 (0% [0, 1.9]) | 0/200 (0% [0, 1.9]) | yes |", "| 12/12 / 12/12 / 12/12 |",
                 "(integrity check) (row failing the precondition left out) | 23/23 (100% [85.7, 100]) | 24/24 (100% [86.2, 100]) | yes |",
                 "(integrity check) (row failing the precondition counted as a failure) | 23/24 (95.8% [79.8, 99.3]) | 24/24 (100% [86.2, 100]) | no |",
                 "`mmlu-6bf0fb35afd9b0d6`",
                 "caps 768 / 512 / 64", "the 7 ledgers read here on NVIDIA H200", "`step_path: graph`, 32 problems per step",
                 "attention `sdpa`"):
        assert text in block, text


@pytest.mark.parametrize("profile", PROFILES)
def test_every_headline_row_has_its_own_label(profile):
    """No two endpoints of the headline share a label (Experiment 4 reported with the row failing its precondition
    left out, and counted as a failure, names which in the label)."""
    labels = [r[1] for r in rp.headline_rows(results(profile))]
    assert len(labels) == len(set(labels)), [x for x in labels if labels.count(x) > 1]


def _copy(tmp_path: Path, profile: str) -> Path:
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copy(rp.page_path(profile), rp.page_path(profile, tmp_path))
    return tmp_path


def test_a_changed_number_is_named_and_rewritten(tmp_path):
    res = results("paper")
    root = _copy(tmp_path, "paper")
    readme, page = root / "README.md", rp.page_path("paper", root)
    readme.write_text(readme.read_text().replace("| 76/200 (38.0% [31.6, 44.9]) |", "| 77/200 (38.5% [31.6, 44.9]) |", 1))
    page.write_text(page.read_text().replace("| 12/12 | 12/12 |", "| 11/12 | 12/12 |", 1))
    diffs = rp.check("paper", root, res)
    assert len(diffs) == 2, diffs
    assert diffs[0].startswith("docs/results-paper.md: line ") and "11/12" in diffs[0]
    assert diffs[1].startswith("README.md, block results-headline:paper: line ") and "77/200" in diffs[1]
    outside = readme.read_text().split(rp.END)[1]
    assert sorted(p.name for p in rp.regenerate("paper", root, res)) == ["README.md", "results-paper.md"]
    assert rp.check("paper", root, res) == [] and readme.read_text().split(rp.END)[1] == outside


def test_a_readme_without_the_block_is_an_error(tmp_path):
    root = _copy(tmp_path, "paper")
    text = (root / "README.md").read_text()
    (root / "README.md").write_text(text[:text.index("<!-- results-headline")] + text[text.index(rp.END) + len(rp.END):])
    with pytest.raises(ValueError, match="0 results-headline blocks of profile 'paper'"):
        rp.check("paper", root, results("paper"))


def test_the_verdict_follows_the_numbers():
    """Had our BF16 rate been the paper's, the headline would say it lies inside our interval: the verdict column is
    computed, not typed."""
    res = results("paper")
    exp1 = dict(res.summary["exp1"])
    exp1["bfloat16"] = dict(exp1["bfloat16"], suffix=wilson(166, 200), tie_initiated=100)
    moved = dataclasses.replace(res, summary=dict(res.summary, exp1=exp1))
    row = rp.headline_rows(moved)[0]
    assert row[2:] == ("166/200 (83.0% [77.2, 87.6])", "166/200 (83.0% [77.2, 87.6])", "yes")
    assert "for Exp 1 BF16 rate, Exp 1 FP32" in rp.headline_block(moved)


def test_table_labels_and_formatted_text_are_never_read(monkeypatch):
    """The pages come from summary objects: the labelled results tables and their formatted cells can change (or
    break) without changing a page."""
    from kvreplay.experiments import bridge, controls, fixed_prefix, matrix, replication, transplant
    from kvreplay.analysis.stats import Proportion

    def broken(*a, **k):
        raise AssertionError("a labelled table or formatted cell was read")

    for module, name in ((matrix, "matrix_table"), (fixed_prefix, "crossing_table"), (bridge, "bridge_table"),
                         (bridge, "audit_table"), (transplant, "transplant_table"), (replication, "replication_table"),
                         (replication, "accuracy_table"), (controls, "controls_table")):
        monkeypatch.setattr(module, name, broken)
    monkeypatch.setattr(Proportion, "pct", broken)
    res = profile_results("cpu", LEDGERS, **rp.profile_stats("cpu"))
    assert rp.results_page(res) == rp.page_path("cpu").read_text()


def test_the_cli_checks_and_rewrites(tmp_path, capsys):
    root = _copy(tmp_path, "cpu")
    page = rp.page_path("cpu", root)
    page.write_text(page.read_text().replace("## Experiment 3", "## Experiment three"))
    assert rp.main(["--profile", "cpu", "--check", "--root", str(root)]) == 1
    assert "docs/results-cpu.md: line " in capsys.readouterr().out
    assert rp.main(["--profile", "cpu", "--root", str(root)]) == 0
    assert "rewritten: docs/results-cpu.md" in capsys.readouterr().out
    assert page.read_text() == rp.page_path("cpu").read_text()
    assert rp.main(["--profile", "nosuch", "--check", "--root", str(root)]) == 2
    assert "error: " in capsys.readouterr().err


def test_the_paper_values_are_the_papers_reported_numbers():
    """``value`` in data/paper/reference.yaml is the number its ``paper`` string reports (both are typed there)."""
    checked = 0
    for e in load_reference()["endpoints"]:
        v, text = e.get("value"), e["paper"]
        if v is None:
            continue
        if "k" in v:
            assert text.startswith(f"{v['k']}/{v['n']}") or (v["k"] == 0 and text == "no decoded disagreement"), e["id"]
        elif "p" in v:
            assert text.endswith(f"p = {v['p']:g}"), e["id"]
        elif "median" in v:
            assert text == f"median {v['median']} (range {v['min']}-{v['max']})", e["id"]
        else:
            assert text == f"BF16 {v['bfloat16']:g}; FP32 {v['float32']:g}", e["id"]
        checked += 1
    assert checked >= 20, REFERENCE


def test_make_paper_writes_the_page_of_another_ledger_root_into_build(tmp_path, monkeypatch):
    """A committed profile's label on another ledger root never touches docs/ or the README: its page goes to
    build/<profile>/results.md, and an unchanged rerun is skipped."""
    from kvreplay import paper
    from kvreplay.notebook.profiles import load_parameters

    monkeypatch.setattr(paper, "BUILD", tmp_path / "build")
    readme = (ROOT / "README.md").read_text()
    params = load_parameters("cpu", {"ledger_root": str(LEDGERS)})
    line = paper.write_results("cpu", params, LEDGERS / "cpu")
    page = tmp_path / "build" / "cpu" / "results.md"
    assert "rewritten" in line and page.read_text() == rp.relinked(rp.page_path("cpu").read_text(), page, ROOT, "cpu")
    # its links lead where the docs page's do (the executed notebooks: the build folder's own index)
    import re

    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text())
    assert "./index.html" in links and "../executed/cpu/README.md" not in links
    assert all((page.parent / x).resolve().is_file() for x in links if x != "./index.html" and not x.startswith("http")), links
    assert "up to date" in paper.write_results("cpu", params, LEDGERS / "cpu")
    assert (ROOT / "README.md").read_text() == readme
    empty = load_parameters("smoke", {"ledger_root": str(tmp_path / "none")})
    assert paper.write_results("smoke", empty, tmp_path / "none" / "smoke").startswith("no results page (")
