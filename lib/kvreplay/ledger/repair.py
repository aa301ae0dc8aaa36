"""``python -m kvreplay.ledger repair FOLDER...``: drop the duplicated rows two writers left in a ledger.

Two processes appending to one ledger without the writer lock (:mod:`.lock`; an older version of this code, or
two hosts on a network file system) can record one problem twice. Every reader refuses such a ledger, naming
file, line and problem ID. :func:`repair` keeps the first line of each problem ID and drops later lines that are
byte-identical to it; a problem ID whose lines differ is refused (which row is right cannot be told from the
ledger: recompute it, ``make verify``). The new rows are written atomically, sealed again when they were sealed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from . import lock
from .files import LedgerError, atomic_write, parse_rows
from .store import ROWS, SEALED, read_rows_text, rows_file, seal, unseal


@dataclasses.dataclass(frozen=True)
class Repaired:
    """What :func:`repair` did to one ledger folder.

    Attributes:
        folder: the ledger folder.
        rows: finished rows kept.
        dropped: line numbers (1-based) dropped as byte-identical duplicates.
    """
    folder: Path
    rows: int
    dropped: tuple[int, ...]


def repair(folder: str | Path) -> Repaired:
    """Drop byte-identical duplicate rows of a ledger folder, keeping each problem ID's first line.

    A torn last line is left as it is (the next run of the arm cuts and recomputes it). Holds the ledger's writer
    lock meanwhile.

    Raises:
        LedgerError: a problem ID whose lines differ (naming file, both lines and the ID); the file is unchanged.
        LedgerLineError: a line that is not JSON (naming file, line and problem ID).
        LedgerBusyError: another process is writing the ledger.
    """
    folder = Path(folder)
    lock.acquire(folder)
    try:
        source = rows_file(folder)
        sealed = source.name == SEALED
        text = read_rows_text(folder)
        body, _, torn = text.rpartition("\n")
        kept: dict[object, tuple[int, str]] = {}
        lines: list[str] = []
        dropped: list[int] = []
        for row in parse_rows(body + "\n" if body else "", source, key=None):
            k = row.record.get("problem_id")
            if k in kept:
                first, first_text = kept[k]
                if first_text != row.text:
                    raise LedgerError(f"{source}: problem {k!r} is recorded on lines {first} and {row.number} with "
                                      "different bytes; repair drops only identical copies. Recompute the row to "
                                      "tell which is right (make verify), then delete the wrong line by hand")
                dropped.append(row.number)
                continue
            kept[k] = (row.number, row.text)
            lines.append(row.text)
        if dropped:
            if sealed:
                unseal(folder)
            atomic_write(folder / ROWS, "".join(x + "\n" for x in lines) + torn)
            if sealed:
                seal(folder)
        return Repaired(folder, len(lines), tuple(dropped))
    finally:
        lock.release(folder)


def describe(r: Repaired) -> str:
    """One line for the command: rows kept and lines dropped."""
    if not r.dropped:
        return f"{r.folder}: {r.rows} rows, no duplicate"
    return f"{r.folder}: {r.rows} rows kept, {len(r.dropped)} duplicate line(s) dropped: {json.dumps(list(r.dropped))}"
