"""Append-only, resumable ledgers (paper §3.9 reproducibility release).

A ledger is a folder ``data/ledgers/<profile>/<name>-<digest12>/`` keyed by the
scientific config (its sha256 is the digest):

- ``manifest.json``: schema version, the config and its digest, written once.
  ``environment.json`` beside it holds the execution contract (device, CPU
  kind and kernel ISA, torch and transformers versions, flags, model identity),
  the experiment's **row-algorithm version** and, for information, a hash of
  the library source. On reuse, a different row-algorithm version makes the
  ledger *stale* (its rows were computed by a different algorithm); a
  different execution contract prints "computed in another environment".
  Either may be read (tables regenerate from it); neither may be appended to,
  so rows of two algorithms or two environments never mix. A refactor that
  changes no bit of any row keeps the version, so it stales nothing.
- ``rows.jsonl``: one JSON record per finished row (per problem, holding all
  of that problem's arms), appended and flushed as each row finishes. A crash
  loses at most the row in flight (with row actors: the rows in flight and
  any finished after the first unfinished one, since rows are appended in
  order). A partial last line is cut off on resume.
- ``rows.jsonl.gz``: a *sealed* ledger's rows, the same bytes gzip-compressed
  (:func:`seal`; level 9, no name or time stamp in the header, so sealing is
  deterministic). Committed ledgers are sealed to keep the repository light.
  Every reader takes either form (:func:`read_rows_text`), and appending to a
  sealed ledger first restores ``rows.jsonl`` (:meth:`Ledger.append`).
- ``runlog.jsonl``: wall times and hosts (never in ``rows.jsonl``, so two runs
  of the same config on the same machine give byte-identical rows). Every event
  carries the ``library_sha256`` of the code that logged it, so a resumed run's
  library is on record; a run's ``end`` (or ``stopped``) event carries its
  compute seconds (``compute_s``).

Records are serialized with sorted keys and no whitespace variation.

One process writes a ledger at a time: :func:`run_rows` (and ``run_arm``, before it loads a model) holds the
ledger's writer lock (:mod:`.lock`, same-host only). The small files are written atomically and read back with
their path named on damage; a damaged row line is named by file, line and problem ID, and a problem ID recorded
twice is refused by every reader (:mod:`.files`; ``python -m kvreplay.ledger repair``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ..gates import GateError
from . import lock
from .files import MANIFEST_TODO, LedgerError, LedgerLineError, RowLine, atomic_write, cut_torn_tail, parse_rows, read_json

SCHEMA_VERSION = 1

_Item = TypeVar("_Item")

__all__ = ["LedgerError", "LedgerLineError", "RowLine"]  # re-exported from .files, with the names defined here


def canonical_json(obj) -> str:
    """Deterministic JSON: sorted keys, compact separators, UTF-8 kept."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=True)


def config_digest(config: dict) -> str:
    """sha256 of the canonical JSON of a scientific config."""
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()


ROWS = "rows.jsonl"
SEALED = "rows.jsonl.gz"


def read_rows_text(folder: str | Path) -> str:
    """The text of a ledger folder's rows, from ``rows.jsonl`` or, for a sealed ledger, ``rows.jsonl.gz``.

    Returns ``""`` when the folder has neither (no row finished yet). Both files holding the same rows (a seal or
    unseal killed between its two steps) read as those rows.

    Raises:
        LedgerError: both files exist and differ, or the sealed file does not decompress (naming it).
    """
    folder = Path(folder)
    plain, sealed = folder / ROWS, folder / SEALED
    if sealed.exists():
        data = _sealed_bytes(sealed)
        if plain.exists() and plain.read_bytes() != data:
            raise LedgerError(f"{folder} holds both {ROWS} and {SEALED} with different rows: keep the right one "
                              "(compare them; python -m kvreplay.ledger unseal after removing the wrong one)")
        return data.decode("utf-8")
    return plain.read_text(encoding="utf-8") if plain.exists() else ""


def _sealed_bytes(sealed: Path) -> bytes:
    """The rows inside ``rows.jsonl.gz``.

    Raises:
        LedgerError: it is not a whole gzip file (naming it).
    """
    try:
        return gzip.decompress(sealed.read_bytes())
    except (OSError, EOFError) as e:
        raise LedgerError(f"{sealed} does not decompress ({e}): a partial write; restore it (e.g. git checkout) "
                          "or delete the folder and run the arm again") from None


