"""The README's results tables, generated from the tables in ``figures/<profile>/``.

The section "## Results of the committed `<profile>` run" of README.md quotes the
run's tables. Each markdown table of that section sits between two marker comments::

    <!-- results-table: cpu/exp1 (generated from figures/cpu/table_exp1_matrix.csv, ...; do not edit) -->
    ...the table...
    <!-- /results-table -->

and is rebuilt from the CSV files that ``make paper`` writes (``figures/<profile>/*.csv``)
plus the paper's reported numbers (``data/paper/reference.yaml``, never typed here)::

    python -m kvreplay.report.readme_tables --profile cpu            # rewrite the blocks in README.md
    python -m kvreplay.report.readme_tables --profile cpu --check    # exit 1 and name each difference

``--check`` also reads the section's prose: every ``k/n`` count must be one that the
tables the paragraph names (in backticks, e.g. `table_exp2_matrix`) give; a percentage
or Wilson interval quoted with it, every bracketed interval, and every "rates above x%"
must equal the tables' value at the printed precision. Only pandas and PyYAML are
imported (no model, no torch).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from functools import partial
from pathlib import Path

import pandas as pd
import yaml

from ..paths import ROOT

README = "README.md"
REFERENCE = Path("data/paper/reference.yaml")
TOOL = "python -m kvreplay.report.readme_tables"

BLOCK = re.compile(
    r"<!-- results-table: (?P<profile>[\w.-]+)/(?P<name>[\w.-]+)\b[^\n]*?-->\n(?P<body>.*?)<!-- /results-table -->",
    re.S,
)


class ReadmeTableError(ValueError):
    """A figures table or reference.yaml lacks a value a README table needs, or has it in an unknown form."""


@dataclass(frozen=True)
class Difference:
    """One place where README.md differs from what the figures tables give.

    Attributes:
        where: The README table (``cpu/exp1``) or prose paragraph the difference is in.
        item: The row and column of the cell, or the quoted number.
        readme: What README.md has (empty when it has nothing).
        expected: What the figures tables give, or which tables were searched.
    """
    where: str
    item: str
    readme: str
    expected: str

    def __str__(self) -> str:
        return f"{self.where}: {self.item}: README has {self.readme!r}; figures give {self.expected!r}"


# ----------------------------------------------------------------------------- reading


def figures_dir(root: Path, profile: str) -> Path:
    """``<root>/figures/<profile>``."""
    return Path(root) / "figures" / profile


def read_table(root: Path, profile: str, stem: str) -> pd.DataFrame:
    """Read ``figures/<profile>/<stem>.csv`` as strings, first column as the index.

    Raises:
        ReadmeTableError: the file does not exist.
    """
    path = figures_dir(root, profile) / f"{stem}.csv"
    if not path.is_file():
        raise ReadmeTableError(f"{path} is missing: run `make paper PROFILE={profile}`")
    return pd.read_csv(path, index_col=0, dtype=str, keep_default_na=False)


def load_reference(root: Path) -> dict:
    """Read ``data/paper/reference.yaml`` (the paper's reported numbers).

    Raises:
        ReadmeTableError: the file does not exist.
    """
    path = Path(root) / REFERENCE
    if not path.is_file():
        raise ReadmeTableError(f"{path} is missing")
    return yaml.safe_load(path.read_text(encoding="utf-8"))


class _Table:
    """A figures table whose missing rows and columns raise a ReadmeTableError naming the file."""

    def __init__(self, root: Path, profile: str, stem: str):
        self.name = f"figures/{profile}/{stem}.csv"
        self.df = read_table(root, profile, stem)

    def __call__(self, row: str, col: str) -> str:
        if row not in self.df.index:
            raise ReadmeTableError(f"{self.name} has no row {row!r}")
        if col not in self.df.columns:
            raise ReadmeTableError(f"{self.name} has no column {col!r}")
        return str(self.df.at[row, col])


def _paper(reference: dict) -> Callable[[str], str]:
    by_id = {e["id"]: e["paper"] for e in reference["endpoints"]}

    def get(endpoint_id: str) -> str:
        if endpoint_id not in by_id:
            raise ReadmeTableError(f"{REFERENCE} has no endpoint {endpoint_id!r}")
        return by_id[endpoint_id]

    return get


# ----------------------------------------------------------------------------- formatting

_PROPORTION = re.compile(
    r"^(?P<k>\d+)/(?P<n>\d+) \((?P<pct>\d+(?:\.\d+)?)%; Wilson 95% CI \[(?P<lo>[\d.]+), (?P<hi>[\d.]+)\]\)?"
)


def _match(pattern: str | re.Pattern, text: str, what: str) -> re.Match:
    m = re.search(pattern, text)
    if m is None:
        raise ReadmeTableError(f"{what}: {text!r} is not in the expected form")
    return m


def _count_of_total(text: str, what: str) -> str:
    """The leading ``k/n`` of a cell such as ``5/16 (31.2%; ...)``."""
    return _match(r"^\d+/\d+", text, what).group(0)


def _round(text: str, places: int) -> str:
    """Round a printed number half up to ``places`` decimals; 0 and 100 print without decimals."""
    d = Decimal(text.lstrip("+"))
    if d in (0, 100):
        return str(int(d))
    return str(d.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP))


def _sci(text: str, sig: int | None = None) -> str:
    """``0.00793`` -> ``7.93e-3``; ``sig`` significant digits (default: as many as ``text`` has)."""
    d = Decimal(text)
    if sig is None:
        sig = len(d.normalize().as_tuple().digits)
    return format(d, f".{sig - 1}e")


def _wilson_short(cell: str, what: str, label: str = "Wilson ") -> str:
    """``5/16 (31.2%; Wilson 95% CI [14.16, 55.60])`` -> ``5/16 (31.2%; Wilson [14.2, 55.6])``."""
    m = _match(_PROPORTION, cell, what)
    return f"{m['k']}/{m['n']} ({m['pct']}%; {label}[{_round(m['lo'], 1)}, {_round(m['hi'], 1)}])"


def _drift(cell: str, what: str) -> tuple[str, str, str]:
    m = _match(r"^(\S+) \[(\S+), (\S+)\]$", cell, what)
    return m.group(1), m.group(2), m.group(3)


def markdown_table(header: list[str], rows: Iterable[list[str]]) -> str:
    """A GitHub markdown table (``|`` in a cell escaped), one line per row, no trailing newline."""

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", r"\|") for c in cells) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header), *(line(r) for r in rows)])


# ----------------------------------------------------------------------------- the tables


@dataclass(frozen=True)
class TableSpec:
    """One README results table: its name, the files it is built from, and its builder.

    Attributes:
        name: The block's name in the marker (``exp1``).
        stems: The ``figures/<profile>/<stem>.csv`` files it reads.
        build: ``build(root, profile) -> (header, rows)``.
    """
    name: str
    stems: tuple[str, ...]
    build: Callable[[Path, str], tuple[list[str], list[list[str]]]]

    def sources(self, profile: str) -> list[str]:
        """The files the table is generated from, relative to the repository root."""
        return [f"figures/{profile}/{s}.csv" for s in self.stems] + [str(REFERENCE)]

    def marker(self, profile: str) -> str:
        """The opening marker comment of the table's README block."""
        files = self.sources(profile)
        listed = ", ".join(files[:-1]) + " and " + files[-1]
        return (
            f"<!-- results-table: {profile}/{self.name} (generated from {listed} "
            f"by {TOOL} --profile {profile}; do not edit) -->"
        )

    def block(self, root: Path, profile: str) -> str:
        """The whole README block: marker, blank line, table, blank line, end marker."""
        header, rows = self.build(root, profile)
        return f"{self.marker(profile)}\n\n{markdown_table(header, rows)}\n\n<!-- /results-table -->"


def _exp1(root: Path, profile: str) -> tuple[list[str], list[list[str]]]:
    """Experiment 1: this run's ``table_exp1_matrix`` and ``table_first_divergence`` vs the paper."""
    t = _Table(root, profile, "table_exp1_matrix")
    fd = _Table(root, profile, "table_first_divergence")
    reference = load_reference(root)
    paper = _paper(reference)
    bf = lambda row: t(row, "bfloat16")  # noqa: E731
    fp = lambda row: t(row, "float32")  # noqa: E731
    paper_rows = reference["setup"]["rows"]["exp1"]

    decoded = ["suffix differs", "answer block differs (any token)", "predicted letter differs", "correctness label differs"]
    tie = next((r for r in t.df.index if r.startswith("suffix differs: tie-initiated / not")), None)
    if tie is None:
        raise ReadmeTableError(f"{t.name} has no row 'suffix differs: tie-initiated / not ...'")

    # first divergence: median (range) from the matrix, quartiles from table_first_divergence
    fd_row = "Exp 1 prefill vs live, bfloat16"
    quartiles = ", ".join(fd(fd_row, c) for c in ("Q1", "median", "Q3"))
    pfd = _match(r"median (\d+) \(range (\d+)-(\d+)\)", paper("exp1.bf16.first_divergence"), "exp1.bf16.first_divergence")

    bf_drift = _drift(bf("median relative L2 cache drift [range]"), t.name)
    fp_drift = _drift(fp("median relative L2 cache drift [range]"), t.name)
    p_drift = _match(r"^BF16 (\S+); FP32 (\S+)$", paper("exp2.drift"), "exp2.drift")

    p_acc = _match(r"^(\d+)/\d+ vs (\d+)/\d+$", paper("exp1.bf16.accuracy"), "exp1.bf16.accuracy")
    p_mcn = _match(r"^(\d+) vs (\d+), p = 0?(\.\d+)$", paper("exp1.bf16.mcnemar"), "exp1.bf16.mcnemar")
    mcnemar = bf("McNemar (live-only vs prefill-only correct), exact p").split(", p =")[0]

    fp_cells = [fp(r) for r in decoded]
    if len(set(fp_cells)) == 1:
        m = _match(_PROPORTION, fp_cells[0], t.name)
        fp_decoded = f"{m['k']}/{m['n']} each (Wilson [{_round(m['lo'], 1)}, {_round(m['hi'], 1)}])"
    else:
        fp_decoded = " / ".join(_count_of_total(c, t.name) for c in fp_cells)
    if paper("exp1.fp32.decoded") != "no decoded disagreement":
        raise ReadmeTableError(f"{REFERENCE} exp1.fp32.decoded is {paper('exp1.fp32.decoded')!r}, not 'no decoded disagreement'")

    header = ["Experiment 1 endpoint", f"here (`{profile}`, {bf('rows')} rows)", f"paper ({paper_rows} rows)"]
    rows = [
        [
            "BF16: boundary cache non-bit-exact; first eligible argmax agrees",
            f"{bf('boundary cache non-bit-exact')}; {bf('first eligible argmax agrees')}",
            f"{paper('exp1.bf16.boundary_non_exact')}; {paper('exp1.bf16.first_token_agree')}",
        ],
        [
            "BF16: suffixes differ",
            _wilson_short(bf("suffix differs"), t.name),
            _wilson_short(paper("exp1.bf16.suffix"), "exp1.bf16.suffix", label=""),
        ],
        ["BF16: of these, tie-initiated / not", bf(tie), "not reported"],
        [
            "BF16: merge / answer block / predicted letter / correctness label differ",
            " / ".join(_count_of_total(bf(r), t.name) for r in ["merge differs", *decoded[1:]]),
            " / ".join(["—", _count_of_total(paper("exp1.bf16.answer"), "exp1.bf16.answer"), "—",
                        _count_of_total(paper("exp1.bf16.label"), "exp1.bf16.label")]),
        ],
        [
            "BF16: first divergence, median (range); quartiles",
            f"{bf('first divergence, tokens after boundary: median (range)')} tokens; {quartiles}",
            f"{pfd.group(1)} ({pfd.group(2)}–{pfd.group(3)})",
        ],
        [
            "BF16: median relative L2 cache drift [range]",
            f"{_sci(bf_drift[0], 3)} [{_sci(bf_drift[1], 3)}, {_sci(bf_drift[2], 3)}]",
            f"{_sci(p_drift.group(1))} (Exp. 2)",
        ],
        [
            "BF16: accuracy live vs prefill",
            f"{bf('accuracy live / prefill')} (McNemar {mcnemar})",
            f"{p_acc.group(1)} vs {p_acc.group(2)} ({p_mcn.group(1)} vs {p_mcn.group(2)}, p = {p_mcn.group(3)})",
        ],
        ["FP32: decoded disagreement (suffix, answer, letter, label)", fp_decoded, f"0/{paper_rows}"],
        [
            "FP32: median relative L2 cache drift",
            f"{_sci(fp_drift[0], 3)} [{_sci(fp_drift[1], 3)}, {_sci(fp_drift[2], 3)}]",
            f"{_sci(p_drift.group(2))} (Exp. 2)",
        ],
        [
            "boundary prefixes token-identical across precisions",
            bf("boundary prefix token-identical across precisions"),
            paper("exp1.cross_precision_prefix"),
        ],
    ]
    return header, rows


RUN_LABELS = {"cpu": "2-core CPU, eager, caps 48 / 160 / 12",
              "gpu": "H200, graph engine, 50 problems per step, caps 48 / 160 / 12",
              "paper": "H200, graph engine, 32 problems per step, caps 768 / 512 / 64"}
"""How a side-by-side table's header names each profile's run: device, step path and batch, caps (a test keeps the
caps and batch equal to ``notebooks/params/<profile>.yaml``). The last column is the publication's run."""


def _run_label(profile: str) -> str:
    return f"`{profile}` profile: " + RUN_LABELS.get(profile, "this run")


def _side_by_side(root: Path, profile: str, base: str = "cpu") -> tuple[list[str], list[list[str]]]:
    """Experiments 1 and 2: the ``base`` run, this run and the paper, endpoint by endpoint.

    Reads ``table_exp1_matrix``, ``table_exp2_matrix`` and ``table_exp2_crossing`` of both profiles.
    """
    runs = {}
    for prof in (base, profile):
        runs[prof] = {stem: _Table(root, prof, stem) for stem in SIDE_BY_SIDE_STEMS}
    reference = load_reference(root)
    paper = _paper(reference)
    paper_rows = reference["setup"]["rows"]["exp1"]

    def cell(prof: str, stem: str, row: str, col: str) -> str:
        return runs[prof][stem](row, col)

    def tie_row(prof: str, stem: str) -> str:
        t = runs[prof][stem]
        row = next((r for r in t.df.index if r.startswith("suffix differs: tie-initiated / not")), None)
        if row is None:
            raise ReadmeTableError(f"{t.name} has no row 'suffix differs: tie-initiated / not ...'")
        return t(row, "bfloat16")

    def both(fn: Callable[[str], str]) -> list[str]:
        return [fn(base), fn(profile)]

    def decoded(prof: str, stem: str, dtype: str) -> str:
        rows = ["suffix differs", "answer block differs (any token)", "predicted letter differs", "correctness label differs"]
        cells = [cell(prof, stem, r, dtype) for r in rows]
        if dtype == "float32" and len(set(cells)) == 1:
            m = _match(_PROPORTION, cells[0], stem)
            return f"{m['k']}/{m['n']} each (Wilson [{_round(m['lo'], 1)}, {_round(m['hi'], 1)}])"
        return " / ".join(_count_of_total(c, stem) for c in cells[1:])

    def drift(prof: str, stem: str, dtype: str) -> str:
        med, lo, hi = _drift(cell(prof, stem, "median relative L2 cache drift [range]", dtype), stem)
        return f"{_sci(med, 3)} [{_sci(lo, 3)}, {_sci(hi, 3)}]"

    def crossing(prof: str, row: str) -> str:
        est = cell(prof, "table_exp2_crossing", row, "FP32 − BF16, pts [95% bootstrap CI]")
        mcn = cell(prof, "table_exp2_crossing", row, "McNemar: BF16-only vs FP32-only, exact p")
        return f"{est}; McNemar {mcn}"

    p_acc = _match(r"^(\d+)/\d+ vs (\d+)/\d+$", paper("exp1.bf16.accuracy"), "exp1.bf16.accuracy")
    p_mcn = _match(r"^(\d+) vs (\d+), p = 0?(\.\d+)$", paper("exp1.bf16.mcnemar"), "exp1.bf16.mcnemar")
    p_drift = _match(r"^BF16 (\S+); FP32 (\S+)$", paper("exp2.drift"), "exp2.drift")
    pfd = _match(r"median (\d+) \(range (\d+)-(\d+)\)", paper("exp1.bf16.first_divergence"), "exp1.bf16.first_divergence")
    p_red = _match(r"^(\S+) \[(\S+), (\S+)\]; p = (\S+)$", paper("exp2.reduction.suffix"), "exp2.reduction.suffix")
    e1, e2 = "table_exp1_matrix", "table_exp2_matrix"
    header = ["endpoint", *both(lambda p: f"{_run_label(p)} ({cell(p, e1, 'rows', 'bfloat16')} rows)"),
              f"paper ({paper_rows} rows)"]
    rows = [
        ["Exp 1 BF16: boundary cache non-bit-exact; first eligible argmax agrees",
         *both(lambda p: f"{cell(p, e1, 'boundary cache non-bit-exact', 'bfloat16')}; "
                         f"{cell(p, e1, 'first eligible argmax agrees', 'bfloat16')}"),
         f"{paper('exp1.bf16.boundary_non_exact')}; {paper('exp1.bf16.first_token_agree')}"],
        ["Exp 1 BF16: prefill vs live suffixes differ",
         *both(lambda p: _wilson_short(cell(p, e1, "suffix differs", "bfloat16"), e1)),
         _wilson_short(paper("exp1.bf16.suffix"), "exp1.bf16.suffix", label="")],
        ["Exp 1 BF16: of these, tie-initiated / not", *both(lambda p: tie_row(p, e1)), "not reported"],
        ["Exp 1 BF16: answer block / predicted letter / correctness label differ",
         *both(lambda p: decoded(p, e1, "bfloat16")),
         " / ".join([_count_of_total(paper("exp1.bf16.answer"), "exp1.bf16.answer"), "—", _count_of_total(paper("exp1.bf16.label"), "exp1.bf16.label")])],
        ["Exp 1 BF16: first divergence, tokens after the boundary: median (range)",
         *both(lambda p: cell(p, e1, "first divergence, tokens after boundary: median (range)", "bfloat16")),
         f"{pfd.group(1)} ({pfd.group(2)}–{pfd.group(3)})"],
        ["Exp 1 BF16: accuracy live vs prefill (McNemar live-only vs prefill-only)",
         *both(lambda p: f"{cell(p, e1, 'accuracy live / prefill', 'bfloat16')} "
                         f"({cell(p, e1, 'McNemar (live-only vs prefill-only correct), exact p', 'bfloat16')})"),
         f"{p_acc.group(1)} vs {p_acc.group(2)} ({p_mcn.group(1)} vs {p_mcn.group(2)}, p = {p_mcn.group(3)})"],
        ["Exp 1 FP32: decoded disagreement (suffix, answer block, letter, label)",
         *both(lambda p: decoded(p, e1, "float32")), f"0/{paper_rows}"],
        ["Exp 1: boundary prefix token-identical across precisions",
         *both(lambda p: cell(p, e1, "boundary prefix token-identical across precisions", "bfloat16")),
         paper("exp1.cross_precision_prefix")],
        ["Exp 2 BF16: prefill vs incremental suffixes differ (tie-initiated / not)",
         *both(lambda p: f"{_wilson_short(cell(p, e2, 'suffix differs', 'bfloat16'), e2)} ({tie_row(p, e2)})"),
         _count_of_total(paper("exp2.bf16.suffix"), "exp2.bf16.suffix")],
        ["Exp 2 FP32: decoded disagreement (suffix, answer block, letter, label)",
         *both(lambda p: decoded(p, e2, "float32")), _count_of_total(paper("exp2.fp32.suffix"), "exp2.fp32.suffix")],
        ["Exp 2 median relative L2 cache drift, BF16 [range]", *both(lambda p: drift(p, e2, "bfloat16")),
         _sci(p_drift.group(1))],
        ["Exp 2 median relative L2 cache drift, FP32 [range]", *both(lambda p: drift(p, e2, "float32")),
         _sci(p_drift.group(2))],
        ["Exp 2 paired FP32 − BF16 suffix disagreement, pts [95% CI]",
         *both(lambda p: crossing(p, "suffix disagreement")),
         f"−{p_red.group(1)} [−{p_red.group(3)}, −{p_red.group(2)}]; p = {p_red.group(4)}"],
        ["Exp 2 paired FP32 − BF16 predicted-letter disagreement, pts [95% CI]",
         *both(lambda p: crossing(p, "predicted-letter disagreement")), "not reported"],
    ]
    return header, rows


SIDE_BY_SIDE_STEMS = ("table_exp1_matrix", "table_exp2_matrix", "table_exp2_crossing")

LATER_STEMS = ("table_exp3_bridge", "table5_exp4_transplant", "table_exp5_replication", "exp2_controls")


def _later_side_by_side(root: Path, profile: str, base: str = "cpu",
                        stems: tuple[str, ...] = LATER_STEMS) -> tuple[list[str], list[list[str]]]:
    """Experiments 3-5 and the exploratory controls: the ``base`` run, this run and the paper.

    Reads ``stems`` (:data:`LATER_STEMS`, or those without ``exp2_controls`` for a profile that has not run
    the controls: their rows then say "not run" in this run's column) of both profiles (each table has one column).
    """
    tables = {(prof, stem): _Table(root, prof, stem) for stem in LATER_STEMS
              for prof in ((base, profile) if stem in stems else (base,))}
    reference = load_reference(root)
    paper = _paper(reference)
    paper_rows = reference["setup"]["rows"]

    def cell(prof: str, stem: str, row: str) -> str:
        t = tables[(prof, stem)]
        return t(row, t.df.columns[0])

    def both(fn: Callable[[str], str]) -> list[str]:
        return [fn(base), fn(profile)]

    def controls(fn: Callable[[str], str]) -> list[str]:
        return [fn(base), fn(profile) if (profile, c2) in tables else "not run"]

    def short(prof: str, stem: str, row: str) -> str:
        return _wilson_short(cell(prof, stem, row), stem)

    def left_out(prof: str) -> str:  # Experiment 4 panel rows whose argmax precondition was unmet
        t = tables[(prof, LATER_STEMS[1])]
        row = next((r for r in t.df.index if r.startswith("argmax precondition unmet")), None)
        if row is None:
            return ""
        n = len(re.findall(r"\((?:divergent|exact): ", t(row, t.df.columns[0])))  # "<id> (<stratum>: <reason>)" each
        return f"; {n} panel row{'s' if n != 1 else ''} left out (precondition unmet)"

    b3, t4, r5, c2 = LATER_STEMS
    tie5 = "of which tie-initiated (either arm's top-1 minus top-2 margin exactly 0 at the first divergent step)"
    def sizes(p: str) -> str:
        return " / ".join([cell(p, b3, "rows"), cell(p, t4, "panel rows (frozen divergent + exact)").split(" ")[0],
                           cell(p, r5, "panel rows (order statistics of prefix length)").split(" ")[0],
                           cell(p, c2, "rows") if (p, c2) in tables else "—"])

    header = ["endpoint (rows: Exp 3 / Exp 4 / Exp 5 / controls)", *both(lambda p: f"{_run_label(p)} ({sizes(p)})"),
              f"paper ({paper_rows['exp3']} / {paper_rows['exp4']} / {paper_rows['exp5']} / —)"]
    rows = [
        ["Exp 3 bridge: incremental bit-exact to live on every layer; logits; complete suffix",
         *both(lambda p: "; ".join(cell(p, b3, r) for r in ("incremental bit-exact to live on every layer",
                                                             "boundary logits exact", "complete suffix exact"))),
         "; ".join(paper(k) for k in ("exp3.bridge.layers_exact", "exp3.bridge.logits_exact", "exp3.bridge.suffix_exact"))],
        ["Exp 3 bridge: new live prefix token-identical to the saved one",
         *both(lambda p: cell(p, b3, "new prefix token-identical to the saved one")), paper("exp3.bridge.same_as_saved")],
        ["Exp 4 whole-cache transplant: joint donor recovery (integrity check)",
         *both(lambda p: short(p, t4, "joint bidirectional recovery (integrity check)") + left_out(p)),
         _count_of_total(paper("exp4.joint_recovery"), "exp4")],
        ["Exp 4: third trajectory among exact controls",
         *both(lambda p: short(p, t4, "third trajectory among exact controls")), _count_of_total(paper("exp4.third_among_exact"), "exp4")],
        ["Exp 4: divergent panel rows tie-initiated / not",
         *both(lambda p: cell(p, t4, "divergent rows (contemporaneous baselines): tie-initiated / not")), "not reported"],
        ["Exp 5 (later checkpoint): incremental/prefill suffix divergence (tie-initiated)",
         *both(lambda p: f"{short(p, r5, 'incremental/prefill suffix divergence')} ({cell(p, r5, tie5)})"),
         _wilson_short(paper("exp5.divergence"), "exp5.divergence", label="")],
        ["Exp 5: joint donor recovery; new trajectory among exact controls",
         *both(lambda p: f"{_count_of_total(cell(p, r5, 'joint bidirectional recovery (integrity check)'), r5)}; "
                         f"{_count_of_total(cell(p, r5, 'new trajectory among exact controls'), r5)}"),
         f"{_count_of_total(paper('exp5.joint_recovery'), 'exp5')}; {_count_of_total(paper('exp5.third_among_exact'), 'exp5')}"],
        ["Exp 5: frozen interpretation (thresholds ≥ 12 divergent, ≥ 6 exact)",
         *both(lambda p: cell(p, r5, "interpretation (frozen matrix)")), paper("exp5.interpretation")],
        ["Controls (exploratory): FP32 readout on the same BF16 caches, suffix differs (tie-initiated)",
         *controls(lambda p: f"{short(p, c2, 'FP32 readout (same BF16 caches; final norm and LM head in float32): suffix differs')} "
                         f"({cell(p, c2, 'FP32 readout: of which tie-initiated')})"), "not in the paper"],
        ["Controls: FP32 readout still differs among rows whose BF16 suffixes differ",
         *controls(lambda p: _count_of_total(cell(p, c2, "FP32 readout: still differs among rows whose plain BF16 suffixes differ"), c2)),
         "not in the paper"],
        ["Controls: matched null perturbation moves the trajectory (tie-initiated)",
         *controls(lambda p: f"{short(p, c2, 'matched null perturbation of the incremental cache: trajectory moved')} "
                         f"({cell(p, c2, 'null perturbation: of which tie-initiated')})"), "not in the paper"],
        ["Controls: null perturbation moves it among rows whose BF16 suffixes agree",
         *controls(lambda p: _count_of_total(cell(p, c2, "null perturbation: moved among rows whose plain BF16 suffixes agree"), c2)),
         "not in the paper"],
    ]
    return header, rows


@dataclass(frozen=True)
class SideBySideSpec(TableSpec):
    """A table that reads the stems of a ``base`` profile (``cpu``; the ``gpu`` run beside the ``paper`` one) as well
    as its own ``stems`` (``base_stems``: what it reads of the base, when that differs)."""

    base: str = "cpu"
    base_stems: tuple[str, ...] | None = None

    def sources(self, profile: str) -> list[str]:
        return ([f"figures/{self.base}/{s}.csv" for s in (self.base_stems or self.stems)]
                + [f"figures/{profile}/{s}.csv" for s in self.stems] + [str(REFERENCE)])


TABLES_BY_PROFILE: dict[str, dict[str, TableSpec]] = {
    "cpu": {"exp1": TableSpec("exp1", ("table_exp1_matrix", "table_first_divergence"), _exp1)},
    "gpu": {"exp1_exp2": SideBySideSpec("exp1_exp2", SIDE_BY_SIDE_STEMS, _side_by_side),
            "exp3_exp5": SideBySideSpec("exp3_exp5", LATER_STEMS, _later_side_by_side)},
    # the paper's caps beside the gpu profile's (same H200 engine, same 200 problems); the controls are not run there
    "paper": {"exp1_exp2": SideBySideSpec("exp1_exp2", SIDE_BY_SIDE_STEMS, partial(_side_by_side, base="gpu"), base="gpu"),
              "exp3_exp5": SideBySideSpec("exp3_exp5", LATER_STEMS[:3], partial(_later_side_by_side, base="gpu",
                                                                                stems=LATER_STEMS[:3]),
                                          base="gpu", base_stems=LATER_STEMS)},
}
"""The README results tables of each profile, by block name."""
TABLES = TABLES_BY_PROFILE["cpu"]


# ----------------------------------------------------------------------------- README blocks


def results_section(readme: str, profile: str) -> str:
    """The text of README's "## Results of the committed `<profile>` run" section ('' if it has none)."""
    m = re.search(rf"^## Results of the committed `{re.escape(profile)}` run\n(.*?)(?=^## |\Z)", readme, re.S | re.M)
    return m.group(1) if m else ""


def _cells(table: str) -> list[list[str]]:
    rows = [line for line in table.strip().splitlines() if line.startswith("|")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", r)[1:-1]] for r in rows if not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", r)]


