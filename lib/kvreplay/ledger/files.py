"""A ledger folder's files read and written so that a crash, a full disk or a damaged line is named, never silent.

* :func:`atomic_write`: a small file (manifest, environment, panel, pointer, sealed rows) written to a temporary
  file beside it, flushed, fsynced and renamed over it, so a reader sees the old bytes or the new, never a part;
* :func:`read_json`: such a file read back; an empty or partial one (left by an older version or a crash) raises
  :class:`LedgerFileError` naming its path and what to do, never a bare ``JSONDecodeError``;
* :func:`parse_rows`: a ledger's rows text parsed line by line; a line that is not a JSON object, or a problem ID
  seen twice, raises :class:`LedgerLineError` naming the file, the line (1-based) and the problem ID where known;
* :func:`read_log`: a run log (``runlog.jsonl``) read the same way.

A *torn last line* (text after the last ``\\n``) is a row still being written, or cut off by a crash. Every reader
leaves it out (with a warning naming file and line); the writer cuts it before appending
(:class:`kvreplay.ledger.store.Ledger`); ``seal`` refuses it. A row is finished when its newline is on disk.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any


class LedgerError(RuntimeError):
    """A ledger cannot be opened or appended to as requested."""


class LedgerFileError(LedgerError):
    """A ledger's small file (manifest, environment, panel, pointer) is empty or not JSON.

    Attributes:
        path: the file.
    """

    def __init__(self, path: Path, message: str):
        self.path = path
        super().__init__(message)


class LedgerLineError(LedgerError):
    """A line of a ledger's rows or run log that cannot be read: not JSON, not an object, or a duplicated key.

    Attributes:
        path: the file (``rows.jsonl``, ``rows.jsonl.gz`` or ``runlog.jsonl``).
        line: the line's number, 1-based.
        problem_id: the row's problem ID where it can be read, else ``None``.
    """

    def __init__(self, path: Path, line: int, problem_id: str | None, what: str):
        self.path, self.line, self.problem_id = path, line, problem_id
        where = f"{path}:{line}" + (f" (problem {problem_id})" if problem_id is not None else "")
        super().__init__(f"{where}: {what}")


REPAIR_HINT = "python -m kvreplay.ledger repair FOLDER drops byte-identical duplicates"
"""What a duplicated-row error tells the user to run."""


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (text is UTF-8) to ``path`` so that ``path`` holds the old bytes or the new, never a part.

    The bytes go to ``.<name>.tmp-<pid>`` in the same folder, are flushed and fsynced, then renamed over ``path``
    (and the folder fsynced). On any error (``ENOSPC`` included) the temporary file is removed and ``path`` is
    left as it was.

    Raises:
        OSError: the write, the fsync or the rename failed (``path`` unchanged).
    """
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(folder: Path) -> None:
    """fsync a folder so that a rename in it is on disk (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems refuse fsync on a folder
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.EACCES):
            raise
    finally:
        os.close(fd)


def read_json(path: str | Path, todo: str) -> Any:
    """A small JSON file, with an empty or partial file reported as :class:`LedgerFileError`.

    Args:
        todo: what the user should do about a damaged file (e.g. "delete the ledger folder and run the arm again").

    Raises:
        FileNotFoundError: no such file.
        LedgerFileError: the file is empty or not JSON (naming its path, the line and column, and ``todo``).
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise LedgerFileError(path, f"{path} is empty ({len(text.encode())} bytes), left by an interrupted write "
                                    f"(a full disk or a kill); {todo}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise LedgerFileError(path, f"{path} is not JSON (line {e.lineno}, column {e.colno}: {e.msg}), a partial write "
                                    f"left by a crash or an older version; {todo}") from None


MANIFEST_TODO = ("restore it (e.g. git checkout), or delete the ledger folder and run the arm again (an empty one is "
                 "rebuilt by the arm's command, from the config that keys the folder)")
ENVIRONMENT_TODO = ("it records the environment the rows were computed in: restore it (e.g. git checkout), or delete "
                    "the ledger folder and run the arm again")


def read_manifest(folder: str | Path) -> Any:
    """A ledger folder's ``manifest.json`` (:func:`read_json`: a damaged one names its path and what to do)."""
    return read_json(Path(folder) / "manifest.json", MANIFEST_TODO)


def read_environment(folder: str | Path) -> Any:
    """A ledger folder's ``environment.json``, ``{}`` when it has none (:func:`read_json` on damage)."""
    path = Path(folder) / "environment.json"
    return read_json(path, ENVIRONMENT_TODO) if path.is_file() else {}


_ID = re.compile(r'"problem_id":"((?:[^"\\]|\\.)*)"')


def _guess_id(line: str) -> str | None:
    """The problem ID of a damaged row line, where its text still holds one."""
    m = _ID.search(line)
    if m is None:
        return None
    try:
        return json.loads(f'"{m.group(1)}"')
    except json.JSONDecodeError:
        return m.group(1)


@dataclasses.dataclass(frozen=True)
class RowLine:
    """One finished row of a ledger: its line number (1-based), its text (no newline) and its parsed record."""
    number: int
    text: str
    record: Any


def parse_rows(text: str, source: str | Path, key: str | None = "problem_id") -> list[RowLine]:
    """The finished rows of a ledger's rows text, each with its line number.

    Lines are split at ``\\n`` only (a row may hold U+2028 and the other Unicode line breaks); empty lines are
    skipped. A torn last line (no ``\\n`` after it) is left out with a warning naming file and line.

    Args:
        source: the file the text came from, for messages.
        key: the field that identifies a row; ``None``: duplicates are not checked.

    Raises:
        LedgerLineError: a line that is not a JSON object, or a ``key`` seen on an earlier line (naming both lines
            and how to repair).
    """
    source = Path(source)
    lines = text.split("\n")
    torn = lines[-1]  # "" when the text ends with "\n"
    if torn:
        warnings.warn(f"{source}:{len(lines)}: a torn last line ({len(torn.encode())} bytes, no newline), a row "
                      "still being written or cut off by a crash, is left out (the next run of the arm recomputes it)")
    out: list[RowLine] = []
    first: dict[Any, int] = {}
    for n, line in enumerate(lines[:-1], start=1):
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise LedgerLineError(source, n, _guess_id(line),
                                  f"not JSON (column {e.colno}: {e.msg}), a damaged line in the middle of the ledger; "
                                  "restore the file (e.g. git checkout) or delete the folder and run the arm again") from None
        if not isinstance(rec, dict):
            raise LedgerLineError(source, n, None, f"a {type(rec).__name__}, not a row (a JSON object)")
        if key is not None:
            k = rec.get(key)
            if k in first:
                raise LedgerLineError(source, n, k, f"{key} {k!r} is recorded twice (first on line {first[k]}), "
                                                    f"written by two processes at once; {REPAIR_HINT}")
            first[k] = n
        out.append(RowLine(n, line, rec))
    return out


def read_log(path: str | Path) -> list[dict]:
    """The events of a run log (``runlog.jsonl``); none when it does not exist.

    A torn last line is left out with a warning (:func:`parse_rows`).

    Raises:
        LedgerLineError: a line in the middle that is not a JSON object (naming file and line).
    """
    path = Path(path)
    if not path.is_file():
        return []
    return [r.record for r in parse_rows(path.read_text(encoding="utf-8"), path, key=None)]


def cut_torn_tail(path: Path) -> int:
    """Cut a torn last line (bytes after the last ``\\n``) off an append-only file; returns the bytes cut."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return 0
    keep = data.rfind(b"\n") + 1
    with open(path, "r+b") as f:
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return len(data) - keep
