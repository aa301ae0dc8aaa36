"""Subprocess worker for the resume test: runs Experiment 1 rows on a tiny model into a ledger.

Usage: python ledger_worker.py LEDGER_ROOT [KILL_AT]
With KILL_AT=k the process writes half a record and kills itself with SIGKILL
when it reaches row k, as a crash mid-write would.
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from conftest import TINY_CAPS, TINY_FORMAT, tiny_lm, tiny_problems  # noqa: E402
from kvreplay.decoding.contract import resolve_format  # noqa: E402
from kvreplay.decoding.settings import Decoding
from kvreplay.experiments.live_vs_prefill import live_vs_prefill_row
from kvreplay.ledger.store import Ledger, run_rows  # noqa: E402
from kvreplay.runner import RunSpec  # noqa: E402

root = Path(sys.argv[1])
kill_at = int(sys.argv[2]) if len(sys.argv) > 2 else None
lm = tiny_lm("qwen2")
spec = RunSpec(lm=lm, fmt=resolve_format(lm.tokenizer, TINY_FORMAT), decoding=Decoding.of(TINY_CAPS))
problems = tiny_problems(4)
ledger = Ledger(root, "exp1-resume", {"test": "resume"}, environment={"worker": True})


def row(p):
    if kill_at is not None and p.problem_id == problems[kill_at].problem_id:
        with open(ledger.rows_path, "a") as f:
            f.write('{"problem_id":"' + p.problem_id + '","arms":{"li')
        os.kill(os.getpid(), signal.SIGKILL)
    return live_vs_prefill_row(spec, p)


run_rows(ledger, problems, row, key=lambda p: p.problem_id, progress=False)
print(ledger.rows_path)