def rows_file(folder: str | Path) -> Path:
    """The file holding a ledger folder's rows: ``rows.jsonl.gz`` when sealed, else ``rows.jsonl``."""
    folder = Path(folder)
    return folder / (SEALED if (folder / SEALED).exists() else ROWS)


def ledger_rows(folder: str | Path, key: str | None = "problem_id") -> list[RowLine]:
    """A ledger folder's finished rows with their line numbers (:func:`~kvreplay.ledger.files.parse_rows`).

    Raises:
        LedgerLineError: a damaged line or a duplicated ``key``, naming file, line and problem ID.
        LedgerError: as :func:`read_rows_text`.
    """
    return parse_rows(read_rows_text(folder), rows_file(folder), key)


def row_lines(text: str) -> list[str]:
    """The rows of a ``rows.jsonl`` text, one JSON line each: split at ``\\n`` only, empty lines dropped.

    ``str.splitlines`` would also split at U+2028, U+0085 and the other Unicode line breaks, which
    :func:`canonical_json` writes raw inside strings (``ensure_ascii=False``), e.g. in a decoded suffix.
    """
    return [line for line in text.split("\n") if line]


def seal(folder: str | Path) -> Path:
    """Replace a ledger folder's ``rows.jsonl`` by ``rows.jsonl.gz`` (same bytes inside; deterministic output).

    Returns:
        the sealed file (unchanged if the folder is sealed already).

    The compressed file is written atomically before ``rows.jsonl`` is removed, so a kill at any point leaves
    ``rows.jsonl``, or both files with the same rows (which every reader takes, and which sealing again finishes).

    Raises:
        LedgerError: the folder has no rows, its last line is cut off (an unfinished write), or both files exist
            with different rows.
        LedgerLineError: a damaged line or a duplicated problem ID (naming file, line and ID).
        LedgerBusyError: another process is writing the ledger.
    """
    folder = Path(folder)
    plain, sealed = folder / ROWS, folder / SEALED
    lock.acquire(folder)
    try:
        if sealed.exists():
            read_rows_text(folder)  # refuses differing copies
            plain.unlink(missing_ok=True)  # same rows: finish an interrupted seal
            return sealed
        data = plain.read_bytes() if plain.exists() else b""
        if not data or not data.endswith(b"\n"):
            raise LedgerError(f"{plain}: {'no rows' if not data else 'a cut-off last line'}; nothing to seal")
        parse_rows(data.decode("utf-8"), plain)
        atomic_write(sealed, gzip.compress(data, compresslevel=9, mtime=0))
        if gzip.decompress(sealed.read_bytes()) != data:  # never lose a row to a bad write
            sealed.unlink()
            raise LedgerError(f"{sealed}: the compressed copy does not read back; {plain} kept")
        plain.unlink()
        return sealed
    finally:
        lock.release(folder)


def unseal(folder: str | Path) -> Path:
    """Restore a sealed ledger's ``rows.jsonl`` (to append to it); the inverse of :func:`seal`.

    ``rows.jsonl`` is written atomically before ``rows.jsonl.gz`` is removed; both files with the same rows (a
    seal or unseal killed between its two steps) are resolved by removing the compressed one.

    Raises:
        LedgerError: both files exist with different rows, or the compressed file does not decompress.
    """
    folder = Path(folder)
    plain, sealed = folder / ROWS, folder / SEALED
    if sealed.exists():
        data = read_rows_text(folder).encode("utf-8")  # refuses differing copies
        if not plain.exists():
            atomic_write(plain, data)
        sealed.unlink()
    return plain


def library_digest() -> str:
    """sha256 over the library's Python sources and formats (recorded for information; staleness is the row-algorithm version)."""
    root = Path(__file__).resolve().parent.parent  # the kvreplay package
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.suffix in {".py", ".yaml"} and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


READ_ONLY_ENV = "KV_LEDGERS_READ_ONLY"
"""Set to ``1`` (``make paper`` does, for a profile whose file lists ``done:``: one computed on a GPU across device
sessions), the ledger root is read, never written: :func:`kvreplay.runner.run_arm` computes no row (an arm with
any row left raises :class:`ReadOnlyLedgerError` before a model is loaded or a ledger folder created), and a frozen
panel (:meth:`kvreplay.notebook.session.Session.write_panel`) or the prefix bank
(:func:`kvreplay.ledger.prefix_bank.write_prefix_bank`) is left as it is when it already holds the same bytes and
refused when it would change or be created."""


