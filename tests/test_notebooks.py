"""Every notebook runs headlessly with papermill on its smoke parameters (the embedded model, real MMLU rows).

Each test writes to a fresh ledger folder, so the notebook computes; a second
run on the same folder must reuse the finished ledger without recomputing.
"""

from __future__ import annotations

import json
import os

import pandas as pd
import papermill as pm
import pytest
import yaml
from kvreplay.paper import CHAIN, artifact_log, declared_parameters
from kvreplay.paths import NOTEBOOKS, PARAMS
from kvreplay.report.files import ARTIFACT_LOG
from kvreplay.report.paper_tables import NOT_RUN
from kvreplay.report.summary import TABLES_BY_EXPERIMENTS

pytestmark = pytest.mark.notebook
SMOKE = yaml.safe_load((PARAMS / "smoke.yaml").read_text())
EXECUTION = SMOKE["execution"] | {"threads": 1}
"""The smoke profile's execution contract with one intra-op thread. `make test`'s two workers already keep both cores
busy, so a second thread only waits for a core: on 2 busy cores notebook 01 took the same wall time with one thread
as with two (320 against 328 s) and half the CPU time (222 against 468 s), which the other worker then gets."""


def _execute(name, out_dir, ledgers, figures, **extra):
    """Run one notebook on the smoke profile, its ledgers, checkpoints and figures in the test's folders, under
    :data:`EXECUTION` (overrides); ``extra``: the drift explorer's own parameters (passed to the notebooks that declare
    them)."""
    overrides = {"ledger_root": str(ledgers), "figures_root": str(figures), "checkpoint_root": str(ledgers.parent / "checkpoints"),
                 "execution": EXECUTION}
    extra.setdefault("interactive", False)  # notebook 08: no widgets in a headless run
    params = declared_parameters(name, {"profile": "smoke", "overrides": overrides, **extra})
    log = artifact_log(out_dir, name)  # the kernel records each table and figure there, as under make paper
    log.unlink(missing_ok=True)
    os.environ[ARTIFACT_LOG] = str(log)
    try:
        return pm.execute_notebook(
            str(NOTEBOOKS / name), str(out_dir / name), parameters=params, cwd=str(NOTEBOOKS), kernel_name="python3",
            progress_bar=False,
        )
    finally:
        del os.environ[ARTIFACT_LOG]


def test_every_notebook_has_a_parameters_cell():
    for name in CHAIN:
        nb = json.loads((NOTEBOOKS / name).read_text())
        tags = [t for c in nb["cells"] for t in c.get("metadata", {}).get("tags", [])]
        assert "parameters" in tags, name
        assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code"), f"{name} has outputs"
        defaults = pm.inspect_notebook(str(NOTEBOOKS / name))
        # the explorer runs as is on the committed cpu ledgers; every other notebook defaults to smoke
        assert defaults["profile"]["default"] == ('"cpu"' if name.startswith("08") else '"smoke"'), name
        assert "matplotlib.use(" not in json.dumps(nb), f"{name} forces a backend: its figures would not show inline"


@pytest.fixture(scope="module")
def explorer_cache(tmp_path_factory):
    """The explorer's cache of rebuilt rows in a temp folder (the kernels inherit it), not the checkout's build/."""
    from kvreplay.notebook.explorer import CACHE_ENV

    with pytest.MonkeyPatch.context() as mp:
        folder = tmp_path_factory.mktemp("explorer-cache")
        mp.setenv(CACHE_ENV, str(folder))
        yield folder


@pytest.fixture(scope="module")
def chain_run(tmp_path_factory, explorer_cache, progress):
    """The whole chain on smoke parameters into fresh ledger and figure folders, in dependency order."""
    import time

    root = tmp_path_factory.mktemp("chain")
    ledgers, figures = root / "ledgers", root / "figures"
    for i, name in enumerate(CHAIN, 1):
        t = time.perf_counter()
        _execute(name, root, ledgers, figures, **({"rebuild": True} if name.startswith("08") else {}))
        progress(f"smoke chain {i}/{len(CHAIN)}: {name} in {time.perf_counter() - t:.0f} s")
    return root, ledgers, figures