def _table_differences(where: str, readme_body: str, expected_body: str) -> list[Difference]:
    got, want = _cells(readme_body), _cells(expected_body)
    out = []
    header = want[0] if want else []
    for i in range(max(len(got), len(want))):
        g = got[i] if i < len(got) else []
        w = want[i] if i < len(want) else []
        label = (w or g or [""])[0]
        for j in range(max(len(g), len(w))):
            gc = g[j] if j < len(g) else ""
            wc = w[j] if j < len(w) else ""
            if gc != wc:
                col = header[j] if j < len(header) else f"column {j + 1}"
                item = f"header, column {j + 1}" if i == 0 else f"row {label!r}, column {col!r}"
                out.append(Difference(where, item, gc, wc))
    return out


def expected_blocks(root: Path, profile: str) -> dict[str, str]:
    """Every results table of ``profile`` as its README block text, by name.

    Raises:
        ReadmeTableError: a figures table or reference.yaml lacks a value, or has it in an unknown form.
    """
    return {name: spec.block(root, profile) for name, spec in TABLES_BY_PROFILE.get(profile, TABLES).items()}


def check_tables(readme: str, root: Path, profile: str) -> list[Difference]:
    """Compare README's generated blocks of ``profile`` with what the figures tables give.

    Reports a block that differs cell by cell (the table and the row and column of each
    differing cell), a changed marker, a block with no generator, a table missing from a
    profile whose results section exists, and any markdown table of that section outside
    a block.

    Raises:
        ReadmeTableError: as :func:`expected_blocks`.
    """
    expected = expected_blocks(root, profile)
    out: list[Difference] = []
    seen = set()
    for m in BLOCK.finditer(readme):
        if m["profile"] != profile:
            continue
        where = f"README table {profile}/{m['name']}"
        seen.add(m["name"])
        if m["name"] not in expected:
            out.append(Difference(where, "block", m.group(0)[:80], f"a table named one of {sorted(expected)}"))
            continue
        want = BLOCK.fullmatch(expected[m["name"]])
        if want is None:
            raise ReadmeTableError(f"the generated block {profile}/{m['name']} is not a results-table block")
        marker, want_marker = m.group(0).split("\n", 1)[0], want.group(0).split("\n", 1)[0]
        if marker != want_marker:
            out.append(Difference(where, "marker comment", marker, want_marker))
        cells = _table_differences(where, m["body"], want["body"])
        if m["body"] != want["body"] and not cells:
            cells.append(Difference(where, "layout (blank lines, separator row)", m["body"], want["body"]))
        out += cells
    section = results_section(readme, profile)
    if section:
        out += [
            Difference(f"README section results of `{profile}`", f"table {name}", "", "a generated block")
            for name in expected if name not in seen
        ]
        outside = BLOCK.sub("", section)
        for line in outside.splitlines():
            if line.startswith("|"):
                out.append(Difference(f"README section results of `{profile}`", "a table outside a results-table block",
                                      line[:80], f"a block written by {TOOL}"))
                break
    return out


