"""The committed ledgers of the earlier, unpaired kernel ablation (``data/kernel_ablation/<profile>``), read and
tabulated; nothing here computes a row.

In that design each kernels value decoded its own live boundary (unpaired inputs) and compared the prefill cache
against it; the attribution now runs as the arm ``exp2_kernels`` on pinned inputs
(:mod:`kvreplay.experiments.kernel_ablation`). These ledgers stay as they were written; the README's kernel-ablation
paragraph (:func:`kvreplay.report.provenance_pages.kernel_paragraph`) and ``table.md`` beside them are rendered from
them. Ledger kinds (the folder name's first part): ``kernels`` (:class:`AblationRow`, one folder per value) and
``orders`` (:class:`OrdersRow`: order B's cache over order A's live boundary IDs, each suffix under its own order).

``table.md`` is rewritten from the ledgers by::

    python -m kvreplay.report.kernel_ablation_legacy          # rewrite data/kernel_ablation/cpu/table.md
    python -m kvreplay.report.kernel_ablation_legacy --check  # change nothing; exit 1 if it differs
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from pydantic import ConfigDict, TypeAdapter, ValidationError, with_config
from typing_extensions import TypedDict

from ..model.kernels import KERNELS
from ..ledger import provenance as prov
from ..ledger.checked import checked_rows
from ..ledger.files import LedgerError, read_environment, read_log, read_manifest
from ..ledger.records import RowSchemaError
from ..ledger.row_parts import Float, Margins, TokenIds
from ..paths import DATA

TOOL = "python -m kvreplay.report.kernel_ablation_legacy"
ROOT_CPU = DATA / "kernel_ablation" / "cpu"
ROW_ALGORITHM = 1
"""The row-algorithm version these ledgers were written with (``environment.json``); no other is read."""
ORDER_A, ORDER_B = "invariant", "invariant-attention-block-128"
"""The two fixed orders of the attention class of the ``orders`` ledger."""
_STRICT = ConfigDict(extra="forbid", strict=True)


@with_config(_STRICT)
class CacheDrift(TypedDict):
    """Whole-cache difference of two boundary caches over the same IDs (every layer's keys and values)."""
    exact: bool  # every element bit-identical
    rel_l2: Float  # ||a - b|| / ||a||
    max_abs: Float
    n_diff: int  # elements that differ
    numel: int


@with_config(_STRICT)
class AblationAnswer(TypedDict):
    """One greedy suffix from a boundary and its scored answer."""
    suffix: TokenIds
    margins: Margins
    answer_text: str
    predicted: str | None  # the answer letter, None when none was read
    correct: bool


@with_config(_STRICT)
class AblationRow(TypedDict):
    """A row of a ``kernels`` ledger: live vs prefill under one kernels value, the live boundary its own."""
    problem_id: str
    kernels: str
    prefix: TokenIds  # the live boundary prefix z
    drift: CacheDrift  # prefill vs live
    logits_exact: bool  # boundary logits bit-identical
    live: AblationAnswer
    prefill: AblationAnswer
    diverged: bool
    first_divergence: int | None  # suffix step
    tie_initiated: bool


@with_config(_STRICT)
class OrderPair(TypedDict):
    order_a: str
    order_b: str


@with_config(_STRICT)
class OrdersRow(TypedDict):
    """A row of the ``orders`` ledger: order A's live boundary vs order B's cache over the same IDs."""
    problem_id: str
    kernels: OrderPair
    prefix: TokenIds  # order A's live boundary prefix z
    drift: CacheDrift  # B's cache over z vs A's live cache
    logits_exact: bool
    order_a: AblationAnswer  # suffix under A from A's live boundary
    order_b: AblationAnswer  # suffix under B from B's cache
    diverged: bool
    first_divergence: int | None
    tie_initiated: bool


ROW_TYPES: dict[str, type] = {"kernels": AblationRow, "orders": OrdersRow}
"""Ledger kind (the folder name's first part) -> row record."""


def check_rows(kind: str, rows: Iterable[Any]) -> list[Any]:
    """Check every row of a ``kind`` ledger (``kernels`` or ``orders``) against its record, strictly.

    Raises:
        RowSchemaError: the first row that does not fit, named by its ``problem_id`` and the first error's path.
        ValueError: an unknown kind.
    """
    if kind not in ROW_TYPES:
        raise ValueError(f"unknown kernel-ablation ledger kind {kind!r}; known: {sorted(ROW_TYPES)}")
    adapter: TypeAdapter[Any] = TypeAdapter(ROW_TYPES[kind])
    out = []
    for row in rows:
        try:
            adapter.validate_python(row)
        except ValidationError as e:
            errors = cast(list[dict[str, Any]], e.errors(include_url=False))
            loc = ".".join(str(x) for x in errors[0]["loc"]) or "<row>"
            raise RowSchemaError(f"kernel-ablation {kind}", row.get("problem_id") if isinstance(row, Mapping) else None,
                                 ROW_TYPES[kind], loc, errors) from None
        out.append(row)
    return out


@dataclasses.dataclass
class AblationLedgers:
    """A root's ablation ledgers of one dtype, checked (:func:`load_ablation`).

    Attributes:
        by_value: kernels value -> its rows (:class:`AblationRow`), in :data:`kvreplay.model.kernels.KERNELS` order.
        orders: the two-orders rows (:class:`OrdersRow`), empty when there is no such ledger.
        folders: ledger name (folder name without its digest) -> its folder.
        configs: ledger name -> its manifest's config.
    """
    by_value: dict[str, list[Any]]
    orders: list[Any]
    folders: dict[str, Path]
    configs: dict[str, dict]


def load_ablation(root: str | Path, dtype: str) -> AblationLedgers:
    """Read and check every ablation ledger of ``dtype`` under ``root`` (``data/kernel_ablation/<profile>``).

    Each check fails closed. The manifest fits its folder (:func:`kvreplay.ledger.checked.checked_manifest`). The
    kernels value and dtype its config names are the folder's, and every row's. The row algorithm is
    :data:`ROW_ALGORITHM`. Rows parse, one per problem, none refused by its sampled float32 check, and fit their record.

    Raises:
        LedgerError: a missing root, or a digest, schema, value or row-algorithm mismatch (naming the folder).
        LedgerLineError: a damaged line, a duplicated problem, or a row whose sampled check failed or never finished.
        RowSchemaError: a row that does not fit its record (:func:`check_rows`).
    """
    root = Path(root)
    if not root.is_dir():
        raise LedgerError(f"{root}: no kernel-ablation ledgers of the earlier design here")
    by_value: dict[str, list[Any]] = {}
    orders: list[Any] = []
    folders: dict[str, Path] = {}
    configs: dict[str, dict] = {}
    for folder in sorted(root.iterdir()):
        kind = folder.name.split("-", 1)[0]
        if not folder.is_dir() or kind not in ROW_TYPES or not folder.name.startswith(f"{kind}-{dtype}-"):
            continue
        lines = checked_rows(folder)  # manifest against the folder; refuses rows a sampled check failed or awaits
        config = read_manifest(folder)["config"]
        value = config.get("execution", {}).get("kernels", "default")
        name = folder.name.rsplit("-", 1)[0]
        want = f"kernels-{dtype}-{value}" if kind == "kernels" else f"orders-{dtype}-{ORDER_A}-vs-{ORDER_B}"
        if name != want or value not in KERNELS or config.get("dtype") != dtype:
            raise LedgerError(f"{folder}: its config names kernels {value!r} and dtype {config.get('dtype')!r}, "
                              f"which is not the folder {name!r}")
        algorithm = read_environment(folder).get("row_algorithm")
        if algorithm != ROW_ALGORITHM:
            raise LedgerError(f"{folder}: written by row algorithm {algorithm}, this code reads {ROW_ALGORITHM}")
        rows = check_rows(kind, [r.record for r in lines])
        if kind == "kernels":
            wrong = [r["problem_id"] for r in rows if r["kernels"] != value]
            if wrong:
                raise LedgerError(f"{folder}: rows {wrong} were computed under other kernels than {value!r}")
            by_value[value] = rows
        else:
            orders = [r for r in rows if r["kernels"] == {"order_a": ORDER_A, "order_b": ORDER_B}]
            if len(orders) != len(rows):
                raise LedgerError(f"{folder}: rows of other orders than {ORDER_A!r} and {ORDER_B!r}")
        folders[name], configs[name] = folder, config
    ordered = {v: by_value[v] for v in KERNELS if v in by_value}
    return AblationLedgers(ordered, orders, folders, configs)


def rows_of_unknown_libraries(folders: Mapping[str, Path], data: Path = DATA) -> dict[str, set[str]]:
    """Per name of ``folders`` (ledger folders), the problem IDs whose run-log ``row`` event names a library digest
    that no commit has (``null`` in ``data/libraries.json``, or absent from it).

    Raises:
        FileNotFoundError, LedgerFileError: ``data/libraries.json`` missing or damaged.
    """
    libraries = prov.read_library_commits(data / "libraries.json")
    return {name: {str(e.get("key") or e.get("problem_id")) for e in read_log(Path(folder) / "runlog.jsonl")
                   if e.get("event") == "row" and e.get("library_sha256") and not libraries.get(e["library_sha256"])}
            for name, folder in folders.items()}


def ablation_table(rows_by_value: Mapping[str, Sequence[Mapping[str, Any]]],
                   marked: Mapping[str, set[str]] | None = None) -> str:
    """A markdown table, one line per kernels value: rows, caches bit-identical, median (range) relative L2 of
    prefill vs live, suffixes parted (of those begun at an exact tie), live and prefill accuracy.

    ``marked`` (kernels value -> problem IDs, :func:`rows_of_unknown_libraries`) adds a last column: the rows a
    library that no commit has wrote, and how many of them part."""
    extra = marked is not None and any(marked.values())
    head = ("| kernels | rows | prefill cache = live, bit for bit | rel. L2 prefill vs live, median [range] | "
            "suffixes part (tie-initiated) | live correct | prefill correct |"
            + (" rows by a library of no known commit (of them part) |" if extra else "")
            + "\n|---|---|---|---|---|---|---|" + ("---|" if extra else "") + "\n")
    lines = []
    for value, rows in rows_by_value.items():
        n = len(rows)
        if not n:
            continue
        parted = sum(r["diverged"] for r in rows)
        ties = sum(r["tie_initiated"] for r in rows)
        lines.append(f"| `{value}` | {n} | {sum(r['drift']['exact'] for r in rows)}/{n} | "
                     f"{_median_range([r['drift']['rel_l2'] for r in rows])} | {parted}/{n} ({ties}) | "
                     f"{sum(bool(r['live']['correct']) for r in rows)}/{n} | "
                     f"{sum(bool(r['prefill']['correct']) for r in rows)}/{n} |")
        if extra and marked is not None:
            ids = marked.get(value, set())
            lines[-1] += (f" {sum(r['problem_id'] in ids for r in rows)} "
                          f"({sum(r['problem_id'] in ids and r['diverged'] for r in rows)}) |")
    return head + "\n".join(lines) + "\n"


def _median_range(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.2e} [{min(values):.2e}, {max(values):.2e}]"


def orders_table(orders_rows: Sequence[Mapping[str, Any]], rows_by_value: Mapping[str, Sequence[Mapping[str, Any]]],
                 order_a: str = ORDER_A, order_b: str = ORDER_B) -> str:
    """A markdown table of the two fixed orders beside the default kernels, on the problems each line has.

    Lines: order B's cache against order A's live cache over the same IDs (the ``orders`` ledger). The default
    kernels' prefill against live on the same problems. The two orders' whole live decodings from the prompt (their
    ``kernels`` ledgers). Columns: rows, caches bit-identical, rel. L2 median [range], suffixes part (of them
    tie-initiated), answers differ.
    """
    head = ("| comparison | rows | caches bit-identical | rel. L2, median [range] | suffixes part (tie-initiated) | "
            "answers differ |\n|---|---|---|---|---|---|\n")
    lines = []
    ids = {r["problem_id"] for r in orders_rows}
    if orders_rows:
        n = len(orders_rows)
        lines.append(f"| `{order_b}` cache vs `{order_a}` live, same IDs, each suffix under its own order | {n} | "
                     f"{sum(r['drift']['exact'] for r in orders_rows)}/{n} | "
                     f"{_median_range([r['drift']['rel_l2'] for r in orders_rows])} | "
                     f"{sum(r['diverged'] for r in orders_rows)}/{n} ({sum(r['tie_initiated'] for r in orders_rows)}) | "
                     f"{sum(r['order_a']['predicted'] != r['order_b']['predicted'] for r in orders_rows)}/{n} |")
    default = [r for r in rows_by_value.get("default", ()) if r["problem_id"] in ids]
    if default:
        n = len(default)
        lines.append(f"| `default` prefill vs live (same problems) | {n} | {sum(r['drift']['exact'] for r in default)}/{n} | "
                     f"{_median_range([r['drift']['rel_l2'] for r in default])} | "
                     f"{sum(r['diverged'] for r in default)}/{n} ({sum(r['tie_initiated'] for r in default)}) | "
                     f"{sum(r['live']['predicted'] != r['prefill']['predicted'] for r in default)}/{n} |")
    a = {r["problem_id"]: r for r in rows_by_value.get(order_a, ())}
    b = {r["problem_id"]: r for r in rows_by_value.get(order_b, ())}
    both = [p for p in a if p in b]
    if both:
        n = len(both)
        parted = sum(a[p]["prefix"] + a[p]["live"]["suffix"] != b[p]["prefix"] + b[p]["live"]["suffix"] for p in both)
        same_z = sum(a[p]["prefix"] == b[p]["prefix"] for p in both)
        lines.append(f"| `{order_a}` live vs `{order_b}` live, from the prompt ({same_z}/{n} same boundary prefix) | "
                     f"{n} | - | - | {parted}/{n} (-) | "
                     f"{sum(a[p]['live']['predicted'] != b[p]['live']['predicted'] for p in both)}/{n} |")
    return head + "\n".join(lines) + "\n"


def table_text(root: Path = ROOT_CPU, data: Path = DATA, dtype: str = "bfloat16") -> str:
    """``table.md``'s text for ``root``'s ``dtype`` ledgers: caps and problems from the ``default`` ledger's
    config, the ablation table with its library marks, then the two orders beside the default kernels.

    Raises:
        LedgerError, LedgerLineError, RowSchemaError: as :func:`load_ablation`.
        ValueError: no ``default`` ledger of ``dtype`` under ``root``.
    """
    found = load_ablation(root, dtype)
    config = found.configs.get(f"kernels-{dtype}-default")
    if config is None:
        raise ValueError(f"{root}: no kernels-{dtype}-default ledger; table.md names its caps and problems")
    caps = config["caps"]
    marked = rows_of_unknown_libraries({v: found.folders[f"kernels-{dtype}-{v}"] for v in found.by_value}, data)
    text = (f"Attribution control of the invariant-kernel contract, profile `{config['profile']}` ({dtype}, caps "
            f"{caps['branch']}/{caps['merge']}/{caps['answer']}, first {len(config['problem_ids'])} bank problems; "
            "rows done per value below).\n"
            f"Tabulated by `{TOOL}` from the ledgers beside this file, which an earlier design wrote (each kernels "
            "value decoded its own live boundary); nothing here is recomputed.\n\n"
            + ablation_table(found.by_value, marked))
    if found.orders:
        text += ("\nTwo fixed orders of the attention class at fixed precision, beside the default kernels' "
                 "prefill vs live:\n\n" + orders_table(found.orders, found.by_value))
        ids = {r["problem_id"] for r in found.orders}
        shared = sorted(ids & marked.get("default", set()))
        if shared:
            text += (f"\nOf the `default` rows on these problems, {len(shared)} of {len(ids)} were written by a "
                     "library of no known commit.\n")
    return text


def main(argv: list[str] | None = None) -> int:
    """Rewrite ``table.md`` from the ledgers beside it, or with ``--check`` say whether it differs (exit 1); exit 2
    on bad input."""
    ap = argparse.ArgumentParser(prog=TOOL, description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT_CPU, help="folder of the ledgers and table.md")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if table.md differs")
    args = ap.parse_args(argv)
    try:
        text = table_text(args.root)
    except (LedgerError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = args.root / "table.md"
    if args.check:
        same = path.is_file() and path.read_text(encoding="utf-8") == text
        print(f"{path}: " + ("agrees with the ledgers" if same else f"differs from the ledgers; run {TOOL}"))
        return 0 if same else 1
    path.write_text(text, encoding="utf-8")
    print(f"rewritten: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