def test_role_adaptation_smoke(chain_run):
    root, ledgers, figures = chain_run
    folders = sorted((root / "checkpoints").glob("role-table-smoke-*"))  # one per recipe of smoke's search
    names = [r["name"] for r in SMOKE["adapt_selection"]["recipes"]]
    assert sorted(f.name.rsplit("-", 1)[0] for f in folders) == sorted(f"role-table-{n}" for n in names)
    manifests = [json.loads((f / "manifest.json").read_text()) for f in folders]
    assert all(m["base_model"]["unchanged_after_training"] for m in manifests)
    pointer = json.loads((ledgers / "smoke" / "role_adaptation.json").read_text())
    (manifest,) = [m for m, f in zip(manifests, folders) if pointer["folder"].endswith(f.name)]  # the chosen recipe
    assert [manifest["checkpoints"][k]["step"] for k in ("early", "later")] == SMOKE["adapt_checkpoints"]
    assert len(manifest["curve"]["train"]) == SMOKE["adapt_steps"]
    assert pointer["checkpoints"]["later"]["sha256"] == manifest["checkpoints"]["later"]["sha256"]
    evals = {json.loads((f / "manifest.json").read_text())["config"]["problem_set"]: f
             for f in (ledgers / "smoke").glob("adapt_eval-float32-*")}
    assert set(evals) == {"bank", "heldout selection"}
    assert len((evals["bank"] / "rows.jsonl").read_text().splitlines()) == SMOKE["n_adapt_eval"]
    held = [json.loads(x) for x in (evals["heldout selection"] / "rows.jsonl").read_text().splitlines()]
    assert len(held) == SMOKE["adapt_selection"]["n_heldout"] and set(held[0]["checkpoints"]) == {"ckpt0", *names}
    acc = pd.read_csv(figures / "smoke" / "adapt_accuracy.csv", index_col=0)
    assert acc.iloc[:, 0]["problems"] == str(SMOKE["n_adapt_eval"])
    tries = pd.read_csv(figures / "smoke" / "adapt_selection.csv", index_col=0)
    assert list(tries.index) == ["ckpt0", *names] and list(tries["chosen"].fillna("")).count("chosen") == 1
    assert pointer["folder"].split("/")[-1].startswith(f"role-table-{tries.index[tries['chosen'] == 'chosen'][0]}-")
    for ext in ("png", "pdf"):
        assert (figures / "smoke" / f"adapt_training_curve.{ext}").stat().st_size > 0


def test_experiment1_smoke(chain_run):
    root, ledgers, figures = chain_run
    for dtype in SMOKE["precisions"]:
        (rows,) = (ledgers / "smoke").glob(f"exp1-{dtype}-*/rows.jsonl")
        records = [json.loads(x) for x in rows.read_text().splitlines()]
        assert len(records) == SMOKE["n_rows"]
        assert all(r["gate_failure"] is None for r in records)
        assert all(r["boundary"]["live_replica"]["cache"]["exact"] for r in records)
    table = pd.read_csv(figures / "smoke" / "table_exp1_matrix.csv", index_col=0)
    assert list(table.columns) == SMOKE["precisions"]
    assert table.loc["replica pairs exact", "bfloat16"] == f"{SMOKE['n_rows']}/{SMOKE['n_rows']}"
    assert table.loc["boundary cache non-bit-exact", "bfloat16"] == f"{SMOKE['n_rows']}/{SMOKE['n_rows']}"
    for ext in ("md", "tex"):
        assert (figures / "smoke" / f"table_exp1_matrix.{ext}").stat().st_size > 0
    for ext in ("png", "pdf"):
        assert (figures / "smoke" / f"exp1_divergence_and_drift.{ext}").stat().st_size > 0
    bank = (ledgers / "smoke" / "prefix_bank_bf16.jsonl").read_text().splitlines()
    assert len(bank) == SMOKE["n_rows"] and json.loads(bank[0])["prefix"]


