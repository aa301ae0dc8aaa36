"""README's results section against figures/cpu/*.csv (kvreplay.report.readme_tables): CPU only, no model, seconds.

The committed README must equal what the CSVs give (tables cell by cell, prose counts and intervals), and
the check must fail when one CSV cell, one paper number in reference.yaml or one README number changes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvreplay.report.readme_tables as rt

ROOT = Path(__file__).resolve().parents[1]
PROFILE = "cpu"
EXP1 = "README table cpu/exp1"
HERE = "here (`cpu`, 16 rows)"


def _readme(root: Path = ROOT) -> str:
    return (root / "README.md").read_text(encoding="utf-8")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of what the check reads: README.md, figures/cpu/*.csv and data/paper/reference.yaml."""
    (tmp_path / "figures" / PROFILE).mkdir(parents=True)
    for f in (ROOT / "figures" / PROFILE).glob("*.csv"):
        shutil.copy(f, tmp_path / "figures" / PROFILE / f.name)
    (tmp_path / rt.REFERENCE).parent.mkdir(parents=True)
    shutil.copy(ROOT / rt.REFERENCE, tmp_path / rt.REFERENCE)
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    return tmp_path


def _replace(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times in {path}"
    path.write_text(text.replace(old, new), encoding="utf-8")


def _cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(rt.__file__).parents[1])}
    return subprocess.run([sys.executable, "-m", "kvreplay.report.readme_tables", "--profile", PROFILE, "--root", str(root),
                           *args], capture_output=True, text=True, env=env, timeout=120)


# ----------------------------------------------------------------------------- the committed README


@pytest.mark.parametrize("profile", ["cpu", "gpu", "paper"])
def test_readme_tables_equal_figures(profile):
    diffs = rt.check_tables(_readme(), ROOT, profile)
    assert not diffs, f"README's results tables differ from figures/{profile} (run python -m kvreplay.report.readme_tables " \
        f"--profile {profile}):\n" + "\n".join(map(str, diffs))


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_readme_prose_counts_and_intervals_equal_figures(profile):
    diffs = rt.check_prose(_readme(), ROOT, profile)
    assert not diffs, f"README's results prose quotes numbers figures/{profile} does not give:\n" + "\n".join(map(str, diffs))


@pytest.mark.parametrize("profile", ["cpu", "gpu", "paper"])
def test_rewriting_the_readme_changes_nothing(profile):
    readme = _readme()
    assert rt.write(readme, ROOT, profile) == readme


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_every_table_of_the_section_is_generated(profile):
    section = rt.results_section(_readme(), profile)
    assert section, f"README has no section '## Results of the committed `{profile}` run'"
    blocks = {m["name"] for m in rt.BLOCK.finditer(section) if m["profile"] == profile}
    assert blocks == set(rt.TABLES_BY_PROFILE[profile])
    assert not [line for line in rt.BLOCK.sub("", section).splitlines() if line.startswith("|")]


def test_the_prose_check_reads_the_quoted_numbers():
    """Guard against a vacuous pass: the section's prose quotes many counts, and intervals with them."""
    paragraphs = rt._paragraphs(rt.results_section(_readme(), PROFILE))
    counts = sum(len(rt._FRACTION.findall(p)) for p in paragraphs)
    intervals = sum(len(rt._INTERVAL.findall(p)) for p in paragraphs)
    assert counts >= 30 and intervals >= 10, (counts, intervals)


def test_cli_check_passes_on_the_committed_readme(repo: Path):
    out = _cli(repo, "--check")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "agrees" in out.stdout


def test_the_module_loads_no_model_library():
    env = {**os.environ, "PYTHONPATH": str(Path(rt.__file__).parents[1])}
    code = "import sys, kvreplay.report.readme_tables; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


# ----------------------------------------------------------------------------- the check can fail


@pytest.mark.parametrize(
    "csv, old, new, row, column, readme, expected",
    [
        ("table_exp1_matrix.csv", 'suffix differs,"5/16 (31.2%; Wilson 95% CI [14.16, 55.60])"',
         'suffix differs,"6/16 (37.5%; Wilson 95% CI [18.48, 61.36])"',
         "BF16: suffixes differ", HERE, "5/16 (31.2%; Wilson [14.2, 55.6])", "6/16 (37.5%; Wilson [18.5, 61.4])"),
        ("table_exp1_matrix.csv", "6.37e-07 [3.68e-07", "6.38e-07 [3.68e-07",
         "FP32: median relative L2 cache drift", HERE, "6.37e-7 [3.68e-7, 7.40e-7]", "6.38e-7 [3.68e-7, 7.40e-7]"),
        ("table_exp1_matrix.csv", "boundary prefix token-identical across precisions,8/16",
         "boundary prefix token-identical across precisions,9/16",
         "boundary prefixes token-identical across precisions", HERE, "8/16", "9/16"),
        ("table_first_divergence.csv", "3,4.5,48,99.5,118\n\"Exp 1 prefill vs live, float32\"",
         "3,4.5,48,99,118\n\"Exp 1 prefill vs live, float32\"",
         "BF16: first divergence, median (range); quartiles", HERE,
         "48 (3–118) tokens; 4.5, 48, 99.5", "48 (3–118) tokens; 4.5, 48, 99"),
    ],
)
def test_a_changed_csv_cell_fails_the_check(repo: Path, csv, old, new, row, column, readme, expected):
    _replace(repo / "figures" / PROFILE / csv, old, new)
    diffs = rt.check_tables(_readme(repo), repo, PROFILE)
    assert diffs == [rt.Difference(EXP1, f"row {row!r}, column {column!r}", readme, expected)]
    out = _cli(repo, "--check")
    assert out.returncode == 1
    assert EXP1 in out.stdout and repr(row) in out.stdout and expected in out.stdout
    # rewriting makes the table agree again and touches nothing outside the block (the prose is edited by hand)
    assert _cli(repo).returncode == 0
    assert rt.check_tables(_readme(repo), repo, PROFILE) == []
    before, after = _readme(ROOT), _readme(repo)
    assert rt.BLOCK.sub("", before) == rt.BLOCK.sub("", after)
    assert rt.BLOCK.search(after).group(0) == rt.BLOCK.search(before).group(0).replace(readme, expected)


