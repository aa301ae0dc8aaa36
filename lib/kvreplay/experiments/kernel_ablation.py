"""The attribution control of the invariant-kernel contract: which operation class, left in its default reduction
order, brings back the prefill-versus-live cache drift and the BF16 suffix divergence.

Each kernels value (:data:`kvreplay.kernels.KERNELS`: ``default``, ``invariant`` and every
``invariant-except-<class>``) is its own arm with its own ledger key (:meth:`kvreplay.runner.ArmSettings.config`
with ``kernels``). A row is Experiment 1's comparison under that value. Greedy live decoding reaches the merge
boundary and a prefill runs over the same IDs. The two boundary caches are compared on every layer, one greedy
suffix is decoded from each, where they part is found, and both answers are scored. Under ``invariant`` the caches
coincide by construction (the contract's test, not a finding); the finding is which ``invariant-except-<class>``
arm brings drift and divergence back. Outcomes are recorded and tabulated, never asserted. The command is ``scripts/kernel_ablation.py``.

Two fixed orders at fixed precision (:func:`orders_row`): live decoding under order A (``invariant``) reaches the
boundary, and order B (``invariant-attention-block-128``) builds its boundary cache over the same token IDs. The two
caches are compared on every layer, and one suffix is decoded from each under its own order. Under each order alone
prefill = live by construction, so this is the size of a change of one fixed reduction order, to set beside the
default kernels' prefill-vs-live drift (:func:`orders_table`).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import pandas as pd
from pydantic import TypeAdapter, ValidationError, with_config
from typing_extensions import TypedDict

from pathlib import Path

from .. import decode
from ..contract import BlockFormat, Caps
from ..drift import aggregate, cache_drift
from ..gates import cache_tensors
from ..kernels import KERNELS
from ..ledger.files import LedgerError, read_environment, read_manifest
from ..ledger.records import RowSchemaError
from ..ledger.checked import checked_rows
from ..ledger.store import SCHEMA_VERSION, config_digest
from ..ledger.row_parts import _CONFIG, Float, Margins, TokenIds
from ..models import LoadedModel
from ..problems import Problem
from ..scoring import score_answer
from ..stats import wilson

ROW_ALGORITHM = 1
"""Row-algorithm version of this control's ledgers (bumped whenever a row's bytes change)."""
ORDER_A, ORDER_B = "invariant", "invariant-attention-block-128"
"""The two fixed orders of the attention class compared at fixed precision (:func:`orders_row`)."""


@with_config(_CONFIG)
class CacheDrift(TypedDict):
    """Whole-cache difference of two boundary caches over the same IDs (every layer's keys and values)."""
    exact: bool  # every element bit-identical
    rel_l2: Float  # ||a - b|| / ||a||
    max_abs: Float
    n_diff: int  # elements that differ
    numel: int


@with_config(_CONFIG)
class AblationAnswer(TypedDict):
    """One greedy suffix from a boundary and its scored answer."""
    suffix: TokenIds
    margins: Margins
    answer_text: str
    predicted: str | None  # the answer letter, None when none was read
    correct: bool


@with_config(_CONFIG)
class AblationRow(TypedDict):
    """A row of a kernels value's ledger (:func:`ablation_row`): live vs prefill under that value."""
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


@with_config(_CONFIG)
class OrderPair(TypedDict):
    order_a: str
    order_b: str


@with_config(_CONFIG)
class OrdersRow(TypedDict):
    """A row of the two-orders ledger (:func:`orders_row`): A's live boundary vs B's cache over the same IDs."""
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

    Returns:
        the rows, as a list.

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


def _answer(lm: LoadedModel, fmt: BlockFormat, problem: Problem, suffix: decode.Suffix) -> dict:
    text = fmt.answer_prefix_text + cast(str, lm.tokenizer.decode(suffix.answer))
    score = score_answer(text, problem.answer, problem.options)
    return {"suffix": suffix.tokens, "margins": suffix.margins, "answer_text": text, "predicted": score.predicted,
            "correct": score.correct}


def ablation_row(lm: LoadedModel, fmt: BlockFormat, problem: Problem, caps: Caps) -> dict:
    """One problem under ``lm``'s kernels value: live vs prefill boundary and suffixes.

    Returns:
        ``{"problem_id", "kernels", "prefix" (token IDs of z), "drift" (whole-cache: exact, rel_l2, max_abs,
        n_diff, numel), "logits_exact", "live", "prefill" (each: suffix IDs, margins, answer text, predicted
        letter, correct), "diverged", "first_divergence" (suffix step or None), "tie_initiated" (either arm's
        margin exactly 0 there)}``.

    Raises:
        GateError: ``desync`` or ``nonfinite`` (the eager decoders' gates).
    """
    live = decode.decode_live(lm, fmt, fmt.prompt_ids(problem.question, problem.options), caps)
    pre = decode.build_prefill(lm, fmt, live.ids)
    common = _drift(live, pre)  # before the suffixes run from the caches
    a = decode.decode_suffix(lm, fmt, live, caps)
    b = decode.decode_suffix(lm, fmt, pre, caps)
    common |= _parted(a, b)
    return {
        "problem_id": problem.problem_id,
        "kernels": decode.kernels_of(lm),
        "prefix": live.ids,
        "drift": common["drift"],
        "logits_exact": common["logits_exact"],
        "live": _answer(lm, fmt, problem, a),
        "prefill": _answer(lm, fmt, problem, b),
        "diverged": common["diverged"],
        "first_divergence": common["first_divergence"],
        "tie_initiated": common["tie_initiated"],
    }


def _drift(x: decode.Boundary, y: decode.Boundary) -> dict:
    """Whole-cache drift of two boundaries (``y`` against ``x``) and whether their logits are bit-identical."""
    drift = aggregate(cache_drift(cache_tensors(x.cache), cache_tensors(y.cache)))
    return {"drift": {k: drift[k] for k in ("exact", "rel_l2", "max_abs", "n_diff", "numel")},
            "logits_exact": bool((x.logits == y.logits).all())}


def _parted(a: decode.Suffix, b: decode.Suffix) -> dict:
    """Where suffixes ``a`` and ``b`` first part (step or None) and whether an exact tie began it."""
    first = next((i for i, (s, t) in enumerate(zip(a.tokens, b.tokens)) if s != t), None)
    if first is None and len(a.tokens) != len(b.tokens):
        first = min(len(a.tokens), len(b.tokens))
    tie = first is not None and any(m is not None and m == 0.0 and i == first
                                    for s in (a, b) for i, m in enumerate(s.margins))
    return {"diverged": first is not None, "first_divergence": first, "tie_initiated": tie}


def orders_row(lm: LoadedModel, fmt: BlockFormat, problem: Problem, caps: Caps, order_a: str = ORDER_A,
               order_b: str = ORDER_B) -> dict:
    """Two fixed orders on one problem's IDs: A's live boundary against the cache B builds over the same IDs.

    Live decoding under ``order_a`` reaches the merge boundary ``z``; a prefill under ``order_b`` over ``z`` builds
    B's boundary (equal to B's live and incremental caches over ``z`` by construction). The caches are compared on
    every layer, and one suffix is decoded from each under its own order. ``lm.contract`` is restored on return.

    Returns:
        an :class:`OrdersRow`: ``kernels`` ``{"order_a", "order_b"}``, ``prefix`` (z), ``drift`` (B vs A),
        ``logits_exact``, ``order_a`` and ``order_b`` (suffix, margins, answer), ``diverged``, ``first_divergence``,
        ``tie_initiated``.

    Raises:
        GateError: ``desync`` or ``nonfinite`` (the eager decoders' gates).
    """
    base = lm.contract
    if base is None:
        raise ValueError("orders_row needs a model loaded under an execution contract (lm.contract)")
    try:
        lm.contract = dataclasses.replace(base, kernels=order_a)
        live = decode.decode_live(lm, fmt, fmt.prompt_ids(problem.question, problem.options), caps)
        lm.contract = dataclasses.replace(base, kernels=order_b)
        other = decode.build_prefill(lm, fmt, live.ids)
        common = _drift(live, other)  # before the suffixes run from the caches
        b = decode.decode_suffix(lm, fmt, other, caps)
        lm.contract = dataclasses.replace(base, kernels=order_a)
        a = decode.decode_suffix(lm, fmt, live, caps)
    finally:
        lm.contract = base
    common |= _parted(a, b)
    return {"problem_id": problem.problem_id, "kernels": {"order_a": order_a, "order_b": order_b}, "prefix": live.ids,
            "drift": common["drift"], "logits_exact": common["logits_exact"],
            "order_a": _answer(lm, fmt, problem, a), "order_b": _answer(lm, fmt, problem, b),
            "diverged": common["diverged"], "first_divergence": common["first_divergence"],
            "tie_initiated": common["tie_initiated"]}


def ablation_table(rows_by_value: Mapping[str, Sequence[Mapping[str, Any]]],
                   marked: Mapping[str, set[str]] | None = None) -> str:
    """A markdown table, one line per kernels value: rows, caches bit-identical, median (range) relative L2 of
    prefill vs live, suffixes parted (of those begun at an exact tie), live and prefill accuracy.

    ``marked`` (kernels value -> problem IDs) adds a last column: the rows a library that no commit has wrote, and
    how many of them part (:func:`kvreplay.report.provenance_pages.rows_of_unknown_libraries`)."""
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
        rel = [r["drift"]["rel_l2"] for r in rows]
        parted = sum(r["diverged"] for r in rows)
        ties = sum(r["tie_initiated"] for r in rows)
        lines.append(f"| `{value}` | {n} | {sum(r['drift']['exact'] for r in rows)}/{n} | "
                     f"{statistics.median(rel):.2e} [{min(rel):.2e}, {max(rel):.2e}] | {parted}/{n} ({ties}) | "
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

    Lines: order B's cache against order A's live cache over the same IDs (:func:`orders_row`). The default
    kernels' prefill against live (the ``default`` ledger, the same problems). The two orders' whole live
    decodings from the prompt (their ``kernels`` ledgers: boundary prefix and suffix compared, answers compared).
    Columns: rows, caches bit-identical, rel. L2 median [range], suffixes part (of them tie-initiated), answers differ.
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


@dataclasses.dataclass
class AblationLedgers:
    """A profile's committed ablation ledgers of one dtype, checked (:func:`load_ablation`).

    Attributes:
        by_value: kernels value -> its rows (:class:`AblationRow`), in :data:`kvreplay.kernels.KERNELS` order.
        orders: the two-orders rows (:class:`OrdersRow`), empty when there is no such ledger.
        folders: ledger name -> its folder.
    """
    by_value: dict[str, list[Any]]
    orders: list[Any]
    folders: dict[str, Path]


def load_ablation(root: str | Path, dtype: str) -> AblationLedgers:
    """Read and check every ablation ledger of ``dtype`` under ``root`` (``data/kernel_ablation/<profile>``).

    Checks, each failing closed: the manifest's schema version and config digest (the folder name ends with its
    first 12 hex digits, the digest is that of the config it holds). The kernels value the config names is the
    folder's and every row's. The row algorithm is :data:`ROW_ALGORITHM`. Rows parse, one per problem, and fit
    their record (:func:`check_rows`).

    Raises:
        LedgerError: a missing folder, a digest, schema, value or row-algorithm mismatch (naming the folder).
        LedgerLineError: a damaged line or a duplicated problem.
        RowSchemaError: a row that does not fit its record.
    """
    root = Path(root)
    if not root.is_dir():
        raise LedgerError(f"{root}: no ablation ledgers here (scripts/kernel_ablation.py writes them)")
    by_value: dict[str, list[Any]] = {}
    orders: list[Any] = []
    folders: dict[str, Path] = {}
    for folder in sorted(root.iterdir()):
        kind = folder.name.split("-", 1)[0]
        if not folder.is_dir() or kind not in ROW_TYPES or not folder.name.startswith(f"{kind}-{dtype}-"):
            continue
        manifest = read_manifest(folder)
        digest, config = manifest.get("config_digest", ""), manifest.get("config", {})
        if manifest.get("schema_version") != SCHEMA_VERSION or config_digest(config) != digest or \
                not folder.name.endswith("-" + digest[:12]):
            raise LedgerError(f"{folder}: its manifest's schema or config digest does not match the folder "
                              f"(digest {digest[:12]!r}); restore it from git")
        value = config.get("execution", {}).get("kernels", "default")
        name = folder.name[: -len(digest[:12]) - 1]
        want = f"kernels-{dtype}-{value}" if kind == "kernels" else f"orders-{dtype}-{ORDER_A}-vs-{ORDER_B}"
        if name != want or value not in KERNELS or config.get("dtype") != dtype:
            raise LedgerError(f"{folder}: its config names kernels {value!r} and dtype {config.get('dtype')!r}, "
                              f"which is not the folder {name!r}")
        algorithm = read_environment(folder).get("row_algorithm")
        if algorithm != ROW_ALGORITHM:
            raise LedgerError(f"{folder}: written by row algorithm {algorithm}, this code reads {ROW_ALGORITHM}")
        rows = check_rows(kind, [r.record for r in checked_rows(folder)])  # refuses rows a sampled check failed or awaits
        if kind == "kernels":
            wrong = [r["problem_id"] for r in rows if r["kernels"] != value]
            if wrong:
                raise LedgerError(f"{folder}: rows {wrong} were computed under other kernels than {value!r}")
            by_value[value] = rows
        else:
            orders = [r for r in rows if r["kernels"] == {"order_a": ORDER_A, "order_b": ORDER_B}]
            if len(orders) != len(rows):
                raise LedgerError(f"{folder}: rows of other orders than {ORDER_A!r} and {ORDER_B!r}")
        folders[name] = folder
    ordered = {v: by_value[v] for v in KERNELS if v in by_value}
    return AblationLedgers(ordered, orders, folders)


def ablation_frame(ledgers: AblationLedgers) -> pd.DataFrame:
    """One line per kernels value, then one for the two orders on the same IDs (when that ledger has rows).

    Columns: ``rows``; ``caches bit-identical`` (k/n); ``rel. L2 median`` and ``rel. L2 max`` (of the boundary
    caches: prefill vs live, or order B vs order A); ``suffixes part`` (k/n with its Wilson 95% interval);
    ``tie-initiated`` (of those parted); ``live correct`` and ``prefill correct`` (k/n; for the orders: order A's
    and order B's answers).
    """
    lines = {}
    items: list[tuple[str, list[Any], str, str]] = [(f"`{v}`: prefill vs live", rows, "live", "prefill")
                                                     for v, rows in ledgers.by_value.items() if rows]
    if ledgers.orders:
        items.append((f"`{ORDER_B}` vs `{ORDER_A}`, same IDs", ledgers.orders, "order_a", "order_b"))
    for label, rows, a, b in items:
        n = len(rows)
        rel = [r["drift"]["rel_l2"] for r in rows]
        parted = sum(r["diverged"] for r in rows)
        lines[label] = {"rows": n, "caches bit-identical": f"{sum(r['drift']['exact'] for r in rows)}/{n}",
                        "rel. L2 median": statistics.median(rel), "rel. L2 max": max(rel),
                        "suffixes part": wilson(parted, n).pct(),
                        "tie-initiated": f"{sum(r['tie_initiated'] for r in rows)}/{parted}",
                        "live (order A) correct": f"{sum(bool(r[a]['correct']) for r in rows)}/{n}",
                        "prefill (order B) correct": f"{sum(bool(r[b]['correct']) for r in rows)}/{n}"}
    return pd.DataFrame.from_dict(lines, orient="index")
