"""The run loop of an arm: run, resume or reuse its ledger (paper §3.9).

:func:`run_arm` maps an experiment's per-row function (or, on the batched
engine, its per-chunk function) over the problems in frozen order, in this
process or on Ray row actors (:mod:`kvreplay.runner.actors`), appending each
record to the arm's ledger (:mod:`kvreplay.ledger`) as it finishes. It is a pipeline of named steps, each taking
one object: :func:`plan` (the committed rows read, what is left, the samples), :func:`preflight` (model, prompts,
ledger opened), :func:`chunks` (the row or chunk mapper), :func:`sampled_check` (the sampled float32 check) and
:func:`close` (the rows appended and returned); :func:`run_on_actors` replaces the last four on Ray actors.

What :func:`run_arm` does: ``row`` mapped over ``problems`` in frozen order.

With a non-eager ``settings.step_path`` the arm runs through the batched
engine instead. There ``chunk(spec, problems)`` (such as
:func:`kvreplay.experiments.live_vs_prefill.live_vs_prefill_chunk`) computes the records of up to
``settings.chunk`` (default ``settings.batch``) problems at a time (:class:`BatchedRows`). They are
appended in problem order as in a sequential run. Every run passes the ``composition`` gate (and, on the
graph path, ``graph_equals_eager``) before it appends a row. So every process that appends rows (with its
own captured graph) has passed both. A new arm passes them on its first preflight problem (computed alone
and inside its chunk). A resumed arm passes them on the committed row with the shortest line (a proxy for
the fewest decoded tokens, so the cheapest to recompute). That row is computed alone and compared with
its committed line byte for byte (:class:`BatchedRows`). With Ray workers
every actor passes the gate on its own first chunk, before that chunk's
rows are returned: on the same committed row for a resumed arm, on the
arm's first problem or its chunk's first problem for a new one.

With ``settings.workers > 1`` (and more than one row, or chunk, to
compute) the rows run on Ray actors (:class:`kvreplay.runner.actors.RowActors`), and this process loads
no model. There is one actor per GPU or CPU worker, each with its own model; on the batched path
each computes whole chunks. Records are
appended in problem order, so the ledger's bytes equal a sequential run's.

The ledger lives in ``<ledger_root>/<profile>/<name>-<dtype>-<digest12>/``
and records :data:`ROW_ALGORITHM` ``[name]``. A ledger already complete
for this scientific config is read without loading the model. The first
``settings.preflight`` rows are preflight rows: a gate failure there
aborts the arm, and in a run below float32 they also carry the float32
construction-equivalence gate (:func:`kvreplay.experiments.matrix.construction_equivalence`). In this
process that check also runs on a sample of each chunk's other rows, its result in the run log, never in
the row (:func:`~kvreplay.runner.row_checks.sampled_equivalence`; docs/gates.md).

With ``live_check`` (an experiment whose reference is the live cache) and a dtype below float32, the
preflight rows and a sample of ``settings.live_check_fraction`` of the others, drawn from the problem IDs
(:func:`~kvreplay.runner.spec.live_check_ids`), carry the ``live_equals_incremental`` gate
(:func:`kvreplay.experiments.matrix.check_live`). The run log records the sample before any row
(event ``live_check_sample``) and, in this process, each check passed with its seconds (event ``live_check_passed``);
a passing check adds nothing to the row, so it is not part of the ledger key.
Every run-log event records the library digest that logged it; the run's ``end`` (or ``stopped``) event records
its compute seconds since this call began, model load and compiles included (``compute_s``).

:func:`run_arm` raises:
    GateError: ``equivalence`` when the sampled float32 check of a chunk fails (its rows stay, and the
        ledger is refused from then on, before any model is loaded); ``preflight`` if a preflight row fails a gate; ``composition``
        or ``graph_equals_eager`` (batched arms) before any row of the process (or, with Ray workers,
        of the actor) that failed it is appended; rows of actors that passed theirs may be in the
        ledger already, in problem order.
    RowSchemaError: a record that does not fit the experiment's row type
        (:mod:`kvreplay.ledger.records`); it is not appended.
    ModelLoadError, ContractError: bad model or problems (a prompt that
        breaks the block contract, or a sequence longer than the model's
        context), before any row and before the ledger folder is created.
    ValueError: a non-eager step path for an experiment without a batched
        runner (``chunk`` None); a ``max_len`` too short for the arm's
        problems; ``workers`` the Ray cluster cannot hold (too few CPUs
        or GPUs), or an explicit ``cuda:N`` with ``workers > 1``.
    RuntimeError: a row actor failed to start (its cause is named), or
        every row actor died (finished rows stay in the ledger).
    ReadOnlyLedgerError: a row left to compute while :data:`READ_ONLY_ENV` is ``1``, before any model is
        loaded or ledger folder created.
    LedgerBusyError: another process is writing this arm's ledger (its writer lock, :mod:`kvreplay.ledger.lock`,
        is taken before the model is loaded and held to the end), unless ``KVREPLAY_LEDGER_WAIT`` allows waiting.
    LedgerLineError: a damaged line or a duplicated problem ID in the arm's ledger, before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from ..ledger.lookup import ledger_progress
from ..ledger.records import validate_row
from ..gates import GateError
from ..ledger import lock
from ..ledger.files import read_log
from ..ledger.checked import checked_rows, pending_rows
from ..ledger.store import READ_ONLY_ENV, Ledger, ReadOnlyLedgerError, row_bar, run_rows
from ..engine.run import EngineRun
from ..model.models import context_length
from ..data.problems import Problem
from .actors import RowActors
from .batched import BatchedRows, gate_recorder
from .row_checks import EAGER_SAMPLE_CHUNK, failed_equivalence_samples, recheck_pending, sampled_equivalence
from .spec import (
    LIVE_CHECK_SALT,
    ROW_ALGORITHM,
    ArmSettings,
    Hook,
    RunSpec,
    arm_environment,
    check_prompts,
    live_check_ids,
)


_Record = TypeVar("_Record", bound=Mapping[str, Any])
"""An experiment's row record (:mod:`kvreplay.ledger.records`, e.g. ``Exp1Record``)."""


