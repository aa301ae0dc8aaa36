"""Rows on Ray actors: one actor per GPU or per CPU worker, on a local Ray cluster or an existing one.

Rows of an experiment are independent pure functions of (model, contract,
problem), so they can be computed in any process, on any host. With
``ArmSettings.workers > 1``, :func:`kvreplay.runner.run_arm` runs an arm
on :class:`RowActors`. Each actor applies the arm's
:class:`~kvreplay.model.execution.ExecutionContract` before it loads the model (intra-op
threads, deterministic algorithms, TF32, SDPA backends, exactly as a
sequential run does). It loads the model once and then computes groups of rows
on request: one problem at a time on the eager path, or a chunk of ``batch``
problems through the batched engine (:class:`~kvreplay.runner.BatchedRows`),
so each actor's batch slots stay full. On CUDA each actor holds one GPU
(``num_gpus=1``; Ray sets ``CUDA_VISIBLE_DEVICES``), or a share of one when
there are more actors than GPUs.

:meth:`RowActors.mapper` yields the records in item order. Every actor is kept
fed with up to :data:`DEPTH` groups while the driver appends finished records
in order (:func:`kvreplay.ledger.run_rows`). So the ledger is append-only,
ordered, resumable and byte-identical to a sequential run's, whatever the
number of actors (tests check this).

A dead actor loses no finished row: Ray restarts it (up to
:data:`MAX_RESTARTS` times, reloading the model) and retries its rows in
flight. An actor that cannot be restarted (or is killed for good) has its rows
in flight sent to the surviving actors. Rows are pure, so a retried row gives
the same bytes.

The cluster: :func:`connect` starts a local one (dashboard off, actors'
output not forwarded, only the CPUs and GPUs the actors need), or joins an
existing one at ``ArmSettings.ray_address`` or ``$RAY_ADDRESS``. Once
started or joined, the connection lasts until :func:`shutdown` or the end of
the process, and later arms reuse it. Row functions and hooks defined outside
the library (a notebook's lambda, a test's fault hook) are sent by value.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import torch

from ..model.execution import device_type
from ..model.models import context_length
from .batched import BatchedRows
from .spec import EngineRun, arm_environment, check_prompts

DEPTH = 2
"""Groups of rows in flight per actor: the next one waits in the actor's queue while it computes the current one."""

MAX_RESTARTS = 2
"""How often Ray restarts a dead actor (and retries its rows in flight) before its rows go to the other actors."""

FORWARDED_ENV = ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG")
"""Environment variables of this process that each actor gets too (when set here)."""

LOCAL_OBJECT_STORE_BYTES = 256 * 2**20
"""Object store of a local cluster: rows are small JSON-like records, so Ray's default (30% of RAM) is not taken."""


PACKAGE_DIR = Path(__file__).resolve().parents[1]
"""The ``kvreplay`` package folder, shipped to a remote Ray cluster's workers as a ``py_modules`` entry."""


