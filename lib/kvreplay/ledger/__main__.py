"""``python -m kvreplay.ledger seal|unseal FOLDER...``: compress finished ledgers for committing, or restore them.

A sealed ledger keeps its rows as ``rows.jsonl.gz`` (the same bytes, gzip level 9, no time stamp); every reader
takes either form, and appending to a sealed ledger unseals it first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .store import LedgerError, seal, unseal


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvreplay.ledger", description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("seal", "unseal"))
    ap.add_argument("folders", nargs="+", type=Path, help="ledger folders (holding manifest.json)")
    args = ap.parse_args(argv)
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