def test_experiments2_and_3_smoke(chain_run):
    root, ledgers, figures = chain_run
    for dtype in SMOKE["precisions"]:
        (rows,) = (ledgers / "smoke").glob(f"exp2-{dtype}-*/rows.jsonl")
        assert len(rows.read_text().splitlines()) == SMOKE["n_rows"]
    bridge = pd.read_csv(figures / "smoke" / "table_exp3_bridge.csv", index_col=0)
    n = SMOKE["n_bridge"]
    assert bridge.loc["incremental bit-exact to live on every layer", "bridge (BF16)"] == f"{n}/{n}"
    assert bridge.loc["complete suffix exact", "bridge (BF16)"] == f"{n}/{n}"
    audit = pd.read_csv(figures / "smoke" / "table_exp3_audit.csv", index_col=0)
    m = SMOKE["n_rows"]
    assert audit.loc["suffix reproduced: live→incremental", "audit (BF16)"] == f"{m}/{m}"
    assert audit.loc["rows on which every cache leaf agrees", "audit (BF16)"] == f"{m}/{m}"
    controls = pd.read_csv(figures / "smoke" / "exp2_controls.csv", index_col=0).iloc[:, 0]
    assert controls["rows"] == str(m) and "FP32 readout" in " ".join(controls.index)
    crossing = pd.read_csv(figures / "smoke" / "table_exp2_crossing.csv", index_col=0)
    assert crossing.loc["integer prefix identical across precision"].iloc[0] == f"{m}/{m}"
    assert json.loads((ledgers / "smoke" / "exp3_bridge_panel.json").read_text())["problem_ids"]


@pytest.mark.slow
def test_kernel_attribution_smoke(chain_run):
    """Notebook 09 (off make paper's chain) on the chain's ledgers: one exp2_kernels ledger per kernels value of the
    profile, every value on the prefix bank's IDs, its table and declared contrasts. Slow (``KVREPLAY_SLOW=1``):
    the invariant-kernel reference takes minutes a row on 2 CPU cores even at the smoke caps; the arm itself runs
    through ``run_arm`` on a tiny model in ``tests/test_kernel_ablation.py``."""
    root, ledgers, figures = chain_run
    _execute("09_kernel_ablation.ipynb", root, ledgers, figures)
    folders = sorted((ledgers / "smoke").glob("exp2_kernels-bfloat16-*"))
    configs = [json.loads((f / "manifest.json").read_text())["config"] for f in folders]
    assert sorted(c["kernels"] for c in configs) == sorted(SMOKE["kernel_values"])
    bank = {json.loads(x)["problem_id"]: json.loads(x)["prefix"]
            for x in (ledgers / "smoke" / "prefix_bank_bf16.jsonl").read_text().splitlines()}
    for f in folders:
        rows = [json.loads(x) for x in (f / "rows.jsonl").read_text().splitlines()]
        assert {r["problem_id"]: r["prefix"] for r in rows} == bank, f.name  # pinned: the bank's IDs in every value
    table = pd.read_csv(figures / "smoke" / "table_kernel_attribution.csv", index_col=0)
    n = len(bank)
    assert table.loc["`invariant`", "prefill cache = replay, bit for bit"] == f"{n}/{n}"  # by construction
    contrasts = pd.read_csv(figures / "smoke" / "table_kernel_contrasts.csv", index_col=0)
    assert list(contrasts.index) == [f"`{a}` vs `{b}`" for a, b in SMOKE["kernel_contrasts"]]
    assert "exact McNemar p" in (root / "09_kernel_ablation.ipynb").read_text()


def test_experiment4_smoke(chain_run):
    root, ledgers, figures = chain_run
    panel = json.loads((ledgers / "smoke" / "exp4_panel.json").read_text())["panel"]
    assert len(panel) == SMOKE["n_divergent"] + SMOKE["n_exact"] or len(panel) <= SMOKE["n_rows"]
    (rows,) = (ledgers / "smoke").glob("exp4-bfloat16-*/rows.jsonl")
    records = [json.loads(x) for x in rows.read_text().splitlines()]
    assert [r["problem_id"] for r in records] == [e["problem_id"] for e in panel]
    assert all(r["gate_failure"] is None for r in records)
    for r in records:  # a whole-cache transplant must reproduce its donor's suffix
        assert r["interventions"]["whole"]["prefill<-incremental"]["suffix"] == r["baseline"]["incremental"]
    table = pd.read_csv(figures / "smoke" / "table5_exp4_transplant.csv", index_col=0)
    assert "power note" in table.index
    assert (figures / "smoke" / "exp4_transplants.png").stat().st_size > 0