class ReadOnlyLedgerError(RuntimeError):
    """Something under the ledger root would be computed or rewritten while :data:`READ_ONLY_ENV` is ``1``: an
    arm's rows (:func:`kvreplay.runner.run_arm`), a frozen panel or the prefix bank.

    Attributes:
        path: the ledger folder the arm's config names, or the panel or prefix bank file (it may not exist).
        todo: how many of the arm's rows no ledger holds (``None`` for a panel or the bank).
    """

    def __init__(self, path: Path, what: str, todo: int | None = None):
        self.path, self.todo = path, todo
        super().__init__(
            f"{path}: {what}, and {READ_ONLY_ENV}=1 (make paper on a profile computed on a GPU, whose file lists "
            "`done:`) forbids that here. A profile file or notebook parameters that changed a ledger key or a "
            "panel do this: undo that change, or compute the rows with scripts/gpu_profile.py.")


def unchanged_when_read_only(files: dict[Path, str | bytes], what: str) -> bool:
    """Whether a writer under the ledger root may skip its write because :data:`READ_ONLY_ENV` is ``1`` and every
    file of ``files`` (path -> the content it would get) already holds that content. ``False`` when not read-only
    (the caller writes).

    Raises:
        ReadOnlyLedgerError: read-only, and a file would be changed, or created (the first one missing).
    """
    if os.environ.get(READ_ONLY_ENV) != "1":
        return False
    if all(p.is_file() and (p.read_bytes() if isinstance(c, bytes) else p.read_text()) == c for p, c in files.items()):
        return True
    raise ReadOnlyLedgerError(next(iter(files)), f"{what} would be " + (
        "changed" if next(iter(files)).is_file() else "created"))


