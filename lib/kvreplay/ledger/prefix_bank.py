"""The fixed-prefix bank: Experiment 1's BF16 boundary prefixes, frozen for Experiments 2-5 (paper §3.5).

``<ledger_root>/<profile>/prefix_bank_bf16.jsonl`` holds one line per problem
(problem ID and the boundary prefix's token IDs). Its manifest names the
Experiment 1 ledger it came from and its sha256, which every downstream
ledger carries in its config (how :mod:`kvreplay.ledger.lookup` finds the
chain by provenance).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from ..gates import GateError
from .records import Exp1Record
from .files import atomic_write, parse_rows, read_json
from .store import canonical_json, unchanged_when_read_only


def write_prefix_bank(records: Sequence[Exp1Record], path: str | Path, source_ledger: str) -> str:
    """Write the BF16 boundary-prefix bank Experiments 2–5 read (paper §3.6).

    One JSON line per problem in frozen order: ``problem_id``, ``prompt_len``,
    ``prefix`` (token IDs of z). A manifest ``<path>.manifest.json`` records
    its sha256 and the ledger it came from.

    Returns:
        the bank's sha256.

    Raises:
        GateError: if a record has no prefix (a failed row).
        FileExistsError: ``path`` already holds a different bank (another row set or other bits). Experiments
            2-5 of the profile were built on that one, so it is never overwritten: delete it (and the ledgers
            built on it) to replace it, or write under another profile label or ledger root.
        ReadOnlyLedgerError: :data:`~kvreplay.ledger.store.READ_ONLY_ENV` is ``1`` and the bank or its manifest
            would be created or changed (with the same bytes there, nothing is written).
    """
    lines = []
    for r in records:
        if "prefix" not in r:
            raise GateError("report", f"row {r['problem_id']} has no boundary prefix; cannot write the prefix bank")
        lines.append(canonical_json({"problem_id": r["problem_id"], "prompt_len": r["prompt_len"], "prefix": r["prefix"]}))
    data = ("\n".join(lines) + "\n").encode()
    path = Path(path)
    if path.is_file() and path.read_bytes() != data:
        old = hashlib.sha256(path.read_bytes()).hexdigest()
        raise FileExistsError(
            f"{path} already holds another prefix bank (sha256 {old[:12]}); this one ({len(lines)} rows from "
            f"{source_ledger}) differs, and Experiments 2-5 of this profile were built on the one there, so it is not "
            f"overwritten. Delete it (and the ledgers built on it) to replace it, or run under another profile label "
            f"(overrides {{'profile': ...}}) or ledger_root")
    digest = hashlib.sha256(data).hexdigest()
    manifest = json.dumps({"sha256": digest, "rows": len(lines), "source_ledger": source_ledger}, indent=1,
                          sort_keys=True) + "\n"
    manifest_path = Path(str(path) + ".manifest.json")
    if unchanged_when_read_only({path: data, manifest_path: manifest}, "this prefix bank (or its manifest)"):
        return digest
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, data)
    atomic_write(manifest_path, manifest)
    return digest


def read_prefix_bank(path: str | Path) -> tuple[list[dict], str]:
    """Read the BF16 boundary-prefix bank written by notebook 01 and check its digest.

    Returns:
        ``(entries, sha256)``; each entry has ``problem_id``, ``prompt_len``, ``prefix``.

    Raises:
        FileNotFoundError: if notebook 01 has not written the bank for this profile.
        GateError: gate ``provenance`` if the file does not match its manifest.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prefix bank at {path}: run notebook 01 (Experiment 1) for this profile first")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    manifest = read_json(Path(str(path) + ".manifest.json"), "write the prefix bank again (notebook 01)")
    if manifest["sha256"] != digest:
        raise GateError("provenance", f"{path} has sha256 {digest}, its manifest says {manifest['sha256']}")
    return [r.record for r in parse_rows(data.decode(), path)], digest
