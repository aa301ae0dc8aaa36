"""Tables and figures written from ledger records (no model loaded).

Every table is saved as CSV, Markdown and LaTeX; every figure as PNG and
PDF. Each file names the notebook that made it, so a reviewer can trace a
number back to its code and ledger.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from ..experiments.endpoints import require_gates
from ..ledger.records import Exp1Record, Exp2Record, comparison_of

LATEX_UNICODE = {
    "…": r"\ldots{}", "–": "--", "—": "---", "−": "$-$", "→": r"$\rightarrow$", "←": r"$\leftarrow$",
    "≥": r"$\geq$", "≤": r"$\leq$", "·": r"$\cdot$", "×": r"$\times$", "±": r"$\pm$", "Δ": r"$\Delta$",
    "‖": r"$\|$", "≈": r"$\approx$", "≠": r"$\neq$", "√": r"$\surd$", "°": r"$^{\circ}$", "²": r"$^{2}$",
    "α": r"$\alpha$", "β": r"$\beta$", "μ": r"$\mu$", "σ": r"$\sigma$", "‘": "`", "’": "'", "“": "``", "”": "''",
    "\u00a0": "~", "✓": "yes", "✗": "no",
}
"""Unicode characters that tables may hold, and their LaTeX spelling (applied after pandas' own escaping)."""


_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def latex_escape(text: str) -> str:
    """Escape LaTeX's special characters and spell Unicode as LaTeX (for captions and other free text).

    Raises:
        ValueError: as :func:`latex_text`.
    """
    return latex_text("".join(_LATEX_SPECIAL.get(ch, ch) for ch in str(text)))


def latex_text(text: str) -> str:
    """Map the non-ASCII characters of already-escaped LaTeX text to LaTeX commands.

    Raises:
        ValueError: naming a non-ASCII character that has no LaTeX spelling in :data:`LATEX_UNICODE`
            (a table must not write raw Unicode into a ``.tex`` file).
    """
    out = []
    for ch in text:
        if ord(ch) < 128:
            out.append(ch)
        elif ch in LATEX_UNICODE:
            out.append(LATEX_UNICODE[ch])
        else:
            raise ValueError(f"no LaTeX spelling for {ch!r} (U+{ord(ch):04X}); add it to kvreplay.report.files.LATEX_UNICODE")
    return "".join(out)


def save_table(df: pd.DataFrame, stem: str | Path, *, caption: str, source: str) -> list[Path]:
    """Write ``df`` to ``<stem>.csv``, ``<stem>.md`` and ``<stem>.tex``.

    The Markdown file starts with the caption and the producing notebook; ``[saved table <stem>: .csv .md .tex]``
    is printed and the table recorded for the index of executed notebooks (:data:`ARTIFACT_LOG`). The
    LaTeX table is escaped (special characters by pandas, Unicode by
    :func:`latex_text`), captioned, and labelled ``tab:<stem name>``.

    Returns:
        the three paths written.

    Raises:
        ValueError: a cell or caption with a character :func:`latex_text` cannot spell.
    """
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    csv, md, tex = stem.with_suffix(".csv"), stem.with_suffix(".md"), stem.with_suffix(".tex")
    latex = latex_text(df.to_latex(caption=latex_escape(caption), label=f"tab:{stem.name}", escape=True))
    df.to_csv(csv)
    md.write_text(f"**{caption}** (made by `{source}`)\n\n{df.to_markdown()}\n", encoding="utf-8")
    tex.write_text(f"% made by {source}\n" + latex, encoding="utf-8")
    _saved("table", stem, ".csv .md .tex")
    return [csv, md, tex]


ARTIFACT_LOG = "KVREPLAY_ARTIFACT_LOG"
"""Environment variable naming the file where :func:`save_table` and :func:`save_figure` record what they write, one
JSON line each (``make paper`` sets it per notebook, :func:`kvreplay.paper.pages.artifact_log`; unset: nothing
recorded). The index of executed notebooks reads these records (:func:`kvreplay.paper.pages.artifact_index`)."""


def _saved(kind: str, stem: Path, files: str) -> None:
    """Print ``[saved <kind> <stem>: <files>]`` for the notebook's reader. Where :data:`ARTIFACT_LOG` names a file,
    append ``{"kind", "stem", "files", "cell_sha256"}`` to it: the sha256 of the running cell's source, which finds
    the cell in the executed notebook (``None`` outside a Jupyter kernel)."""
    print(f"[saved {kind} {stem.name}: {files}]")
    log = os.environ.get(ARTIFACT_LOG)
    if log:
        record = {"kind": kind, "stem": stem.name, "files": files, "cell_sha256": _cell_sha256()}
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def _cell_sha256() -> str | None:
    """The sha256 of the source of the cell a Jupyter kernel is running (its execute request's code), else ``None``."""
    if not _in_kernel():
        return None
    from IPython import get_ipython

    code = get_ipython().kernel.get_parent().get("content", {}).get("code")
    return hashlib.sha256(code.encode()).hexdigest() if isinstance(code, str) else None


def _in_kernel() -> bool:
    """Whether this code runs in a Jupyter kernel (where a figure can be shown inline)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and hasattr(ip, "kernel")


def _save_png(fig, png: Path, source: str) -> None:
    """Write ``fig`` as a 150-dpi PNG reduced to a 256-colour palette (median cut, no dithering).

    A plot's pixels hold few colours, so the palette leaves it looking the same at about a third of the bytes;
    every executed notebook embeds these files. Pillow's quantizer is deterministic: same figure, same bytes.
    """
    import io

    from PIL import Image, PngImagePlugin

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=150, bbox_inches="tight")
    buf.seek(0)
    with Image.open(buf) as im:
        palette = im.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    info = PngImagePlugin.PngInfo()
    info.add_text("Software", source)
    palette.save(png, format="PNG", optimize=True, pnginfo=info)


def save_figure(fig, stem: str | Path, *, source: str, show: bool = True) -> list[Path]:
    """Save a matplotlib figure as PNG (150 dpi, a 256-colour palette) and PDF, stamped with its source notebook; show it inline; close it.

    Prints ``[saved figure <stem>: .png .pdf]`` and records the figure for the index of executed notebooks
    (:data:`ARTIFACT_LOG`). The ``source:`` stamp is placed below everything the figure draws (its
    tight bounding box), so it never overlaps tick or axis labels.

    Args:
        fig: the figure.
        stem: path without suffix; ``.png`` and ``.pdf`` are written.
        source: the producing notebook, stamped and written into the files' metadata.
        show: display the figure in the notebook's output (only inside a Jupyter kernel).

    Returns:
        the two paths written.
    """
    import matplotlib.pyplot as plt

    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    if not hasattr(fig.canvas, "get_renderer"):  # a figure whose canvas has no renderer (closed, or a non-Agg backend)
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(fig)
    renderer = fig.canvas.get_renderer()
    box = fig.get_tightbbox(renderer)  # inches
    y = (box.y0 - 0.04) / fig.get_figheight()
    x = box.x1 / fig.get_figwidth()
    fig.text(x, y, f"source: {source}", ha="right", va="top", fontsize=6, color="0.5")
    png, pdf = stem.with_suffix(".png"), stem.with_suffix(".pdf")
    _save_png(fig, png, source)
    fig.savefig(pdf, bbox_inches="tight", metadata={"Creator": source, "CreationDate": None})
    _saved("figure", stem, ".png .pdf")
    if show and _in_kernel():
        from IPython.display import Image, display

        display(Image(filename=str(png), width=min(900, int(fig.get_figwidth() * 80))))
    plt.close(fig)
    return [png, pdf]


def drift_by_layer(records: Sequence[Exp1Record] | Sequence[Exp2Record],
                   comparison: str = "prefill_vs_live") -> pd.DataFrame:
    """Median over rows of each layer's relative L2 drift, keys and values separately.

    Args:
        records: an Experiment 1 or 2 arm's rows.
        comparison: the boundary comparison holding per-tensor drift (``prefill_vs_live`` or
            ``prefill_vs_incremental``).

    Returns:
        DataFrame with columns ``layer`` (int), ``kind`` (``key``/``value``), ``rel_l2``; for a model
        with sliding-window layers also ``layer_kind`` (``full``/``sliding``; a sliding layer's drift
        is over its attended positions, :func:`kvreplay.analysis.drift.cache_drift`).

    Raises:
        GateError: a row failed a gate.
    """
    rows = []
    for r in require_gates(records):
        for t in comparison_of(r, comparison)["tensors"]:
            layer, kind = t["tensor"].split(".")
            row = {"layer": int(layer[1:]), "kind": kind, "rel_l2": t["rel_l2"]}
            if "layer_kind" in t:
                row["layer_kind"] = t["layer_kind"]
            rows.append(row)
    df = pd.DataFrame(rows)
    keys = ["layer", "kind"] + (["layer_kind"] if "layer_kind" in df else [])
    return df.groupby(keys, as_index=False)["rel_l2"].median()


def _short(x, n: int = 12):
    return f"{x[:n]}…" if isinstance(x, str) and len(x) > n else x


def contract_frame(environments: dict[str, dict]) -> pd.DataFrame:
    """The execution contract of one or more ledgers (their ``environment.json``) as a compact table.

    Args:
        environments: column label (e.g. a precision or ledger name) -> the parsed
            ``environment.json`` (with an ``execution_contract`` key, or the contract itself).

    Returns:
        DataFrame indexed by field (software, device, threads, dtype, SDPA, determinism, TF32,
        model identity; digests cut to 12 hex digits), one column per input. A ``greedy tie rule`` row
        appears when an environment records a rule other than the default.
    """
    cols = {}
    for label, env in environments.items():
        c = env.get("execution_contract", env)
        m = c.get("model", {})
        cols[label] = {
            "torch / transformers / python": f"{c.get('torch')} / {c.get('transformers')} / {c.get('python')}",
            "device": f"{c.get('device')} ({c.get('device_name')})",
            "intra-op threads": c.get("intra_op_threads"),
            "dtype": c.get("dtype"),
            "attention / SDPA backends used": f"{c.get('attn_implementation')}"
                + (f" (engine step: {step})" if (step := (c.get("engine") or {}).get("attention", "sdpa")) != "sdpa" else "")
                + f" / {', '.join(c.get('sdpa_backends_used') or []) or '—'}",
            "deterministic algorithms / TF32 (matmul, cuDNN)": f"{c.get('deterministic_algorithms')} / {c.get('tf32_matmul')}, {c.get('tf32_cudnn')}",
            "model": f"{m.get('model')} ({m.get('architecture')}, {m.get('layers')} layers, {m.get('kv_heads')} KV heads)",
            "model file sha256": _short(m.get("file_sha256")),
            "weights sha256": _short(m.get("weights_sha256")),
            "role table sha256": _short(m.get("role_table_sha256")) or "none",
            "format digest": _short(c.get("format_digest")),
            "library sha256 (when written)": _short(env.get("library_sha256")),
        }
    rules = {label: env.get("execution_contract", env).get("tie_rule") for label, env in environments.items()}
    if any(rules.values()):  # a rule other than the default (lowest, recorded by no environment)
        for label, rule in rules.items():
            cols[label]["greedy tie rule"] = rule or "lowest"
    return pd.DataFrame(cols)
