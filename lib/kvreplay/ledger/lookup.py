"""Finding a profile's ledgers by provenance, never by date or by re-running anything.

Ledgers live in ``<ledger_root>/<profile>/<experiment>-<dtype>-<digest12>/``
(:data:`LEDGER_SPECS` names the notebook that writes each). When a profile
holds several folders for one experiment (an older config left behind), the
one that belongs to the current chain is chosen by provenance: Experiment 1
BF16 is the ledger the prefix bank names as its source; Experiment 1 FP32 has
the same config except its dtype; Experiments 2-5 carry the prefix bank's
sha256 in their config. A missing, incomplete or ambiguous ledger raises
:class:`MissingLedgerError` naming the notebook that writes it.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

from ..arm_facts import ARM_FACTS, Derived
from .records import (
    ROW_TYPES,
    BridgeRecord,
    Exp1Record,
    Exp2Record,
    ReplicationRecord,
    TransplantRecord,
    validate_rows,
)
from .checked import (  # MissingLedgerError re-exported
    MissingLedgerError,
    checked_manifest,
    checked_rows,
    pending_rows,
    sampled_check_labels,
)
from .files import read_environment, read_json
from .store import ROWS, SEALED

PREFIX_BANK = "prefix_bank_bf16.jsonl"


@dataclasses.dataclass(frozen=True)
class LedgerSpec:
    """Which ledger an assembly needs and which notebook writes it.

    Attributes:
        experiment: folder-name prefix (``exp1`` ... ``exp5``).
        dtype: ``bfloat16`` or ``float32``.
        notebook: the notebook that writes it (under ``notebooks/``).
        what: one line for error messages and the artifact map.
    """
    experiment: str
    dtype: str
    notebook: str
    what: str

    @property
    def key(self) -> str:
        return f"{self.experiment}-{self.dtype}"


LEDGER_SPECS: Mapping[str, LedgerSpec] = Derived(lambda: {
    s.key: s for f in ARM_FACTS.values() if f.assembly
    for s in (LedgerSpec(f.experiment, d, f.notebook, f.what_at(d)) for d in f.dtypes)})
"""Every ledger the paper assembly reads, keyed ``<experiment>-<dtype>``: the arms of
:data:`kvreplay.arm_facts.ARM_FACTS` marked ``assembly``, at each of their precisions."""


@dataclasses.dataclass
class LoadedLedger:
    """One finished ledger folder read from disk.

    Attributes:
        key: ``<experiment>-<dtype>`` (a :data:`LEDGER_SPECS` key).
        dir: the folder.
        manifest: ``manifest.json`` (``schema_version``, ``name``, ``config_digest``, ``config``).
        environment: ``environment.json`` (``execution_contract``, ``library_sha256``), ``{}`` if absent.
        records: the rows, in the config's frozen ``problem_ids`` order, each checked against its experiment's
            record (:mod:`.records`). Typed ``Any``: which record depends on ``key``, known only at run time; a
            summary function that takes them (e.g. ``matrix_summary(records: Sequence[Exp1Record] | ...)``)
            reads them as its record.
        unchecked: problem ID -> ``"sampled check not run (library <digest12>)"`` for rows below float32 that no
            sampled float32 check covers (:func:`~kvreplay.ledger.checked.sampled_check_labels`).
    """
    key: str
    dir: Path
    manifest: dict
    environment: dict
    records: list[Any]
    unchecked: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def config(self) -> dict:
        return self.manifest["config"]

    @property
    def contract(self) -> dict:
        """The execution contract recorded when the ledger was written."""
        return self.environment.get("execution_contract", {})

    @property
    def rows_path(self) -> Path:
        """The file holding the rows: ``rows.jsonl``, or ``rows.jsonl.gz`` for a sealed ledger."""
        return self.dir / (SEALED if (self.dir / SEALED).exists() else ROWS)


def _manifest(folder: Path) -> dict:
    """:func:`~kvreplay.ledger.checked.checked_manifest` (a missing one: :class:`MissingLedgerError`)."""
    return checked_manifest(folder)


def finished_rows(folder: str | Path) -> list[dict]:
    """The rows of a ledger folder as written (``rows.jsonl`` or sealed ``rows.jsonl.gz``), finished or not, each
    checked (:func:`~kvreplay.ledger.checked.checked_rows`).

    A torn last line (an arm stopped mid-write) is left out with a warning: the ledger is unfinished, not corrupt.

    Raises:
        MissingLedgerError: the folder has no manifest.
        LedgerLineError: a line other than the last is not JSON, a problem ID is recorded twice, or a row does not
            fit its schema (naming file, line, problem ID and field).
        UncheckedRowError: a row whose sampled float32 check failed or has not run (naming file, line and why).
        LedgerFileError: a damaged manifest, or one that is not the folder's (another arm's, another schema).
        LedgerError: the folder holds both the plain and the sealed rows file, with different rows.
    """
    folder = Path(folder)
    _manifest(folder)
    return [r.record for r in checked_rows(folder)]


def ledger_progress(folder: str | Path) -> tuple[int, int]:
    """``(finished, expected)`` rows of a ledger folder: checked records present for the manifest's ``problem_ids``.

    A row whose sampled float32 check has not run yet (an arm writing now, or stopped before the check) is not
    counted: the arm's next run checks it.

    Raises:
        as :func:`finished_rows`, but for rows whose check has not run.
    """
    folder = Path(folder)
    ids = _manifest(folder)["config"]["problem_ids"]
    waiting = pending_rows(folder)
    done = {r.record["problem_id"] for r in checked_rows(folder, pending=True)} - waiting
    return sum(i in done for i in ids), len(ids)


def read_ledger(folder: str | Path, key: str | None = None) -> LoadedLedger:
    """Read a ledger folder (manifest, environment, rows) with its rows in frozen order.

    Every row is checked against its experiment's typed record (:mod:`.records`) on the way in, so
    what a notebook reads has the layout the code declares.

    Raises:
        MissingLedgerError: if the folder has no manifest or is unfinished.
        RowSchemaError: a row that does not fit the record of ``key``'s experiment (naming the row and the field).
        LedgerLineError: a damaged line, a duplicated problem ID, or a row that does not fit the manifest's
            experiment (naming file, line, problem ID and field).
        UncheckedRowError: a row whose sampled float32 check failed or has not run (naming file, line and why).
        LedgerFileError: an empty or partial manifest or environment, or a manifest that is not the folder's
            (naming it, the field and what to do).
    """
    folder = Path(folder)
    manifest = _manifest(folder)
    env = read_environment(folder)
    by_id = {r["problem_id"]: r for r in finished_rows(folder)}
    ids = manifest["config"]["problem_ids"]
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise MissingLedgerError(f"ledger {folder} is unfinished: {len(ids) - len(missing)}/{len(ids)} rows")
    key = key or "-".join(folder.name.split("-")[:2])
    records = [by_id[i] for i in ids]
    experiment = key.rsplit("-", 1)[0]
    if experiment in ROW_TYPES:
        validate_rows(experiment, records)
    return LoadedLedger(key=key, dir=folder, manifest=manifest, environment=env, records=records,
                        unchecked=sampled_check_labels(folder, records))


def _run_hint(spec: LedgerSpec, profile: str) -> str:
    return (f"run notebooks/{spec.notebook} for profile {profile!r} first "
            f"(make paper PROFILE={profile}, or papermill with -p profile {profile})")


def find_ledger(
    root: str | Path, profile: str, key: str, *, match: Callable[[dict], bool] | None = None, why: str = ""
) -> LoadedLedger:
    """The one finished ledger ``<root>/<profile>/<key>-*`` that belongs to the current chain.

    Args:
        root: the ledger root (``data/ledgers`` by default in the notebooks).
        profile: profile name (a folder under ``root``).
        key: a :data:`LEDGER_SPECS` key, e.g. ``"exp2-float32"``.
        match: optional predicate on a candidate's manifest (provenance); only
            finished candidates it accepts are kept.
        why: what ``match`` checks, for the error message.

    Raises:
        MissingLedgerError: no folder, none finished, none matching, or more
            than one matching; the message names the notebook that writes it.
    """
    spec = LEDGER_SPECS[key]
    base = Path(root) / profile
    folders = sorted(p for p in base.glob(f"{key}-*") if (p / "manifest.json").is_file())
    if not folders:
        raise MissingLedgerError(f"no {spec.what} ledger ({key}-*) under {base}: {_run_hint(spec, profile)}")
    progress = {p: ledger_progress(p) for p in folders}
    finished = [p for p in folders if progress[p][0] == progress[p][1]]
    if not finished:
        for p in folders:  # a row refused (its sampled check failed or never ran) is named with its file and line
            finished_rows(p)
        state = ", ".join(f"{p.name} {d}/{n} rows" for p, (d, n) in progress.items())
        raise MissingLedgerError(f"{spec.what} ledger under {base} is unfinished ({state}): {_run_hint(spec, profile)}")
    if match is not None:
        finished = [p for p in finished if match(_manifest(p))]
        if not finished:
            raise MissingLedgerError(
                f"no finished {spec.what} ledger under {base} matches {why or 'the chain'} "
                f"(found {[p.name for p in folders]}): {_run_hint(spec, profile)}"
            )
    if len(finished) > 1:
        raise MissingLedgerError(
            f"{len(finished)} finished {spec.what} ledgers under {base} match ({[p.name for p in finished]}); "
            f"move the stale ones away or {_run_hint(spec, profile)}"
        )
    return read_ledger(finished[0], key)


def _without(config: dict, *keys: str) -> dict:
    return {k: v for k, v in config.items() if k not in keys}


@dataclasses.dataclass
class ProfileLedgers:
    """A profile's finished ledgers for the paper assembly.

    Attributes:
        root: ledger root; profile: profile name.
        prefix_bank_sha256: sha256 of ``prefix_bank_bf16.jsonl`` (the BF16 prefixes Experiments 2–5 read).
        ledgers: :data:`LEDGER_SPECS` key -> :class:`LoadedLedger`.
    """
    root: Path
    profile: str
    prefix_bank_sha256: str
    ledgers: dict[str, LoadedLedger]

    def __getitem__(self, key: str) -> LoadedLedger:
        return self.ledgers[key]

    # <generated: ProfileLedgers.records> by python -m kvreplay.ledger.overloads from kvreplay.arm_facts.ARM_FACTS
    @overload
    def records(self, key: Literal["exp1-bfloat16", "exp1-float32"]) -> list[Exp1Record]: ...
    @overload
    def records(self, key: Literal["exp2-bfloat16", "exp2-float32"]) -> list[Exp2Record]: ...
    @overload
    def records(self, key: Literal["exp3-bfloat16"]) -> list[BridgeRecord]: ...
    @overload
    def records(self, key: Literal["exp4-bfloat16"]) -> list[TransplantRecord]: ...
    @overload
    def records(self, key: Literal["exp5-bfloat16"]) -> list[ReplicationRecord]: ...
    # </generated: ProfileLedgers.records>
    @overload
    def records(self, key: str) -> list[Any]: ...
    def records(self, key: str) -> list[Any]:
        """The rows of ledger ``key`` (:attr:`LoadedLedger.records`), typed as their record when ``key`` is a
        literal :data:`LEDGER_SPECS` key (``records("exp4-bfloat16")`` is ``list[TransplantRecord]``)."""
        return self.ledgers[key].records

    @property
    def precisions(self) -> list[str]:
        return [k.split("-", 1)[1] for k in self.ledgers if k.startswith("exp1-")]


def _bank(root: Path, profile: str) -> dict | None:
    path = root / profile / f"{PREFIX_BANK}.manifest.json"
    return read_json(path, "write the prefix bank again (notebook 01)") if path.is_file() else None


def find_chain_ledger(root: str | Path, profile: str, key: str) -> LoadedLedger:
    """The finished ledger for ``key`` that belongs to the profile's current chain (provenance, not dates).

    Experiment 1 BF16 is the ledger the BF16 prefix bank names as its source
    (the only finished one if there is no bank yet); Experiment 1 at another
    precision has the same config as Experiment 1 BF16 except its dtype;
    Experiments 2–5 carry the bank's sha256 in their config.

    Raises:
        MissingLedgerError: naming the notebook that writes the missing ledger.
        KeyError: ``key`` is not a ledger of the chain (the known keys named, the closest first).
    """
    root = Path(root)
    if key not in LEDGER_SPECS:
        near = difflib.get_close_matches(key, LEDGER_SPECS, n=1)
        raise KeyError(f"{key!r} is not a ledger of the chain" + (f" (did you mean {near[0]!r}?)" if near else "")
                       + f"; known: {sorted(LEDGER_SPECS)}")
    spec = LEDGER_SPECS[key]
    bank = _bank(root, profile)
    if key == "exp1-bfloat16":
        if bank is None:
            return find_ledger(root, profile, key)
        source = bank["source_ledger"]
        return find_ledger(root, profile, key, match=lambda m: f"{m['name']}-{m['config_digest'][:12]}" == source,
                           why=f"the prefix bank's source ledger {source}")
    if spec.experiment == "exp1":
        base = _without(find_chain_ledger(root, profile, "exp1-bfloat16").config, "dtype")
        return find_ledger(root, profile, key, match=lambda m: _without(m["config"], "dtype") == base,
                           why="the Experiment 1 BF16 config (same problems, caps, model, format, threads)")
    if bank is None:
        raise MissingLedgerError(
            f"no BF16 prefix bank at {root / profile / PREFIX_BANK}, which {spec.what} reads: "
            f"{_run_hint(LEDGER_SPECS['exp1-bfloat16'], profile)}"
        )
    return find_ledger(root, profile, key, match=lambda m: m["config"].get("prefix_bank_sha256") == bank["sha256"],
                       why=f"the prefix bank (sha256 {bank['sha256'][:12]})")


def load_profile_ledgers(root: str | Path, profile: str, precisions: Sequence[str] = ("bfloat16", "float32")) -> ProfileLedgers:
    """Find and read every ledger the paper assembly needs for one profile (no model is loaded).

    Needs Experiments 1 and 2 at each of ``precisions`` (which must include
    ``bfloat16``: the prefix bank is BF16), Experiments 3, 4 and 5, each
    chosen by :func:`find_chain_ledger`.

    Raises:
        MissingLedgerError: naming the notebook to run for the first ledger that is missing.
        ValueError: if ``precisions`` lacks ``bfloat16``.
    """
    if "bfloat16" not in precisions:
        raise ValueError(f"precisions {list(precisions)} must include 'bfloat16' (Experiments 2-5 read the BF16 prefix bank)")
    root = Path(root)
    bank = _bank(root, profile)
    if bank is None:
        raise MissingLedgerError(
            f"no BF16 prefix bank at {root / profile / PREFIX_BANK}: {_run_hint(LEDGER_SPECS['exp1-bfloat16'], profile)}"
        )
    keys = [k for k, s in LEDGER_SPECS.items() if s.experiment in ("exp3", "exp4", "exp5") or s.dtype in precisions]
    ledgers = {k: find_chain_ledger(root, profile, k) for k in keys}
    return ProfileLedgers(root=root, profile=profile, prefix_bank_sha256=bank["sha256"], ledgers=ledgers)
