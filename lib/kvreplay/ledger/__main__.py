"""``python -m kvreplay.ledger seal|unseal FOLDER...``: compress finished ledgers for committing, or restore them;
``python -m kvreplay.ledger compare RECOMPUTED COMMITTED``: a recomputed profile folder against the committed one;
``python -m kvreplay.ledger digests PROFILE_FOLDER...``: the library digests that wrote each profile's ledgers;
``python -m kvreplay.ledger libraries PROFILE_FOLDER...``: write ``data/libraries.json``, each of those digests with
the first commit that has it (from git; ``--check``: exit 1 when the file differs);
``python -m kvreplay.ledger repair FOLDER...``: drop byte-identical duplicate rows (two writers at once), refuse
differing ones (:mod:`kvreplay.ledger.repair`); exit 1 on a folder it cannot repair.

A sealed ledger keeps its rows as ``rows.jsonl.gz`` (the same bytes, gzip level 9, no time stamp); every reader
takes either form, and appending to a sealed ledger unseals it first. ``compare`` prints one line per ledger folder
or file (:mod:`kvreplay.ledger.compare`) and a count, and exits 1 if any row, manifest, prefix bank or panel
differs, a recomputed folder has no committed counterpart, or no ledger was compared at all. An unfinished
recomputation whose rows so far are identical, and committed folders not recomputed, fail only with
``--complete``. Exit 2: a folder that cannot be compared. ``digests`` prints, per ledger, the library digests of
its ``environment.json`` and run log, its runs and recorded compute seconds (:mod:`kvreplay.ledger.provenance`),
then each profile's set of digests. It exits 1 unless each profile named has one library and a digest on every
run-log event. ``docs/provenance.md`` renders both (``python -m kvreplay.report.provenance_pages``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import provenance
from . import repair as repairing
from ..paths import DATA, ROOT
from .compare import CompareError, agrees, compare_ledger_roots, describe
from .store import LedgerError, seal, unseal


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvreplay.ledger", description=__doc__.replace("``", "`").replace(":mod:`", "`"),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("seal", "unseal", "compare", "digests", "libraries", "repair"))
    ap.add_argument("folders", nargs="+", type=Path,
                    help="ledger folders (holding manifest.json); for compare: two profile folders, the recomputed "
                         "one first (e.g. /tmp/kv/ledgers/gpu data/ledgers/gpu); for digests: profile folders "
                         "(e.g. data/ledgers/paper)")
    ap.add_argument("--complete", action="store_true",
                    help="compare: also fail on an unfinished recomputed ledger and on a committed entry not recomputed")
    ap.add_argument("--check", action="store_true", help="libraries: change nothing; exit 1 when the file differs")
    ap.add_argument("--out", type=Path, default=DATA / "libraries.json",
                    help="libraries: the file (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.action == "compare":
        if len(args.folders) != 2:
            ap.error("compare takes two profile folders: RECOMPUTED COMMITTED")
        try:
            entries = compare_ledger_roots(*args.folders)
        except (FileNotFoundError, CompareError, LedgerError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for entry in entries:
            print(describe(entry))
        compared = [e for e in entries if "rows" in e]
        bad = [e["name"] for e in entries if not agrees(e, complete=args.complete)]
        print(f"{len(compared)} ledger(s) compared, {sum(agrees(e, True) for e in compared)} identical, "
              f"{sum(bool(e.get('not_recomputed')) for e in entries)} committed entries not recomputed, "
              f"{len(bad)} that {'differ or are missing' if not args.complete else 'differ, are missing or unfinished'}")
        if not compared:
            print(f"error: no ledger folder of {args.folders[0]} has a committed counterpart in {args.folders[1]}: "
                  "nothing compared (profile folders, e.g. /tmp/kv/ledgers/gpu data/ledgers/gpu?)", file=sys.stderr)
            return 1
        return 1 if bad else 0
    if args.action == "digests":
        return _digests(args.folders)
    if args.action == "libraries":
        return _libraries(args.folders, args.out, args.check)
    status = 0
    for folder in args.folders:
        if not (folder / "manifest.json").is_file():
            print(f"{folder}: not a ledger folder (no manifest.json)", file=sys.stderr)
            status = 2
            continue
        try:
            if args.action == "repair":
                print(repairing.describe(repairing.repair(folder)))
                continue
            out = seal(folder) if args.action == "seal" else unseal(folder)
        except LedgerError as e:
            print(f"{folder}: {e}", file=sys.stderr)
            status = 1
            continue
        print(f"{folder}: {out.name}")
    return status


def _digests(profiles: list[Path]) -> int:
    """``digests``: each profile's ledgers and library digests; 0 when each was written by one library."""
    status = 0
    for root in profiles:
        try:
            ledgers = provenance.profile_provenance(root)
            problems = provenance.one_library_problems(root)
        except (FileNotFoundError, ValueError, LedgerError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for p in ledgers:
            print(provenance.describe(p))
        digests = sorted({d[:12] for p in ledgers for d in p.digests})
        print(f"{root}: {len(digests)} library digest(s): {', '.join(digests) or 'none'}; "
              f"{sum(p.compute_s for p in ledgers):.1f} s compute recorded")
        for problem in problems:
            print(f"  not one library: {problem}")
        status = status or (1 if problems else 0)
    return status


def _libraries(profiles: list[Path], out: Path, check: bool) -> int:
    """``libraries``: every digest of ``profiles`` with its first commit, written to (or checked against) ``out``."""
    try:
        digests = {d for root in profiles for d in provenance.profile_library_digests(root)}
        found = provenance.library_commits(ROOT, digests)
    except (FileNotFoundError, RuntimeError, LedgerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = provenance.library_commits_json(digests, found)
    for d in sorted(digests):
        print(f"{d[:12]}: " + (f"{found[d].commit[:12]} ({found[d].date[:10]})" if d in found else "in no commit"))
    if check:
        same = out.is_file() and out.read_text(encoding="utf-8") == text
        print(f"{out}: {'agrees with' if same else 'differs from'} git and the ledgers")
        return 0 if same else 1
    out.write_text(text, encoding="utf-8")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
