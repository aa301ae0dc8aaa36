"""A ledger folder's rows as every reader takes them: the manifest matches the folder, every row fits its schema,
and no row is read as clean before the sampled float32 check that covers it has passed.

The sampled check's record lives in the folder's run log (``runlog.jsonl``, kept by sealing and packing). Before
the first row of a chunk is appended, an :data:`PENDING_EVENT` event names the chunk's rows. Once the chunk's check
has run, an :data:`SAMPLE_EVENT` event names them again with ``passed`` true or false
(:func:`kvreplay.runner.row_checks.sampled_equivalence`). A row is

* ``passed``: a later passing check names it;
* ``pending``: a pending event names it and no check passed since (a kill, Ctrl-C or crash before its chunk's
  check): refused by readers, re-checked by the arm's next run;
* ``failed``: a failed check names it: refused by readers and by the arm;
* unlabelled: no event names it (a float32 arm, a row checked inside itself, or a library without the sampled
  check, which :func:`sampled_check_labels` names).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .files import LedgerFileError, LedgerLineError, RowLine, read_environment, read_log, read_manifest

PENDING_EVENT = "equivalence_pending"
"""Run-log event naming a chunk's rows before the first is appended (``rows``: their problem IDs)."""

SAMPLE_EVENT = "equivalence_sample"
"""Run-log event of a chunk's sampled float32 check (``passed``, ``checks``, ``rows``)."""


class MissingLedgerError(FileNotFoundError):
    """A ledger the assembly needs is absent, unfinished or ambiguous, or a folder is not a ledger yet; the message
    names what to run (re-exported by :mod:`kvreplay.ledger.lookup`)."""


class UncheckedRowError(LedgerLineError):
    """A row whose sampled float32 check failed, or has not run yet; ``status`` is ``failed`` or ``pending``."""

    def __init__(self, path: Path, line: int, problem_id: str, status: str):
        self.status = status
        what = ("its chunk's sampled float32 construction-equivalence check failed (run log): the row may come from "
                "a broken construction; fix it, delete the folder and run the arm again") if status == "failed" else (
                "its chunk's sampled float32 construction-equivalence check has not run (the run stopped before it): "
                "run the arm's command again, which checks it before any new row")
        super().__init__(path, line, problem_id, what)


