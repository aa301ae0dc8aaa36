"""A long row is never silent: while it runs, a line at least every minute naming its phase and step.

:class:`Heartbeat` is a context manager around one unit of work (a recomputed row in ``make verify``). A daemon thread
wakes every ``interval`` seconds (:data:`INTERVAL_ENV`, default 60) and prints one line: what runs, the seconds since
it began, its **phase** and its **step**. The phase is read from the working thread's stack (the outermost and
innermost ``kvreplay`` functions it is in, e.g. ``live_vs_prefill.exp1_row > decode.suffix``); the step is a count
the caller supplies (the model's forward calls so far in this row). Nothing in the row is touched, so no bit changes.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

INTERVAL_ENV = "KVREPLAY_HEARTBEAT_S"
"""Environment variable: seconds between heartbeat lines (default 60; tests set 1)."""

DEFAULT_INTERVAL = 60.0

_OWN = ("kvreplay.runner.heartbeat", "kvreplay.verify")
"""Modules whose frames are not a phase: this one, and the command that wraps the row."""


def interval() -> float:
    """Seconds between heartbeat lines: ``$KVREPLAY_HEARTBEAT_S`` when it is a positive number, else 60."""
    try:
        value = float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL))
    except ValueError:
        return DEFAULT_INTERVAL
    return value if value > 0 else DEFAULT_INTERVAL


def phase(thread_id: int) -> str:
    """The ``kvreplay`` functions a thread is in, as ``outer > inner`` (module without ``kvreplay.``, function; lambdas
    and comprehensions skipped), or ``"outside kvreplay"`` (loading a model, say, inside ``transformers``)."""
    frame = sys._current_frames().get(thread_id)
    names: list[str] = []
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("kvreplay.") and module not in _OWN and not frame.f_code.co_name.startswith("<"):
            names.append(f"{module.removeprefix('kvreplay.')}.{frame.f_code.co_name}")
        frame = frame.f_back
    if not names:
        return "outside kvreplay"
    inner, outer = names[0], names[-1]
    return outer if inner == outer else f"{outer} > {inner}"


def model_calls(thread_id: int) -> int | None:
    """Forward calls so far of the model the thread works with: the ``calls`` count of the innermost local ``lm`` (a
    :class:`~kvreplay.model.models.LoadedModel`) or ``spec.lm`` on its stack; ``None`` before a model is loaded."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        local = frame.f_locals
        for lm in (local.get("lm"), getattr(local.get("spec"), "lm", None)):
            calls = getattr(lm, "calls", None)
            if isinstance(calls, int):
                return calls
        frame = frame.f_back
    return None


class Heartbeat:
    """Print a line every :func:`interval` seconds while the ``with`` block runs (see the module docstring).

    Args:
        what: the work, as the line names it (e.g. ``"exp1-bfloat16-… mmlu-…"``).
        step: returns the step count now (e.g. forward calls so far); ``None``: the forward calls of the model found
            on the working thread's stack (:func:`model_calls`), counted from the first line that finds one.
        stream: where lines go (default ``sys.stdout``), each flushed.
        every: seconds between lines (default :func:`interval`).
    """

    def __init__(self, what: str, step: Callable[[], int] | None = None, *, stream: TextIO | None = None,
                 every: float | None = None):
        self.what, self.step, self.stream = what, step, stream
        self.every = every if every is not None else interval()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lines = 0

    def __enter__(self) -> Heartbeat:
        worker, start = threading.get_ident(), time.perf_counter()
        first = self.step() if self.step is not None else None

        def beat() -> None:
            nonlocal first
            while not self._stop.wait(self.every):
                line = f"  ... {self.what}: still running after {time.perf_counter() - start:.0f} s; phase {phase(worker)}"
                if self.step is not None:
                    line += f"; step {self.step() - (first or 0)} (forward calls in this row)"
                else:
                    calls = model_calls(worker)
                    first = calls if first is None else first
                    if calls is not None:
                        line += f"; step {calls} (forward calls of its model so far)"
                print(line, file=self.stream or sys.stdout, flush=True)
                self.lines += 1

        self._thread = threading.Thread(target=beat, name="kvreplay-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
