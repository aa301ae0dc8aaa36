"""The `make paper` driver's command line: clear errors for bad input."""

import pytest
from kvreplay.paper import main


def test_unknown_profile_and_empty_selection_exit_2(capsys):
    assert main(["--profile", "no-such-profile"]) == 2
    assert "unknown profile" in capsys.readouterr().err
    assert main(["--profile", "smoke", "--only", "99"]) == 2
    assert "matches no notebook" in capsys.readouterr().err


def test_a_profile_given_as_a_file_is_passed_on_absolute_and_labels_the_build(tmp_path, monkeypatch):
    """`--profile some/where/mine.yaml`: the notebooks (run in notebooks/) get the absolute path; build/mine/."""
    from kvreplay import paper

    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "mine.yaml").write_text(f"profile: mine\nledger_root: {tmp_path / 'ledgers'}\n")
    seen = []
    monkeypatch.setattr(paper, "BUILD", tmp_path / "build")
    monkeypatch.setattr(paper, "run_notebook", lambda name, prm, out_dir, **kw: seen.append((out_dir.name, prm, out_dir)))
    monkeypatch.chdir(tmp_path)
    assert paper.main(["--profile", "p/mine.yaml", "--only", "01", "--no-executed"]) == 0
    ((label, injected, out_dir),) = seen
    assert label == "mine" and out_dir == tmp_path / "build" / "mine"
    assert injected["profile"] == str(tmp_path / "p" / "mine.yaml")


def test_up_to_date_notebooks_are_skipped(tmp_path, monkeypatch, capsys):
    from kvreplay import paper
    from kvreplay.notebook import profiles

    params = tmp_path / "params"
    params.mkdir()
    (params / "mini.yaml").write_text(f"profile: mini\nbase: defaults\nledger_root: {tmp_path / 'ledgers'}\n")
    (tmp_path / "ledgers" / "mini").mkdir(parents=True)
    ledger_file = tmp_path / "ledgers" / "mini" / "rows.jsonl"
    ledger_file.write_text("{}\n")
    ran, injected = [], []

    def fake_run(name, prm, out_dir, html=True, progress=True):
        ran.append(name)
        injected.append(prm)
        (out_dir / name).write_text("executed")

    monkeypatch.setattr(profiles, "PARAMS", params)
    monkeypatch.setattr(paper, "BUILD", tmp_path / "build")
    monkeypatch.setattr(paper, "run_notebook", fake_run)
    assert paper.main(["--profile", "mini", "--only", "01", "02"]) == 0
    assert len(ran) == 2
    assert injected[0] == {"profile": "mini", "overrides": {}, "interactive": False}  # the notebook resolves the rest
    assert paper.main(["--profile", "mini", "--only", "01", "02"]) == 0
    assert len(ran) == 2 and "up to date" in capsys.readouterr().out
    ledger_file.write_text('{"changed": 1}\n')  # a ledger changed: both rerun
    assert paper.main(["--profile", "mini", "--only", "01", "02"]) == 0
    assert len(ran) == 4
    assert paper.main(["--profile", "mini", "--only", "01", "--force"]) == 0
    assert len(ran) == 5
    text = (params / "mini.yaml").read_text()
    (params / "mini.yaml").write_text(text + "# a comment only\n")  # the resolved values are unchanged: skipped
    assert paper.main(["--profile", "mini", "--only", "01"]) == 0
    assert len(ran) == 5
    (params / "mini.yaml").write_text(text + "n_rows: 3\n")  # a value changed: rerun
    assert paper.main(["--profile", "mini", "--only", "01"]) == 0
    assert len(ran) == 6
    figures = tmp_path / "figs"  # --figures-root is passed as an override, and enters the stamp
    assert paper.main(["--profile", "mini", "--only", "01", "--figures-root", str(figures)]) == 0
    assert len(ran) == 7 and injected[-1]["overrides"] == {"figures_root": str(figures.resolve())}
    # a profile that names its notebooks (a partial reference run) runs only those by default
    (params / "mini.yaml").write_text(f"profile: mini\nbase: defaults\nledger_root: {tmp_path / 'ledgers'}\nnotebooks: ['03']\n")
    ran.clear()
    assert paper.main(["--profile", "mini", "--force"]) == 0
    assert [n[:2] for n in ran] == ["03"]