def actor_resources(device: str, workers: int, threads: int, gpus: float) -> dict:
    """Ray resources of each row actor: ``{"num_cpus": threads, "num_gpus": share}``.

    On CUDA each actor gets one GPU when ``workers <= gpus``; with more actors
    than GPUs they share them (``num_gpus = gpus / workers``, rounded down to
    Ray's 1e-4 resolution). On the CPU ``num_gpus`` is 0.

    Args:
        device: the arm's device: ``"cpu"`` or ``"cuda"`` (Ray gives each actor its GPU, so an explicit
            ``"cuda:N"`` is refused).
        workers: number of actors (at least 1).
        threads: intra-op threads of each actor (its ``num_cpus``).
        gpus: GPUs of the cluster (``ray.cluster_resources()["GPU"]``; 0 if none).

    Raises:
        ValueError: ``workers < 1``; ``cuda:N``; ``cuda`` on a cluster with no GPU; an unknown device.
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    kind = device_type(device)  # ValueError naming a device torch cannot parse
    pinned = torch.device(device).index is not None
    if kind == "cpu" and not pinned:
        return {"num_cpus": threads, "num_gpus": 0}
    if kind != "cuda":
        raise ValueError(f"unknown device {device!r} for row actors; use 'cpu' or 'cuda'")
    if pinned:
        raise ValueError(f"device {device!r} pins one GPU, but Ray gives each of the {workers} row actors its own: "
                         f"use device 'cuda' (or workers=1 to run in this process on {device})")
    if gpus <= 0:
        raise ValueError("device 'cuda' asked for, but the Ray cluster has no GPU")
    share = 1.0 if workers <= gpus else math.floor(1e4 * gpus / workers) / 1e4
    return {"num_cpus": threads, "num_gpus": share}


def _ray():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # offline by contract: no usage report
    # Ray starts its workers at niceness 15 by default; beside any other CPU-bound job a row actor then gets a few
    # percent of a core. Row actors do the run's work, so they run at the driver's priority (read by a local
    # cluster when ray.init starts it; changes no bit).
    os.environ.setdefault("RAY_worker_niceness", "0")
    import ray

    return ray


def connect(address: str | None = None, *, num_cpus: int | None = None, num_gpus: int | None = None) -> dict:
    """Join or start the Ray cluster that row actors run on (once per process; later calls reuse it).

    Args:
        address: an existing cluster (``"auto"``, ``"host:port"`` of its head, or ``"ray://host:10001"``);
            ``None`` takes ``$RAY_ADDRESS``, and without it starts a local cluster.
        num_cpus, num_gpus: logical CPUs and GPUs of a local cluster (ignored when joining one).

    A local cluster starts without the dashboard, with the actors' output not
    forwarded to this process, Ray's own log at ERROR and a
    :data:`LOCAL_OBJECT_STORE_BYTES` object store. When joining an existing
    cluster, this library is sent with the job (Ray ``py_modules``), so every
    node computes rows with the same code; each node still needs this
    project's environment (the lock's torch and transformers).

    Returns:
        ``{"address": ..., "started": bool (a local cluster was started here), "seconds": start-up or join time,
        "resources": the cluster's total resources}``.

    Raises:
        RuntimeError: this process is already connected to another cluster than ``address``;
        ConnectionError (from Ray): the cluster at ``address`` cannot be reached.
    """
    ray = _ray()
    address = address or os.environ.get("RAY_ADDRESS") or None
    t0 = time.perf_counter()
    started = False
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if address and address != "auto" and not address.startswith("ray://") and address != current:
            raise RuntimeError(f"this process is connected to the Ray cluster at {current}, not {address!r}; "
                               f"call kvreplay.runner.actors.shutdown() first to join another")
    else:
        quiet = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
        if address:
            ray.init(address=address, runtime_env={"py_modules": [str(PACKAGE_DIR)]}, **quiet)
        else:
            ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus,
                     object_store_memory=LOCAL_OBJECT_STORE_BYTES, **quiet)
            started = True
    return {"address": ray.get_runtime_context().gcs_address, "started": started,
            "seconds": round(time.perf_counter() - t0, 3), "resources": dict(ray.cluster_resources())}


def shutdown() -> None:
    """Disconnect from the Ray cluster (a local cluster started by :func:`connect` stops with it); no-op if none."""
    ray = _ray()
    if ray.is_initialized():
        ray.shutdown()


def _send_by_value(*fns) -> None:
    """Have Ray pickle by value the modules of callables defined outside the library and installed packages.

    Such a module (a test file, a script) cannot be imported by an actor on
    another process or host; ``__main__`` (a notebook) is always sent by value.
    """
    from ray import cloudpickle

    roots = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, Path(__file__).parent)}
    for fn in fns:
        mod = sys.modules.get(getattr(fn, "__module__", None) or "")
        path = getattr(mod, "__file__", None)
        if mod is None or mod.__name__ == "__main__" or path is None:
            continue
        if not any(Path(path).resolve().is_relative_to(r) for r in roots):
            cloudpickle.register_pickle_by_value(mod)


class RowActor:
    """One row actor (a Ray actor class once wrapped by :class:`RowActors`): one model, rows on request.

    Its start-up never raises: a failure is kept and re-raised, named, by every
    later call, so the caller sees why instead of a dead actor.
    """
    def __init__(self, settings, row: Callable, chunk: Callable | None, faults: Callable | None,
                 equivalence_ids: frozenset, live_check_ids: frozenset = frozenset()):
        self.device = settings.device
        self.error: BaseException | None = None
        try:
            import ray

            gpus = ray.get_gpu_ids()
            self.device = settings.device + (f" (GPU {','.join(map(str, gpus))})" if gpus else "")
            lm, fmt = settings.load()  # the contract is applied before the model loads
            self.settings, self.row, self.chunk = settings, row, chunk
            self.spec = settings.run_spec(lm, fmt, faults=faults, equivalence_ids=equivalence_ids,
                                          live_check_ids=live_check_ids)
            self.gated = False  # this actor passed its own preflight gate (a restarted actor starts over)
        except BaseException as e:  # noqa: BLE001 (re-raised, named, by ready() and every call)
            self.error = e

    def _ready(self) -> None:
        if self.error is not None:
            e = self.error
            raise RuntimeError(f"row actor (pid {os.getpid()}, device {self.device}) failed to start: "
                               f"{type(e).__name__}: {e}") from e

    def ready(self) -> dict:
        """``{"pid", "device", "node"}`` once the model is loaded (RuntimeError naming the cause if it is not)."""
        import ray

        self._ready()
        return {"pid": os.getpid(), "device": self.device, "node": ray.get_runtime_context().get_node_id()[:12]}

    def prepare(self, problems: Sequence) -> tuple[dict, EngineRun | None]:
        """Check every prompt against the block contract and the context; return the ledger environment and engine run.

        Raises:
            ContractError: a problem violates the contract or its sequence can exceed the model's context;
            ValueError: a ``max_len`` too short for the arm's problems.
        """
        self._ready()
        spec = self.spec
        check_prompts(spec.fmt, problems, context_length(spec.lm.model.config), caps=spec.caps)
        run = self.settings.engine_run(spec.fmt, problems, spec.lm.model.config)
        return arm_environment(spec.lm, spec.fmt, self.settings, run), run

    def rows(self, group: list, run=None, composition_id: str | None = None,
             reference: tuple | None = None) -> tuple[list[dict], list[dict]]:
        """Records of one group of problems in order, and the preflight gates passed (batched path).

        ``run`` is ``None`` on the eager path: ``row(spec, problem)`` for each
        problem. Else it is the batched engine's resolved shape (``EngineRun``)
        and the group is one chunk of the engine
        (:class:`~kvreplay.runner.BatchedRows`). Every actor gates its own
        engine (its own captured graph, on its own device) before it returns
        its first group: a resumed arm's actor on ``reference`` (a committed
        row and its line, recomputed alone and required equal byte for byte),
        a new arm's on ``composition_id`` when its first group holds it, else
        on that group's first problem. Both come with every call, so an actor
        that Ray restarts (a new process, a new graph) needs no other state
        than its model, and gates again.

        Raises:
            GateError: ``composition`` or ``graph_equals_eager``; whatever a row raised.
        """
        import dataclasses

        self._ready()
        if run is None:
            return [self.row(self.spec, p) for p in group], []
        if self.chunk is None:
            raise ValueError("row actor: an engine run needs the arm's chunk function (RowActors(..., chunk=...))")
        spec = dataclasses.replace(self.spec, engine=run, memo=self.spec.memo)
        ids = [p.problem_id for p in group]
        gate_on = composition_id if composition_id in ids else None
        if not self.gated and reference is None and gate_on is None:
            gate_on = ids[0]
        batched = BatchedRows(spec, self.chunk, group, composition_id=gate_on,
                              reference=None if self.gated else reference)
        records = list(batched(group))
        self.gated = True
        return records, [check | {"actor_pid": os.getpid(), "device": self.device} for check in batched.checks]


class RowActors:
    """Row actors of one arm on a Ray cluster; use as a context manager (the actors are killed on exit).

    Args:
        settings: the arm's :class:`~kvreplay.runner.ArmSettings` (each actor loads the model with it;
            ``settings.workers`` actors unless ``workers`` is given; ``settings.ray_address`` or
            ``$RAY_ADDRESS`` names an existing cluster, else a local one is started).
        row: ``(RunSpec, problem) -> record``, the function a sequential run maps.
        chunk: ``(RunSpec, problems) -> records``, the batched runner (:func:`~kvreplay.experiments.live_vs_prefill.live_vs_prefill_chunk`,
            ...), used when :meth:`prepare` resolves an engine run (``settings.step_path`` not eager).
        faults: optional boundary-state hook passed into each actor's RunSpec (tests).
        equivalence_ids: problem IDs that carry the float32 construction-equivalence gate (the preflight rows).
        live_check_ids: problem IDs that carry the ``live_equals_incremental`` gate (:attr:`RunSpec.live_check_ids`).

    Attributes:
        workers: number of actors; actors: their Ray handles; devices: each actor's device (and Ray GPU IDs);
        cluster: what :func:`connect` returned; startup: ``{"ray_s", "actors_s"}`` (cluster start or join, and
        actors created with their model loaded).

    Raises:
        ValueError: bad ``workers``, device or a cluster with too few CPUs or GPUs for the actors
            (:func:`actor_resources`);
        RuntimeError: an actor failed to start (its cause is named; the other actors are killed).
    """
    def __init__(self, settings, row: Callable, *, chunk: Callable | None = None, workers: int | None = None,
                 faults: Callable | None = None, equivalence_ids: frozenset = frozenset(),
                 live_check_ids: frozenset = frozenset()):
        ray = _ray()
        self.workers = workers or settings.workers
        self.actors: list = []
        self.dead: set[int] = set()
        self.events: list[dict] = []  # actors lost during the run, for the ledger's run log
        t0 = time.perf_counter()
        address = settings.ray_address or os.environ.get("RAY_ADDRESS") or None
        local_gpus = 0
        if address is None and settings.contract().device_type == "cuda":
            import torch

            local_gpus = torch.cuda.device_count()
        # checked before any cluster starts: workers, device, and GPUs of a local cluster
        actor_resources(settings.device, self.workers, settings.threads, math.inf if address else local_gpus)
        self.cluster = connect(address, num_cpus=self.workers * settings.threads, num_gpus=local_gpus)
        total = self.cluster["resources"]
        res = actor_resources(settings.device, self.workers, settings.threads, total.get("GPU", 0))
        for kind, key in (("CPU", "num_cpus"), ("GPU", "num_gpus")):
            need = round(self.workers * res[key], 4)
            if need > total.get(kind, 0) + 1e-9:
                raise ValueError(f"{self.workers} row actors need {need:g} {kind}s ({res[key]:g} each), but the Ray "
                                 f"cluster at {self.cluster['address']} has {total.get(kind, 0):g}")
        t1 = time.perf_counter()
        _send_by_value(row, chunk, faults)
        env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
        env |= {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(settings.threads)}  # set before torch loads
        cls = ray.remote(RowActor).options(max_restarts=MAX_RESTARTS, max_task_retries=MAX_RESTARTS,
                                           runtime_env={"env_vars": env}, **res)
        self.actors = [cls.remote(settings, row, chunk, faults, frozenset(equivalence_ids), frozenset(live_check_ids))
                       for _ in range(self.workers)]
        try:
            info = self._get([a.ready.remote() for a in self.actors])
        except BaseException:
            self.close()
            raise
        self.devices = [i["device"] for i in info]
        self.info = info
        self.startup = {"ray_s": round(t1 - t0, 3), "actors_s": round(time.perf_counter() - t1, 3)}

    @staticmethod
    def _get(refs):
        """``ray.get`` that raises a task's own exception (GateError, ContractError, ...) rather than Ray's wrapper."""
        ray = _ray()
        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause
            if isinstance(cause, BaseException) and not isinstance(cause, ray.exceptions.RayTaskError):
                raise cause from None
            raise

    def live(self) -> list[int]:
        return [i for i in range(len(self.actors)) if i not in self.dead]

    def prepare(self, problems: Sequence) -> tuple[dict, EngineRun | None]:
        """In one actor: check every prompt, return ``(environment, engine run or None)`` (see :meth:`RowActor.prepare`)."""
        return self._get(self.actors[self.live()[0]].prepare.remote(list(problems)))

    def mapper(self, todo: Sequence, *, key: Callable, run=None, composition_id: str | None = None,
               on_checks: Callable[[list[dict]], None] | None = None, reference: tuple | None = None) -> "ActorRows":
        """A :func:`~kvreplay.ledger.run_rows` mapper over ``todo`` (the rows still to compute, in order).

        ``run`` (the engine run :meth:`prepare` returned) makes groups of
        ``run.problems_per_chunk`` problems computed by the batched engine; every actor passes the
        preflight gate on its own first group (:meth:`RowActor.rows`: on ``reference``, a resumed arm's
        committed ``(problem, line)``, or on ``composition_id``); ``None`` makes groups of one row.
        """
        return ActorRows(self, todo, key, run, composition_id, on_checks, reference)

    def _ordered(self, groups: list[list], run=None, composition_id: str | None = None, reference: tuple | None = None
                 ) -> Iterator[tuple[list[dict], list[dict]]]:
        """``(records, checks)`` of each group, computed on the actors, yielded in group order.

        Raises (in group order, after the groups before it were yielded):
            whatever a group's rows raised;
            RuntimeError if no actor is left alive (the rows finished before stay yielded).
        """
        ray = _ray()
        pending = deque(range(len(groups)))
        inflight: dict = {}  # ObjectRef -> (group index, actor index)
        load = dict.fromkeys(range(len(self.actors)), 0)
        done: dict[int, tuple[list[dict], list[dict]] | BaseException] = {}  # group -> (records, checks), or its error
        nxt = 0
        while nxt < len(groups):
            while pending and self.live():
                a = min(self.live(), key=load.__getitem__)
                if load[a] >= DEPTH:
                    break
                g = pending.popleft()
                inflight[self.actors[a].rows.remote(groups[g], run, composition_id, reference)] = (g, a)
                load[a] += 1
            if nxt in done:
                out = done.pop(nxt)
                nxt += 1
                if isinstance(out, BaseException):
                    raise out
                yield out
                continue
            if not inflight:
                raise RuntimeError(f"every row actor died ({len(self.actors)} started); the rows finished before "
                                   f"are in the ledger, and a new run resumes from there")
            (ref,), _ = ray.wait(list(inflight), num_returns=1)
            g, a = inflight.pop(ref)
            load[a] -= 1
            try:
                done[g] = self._get(ref)
            except ray.exceptions.RayActorError as e:  # died for good (restarts spent, or killed without restart)
                if a not in self.dead:
                    self.dead.add(a)
                    self.events.append({"event": "actor_lost", "actor": a, "device": self.devices[a],
                                        "error": f"{type(e).__name__}: {str(e)[:300]}"})
                pending = deque(sorted([*pending, g]))  # its rows go to the actors still alive
            except Exception as e:  # noqa: BLE001 (the row's own error, raised in order)
                done[g] = e

    def close(self) -> None:
        """Kill the actors (their processes end and release their GPU); the cluster stays for later arms."""
        ray = _ray()
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 (already dead)
                pass
        self.actors = []

    def __enter__(self) -> "RowActors":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ActorRows:
    """The ordered mapper of :meth:`RowActors.mapper`: called with items in order, yields their records in order.

    ``todo`` is cut into consecutive groups of ``size``; a call dispatches every
    group that holds one of its items (and that was not computed yet), spread
    over the actors, and yields records in item order. A group's records for
    items not asked for yet are held until they are (the first batched group
    holds the preflight problems and others; those are appended only after the
    preflight rows passed, as in a sequential batched run).

    Attributes:
        checks: preflight gates the actors passed (``composition``, ``graph_equals_eager``; each actor's own,
            with its ``actor_pid`` and ``device``), for the run log.
    """
    def __init__(self, pool: RowActors, todo: Sequence, key: Callable, run=None, composition_id: str | None = None,
                 on_checks: Callable[[list[dict]], None] | None = None, reference: tuple | None = None):
        self.pool, self.key, self.run, self.composition_id = pool, key, run, composition_id
        self.reference = reference
        self.on_checks = on_checks
        size = run.problems_per_chunk if run is not None else 1
        self.groups = [list(todo[i : i + size]) for i in range(0, len(todo), size)]
        self.group_of = {key(it): g for g, group in enumerate(self.groups) for it in group}
        self.held: dict[str, dict] = {}
        self.sent: set[int] = set()
        self.checks: list[dict] = []

    def __call__(self, items: Iterable) -> Iterator[dict]:
        items = list(items)
        wanted = sorted({self.group_of[self.key(it)] for it in items if self.key(it) not in self.held} - self.sent)
        self.sent |= set(wanted)
        stream = zip(wanted, self.pool._ordered([self.groups[g] for g in wanted], self.run, self.composition_id,
                                                self.reference))
        for it in items:
            k = self.key(it)
            while k not in self.held:
                g, (records, checks) = next(stream)
                if len(records) != len(self.groups[g]):
                    raise RuntimeError(f"a row actor returned {len(records)} records for a group of {len(self.groups[g])}")
                self.held.update(zip(map(self.key, self.groups[g]), records))
                self.checks += checks
                if checks and self.on_checks is not None:
                    self.on_checks(checks)
            yield self.held.pop(k)