def test_experiment5_smoke(chain_run):
    root, ledgers, figures = chain_run
    panel_doc = json.loads((ledgers / "smoke" / "exp5_panel.json").read_text())
    panel = panel_doc["panel"]
    assert len(panel) == min(SMOKE["n_exp5"], SMOKE["n_rows"]) and panel_doc["checkpoint"]["kind"].startswith("later role table")
    (folder,) = (ledgers / "smoke").glob("exp5-bfloat16-*")
    records = [json.loads(x) for x in (folder / "rows.jsonl").read_text().splitlines()]
    assert [r["problem_id"] for r in records] == [e["problem_id"] for e in panel]
    assert all(r["gate_failure"] is None and list(r["interventions"]) == ["whole"] for r in records)
    env = json.loads((folder / "environment.json").read_text())["execution_contract"]
    assert env["model"]["role_table_sha256"] == panel_doc["checkpoint"]["role_table_sha256"]
    table = pd.read_csv(figures / "smoke" / "table_exp5_replication.csv", index_col=0).iloc[:, 0]
    from kvreplay.experiments.replication import PRECEDENCE

    assert table["interpretation (frozen matrix)"] in PRECEDENCE
    assert table["thresholds (the paper's, absolute)"].startswith("≥ 12 divergent and ≥ 6 exact rows")
    assert table["interpretation (frozen matrix)"] == "divergence-underpowered"  # a smoke panel never reaches 12 divergent
    scaled = f"≥ 1 divergent and ≥ 1 exact rows for n = {len(panel)}"  # ceil(12·n/48) and ceil(6·n/48) for n <= 4
    assert scaled in table["secondary: interpretation with thresholds scaled to the panel"]
    assert (figures / "smoke" / "exp5_replication.png").stat().st_size > 0
    assert (figures / "smoke" / "table_exp5_accuracy.csv").stat().st_size > 0


TABLES = ("table1_related_work", "table2_role_visibility", "table3_numerical_contract", "table_exp1_matrix",
          "table_exp2_matrix", "table_exp2_crossing", "table_exp3_bridge", "table_exp3_audit", "table5_exp4_transplant",
          "table_exp5_replication", "table_exp5_accuracy",
          "table_first_divergence", "table_setup_vs_paper", "table_vs_paper", "table_artifact_map",
          "table_prefix_length", "table_prefix_length_fit")
FIGURES = ("fig1_design", "fig_first_divergence", "fig_layer_drift", "fig_transplants", "fig_near_tie", "fig_prefix_length")


def test_tables_smoke(chain_run):
    root, ledgers, figures = chain_run
    out = figures / "smoke"
    for stem in TABLES:
        for ext in ("csv", "md", "tex"):
            assert (out / f"{stem}.{ext}").stat().st_size > 0, f"{stem}.{ext}"
    for stem, notebook in TABLES_BY_EXPERIMENTS.items():  # written once, by the experiment notebook
        assert f"(made by `notebooks/{notebook}`)" in (out / f"{stem}.md").read_text(), stem
    old_names = ("exp1_table", "exp2_table", "exp2_crossing", "exp3_bridge", "exp3_audit", "exp4_table", "exp4_localization",
                 "exp5_table", "exp5_accuracy")
    assert not [p.name for p in out.iterdir() if p.stem in old_names], "a table is written twice under two names"
    # notebook 06 recomputes each of them from the ledger rows and fails unless the CSVs are byte-identical
    assert "recomputed here, byte-identical" in (root / "06_tables.ipynb").read_text()
    for tex in out.glob("*.tex"):  # escaped (no raw Unicode) and labelled
        text = tex.read_text(encoding="utf-8")
        assert text.isascii(), tex.name
        assert f"\\label{{tab:{tex.stem}}}" in text, tex.name
    vs = pd.read_csv(out / "table_vs_paper.csv", index_col=0)
    built = vs[vs["experiment"] <= 5]
    assert (built["this run"] != NOT_RUN).all()
    amap = pd.read_csv(out / "table_artifact_map.csv", index_col=0)
    assert set(vs.index) <= set(amap.index)
    t2 = pd.read_csv(out / "table2_role_visibility.csv", index_col=0)
    assert "branch" not in t2.loc["answer", "may attend to"]


def test_figures_smoke(chain_run):
    root, ledgers, figures = chain_run
    for stem in FIGURES:
        for ext in ("png", "pdf"):
            assert (figures / "smoke" / f"{stem}.{ext}").stat().st_size > 0, f"{stem}.{ext}"


