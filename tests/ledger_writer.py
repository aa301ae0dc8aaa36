"""Subprocess worker for the one-writer tests: runs Experiment 1 on a tiny model into a ledger, as a notebook does.

Usage: python ledger_writer.py LEDGER_ROOT MODEL_FOLDER FORMAT_FILE [stop]
With ``stop`` the process stops itself (SIGSTOP) right after appending its first row, as a process paused by the
system would; the test resumes it with SIGCONT. Prints ``DONE <n> rows`` at the end.
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from conftest import TINY_CAPS, tiny_problems  # noqa: E402
from kvreplay.experiments.live_vs_prefill import EXP1  # noqa: E402
from kvreplay.ledger.store import Ledger  # noqa: E402
from kvreplay.runner import ArmSettings  # noqa: E402

root, model, fmt = sys.argv[1:4]
if sys.argv[4:] == ["stop"]:
    append = Ledger.append

    def append_then_stop(self, record, stopped=[]):  # noqa: B006 (once per process)
        append(self, record)
        if not stopped:
            stopped.append(True)
            os.kill(os.getpid(), signal.SIGSTOP)

    Ledger.append = append_then_stop  # type: ignore[method-assign]
settings = ArmSettings(profile="t", dtype="float32", caps=TINY_CAPS, model=model, fmt=fmt, threads=1, preflight=1)
records, ledger = EXP1.run(settings, tiny_problems(3), ledger_root=root, progress=False)
print(f"DONE {len(records)} rows in {ledger.dir}", flush=True)