def _other_folders(root: Path, label: str, folder: Path) -> list[str]:
    """The arm's ledger folders under ``root`` other than ``folder``, each with its finished and wanted rows."""
    out = []
    for f in sorted(root.glob(f"{label}-*/manifest.json")):
        if f.parent != folder:
            done, wanted = ledger_progress(f.parent)
            out.append(f"{f.parent.name} ({done} of {wanted} rows)")
    return out


@dataclasses.dataclass(frozen=True)
class ArmCall:
    """One call of :func:`run_arm`, its arguments as one object (see there); ``started`` is the call's
    ``time.perf_counter()``, from which the run log's ``compute_s`` counts."""
    name: str
    settings: ArmSettings
    problems: Sequence[Problem]
    row: Callable[[RunSpec, Problem], Any]
    chunk: Callable[[RunSpec, Sequence[Problem]], list[Any]] | None
    ledger_root: Path
    extra_config: dict
    progress: bool
    faults: Hook | None
    live_check: bool
    started: float


@dataclasses.dataclass(frozen=True)
class ArmWork:
    """What :func:`plan` decided before any model is loaded.

    Attributes:
        call: the call.
        label, config, root, version: the ledger's ``<experiment>-<dtype>``, its config, profile folder and row
            algorithm.
        by_id: committed rows by problem ID; pending: those whose sampled float32 check never ran.
        todo: the problems left to compute, in order.
        equivalence_ids: the preflight rows (the float32 equivalence gate).
        checked: the rows that carry ``live_equals_incremental``.
        first: the composition gate's problem (batched, new rows); reference: a resumed batched arm's
            ``(problem, committed line)`` for that gate.
        groups: rows (eager) or chunks (batched) left.
        reused: ``(records, ledger)`` when the ledger already holds every row: nothing else runs.
    """
    call: ArmCall
    label: str
    config: dict
    root: Path
    version: int | None
    by_id: dict[str, Any]
    pending: list[str]
    todo: list[Problem]
    equivalence_ids: frozenset[str]
    checked: frozenset[str]
    first: str | None
    reference: tuple[Problem, str] | None
    groups: int
    reused: tuple[list[Any], Ledger] | None = None

    @property
    def on_actors(self) -> bool:
        """Rows go to Ray actors: more than one worker and group, and no committed row waiting for its check."""
        return self.call.settings.workers > 1 and self.groups > 1 and not self.pending

    @property
    def sample_event(self) -> dict:
        """The run log's ``live_check_sample`` event: the rows left that carry ``live_equals_incremental``."""
        s = self.call.settings
        return {"event": "live_check_sample", "gate": "live_equals_incremental", "fraction": s.live_check_fraction,
                "preflight": s.preflight, "salt": LIVE_CHECK_SALT,
                "problem_ids": [p.problem_id for p in self.todo if p.problem_id in self.checked]}

    @property
    def desc(self) -> str:
        """The progress bar's label, ``"<experiment> <dtype>"``."""
        return f"{self.call.name} {self.call.settings.dtype}"