@pytest.mark.parametrize("stop", ["failure", "interrupt"])
def test_a_stopped_chain_resumes_at_the_notebook_that_stopped(tmp_path, monkeypatch, capsys, stop):
    """A chain that fails (or is interrupted) in 03 keeps 01 and 02 done: the same command skips them, even though
    03 wrote ledger rows before it stopped, and runs 03 (then the rest) again."""
    from kvreplay import paper
    from kvreplay.notebook import profiles

    params = tmp_path / "params"
    params.mkdir()
    (params / "mini.yaml").write_text(f"profile: mini\nbase: defaults\nledger_root: {tmp_path / 'ledgers'}\n")
    ledgers = tmp_path / "ledgers" / "mini"
    ledgers.mkdir(parents=True)
    ran, failing = [], ["03"]

    def fake_run(name, prm, out_dir, html=True, progress=True):
        ran.append(name[:2])
        (ledgers / f"rows-{name[:2]}.jsonl").write_text(f"{len(ran)}\n")  # each notebook writes (or resumes) a ledger
        if name[:2] in failing:
            if stop == "interrupt":
                raise KeyboardInterrupt
            raise RuntimeError(f"{name} failed in cell 3 (ValueError: planted)")
        (out_dir / name).write_text("executed")

    monkeypatch.setattr(profiles, "PARAMS", params)
    monkeypatch.setattr(paper, "BUILD", tmp_path / "build")
    monkeypatch.setattr(paper, "run_notebook", fake_run)
    args = ["--profile", "mini", "--only", "01", "02", "03", "04"]
    assert paper.main(args) == (1 if stop == "failure" else 130)
    assert ran == ["01", "02", "03"]
    failing.clear()
    assert paper.main(args) == 0
    assert ran == ["01", "02", "03", "03", "04"], "the notebooks that finished before the stop ran again"
    out = capsys.readouterr().out
    assert out.count("up to date") == 2
    assert paper.main(args) == 0 and len(ran) == 5  # a finished chain: every notebook skipped


def test_inprocess_engine_injects_parameters_and_names_the_failing_cell(tmp_path):
    """The in-process runner injects the values of the names the parameters cell declares, as papermill does."""
    import json

    from kvreplay.paper import run_inprocess

    def cell(src, tags=()):
        return {"cell_type": "code", "metadata": {"tags": list(tags)}, "source": src, "outputs": [], "execution_count": None}

    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "markdown", "metadata": {}, "source": "# t"},
        cell("n_rows = 2\nprofile = 'smoke'\n", ["parameters"]),
        cell("from pathlib import Path\nPath('out.txt').write_text(f'{profile} {n_rows}')\n"),
        cell("assert n_rows < 10, 'too many rows'\n"),
    ]}
    path = tmp_path / "t.ipynb"
    path.write_text(json.dumps(nb))
    run_inprocess(path, {"n_rows": 3, "profile": "cpu", "undeclared": 1})
    assert (tmp_path / "out.txt").read_text() == "cpu 3"  # written with the notebook folder as cwd
    with pytest.raises(RuntimeError, match=r"t.ipynb failed in code cell 3 \(AssertionError: too many rows\)"):
        run_inprocess(path, {"n_rows": 30})