class Ledger:
    """One experiment's append-only ledger for one scientific config.

    Args:
        root: ``data/ledgers/<profile>`` (created if missing).
        name: experiment and arm label, e.g. ``"exp1-bfloat16"``.
        config: the scientific config (profile parameters, digests, dtype,
            caps, contract flags); it decides the folder.
        environment: the execution contract, stored beside the manifest.
        key: record field that identifies a row (default ``problem_id``).
        row_algorithm: the experiment's row-algorithm version (an int bumped
            whenever a golden row's bytes change); ``None`` when only reading.

    Attributes:
        stale: ``["row_algorithm"]`` when the ledger was written by another
            row-algorithm version (or records none), else empty.
        other_environment: the execution-contract fields that differ from
            when the ledger was written (e.g. ``device_name``,
            ``cpu_capability``, ``torch``); empty when they agree or when no
            environment was given. A stale ledger, or one computed in another
            environment, may be read but :func:`run_rows` refuses to append to it.

    Raises:
        LedgerError: if the folder holds a manifest for another config.
    """
    @staticmethod
    def folder(root: str | Path, name: str, config: dict) -> Path:
        """Where the ledger of this name and config lives (nothing is created)."""
        return Path(root) / f"{name}-{config_digest(config)[:12]}"

    def __init__(self, root: str | Path, name: str, config: dict, environment: dict | None = None, key: str = "problem_id",
                 row_algorithm: int | None = None):
        self.config = config
        self.digest = config_digest(config)
        self.name = name
        self.key = key
        self.dir = self.folder(root, name, config)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rows_path = self.dir / ROWS
        manifest = {"schema_version": SCHEMA_VERSION, "name": name, "config_digest": self.digest, "config": config}
        mpath = self.dir / "manifest.json"
        text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
        if mpath.exists() and not mpath.read_text(encoding="utf-8").strip():
            # an empty manifest (a full disk or a kill before the first write): derivable from the folder's key
            warnings.warn(f"{mpath} was empty (an interrupted write); rebuilt from the config that keys the folder")
            atomic_write(mpath, text)
        if mpath.exists():
            old = read_json(mpath, MANIFEST_TODO)
            if old.get("config_digest") != self.digest:
                raise LedgerError(f"{mpath} belongs to config {old.get('config_digest')}, not {self.digest}")
            if old.get("schema_version") != SCHEMA_VERSION:
                raise LedgerError(f"{mpath} has schema {old.get('schema_version')}, this code writes {SCHEMA_VERSION}")
        else:
            atomic_write(mpath, text)
        self.library = library_digest()
        env = {"execution_contract": environment or {}, "library_sha256": self.library, "row_algorithm": row_algorithm}
        epath = self.dir / "environment.json"
        self.stale: list[str] = []
        self.other_environment: list[str] = []
        if epath.exists() and environment is not None and not epath.read_text(encoding="utf-8").strip() and not (
                (self.dir / ROWS).exists() or (self.dir / SEALED).exists()):
            warnings.warn(f"{epath} was empty (an interrupted write) and no row was written; rebuilt")
            epath.unlink()
        if epath.exists():
            old_env = read_json(epath, "it records the environment the rows were computed in: restore it (e.g. git "
                                       "checkout), or delete the ledger folder and run the arm again")
            if row_algorithm is not None and old_env.get("row_algorithm") != row_algorithm:
                self.stale = ["row_algorithm"]
                warnings.warn(f"ledger {self.dir.name} is stale: written by row algorithm "
                              f"{old_env.get('row_algorithm')}, this code computes version {row_algorithm}")
            if environment is not None:
                old_c = old_env.get("execution_contract", {})
                self.other_environment = sorted(k for k in set(old_c) | set(environment) if old_c.get(k) != environment.get(k))
                if self.other_environment:
                    warnings.warn(f"ledger {self.dir.name} was computed in another environment "
                                  f"({', '.join(self.other_environment)} differ)")
        elif environment is not None:
            atomic_write(epath, json.dumps(env, indent=1, sort_keys=True) + "\n")
        self._done: set[str] | None = None
        self._seen = -1  # the size of rows.jsonl when done keys were last read
        self._repair()

    def _repair(self) -> None:
        """Cut a partial trailing line left by a crash mid-write (only while holding the writer lock, or with
        no other writer: a reader never cuts the line another process is writing)."""
        if lock.lock_path(self.dir) in lock.held():
            cut_torn_tail(self.rows_path)

    def records(self) -> list[Any]:
        """All finished records, in the order they were appended (parsed JSON; typed ``Any``, since which record of
        :mod:`kvreplay.ledger.records` they are depends on the ledger's experiment).

        Raises:
            LedgerLineError: a damaged line or a duplicated key (naming file, line and problem ID).
        """
        return [r.record for r in ledger_rows(self.dir, self.key)]

    def done_keys(self) -> set[str]:
        """The keys of the finished records, re-read whenever ``rows.jsonl`` changed size since last read (rows
        appended by another process)."""
        size = self.rows_path.stat().st_size if self.rows_path.exists() else -1
        if self._done is None or size != self._seen:
            self._done = {r[self.key] for r in self.records()}
            self._seen = size
        return self._done

    def append(self, record: Mapping[str, Any]) -> None:
        """Append one finished record and flush it to disk (holding the writer lock meanwhile).

        Raises:
            LedgerError: if a record with the same key is already present (re-read from disk).
            LedgerBusyError: another process holds the ledger's writer lock.
        """
        lock.acquire(self.dir)
        try:
            unseal(self.dir)  # a sealed ledger takes more rows as rows.jsonl again
            cut_torn_tail(self.rows_path)
            done = self.done_keys()  # re-read only if another process changed the file since this one last did
            if record[self.key] in done:
                raise LedgerError(f"{self.rows_path}: {self.key}={record[self.key]} already recorded")
            line = canonical_json(record) + "\n"
            with open(self.rows_path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            # the writer lock is held: the file is what was read plus this line, so the keys are updated in place
            # (re-reading it after every append made a run's appends quadratic in its rows)
            done.add(record[self.key])
            self._seen = self.rows_path.stat().st_size
        finally:
            lock.release(self.dir)

    def log(self, **event) -> None:
        """Append a wall-time/host event to ``runlog.jsonl`` (not part of the ledger bytes).

        Every event gets ``time``, ``host`` and ``library_sha256`` (:func:`library_digest` of the code logging it).
        """
        event.setdefault("time", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        event.setdefault("host", platform.node())
        event.setdefault("library_sha256", self.library)
        path = self.dir / "runlog.jsonl"
        cut_torn_tail(path)  # an event cut off by a crash is dropped, not continued on its line
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(event, sort_keys=True) + "\n")

    def complete(self, keys: Iterable[str]) -> bool:
        """True when every key has a record."""
        return set(keys) <= self.done_keys()


TERMINAL_PROGRESS = "KVREPLAY_TERMINAL_PROGRESS"
"""Environment variable: when ``1`` (``make paper`` sets it for its kernels), row bars are also drawn on the
process's own stderr, i.e. the terminal that runs ``make paper``, not only in the notebook."""


class _Bars:
    """Several tqdm bars updated together (the notebook's and the terminal's)."""

    def __init__(self, bars):
        self.bars = bars

    def update(self, n: int = 1) -> None:
        for b in self.bars:
            b.update(n)

    def close(self) -> None:
        for b in self.bars:
            b.close()


def row_bar(total: int, done: int, desc: str, progress: bool = True):
    """A progress bar over ``total`` rows of which ``done`` are already in the ledger.

    With nothing left to compute it draws no bar and prints one line (``desc: n/n rows in the
    ledger, none computed``). Otherwise a tqdm bar (a widget in a notebook), and, when
    :data:`TERMINAL_PROGRESS` is ``1``, a text bar on ``sys.__stderr__`` as well.

    Returns:
        an object with ``update(n)`` and ``close()``.
    """
    if not progress:
        return _Bars([])
    if done >= total:
        print(f"{desc}: {done}/{total} rows in the ledger, none computed")
        return _Bars([])
    from tqdm.auto import tqdm

    bars = [tqdm(total=total, initial=done, desc=desc, unit="row")]
    if os.environ.get(TERMINAL_PROGRESS) == "1" and sys.__stderr__ is not None:
        from tqdm.std import tqdm as text_tqdm

        bars.append(text_tqdm(total=total, initial=done, desc=f"   {desc}", unit="row", file=sys.__stderr__, leave=True))
    return _Bars(bars)


def run_rows(
    ledger: Ledger,
    items: list[_Item],
    row_fn: Callable[[_Item], Mapping[str, Any]] | None,
    *,
    key: Callable[[_Item], str],
    preflight: int = 0,
    progress: bool = True,
    desc: str = "rows",
    mapper: Callable[[list[_Item]], Iterable[Mapping[str, Any]]] | None = None,
    validate: Callable[[Mapping[str, Any]], object] | None = None,
    started: float | None = None,
) -> list[Any]:
    """Map a pure per-row function over items in frozen order, appending each record.

    Rows already in the ledger are skipped (resume). A record whose
    ``gate_failure`` is set is kept, and the run goes on; but if it is one of
    the first ``preflight`` items the whole arm is aborted.

    Args:
        row_fn: item -> record, run in this process (ignored when ``mapper`` is given).
        mapper: items -> records *in the same order*, e.g. the mapper of
            :class:`kvreplay.runner.actors.RowActors` computing rows on Ray
            actors. Records are appended in item order as they arrive, so
            the ledger's bytes equal a sequential run's, and an interrupted
            parallel run resumes like a sequential one. Preflight rows are
            mapped (and checked) before any other row is started.
        validate: record -> record, raising on a record that does not fit
            its schema (the experiment's row type,
            :func:`kvreplay.ledger.records.validate_row`); called before each
            append, so such a record is never written.
        started: ``time.perf_counter()`` when the arm's run began (model load, compiles and graph capture
            included); default: this call. The run log's ``end`` event, or ``stopped`` when an exception
            ends the run, records the seconds since then as ``compute_s``.

    Returns:
        The ledger's records for ``items``, in item order.

    Raises:
        GateError: gate ``preflight`` when a preflight row fails a gate.
        RowSchemaError: (from ``validate``) a record that does not fit its row type; the rows before it stay.
        LedgerBusyError: another process is writing this ledger (:mod:`.lock`).
        LedgerError: if rows remain to compute in a stale ledger or one
            computed in another environment (rows of two algorithms or two
            environments would mix); delete the folder, or set
            ``KVREPLAY_ALLOW_STALE=1`` to append anyway.
    """
    lock.acquire(ledger.dir)  # one writer per ledger, released when the run ends
    try:
        return _run_rows(ledger, items, row_fn, key=key, preflight=preflight, progress=progress, desc=desc,
                         mapper=mapper, validate=validate, started=started)
    finally:
        lock.release(ledger.dir)


def _run_rows(ledger: Ledger, items: list[_Item], row_fn: Callable[[_Item], Mapping[str, Any]] | None, *,
              key: Callable[[_Item], str], preflight: int, progress: bool, desc: str,
              mapper: Callable[[list[_Item]], Iterable[Mapping[str, Any]]] | None,
              validate: Callable[[Mapping[str, Any]], object] | None, started: float | None) -> list[Any]:
    """:func:`run_rows` under the ledger's writer lock."""
    ledger._repair()
    done: dict[str, Any] = {r[ledger.key]: r for r in ledger.records()}
    todo = [it for it in items if key(it) not in done]
    if todo and done and (ledger.stale or ledger.other_environment) and os.environ.get("KVREPLAY_ALLOW_STALE") != "1":
        why = ("by another row-algorithm version" if ledger.stale
               else f"in another environment ({', '.join(ledger.other_environment)} differ)")
        raise LedgerError(
            f"{ledger.dir}: {len(done)} rows were computed {why}; refusing to add {len(todo)} rows from this "
            f"code and environment. Delete the folder to recompute, or set KVREPLAY_ALLOW_STALE=1."
        )
    if mapper is None:
        if row_fn is None:
            raise ValueError("run_rows needs row_fn or mapper")
        mapper = lambda its: (row_fn(it) for it in its)  # noqa: E731
    ledger.log(event="start", rows=len(items), todo=len(todo), mapper=type(mapper).__name__)

    def check_preflight(i, k):
        rec = done[k]
        if i < preflight and rec.get("gate_failure"):
            f = rec["gate_failure"]
            raise GateError("preflight", f"preflight row {k} failed gate {f['gate']!r}: {f['reason']}; arm aborted")

    bar = row_bar(len(items), len(items) - len(todo), desc, progress)
    position = {key(it): i for i, it in enumerate(items)}
    began = time.perf_counter() if started is None else started
    try:
        for i, it in enumerate(items[:preflight]):  # preflight rows already in the ledger
            if key(it) in done:
                check_preflight(i, key(it))
        first = [it for it in todo if position[key(it)] < preflight]
        for chunk in (first, todo[len(first):]):
            if not chunk:
                continue
            t0 = time.perf_counter()
            for it, rec in zip(chunk, mapper(chunk), strict=True):
                k = key(it)
                if rec.get(ledger.key) != k:
                    raise LedgerError(f"{ledger.dir}: the mapper returned row {rec.get(ledger.key)!r} where {k!r} was due")
                if validate is not None:
                    validate(rec)
                ledger.append(rec)
                ledger.log(event="row", key=k, seconds=round(time.perf_counter() - t0, 3))
                t0 = time.perf_counter()
                done[k] = rec
                bar.update(1)
                check_preflight(position[k], k)
    except BaseException as e:  # a gate, a deadline or an interrupt: the run's compute time stays on record
        ledger.log(event="stopped", error=type(e).__name__, compute_s=round(time.perf_counter() - began, 3))
        raise
    bar.close()
    ledger.log(event="end", compute_s=round(time.perf_counter() - began, 3))
    return [done[key(it)] for it in items]


def _flat_scalars(obj, prefix: str = "") -> dict:
    """Scalar leaves of nested dicts as ``a.b.c`` columns; lists (token IDs, per-tensor rows) are left out."""
    out: dict = {}
    for k, v in obj.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat_scalars(v, name + "."))
        elif not isinstance(v, list):
            out[name] = v
    return out