def write(readme: str, root: Path, profile: str) -> str:
    """README text with every block of ``profile`` rewritten from the figures tables.

    Only text between the markers (and the opening marker itself) changes; a block with
    no generator is left as it is (``check_tables`` reports it).

    Raises:
        ReadmeTableError: as :func:`expected_blocks`.
    """
    expected = expected_blocks(root, profile)

    def sub(m: re.Match) -> str:
        if m["profile"] != profile or m["name"] not in expected:
            return m.group(0)
        return expected[m["name"]]

    return BLOCK.sub(sub, readme)


# ----------------------------------------------------------------------------- prose

_FRACTION = re.compile(r"(?<![\w./])(\d+)/(\d+)(?![\w/])")
_FULL = re.compile(r"(\d+)/(\d+) \((\d+(?:\.\d+)?)%; Wilson 95% CI \[([\d.]+), ([\d.]+)\]\)")
_INTERVAL = re.compile(r"\[([+\-−]?\d+(?:\.\d+)?), ([+\-−]?\d+(?:\.\d+)?)\]")
_LETTERS = re.compile(r"^[A-Z] \d+(, [A-Z] \d+)*$")


@dataclass
class _Facts:
    """What a set of figures tables says: k/n counts, their percentages and Wilson intervals, all intervals."""

    fractions: set[tuple[int, int]] = field(default_factory=set)
    proportions: dict[tuple[int, int], list[tuple[str, str, str]]] = field(default_factory=dict)  # -> (pct, lo, hi)
    intervals: list[tuple[str, str]] = field(default_factory=list)  # (lo, hi) as printed

    def add_table(self, df: pd.DataFrame) -> None:
        cells = [str(c) for c in df.to_numpy().ravel()]
        for c in cells:
            self.fractions.update((int(k), int(n)) for k, n in _FRACTION.findall(c))
            for k, n, pct, lo, hi in _FULL.findall(c):
                self.proportions.setdefault((int(k), int(n)), []).append((pct, lo, hi))
            self.intervals += _INTERVAL.findall(c)
        # counts with their denominator in another cell
        if {"rows", "follows donor"} <= set(df.columns):  # table_exp4_localization
            for _, r in df.iterrows():
                for col in df.columns[df.columns.get_loc("rows") + 1:]:
                    self.fractions.add((int(r[col]), int(r["rows"])))
        n = next((df.iloc[df.index.get_loc(lab), 0] for lab in ("problems", "rows") if lab in df.index), None)
        if n is not None and str(n).isdigit():  # letter counts such as "A 13, D 187" of n rows
            for c in cells:
                if _LETTERS.match(c):
                    self.fractions.update((int(x), int(n)) for x in re.findall(r"\d+", c))