def test_chain_order_and_checkpoint_files_enter_the_stamp(tmp_path):
    from kvreplay import adapt, paper
    from kvreplay.notebook.profiles import ChainParameters

    assert [n[:2] for n in paper.CHAIN] == [f"{i:02d}" for i in range(9)]
    ledger = tmp_path / "ledgers"
    (ledger / "p").mkdir(parents=True)
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "manifest.json").write_text("{}")
    table = folder / "role_table_step0001.pt"
    table.write_bytes(b"a")
    adapt.write_pointer(ledger / "p" / adapt.POINTER, folder, {"config_digest": "x", "checkpoints": {},
                                                             "base_model": {"key": {}, "model": "m"}})
    params = ChainParameters(profile="p", ledger_root=str(ledger))
    digest = lambda: paper.inputs_digest("05_experiment5_replication.ipynb", params)  # noqa: E731
    d1 = digest()
    table.write_bytes(b"b")  # the role table changed outside the ledgers: notebook 05 must rerun
    d2 = digest()
    table.unlink()
    assert len({d1, d2, digest()}) == 3


def test_a_malformed_notebooks_key_is_refused(tmp_path, monkeypatch, capsys):
    from kvreplay import paper
    from kvreplay.notebook import profiles

    params = tmp_path / "params"
    params.mkdir()
    monkeypatch.setattr(profiles, "PARAMS", params)
    monkeypatch.setattr(paper, "BUILD", tmp_path / "build")
    for bad in ('"01"', "1", "[]"):
        (params / "mini.yaml").write_text(f"profile: mini\nbase: defaults\nnotebooks: {bad}\n")
        assert paper.main(["--profile", "mini"]) == 2
        assert "`notebooks` must be a non-empty list" in capsys.readouterr().err


def test_executed_copies_do_not_depend_on_the_run_or_the_checkout(tmp_path):
    import nbformat
    from kvreplay.paper import clean_executed
    from kvreplay.paths import ROOT

    nb = nbformat.v4.new_notebook()
    nb.metadata["papermill"] = {"start_time": "2026-11-30T00:00:00"}
    cell = nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["injected-parameters"], "execution": {"iopub.status.busy": "2026-11-30T00:00:00"}})
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"{ROOT}/data/ledgers/cpu/exp4_panel.json\n"),
                    nbformat.v4.new_output("stream", name="stdout", text="second print\n"),  # flushed apart: merged
                    nbformat.v4.new_output("execute_result", data={"text/plain": f"'{ROOT}/figures/cpu'"}, execution_count=1)]
    nb.cells = [cell]
    src = tmp_path / "run.ipynb"
    nbformat.write(nb, str(src))
    out = nbformat.read(str(clean_executed(src, tmp_path / "clean.ipynb")), as_version=4)
    c = out.cells[0]
    assert c["id"] == "injected-parameters" and "execution" not in c.metadata and "papermill" not in out.metadata
    assert c.outputs[0]["text"] == "data/ledgers/cpu/exp4_panel.json\nsecond print\n" and len(c.outputs) == 2
    assert c.outputs[1]["data"]["text/plain"] == "'figures/cpu'"


def test_the_index_names_notebooks_outside_the_profile_list_apart(tmp_path):
    from kvreplay.paper import CHAIN, write_index

    (tmp_path / CHAIN[1]).write_text("{}")
    write_index([], "paper", tmp_path, None, ["01", "02"])
    text = (tmp_path / "README.md").read_text()
    assert f"Not executed into this folder yet: {CHAIN[2]} (" in text  # 02: listed, not there
    assert "so not executed: " + CHAIN[0] in text and CHAIN[1] + "," not in text
    write_index([], "cpu", tmp_path, None)
    assert "so not executed" not in (tmp_path / "README.md").read_text()


def _refused_profile(tmp_path, monkeypatch, text: str) -> None:
    """Write profile `mini` with ``text`` into a scratch params folder; `make paper` must refuse it (exit 2) before any
    notebook runs."""
    from kvreplay import paper
    from kvreplay.notebook import profiles

    params = tmp_path / "params"
    params.mkdir()
    monkeypatch.setattr(profiles, "PARAMS", params)
    monkeypatch.setattr(paper, "BUILD", tmp_path / "build")
    monkeypatch.setattr(paper, "run_notebook", lambda *a, **k: pytest.fail("a notebook ran"))
    (params / "mini.yaml").write_text(text)
    assert paper.main(["--profile", "mini"]) == 2


