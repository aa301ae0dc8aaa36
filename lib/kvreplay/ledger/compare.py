"""Two copies of a profile's ledgers compared file by file: is a recomputation the committed ledger, bit for bit?

A profile recomputed from nothing (another ledger root, e.g. ``make paper --ledger-root`` or
``scripts/gpu_profile.py`` with ``KV_LEDGERS``) is the committed one when every ledger folder's rows, manifest,
prefix bank and frozen panels are byte-identical; its ``environment.json`` may differ only in what records where
and by what it was written (the library digest, the host), and its run log always differs (wall times). This
module says which, per folder, and where rows first part. ``make verify`` answers the same question for a few
rows recomputed on the spot; this one compares whole ledgers already recomputed.
"""

from __future__ import annotations

import json
from pathlib import Path

from .store import read_rows_text

__all__ = ["SAME", "agrees", "compare_ledger_roots", "compare_rows", "describe"]


def _flat(obj: object, prefix: str = "") -> dict[str, object]:
    if isinstance(obj, dict):
        out: dict[str, object] = {}
        for k, v in obj.items():
            out |= _flat(v, f"{prefix}{k}.")
        return out
    return {prefix[:-1]: obj}


def _environment(folder: Path) -> dict:
    path = folder / "environment.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def compare_rows(recomputed: str, committed: str, key: str = "problem_id") -> dict:
    """Compare two ledgers' rows text line by line (a row is one line of ``rows.jsonl``).

    Args:
        recomputed, committed: the rows' text (:func:`~kvreplay.ledger.store.read_rows_text`).
        key: the row field that names a row in the result.

    Returns:
        ``{"rows": (n recomputed, n committed), "identical": k, "state": s, "first_difference": id or None}``:
        ``k`` leading rows equal byte for byte; ``s`` is ``"identical"`` (same text), ``"prefix"`` (every
        recomputed row equals the committed row at its place, fewer of them: a recomputation not finished),
        ``"longer"`` (the committed rows are a prefix of the recomputed ones) or ``"differs"`` (row ``k`` differs;
        ``first_difference`` is its ``key``, from the recomputed row).
    """
    a, b = recomputed.splitlines(), committed.splitlines()
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    if len(a) == len(b) == k:
        state, first = "identical", None
    elif k == len(a):
        state, first = "prefix", None
    elif k == len(b):
        state, first = "longer", None
    else:
        state, first = "differs", json.loads(a[k]).get(key)
    return {"rows": (len(a), len(b)), "identical": k, "state": state, "first_difference": first}


def compare_ledger_roots(recomputed: str | Path, committed: str | Path) -> list[dict]:
    """Compare every ledger folder and file of a recomputed profile folder with the committed one.

    Args:
        recomputed, committed: profile folders, e.g. ``/tmp/kv/ledgers/gpu`` and ``data/ledgers/gpu``.

    Returns:
        one dict per entry of ``recomputed`` (sorted by name): ``name``; ``missing`` (no committed counterpart);
        for a ledger folder ``rows`` (:func:`compare_rows`), ``manifest`` (``"identical"`` or ``"differs"``) and
        ``environment`` (the dotted keys whose values differ; ``[]`` when none); for a file (prefix bank, panel,
        ``role_adaptation.json``) ``file`` (``"identical"`` or ``"differs"``). Committed folders the recomputed
        side lacks are listed with ``not_recomputed``. Run logs and parquet copies are not compared.

    Raises:
        FileNotFoundError: either folder does not exist.
        LedgerError: a ledger folder holds both ``rows.jsonl`` and ``rows.jsonl.gz``.
    """
    recomputed, committed = Path(recomputed), Path(committed)
    for p in (recomputed, committed):
        if not p.is_dir():
            raise FileNotFoundError(f"{p}: no such profile folder")
    out: list[dict] = []
    for src in sorted(recomputed.iterdir()):
        other = committed / src.name
        entry: dict = {"name": src.name}
        if not other.exists():
            entry["missing"] = True
        elif src.is_dir() and (src / "manifest.json").is_file():
            entry["rows"] = compare_rows(read_rows_text(src), read_rows_text(other))
            entry["manifest"] = ("identical" if (src / "manifest.json").read_bytes()
                                 == (other / "manifest.json").read_bytes() else "differs")
            env_a, env_b = (_flat(_environment(f)) for f in (src, other))
            entry["environment"] = sorted(k for k in env_a.keys() | env_b.keys() if env_a.get(k) != env_b.get(k))
        elif src.is_file():
            entry["file"] = "identical" if src.read_bytes() == other.read_bytes() else "differs"
        else:
            continue  # not a ledger folder (e.g. a partial write's tmp-* folder)
        out.append(entry)
    seen = {e["name"] for e in out}
    for other in sorted(committed.iterdir()):
        if other.name not in seen and (other.is_file() or (other / "manifest.json").is_file()):
            out.append({"name": other.name, "not_recomputed": True})
    return out


def describe(entry: dict) -> str:
    """One line for one entry of :func:`compare_ledger_roots`."""
    name = entry["name"]
    if entry.get("missing"):
        return f"{name}: not in the committed folder"
    if entry.get("not_recomputed"):
        return f"{name}: committed, not recomputed"
    if "file" in entry:
        return f"{name}: {entry['file']}"
    r = entry["rows"]
    rows = {"identical": f"rows identical ({r['rows'][0]})",
            "prefix": f"rows identical so far ({r['identical']} of {r['rows'][1]} committed)",
            "longer": f"rows: the {r['rows'][1]} committed are the first of {r['rows'][0]} recomputed",
            "differs": f"rows part at row {r['identical']} ({r['first_difference']}); {r['rows'][0]} recomputed, "
                       f"{r['rows'][1]} committed"}[r["state"]]
    env = ", ".join(entry["environment"]) or "none"
    return f"{name}: {rows}; manifest {entry['manifest']}; environment keys that differ: {env}"


SAME = {"identical", "prefix"}
"""Row states that mean a recomputation agrees with the committed ledger so far."""


def agrees(entry: dict) -> bool:
    """Whether an entry of :func:`compare_ledger_roots` shows no bit that differs (rows so far, manifest, file)."""
    if "file" in entry:
        return entry["file"] == "identical"
    if "rows" in entry:
        return entry["rows"]["state"] in SAME and entry["manifest"] == "identical"
    return True