def _num(text: str) -> Decimal:
    return Decimal(text.replace("−", "-").lstrip("+"))


def _same(printed: str, value: str) -> bool:
    """``printed`` equals ``value`` rounded to the decimals ``printed`` shows."""
    p = _num(printed)
    exponent = p.as_tuple().exponent
    if not isinstance(exponent, int):
        raise ValueError(f"printed number {printed!r} is not finite")
    places = max(0, -exponent)
    return abs(p - _num(value)) <= Decimal(5).scaleb(-places - 1) + Decimal("1e-9")


def _paragraphs(section: str) -> list[str]:
    text = BLOCK.sub("", section)
    return [p for p in (" ".join(x.split()) for x in re.split(r"\n\s*\n", text)) if p and not p.startswith("|")]


def check_prose(readme: str, root: Path, profile: str) -> list[Difference]:
    """Check the counts and intervals quoted in the prose of README's results section.

    Each paragraph is checked against the figures tables it names in backticks (all
    tables of the profile when it names none): every ``k/n`` must be a count those
    tables give (in a cell, as a row count of ``table_exp4_localization``, or as a letter
    count of the table's rows); a percentage right after it (``5/16 (31.2%``) and a
    Wilson interval quoted with it (``5/16 (Wilson [14.2, 55.6])``) must equal the
    tables' value for that count at the printed precision; every other bracketed
    interval must be one of the tables' intervals; every "rates above x%" must be a
    Wilson upper bound of those tables. Text in "(paper: ...)" is skipped.

    Raises:
        ReadmeTableError: a table named in a paragraph cannot be read.
    """
    folder = figures_dir(root, profile)
    stems = sorted(p.stem for p in folder.glob("*.csv"))
    cache: dict[str, pd.DataFrame] = {}
    out: list[Difference] = []
    for para in _paragraphs(results_section(readme, profile)):
        cited = [s for s in dict.fromkeys(re.findall(r"`([\w.-]+)`", para)) if s in stems] or stems
        facts = _Facts()
        for s in cited:
            facts.add_table(cache.setdefault(s, read_table(root, profile, s)))
        where = f"README prose {para[:50]!r}"
        tables = ", ".join(cited) if len(cited) < len(stems) else f"figures/{profile}/*.csv"
        text = re.sub(r"\(paper:[^)]*\)", "", para)
        quoted_with_count = set()  # where the Wilson intervals checked with their count end
        for m in _FRACTION.finditer(text):
            k, n = int(m[1]), int(m[2])
            if (k, n) not in facts.fractions:
                out.append(Difference(where, f"count {k}/{n}", m[0], f"no {k}/{n} in {tables}"))
                continue
            given = facts.proportions.get((k, n), [])
            after = text[m.end():]
            pct = re.match(r" \((\d+(?:\.\d+)?)%", after)
            known = [g[0] for g in given] or [str(Decimal(100 * k) / n)]
            if pct and not any(_same(pct[1], x) for x in known):
                out.append(Difference(where, f"percentage of {k}/{n}", pct[1] + "%",
                                      " or ".join(x + "%" for x in known)))
            ci = re.match(r"(?: [a-z ]{0,30})? \((?:\d+(?:\.\d+)?%[,;] )?(?:Wilson )?\[([\d.]+), ([\d.]+)\]", after)
            if ci:
                quoted_with_count.add(m.end() + ci.end())
            if ci and not any(_same(ci[1], g[1]) and _same(ci[2], g[2]) for g in given):
                out.append(Difference(where, f"Wilson interval of {k}/{n}", f"[{ci[1]}, {ci[2]}]",
                                      " or ".join(f"[{g[1]}, {g[2]}]" for g in given) or f"none in {tables}"))
        for m in _INTERVAL.finditer(text):
            if m.end() not in quoted_with_count and not any(_same(m[1], lo) and _same(m[2], hi) for lo, hi in facts.intervals):
                out.append(Difference(where, "interval", m[0], f"no such interval in {tables}"))
        for m in re.finditer(r"rates above (\d+(?:\.\d+)?)%", text):
            if not any(_same(m[1], hi) for _, _, hi in (g for gs in facts.proportions.values() for g in gs)):
                out.append(Difference(where, "rates above", m[1] + "%", f"no such Wilson upper bound in {tables}"))
    return out


