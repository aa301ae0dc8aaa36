"""Ledgers that a second writer, a full disk or a kill at the wrong moment cannot corrupt or wedge.

Each test fails on the code before the writer lock, the atomic small files and the named decode errors: two
processes on one ledger (one paused), a full disk (a stand-in raising ``ENOSPC`` at a chosen write), a kill between
seal's two steps, a damaged middle line, an empty manifest, the library's ``preflight=0`` below float32.
"""

from __future__ import annotations

import builtins
import errno
import gzip
import io
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from conftest import tiny_problems
from kvreplay.experiments.live_vs_prefill import EXP1
from kvreplay.ledger import lock
from kvreplay.ledger.files import LedgerFileError, LedgerLineError, read_log
from kvreplay.ledger.lookup import finished_rows, ledger_progress, read_ledger
from kvreplay.ledger.provenance import ledger_provenance
from kvreplay.ledger.store import Ledger, LedgerError, read_rows_text, run_rows, seal, unseal
from kvreplay.runner import ArmSettings
from kvreplay.decoding.ties import parse_tie_rule
from kvreplay.verify import choose_rows

HERE = Path(__file__).parent
PY = sys.executable


def _ledger(root: Path, n: int = 3, name: str = "x-bfloat16") -> Ledger:
    """A ledger of ``n`` plain rows (problem IDs p0, p1, ...) with a manifest naming them."""
    ledger = Ledger(root, name, {"problem_ids": [f"p{i}" for i in range(n)]}, environment={"t": 1}, row_algorithm=1)
    for i in range(n):
        ledger.append({"problem_id": f"p{i}", "value": i})
    return ledger