def export_parquet(folder: str | Path) -> list[Path]:
    """Columnar copies of a ledger for analysis: ``rows.parquet`` and ``tensors.parquet``.

    ``rows.parquet`` has one row per record with every scalar leaf as a
    column (``boundary.prefill_vs_live.cache.rel_l2``, ``endpoints.suffix_differs``,
    ...; token-ID lists are left out). ``tensors.parquet`` has one row per
    record, comparison and cache tensor with the per-tensor drift summary.
    Both are derived from the rows (``rows.jsonl``, or ``rows.jsonl.gz`` when
    sealed) and rewritten on every call; the rows stay the ledger of record.

    Returns:
        the paths written.
    """
    import pandas as pd

    folder = Path(folder)
    records = [r.record for r in ledger_rows(folder)]
    rows = pd.DataFrame([_flat_scalars(r) for r in records])
    tensors = pd.DataFrame([
        {"problem_id": r["problem_id"], "comparison": comp, **{k: v for k, v in t.items() if not isinstance(v, dict)}}
        for r in records for comp, c in (r.get("boundary") or {}).items() for t in c.get("tensors", [])
    ])
    out = []
    for name, df in (("rows", rows), ("tensors", tensors)):
        if len(df):
            path = folder / f"{name}.parquet"
            df.to_parquet(path, index=False)
            out.append(path)
    return out


