"""``make paper``: run every notebook headlessly with papermill, in dependency order.

Usage: ``python -m kvreplay.paper --profile cpu [--only 01]``.

Each notebook runs with its two parameters injected: ``profile`` (the name of
``notebooks/params/<profile>.yaml``) and ``overrides`` (``--ledger-root`` and
``--figures-root``, when given); the notebook resolves them into the chain's
parameters (:func:`kvreplay.profiles.load_parameters`), which are checked here
first, so a bad profile stops before any notebook runs. The executed copy and an HTML rendering go to
``build/<profile>/``; ledgers, tables and figures are written by the
notebooks themselves (``data/ledgers/<profile>/``, ``figures/<profile>/``).
A notebook that fails stops the chain: its partial copy is moved to
``build/<profile>/failed/`` (never left in place of a good one) and the
failing cell is named. A notebook whose inputs (source, parameters, library
source, the profile's ledgers) are unchanged since its last successful run is
skipped (the parameters enter as resolved, so editing a profile's value reruns
what reads it); ``--force`` runs it anyway.

For the profiles whose ledgers are committed (:data:`EXECUTED_PROFILES`: ``cpu``, ``gpu``, ``paper``)
the executed notebooks are also written, without volatile metadata, to
``executed/<profile>/`` (committed: a reviewer reads them without running
anything), with ``executed/<profile>/README.md``, an index linking each table
and figure to the notebook cell that makes it; ``build/<profile>/index.html`` is
the same index for the HTML renderings, which show outputs with the code hidden.
``--executed`` writes them for any profile, ``--no-executed`` for none.

After a run of the profile's notebooks (not ``--only``), :func:`write_results` rewrites its results page from
the ledgers: ``docs/results-<profile>.md`` for the committed profiles (and the README's headline block for
``paper``), ``build/<profile>/results.md`` for any other.

While a notebook runs, one progress bar counts its cells; rows that are
computed (not read from a finished ledger) get a row bar with counts below it.

``--engine inprocess`` runs the notebooks' code cells in this Python process
instead of a Jupyter kernel, for machines that have the scientific stack but
no Jupyter (the lent GPU machine): ledgers, tables and figures are written as
usual, but no executed notebook, HTML or up-to-date stamp, so a later
papermill run executes every notebook (reusing the finished ledgers).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
import time
from pathlib import Path

import yaml

from .adapt import read_pointer
from .ledger.lookup import ledger_progress
from .ledger.store import TERMINAL_PROGRESS, canonical_json, library_digest
from .paths import BUILD, EXECUTED, FIGURES, LEDGERS, NOTEBOOKS, ROOT
from .profiles import ChainParameters, describe, load_parameters, profile_path, read_profile
from .report.paper_tables import NOT_RUN
from .runner import READ_ONLY_ENV

EXECUTED_PROFILES = ("cpu", "gpu", "paper")
"""Profiles whose executed notebooks ``make paper`` writes to :data:`EXECUTED` (those with committed ledgers)."""

RUN_PARAMETERS = {"interactive": False}
"""Parameters every headless run passes (to the notebooks that declare them): no widgets in executed copies."""

CHAIN = [
    "00_role_adaptation.ipynb",
    "01_experiment1_live_vs_prefill.ipynb",
    "02_experiment2_fixed_prefix_precision.ipynb",
    "03_experiment3_bridge_and_audit.ipynb",
    "04_experiment4_cache_transplant.ipynb",
    "05_experiment5_replication.ipynb",
    "06_tables.ipynb",
    "07_figures.ipynb",
    "08_drift_explorer.ipynb",
]
"""Notebooks in dependency order (the checkpoint family, experiments, then tables, then figures)."""


def notebook_arms(name: str, params: ChainParameters) -> list[str]:
    """The ledger arms (``<experiment>-<dtype>``) notebook ``name`` reads or, where they are unfinished, computes.

    Experiments 1 and 2 run at every precision of ``params``; 3-5 and the controls in BF16 only; 02 reads
    Experiment 1's BF16 prefix bank, 03 the Experiment 1 and 2 BF16 ledgers (its audit), 04 and 05 the
    Experiment 2 BF16 ledger (the panel, the accuracy comparison); 06 and 07 read all of them, 08 Experiments
    1 and 2. Notebook 00 (the checkpoint family) is not a ledger arm: ``[]``.
    """
    exp1 = [f"exp1-{d}" for d in params.precisions]
    exp2 = [f"exp2-{d}" for d in params.precisions]
    controls = ["exp2_controls-bfloat16"] if params.exploratory_controls else []
    own = {"01": exp1, "02": ["exp1-bfloat16", *exp2, *controls], "03": ["exp1-bfloat16", "exp2-bfloat16", "exp3-bfloat16"],
           "04": ["exp2-bfloat16", "exp4-bfloat16"], "05": ["exp2-bfloat16", "exp5-bfloat16"],
           "08": [*exp1, *exp2]}
    every = [*exp1, *exp2, *controls, "exp3-bfloat16", "exp4-bfloat16", "exp5-bfloat16"]
    arms = own.get(name[:2], every if name[:2] in ("06", "07") else [])
    return list(dict.fromkeys(arms))


def unfinished_arms(chain: list[str], params: ChainParameters, ledgers: Path) -> list[str]:
    """For a profile computed elsewhere (one whose file lists ``done:``), every arm the notebooks of ``chain`` need
    that its ledgers under ``ledgers`` do not hold in full, as ``"<notebook>: <arm> (k of n rows)"`` or
    ``"... (not started)"``. Run on such a profile, ``make paper`` would compute those rows on this machine
    (hours on a CPU for the ``paper`` caps), so :func:`main` refuses before any notebook runs. Notebook 00 is
    always listed: such a profile reads the checkpoint family its ``role_adaptation.json`` names (the ``cpu``
    profile's), and 00 would train another one here and point the profile's Experiment 5 at it."""
    out = []
    for name in chain:
        if name.startswith("00"):
            out.append(f"{name}: trains a checkpoint family; this profile reads the one its "
                       f"{ledgers / 'role_adaptation.json'} names (train it under the `cpu` profile)")
            continue
        for arm in notebook_arms(name, params):
            folders = sorted(ledgers.glob(f"{arm}-*/manifest.json"))
            progress = [ledger_progress(f.parent) for f in folders]
            if not any(done == wanted for done, wanted in progress):
                held = ", ".join(f"{done} of {wanted} rows" for done, wanted in progress) or "not started"
                out.append(f"{name}: {arm} ({held})")
    return out


def declared_parameters(name: str, params: dict) -> dict:
    """The subset of ``params`` that the notebook's ``parameters`` cell declares (no unknown-parameter noise): every
    notebook declares ``profile`` and ``overrides``; :data:`RUN_PARAMETERS` go only to the notebooks that declare them."""
    import papermill as pm

    declared = pm.inspect_notebook(str(NOTEBOOKS / name))
    return {k: v for k, v in params.items() if k in declared}


KERNEL_ARGUMENTS = ["--IPKernelApp.log_level=CRITICAL", "--IPKernelApp.capture_fd_output=False"]
"""How ``make paper`` starts a kernel: it logs only critical errors (a kernel shut down by Ctrl-C logs no ZMQ
traceback), and what is written to its file descriptors rather than through ``sys.stdout`` (the row bars drawn
on the terminal, :data:`~kvreplay.ledger.store.TERMINAL_PROGRESS`) goes to the terminal, not into the notebook."""


def run_notebook(name: str, params: dict, out_dir: Path, html: bool = True, progress: bool = True) -> Path:
    """Execute one notebook with papermill into ``out_dir`` (atomically) and render HTML.

    The executed copy is written to a hidden partial file and moved into
    place only when every cell ran, cleaned as :func:`clean_executed` cleans
    the committed copies (paths relative to the repository); on any failure
    (a failing cell, a dead kernel, Ctrl-C) the partial copy goes to
    ``out_dir/failed/`` and any earlier good copy and its HTML are removed,
    so nothing stale stays in place. The kernel logs only critical errors
    (a kernel shut down under Ctrl-C logs no ZMQ traceback).

    Raises:
        RuntimeError: naming the notebook and, for a failing cell, the cell.
    """
    import papermill as pm

    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / name
    tmp = out_dir / f".{Path(name).stem}.partial.ipynb"
    try:
        pm.execute_notebook(
            str(NOTEBOOKS / name), str(tmp), parameters=declared_parameters(name, params), cwd=str(NOTEBOOKS),
            kernel_name="python3", report_mode=False, extra_arguments=KERNEL_ARGUMENTS,
            progress_bar={"desc": f"{Path(name).stem[:24]:<24}", "leave": True} if progress else False,
        )
    except BaseException as e:
        failed = out_dir / "failed"
        failed.mkdir(exist_ok=True)
        if tmp.exists():
            os.replace(tmp, failed / name)
        out.unlink(missing_ok=True)
        out.with_suffix(".html").unlink(missing_ok=True)
        if isinstance(e, pm.PapermillExecutionError):
            where = f"cell {e.exec_count} ({e.ename}: {e.evalue})"
        elif isinstance(e, KeyboardInterrupt):
            raise
        else:
            where = f"{type(e).__name__}: {e}"
        raise RuntimeError(f"{name} failed in {where}; executed copy kept at {failed / name}") from None
    clean_executed(tmp, tmp)  # no absolute path of this checkout, run dates or timings in the build copy either
    os.replace(tmp, out)
    html_path = out.with_suffix(".html")
    if html:
        html_path.write_text(render_html(out), encoding="utf-8")
    else:
        html_path.unlink(missing_ok=True)
    return out


READING_CSS = """
.jp-OutputArea-output { overflow-x: auto; }
.jp-RenderedHTMLCommon table { table-layout: auto; max-width: none; }
.jp-RenderedHTMLCommon td, .jp-RenderedHTMLCommon th { white-space: normal; overflow-wrap: anywhere;
  max-width: 36em; vertical-align: top; }
.jp-RenderedHTMLCommon thead th { position: sticky; top: 0; background: var(--jp-layout-color0, #fff); }
"""
"""Style added to every HTML rendering: a table's cells wrap (at most 36em wide) and a table wider than the page
scrolls inside its output, with its header row kept in view."""


def render_html(path: Path) -> str:
    """HTML of an executed notebook for reading: markdown and outputs, code cells' input hidden, tables wrapped or
    scrolled within the page (:data:`READING_CSS`)."""
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(exclude_input=True, exclude_input_prompt=True, exclude_output_prompt=True)
    body, _ = exporter.from_filename(str(path))
    return body.replace("</head>", f"<style>{READING_CSS}</style>\n</head>", 1)


VOLATILE_METADATA = ("papermill", "execution")
"""Notebook and cell metadata keys that change on every run (timings, dates); dropped from committed copies."""

PROGRESS_BAR = re.compile(r"^[^\n]*\d+%\|[^\n]*\|[^\n]*\[[^\]\n]*\]\s*(\x1b\[A)?$")
"""One tqdm bar as text: ``desc:  50%|█████     | 1/2 [00:01<00:01, 1.0row/s]``."""


def is_progress_output(out: dict) -> bool:
    """Whether a notebook output is only a progress bar: a tqdm widget (its text fallback a bar) or a stderr stream
    whose every line (after the carriage returns that redraw it) is a bar. Such an output shows a run's state at one
    moment (``0%`` in a finished copy), so :func:`clean_executed` drops it; other stderr (a warning) stays."""
    data = out.get("data", {})
    if out.get("output_type") == "display_data" and "application/vnd.jupyter.widget-view+json" in data:
        text = data.get("text/plain", "")
        text = "".join(text) if isinstance(text, list) else text
        return bool(PROGRESS_BAR.match(text.strip()))
    if out.get("output_type") == "stream" and out.get("name") == "stderr":
        text = "".join(out["text"]) if isinstance(out["text"], list) else out["text"]
        shown = [line.rsplit("\r", 1)[-1].strip() for line in text.replace("\r\n", "\n").split("\n")]
        shown = [line for line in shown if line]
        return bool(shown) and all(PROGRESS_BAR.match(line) for line in shown)
    return False


def clean_executed(src: Path, dest: Path) -> Path:
    """Copy an executed notebook to ``dest`` without what changes from run to run or checkout to checkout.

    Dropped: volatile metadata (run dates and durations), progress-bar outputs (:func:`is_progress_output`), and
    the plain-text copy of an output that has an HTML one (a table is read as HTML, in JupyterLab, on GitHub and
    in ``make paper``'s HTML; its text copy doubled the bytes the repository's size budget counts). Made fixed: the
    id of
    the cell papermill injects (a fresh random id on every run), and this
    checkout's absolute path in text outputs (written relative to the
    repository root), and consecutive stream outputs merged into one (how a
    kernel's prints are split into messages depends on flush timing), so
    re-executing on unchanged ledgers, anywhere, rewrites the same file.

    Returns:
        ``dest``.
    """
    import nbformat
    from nbconvert.preprocessors import CoalesceStreamsPreprocessor

    prefix = f"{ROOT}/"
    nb = nbformat.read(str(src), as_version=4)
    nb, _ = CoalesceStreamsPreprocessor().preprocess(nb, {})
    for key in VOLATILE_METADATA:
        nb.metadata.pop(key, None)
    for c in nb.cells:
        for key in VOLATILE_METADATA:
            c.metadata.pop(key, None)
        if "injected-parameters" in c.metadata.get("tags", []):
            c["id"] = "injected-parameters"
        if "outputs" in c:
            c["outputs"] = [out for out in c["outputs"] if not is_progress_output(out)]
        for out in c.get("outputs", []):
            if "text/html" in out.get("data", {}):
                out["data"].pop("text/plain", None)
            if "text" in out:
                out["text"] = out["text"].replace(prefix, "")
            for mime in ("text/plain", "text/markdown", "text/html"):
                if mime in out.get("data", {}):
                    out["data"][mime] = out["data"][mime].replace(prefix, "")
    dest.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(dest))
    return dest


SAVED_MARK = re.compile(r"^\[saved (table|figure) ([\w.-]+): ([^\]]*)\]", re.M)
"""The line :func:`kvreplay.report.files.save_table` / ``save_figure`` print in a notebook for each file set they write."""


def artifact_index(folder: Path, chain: list[str]) -> list[dict]:
    """Where each table and figure is made: scan executed notebooks' outputs for the ``[saved ...]`` lines.

    Returns:
        one dict per artifact: ``kind`` (table/figure), ``stem``, ``files`` (suffixes), ``notebook``,
        ``cell`` (1-based code-cell number), ``cell_id`` (the nbformat cell id), ``heading`` (the nearest
        markdown heading above the cell).
    """
    import nbformat

    out = []
    for name in chain:
        path = folder / name
        if not path.is_file():
            continue
        try:
            nb = nbformat.read(str(path), as_version=4)
        except Exception:  # not a notebook (e.g. a placeholder): nothing to index
            continue
        heading, n_code = "", 0
        for c in nb.cells:
            if c.cell_type == "markdown":
                for line in c.source.splitlines():
                    if line.startswith("#"):
                        heading = line.lstrip("#").strip()
                        break
                continue
            if c.cell_type != "code":
                continue
            n_code += 1
            text = "".join(o.get("text", "") for o in c.get("outputs", []) if o.get("output_type") == "stream")
            for kind, stem, files in SAVED_MARK.findall(text):
                out.append({"kind": kind, "stem": stem, "files": files, "notebook": name, "cell": n_code,
                            "cell_id": c.get("id"), "heading": heading})
    return out


HEADLINE = ("exp1.bf16.suffix", "exp2.fp32.suffix", "exp4.joint_recovery", "exp5.interpretation")
"""The endpoints (ids of ``table_vs_paper``) an index opens with: BF16 and FP32 divergence, donor recovery, the verdict."""

EXPLORER = "08_drift_explorer.ipynb"


def headline(figures: Path) -> list[str]:
    """The index's first lines: :data:`HEADLINE`'s endpoints, this run against the paper, read from
    ``<figures>/table_vs_paper.csv`` (notebook 06); one line saying it is missing when it is.

    Returns:
        Markdown lines (``- endpoint: this run (paper: ...)``).
    """
    import csv

    table = figures / "table_vs_paper.csv"
    if not table.is_file():
        return [f"- No headline yet: notebook 06 writes `{table.name}` (this run against the paper)."]
    with table.open(encoding="utf-8", newline="") as f:
        rows = {r["id"]: r for r in csv.DictReader(f)}
    out = [f"- {rows[i]['endpoint']}: **{rows[i]['this run']}** (paper: {rows[i]['paper']})"
           for i in HEADLINE if i in rows and rows[i]["this run"] != NOT_RUN]
    if "exp1.bf16.suffix" in rows:
        out.append(f"- What differs from the paper's setup: {rows['exp1.bf16.suffix']['what differs']}.")
    return out


def _relative(target: Path, start: Path) -> str:
    """``target`` as a link from a page in ``start`` (POSIX separators)."""
    return Path(os.path.relpath(Path(target).resolve(), Path(start).resolve())).as_posix()


def write_index(entries: list[dict], profile: str, folder: Path, html_folder: Path | None,
                listed: list[str] | None = None, figures: Path | None = None) -> list[Path]:
    """Write the one-page index of tables and figures: ``<folder>/README.md`` and ``<html_folder>/index.html``.

    Both open with the headline (:func:`headline`, read from ``figures``) and a link to the drift explorer
    (notebook 08); every notebook and file is a link, relative to the page. ``listed``: the notebook name prefixes
    the profile's ``notebooks`` list names (``None``: all of them); a notebook not executed yet is said to be
    missing, or to be outside that list. ``figures``: the profile's tables and figures (default
    ``figures/<profile>``).

    Returns:
        the paths written.
    """
    import html as H

    figures = Path(figures) if figures is not None else FIGURES / profile
    top = headline(figures)
    explorer_md = (f"Per-tensor drift of one row, per layer, KV head and token position: [{EXPLORER}]({EXPLORER}) "
                   "(the drift explorer; interactive with `make lab`).")
    rel_fig = _relative(figures, folder)
    lines = [f"# Executed notebooks, profile `{profile}`", "",
             f"Headline (from `{_relative(figures / 'table_vs_paper.csv', folder)}`):", "", *top, "", explorer_md, "",
             "Each notebook here was executed headlessly by `make paper` (`python -m kvreplay.paper --profile "
             f"{profile}`) from the clean sources in `notebooks/`; every table and figure is inline. They are "
             "re-executed whenever the ledgers are recomputed. Below: every table and figure, the notebook cell that "
             "makes it (code cells counted from 1, the injected-parameters cell included) and its files.", "",
             "| artifact | kind | made by | files |", "|---|---|---|---|"]
    for e in entries:
        files = ", ".join(f"[{x}]({rel_fig}/{e['stem']}{x})" for x in e["files"].split())
        lines.append(f"| `{e['stem']}` | {e['kind']} | [{e['notebook']}]({e['notebook']}), code cell {e['cell']} "
                     f"({e['heading']}) | {files} |")
    missing = [n for n in CHAIN if not (folder / n).is_file()]
    in_list = [n for n in missing if listed is None or any(n.startswith(p) for p in listed)]
    if in_list:
        lines += ["", f"Not executed into this folder yet: {', '.join(in_list)} (`make paper PROFILE={profile}` writes them)."]
    if len(in_list) < len(missing):
        lines += ["", f"Not in the profile's `notebooks` list (`notebooks/params/{profile}.yaml`), so not executed: "
                  f"{', '.join(n for n in missing if n not in in_list)}."]
    written = []
    folder.mkdir(parents=True, exist_ok=True)
    md = folder / "README.md"
    md.write_text("\n".join(lines) + "\n", encoding="utf-8")
    written.append(md)
    if html_folder is not None:
        def inline(text: str) -> str:
            """The Markdown of a headline line as HTML: escaped, **bold** and `code` kept."""
            text = H.escape(text)
            text = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", text)
            return re.sub(r"`(.+?)`", r"<code>\1</code>", text)

        fig_href = _relative(figures, html_folder)
        rows = "".join(
            f"<tr><td><code>{H.escape(e['stem'])}</code></td><td>{e['kind']}</td>"
            f"<td><a href=\"{Path(e['notebook']).stem}.html#cell-id={e['cell_id']}\">{H.escape(e['notebook'])}, code cell {e['cell']}</a>"
            f" ({H.escape(e['heading'])})</td><td>"
            + ", ".join(f"<a href=\"{H.escape(fig_href)}/{H.escape(e['stem'] + x)}\">{H.escape(x)}</a>" for x in e["files"].split())
            + "</td></tr>" for e in entries)
        notebooks = "".join(f"<li><a href=\"{Path(n).stem}.html\">{H.escape(n)}</a></li>" for n in CHAIN
                            if (html_folder / f"{Path(n).stem}.html").is_file())
        explorer = Path(EXPLORER).stem + ".html"
        page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvreplay, profile {profile}</title>"
                "<style>body{font-family:sans-serif;max-width:70em;margin:2em auto}td,th{padding:2px 8px;text-align:left;"
                "vertical-align:top;overflow-wrap:anywhere}tr:nth-child(even){background:#f4f4f4}</style></head><body>"
                f"<h1>kvreplay: tables and figures, profile <code>{profile}</code></h1>"
                f"<p>Headline (from <code>{H.escape(_relative(figures / 'table_vs_paper.csv', html_folder))}</code>):</p>"
                "<ul class='headline'>" + "".join(f"<li>{inline(x[2:])}</li>" for x in top) + "</ul>"
                f"<p>Per-tensor drift of one row, per layer, KV head and token position: <a href=\"{explorer}\">"
                f"{EXPLORER}</a> (the drift explorer; interactive with <code>make lab</code>).</p>"
                f"<p>Executed notebooks (code hidden):</p><ul>{notebooks}</ul>"
                "<p>Each link below opens the executed notebook at the cell that makes the artifact, or the file.</p>"
                f"<table><tr><th>artifact</th><th>kind</th><th>made by</th><th>files</th></tr>{rows}</table></body></html>")
        html_folder.mkdir(parents=True, exist_ok=True)
        idx = html_folder / "index.html"
        idx.write_text(page, encoding="utf-8")
        written.append(idx)
    return written


def assigned_names(src: str) -> set[str]:
    """The names a cell's top-level ``name = ...`` statements assign: a ``parameters`` cell's declared parameters,
    as papermill sees them."""
    return {t.id for node in ast.parse(src).body if isinstance(node, ast.Assign) for t in node.targets
            if isinstance(t, ast.Name)}


def code_cells(path: Path) -> list[tuple[list[str], str]]:
    """``(tags, source)`` of every code cell of a notebook file (read as JSON, no Jupyter needed)."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    out = []
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            src = c["source"] if isinstance(c["source"], str) else "".join(c["source"])
            out.append((c.get("metadata", {}).get("tags", []), src))
    return out


def run_inprocess(path: Path, params: dict) -> None:
    """Execute a notebook's code cells in one fresh namespace of this process, parameters injected as papermill would.

    The names assigned in the cell tagged ``parameters`` are the declared
    parameters; values of ``params`` for those names are assigned right after
    it. Cells run with the notebook's folder as working directory.

    Raises:
        RuntimeError: naming the notebook and the failing cell (1-based among code cells).
    """
    cells = code_cells(path)
    ns: dict = {"__name__": "__main__"}
    cwd = os.getcwd()
    os.chdir(Path(path).parent)
    try:
        for i, (tags, src) in enumerate(cells, 1):
            try:
                exec(compile(src, f"{Path(path).name}, code cell {i}", "exec"), ns)
                if "parameters" in tags:
                    declared = assigned_names(src)
                    ns.update({k: v for k, v in params.items() if k in declared})
            except Exception as e:
                raise RuntimeError(f"{Path(path).name} failed in code cell {i} ({type(e).__name__}: {e})") from e
    finally:
        os.chdir(cwd)
        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")


def inputs_digest(name: str, params: ChainParameters) -> str:
    """sha256 of everything a notebook's outputs depend on: its source, the resolved chain parameters (so a profile
    whose values change reruns it, whatever the file's layout), the library source, every ledger (plain or sealed),
    panel and prefix-bank file of the profile (run logs and parquet copies excluded), and the role-table checkpoint
    files the profile's pointer names."""
    import hashlib

    h = hashlib.sha256()
    h.update((NOTEBOOKS / name).read_bytes())
    h.update(canonical_json(params.model_dump(mode="json")).encode())
    h.update(library_digest().encode())
    root = Path(params.ledger_root or LEDGERS) / params.profile
    if root.is_dir():
        for f in sorted(root.rglob("*")):
            if f.is_file() and f.name.endswith((".jsonl", ".json", ".jsonl.gz")) and f.name != "runlog.jsonl":
                h.update(str(f.relative_to(root)).encode())
                h.update(f.read_bytes())
    pointer = root / "role_adaptation.json"  # the checkpoint family lives outside the ledgers (data/checkpoints)
    if pointer.is_file():

        folder, _ = read_pointer(pointer)
        for name in ("manifest.json", *sorted(p.name for p in folder.glob("*.pt"))) if folder.is_dir() else ():
            f = folder / name
            h.update(name.encode())
            h.update(f.read_bytes() if f.is_file() else b"missing")
        if not folder.is_dir():
            h.update(b"checkpoint folder missing")
    return h.hexdigest()


def _results_inputs(label: str, ledgers: Path, targets: list[Path]) -> str:
    """sha256 of what a results page reads and writes: the library, the paper's numbers, the profile's ledgers (and
    the cross-hardware setups' when the profile is one of them; run logs excluded) and the files it writes."""
    import hashlib

    from .report.cross_hardware import SETUPS
    from .report.results import REFERENCE

    h = hashlib.sha256(library_digest().encode() + REFERENCE.read_bytes())
    setups = [p for p, _ in SETUPS]
    for folder in (ledgers.parent / name for name in ([label] + setups if label in setups else [label])):
        for f in sorted(folder.rglob("*")) if folder.is_dir() else ():
            if f.is_file() and f.name != "runlog.jsonl":
                h.update(str(f.relative_to(ledgers.parent)).encode() + f.read_bytes())
    for t in targets:
        h.update(t.read_bytes() if t.is_file() else b"missing")
    return h.hexdigest()


def write_results(label: str, params: ChainParameters, ledgers: Path) -> str:
    """Rewrite a profile's results page from its ledgers (:mod:`kvreplay.report.results_pages`).

    A committed profile (:data:`EXECUTED_PROFILES`, default ledger root) gets ``docs/results-<profile>.md`` and,
    for :data:`~kvreplay.report.results_pages.HEADLINE_PROFILE`, the README's headline block; any other gets
    ``build/<profile>/results.md``. Skipped while its inputs (:func:`_results_inputs`) are unchanged; a chain
    that is not complete gets no page. :func:`main` calls it after a run of the profile's notebooks, not ``--only``.

    Returns:
        one line saying what was written or skipped, or why no page was made.
    """
    from .ledger.lookup import MissingLedgerError
    from .report import results_pages

    committed = label in EXECUTED_PROFILES and params.ledger_root is None
    page = results_pages.page_path(label) if committed else BUILD / label / "results.md"
    readme = committed and label == results_pages.HEADLINE_PROFILE
    targets = [page] + ([ROOT / "README.md"] if readme else [])
    stamp = BUILD / label / ".results.inputs"
    if stamp.is_file() and stamp.read_text() == _results_inputs(label, ledgers, targets):
        return f"results page up to date: {page}"
    try:
        res = results_pages.profile_results(label, ledgers.parent, **results_pages.profile_stats(label))
        changed = results_pages.regenerate(label, ROOT, res, page=page, readme=readme)
    except (MissingLedgerError, ValueError) as e:
        return f"no results page ({e})"
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(_results_inputs(label, ledgers, targets))
    return f"results page: {', '.join(map(str, changed))} rewritten" if changed else f"results page unchanged: {page}"


WAIT_POLICY = "OMP_WAIT_POLICY"
"""OpenMP's wait policy: ``PASSIVE`` (unless set) for the kernels, whose idle threads then sleep instead of spinning
against other jobs; it changes no bit (the golden rows pass under it). The Makefile exports the same."""


def main(argv: list[str] | None = None) -> int:
    """``make paper``; see the module docstring. The environment variables it sets for the notebooks' kernels
    (:data:`~kvreplay.ledger.store.TERMINAL_PROGRESS`, :data:`WAIT_POLICY` when unset, and
    :data:`~kvreplay.runner.READ_ONLY_ENV` for a profile whose file lists ``done:``) are restored when it returns.

    Ctrl-C stops the run with one line (exit 130): the kernel is shut down, finished ledger rows stay (a ledger
    is append-only), and the same command resumes."""
    saved = {k: os.environ.get(k) for k in (TERMINAL_PROGRESS, READ_ONLY_ENV, WAIT_POLICY)}
    os.environ.setdefault(WAIT_POLICY, "PASSIVE")
    try:
        return _main(argv)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _shown_path(path: Path) -> str:
    """A path as printed: relative to the repository when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvreplay.paper", description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--only", nargs="*", help="notebook name prefixes to run (default: the whole chain)")
    ap.add_argument("--no-html", action="store_true")
    ap.add_argument("--force", action="store_true", help="run every notebook even if its inputs are unchanged")
    ap.add_argument("--ledger-root", default=None, help="write and read ledgers under this folder instead of data/ledgers "
                    "(passed to the notebooks as an override)")
    ap.add_argument("--figures-root", default=None, help="write tables and figures under this folder instead of figures/ "
                    "(passed to the notebooks as an override)")
    ap.add_argument("--executed", action="store_true", help=f"also write executed/<profile>/ (default only for {EXECUTED_PROFILES})")
    ap.add_argument("--no-executed", action="store_true", help="do not write executed/<profile>/")
    ap.add_argument("--engine", choices=["papermill", "inprocess"], default="papermill",
                    help="inprocess: run code cells in this process (no Jupyter; writes no executed notebooks)")
    args = ap.parse_args(argv)
    overrides = {key: str(Path(value).resolve()) for key, value in (("ledger_root", args.ledger_root),
                                                                    ("figures_root", args.figures_root)) if value}
    try:
        params = load_parameters(args.profile, overrides)  # what every notebook resolves, checked before any runs
        doc = read_profile(args.profile)  # its `notebooks` list is this driver's, not a chain parameter
    except (FileNotFoundError, ValueError, yaml.YAMLError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # a profile given as a file is passed on as an absolute path (the notebooks run in notebooks/); its label,
    # the file's name, names the build, ledger and figure folders
    path = profile_path(args.profile)
    label = params.profile
    named = not (args.profile.endswith((".yaml", ".yml")) or "/" in args.profile)  # as profile_path tells them apart
    given = args.profile if named else str(path.resolve())
    injected = {"profile": given, "overrides": overrides} | RUN_PARAMETERS
    ledgers = Path(params.ledger_root or LEDGERS) / params.profile
    figures = Path(params.figures_root or FIGURES) / params.profile
    out_dir = BUILD / label
    # a profile may name the notebooks it runs (e.g. a reference run that covered only some experiments)
    listed = doc.get("notebooks")
    selected = args.only or listed
    if not args.only and "notebooks" in doc:
        if not (isinstance(selected, list) and selected and all(isinstance(x, str) and x for x in selected)):
            print(f"error: profile {label!r}: `notebooks` must be a non-empty list of notebook name prefixes "
                  f"such as [\"01\", \"06\"], got {selected!r}", file=sys.stderr)
            return 2
    chain = [n for n in CHAIN if not selected or any(n.startswith(p) for p in selected)]
    if not chain:
        print(f"error: --only / notebooks {selected} matches no notebook of {CHAIN}", file=sys.stderr)
        return 2
    if "done" in doc:  # computed on a GPU across device sessions: read what is there, never compute the rest here
        missing = unfinished_arms(chain, params, ledgers)
        if missing:
            print(f"error: profile {label!r} is computed on a GPU (its file lists `done:`), and these notebooks would "
                  f"compute here: they need arms its ledgers under {ledgers} do not hold in full, or (00) would train "
                  "a checkpoint family. Finish the arms with scripts/gpu_profile.py, or leave the notebooks out "
                  "(`notebooks:` / --only):\n  "
                  + "\n  ".join(missing), file=sys.stderr)
            return 2
        # every arm is complete under some folder; should a notebook build another key (a profile file edited in a
        # way that changes one), its run_arm refuses to compute rather than compute here (kernels inherit this)
        os.environ[READ_ONLY_ENV] = "1"
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"== {describe(params, given, overrides)}", flush=True)  # the resolved values, before anything runs
    t0 = time.perf_counter()
    if args.engine == "inprocess":
        import matplotlib

        matplotlib.use("Agg")
        name = chain[0]
        try:
            for name in chain:
                t = time.perf_counter()
                print(f"== {name} (profile {label}, in process)", flush=True)
                (out_dir / f".{Path(name).stem}.inputs").unlink(missing_ok=True)
                try:
                    run_inprocess(NOTEBOOKS / name, injected)
                except RuntimeError as e:
                    print(f"error: {e}", file=sys.stderr)
                    return 1
                print(f"   done in {time.perf_counter() - t:.0f} s", flush=True)
        except KeyboardInterrupt:
            print(f"\ninterrupted (Ctrl-C) in {name}: the rows it finished are kept in {_shown_path(ledgers)}; "
                  "run the same command again to resume", file=sys.stderr, flush=True)
            return 130
        print(f"\nin-process run ({label}) finished in {time.perf_counter() - t0:.0f} s; ledgers: {ledgers}; "
              f"tables and figures: {figures}")
        return 0

    os.environ[TERMINAL_PROGRESS] = "1"  # kernels inherit it: computed rows get a row bar in this terminal
    executed = (args.executed or label in EXECUTED_PROFILES) and not args.no_executed
    name = chain[0]
    try:
        for name in chain:
            t = time.perf_counter()
            stamp = out_dir / f".{Path(name).stem}.inputs"
            if not args.force and (out_dir / name).exists() and stamp.exists() and stamp.read_text() == inputs_digest(name, params):
                print(f"== {name}: up to date (source, parameters, library and ledgers unchanged), skipped", flush=True)
                continue
            print(f"== {name} (profile {label})", flush=True)
            stamp.unlink(missing_ok=True)
            try:
                run_notebook(name, injected, out_dir, html=not args.no_html)
            except RuntimeError as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            print(f"   done in {time.perf_counter() - t:.0f} s", flush=True)
            if executed:
                clean_executed(out_dir / name, EXECUTED / label / name)
    except KeyboardInterrupt:
        print(f"\ninterrupted (Ctrl-C) in {name}: the rows it finished are kept in {_shown_path(ledgers)}; "
              "run the same command again to resume", file=sys.stderr, flush=True)
        return 130
    # Stamp against the final state: a notebook reads only its own and earlier notebooks' ledgers, so the
    # later notebooks' writes do not change its outputs.
    for name in chain:
        (out_dir / f".{Path(name).stem}.inputs").write_text(inputs_digest(name, params))
    entries = artifact_index(out_dir, CHAIN)
    write_index(entries, label, out_dir, out_dir, listed, figures)
    if executed:
        write_index(artifact_index(EXECUTED / label, CHAIN), label, EXECUTED / label, None,
                    listed, figures)
    results_line = ("results page: not rewritten by a run with --only" if args.only
                    else write_results(label, params, ledgers))
    print(f"\nmake paper ({label}) finished in {time.perf_counter() - t0:.0f} s")
    print(f"  executed notebooks and HTML: {out_dir} (index: {out_dir / 'index.html'})")
    if executed:
        print(f"  committed executed copies:   {EXECUTED / label} (index: README.md)")
    print(f"  ledgers:                     {ledgers}")
    print(f"  tables and figures:          {figures}")
    print(f"  {results_line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