def test_a_changed_paper_number_fails_the_check(repo: Path):
    _replace(repo / rt.REFERENCE, "166/200 (83.0%; Wilson 95% CI [77.18, 87.57])",
             "167/200 (83.5%; Wilson 95% CI [77.67, 87.99])")
    diffs = rt.check_tables(_readme(repo), repo, PROFILE)
    assert diffs == [rt.Difference(EXP1, "row 'BF16: suffixes differ', column 'paper (200 rows)'",
                                   "166/200 (83.0%; [77.2, 87.6])", "167/200 (83.5%; [77.7, 88.0])")]


def test_a_changed_readme_cell_fails_the_check(repo: Path):
    _replace(repo / "README.md", "| 4/16 / 4/16 / 1/16 / 0/16 |", "| 4/16 / 4/16 / 2/16 / 0/16 |")
    diffs = rt.check_tables(_readme(repo), repo, PROFILE)
    row = "BF16: merge / answer block / predicted letter / correctness label differ"
    assert diffs == [rt.Difference(EXP1, f"row {row!r}, column {HERE!r}", "4/16 / 4/16 / 2/16 / 0/16",
                                   "4/16 / 4/16 / 1/16 / 0/16")]


def test_a_table_outside_a_block_fails_the_check(repo: Path):
    text = _readme(repo)
    end = text.index("<!-- /results-table -->\n", text.index("<!-- results-table: cpu/")) + len("<!-- /results-table -->\n")
    (repo / "README.md").write_text(text[:end] + "\n| a | b |\n|---|---|\n| 1 | 2 |\n" + text[end:], encoding="utf-8")
    diffs = rt.check_tables(_readme(repo), repo, PROFILE)
    assert [d.item for d in diffs] == ["a table outside a results-table block"]


def test_a_removed_block_fails_the_check(repo: Path):
    text = _readme(repo)
    _replace(repo / "README.md", rt.BLOCK.search(text).group(0), "")
    assert [d.item for d in rt.check_tables(_readme(repo), repo, PROFILE)] == ["table exp1"]


@pytest.mark.parametrize(
    "old, new, item",
    [
        ("predicted letter 1/16", "predicted letter 3/16", "count 3/16"),  # Experiment 2: no 3/16 in its tables
        ("complete\nsuffixes (6/6)", "complete\nsuffixes (5/5)", "count 5/5"),  # in Experiment 4's tables, not 3's
        ("8/16 rows ([28.0, 72.0])", "8/16 rows ([28.0, 71.0])", "Wilson interval of 8/16"),
        ("suffixes 5/16 (Wilson\n[14.2, 55.6])", "suffixes 5/16 (Wilson\n[14.2, 56.6])", "Wilson interval of 5/16"),
        ("6/16 (37.5%, Wilson", "6/16 (38.5%, Wilson", "percentage of 6/16"),
        ("FP32 − BF16: suffix −31.2 pts [−56.2, −12.5]", "FP32 − BF16: suffix −31.2 pts [−56.2, −11.5]", "interval"),
        ("rates above\n27.8%", "rates above\n28.8%", "rates above"),
        ("187/200 rows", "186/200 rows", "count 186/200"),
    ],
)
def test_a_changed_prose_number_fails_the_check(repo: Path, old, new, item):
    _replace(repo / "README.md", old, new)
    diffs = rt.check_prose(_readme(repo), repo, PROFILE)
    assert [d.item for d in diffs] == [item], diffs


def test_cli_check_names_a_changed_prose_count(repo: Path):
    _replace(repo / "README.md", "predicted letter 1/16", "predicted letter 3/16")
    out = _cli(repo, "--check")
    assert out.returncode == 1
    assert "README prose '**Experiment 2**" in out.stdout and "count 3/16" in out.stdout