def _stopped(proc: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until ``proc`` has stopped itself (SIGSTOP); fail if it exits first."""
    pid, status = os.waitpid(proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), f"the writer exited (status {status}) instead of pausing: {proc.stderr.read()}"


def test_a_second_writer_stops_at_once_and_the_paused_one_finishes_without_duplicates(tmp_path, tiny_arm):
    settings = tiny_arm()
    env = os.environ | {"PYTHONPATH": str(HERE.parent / "lib")}
    args = [PY, str(HERE / "ledger_writer.py"), str(tmp_path / "ledgers"), settings.model, settings.fmt]
    first = subprocess.Popen(args + ["stop"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _stopped(first)  # paused right after appending its first row, holding the arm's lock
        second = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
        folder = EXP1.plan(tiny_problems(3)).folder(settings, tmp_path / "ledgers")
        assert second.returncode != 0, f"a second writer ran beside a paused one: {second.stdout}"
        assert "LedgerBusyError" in second.stderr and str(folder) in second.stderr, second.stderr
        assert f"pid {first.pid} " in second.stderr, second.stderr  # the holder is named
        assert "Loading" not in second.stderr
    finally:
        os.kill(first.pid, signal.SIGCONT)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert "DONE 3 rows" in out
    lines = (folder / "rows.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["problem_id"] for x in lines) == ["tiny-00", "tiny-01", "tiny-02"]
    assert ledger_progress(folder) == (3, 3)


def test_a_lock_left_by_a_killed_process_does_not_wedge_the_arm_and_waiting_is_asked_for(tmp_path, monkeypatch):
    folder = tmp_path / "p" / "exp1-bfloat16-abc"
    code = ("import sys, time; from kvreplay.ledger import lock; lock.acquire(sys.argv[1]); print('held', flush=True); "
            "time.sleep(600)")
    holder = subprocess.Popen([PY, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(lock.LedgerBusyError, match=f"pid {holder.pid} host"):
            lock.acquire(folder)
        monkeypatch.setenv(lock.WAIT_ENV, "0.3")
        with pytest.raises(lock.LedgerBusyError, match="after waiting"):
            lock.acquire(folder)
    finally:
        holder.kill()
        holder.wait()
    lock.acquire(folder)  # SIGKILL released it; the file stays, the lock does not
    try:
        assert lock.lock_path(folder).read_text().startswith(f"pid {os.getpid()} host")
    finally:
        lock.release(folder)
    assert lock.lock_path(folder) not in lock.held()


def test_the_duplicate_guard_rereads_what_another_writer_appended(tmp_path):
    a = _ledger(tmp_path, 1)
    b = Ledger(tmp_path, "x-bfloat16", a.config, environment={"t": 1}, row_algorithm=1)
    assert a.done_keys() == {"p0"}
    b.append({"problem_id": "p1", "value": 1})
    with pytest.raises(LedgerError, match="p1 already recorded"):
        a.append({"problem_id": "p1", "value": 1})
    assert len(a.records()) == 2


def _duplicate(ledger: Ledger, differ: bool = False) -> Path:
    """Append a copy of the ledger's second row (changed when ``differ``) as its last line, as two writers do."""
    rows = ledger.rows_path
    second = rows.read_text().splitlines()[1]
    rows.write_text(rows.read_text() + (second.replace('"value":1', '"value":9') if differ else second) + "\n")
    return rows


def test_every_reader_refuses_a_duplicated_problem_id_naming_file_line_and_id(tmp_path):
    ledger = _ledger(tmp_path)
    rows = _duplicate(ledger)
    where = f"{rows}:4 (problem p1)"
    for read in (finished_rows, ledger_progress, read_ledger, choose_rows, seal, lambda f: Ledger(
            tmp_path, "x-bfloat16", ledger.config).records()):
        with pytest.raises(LedgerLineError, match="first on line 2") as e:
            read(ledger.dir)
        assert where in str(e.value) and "repair" in str(e.value)
    with pytest.raises(LedgerLineError, match="recorded twice"):
        run_rows(ledger, ["p0"], lambda p: {"problem_id": p}, key=str, progress=False)


def test_repair_drops_byte_identical_duplicates_and_refuses_differing_ones(tmp_path):
    ledger = _ledger(tmp_path)
    clean = ledger.rows_path.read_bytes()
    _duplicate(ledger)
    cli = [PY, "-m", "kvreplay.ledger", "repair", str(ledger.dir)]
    out = subprocess.run(cli, capture_output=True, text=True)
    assert out.returncode == 0 and "1 duplicate line(s) dropped: [4]" in out.stdout, out.stderr
    assert ledger.rows_path.read_bytes() == clean
    _duplicate(ledger, differ=True)
    damaged = ledger.rows_path.read_bytes()
    out = subprocess.run(cli, capture_output=True, text=True)
    assert out.returncode == 1 and "lines 2 and 4 with different bytes" in out.stderr, out.stderr
    assert ledger.rows_path.read_bytes() == damaged  # refused: nothing changed


def _full_disk_at(monkeypatch, name: str) -> None:
    """A stand-in for a full disk: writing to a file called ``name`` raises ``ENOSPC`` after the file is created."""
    real_open = builtins.open

    class Full(io.BufferedWriter):
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    def full_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if Path(str(file)).name.startswith((name, f".{name}")) and ("w" in mode or "a" in mode):
            f.close()
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return f

    monkeypatch.setattr(builtins, "open", full_open)
    monkeypatch.setattr(io, "open", full_open)


def test_a_full_disk_at_the_first_write_leaves_no_file_that_wedges_the_arm(tmp_path, monkeypatch):
    config = {"problem_ids": ["p0"]}
    with monkeypatch.context() as m:
        _full_disk_at(m, "manifest.json")
        with pytest.raises(OSError, match="No space left"):
            Ledger(tmp_path, "x-bfloat16", config, environment={"t": 1}, row_algorithm=1)
    folder = Ledger.folder(tmp_path, "x-bfloat16", config)
    assert not (folder / "manifest.json").exists() or json.loads((folder / "manifest.json").read_text())
    assert not [p.name for p in folder.iterdir() if ".tmp-" in p.name]
    ledger = Ledger(tmp_path, "x-bfloat16", config, environment={"t": 1}, row_algorithm=1)  # space freed: it works
    ledger.append({"problem_id": "p0"})
    assert ledger_progress(folder) == (1, 1)


def test_an_empty_manifest_is_rebuilt_by_the_writer_and_named_by_readers(tmp_path):
    config = {"problem_ids": ["p0"]}
    folder = Ledger.folder(tmp_path, "x-bfloat16", config)
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("")  # left by an older version on a full disk
    for read in (ledger_progress, read_ledger):
        with pytest.raises(LedgerFileError, match="manifest.json is empty") as e:
            read(folder)
        assert str(folder / "manifest.json") in str(e.value) and "run the arm" in str(e.value)
    (folder / "manifest.json").write_text('{"config": {"probl')  # a partial one
    with pytest.raises(LedgerFileError, match=r"is not JSON \(line 1"):
        ledger_progress(folder)
    (folder / "manifest.json").write_text("")
    with pytest.warns(UserWarning, match="rebuilt"):
        ledger = Ledger(tmp_path, "x-bfloat16", config, environment={"t": 1}, row_algorithm=1)
    ledger.append({"problem_id": "p0"})
    assert read_ledger(folder).manifest["config"] == config


def _killed_at_unlink(folder: Path, action: str, victim: str) -> None:
    """Run ``seal``/``unseal`` in a process that is SIGKILLed when it removes ``victim``: between the two steps."""
    code = (f"import os, signal, sys; from kvreplay.ledger.store import {action}\n"
            "real = os.unlink\n"
            "def unlink(p, *a, **k):\n"
            f"    if str(p).endswith('/{victim}'): os.kill(os.getpid(), signal.SIGKILL)\n"
            "    return real(p, *a, **k)\n"
            f"os.unlink = unlink\n{action}(sys.argv[1])\n")
    out = subprocess.run([PY, "-c", code, str(folder)], capture_output=True, text=True)
    assert out.returncode == -signal.SIGKILL, out.stderr


def test_a_kill_between_seals_two_steps_is_recovered(tmp_path):
    ledger = _ledger(tmp_path)
    data = ledger.rows_path.read_bytes()
    _killed_at_unlink(ledger.dir, "seal", "rows.jsonl")
    assert (ledger.dir / "rows.jsonl").exists() and (ledger.dir / "rows.jsonl.gz").exists()
    assert read_rows_text(ledger.dir).encode() == data  # both hold the same rows: readers take them
    assert ledger_progress(ledger.dir) == (3, 3)
    assert seal(ledger.dir).name == "rows.jsonl.gz" and not (ledger.dir / "rows.jsonl").exists()
    assert gzip.decompress((ledger.dir / "rows.jsonl.gz").read_bytes()) == data
    _killed_at_unlink(ledger.dir, "unseal", "rows.jsonl.gz")
    assert (ledger.dir / "rows.jsonl").exists() and (ledger.dir / "rows.jsonl.gz").exists()
    Ledger(tmp_path, "x-bfloat16", ledger.config).append({"problem_id": "p3", "value": 3})  # unseals, appends
    assert not (ledger.dir / "rows.jsonl.gz").exists() and len(finished_rows(ledger.dir)) == 4
    (ledger.dir / "rows.jsonl.gz").write_bytes(gzip.compress(data, mtime=0))  # both, and different: refused
    with pytest.raises(LedgerError, match="different rows"):
        read_rows_text(ledger.dir)


def test_a_damaged_middle_line_is_named_by_file_line_and_problem_id_everywhere(tmp_path):
    ledger = _ledger(tmp_path)
    lines = ledger.rows_path.read_text().splitlines()
    ledger.rows_path.write_text("\n".join([lines[0], lines[1][:20], lines[2]]) + "\n")  # the middle one cut short
    where = f"{ledger.rows_path}:2 (problem p1): not JSON"
    for read in (finished_rows, ledger_progress, read_ledger, choose_rows, seal, lambda f: run_rows(
            Ledger(tmp_path, "x-bfloat16", ledger.config), ["p0"], None, key=str, progress=False)):
        with pytest.raises(LedgerLineError) as e:
            read(ledger.dir)
        assert where in str(e.value), e.value


def test_a_torn_last_line_is_left_out_alike_by_every_reader(tmp_path):
    ledger = _ledger(tmp_path)
    with open(ledger.rows_path, "a") as f:
        f.write('{"problem_id":"p9","val')
    with open(ledger.dir / "runlog.jsonl", "a") as f:
        f.write('{"event":"ro')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [r["problem_id"] for r in finished_rows(ledger.dir)] == ["p0", "p1", "p2"]
        assert choose_rows(ledger.dir, 3, pick="fastest") == [0, 1, 2]
        assert ledger_provenance(ledger.dir).runs == 0
    assert any(f"{ledger.rows_path}:4: a torn last line" in str(w.message) for w in caught)
    assert any("runlog.jsonl:" in str(w.message) for w in caught)
    with pytest.raises(LedgerError, match="cut-off last line"):
        seal(ledger.dir)
    ledger.log(event="after")  # the writer cuts the torn event before appending
    assert [e["event"] for e in read_log(ledger.dir / "runlog.jsonl")] == ["after"]
    (ledger.dir / "runlog.jsonl").write_text('{"event":"a"}\n{"ev\n{"event":"b"}\n')
    with pytest.raises(LedgerLineError, match=r"runlog.jsonl:2: not JSON"):
        ledger_provenance(ledger.dir)


def test_a_resume_stops_on_a_damaged_line_before_loading_the_model(tmp_path, tiny_arm, monkeypatch):
    problems = tiny_problems(2)
    settings = tiny_arm()
    folder = EXP1.plan(problems).folder(settings, tmp_path)
    folder.mkdir(parents=True)
    Ledger(tmp_path / "t", folder.name.rsplit("-", 1)[0], EXP1.plan(problems).config(settings))
    (folder / "rows.jsonl").write_text('{"problem_id":"tiny-00","x":1}\n{"problem_id":"tiny-01"\n{"problem_id":"z"}\n')
    monkeypatch.setattr(ArmSettings, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(LedgerLineError, match=r"rows.jsonl:2 \(problem tiny-01\)"):
        EXP1.run(settings, problems, ledger_root=tmp_path, progress=False)


def test_the_library_refuses_preflight_0_below_float32_as_the_profile_does(tmp_path, tiny_arm, monkeypatch):
    monkeypatch.setattr(ArmSettings, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(ValueError, match="preflight 0 would switch off"):
        EXP1.run(tiny_arm(dtype="bfloat16", preflight=0), tiny_problems(2), ledger_root=tmp_path, progress=False)
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("rule", ["hash:0\n", "hash:\u0663", " hash:1", "hash:1 ", "hash:+1", "hash:", "Hash:1"])
def test_tie_rule_names_are_parsed_strictly(rule):
    with pytest.raises(ValueError, match="unknown tie rule"):
        parse_tie_rule(rule)


def test_a_tie_rule_enters_the_ledger_key_in_one_canonical_spelling(tiny_arm):
    problems = tiny_problems(1)
    keys = {json.dumps(tiny_arm(tie_rule=r).config("exp1", problems), sort_keys=True) for r in ("hash:7", "hash:07")}
    assert len(keys) == 1 and '"tie_rule": "hash:7"' in keys.pop()
    assert "tie_rule" not in tiny_arm(tie_rule="lowest").config("exp1", problems)


@pytest.fixture
def prefill_shifted_after_the_first_problem(monkeypatch):
    """A construction fault that shows only on some rows: the prefill call of every problem but ``tiny-00`` (the
    preflight row) sees its position IDs shifted by one, while the positions it records stay correct."""
    from kvreplay.decoding import decode

    state = {"on": False}
    inputs, prefill = decode.model_inputs, decode.build_prefill

    def shifted(*args, **kwargs):
        e, m, p = inputs(*args, **kwargs)
        return e, m, (p + 1 if state["on"] else p)

    def faulty(*args, where="prefix", **kwargs):
        state["on"] = where != "tiny-00"
        try:
            b = prefill(*args, where=where, **kwargs)
        finally:
            state["on"] = False
        if where != "tiny-00":
            b.positions = b.positions - 1
        return b

    monkeypatch.setattr(decode, "model_inputs", shifted)
    monkeypatch.setattr(decode, "build_prefill", faulty)


def test_the_float32_check_runs_on_a_sample_of_the_other_rows_and_logs_without_changing_rows(tmp_path, tiny_arm):
    from kvreplay.runner.row_checks import equivalence_sample

    records, ledger = EXP1.run(tiny_arm(dtype="bfloat16"), tiny_problems(3), ledger_root=tmp_path, progress=False)
    assert [r["equivalence"] is None for r in records] == [False, True, True]  # rows as before: only preflight's
    events = [e for e in read_log(ledger.dir / "runlog.jsonl") if e["event"] == "equivalence_sample"]
    assert [(e["passed"], e["rows"]) for e in events] == [(True, ["tiny-00"]), (True, ["tiny-01", "tiny-02"])]
    assert events[0]["checks"] == []  # the preflight row is checked inside its row
    events = events[1:]
    assert [c["problem_id"] for c in events[0]["checks"]] == equivalence_sample(records[1:])
    assert len(events[0]["checks"]) == 2 and all(c["rel_l2"] < 1e-3 for c in events[0]["checks"])
    lengths = {r["problem_id"]: len(r["prefix"]) for r in records[1:]}
    assert lengths[events[0]["checks"][0]["problem_id"]] == max(lengths.values())  # the longest prefix first


def test_a_construction_fault_on_non_preflight_rows_stops_the_arm_and_wedges_its_ledger_closed(
        tmp_path, tiny_arm, monkeypatch, prefill_shifted_after_the_first_problem):
    from kvreplay.gates import GateError

    settings = tiny_arm(dtype="bfloat16")
    with pytest.raises(GateError, match="equivalence"):
        EXP1.run(settings, tiny_problems(3), ledger_root=tmp_path, progress=False)
    folder = EXP1.plan(tiny_problems(3)).folder(settings, tmp_path)
    failed = [e for e in read_log(folder / "runlog.jsonl") if e["event"] == "equivalence_sample"]
    assert failed and failed[-1]["passed"] is False and failed[-1]["rows"] == ["tiny-01", "tiny-02"]
    monkeypatch.setattr(ArmSettings, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(GateError, match="sampled float32 construction-equivalence check failed"):
        EXP1.run(settings, tiny_problems(3), ledger_root=tmp_path, progress=False)
