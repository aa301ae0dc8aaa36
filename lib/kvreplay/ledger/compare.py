"""Two copies of a profile's ledgers compared file by file: is a recomputation the committed ledger, bit for bit?

A profile recomputed from nothing (another ledger root, e.g. ``make paper --ledger-root`` or
``scripts/gpu_profile.py --from-scratch`` with ``KV_LEDGERS``) is the committed one when every ledger folder's rows,
manifest, prefix bank and frozen panels are byte-identical. Its ``environment.json`` records where and by what it
was written (library digest, host, versions): the keys that differ are listed, not judged. Run logs (wall times)
and parquet copies (derived) are not compared. This module says which, per folder, and where rows first part.
``make verify`` answers the same question for a few rows recomputed on the spot; this one compares whole
ledgers already recomputed.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

from .store import LedgerError, read_rows_text

__all__ = ["SAME", "CompareError", "agrees", "compare_ledger_roots", "compare_rows", "describe"]


class CompareError(ValueError):
    """A folder that cannot be compared: not a profile folder, or a file that cannot be read."""


def _flat(obj: object, prefix: str = "") -> dict[str, object]:
    if isinstance(obj, dict):
        out: dict[str, object] = {}
        for k, v in obj.items():
            out |= _flat(v, f"{prefix}{k}.")
        return out
    return {prefix[:-1]: obj}


def _lines(text: str) -> list[str]:
    """Rows of a ``rows.jsonl`` text: split at ``\\n`` only (a row's JSON may hold U+2028 and the like raw)."""
    lines = text.split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


def _key(line: str, key: str) -> object:
    try:
        return json.loads(line).get(key)
    except (json.JSONDecodeError, AttributeError):  # a line cut off by a kill, or not an object
        return None


def compare_rows(recomputed: str, committed: str, key: str = "problem_id") -> dict:
    """Compare two ledgers' rows text line by line (a row is one line of ``rows.jsonl``).

    Args:
        recomputed, committed: the rows' text (:func:`~kvreplay.ledger.store.read_rows_text`).
        key: the row field that names a row in the result.

    Returns:
        ``{"rows": (n recomputed, n committed), "identical": k, "state": s, "first_difference": id or None}``:
        ``k`` leading rows equal byte for byte; ``s`` is ``"identical"`` (the same bytes), ``"prefix"`` (every
        recomputed row equals the committed row at its place, fewer of them: a recomputation not finished.
        A last line cut off mid-write counts as unfinished when its bytes so far are the committed row's),
        ``"longer"`` (the committed rows are a prefix of the recomputed ones) or ``"differs"`` (row ``k`` differs;
        ``first_difference`` is its ``key`` in the recomputed row, ``None`` if that line does not parse).
    """
    a, b = _lines(recomputed), _lines(committed)
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    first = None
    if recomputed == committed:
        state = "identical"
    elif (k == len(a) < len(b) and recomputed.endswith("\n")) or not recomputed or (
            k == len(a) - 1 < len(b) and not recomputed.endswith("\n") and b[k].startswith(a[k])):
        state = "prefix"  # (the last case: a last line being written, or cut off by a kill, so far the same)
    elif k == len(b) < len(a):
        state = "longer"
    else:
        state = "differs"
        first = _key(a[k], key) if k < len(a) else None
    return {"rows": (len(a), len(b)), "identical": k, "state": state, "first_difference": first}


def _read_rows(folder: Path) -> str:
    try:
        return read_rows_text(folder)
    except (OSError, EOFError, zlib.error, gzip.BadGzipFile, UnicodeDecodeError, LedgerError) as e:
        raise CompareError(f"{folder}: its rows cannot be read ({type(e).__name__}: {e})") from None


def _environment(folder: Path) -> dict:
    path = folder / "environment.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CompareError(f"{path} cannot be read ({type(e).__name__}: {e})") from None


def _is_ledger(path: Path) -> bool:
    return path.is_dir() and (path / "manifest.json").is_file()


def compare_ledger_roots(recomputed: str | Path, committed: str | Path) -> list[dict]:
    """Compare every ledger folder and file of a recomputed profile folder with the committed one.

    Args:
        recomputed, committed: profile folders, e.g. ``/tmp/kv/ledgers/gpu`` and ``data/ledgers/gpu``.

    Returns:
        one dict per entry, sorted by name: ``name`` and ``kind`` (``"ledger"`` or ``"file"``). Then ``missing``
        (recomputed, no committed counterpart: e.g. a folder of another config digest), ``not_recomputed``
        (committed only), or the comparison: for a ledger folder ``rows`` (:func:`compare_rows`), ``manifest``
        (``"identical"`` or ``"differs"``) and ``environment`` (the dotted keys whose values differ). For a file
        (prefix bank, panel, ``role_adaptation.json``) ``file`` (``"identical"`` or ``"differs"``). Folders that
        are not ledgers (no ``manifest.json``, e.g. a partial write's ``tmp-*``) are left out on both sides.

    Raises:
        FileNotFoundError: either folder does not exist.
        CompareError: a ledger folder was given instead of its profile folder, or a file cannot be read.
        LedgerError: a ledger folder holds both ``rows.jsonl`` and ``rows.jsonl.gz``.
    """
    recomputed, committed = Path(recomputed), Path(committed)
    for p in (recomputed, committed):
        if not p.is_dir():
            raise FileNotFoundError(f"{p}: no such profile folder")
        if (p / "manifest.json").is_file():
            raise CompareError(f"{p} is a ledger folder: give its profile folder ({p.parent})")

    def entries(root: Path) -> dict[str, str]:
        return {p.name: ("ledger" if _is_ledger(p) else "file") for p in root.iterdir()
                if (_is_ledger(p) or p.is_file()) and not p.name.startswith(".")}  # not writer locks, temporaries

    ours, theirs = entries(recomputed), entries(committed)
    out: list[dict] = []
    for name in sorted(ours.keys() | theirs.keys()):
        src, other = recomputed / name, committed / name
        entry: dict = {"name": name, "kind": ours.get(name) or theirs[name]}
        if name not in theirs or ours.get(name, theirs[name]) != theirs[name]:
            entry["missing"] = True
        elif name not in ours:
            entry["not_recomputed"] = True
        elif entry["kind"] == "ledger":
            entry["rows"] = compare_rows(_read_rows(src), _read_rows(other))
            entry["manifest"] = ("identical" if (src / "manifest.json").read_bytes()
                                 == (other / "manifest.json").read_bytes() else "differs")
            env_a, env_b = _flat(_environment(src)), _flat(_environment(other))
            entry["environment"] = sorted(k for k in env_a.keys() | env_b.keys() if env_a.get(k) != env_b.get(k))
        else:
            entry["file"] = "identical" if src.read_bytes() == other.read_bytes() else "differs"
        out.append(entry)
    return out


SAME = {"identical", "prefix"}
"""Row states that mean a recomputation agrees with the committed ledger so far."""


def agrees(entry: dict, complete: bool = False) -> bool:
    """Whether an entry of :func:`compare_ledger_roots` shows nothing that differs.

    A recomputed folder or file with no committed counterpart does not agree; neither does a file or a manifest
    that differs, or rows that part. With ``complete``, an unfinished ledger (``"prefix"``) and a committed entry
    not recomputed do not agree either (a finished recomputation of the whole profile)."""
    if entry.get("missing"):
        return False
    if entry.get("not_recomputed"):
        return not complete
    if "file" in entry:
        return entry["file"] == "identical"
    same = {"identical"} if complete else SAME
    return entry["rows"]["state"] in same and entry["manifest"] == "identical"


def describe(entry: dict) -> str:
    """One line for one entry of :func:`compare_ledger_roots`."""
    name = entry["name"]
    if entry.get("missing"):
        return f"{name}: recomputed, not in the committed folder (another config digest?)"
    if entry.get("not_recomputed"):
        return f"{name}: committed, not recomputed"
    if "file" in entry:
        return f"{name}: {entry['file']}"
    r = entry["rows"]
    n, m, k = r["rows"][0], r["rows"][1], r["identical"]
    rows = {"identical": f"rows identical ({n})",
            "prefix": f"rows identical so far ({k} of {m} committed)",
            "longer": f"rows: the {m} committed are the first {m} of {n} recomputed",
            "differs": f"rows part after {k} identical rows, at row {k + 1} "
                       f"({r['first_difference'] if r['first_difference'] is not None else 'no readable problem_id'}); "
                       f"{n} recomputed, {m} committed"}[r["state"]]
    env = ", ".join(entry["environment"]) or "none"
    return f"{name}: {rows}; manifest {entry['manifest']}; environment keys that differ: {env}"

