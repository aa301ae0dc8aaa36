"""How the results pages write numbers: counts with Wilson intervals, percentage points, p-values, markdown tables.

Shared by :mod:`kvreplay.report.results_pages` (a profile's page and the README's headline) and
:mod:`kvreplay.report.cross_family` (two model families side by side). Each function formats one summary object;
none reads formatted text back.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..analysis.stats import PairedDifference, Proportion


def pct(x: float) -> str:
    """A percentage with one decimal; 0 and 100 without."""
    return "0" if x == 0 else "100" if x == 100 else f"{x:.1f}"


def rate(p: Proportion | None) -> str:
    """``k/n (r% [low, high])``: a count with its Wilson 95% interval in percent (``n/a`` for an empty stratum)."""
    if p is None:
        return "n/a (no rows)"
    return f"{p.k}/{p.n} ({pct(100 * p.rate)}% [{pct(100 * p.low)}, {pct(100 * p.high)}])"


def pts(d: PairedDifference | None) -> str:
    """A paired difference in percentage points with its bootstrap interval."""
    return "n/a" if d is None else f"{100 * d.estimate:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]"


def pval(p: float) -> str:
    """A p-value to two significant digits."""
    return f"{p:.2g}"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table (``|`` in a cell escaped)."""
    def line(cells: Sequence[object]) -> str:
        return "| " + " | ".join(str(c).replace("|", r"\|") for c in cells) + " |"
    return "\n".join([line(header), "|" + "---|" * len(header), *(line(r) for r in rows)])


def caps_text(c: dict) -> str:
    """``branch / merge / answer`` caps in tokens."""
    return f"{c['branch']} / {c['merge']} / {c['answer']}"


def dtype_label(d: str) -> str:
    """``BF16`` / ``FP32`` for a dtype name (other names as they are)."""
    return {"bfloat16": "BF16", "float32": "FP32"}.get(d, d)
