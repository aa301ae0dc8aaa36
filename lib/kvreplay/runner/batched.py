"""The batched runner's chunk mapper and the record comparisons behind its gates (paper §3.9).

:class:`BatchedRows` computes an arm's rows a chunk of problems at a time on the batched engine
(:mod:`kvreplay.engine`). It runs the preflight gates ``composition``, ``graph_equals_eager`` and, for an
attention of the engine's own, ``attention_tolerance`` on a chunk's first problem (or, when an arm resumes, on a
committed row). It stops before a chunk that would end after the call's deadline (:data:`CHUNK_DEADLINE_ENV`).
:func:`gate_recorder` logs the gates and keeps the arm's attention check in its ``environment.json``.
:func:`first_difference` and :func:`leaves` compare two records leaf by leaf; ``make verify`` uses them too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ..engine import EngineStats, Measured
from ..gates import GateError
from ..ledger.files import ENVIRONMENT_TODO, atomic_write, read_json
from ..ledger.store import canonical_json
from ..data.problems import Problem
from .spec import EngineRun, RunSpec

GRAPH_CHECK_STEPS = 32
"""Steps of each engine of a new arm's first chunk (a resumed arm's reference run) checked against the eager step on
the graph path (gate ``graph_equals_eager``): the step is one captured graph, so its first steps stand for all."""

CHUNK_DEADLINE_ENV = "KV_CHUNK_DEADLINE"

FIRST_CHUNK_ESTIMATE_ENV = "KV_FIRST_CHUNK_ESTIMATE"
"""Seconds the arm's first chunk is expected to take, gates included (e.g. the longest chunk in an earlier run log
of the same arm): with :data:`CHUNK_DEADLINE_ENV`, a first chunk that would end after the deadline is not
started either. Unset: a first chunk always starts."""


class ChunkDeadline(RuntimeError):
    """A batched arm stopped at a chunk boundary: the next chunk would have ended after ``KV_CHUNK_DEADLINE``."""


class BatchedRows:
    """A :func:`kvreplay.ledger.run_rows` mapper that computes rows a chunk of ``B`` problems at a time.

    Called with items in problem order, it yields their records in that
    order. Each chunk is the next ``spec.engine.problems_per_chunk`` problems of ``todo``
    (the arm's rows still to compute) from the first item not computed yet,
    so the preflight call computes its chunk's other problems ahead. Their
    records are held and yielded (and appended) only when
    :func:`~kvreplay.ledger.run_rows` asks for them, after the preflight rows
    passed. A problem's bits do not depend on which chunk it falls in (the
    batch shape is the arm's), which the ``composition`` gate checks.

    Composition gate: when a chunk holds ``composition_id`` (a new arm's first problem), that problem is decoded
    twice in the chunk: in its place, and as a copy queued after every other problem. The copy starts when a
    slot frees late in the chunk: beside other companions, at another time and, as the queue hands slots out, in
    other slots. With a chunk of more problems than slots it costs about one problem's steps in the ragged tail.
    The two records must agree byte for byte in canonical JSON: a problem's bits depend neither on its companions
    nor on its slot. On the graph path the same chunk also re-runs the first :data:`GRAPH_CHECK_STEPS` steps of
    its engines eagerly (gate ``graph_equals_eager``). With an attention other than ``sdpa`` it checks every
    layer's attention output of its first step that holds a boundary against the math-SDPA reference (gate
    ``attention_tolerance``, :meth:`kvreplay.engine.StepEngine.check_attention`).

    A run that resumes an arm is given ``reference`` instead: a committed row of the ledger, computed inside a
    chunk by an earlier run. It is computed alone before the first chunk (a chunk of one at the same ``B`` and
    ``max_len``, the other slots idle, its jobs placed from the *last* slot down) and must equal its committed
    line byte for byte. This checks the companions as above and that this run's bits are the ledger's: a code or
    machine change that moved them stops the arm before it appends a row. The graph and attention checks run
    with it.

    Args:
        spec: the arm's run spec (``spec.engine`` set).
        chunk: ``(spec, problems) -> records``, a :class:`~kvreplay.engine.Measured` list whose ``stats`` sum the
            chunk's engines (:func:`kvreplay.experiments.live_vs_prefill.live_vs_prefill_chunk`, ...).
        todo: the problems to compute, in order.
        composition_id: problem ID of the composition gate, or ``None``.
        reference: ``(problem, committed line)`` of a resumed arm (the line as in ``rows.jsonl``, without its
            newline), checked before the first chunk; or ``None``.
        on_checks: called with the preflight gates just passed (``checks`` entries), as soon as they pass,
            so that an arm stopped later still has them in its run log.
        on_chunk: called after each chunk with ``{"chunk", "problems", "seconds", "steps", "slot_steps",
            "busy_slot_steps", "occupancy"}`` (the engines' step counts of the chunk: the ``stats`` its chunk
            function returned, :meth:`~kvreplay.engine.EngineStats.chunk_event`).

    Deadline: when the environment variable :data:`CHUNK_DEADLINE_ENV` holds
    a wall-clock time (seconds since the epoch, as ``time.time()``), a chunk
    is not started if the longest chunk computed so far by this mapper would
    end after it. The first chunk always starts, unless :data:`FIRST_CHUNK_ESTIMATE_ENV` gives its expected
    time and that would end after the deadline. A chunk's time counts the gates that ran in it; a resumed arm's
    reference run is left out (it runs once a mapper). A lent machine's time limit
    kills a process mid-chunk and loses that chunk's rows, so stopping at a
    chunk boundary keeps the device time for the next call. The rows already
    yielded are in the ledger; the arm resumes from there.

    Raises (while iterating):
        GateError: ``composition``, ``graph_equals_eager`` or ``attention_tolerance``.
        TypeError: a chunk function that returned no :class:`~kvreplay.engine.Measured` list.
        ChunkDeadline: the next chunk (or, by its estimate, the first) would end after the deadline.
    """
    def __init__(self, spec: RunSpec, chunk: Callable, todo: Sequence[Problem], composition_id: str | None = None,
                 on_checks: Callable[[list[dict]], None] | None = None,
                 reference: tuple[Problem, str] | None = None,
                 on_chunk: Callable[[dict], None] | None = None):
        self.spec, self.chunk, self.todo = spec, chunk, list(todo)
        self.on_checks = on_checks
        self.on_chunk = on_chunk
        self.seconds: list[float] = []  # wall time of each chunk computed, its preflight gates left out
        self.position = {p.problem_id: i for i, p in enumerate(self.todo)}
        self.composition_id = composition_id
        self.reference = reference
        self.held: dict[str, dict] = {}
        self.chunks: list[list[str]] = []
        self.checks: list[dict] = []  # the preflight gates passed: gate, problem, seconds, steps checked

    @property
    def _run(self) -> EngineRun:
        """``spec.engine``, the batch shape and step path every chunk runs at.

        Raises:
            ValueError: the spec has no engine run (a batched runner needs one).
        """
        if self.spec.engine is None:
            raise ValueError("BatchedRows: spec.engine is not set (the batched runner needs the engine's batch shape)")
        return self.spec.engine

    def __call__(self, items) -> Iterator[dict]:
        for it in items:
            if it.problem_id not in self.held:
                start = self.position[it.problem_id]
                size = self._run.problems_per_chunk
                group = [p for p in self.todo[start : start + size] if p.problem_id not in self.held]
                deadline = os.environ.get(CHUNK_DEADLINE_ENV)
                estimate = os.environ.get(FIRST_CHUNK_ESTIMATE_ENV)
                expected = max(self.seconds) if self.seconds else float(estimate) if estimate else None
                if deadline and expected is not None and time.time() + expected > float(deadline):
                    which, why = (("a", f"the longest chunk so far took {expected:.0f} s (its gates left out)")
                                  if self.seconds else
                                  ("the first", f"{FIRST_CHUNK_ESTIMATE_ENV} says {expected:.0f} s (gates included)"))
                    raise ChunkDeadline(f"not starting {which} chunk of {len(group)} problems at {it.problem_id}: "
                                        f"{why} and {CHUNK_DEADLINE_ENV} is {float(deadline) - time.time():.0f} s away")
                if self.reference is not None:
                    before = len(self.checks)
                    self.check_reference(*self.reference)
                    self.reference = None
                    if self.on_checks is not None:
                        self.on_checks(self.checks[before:])
                ids = [p.problem_id for p in group]
                probe = ids.index(self.composition_id) if self.composition_id in ids else None
                t0, run = time.perf_counter(), self._run
                if probe is not None:  # the preflight gates ride along in this chunk: composition probe queued last
                    run = dataclasses.replace(run, verify_steps=self._verify_steps, tolerance_check=True)
                members = group + [group[probe]] if probe is not None else group
                records, stats = self._computed(dataclasses.replace(self.spec, engine=run), members)
                self.seconds.append(time.perf_counter() - t0)  # its gates included: they ride in the chunk
                self.chunks.append(ids)
                if self.on_chunk is not None:
                    self.on_chunk(stats.chunk_event(len(group), self.seconds[-1]) | {"chunk": len(self.chunks)})
                if probe is not None:
                    before = len(self.checks)
                    self.check_composition(group[probe], records[probe], records[-1], len(group), run, stats)
                    records = records[:-1]
                    if self.on_checks is not None:
                        self.on_checks(self.checks[before:])
                self.held.update(zip(ids, records))
            yield self.held.pop(it.problem_id)

    def _computed(self, spec: RunSpec, problems: Sequence[Problem]) -> tuple[list[dict], EngineStats]:
        """The chunk function's records of ``problems`` at ``spec`` and what its engines measured.

        Raises:
            TypeError: the chunk function returned no :class:`~kvreplay.engine.Measured` list."""
        records = self.chunk(spec, problems)
        if not isinstance(records, Measured):
            raise TypeError(f"BatchedRows: the chunk function returned a {type(records).__name__}, not the "
                            "kvreplay.engine.Measured list (records with their engines' stats) it must return")
        return list(records), records.stats

    @property
    def _verify_steps(self) -> int:
        """Steps of each engine checked against the eager step: :data:`GRAPH_CHECK_STEPS` on the graph path, else 0."""
        return GRAPH_CHECK_STEPS if self._run.step_path == "graph" else 0

    def check_composition(self, problem: Problem, record: dict, again: dict, size: int, run: EngineRun,
                          stats: EngineStats) -> None:
        """The composition gate on one problem decoded twice in one chunk (and the gates that ran with it).

        ``again`` is the record of its second copy, queued after every other problem of the chunk. That copy
        starts when a slot frees late in the chunk: beside other companions, at another time and, as the queue hands
        slots out, in other slots. Its record must equal ``record`` byte for byte in canonical JSON. Also recorded
        here, as they ran inside the chunk (its engines' ``stats``): ``graph_equals_eager`` (the chunk's first
        :data:`GRAPH_CHECK_STEPS` steps of each engine re-run eagerly) and the first ``attention_tolerance`` check.

        Raises:
            GateError: ``composition`` naming the first differing leaf, or ``attention_tolerance`` when the chunk
                decoded no boundary to check.
        """
        if canonical_json(again) != canonical_json(record):
            where = first_difference(again, record) or "?"
            raise GateError("composition", f"problem {problem.problem_id}: its record decoded a second time in its "
                            f"chunk of {size} problems (queued last: other companions and slots; B={run.batch}, "
                            f"max_len={run.max_len}) differs from its first, first at {where!r}; a problem's bits "
                            "depend on its companions or its slot")
        self.checks.append({"gate": "composition", "problem_id": problem.problem_id, "chunk": size,
                            "batch": run.batch, "max_len": run.max_len, "probe": "second copy queued last in its chunk"})
        self._ran_with(problem, record, run, stats)

    def _ran_with(self, problem: Problem, record: dict, run: EngineRun, measured: EngineStats) -> None:
        """Record the ``graph_equals_eager`` and ``attention_tolerance`` checks that ran in engines at ``run``, as
        their ``measured`` stats give them.

        Raises:
            GateError: ``attention_tolerance`` when an attention of the engine's own checked no boundary.
        """
        if run.verify_steps:
            self.checks.append({"gate": "graph_equals_eager", "problem_id": problem.problem_id,
                                "steps_checked": measured.verified_steps})
        if run.attention != "sdpa":
            checked = measured.attention_checks
            if not checked and not record.get("gate_failure"):
                raise GateError("attention_tolerance", f"problem {problem.problem_id}: its chunk decoded no "
                                f"boundary, so attention {run.attention!r} was not checked against the reference")
            for c in checked[:1]:  # the first: on a boundary of the chunk
                self.checks.append({k: v for k, v in c.items() if k != "where"} | {"problem_id": problem.problem_id})

    def check_reference(self, problem: Problem, line: str) -> None:
        """The composition gate of a resumed arm (and, on the graph path, ``graph_equals_eager``) on a committed row.

        ``problem``'s record is computed alone at the arm's batch shape and must equal ``line``, its committed
        ``rows.jsonl`` line (canonical JSON, no newline), byte for byte.

        Raises:
            GateError: ``composition`` naming the first differing leaf, or ``graph_equals_eager``.
        """
        run = self._run
        alone, seconds = self._alone(problem)
        if canonical_json(alone) != line:
            where = first_difference(alone, json.loads(line)) or "?"
            raise GateError("composition", f"problem {problem.problem_id}: its committed record (computed in a chunk "
                            f"by an earlier run) differs from its record computed alone by this run (B={run.batch}, "
                            f"max_len={run.max_len}, other slots idle), first at {where!r}; this run's bits are not "
                            f"the ledger's (another code version or machine?), so it appends nothing")
        self.checks.append({"gate": "composition", "problem_id": problem.problem_id, "reference": "committed row",
                            "batch": run.batch, "max_len": run.max_len, "seconds": seconds})

    def _alone(self, problem: Problem) -> tuple[dict, float]:
        """``problem``'s record computed in a chunk of one at the arm's batch shape, and the seconds it took.

        Its slots are handed out from the last one down, and the checks of :meth:`_ran_with` run with it.

        Raises:
            GateError: ``graph_equals_eager`` or ``attention_tolerance``.
        """
        run = self._run
        alone_run = dataclasses.replace(run, verify_steps=self._verify_steps, tolerance_check=True, fill_from="last")
        spec = dataclasses.replace(self.spec, engine=alone_run, memo=self.spec.memo)
        t0 = time.perf_counter()
        (alone,), stats = self._computed(spec, [problem])
        seconds = round(time.perf_counter() - t0, 3)
        self._ran_with(problem, alone, alone_run, stats)
        return alone, seconds


ENVIRONMENT_CHECK = "attention_tolerance"
"""The key under which an arm's ``environment.json`` keeps its ``attention_tolerance`` check (beside, not inside,
``execution_contract``, which a resumed run compares: the check is a measurement on the arm's first problem)."""


def gate_recorder(log: Callable[..., None], folder: str | Path, first_id: str | None) -> Callable[[list[dict]], None]:
    """The ``on_checks`` of an arm: log each batch of passed gates, and keep the attention check in the environment.

    The first ``attention_tolerance`` check on the arm's first problem (``first_id``: its first preflight row, on
    which a new arm's ``composition`` gate runs) goes into the ledger's ``environment.json``. It is written under
    :data:`ENVIRONMENT_CHECK` if that holds none yet: each layer's relative error, the largest, the tolerance,
    the attention and the dtype. Later runs (a resumed arm checks a committed row) only log theirs.

    Args:
        log: the ledger's ``log`` (``log(event="gates", checks=...)``).
        folder: the ledger folder.
        first_id: the arm's first problem ID, or ``None``.
    """
    path = Path(folder) / "environment.json"

    def record(checks: list[dict]) -> None:
        log(event="gates", checks=checks)
        for c in checks:
            if c.get("gate") == "attention_tolerance" and c.get("problem_id") == first_id and path.is_file():
                env = read_json(path, ENVIRONMENT_TODO)
                if ENVIRONMENT_CHECK not in env:
                    env[ENVIRONMENT_CHECK] = {k: v for k, v in c.items() if k not in ("actor_pid", "device", "gate")}
                    atomic_write(path, json.dumps(env, indent=1, sort_keys=True) + "\n")
    return record


_ABSENT = object()


_PATH_PART = re.compile(r"\[(\d+)\]|\.?([^.\[]+)")


def _path_order(path: str) -> list[tuple[int, object]]:
    """Sort key of a leaf path: keys as strings, list indices as numbers (``suffix[2]`` before ``suffix[10]``)."""
    return [(1, int(index)) if index else (0, name) for index, name in _PATH_PART.findall(path)]


def first_difference(a: dict, b: dict) -> str | None:
    """The first leaf path whose value differs between two records, or None.

    First in canonical JSON order: keys sorted, list elements by index (``suffix[2]`` before ``suffix[10]``,
    so a suffix is named at its first differing token).

    The composition gates name it where a record differs, and ``make verify`` (:mod:`kvreplay.verify`) where a
    recomputed record parts from its committed line. Leaves are :func:`leaves` with ``empty=True``; a leaf that
    only one record has is a difference, even where its value is None. An empty list facing a non-empty list or
    dict is not named itself: the difference is named at a leaf below it (``suffix[0]``).

    Args:
        a, b: records (nested dicts and lists of JSON scalars).

    Returns:
        A dotted path such as ``arms.prefill.suffix[12]``; None where every leaf agrees (the records may
        still differ as JSON: an empty dict against a missing key, 1 against 1.0).
    """
    la, lb = leaves(a, empty=True), leaves(b, empty=True)
    for k in sorted(la.keys() | lb.keys(), key=_path_order):
        x, y = la.get(k, _ABSENT), lb.get(k, _ABSENT)
        if x == y:
            continue
        below = (k + "[", k + ".")
        if [] in (x, y) and _ABSENT in (x, y) and any(p.startswith(below) for p in (la if x is _ABSENT else lb)):
            continue  # an empty list where the other record has leaves below the path: named at the first of them
        return k
    return None


def leaves(obj, prefix: str = "", *, empty: bool = False) -> dict[str, object]:
    """Flatten nested dicts/lists into ``path -> scalar`` (paths such as ``arms.prefill.suffix[3]``).

    With ``empty``, an empty list is a leaf of its own (``path -> []``); without, it leaves no path.
    """
    out: dict[str, object] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(leaves(v, f"{prefix}.{k}" if prefix else str(k), empty=empty))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(leaves(v, f"{prefix}[{i}]", empty=empty))
        if empty and not obj:
            out[prefix] = []
    else:
        out[prefix] = obj
    return out