def test_explorer_rebuild_reproduces_the_ledger(chain_run):
    root, ledgers, figures = chain_run
    text = (root / "08_drift_explorer.ipynb").read_text()
    # what was compared (whole-cache summary, boundary logits, per-layer drift) and that every part is equal
    assert "per-layer K/V drift: equal)" in text and "the rebuild reproduces the ledger bit for bit" in text
    assert "differs" not in text.split("rebuilt values against the ledger row's", 1)[1].split("bit for bit", 1)[0]


def test_the_chain_computes_the_golden_rows(chain_run, capsys):
    """Every row, the fixed-prefix bank and the panels the chain computed are byte for byte the committed golden
    copies (tests/golden_smoke.py) where the environment is the one that wrote them (CI's); elsewhere skipped."""
    from golden_smoke import differences

    _, ledgers, _ = chain_run
    skipped, differ = differences(ledgers / "smoke")
    if skipped:
        pytest.skip(skipped)
    assert not differ, "\n".join(differ)


def test_tables_notebook_names_the_missing_notebook(tmp_path):
    with pytest.raises(pm.PapermillExecutionError, match="01_experiment1_live_vs_prefill"):
        _execute("06_tables.ipynb", tmp_path, tmp_path / "none", tmp_path / "figs")
    assert not (tmp_path / "figs").exists()  # nothing half-written


@pytest.fixture(scope="module")
def reused_run(chain_run, progress):
    """The chain once more on the finished ledgers (into ``<root>/reused``): what ``make paper`` executes after a run.

    Returns:
        ``(folder of the executed notebooks, ledger and checkpoint bytes before, the same after)``.
    """
    root, ledgers, figures = chain_run

    def state():
        files = [*(ledgers / "smoke").glob("*/*.jsonl"), *(root / "checkpoints").glob("*/*")]
        return {p: p.read_bytes() for p in files}

    before = state()
    out = root / "reused"
    out.mkdir(exist_ok=True)
    for i, name in enumerate(CHAIN, 1):
        _execute(name, out, ledgers, figures)
        progress(f"smoke chain again on its finished ledgers {i}/{len(CHAIN)}: {name}")
    return out, before, state()


def test_finished_ledgers_are_reused(reused_run, explorer_cache):
    out, before, after = reused_run
    assert before == after  # rows, run logs and checkpoints untouched: nothing was recomputed or retrained
    text = (out / "01_experiment1_live_vs_prefill.ipynb").read_text()
    assert "rows in the ledger, none computed" in text and "row/s" not in text  # one line, no bar, when nothing is computed
    # the explorer's rebuild of the first run is read back (rebuild = False here): its maps, no model loaded
    assert len(list(explorer_cache.glob("smoke/*.npz"))) == 1
    explorer = (out / "08_drift_explorer.ipynb").read_text()
    assert "read from the cache of rebuilt rows (" in explorer and "earlier; nothing rebuilt now" in explorer
    assert "image/png" in explorer
    assert "Mean over layers of the per-position drift" in explorer


# ----------------------------------------------------------------------------- unfavourable outcomes are reported


def _copy_chain(chain_run, tmp_path):
    import shutil

    root, ledgers, figures = chain_run
    new = tmp_path / "edited"
    shutil.copytree(ledgers, new / "ledgers")
    shutil.copytree(root / "checkpoints", new / "checkpoints")
    return new, new / "ledgers", new / "figures"


def _edit_rows(folder, edit):
    """Rewrite a finished ledger's rows (its manifest, and so its key, unchanged): a synthetic outcome."""
    path = folder / "rows.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()]
    edit(records)
    path.write_text("".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in records))


def _fail_recovery(records):
    """Row 0 becomes divergent, and its prefill <- incremental transplant keeps the recipient's suffix."""
    r = records[0]
    inc = r["baseline"]["incremental"]
    pre = inc[:1] + [t + 1 for t in inc[1:]]
    r["baseline"].update(prefill=pre, suffix_differs=True, first_divergence=1, tie_initiated=False)
    r["interventions"]["whole"]["prefill<-incremental"].update(outcome="recipient", suffix=pre)
    r["interventions"]["whole"]["incremental<-prefill"].update(outcome="donor", suffix=pre)


