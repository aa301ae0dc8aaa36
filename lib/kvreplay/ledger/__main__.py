"""``python -m kvreplay.ledger seal|unseal FOLDER...``: compress finished ledgers for committing, or restore them;
``python -m kvreplay.ledger compare RECOMPUTED COMMITTED``: a recomputed profile folder against the committed one.

A sealed ledger keeps its rows as ``rows.jsonl.gz`` (the same bytes, gzip level 9, no time stamp); every reader
takes either form, and appending to a sealed ledger unseals it first. ``compare`` prints one line per ledger folder
or file (:mod:`kvreplay.ledger.compare`) and exits 1 if any row, manifest, prefix bank or panel differs (an
unfinished recomputation whose rows so far are identical does not count as differing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .compare import agrees, compare_ledger_roots, describe
from .store import LedgerError, seal, unseal


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvreplay.ledger", description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("seal", "unseal", "compare"))
    ap.add_argument("folders", nargs="+", type=Path,
                    help="ledger folders (holding manifest.json); for compare: two profile folders, the recomputed "
                         "one first (e.g. /tmp/kv/ledgers/gpu data/ledgers/gpu)")
    args = ap.parse_args(argv)
    if args.action == "compare":
        if len(args.folders) != 2:
            ap.error("compare takes two profile folders: RECOMPUTED COMMITTED")
        try:
            entries = compare_ledger_roots(*args.folders)
        except (FileNotFoundError, LedgerError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for entry in entries:
            print(describe(entry))
        return 0 if all(agrees(e) for e in entries) else 1
    status = 0
    for folder in args.folders:
        if not (folder / "manifest.json").is_file():
            print(f"{folder}: not a ledger folder (no manifest.json)", file=sys.stderr)
            status = 2
            continue
        try:
            out = seal(folder) if args.action == "seal" else unseal(folder)
        except LedgerError as e:
            print(f"{folder}: {e}", file=sys.stderr)
            status = 1
            continue
        print(f"{folder}: {out.name}")
    return status


if __name__ == "__main__":
    sys.exit(main())