@dataclasses.dataclass(frozen=True)
class Opened:
    """What :func:`preflight` made in this process: the ledger, the run's spec and its engine run (``None``: eager)."""
    ledger: Ledger
    spec: RunSpec
    run: EngineRun | None


class Rows(NamedTuple):
    """How :func:`close` computes the rows left: a mapper over problems, else a per-row function."""
    mapper: Callable[[list[Problem]], Iterable[Mapping[str, Any]]] | None
    row_fn: Callable[[Problem], Any] | None


@lock.releases_locks
def run_arm(name: str, settings: ArmSettings, problems: Sequence[Problem], row: Callable[[RunSpec, Problem], _Record],
            *, ledger_root: str | Path, extra_config: dict | None = None, progress: bool = True,
            faults: Hook | None = None, chunk: Callable[[RunSpec, Sequence[Problem]], list[_Record]] | None = None,
            live_check: bool = False) -> tuple[list[_Record], "Ledger"]:
    """Run, resume or reuse one experiment arm: ``row`` (or, batched, ``chunk``) mapped over ``problems`` in frozen
    order into the ledger ``<ledger_root>/<profile>/<name>-<dtype>-<digest12>/``.

    What it does, and what it raises, is in this module's docstring (:mod:`kvreplay.runner.loop`).

    Returns:
        ``(records, ledger)``: every problem's record in problem order, and the arm's ledger.
    """
    work = plan(ArmCall(name, settings, problems, row, chunk, Path(ledger_root), extra_config or {}, progress,
                        faults, live_check, time.perf_counter()))
    if work.reused is not None:
        return work.reused
    if work.on_actors:
        return run_on_actors(work)
    opened = preflight(work)
    return close(work, opened, sampled_check(work, opened, chunks(work, opened)))


