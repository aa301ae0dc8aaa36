"""Row-parallel execution on one machine (several worker processes; several per GPU, or one GPU each).

Rows of an experiment are independent pure functions of (model, contract,
problem), so they can be computed in any process. :class:`RowPool` starts
``workers`` processes (``spawn``: no CUDA or OpenMP state is inherited), each of
which applies the arm's :class:`~kvreplay.models.ExecutionContract`, loads
the model once and then computes rows on request. Its :meth:`RowPool.map`
yields the records in submission order, and :func:`kvreplay.ledger.run_rows`
appends them in that order, so the ledger is append-only, ordered,
resumable, and byte-identical to a sequential run's (tests check this).

The row function is sent to the workers with ``cloudpickle``, so a lambda
defined in a notebook works as it does sequentially.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import pickle
from collections.abc import Callable, Iterable, Iterator

_WORKER: dict = {}


def worker_devices(device: str, workers: int) -> list[str]:
    """The device each worker uses: ``cuda`` is spread round-robin over the visible GPUs; anything else is kept.

    Args:
        device: the arm's device (``"cpu"``, ``"cuda"`` or ``"cuda:N"``; an explicit index pins every worker).
        workers: number of worker processes (several per GPU suit small models; give as many as GPUs for large ones).

    Raises:
        ValueError: ``workers < 1``, or ``cuda`` with no visible GPU.
    """
    import torch

    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if device == "cuda":
        n = torch.cuda.device_count()
        if n == 0:
            raise ValueError("device 'cuda' asked for, but no CUDA device is visible")
        return [f"cuda:{i % n}" for i in range(workers)]
    return [device] * workers


def _init(settings_blob: bytes, row_blob: bytes, devices, lock, equivalence_ids=frozenset()) -> None:
    device = "?"
    # before torch is imported here: idle OpenMP threads of many workers must not spin on shared cores
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        from .experiments import RunSpec

        settings, faults = pickle.loads(settings_blob)
        with lock:
            device = devices.pop(0) if len(devices) else settings.device
        lm, fmt = settings.load(device)
        _WORKER.update(spec=RunSpec(lm=lm, fmt=fmt, caps=settings.caps, faults=faults, equivalence_ids=equivalence_ids),
                       settings=settings,
                       row=pickle.loads(row_blob), device=device)
    except BaseException as e:  # keep it: the first task re-raises it in the caller, instead of a broken pool
        _WORKER.update(error=e, device=device)


def _ready() -> None:
    if "error" in _WORKER:
        e = _WORKER["error"]
        raise RuntimeError(f"row worker (pid {os.getpid()}, device {_WORKER['device']}) failed to start: "
                           f"{type(e).__name__}: {e}") from e


def _task(item) -> dict:
    _ready()
    return _WORKER["row"](_WORKER["spec"], item)


def _prepare(problems) -> dict:
    from .experiments import arm_environment, check_prompts
    from .models import context_length

    _ready()
    spec = _WORKER["spec"]
    check_prompts(spec.fmt, problems, context_length(spec.lm.model.config), caps=spec.caps)
    return arm_environment(spec.lm, spec.fmt, _WORKER["settings"])


class RowPool:
    """A pool of worker processes that compute rows of one arm.

    Args:
        settings: the arm's :class:`~kvreplay.experiments.ArmSettings` (each
            worker loads the model with it; ``settings.workers`` is the pool size
            unless ``workers`` is given).
        row: ``(RunSpec, item) -> record``, the same function a sequential run uses.
        faults: optional boundary-state hook passed into each worker's RunSpec (tests).
        equivalence_ids: problem IDs that carry the float32 construction-equivalence gate (the preflight rows).

    Use as a context manager; ``pool.map(items)`` yields records in item order.
    Worker start-up (contract, model load) happens once per worker.
    """

    def __init__(self, settings, row: Callable, *, workers: int | None = None, faults: Callable | None = None,
                 equivalence_ids: frozenset = frozenset()):
        import cloudpickle

        self.workers = workers or settings.workers
        self.devices = worker_devices(settings.device, self.workers)
        ctx = mp.get_context("spawn")
        manager = ctx.Manager()
        self._manager = manager
        shared = manager.list(self.devices)
        lock = manager.Lock()
        self._pool = cf.ProcessPoolExecutor(
            max_workers=self.workers, mp_context=ctx, initializer=_init,
            initargs=(cloudpickle.dumps((settings, faults)), cloudpickle.dumps(row), shared, lock, frozenset(equivalence_ids)),
        )

    def prepare(self, problems) -> dict:
        """In one worker: check every prompt against the block contract and the model's context, return the ledger environment.

        Raises:
            ContractError: a problem violates the contract or its sequence can
                exceed the model's context (before any row is computed);
            RuntimeError: a worker failed to start (its cause is named).
        """
        return self._pool.submit(_prepare, list(problems)).result()

    def map(self, items: Iterable) -> Iterator[dict]:
        """Records for ``items``, computed in the workers, yielded in item order.

        Raises:
            whatever a row raised (after the rows before it were yielded);
            RuntimeError naming the cause if a worker failed to start;
            ``concurrent.futures.process.BrokenProcessPool`` if a worker process died.
        """
        return self._pool.map(_task, list(items), chunksize=1)

    __call__ = map

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._manager.shutdown()

    def __enter__(self) -> "RowPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