def check_status(events: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Problem ID -> ``passed``, ``pending`` or ``failed`` from a run log's events, in order (failed stays failed)."""
    status: dict[str, str] = {}
    for e in events:
        kind, rows = e.get("event"), e.get("rows")
        if kind not in (PENDING_EVENT, SAMPLE_EVENT) or not isinstance(rows, list):
            continue
        for pid in rows:
            if status.get(pid) == "failed":
                continue
            if kind == PENDING_EVENT:
                status[pid] = "pending"
            else:
                status[pid] = "passed" if e.get("passed") is True else "failed"
    return status


def covered_rows(events: Iterable[Mapping[str, Any]]) -> set[str]:
    """Problem IDs a passing sampled check covers: those :func:`check_status` reads as ``passed``. For a library that
    logged passing :data:`SAMPLE_EVENT` events without naming their rows, also the chunk each checked (the rows
    logged since the run's ``start`` or the previous sample event) and the rows its ``checks`` name. Used by the
    provenance tables; readers go by :func:`check_status` alone."""
    events = list(events)
    covered = {k for k, v in check_status(events).items() if v == "passed"}
    chunk: list[str] = []
    for event in events:
        kind = event.get("event")
        if kind == "start":
            chunk = []
        elif kind == "row" and (key := event.get("key") or event.get("problem_id")):
            chunk.append(key)
        elif kind == SAMPLE_EVENT:
            if event.get("passed") is True and not isinstance(event.get("rows"), list):
                covered.update(chunk, (c.get("problem_id") for c in event.get("checks", [])))
            chunk = []
    return covered


def ledger_key(manifest: Mapping[str, Any]) -> str:
    """The folder name a manifest keys: ``<name>-<config_digest[:12]>``."""
    return f"{manifest.get('name')}-{str(manifest.get('config_digest'))[:12]}"


def checked_manifest(folder: str | Path) -> dict:
    """A ledger folder's manifest, checked against the folder it sits in and the schema this code reads.

    Raises:
        MissingLedgerError: no manifest (a FileNotFoundError).
        LedgerFileError: a damaged manifest; or one whose ``schema_version`` is not this code's, whose config does
            not hash to its ``config_digest``, or whose name and digest are not the folder's key (another arm's
            manifest), naming the file and the field.
    """
    from .store import SCHEMA_VERSION, config_digest

    folder = Path(folder)
    path = folder / "manifest.json"
    if not path.is_file():
        raise MissingLedgerError(f"{folder} is not a ledger yet (no manifest.json: its arm stopped before writing it, "
                                 "or the folder is not a ledger); run the arm's command again, or delete the folder")
    m = read_manifest(folder)
    todo = "restore it (e.g. git checkout), or delete the ledger folder and run the arm again"
    if not isinstance(m, dict) or not isinstance(m.get("config"), dict):
        raise LedgerFileError(path, f"{path}: field 'config' is missing or not an object; {todo}")
    if m.get("schema_version") != SCHEMA_VERSION:
        raise LedgerFileError(path, f"{path}: field 'schema_version' is {m.get('schema_version')!r}, this code reads "
                                    f"schema {SCHEMA_VERSION}; {todo}")
    if config_digest(m["config"]) != m.get("config_digest"):
        raise LedgerFileError(path, f"{path}: field 'config_digest' {m.get('config_digest')!r} is not the sha256 of "
                                    f"its 'config'; {todo}")
    if ledger_key(m) != folder.name:
        raise LedgerFileError(path, f"{path}: fields 'name' and 'config_digest' key folder {ledger_key(m)!r}, not "
                                    f"{folder.name!r} (another arm's manifest); {todo}")
    return m


def checked_rows(folder: str | Path, *, pending: bool = False) -> list[RowLine]:
    """A ledger folder's finished rows, each checked: manifest (:func:`checked_manifest`), schema and sampled check.

    Args:
        pending: keep rows whose sampled check has not run (the arm's resume re-checks them); readers leave it off.

    Raises:
        LedgerFileError: as :func:`checked_manifest`.
        LedgerLineError: a damaged line, a duplicated problem ID, a row without a string ``problem_id``, or one that
            does not fit the schema of the manifest's experiment (naming file, line, problem ID and field).
        UncheckedRowError: a row whose sampled check failed, or (unless ``pending``) has not run.
    """
    from .records import ROW_TYPES, RowSchemaError, validate_row
    from .store import ledger_rows, rows_file

    folder = Path(folder)
    manifest = checked_manifest(folder)
    experiment = manifest["config"].get("experiment")  # the schema the manifest names (every arm's config does)
    rows = ledger_rows(folder)
    source = rows_file(folder)
    status = check_status(read_log(folder / "runlog.jsonl"))
    for r in rows:
        pid = r.record.get("problem_id")
        if not isinstance(pid, str):
            raise LedgerLineError(source, r.number, None, f"field 'problem_id' is {'missing' if pid is None else pid!r}"
                                  f"; a row needs its problem ID (a hand-edited or damaged line)")
        if experiment in ROW_TYPES:
            try:
                validate_row(experiment, r.record)
            except RowSchemaError as e:
                raise LedgerLineError(source, r.number, pid, f"field {e.path!r} does not fit the {experiment} row "
                                      f"schema ({e.errors[0].get('msg') if e.errors else e})") from None
        state = status.get(pid)
        if state == "failed" or (state == "pending" and not pending):
            raise UncheckedRowError(source, r.number, pid, state)
    return rows


def pending_rows(folder: str | Path) -> set[str]:
    """The problem IDs of a folder's rows whose sampled check has not run (:func:`check_status`)."""
    return {k for k, v in check_status(read_log(Path(folder) / "runlog.jsonl")).items() if v == "pending"}


NOT_RUN = "sampled check not run"
"""The start of the label of a row below float32 that no sampled check covers (:func:`sampled_check_labels`)."""

UNRECORDED = "sampled check ran, its rows not recorded"
"""The label's start where the library logged passing checks without naming the rows each covered."""


def sampled_check_labels(folder: str | Path, records: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Problem ID -> ``"sampled check not run (library <digest12>)"`` (or :data:`UNRECORDED`) for each row of an arm below float32 that
    carries a boundary ``prefix``, no gate failure and no in-row ``equivalence`` check, and that no sampled check
    covers: rows written by a library without the check (or by Ray row actors, which do not take it). The digest is
    the library that logged the row (its ``row`` event), else the folder's ``environment.json``."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest.get("config", {}).get("dtype") == "float32":
        return {}
    events = read_log(folder / "runlog.jsonl")
    covered = check_status(events)
    by_row = {e.get("key"): e.get("library_sha256") for e in events if e.get("event") == "row"}
    default = read_environment(folder).get("library_sha256") or "unknown"
    # a library that logged passing checks without naming their rows: the check ran, which rows it covered is unknown
    what = UNRECORDED if any(e.get("event") == SAMPLE_EVENT and "rows" not in e for e in events) else NOT_RUN
    return {r["problem_id"]: f"{what} (library {str(by_row.get(r['problem_id']) or default)[:12]})"
            for r in records if r.get("prefix") and not r.get("gate_failure") and not r.get("equivalence")
            and r["problem_id"] not in covered}
