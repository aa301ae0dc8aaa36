"""Which library wrote a profile's ledgers, and each run's compute time (paper §3.9 reproducibility release).

A ledger's ``environment.json`` records the library digest that created it (``library_sha256``,
:func:`kvreplay.ledger.store.library_digest`). Run logs (``runlog.jsonl``) written since they recorded one give
each event the digest of the code that logged it, so rows appended by a resumed run are attributed too. Older run
logs name none: what resumed those ledgers is not recorded. A run's ``end`` or ``stopped`` event
records its compute seconds (``compute_s``: model load, compiles and rows). ``python -m kvreplay.ledger digests
data/ledgers/<profile>`` prints this and exits 1 unless the profile was written by one library.

Which commit a digest is (:func:`library_commits`, from git) and which rows never had the sampled float32
construction-equivalence check (:func:`sampled_check_missing`, from the run logs) feed the generated tables of
``docs/provenance.md`` (:mod:`kvreplay.report.provenance_pages`).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .checked import SAMPLE_EVENT, covered_rows
from .files import read_environment, read_json, read_log, read_manifest


@dataclass(frozen=True)
class LedgerProvenance:
    """One ledger folder's library digests and compute time.

    Attributes:
        name: the folder's name, e.g. ``exp1-bfloat16-c902497e8e11``.
        environment: ``library_sha256`` of its ``environment.json`` (``None`` when absent).
        run_log: the distinct ``library_sha256`` values of its run-log events.
        unstamped: run-log events with no ``library_sha256`` (written before run logs recorded one).
        runs: ``start`` events (one per run that had rows to consider).
        compute_s: the sum of the runs' ``compute_s`` (seconds), over the runs that recorded one.
        unchecked: rows below float32 that no sampled float32 check covers, by label (``"sampled check not run
            (library <digest12>)"``: :func:`~kvreplay.ledger.checked.sampled_check_labels`) -> count.
    """

    name: str
    environment: str | None
    run_log: frozenset[str]
    unstamped: int
    runs: int
    compute_s: float
    unchecked: tuple[tuple[str, int], ...] = ()

    @property
    def digests(self) -> frozenset[str]:
        """Every library digest that wrote this ledger: ``environment.json``'s and the run log's."""
        return self.run_log | ({self.environment} if self.environment else frozenset())


def ledger_provenance(folder: str | Path) -> LedgerProvenance:
    """The library digests and compute seconds of one ledger folder (holding ``manifest.json``).

    Raises:
        FileNotFoundError: ``folder`` has no ``manifest.json``.
        LedgerLineError: a run-log line other than the last that is not JSON (naming file and line; a torn last
            line is left out with a warning).
        LedgerFileError: an empty or partial ``environment.json`` (naming it).
    """
    folder = Path(folder)
    if not (folder / "manifest.json").is_file():
        raise FileNotFoundError(f"{folder}: not a ledger folder (no manifest.json)")
    env_path, log_path = folder / "environment.json", folder / "runlog.jsonl"
    environment = read_environment(folder).get("library_sha256") if env_path.is_file() else None
    digests: set[str] = set()
    unstamped = runs = 0
    compute = 0.0
    for event in read_log(log_path):
        if event.get("library_sha256"):
            digests.add(event["library_sha256"])
        else:
            unstamped += 1
        runs += event.get("event") == "start"
        if event.get("event") in ("end", "stopped") and isinstance(event.get("compute_s"), (int, float)):
            compute += float(event["compute_s"])
    from collections import Counter

    from .checked import sampled_check_labels
    from .store import ledger_rows

    labels = Counter(sampled_check_labels(folder, [r.record for r in ledger_rows(folder, None)]).values())
    return LedgerProvenance(folder.name, environment, frozenset(digests), unstamped, runs, round(compute, 3),
                            tuple(sorted(labels.items())))


def profile_provenance(profile_root: str | Path) -> list[LedgerProvenance]:
    """Every ledger folder of a profile (``data/ledgers/<profile>``), in name order.

    Raises:
        FileNotFoundError: ``profile_root`` is not a folder.
    """
    root = Path(profile_root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such profile folder of ledgers")
    return [ledger_provenance(f.parent) for f in sorted(root.glob("*/manifest.json"))]


def profile_library_digests(profile_root: str | Path) -> set[str]:
    """The set of library digests that wrote a profile's ledgers (``environment.json`` and every run-log event)."""
    return {d for p in profile_provenance(profile_root) for d in p.digests}


def one_library_problems(profile_root: str | Path) -> list[str]:
    """Why a profile is not written by one library: empty when it is.

    A profile is written by one library when its ledgers' ``environment.json`` files and run-log events name one
    ``library_sha256`` in all, every ledger has one in ``environment.json``, and every run-log event has one.
    Each problem names the ledger folder and, shortened to 12 hex digits, the digests.
    """
    ledgers = profile_provenance(profile_root)
    out = [f"{profile_root}: no ledger folder"] if not ledgers else []
    for p in ledgers:
        if not p.environment:
            out.append(f"{p.name}: environment.json records no library_sha256")
        if p.unstamped:
            out.append(f"{p.name}: {p.unstamped} run-log event(s) record no library_sha256")
    digests = sorted({d for p in ledgers for d in p.digests})
    if len(digests) > 1:
        by = {d: sorted(p.name for p in ledgers if d in p.digests) for d in digests}
        out.append(f"{profile_root}: written by {len(digests)} libraries: "
                   + "; ".join(f"{d[:12]} ({', '.join(names)})" for d, names in by.items()))
    return out


def describe(p: LedgerProvenance) -> str:
    """One line for ``python -m kvreplay.ledger digests``: the folder, its digests (12 hex digits), runs, seconds."""
    env = (p.environment or "none")[:12]
    logged = ", ".join(sorted(d[:12] for d in p.run_log)) or "none"
    return (f"{p.name}: environment {env}; run log {logged}"
            + (f" ({p.unstamped} event(s) without a digest)" if p.unstamped else "")
            + f"; {p.runs} run(s), {p.compute_s:.1f} s compute recorded"
            + "".join(f"; {n} row(s): {label}" for label, n in p.unchecked))


SAMPLED_CHECK_EVENT = SAMPLE_EVENT
"""The run-log event of the sampled float32 construction-equivalence check (:mod:`kvreplay.ledger.checked`)."""


def sampled_check_missing(folder: str | Path, has_check: Mapping[str, bool | None]) -> dict[str, str]:
    """The rows of one ledger whose sampled float32 construction-equivalence check never ran, problem ID -> why.

    Read from the run log alone. A ledger whose config's ``dtype`` is ``float32`` (or names none) has no such row:
    a float32 row checks itself. Any other row counts as checked only when a passing sampled check covers it
    (:func:`kvreplay.ledger.checked.covered_rows`, which also reads the checks of a library that did not name their
    rows). ``has_check`` maps a library digest to whether its code had the check (``None``: unknown, e.g. a digest
    no commit has). The reason names the digest of the row's ``row`` event (12 hex digits):
    ``"never ran (library <d>)"`` when it had the check; ``"not run (library <d>)"`` when it had not;
    ``"not run (library <d>, in no commit)"`` when unknown; ``"not run (run log names no library)"``.

    Raises:
        FileNotFoundError, LedgerLineError, LedgerFileError: as :func:`ledger_provenance`.
    """
    folder = Path(folder)
    if read_manifest(folder).get("config", {}).get("dtype", "float32") == "float32":
        return {}
    events = read_log(folder / "runlog.jsonl")
    checked = covered_rows(events)
    library = {key: e.get("library_sha256") for e in events
               if e.get("event") == "row" and (key := e.get("key") or e.get("problem_id"))}
    out = {}
    for key, digest in library.items():
        if key in checked:
            continue
        known = has_check.get(digest) if digest else None
        out[key] = ("not run (run log names no library)" if not digest else
                    f"{'never ran' if known else 'not run'} (library {digest[:12]}"
                    + (", in no commit)" if known is None else ")"))
    return out


@dataclass(frozen=True)
class LibraryCommit:
    """The first commit (in committer-date order) whose ``lib/kvreplay`` has a library digest.

    Attributes:
        commit: its full hash.
        date: its committer date, ISO 8601 with offset.
        sampled_check: whether its library logs the sampled float32 check (:data:`SAMPLED_CHECK_EVENT`).
    """

    commit: str
    date: str
    sampled_check: bool


def library_commits(repo: str | Path, digests: set[str] | None = None) -> dict[str, LibraryCommit]:
    """Library digest -> its first commit, over every commit git can reach in ``repo`` (``git rev-list --all``).

    The digest is :func:`~kvreplay.ledger.store.library_digest` recomputed from each commit's tracked
    ``lib/kvreplay`` files (``.py`` and ``.yaml``, in the same order). ``digests`` keeps only those; a digest no
    commit has is absent.

    Raises:
        RuntimeError: ``repo`` is not a git checkout, or a shallow one (its early commits are missing).
    """
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{repo}: git {args[0]} failed ({done.stderr.strip()}); a full git clone is needed")
        return done.stdout

    if git("rev-parse", "--is-shallow-repository").strip() == "true":
        raise RuntimeError(f"{repo}: a shallow clone lacks early commits; `git fetch --unshallow` first")
    commits = [line.split() for line in git("log", "--all", "--reverse", "--format=%H %cI").splitlines()]
    blobs = subprocess.Popen(["git", "-C", str(repo), "cat-file", "--batch"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    stdin, stdout = blobs.stdin, blobs.stdout
    assert stdin is not None and stdout is not None
    cache: dict[str, bytes] = {}

    def blob(sha: str) -> bytes:
        if sha not in cache:
            stdin.write(sha.encode() + b"\n")
            stdin.flush()
            size = int(stdout.readline().split()[2])
            cache[sha] = stdout.read(size + 1)[:-1]
        return cache[sha]

    out: dict[str, LibraryCommit] = {}
    try:
        for commit, date in commits:
            files = []
            for line in git("ls-tree", "-r", commit, "--", "lib/kvreplay").splitlines():
                meta, path = line.split("\t", 1)
                rel = PurePosixPath(path).relative_to("lib/kvreplay")
                if rel.suffix in {".py", ".yaml"} and "__pycache__" not in rel.parts:
                    files.append((rel.parts, str(rel), meta.split()[2]))
            h = hashlib.sha256()
            for _, rel_name, sha in sorted(files):
                h.update(rel_name.encode())
                h.update(blob(sha))
            digest = h.hexdigest()
            if digest not in out and (digests is None or digest in digests):
                sampled = any(f'event="{SAMPLED_CHECK_EVENT}"'.encode() in blob(sha) for *_, sha in files)
                out[digest] = LibraryCommit(commit, date, sampled)
    finally:
        stdin.close()
        blobs.wait()
    return out


def read_library_commits(path: str | Path) -> dict[str, LibraryCommit | None]:
    """The committed digest -> first-commit map (``data/libraries.json``; ``None``: a digest no commit has).

    Raises:
        LedgerFileError: a damaged file (naming it); FileNotFoundError: none.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; `python -m kvreplay.ledger libraries` writes it")
    data = read_json(path, "restore it from git or rewrite it with `python -m kvreplay.ledger libraries`")
    return {d: (LibraryCommit(**v) if v else None) for d, v in data["libraries"].items()}


def library_commits_json(digests: set[str], found: Mapping[str, LibraryCommit]) -> str:
    """The text of ``data/libraries.json``: every digest of ``digests`` with its first commit, or null."""
    rows = {d: (found[d].__dict__ if d in found else None) for d in sorted(digests)}
    return json.dumps({"libraries": rows}, indent=1, sort_keys=True) + "\n"