def check(readme: str, root: Path, profile: str) -> list[Difference]:
    """:func:`check_tables` and :func:`check_prose` together (what ``--check`` reports)."""
    return check_tables(readme, root, profile) + check_prose(readme, root, profile)


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """Rewrite README's results tables of a profile, or with ``--check`` report differences (exit 1).

    Exit status: 0 when README was rewritten or agrees, 1 when ``--check`` found a
    difference, 2 when a figures table or reference.yaml cannot be read as needed.
    """
    ap = argparse.ArgumentParser(prog=TOOL, description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu", help="figures/<profile>/ to read (default: cpu)")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 and name every difference")
    ap.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout's)")
    args = ap.parse_args(argv)
    path = args.root / README
    readme = path.read_text(encoding="utf-8")
    sections = sorted({m["profile"] for m in BLOCK.finditer(readme)})
    if args.profile not in sections:
        print(f"error: README.md has no results tables of profile {args.profile!r}; it has them for "
              f"{', '.join(sections)}", file=sys.stderr)
        return 2
    try:
        if args.check:
            diffs = check(readme, args.root, args.profile)
            for d in diffs:
                print(d)
            if diffs:
                print(f"{len(diffs)} difference(s); `{TOOL} --profile {args.profile}` rewrites the tables "
                      "(prose is edited by hand)", file=sys.stderr)
                return 1
            print(f"README.md agrees with figures/{args.profile}/")
            return 0
        new = write(readme, args.root, args.profile)
        if new != readme:
            path.write_text(new, encoding="utf-8")
            print(f"README.md: results tables of {args.profile} rewritten")
        else:
            print("README.md unchanged")
        return 0
    except ReadmeTableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