def test_a_missing_csv_row_is_an_error_naming_it(repo: Path):
    _replace(repo / "figures" / PROFILE / "table_exp1_matrix.csv", "merge differs,", "merges differ,")
    with pytest.raises(rt.ReadmeTableError, match=r"table_exp1_matrix\.csv has no row 'merge differs'"):
        rt.check_tables(_readme(repo), repo, PROFILE)
    out = _cli(repo, "--check")
    assert out.returncode == 2 and "merge differs" in out.stderr


# ----------------------------------------------------------------------------- formatting


def test_number_formatting():
    assert rt._sci("0.00793", 3) == "7.93e-3"
    assert rt._sci("7.4e-07", 3) == "7.40e-7"
    assert rt._sci("0.01224") == "1.224e-2"
    assert rt._sci("4.27e-06") == "4.27e-6"
    assert [rt._round(x, 1) for x in ("55.60", "77.18", "0.00", "100.00", "14.15")] == ["55.6", "77.2", "0", "100", "14.2"]
    assert rt._same("27.8", "27.75") and rt._same("49", "48.99") and rt._same("−18.8", "-18.8")
    assert rt._same("0", "+0.0") and not rt._same("14.2", "14.26")


def _copy_figures(tmp_path: Path, *profiles: str) -> None:
    """figures/<profile>/*.csv of each profile and data/paper/reference.yaml, copied under ``tmp_path``."""
    for prof in profiles:
        (tmp_path / "figures" / prof).mkdir(parents=True)
        for f in (ROOT / "figures" / prof).glob("*.csv"):
            shutil.copy(f, tmp_path / "figures" / prof / f.name)
    (tmp_path / rt.REFERENCE).parent.mkdir(parents=True)
    shutil.copy(ROOT / rt.REFERENCE, tmp_path / rt.REFERENCE)


def test_the_paper_tables_quote_the_gpu_run_and_say_the_controls_were_not_run(tmp_path):
    """The `paper` blocks set the `gpu` run beside it; a changed `gpu` cell is a difference of the `paper` block, and
    without figures/paper/exp2_controls.csv the controls' rows say "not run" in the `paper` column."""
    _copy_figures(tmp_path, "gpu", "paper")
    readme = _readme()
    assert not rt.check_tables(readme, tmp_path, "paper") and not (tmp_path / "figures" / "paper" / "exp2_controls.csv").exists()
    header, rows = rt.TABLES_BY_PROFILE["paper"]["exp3_exp5"].build(tmp_path, "paper")
    assert header[1].startswith("`gpu` profile") and header[2].startswith("`paper` profile") and header[2].endswith("/ —)")
    joint = next(r for r in rows if r[0].startswith("Exp 4 whole-cache transplant: joint"))
    assert joint[2].endswith("; 1 panel row left out (precondition unmet)") and "left out" not in joint[1]
    controls = [r for r in rows if r[0].startswith("Controls")]
    assert len(controls) == 4 and all(r[2] == "not run" and r[1] != "not run" and r[3] == "not in the paper" for r in controls)
    _replace(tmp_path / "figures" / "gpu" / "table_exp2_crossing.csv", '"43 vs 0, p = 2.27e-13"', '"43 vs 1, p = 5e-12"')
    diffs = rt.check_tables(readme, tmp_path, "paper")
    assert [d.item for d in diffs] == ["row 'Exp 2 paired FP32 − BF16 suffix disagreement, pts [95% CI]', column "
                                       "'`gpu` profile: H200, graph engine, 50 problems per step, caps 48 / 160 / 12 (200 rows)'"]


def test_the_side_by_side_table_follows_the_cpu_tables_too(tmp_path):
    """The `gpu` table quotes the `cpu` run beside it: a changed `cpu` cell is a difference of the `gpu` block."""
    _copy_figures(tmp_path, "cpu", "gpu")
    readme = _readme()
    assert not rt.check_tables(readme, tmp_path, "gpu")
    _replace(tmp_path / "figures" / "cpu" / "table_exp2_crossing.csv", '"5 vs 0, p = 0.0625"', '"5 vs 1, p = 0.219"')
    diffs = rt.check_tables(readme, tmp_path, "gpu")
    assert [d.item for d in diffs] == ["row 'Exp 2 paired FP32 − BF16 suffix disagreement, pts [95% CI]', column "
                                       "'`cpu` profile: 2-core CPU, eager, caps 48 / 160 / 12 (16 rows)'"]


def test_the_run_labels_give_each_profiles_caps_and_batch():
    """The side-by-side headers name caps and problems per step: they must be what the profile files say."""
    import yaml

    for profile, label in rt.RUN_LABELS.items():
        doc = yaml.safe_load((ROOT / "notebooks" / "params" / f"{profile}.yaml").read_text())
        assert f"caps {doc['cap_branch']} / {doc['cap_merge']} / {doc['cap_answer']}" in label, profile
        batch = doc.get("execution", {}).get("batch")
        assert (f"{batch} problems per step" in label) if doc.get("execution", {}).get("step_path") == "graph" \
            else "eager" in label, profile