def test_execution_keys_outside_the_execution_mapping_are_refused(tmp_path, monkeypatch, capsys):
    """`threads: 4` at a profile's top level is no chain parameter (the arms would run under the defaults and key new
    ledgers if it were dropped): refused, naming the keys, before any notebook runs."""
    _refused_profile(tmp_path, monkeypatch, "profile: mini\nthreads: 4\nstep_path: graph\nexecution:\n  device: cuda\n")
    assert "threads, step_path belong to the execution contract: put them under `execution:`" in capsys.readouterr().err


def test_the_inprocess_engine_injects_profile_and_overrides(tmp_path):
    """Every notebook declares `profile` and `overrides`; `make paper --engine inprocess` puts the profile's name and
    the overrides below the parameters cell, as papermill injects them, and the setup call resolves them."""
    import ast
    import json

    from kvreplay.paper import run_inprocess

    nb = {"cells": [{"cell_type": "code", "metadata": {"tags": ["parameters"]}, "source": "profile = 'smoke'\noverrides = {}\n",
                     "outputs": [], "execution_count": None},
                    {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
                     "source": "from kvreplay.notebook.profiles import load_parameters\n"
                               "open('seen', 'w').write(repr(load_parameters(profile, overrides).execution))\n"}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(nb))
    run_inprocess(path, {"profile": "gpu", "overrides": {"execution": {"threads": 3}}, "interactive": False})
    assert ast.literal_eval((tmp_path / "seen").read_text()) == {"threads": 3}


def test_a_profile_key_that_is_no_parameter_is_refused(tmp_path, monkeypatch, capsys):
    """A typo (`executon:`, `n_row:`) would be dropped and the run would go ahead on defaults: refused with the closest
    parameter name before any notebook runs."""
    from kvreplay import paper

    _refused_profile(tmp_path, monkeypatch, "profile: mini\nn_rows: 2\nexecuton:\n  device: cuda\nnotebooks: ['01']\n")
    assert "'executon' (did you mean 'execution'?) is not a chain parameter" in capsys.readouterr().err
    monkeypatch.undo()
    for name in ("cpu", "gpu", "paper", "smoke"):  # every committed profile passes
        assert paper.load_parameters(name).profile == name


def test_a_profile_computed_on_a_gpu_refuses_notebooks_whose_arms_are_unfinished(monkeypatch, capsys, tmp_path):
    """`paper` lists `done:`: make paper reads its complete ledgers but refuses, before any notebook runs, a notebook
    whose arms the committed ledgers do not hold in full (it would compute them on this machine). Its own
    `notebooks:` list needs only complete arms; with the exploratory controls turned on (not run at its caps),
    notebooks 02 and 06 need an arm it does not have."""
    import kvreplay.paper as paper
    from kvreplay.paths import LEDGERS
    from kvreplay.notebook.profiles import load_parameters, profile_path

    ran = []
    monkeypatch.setattr(paper, "run_notebook", lambda *a, **k: ran.append(a[0]))
    params = load_parameters("paper")
    chain = [n for n in paper.CHAIN if n[:2] in paper.read_profile("paper")["notebooks"]]
    assert len(chain) == len(paper.CHAIN) - 1 and not params.exploratory_controls  # all but 00 (the checkpoints are cpu's)
    assert paper.unfinished_arms(chain, params, LEDGERS / "paper") == []  # the profile's own `notebooks:` list
    text = profile_path("paper").read_text()
    assert text.count("exploratory_controls: false") == 1
    (tmp_path / "with_controls").mkdir()
    with_controls = tmp_path / "with_controls" / "paper.yaml"  # a profile file is named as its `profile:`
    with_controls.write_text(text.replace("exploratory_controls: false", "exploratory_controls: true"))
    assert main(["--profile", str(with_controls), "--only", "03", "02", "--no-html", "--no-executed"]) == 2
    err = capsys.readouterr().err
    assert "02_" in err and "exp2_controls-bfloat16 (not started)" in err and "03_" not in err and ran == []
    params = load_parameters(str(with_controls))
    assert paper.notebook_arms("02_x.ipynb", params) == ["exp1-bfloat16", "exp2-bfloat16", "exp2-float32", "exp2_controls-bfloat16"]
    assert paper.unfinished_arms(["06_x.ipynb"], params, LEDGERS / "paper") == ["06_x.ipynb: exp2_controls-bfloat16 (not started)"]
    # notebook 00 would train a second checkpoint family here and repoint the profile's Experiment 5 at it
    assert main(["--profile", "paper", "--only", "00", "--no-html", "--no-executed"]) == 2
    err = capsys.readouterr().err
    assert "00_role_adaptation.ipynb: trains a checkpoint family" in err and "role_adaptation.json" in err and ran == []


def test_a_profile_computed_on_a_gpu_runs_its_notebooks_read_only(monkeypatch, tmp_path):
    """For a profile whose file lists `done:` the notebooks' kernels get KV_LEDGERS_READ_ONLY=1 (run_arm then
    refuses to compute a row whose key no ledger holds, e.g. after an edit that changes a key); for another
    profile they do not; either way `main` restores the variable when it returns."""
    import os

    import kvreplay.paper as paper
    from kvreplay.runner import READ_ONLY_ENV

    seen = []
    monkeypatch.setattr(paper, "BUILD", tmp_path / "build")
    monkeypatch.setattr(paper, "run_notebook", lambda name, *a, **k: seen.append((name, os.environ.get(READ_ONLY_ENV))))
    monkeypatch.delenv(READ_ONLY_ENV, raising=False)
    assert paper.main(["--profile", "paper", "--only", "06", "--force", "--no-html", "--no-executed"]) == 0
    assert seen == [("06_tables.ipynb", "1")] and READ_ONLY_ENV not in os.environ
    assert paper.main(["--profile", "smoke", "--only", "01", "--force", "--no-html", "--no-executed"]) == 0
    assert seen[1] == ("01_experiment1_live_vs_prefill.ipynb", None) and READ_ONLY_ENV not in os.environ


def test_a_read_only_session_keeps_its_frozen_panels(monkeypatch, tmp_path):
    """Under KV_LEDGERS_READ_ONLY=1 a notebook may write a panel only as it already is: a changed or new panel
    (parameters that choose other problems) is refused before it is written."""
    import pytest
    from kvreplay.runner import READ_ONLY_ENV, ReadOnlyLedgerError
    from kvreplay.notebook.session import open_session

    session = open_session("notebooks/04_experiment4_cache_transplant.ipynb", "smoke", {"ledger_root": str(tmp_path)})
    path = session.write_panel("exp4_panel", rule="r", panel=[1, 2])
    monkeypatch.setenv(READ_ONLY_ENV, "1")
    assert session.write_panel("exp4_panel", rule="r", panel=[1, 2]) == path  # the same bytes: allowed
    with pytest.raises(ReadOnlyLedgerError, match="this frozen panel would be changed"):
        session.write_panel("exp4_panel", rule="r", panel=[1, 3])
    with pytest.raises(ReadOnlyLedgerError, match="this frozen panel would be created"):
        session.write_panel("exp5_panel", rule="r", panel=[1])
    assert path.read_text().count("3") == 0 and not (path.parent / "exp5_panel.json").exists()


def test_ctrl_c_ends_the_run_with_one_line(tmp_path, monkeypatch, capsys):
    """A KeyboardInterrupt while a notebook runs: exit 130 and one line naming the notebook, where its finished rows
    are, and that the same command resumes (the kernel is shut down by papermill; a ledger is append-only)."""
    from kvreplay import paper

    def interrupted(name, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(paper, "BUILD", tmp_path / "build")
    monkeypatch.setattr(paper, "run_notebook", interrupted)
    assert paper.main(["--profile", "smoke", "--only", "01", "--force", "--no-executed",
                       "--ledger-root", str(tmp_path / "l")]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"interrupted (Ctrl-C) in 01_experiment1_live_vs_prefill.ipynb: the rows it finished are kept in "
                   f"{tmp_path / 'l' / 'smoke'}; run the same command again to resume"]
    assert paper.KERNEL_ARGUMENTS == ["--IPKernelApp.log_level=CRITICAL", "--IPKernelApp.capture_fd_output=False"]


def test_make_paper_prints_the_resolved_values_first(tmp_path, monkeypatch, capsys):
    from kvreplay import paper

    monkeypatch.setattr(paper, "BUILD", tmp_path / "build")
    monkeypatch.setattr(paper, "run_notebook", lambda *a, **k: None)
    assert paper.main(["--profile", "gpu", "--only", "06", "--force", "--no-executed", "--no-html"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("== profile gpu (notebooks/params/gpu.yaml, sha256 ") and "the rest from base cpu" in first


def test_progress_bars_are_dropped_from_executed_copies_and_warnings_kept(tmp_path):
    import nbformat
    from kvreplay.paper import clean_executed

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("run()")
    widget = {"application/vnd.jupyter.widget-view+json": {"model_id": "x", "version_major": 2, "version_minor": 0},
              "text/plain": "answer-letter accuracy:   0%|          | 0/4 [00:00<?, ?row/s]"}
    cell.outputs = [nbformat.v4.new_output("display_data", data=widget),
                    nbformat.v4.new_output("stream", name="stderr",
                                           text="\n\r   exp1 bfloat16:   0%|          | 0/2 [00:00<?, ?row/s]\x1b[A"),
                    nbformat.v4.new_output("stream", name="stdout", text="2 rows computed\n"),
                    nbformat.v4.new_output("stream", name="stderr", text="UserWarning: 50% of the rows\n")]
    nb.cells = [cell]
    nbformat.write(nb, str(tmp_path / "run.ipynb"))
    out = nbformat.read(str(clean_executed(tmp_path / "run.ipynb", tmp_path / "clean.ipynb")), as_version=4)
    assert [(o["output_type"], o.get("name")) for o in out.cells[0].outputs] == [("stream", "stdout"), ("stream", "stderr")]
    assert out.cells[0].outputs[1]["text"] == "UserWarning: 50% of the rows\n"


def test_the_index_opens_with_the_headline_from_the_data_and_links_every_file(tmp_path):
    """index.html and README.md: the headline endpoints read from table_vs_paper.csv, a link to notebook 08, each
    executed notebook and each table or figure file linked relative to the page."""
    from kvreplay.paper import CHAIN, artifact_index, headline, write_index
    from kvreplay.paths import EXECUTED, FIGURES

    entries = artifact_index(EXECUTED / "cpu", CHAIN)
    html_dir = tmp_path / "build" / "cpu"
    html_dir.mkdir(parents=True)
    (html_dir / "08_drift_explorer.html").write_text("<html></html>")
    md, html = write_index(entries, "cpu", tmp_path / "executed", html_dir, figures=FIGURES / "cpu")
    top = headline(FIGURES / "cpu")
    assert top[0].startswith("- BF16 suffix differs: **5/16 (31.2%") and "(paper: 166/200" in top[0]
    assert any("frozen interpretation" in x for x in top) and top[-1].startswith("- What differs from the paper's setup")
    page = html.read_text()
    assert page.index("5/16 (31.2%") < page.index("<table>")
    assert '<a href="08_drift_explorer.html">08_drift_explorer.html</a>' in page  # a link reads what it opens
    assert ".ipynb</a>" not in page
    import os

    rel = os.path.relpath(FIGURES / "cpu", html_dir)
    assert f'<a href="{rel}/table_exp4_localization.csv">.csv</a>' in page
    assert 'href="/' not in page and "file:" not in page and str(tmp_path) not in page  # relative links only
    assert "- BF16 suffix differs: **5/16" in md.read_text().split("| artifact |")[0]
    assert headline(tmp_path / "none") == ["- No headline yet: notebook 06 writes `table_vs_paper.csv` (this run "
                                           "against the paper)."]


def test_the_index_reads_what_the_writers_recorded_not_the_printed_lines(tmp_path, monkeypatch, capsys):
    """save_table records each table as data (kind, stem, files, the sha256 of its cell's source) where the
    environment says; the index finds the cell from the record. A ``[saved ...]`` line printed without a record
    is not read, and a record of a cell the notebook lacks is refused, naming the file and line."""
    import hashlib
    import json

    import nbformat
    import pandas as pd

    from kvreplay.paper import artifact_index, artifact_log
    from kvreplay.report.files import ARTIFACT_LOG, save_table

    name = "01_experiment1_live_vs_prefill.ipynb"
    monkeypatch.setenv(ARTIFACT_LOG, str(artifact_log(tmp_path, name)))
    save_table(pd.DataFrame({"a": [1]}), tmp_path / "figs" / "table_demo", caption="Demo", source=name)
    assert "[saved table table_demo: .csv .md .tex]" in capsys.readouterr().out  # the reader's line stays
    (rec,) = [json.loads(line) for line in artifact_log(tmp_path, name).read_text().splitlines()]
    assert rec == {"kind": "table", "stem": "table_demo", "files": ".csv .md .tex", "cell_sha256": None}  # no kernel
    saving = "session.save_table(df, 'table_demo')"
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# Experiment 1\n\n## The table"), nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_code_cell("print('[saved figure not_recorded: .png .pdf]')", outputs=[
            nbformat.v4.new_output("stream", name="stdout", text="[saved figure not_recorded: .png .pdf]\n")]),
        nbformat.v4.new_code_cell(saving)])
    nbformat.write(nb, str(tmp_path / name))
    rec["cell_sha256"] = hashlib.sha256(saving.encode()).hexdigest()  # as a kernel records it
    artifact_log(tmp_path, name).write_text(json.dumps(rec) + "\n")
    assert artifact_index(tmp_path, [name, "02_experiment2_fixed_prefix_precision.ipynb"]) == [
        {"kind": "table", "stem": "table_demo", "files": ".csv .md .tex", "notebook": name, "cell": 3,
         "cell_id": nb.cells[3].id, "heading": "Experiment 1"}]
    artifact_log(tmp_path, name).write_text(json.dumps(rec) + "\n" + json.dumps(rec | {"cell_sha256": "0" * 64}) + "\n")
    with pytest.raises(ValueError, match=r"artifacts\.jsonl:2: not a record of a cell of 01_experiment1"):
        artifact_index(tmp_path, [name])


def test_a_kernel_records_the_cell_that_saved_each_table(tmp_path, monkeypatch):
    """In a real kernel (papermill), the record names the running cell by the sha256 of its source."""
    import nbformat
    import papermill as pm

    from kvreplay.paper import artifact_index, artifact_log
    from kvreplay.report.files import ARTIFACT_LOG

    name = "06_tables.ipynb"
    cells = ["import pandas as pd\nfrom kvreplay.report.files import save_table",
             f"save_table(pd.DataFrame({{'a': [1]}}), {str(tmp_path / 'figs' / 'table_k')!r}, caption='K', source='06')"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Tables"), *map(nbformat.v4.new_code_cell, cells)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(tmp_path / "source.ipynb"))
    monkeypatch.setenv(ARTIFACT_LOG, str(artifact_log(tmp_path, name)))  # the kernel inherits it
    pm.execute_notebook(str(tmp_path / "source.ipynb"), str(tmp_path / name), kernel_name="python3", progress_bar=False)
    (entry,) = artifact_index(tmp_path, [name])
    assert (entry["stem"], entry["cell"], entry["heading"]) == ("table_k", 2, "Tables")
