"""The run loop of an arm: run, resume or reuse its ledger (paper §3.9).

:func:`run_arm` maps an experiment's per-row function (or, on the batched
engine, its per-chunk function) over the problems in frozen order, in this
process or on Ray row actors (:mod:`kvreplay.runner.actors`), appending each
record to the arm's ledger (:mod:`kvreplay.ledger`) as it finishes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ..ledger.lookup import ledger_progress
from ..ledger.records import validate_row
from ..gates import GateError
from ..ledger import lock
from ..ledger.files import read_log
from ..ledger.checked import checked_rows, pending_rows
from ..ledger.store import READ_ONLY_ENV, Ledger, ReadOnlyLedgerError, row_bar, run_rows
from ..models import context_length
from ..problems import Problem
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


@lock.releases_locks
def run_arm(
    name: str,
    settings: ArmSettings,
    problems: Sequence[Problem],
    row: Callable[[RunSpec, Problem], _Record],
    *,
    ledger_root: str | Path,
    extra_config: dict | None = None,
    progress: bool = True,
    faults: Hook | None = None,
    chunk: Callable[[RunSpec, Sequence[Problem]], list[_Record]] | None = None,
    live_check: bool = False,
) -> tuple[list[_Record], "Ledger"]:
    """Run, resume or reuse one experiment arm: ``row`` mapped over ``problems`` in frozen order.

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

    Raises:
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
    started = time.perf_counter()  # the run's compute time (run log, ``compute_s``): model load and compiles included
    if settings.step_path != "eager" and chunk is None:
        raise ValueError(f"experiment {name!r} has no batched runner: step path {settings.step_path!r} is "
                         f"refused (use step_path='eager'; every experiment of notebooks 01-05 has one)")

    config = settings.config(name, problems) | (extra_config or {})
    root = Path(ledger_root) / settings.profile
    ids = [p.problem_id for p in problems]
    label = f"{name}-{settings.dtype}"
    version = ROW_ALGORITHM.get(name)
    done: set[str] = set()
    committed: list[str] = []  # the ledger's finished lines, for a resumed batched arm's gate
    parsed: list[Any] = []  # the same lines parsed
    by_id: dict[str, Any] = {}
    pending: list[str] = []  # committed rows whose sampled float32 check never ran: checked before any new row
    if os.environ.get(READ_ONLY_ENV) != "1":
        lock.acquire(Ledger.folder(root, label, config))  # one writer, before any model is loaded; released at return
    if Ledger.folder(root, label, config).is_dir():
        probe = Ledger(root, label, config, row_algorithm=version)
        failed = failed_equivalence_samples(read_log(probe.dir / "runlog.jsonl"))
        if failed:
            raise GateError("equivalence", f"{probe.dir}: the sampled float32 construction-equivalence check failed on "
                            f"the chunk of rows {', '.join(failed)} (run log), so its rows may come from a broken "
                            "construction; fix it, delete the folder and run the arm again")
        rows = checked_rows(probe.dir, pending=True)  # read once: manifest, schema (file, line, field), done keys
        committed, parsed = [r.text for r in rows], [r.record for r in rows]
        by_id = {r[probe.key]: r for r in parsed}
        waiting = pending_rows(probe.dir)
        pending = [i for i in ids if i in by_id and i in waiting]
        if set(ids) <= by_id.keys() and not pending:  # nothing to compute or check: no model, no actors
            row_bar(len(ids), len(ids), f"{name} {settings.dtype}", progress)
            return [by_id[i] for i in ids], probe
        done = set(by_id)
    todo = [p for p in problems if p.problem_id not in done]
    if (todo or pending) and os.environ.get(READ_ONLY_ENV) == "1":
        folder = Ledger.folder(root, label, config)
        if not todo:
            raise ReadOnlyLedgerError(folder, f"{len(pending)} rows ({', '.join(pending)}) wait for their sampled "
                                      "float32 check, which the arm's command runs before any new row")
        others = _other_folders(root, label, folder)
        held = "; other folders of this arm: " + ", ".join(others) if others else "; no other folder of this arm"
        raise ReadOnlyLedgerError(folder, f"{len(todo)} of {len(ids)} rows of this arm are not in any ledger{held}",
                                  len(todo))
    equivalence_ids = frozenset(ids[: settings.preflight])
    checked = (live_check_ids(ids, settings.preflight, settings.live_check_fraction)
               if live_check and settings.dtype != "float32" else frozenset())
    declared = {"event": "live_check_sample", "gate": "live_equals_incremental", "fraction": settings.live_check_fraction,
                "preflight": settings.preflight, "salt": LIVE_CHECK_SALT,
                "problem_ids": [p.problem_id for p in todo if p.problem_id in checked]}
    first = todo[0].problem_id if todo else None  # composition gate (batched), per run, whatever the preflight count
    groups = len(todo) if settings.step_path == "eager" else -(-len(todo) // (settings.chunk or settings.batch))
    reference = None
    if settings.step_path != "eager" and first is not None and committed:
        # a resumed batched arm: its gate on the committed row with the shortest line, not on a new row; a row that
        # stopped at a gate (e.g. a transplant's precondition) decoded little and would check little, so it is
        # the reference only when every committed row did
        lines = list(zip(committed, parsed))
        line, rec = min([x for x in lines if not x[1].get("gate_failure")] or lines, key=lambda x: len(x[0]))
        reference, first = (next(p for p in problems if p.problem_id == rec["problem_id"]), line), None
    if settings.workers > 1 and groups > 1 and not pending:  # rows waiting for their check: in this process
        # the actors load the model; this process loads none (a second copy would sit on the first GPU)

        with RowActors(settings, row, chunk=chunk, workers=min(settings.workers, groups), faults=faults,
                       equivalence_ids=equivalence_ids, live_check_ids=checked) as pool:
            environment, run = pool.prepare(problems)  # prompts checked and contract recorded inside an actor
            ledger = Ledger(root, label, config, environment=environment, row_algorithm=version)
            if checked:
                ledger.log(**declared)
            ledger.log(event="workers", workers=pool.workers, devices=pool.devices, ray=pool.cluster["address"],
                       ray_started=pool.cluster["started"], startup_s=pool.startup)
            if run is not None:
                ledger.log(event="engine", **run.settings(settings.decoding))
            pooled = pool.mapper(todo, key=lambda p: p.problem_id, run=run, composition_id=first, reference=reference,
                                 on_checks=gate_recorder(ledger.log, ledger.dir, ids[0]))
            try:
                records = run_rows(
                    ledger, list(problems), None, key=lambda p: p.problem_id, mapper=pooled,
                    preflight=settings.preflight, progress=progress, desc=f"{name} {settings.dtype} x{pool.workers}",
                    validate=lambda rec: validate_row(name, rec), started=started,
                )
            finally:
                for event in pool.events:
                    ledger.log(**event)
        return records, ledger
    lm, block_format = settings.load()
    check_prompts(block_format, problems, context_length(lm.model.config), caps=settings.caps)  # before the ledger folder exists
    run = settings.engine_run(block_format, problems, lm.model.config)
    ledger = Ledger(root, label, config, environment=arm_environment(lm, block_format, settings, run), row_algorithm=version)
    spec = settings.run_spec(lm, block_format, run, faults=faults, equivalence_ids=equivalence_ids,
                             live_check_ids=checked)
    if checked:
        ledger.log(**declared)

    def logged(rec: Any) -> Any:
        """``rec``, after the live checks passed since the last record are written to the run log."""
        if spec.live_checks:
            ledger.log(event="live_check_passed", checks=list(spec.live_checks))
            spec.live_checks.clear()
        return rec

    mapper: Callable[[list[Problem]], Iterable[Mapping[str, Any]]] | None
    row_fn: Callable[[Problem], _Record] | None
    if run is None:
        mapper, row_fn = None, (lambda p: logged(row(spec, p)))
    else:
        assert chunk is not None  # a non-eager step path without a chunk function was refused above
        batched = BatchedRows(spec, chunk, todo, composition_id=first, reference=reference,
                              on_checks=gate_recorder(ledger.log, ledger.dir, ids[0]),
                              on_chunk=lambda stats: ledger.log(event="chunk", **stats))
        mapper, row_fn = (lambda items: (logged(rec) for rec in batched(items))) if checked else batched, None
        ledger.log(event="engine", **run.settings(settings.decoding))
    if settings.dtype != "float32":  # the float32 equivalence check also on a sample of each chunk's other rows
        if mapper is None:
            assert row_fn is not None
            one = row_fn
            mapper = lambda items: (one(p) for p in items)  # noqa: E731
        mapper, row_fn = sampled_equivalence(mapper, spec, {p.problem_id: p for p in problems}, equivalence_ids,
                                             EAGER_SAMPLE_CHUNK if run is None else settings.chunk or settings.batch,
                                             ledger.log), None
    if pending:  # before any new row: the check a kill, Ctrl-C or crash kept from running on committed rows
        recheck_pending([by_id[i] for i in pending], spec, {p.problem_id: p for p in problems}, equivalence_ids,
                        EAGER_SAMPLE_CHUNK if run is None else settings.chunk or settings.batch, ledger.log)
    records = run_rows(
        ledger, list(problems), row_fn, key=lambda p: p.problem_id, mapper=mapper,
        preflight=settings.preflight, progress=progress, desc=f"{name} {settings.dtype}",
        validate=lambda rec: validate_row(name, rec), started=started,
    )
    return records, ledger
