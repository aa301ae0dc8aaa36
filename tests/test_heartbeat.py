"""A row that runs long is never silent: `make verify` prints a line every interval naming the row's phase and step."""

from __future__ import annotations

import io
import re
import time

from conftest import tiny_problems
from kvreplay.experiments.live_vs_prefill import EXP1
from kvreplay.runner.heartbeat import INTERVAL_ENV, Heartbeat, interval


def test_a_recomputed_row_prints_its_phase_and_step_while_it_runs(tmp_path, tiny_arm, monkeypatch, capsys):
    from kvreplay.verify import verify_ledger

    problems = tiny_problems(2)
    _, ledger = EXP1.run(tiny_arm(), problems, ledger_root=tmp_path, progress=False)
    capsys.readouterr()
    monkeypatch.setenv(INTERVAL_ENV, "0.05")  # the row takes seconds: many intervals
    checks = verify_ledger(ledger.dir, rows=1, pick="first", problems=problems, model=str(tmp_path / "tiny-llama"))
    assert [c.ok for c in checks] == [True]
    beats = [line for line in capsys.readouterr().out.splitlines() if "still running" in line]
    assert beats, "no heartbeat line during a row of several intervals"
    shape = re.compile(rf"  \.\.\. {ledger.dir.name} tiny-00: still running after \d+ s; phase (\S+)( > \S+)?; "
                       r"step (\d+) \(forward calls in this row\)")
    parsed = [shape.fullmatch(line) for line in beats]
    assert all(parsed), beats[:3]
    phases = {m.group(1) for m in parsed}
    assert all(p.startswith(("experiments.", "runner.")) for p in phases), phases  # the row's own function
    steps = [int(m.group(3)) for m in parsed]
    assert steps == sorted(steps) and steps[-1] > 0  # forward calls counted from the row's start


def test_a_short_block_prints_nothing_and_the_interval_defaults_to_a_minute(monkeypatch):
    out = io.StringIO()
    with Heartbeat("quick", lambda: 0, stream=out, every=5):
        time.sleep(0.01)
    assert out.getvalue() == ""
    monkeypatch.delenv(INTERVAL_ENV, raising=False)
    assert interval() == 60
    monkeypatch.setenv(INTERVAL_ENV, "not a number")
    assert interval() == 60


def test_an_arm_run_names_its_model_s_forward_calls_found_on_the_stack(tmp_path, tiny_arm):
    """The form ``make paper`` prints on its terminal around each arm (kvreplay.notebook.session.Session.run)."""
    out = io.StringIO()
    with Heartbeat("exp1-float32", stream=out, every=0.05):
        EXP1.run(tiny_arm(), tiny_problems(2), ledger_root=tmp_path, progress=False)
    lines = out.getvalue().splitlines()
    counted = [int(m.group(1)) for m in map(re.compile(r".*; step (\d+) \(forward calls of its model so far\)$").match,
                                            lines) if m]
    assert counted and counted == sorted(counted) and counted[-1] > 0, lines[:5]
    assert all(line.startswith("  ... exp1-float32: still running after ") for line in lines)
