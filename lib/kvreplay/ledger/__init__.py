"""Ledgers: append-only, resumable records of every finished row, and how to find them (paper §3.9).

* :mod:`.store`: :class:`Ledger` (one experiment arm's folder: manifest,
  environment, ``rows.jsonl``, run log), :func:`run_rows` (map a per-row
  function over problems, appending each record), canonical JSON and digests,
  sealing (``rows.jsonl.gz``, ``python -m kvreplay.ledger seal``) and columnar parquet copies;
* :mod:`.records`: the layout of every kind of ledger row as typed records
  (``TypedDict``, checked with pydantic before a row is appended);
* :mod:`.row_parts`: the value types and nested records those rows hold;
* :mod:`.prefix_bank`: Experiment 1's BF16 boundary prefixes, frozen for
  Experiments 2-5;
* :mod:`.lookup`: a profile's ledgers found by provenance (no re-running);
* :mod:`.files`: atomic writes of small files, and rows, run logs and small files read back with every damaged
  line named by file, line and problem ID;
* :mod:`.lock`: one writer per ledger (an advisory lock named after its folder, same-host only);
* :mod:`.repair`: byte-identical duplicate rows dropped (``python -m kvreplay.ledger repair``);
* :mod:`.provenance`: the library digests that wrote a profile's ledgers and each run's compute seconds
  (``python -m kvreplay.ledger digests``).

The store's names are re-exported here.
"""

from .store import (
    READ_ONLY_ENV,
    SCHEMA_VERSION,
    TERMINAL_PROGRESS,
    Ledger,
    LedgerError,
    ReadOnlyLedgerError,
    canonical_json,
    LedgerLineError,
    config_digest,
    export_parquet,
    ledger_rows,
    library_digest,
    read_rows_text,
    rows_file,
    row_bar,
    row_lines,
    run_rows,
    seal,
    unseal,
)

__all__ = [
    "READ_ONLY_ENV", "SCHEMA_VERSION", "TERMINAL_PROGRESS", "Ledger", "LedgerError", "ReadOnlyLedgerError", "canonical_json", "config_digest", "export_parquet",
    "LedgerLineError", "ledger_rows", "library_digest", "read_rows_text", "rows_file", "row_bar", "row_lines", "run_rows", "seal", "unseal",
]