def plan(call: ArmCall) -> ArmWork:
    """Read what the arm's ledger holds and decide what is left, before any model is loaded. Takes the ledger's
    writer lock (unless read-only).

    Raises:
        ValueError: a non-eager step path without ``chunk``.
        GateError: ``equivalence``, the ledger's sampled float32 check failed before.
        ReadOnlyLedgerError: rows left while :data:`READ_ONLY_ENV` is ``1``.
    """
    s = call.settings
    if s.step_path != "eager" and call.chunk is None:
        raise ValueError(f"experiment {call.name!r} has no batched runner: step path {s.step_path!r} is "
                         f"refused (use step_path='eager'; every experiment of notebooks 01-05 has one)")
    config = s.config(call.name, call.problems) | call.extra_config
    root, label, version = call.ledger_root / s.profile, f"{call.name}-{s.dtype}", ROW_ALGORITHM.get(call.name)
    ids = [p.problem_id for p in call.problems]
    folder = Ledger.folder(root, label, config)
    if os.environ.get(READ_ONLY_ENV) != "1":
        lock.acquire(folder)  # one writer, before any model is loaded; released at return
    committed, by_id, pending, reused = _committed(call, root, label, config, version)
    todo = [p for p in call.problems if p.problem_id not in by_id]
    if (todo or pending) and reused is None and os.environ.get(READ_ONLY_ENV) == "1":
        _refuse_read_only(folder, label, todo, pending, len(ids))
    checked = (live_check_ids(ids, s.preflight, s.live_check_fraction)
               if call.live_check and s.dtype != "float32" else frozenset())
    first = todo[0].problem_id if todo else None  # composition gate (batched), per run, whatever the preflight count
    reference = None
    if s.step_path != "eager" and first is not None and committed:
        reference, first = _reference(call.problems, committed), None
    groups = len(todo) if s.step_path == "eager" else -(-len(todo) // (s.chunk or s.batch))
    return ArmWork(call, label, config, root, version, by_id, pending, todo, frozenset(ids[: s.preflight]), checked,
                   first, reference, groups, reused)


def _committed(call: ArmCall, root: Path, label: str, config: dict, version: int | None) -> tuple[
        list[tuple[str, Any]], dict[str, Any], list[str], tuple[list[Any], Ledger] | None]:
    """The ledger's committed ``(line, record)`` pairs, its records by problem ID, those waiting for their sampled
    check, and ``(records, ledger)`` when every problem is done and checked (nothing to compute: no model)."""
    if not Ledger.folder(root, label, config).is_dir():
        return [], {}, [], None
    probe = Ledger(root, label, config, row_algorithm=version)
    failed = failed_equivalence_samples(read_log(probe.dir / "runlog.jsonl"))
    if failed:
        raise GateError("equivalence", f"{probe.dir}: the sampled float32 construction-equivalence check failed on "
                        f"the chunk of rows {', '.join(failed)} (run log), so its rows may come from a broken "
                        "construction; fix it, delete the folder and run the arm again")
    rows = checked_rows(probe.dir, pending=True)  # read once: manifest, schema (file, line, field), done keys
    by_id = {r.record[probe.key]: r.record for r in rows}
    ids = [p.problem_id for p in call.problems]
    waiting = pending_rows(probe.dir)
    pending = [i for i in ids if i in by_id and i in waiting]
    reused = None
    if set(ids) <= by_id.keys() and not pending:  # nothing to compute or check: no model, no actors
        row_bar(len(ids), len(ids), f"{call.name} {call.settings.dtype}", call.progress)
        reused = [by_id[i] for i in ids], probe
    return [(r.text, r.record) for r in rows], by_id, pending, reused


def _refuse_read_only(folder: Path, label: str, todo: list[Problem], pending: list[str], n: int) -> None:
    """Raise :class:`ReadOnlyLedgerError`: rows left to compute, or committed rows waiting for their check."""
    if not todo:
        raise ReadOnlyLedgerError(folder, f"{len(pending)} rows ({', '.join(pending)}) wait for their sampled "
                                  "float32 check, which the arm's command runs before any new row")
    others = _other_folders(folder.parent, label, folder)
    held = "; other folders of this arm: " + ", ".join(others) if others else "; no other folder of this arm"
    raise ReadOnlyLedgerError(folder, f"{len(todo)} of {n} rows of this arm are not in any ledger{held}", len(todo))


def _reference(problems: Sequence[Problem], committed: list[tuple[str, Any]]) -> tuple[Problem, str]:
    """A resumed batched arm's composition-gate reference: the committed row with the shortest line, not a new row.

    A row that stopped at a gate (e.g. a transplant's precondition) decoded little and would check little, so it
    is the reference only when every committed row did."""
    line, rec = min([x for x in committed if not x[1].get("gate_failure")] or committed, key=lambda x: len(x[0]))
    return next(p for p in problems if p.problem_id == rec["problem_id"]), line


def run_on_actors(work: ArmWork) -> tuple[list[Any], Ledger]:
    """The rows left, on Ray actors: the actors load the model; this process loads none (a second copy would sit on
    the first GPU). Returns ``(records, ledger)``."""
    call, s = work.call, work.call.settings
    with RowActors(s, call.row, chunk=call.chunk, workers=min(s.workers, work.groups), faults=call.faults,
                   equivalence_ids=work.equivalence_ids, live_check_ids=work.checked) as pool:
        environment, run = pool.prepare(call.problems)  # prompts checked and contract recorded inside an actor
        ledger = Ledger(work.root, work.label, work.config, environment=environment, row_algorithm=work.version)
        if work.checked:
            ledger.log(**work.sample_event)
        ledger.log(event="workers", workers=pool.workers, devices=pool.devices, ray=pool.cluster["address"],
                   ray_started=pool.cluster["started"], startup_s=pool.startup)
        if run is not None:
            ledger.log(event="engine", **run.settings(s.decoding))
        pooled = pool.mapper(work.todo, key=lambda p: p.problem_id, run=run, composition_id=work.first,
                             reference=work.reference,
                             on_checks=gate_recorder(ledger.log, ledger.dir, call.problems[0].problem_id))
        try:
            records = run_rows(ledger, list(call.problems), None, key=lambda p: p.problem_id, mapper=pooled,
                               preflight=s.preflight, progress=call.progress, desc=f"{work.desc} x{pool.workers}",
                               validate=lambda rec: validate_row(call.name, rec), started=call.started)
        finally:
            for event in pool.events:
                ledger.log(**event)
    return records, ledger


def preflight(work: ArmWork) -> Opened:
    """In this process: the model loaded, every prompt checked before the ledger folder exists, the ledger opened
    with its environment, the run's spec built, and the live-check sample logged.

    Raises:
        ModelLoadError, ContractError: a bad model or prompt, before the ledger folder is created."""
    s, problems = work.call.settings, work.call.problems
    lm, block_format = s.load()
    check_prompts(block_format, problems, context_length(lm.model.config), caps=s.caps)
    run = s.engine_run(block_format, problems, lm.model.config)
    ledger = Ledger(work.root, work.label, work.config, environment=arm_environment(lm, block_format, s, run),
                    row_algorithm=work.version)
    spec = s.run_spec(lm, block_format, run, faults=work.call.faults, equivalence_ids=work.equivalence_ids,
                      live_check_ids=work.checked)
    if work.checked:
        ledger.log(**work.sample_event)
    return Opened(ledger, spec, run)


def chunks(work: ArmWork, opened: Opened) -> Rows:
    """The rows left as a per-row function (eager) or a chunk mapper (:class:`BatchedRows`; its ``engine`` event
    logged); with a live-check sample, each record follows the run log's ``live_check_passed`` of its checks."""
    ledger, spec, run, call = opened.ledger, opened.spec, opened.run, work.call

    def logged(rec: Any) -> Any:
        """``rec``, after the live checks passed since the last record are written to the run log."""
        if spec.live_checks:
            ledger.log(event="live_check_passed", checks=list(spec.live_checks))
            spec.live_checks.clear()
        return rec

    if run is None:
        return Rows(None, lambda p: logged(call.row(spec, p)))
    assert call.chunk is not None  # a non-eager step path without a chunk function was refused by plan
    batched = BatchedRows(spec, call.chunk, work.todo, composition_id=work.first, reference=work.reference,
                          on_checks=gate_recorder(ledger.log, ledger.dir, call.problems[0].problem_id),
                          on_chunk=lambda stats: ledger.log(event="chunk", **stats))
    ledger.log(event="engine", **run.settings(call.settings.decoding))
    return Rows((lambda items: (logged(rec) for rec in batched(items))) if work.checked else batched, None)


def sampled_check(work: ArmWork, opened: Opened, rows: Rows) -> Rows:
    """Below float32, the float32 equivalence check also on a sample of each chunk's other rows
    (:func:`~kvreplay.runner.row_checks.sampled_equivalence`); first, the check a kill or crash kept from running
    on committed rows (:func:`~kvreplay.runner.row_checks.recheck_pending`).

    Raises:
        GateError: ``equivalence``, a committed row's check failed."""
    s, by_problem = work.call.settings, {p.problem_id: p for p in work.call.problems}
    size = EAGER_SAMPLE_CHUNK if opened.run is None else s.chunk or s.batch
    if s.dtype != "float32":
        mapper, one = rows.mapper, rows.row_fn
        if mapper is None:
            assert one is not None  # chunks gives a mapper or a per-row function
            mapper = lambda items: (one(p) for p in items)  # noqa: E731
        rows = Rows(sampled_equivalence(mapper, opened.spec, by_problem, work.equivalence_ids, size,
                                        opened.ledger.log), None)
    if work.pending:  # before any new row
        recheck_pending([work.by_id[i] for i in work.pending], opened.spec, by_problem, work.equivalence_ids, size,
                        opened.ledger.log)
    return rows


def close(work: ArmWork, opened: Opened, rows: Rows) -> tuple[list[Any], Ledger]:
    """The rows left computed and appended in problem order (:func:`~kvreplay.ledger.store.run_rows`); returns
    ``(records, ledger)``, every problem's record in order."""
    call = work.call
    records = run_rows(opened.ledger, list(call.problems), rows.row_fn, key=lambda p: p.problem_id,
                       mapper=rows.mapper, preflight=call.settings.preflight, progress=call.progress, desc=work.desc,
                       validate=lambda rec: validate_row(call.name, rec), started=call.started)
    return records, opened.ledger
