"""Which library wrote a profile's ledgers, and each run's compute time (paper §3.9 reproducibility release).

A ledger's ``environment.json`` records the library digest that created it (``library_sha256``,
:func:`kvreplay.ledger.store.library_digest`); every event of its run log (``runlog.jsonl``) records the digest of
the code that logged it, so rows appended by a resumed run are attributed too. A run's ``end`` or ``stopped`` event
records its compute seconds (``compute_s``: model load, compiles and rows). ``python -m kvreplay.ledger digests
data/ledgers/<profile>`` prints this and exits 1 unless the profile was written by one library.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .files import read_environment, read_log


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