def test_a_transplant_recovery_failure_is_reported_not_asserted(chain_run, tmp_path):
    root, ledgers, figures = _copy_chain(chain_run, tmp_path)
    (exp4,) = (ledgers / "smoke").glob("exp4-bfloat16-*")
    (exp5,) = (ledgers / "smoke").glob("exp5-bfloat16-*")
    _edit_rows(exp4, _fail_recovery)
    _edit_rows(exp5, _fail_recovery)
    for name in ("04_experiment4_cache_transplant.ipynb", "05_experiment5_replication.ipynb"):
        _execute(name, root, ledgers, figures)
    t4 = pd.read_csv(figures / "smoke" / "table5_exp4_transplant.csv", index_col=0).iloc[:, 0]
    assert t4.filter(like="donor recovery, prefill <- incremental").iloc[0].startswith("0/1")
    t5 = pd.read_csv(figures / "smoke" / "table_exp5_replication.csv", index_col=0).iloc[:, 0]
    assert t5["interpretation (frozen matrix)"] == "checkpoint-sensitive recovery"
    assert "not the donor's: 1" in (root / "05_experiment5_replication.ipynb").read_text()


def test_fp32_drift_above_bf16_is_reported_not_asserted(chain_run, tmp_path):
    root, ledgers, figures = _copy_chain(chain_run, tmp_path)

    def inflate(records):
        for r in records:
            for t in r["boundary"]["prefill_vs_incremental"]["tensors"]:
                t["rel_l2"] = 1.0

    for folder in (ledgers / "smoke").glob("exp2-float32-*"):
        _edit_rows(folder, inflate)
    _execute("07_figures.ipynb", root, ledgers, figures)
    assert "FP32 NOT below BF16" in (root / "07_figures.ipynb").read_text()


# ----------------------------------------------------------------------------- what a reviewer reads


def test_index_links_every_table_and_figure_to_its_cell(chain_run):
    from kvreplay.paper import artifact_index, write_index

    root, ledgers, figures = chain_run
    entries = artifact_index(root, CHAIN)
    stems = [e["stem"] for e in entries]
    assert set(TABLES) <= set(stems) and set(FIGURES) <= set(stems)
    assert len(stems) == len(set(stems)), "an artifact is written by two cells"
    assert all(e["cell_id"] and e["cell"] >= 1 for e in entries)
    md, html = write_index(entries, "smoke", root / "executed", root / "html", figures=figures / "smoke")
    text = md.read_text()
    assert "table5_exp4_transplant" in text and "04_experiment4_cache_transplant.ipynb" in text
    assert "#cell-id=" in html.read_text()
    vs = pd.read_csv(figures / "smoke" / "table_vs_paper.csv", index_col=0)
    first = text.split("| artifact |")[0]  # the headline comes before the table, read from this run's data
    assert f"BF16 suffix differs: **{vs.loc['exp1.bf16.suffix', 'this run']}**" in first
    assert "[08_drift_explorer.ipynb](08_drift_explorer.ipynb)" in first


def test_notebooks_show_figures_inline_and_stay_quiet(chain_run):
    root, ledgers, figures = chain_run
    for name in CHAIN[:8]:
        nb = json.loads((root / name).read_text())
        outs = [o for c in nb["cells"] for o in c.get("outputs", [])]
        text = json.dumps(outs)
        assert "IProgress not found" not in text, name
        assert "de-quantizing" not in text and "Loading weights" not in text, name
        assert '"execution_contract"' not in text, f"{name} dumps environment.json"
        saved = text.count("[saved figure ")
        images = sum("image/png" in o.get("data", {}) for o in outs)
        assert images >= saved, f"{name}: {saved} figures saved, {images} shown inline"


def test_reexecution_reproduces_outputs(reused_run):
    """nbval re-executes executed notebooks (smoke profile, run on finished ledgers in the test's temp folder, as
    ``make paper`` runs them after a finished run) and compares every text output
    (tables, printed numbers) after tests/nbval_sanitize.cfg; images are not compared. The committed cpu copies
    are not re-executed here: notebooks 00-05 take minutes to reload their ledgers on 2 cores."""
    import subprocess
    import sys

    from kvreplay.paths import ROOT

    root, _, _ = reused_run
    picked = [str(root / n) for n in CHAIN if n[:2] in ("01", "06", "07")]
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--nbval", "--nbval-current-env",
         "--nbval-sanitize-with", str(ROOT / "tests" / "nbval_sanitize.cfg"), "--rootdir", str(root), *picked],
        cwd=root, capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
