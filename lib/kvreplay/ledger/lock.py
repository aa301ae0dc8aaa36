"""One writer per ledger: an advisory ``fcntl.flock`` lock on a file named after the ledger folder.

The lock file is ``/tmp/kvreplay-ledger-locks/<ledger folder name>-<hash16>.lock`` (whatever ``TMPDIR`` is), where
``hash16`` hashes the folder's resolved path: host-local, and nothing is created under the ledger root before the ledger
folder itself. Its holder writes its PID, host, start time and the ledger folder into it. The kernel drops the lock when its holder exits, however it exits (``SIGKILL`` included), so a lock left
by a killed process never wedges the arm: the file remains, the lock does not. Locks are **same-host only**: two
machines writing one ledger over a network file system are not kept apart.

A second writer of the same arm stops at once with :class:`LedgerBusyError` naming the ledger and the holder,
unless asked to wait (``wait`` seconds, or the environment variable :data:`WAIT_ENV`).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import math
import os
import platform
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from .files import LedgerError

WAIT_ENV = "KVREPLAY_LEDGER_WAIT"
"""Seconds a writer waits for another writer of the same ledger to finish (``inf``: without limit); default 0."""

_F = TypeVar("_F", bound=Callable[..., Any])


class LedgerBusyError(LedgerError):
    """Another process holds a ledger's writer lock.

    Attributes:
        folder: the ledger folder.
        holder: the holder's line from the lock file (``pid ... host ... since ...``), or ``"unknown"``.
    """

    def __init__(self, folder: Path, holder: str, waited: float):
        self.folder, self.holder = folder, holder
        waited_text = f" after waiting {waited:g} s" if waited else ""
        super().__init__(
            f"{folder}: another process is writing this ledger ({holder}){waited_text}; two writers would "
            f"duplicate rows. Let it finish or stop it, or set {WAIT_ENV}=SECONDS to wait for it "
            "(the lock is same-host only)")


def lock_path(folder: str | Path) -> Path:
    """The lock file of a ledger folder (it need not exist): ``exp1-bfloat16-<digest12>-<hash16>.lock`` in the
    host's temporary folder, ``hash16`` from the folder's resolved path."""
    folder = Path(folder).resolve()
    where = hashlib.sha256(str(folder).encode()).hexdigest()[:16]
    return lock_root() / f"{folder.name}-{where}.lock"


def lock_root() -> Path:
    """The host's lock folder, the same whatever ``TMPDIR`` is: ``/tmp/kvreplay-ledger-locks`` (the system's own
    temporary folder where ``/tmp`` does not exist)."""
    base = Path("/tmp")
    if not base.is_dir():
        base = Path(tempfile.gettempdir())
    return base / "kvreplay-ledger-locks"


def remove_stale_temporaries(folder: str | Path) -> list[Path]:
    """Remove the ``.<name>.tmp-<pid>`` files a killed writer left in a ledger folder (:func:`~.files.atomic_write`);
    a temporary file of a process still alive on this host is kept. Returns the files removed."""
    folder = Path(folder)
    gone = []
    for tmp in folder.glob(".*.tmp-*") if folder.is_dir() else []:
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and (int(pid) == os.getpid() or _alive(int(pid))):
            continue
        tmp.unlink(missing_ok=True)
        gone.append(tmp)
    return gone


def _alive(pid: int) -> bool:
    """Whether a process of that ID runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_seconds(wait: float | None = None) -> float:
    """``wait``, or the seconds of :data:`WAIT_ENV` (0 when unset).

    Raises:
        ValueError: :data:`WAIT_ENV` is not a number of seconds >= 0.
    """
    if wait is not None:
        return wait
    raw = os.environ.get(WAIT_ENV, "0")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{WAIT_ENV}={raw!r}: give seconds to wait (0 or more, or inf)")
    return value


_held: dict[Path, tuple[int, int]] = {}  # lock file -> (fd, depth): this process's locks, re-entrant
_mutex = threading.Lock()


def acquire(folder: str | Path, wait: float | None = None) -> Path:
    """Take the writer lock of a ledger folder (re-entrant within this process); returns the lock file.

    Nothing is created under the ledger root; the ledger folder need not exist yet. Once taken, temporary files a
    killed writer left in the folder are removed (:func:`remove_stale_temporaries`).

    Raises:
        LedgerBusyError: another process holds it and it was not released within ``wait`` seconds
            (default :func:`wait_seconds`).
        LedgerError: the lock file cannot be created (e.g. a read-only folder), naming it.
    """
    folder = Path(folder)
    path = lock_path(folder)
    with _mutex:
        if path in _held:
            fd, depth = _held[path]
            _held[path] = (fd, depth + 1)
            return path
    limit = wait_seconds(wait)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise LedgerError(f"{path}: cannot create the ledger's writer lock ({e.strerror})") from e
    t0 = time.monotonic()
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            waited = time.monotonic() - t0
            if waited >= limit:
                holder = _holder(fd)
                os.close(fd)
                raise LedgerBusyError(folder, holder, 0 if limit == 0 else round(waited, 1)) from None
            time.sleep(0.2 if math.isinf(limit) else min(0.2, max(limit - waited, 0.01)))
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} host {platform.node()} since {time.strftime('%Y-%m-%dT%H:%M:%S%z')} "
                  f"ledger {folder}\n".encode(), 0)
    with _mutex:
        _held[path] = (fd, 1)
    remove_stale_temporaries(folder)  # left by a writer killed inside an atomic write
    return path


def _holder(fd: int) -> str:
    """The holder's line of a lock file (``unknown`` when it wrote none yet)."""
    try:
        text = os.pread(fd, 400, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "holder unknown"


def release(folder: str | Path) -> None:
    """Give back one hold of this process on a ledger's writer lock (the lock goes when the last hold does)."""
    _release(lock_path(folder))


def _release(path: Path) -> None:
    """:func:`release` by lock file."""
    with _mutex:
        if path not in _held:
            return
        fd, depth = _held[path]
        if depth > 1:
            _held[path] = (fd, depth - 1)
            return
        del _held[path]
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def held() -> set[Path]:
    """The lock files this process holds now."""
    with _mutex:
        return set(_held)


def releases_locks(fn: _F) -> _F:
    """Decorator: every writer lock ``fn`` takes (:func:`acquire`) and still holds is released when it returns or
    raises."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before = held()
        try:
            return fn(*args, **kwargs)
        finally:
            for path in held() - before:
                while path in held():
                    _release(path)
    return wrapper  # type: ignore[return-value]
