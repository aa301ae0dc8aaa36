"""The pages ``make paper`` writes beside the executed notebooks: their HTML rendering, the executed copies
without volatile metadata, and the index linking each table and figure to the cell that makes it.

Re-exported by :mod:`kvreplay.paper`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from ..paths import FIGURES, ROOT
from .chain import CHAIN
from ..report.paper_tables import NOT_RUN


READING_CSS = """
.jp-OutputArea-output { overflow-x: auto; }
.jp-RenderedImage img, .jp-OutputArea-output img { width: 100%; max-width: 100%; height: auto; }
.jp-RenderedHTMLCommon table { table-layout: auto; max-width: none; }
.jp-RenderedHTMLCommon td, .jp-RenderedHTMLCommon th { white-space: normal; overflow-wrap: normal;
  word-break: normal; hyphens: none; max-width: 36em; vertical-align: top; }
.jp-RenderedHTMLCommon thead th { position: sticky; top: 0; background: var(--jp-layout-color0, #fff); }
"""
"""Style added to every HTML rendering: a figure spans the page's width (its PNG is drawn at twice its shown size,
so it stays sharp), a table's cells wrap between words, never inside one (at most 36em wide), and a table wider
than the page scrolls inside its output, with its header row kept in view."""

INDEX_CSS = ("body{font-family:sans-serif;max-width:70em;margin:2em auto}"
             "td,th{padding:2px 8px;text-align:left;vertical-align:top;overflow-wrap:normal;word-break:normal;"
             "hyphens:none}tr:nth-child(even){background:#f4f4f4}")
"""The index page's style: words wrap whole (a long artifact name breaks only after an underscore, :func:`_breakable`)."""


def _breakable(name: str) -> str:
    """An artifact or file name as HTML that may wrap after each underscore (``<wbr>``), never inside a word."""
    import html as H

    return "_<wbr>".join(H.escape(part) for part in name.split("_"))


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
    the plain-text copy of an output that has an HTML one. A table is read as HTML (JupyterLab, GitHub,
    ``make paper``'s HTML); its text copy doubled the bytes the repository's size budget counts. Made fixed:
    the id of the cell papermill injects (fresh on every run); this checkout's absolute path in text outputs
    (written relative to the repository root); stream outputs, consecutive ones merged into one (their split
    depends on flush timing). So re-executing on unchanged ledgers, anywhere, rewrites the same file.

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


def artifact_log(folder: Path, notebook: str) -> Path:
    """Where a notebook's tables and figures are recorded as it runs, beside its executed copy:
    ``<folder>/.<notebook stem>.artifacts.jsonl`` (:data:`kvreplay.report.files.ARTIFACT_LOG` names it)."""
    return folder / f".{Path(notebook).stem}.artifacts.jsonl"


def artifact_index(folder: Path, chain: list[str]) -> list[dict]:
    """Where each table and figure is made: each executed notebook's record of what it saved
    (:func:`artifact_log`), its cells found in the notebook by the sha256 of their source.

    Returns:
        one dict per artifact, in the order they were saved: ``kind`` (table/figure), ``stem``, ``files``
        (suffixes), ``notebook``, ``cell`` (1-based code-cell number), ``cell_id`` (the nbformat cell id),
        ``heading`` (the nearest markdown heading above the cell). A notebook without its record is left out.

    Raises:
        ValueError: a record line that is not JSON, or whose cell is not in the notebook (file and line named).
    """
    import nbformat

    out = []
    for name in chain:
        path, log = folder / name, artifact_log(folder, name)
        if not path.is_file() or not log.is_file():
            continue
        try:
            nb = nbformat.read(str(path), as_version=4)
        except Exception:  # not a notebook (e.g. a placeholder): nothing to index
            continue
        cells: dict[str, tuple[int, str | None, str]] = {}  # sha256 of a code cell's source -> number, id, heading
        heading, n_code = "", 0
        for c in nb.cells:
            if c.cell_type == "markdown":
                heading = next((line.lstrip("#").strip() for line in c.source.splitlines() if line.startswith("#")),
                               heading)
            elif c.cell_type == "code":
                n_code += 1
                cells.setdefault(hashlib.sha256(c.source.encode()).hexdigest(), (n_code, c.get("id"), heading))
        for i, line in enumerate(log.read_text(encoding="utf-8").splitlines(), 1):
            try:
                rec = json.loads(line)
                cell, cell_id, head = cells[rec["cell_sha256"]]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{log}:{i}: not a record of a cell of {name} ({type(e).__name__}: {e}); "
                                 f"re-execute the notebook (make paper) to record its tables and figures again") from None
            out.append({"kind": rec["kind"], "stem": rec["stem"], "files": rec["files"], "notebook": name,
                        "cell": cell, "cell_id": cell_id, "heading": head})
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
            f"<tr><td><code>{_breakable(e['stem'])}</code></td><td>{e['kind']}</td>"
            f"<td><a href=\"{Path(e['notebook']).stem}.html#cell-id={e['cell_id']}\">{_breakable(Path(e['notebook']).stem + '.html')}, code cell {e['cell']}</a>"
            f" ({H.escape(e['heading'])})</td><td>"
            + ", ".join(f"<a href=\"{H.escape(fig_href)}/{H.escape(e['stem'] + x)}\">{H.escape(x)}</a>" for x in e["files"].split())
            + "</td></tr>" for e in entries)
        notebooks = "".join(f"<li><a href=\"{Path(n).stem}.html\">{H.escape(Path(n).stem)}.html</a> (executed "
                            f"notebook: {H.escape(n)})</li>" for n in CHAIN
                            if (html_folder / f"{Path(n).stem}.html").is_file())
        explorer = Path(EXPLORER).stem + ".html"
        page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvreplay, profile {profile}</title>"
                f"<style>{INDEX_CSS}</style></head><body>"
                f"<h1>kvreplay: tables and figures, profile <code>{profile}</code></h1>"
                f"<p>Headline (from <code>{H.escape(_relative(figures / 'table_vs_paper.csv', html_folder))}</code>):</p>"
                "<ul class='headline'>" + "".join(f"<li>{inline(x[2:])}</li>" for x in top) + "</ul>"
                f"<p>Per-tensor drift of one row, per layer, KV head and token position: <a href=\"{explorer}\">"
                f"{explorer}</a> (the drift explorer, {EXPLORER} executed; interactive with <code>make lab</code>).</p>"
                f"<p>Executed notebooks (code hidden):</p><ul>{notebooks}</ul>"
                "<p>Each link below opens the executed notebook at the cell that makes the artifact, or the file.</p>"
                f"<table><tr><th>artifact</th><th>kind</th><th>made by</th><th>files</th></tr>{rows}</table></body></html>")
        html_folder.mkdir(parents=True, exist_ok=True)
        idx = html_folder / "index.html"
        idx.write_text(page, encoding="utf-8")
        written.append(idx)
    return written
