"""Tables and figures written from ledger records (no model loaded).

Every table is saved as CSV, Markdown and LaTeX; every figure as PNG and
PDF. Each file names the notebook that made it, so a reviewer can trace a
number back to its code and ledger.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd


def save_table(df: pd.DataFrame, stem: str | Path, *, caption: str, source: str) -> list[Path]:
    """Write ``df`` to ``<stem>.csv``, ``<stem>.md`` and ``<stem>.tex``.

    The Markdown file starts with the caption and the producing notebook.

    Returns:
        the three paths written.
    """
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    csv, md, tex = stem.with_suffix(".csv"), stem.with_suffix(".md"), stem.with_suffix(".tex")
    df.to_csv(csv)
    md.write_text(f"**{caption}** (made by `{source}`)\n\n{df.to_markdown()}\n", encoding="utf-8")
    tex.write_text(
        f"% made by {source}\n" + df.to_latex(caption=caption, escape=True), encoding="utf-8"
    )
    return [csv, md, tex]


def save_figure(fig, stem: str | Path, *, source: str) -> list[Path]:
    """Save a matplotlib figure as PNG (150 dpi) and PDF, stamped with its source notebook, then close it."""
    import matplotlib.pyplot as plt

    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    fig.text(0.995, 0.005, f"source: {source}", ha="right", va="bottom", fontsize=6, color="0.5")
    png, pdf = stem.with_suffix(".png"), stem.with_suffix(".pdf")
    fig.savefig(png, dpi=150, bbox_inches="tight", metadata={"Software": source})
    fig.savefig(pdf, bbox_inches="tight", metadata={"Creator": source, "CreationDate": None})
    plt.close(fig)
    return [png, pdf]


def drift_by_layer(records: Sequence[dict], comparison: str = "prefill_vs_live") -> pd.DataFrame:
    """Median over rows of each layer's relative L2 drift, keys and values separately.

    Returns:
        DataFrame with columns ``layer`` (int), ``kind`` (``key``/``value``), ``rel_l2``.
    """
    rows = []
    for r in records:
        for t in r["boundary"][comparison]["tensors"]:
            layer, kind = t["tensor"].split(".")
            rows.append({"layer": int(layer[1:]), "kind": kind, "rel_l2": t["rel_l2"]})
    df = pd.DataFrame(rows)
    return df.groupby(["layer", "kind"], as_index=False)["rel_l2"].median()
