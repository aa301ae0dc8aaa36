"""No row reads as clean before the sampled float32 check that covers it has passed, across kills and hand edits.

A construction fault that fires only on prefixes longer than the first one built (the preflight row's, the shortest:
each problem's question is longer than the one before) passes the preflight row's in-row check and is caught by the
sampled check of a later chunk, on the eager path and on the batched engine (batch 2, chunk 6: slots refill). Rows
of a chunk that failed, or whose check never ran (a Ctrl-C or a SIGKILL after the rows were appended), are refused
by every reader with file, line and reason, and re-checked by the arm's next run. Malformed rows and another arm's
manifest are refused by readers and by the resume before any model is loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvreplay.experiments.live_vs_prefill import EXP1
from kvreplay.gates import GateError
from kvreplay.ledger.checked import PENDING_EVENT, SAMPLE_EVENT, UncheckedRowError, sampled_check_labels
from kvreplay.ledger.files import LedgerFileError, LedgerLineError, read_log
from kvreplay.ledger.lookup import find_chain_ledger, finished_rows, ledger_progress, read_ledger
from kvreplay.ledger.store import Ledger, LedgerError, seal
from kvreplay.data.problems import Problem
from kvreplay.runner import ArmSettings
from kvreplay.runner.row_checks import equivalence_sample, sample_size
from kvreplay.verify import choose_rows

HERE = Path(__file__).parent
TINY_ARM_DTYPE = "bfloat16"
PATHS = {"eager": {}, "batched": {"step_path": "engine-eager", "batch": 2, "chunk": 6}}


def growing_problems(n: int) -> list[Problem]:
    """``n`` tiny problems whose prompts (so boundary prefixes) grow with the index."""
    return [Problem(problem_id=f"tiny-{i:02d}", source="test", source_line=i + 1, question="Q?" + " x y" * i,
                    options=("x", "y", f"z{i}", "w"), answer="ABCD"[i % 4]) for i in range(n)]


@pytest.fixture
def long_prefix_fault(monkeypatch):
    """A prefill fault that fires only on prefixes longer than the first prefix built: its position IDs are shifted
    by one while the positions it records stay right (any precision; the float32 check sees it)."""
    from kvreplay.decoding import decode

    state: dict = {"on": False, "limit": None}
    inputs, prefill = decode.model_inputs, decode.build_prefill

    def shifted(*args, **kwargs):
        e, m, p = inputs(*args, **kwargs)
        return e, m, (p + 1 if state["on"] else p)

    def faulty(lm, fmt, prefix, *args, **kwargs):
        if state["limit"] is None:
            state["limit"] = len(prefix)
        state["on"] = len(prefix) > state["limit"]
        try:
            b = prefill(lm, fmt, prefix, *args, **kwargs)
        finally:
            fired, state["on"] = state["on"], False
        if fired:
            b.positions = b.positions - 1
        return b

    monkeypatch.setattr(decode, "model_inputs", shifted)
    monkeypatch.setattr(decode, "build_prefill", faulty)
    return state


def _refused_by_every_reader(root: Path, folder: Path, status: str) -> None:
    """Every reader refuses the folder's first row of that status with file, line and reason."""
    for read in (finished_rows, read_ledger, lambda f: choose_rows(f, 2, pick="first"),
                 lambda f: find_chain_ledger(root, "t", "exp1-bfloat16")):
        with pytest.raises(UncheckedRowError) as e:
            read(folder)
        assert e.value.status == status and "rows.jsonl" in str(e.value) and e.value.line >= 1
        assert "sampled float32 construction-equivalence check" in str(e.value)


@pytest.mark.gate("equivalence")
@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_chunk_whose_sampled_check_failed_is_refused_by_every_reader(tmp_path, tiny_arm, long_prefix_fault, path):
    settings = tiny_arm(**PATHS[path])
    problems = growing_problems(8)
    with pytest.raises(GateError, match="equivalence"):
        EXP1.run(settings, problems, ledger_root=tmp_path, progress=False)
    folder = EXP1.plan(problems).folder(settings, tmp_path)
    events = [e for e in read_log(folder / "runlog.jsonl") if e["event"] == SAMPLE_EVENT]
    assert [e["passed"] for e in events] == [True, False]  # the preflight row's chunk, then the first other chunk
    assert events[0]["rows"] == ["tiny-00"]
    _refused_by_every_reader(tmp_path, folder, "failed")
    with pytest.raises(UncheckedRowError):
        ledger_progress(folder)
    with pytest.raises(GateError, match="sampled float32 construction-equivalence check failed"):
        EXP1.run(settings, problems, ledger_root=tmp_path, progress=False)


def _interrupt_after_row(monkeypatch, key: str, signum: int | None = None) -> None:
    """Stop the run (Ctrl-C, or ``signum`` sent to this process) right after row ``key`` is appended."""
    log = Ledger.log

    def stopping(self, **event):
        log(self, **event)
        if event.get("event") == "row" and event.get("key") == key:
            raise KeyboardInterrupt

    monkeypatch.setattr(Ledger, "log", stopping)


@pytest.mark.gate("equivalence")
@pytest.mark.parametrize("path", sorted(PATHS))
def test_rows_appended_before_a_ctrl_c_are_refused_and_checked_on_resume(tmp_path, tiny_arm, monkeypatch,
                                                                        long_prefix_fault, path):
    settings = tiny_arm(**PATHS[path])
    problems = growing_problems(8)
    with monkeypatch.context() as m:
        _interrupt_after_row(m, "tiny-03")
        with pytest.raises(KeyboardInterrupt):
            EXP1.run(settings, problems, ledger_root=tmp_path, progress=False)
    folder = EXP1.plan(problems).folder(settings, tmp_path)
    assert [r["problem_id"] for r in finished_rows_unchecked(folder)][-1] == "tiny-03"
    _refused_by_every_reader(tmp_path, folder, "pending")
    assert ledger_progress(folder) == (1, 8)  # the preflight row; the rest wait for their check
    with pytest.raises(GateError, match="equivalence"):  # the resume checks them first, and the fault is caught
        EXP1.run(settings, problems, ledger_root=tmp_path, progress=False)
    last = [e for e in read_log(folder / "runlog.jsonl") if e["event"] == SAMPLE_EVENT][-1]
    assert last["passed"] is False and last["rows"] == ["tiny-01", "tiny-02", "tiny-03"]
    _refused_by_every_reader(tmp_path, folder, "failed")


def finished_rows_unchecked(folder: Path) -> list[dict]:
    from kvreplay.ledger.checked import checked_rows

    return [r.record for r in checked_rows(folder, pending=True)]


def test_a_resume_checks_rows_a_kill_left_unchecked_and_then_reads_them_as_clean(tmp_path, tiny_arm, monkeypatch):
    settings = tiny_arm(step_path="engine-eager", batch=2, chunk=6)
    problems = growing_problems(5)
    with monkeypatch.context() as m:
        _interrupt_after_row(m, "tiny-02")
        with pytest.raises(KeyboardInterrupt):
            EXP1.run(settings, problems, ledger_root=tmp_path, progress=False)
    folder = EXP1.plan(problems).folder(settings, tmp_path)
    with pytest.raises(UncheckedRowError):
        read_ledger(folder)
    records, _ = EXP1.run(settings, problems, ledger_root=tmp_path, progress=False)
    events = read_log(folder / "runlog.jsonl")
    rechecked = [e for e in events if e["event"] == SAMPLE_EVENT and e["rows"] == ["tiny-01", "tiny-02"]]
    assert len(rechecked) == 1 and rechecked[0]["passed"] and len(rechecked[0]["checks"]) == 2
    assert [r["problem_id"] for r in read_ledger(folder).records] == [p.problem_id for p in problems]
    seal(folder)  # the record of each check lives in the folder and outlives sealing
    assert len(read_ledger(folder).records) == 5 and read_ledger(folder).unchecked == {}
    assert records == read_ledger(folder).records


WRITER = """
import json, os, signal, sys
sys.path.insert(0, sys.argv[1])
from kvreplay.decoding.contract import Caps
from kvreplay.experiments.live_vs_prefill import EXP1
from kvreplay.ledger.store import Ledger
from kvreplay.runner import ArmSettings
from test_checked_rows import growing_problems

log = Ledger.log
def killing(self, **event):
    log(self, **event)
    if event.get("event") == "row" and event.get("key") == "tiny-02":
        os.kill(os.getpid(), signal.SIGKILL)
Ledger.log = killing
fields = json.loads(sys.argv[2])
settings = ArmSettings(**fields | {"caps": Caps(*fields["caps"])})
EXP1.run(settings, growing_problems(4), ledger_root=sys.argv[3], progress=False)
"""


def test_rows_a_sigkill_left_unchecked_are_refused_and_checked_on_resume(tmp_path, tiny_arm):
    settings = tiny_arm()
    fields = {k: getattr(settings, k) for k in ("profile", "dtype", "model", "fmt", "threads", "preflight")}
    fields["caps"] = [settings.caps.branch, settings.caps.merge, settings.caps.answer]
    env = os.environ | {"PYTHONPATH": str(HERE.parent / "lib")}
    proc = subprocess.run([sys.executable, "-c", WRITER, str(HERE), json.dumps(fields), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    folder = EXP1.plan(growing_problems(4)).folder(settings, tmp_path)
    assert [e["rows"] for e in read_log(folder / "runlog.jsonl") if e["event"] == PENDING_EVENT][-1] == [
        "tiny-01", "tiny-02", "tiny-03"]
    _refused_by_every_reader(tmp_path, folder, "pending")
    EXP1.run(settings, growing_problems(4), ledger_root=tmp_path, progress=False)
    assert len(read_ledger(folder).records) == 4


def _complete(tmp_path: Path, tiny_arm, dtype: str = "float32", n: int = 3) -> Path:
    settings = tiny_arm(dtype=dtype)
    EXP1.run(settings, growing_problems(n), ledger_root=tmp_path, progress=False)
    return EXP1.plan(growing_problems(n)).folder(settings, tmp_path)


def _rewrite_row(folder: Path, number: int, row: dict) -> None:
    lines = (folder / "rows.jsonl").read_text().split("\n")
    lines[number - 1] = json.dumps(row)
    (folder / "rows.jsonl").write_text("\n".join(lines))


@pytest.mark.parametrize("row", [{"foo": 1, "problem_id": "tiny-01"}, {"foo": 1}, "prefix_len"], ids=["extra", "no-id", "type"])
def test_a_malformed_row_is_named_by_readers_and_the_resume_with_file_line_and_field(tmp_path, tiny_arm, monkeypatch,
                                                                                    row):
    folder = _complete(tmp_path, tiny_arm)
    if row == "prefix_len":
        good = json.loads((folder / "rows.jsonl").read_text().split("\n")[1])
        good["prefix_len"] = "x"
        row = good
    _rewrite_row(folder, 2, row)
    readers = (finished_rows, read_ledger, ledger_progress, lambda f: choose_rows(f, 2, pick="first"))
    for read in readers:
        with pytest.raises(LedgerLineError, match=r"rows\.jsonl:2"):
            read(folder)
    monkeypatch.setattr(ArmSettings, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(LedgerLineError, match=r"rows\.jsonl:2.*field"):
        EXP1.run(tiny_arm(dtype="float32"), growing_problems(3), ledger_root=tmp_path, progress=False)


def test_another_arms_manifest_or_schema_is_refused_by_readers_and_the_arm(tmp_path, tiny_arm, monkeypatch):
    fp32 = _complete(tmp_path, tiny_arm, "float32", 2)
    bf16 = _complete(tmp_path, tiny_arm, "bfloat16", 2)
    shutil.copy(bf16 / "manifest.json", fp32 / "manifest.json")
    readers = (finished_rows, read_ledger, ledger_progress, lambda f: choose_rows(f, 2, pick="first"))
    for read in readers:
        with pytest.raises(LedgerFileError, match="another arm's manifest"):
            read(fp32)
    monkeypatch.setattr(ArmSettings, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(LedgerError, match="manifest.json"):
        EXP1.run(tiny_arm(dtype="float32"), growing_problems(2), ledger_root=tmp_path, progress=False)
    manifest = json.loads((bf16 / "manifest.json").read_text())
    (bf16 / "manifest.json").write_text(json.dumps(manifest | {"schema_version": 99}))
    for read in readers:
        with pytest.raises(LedgerFileError, match="schema_version"):
            read(bf16)


def test_readers_name_a_folder_killed_before_its_manifest(tmp_path):
    from kvreplay.ledger.lookup import MissingLedgerError

    folder = tmp_path / "t" / "exp1-bfloat16-000000000000"
    folder.mkdir(parents=True)
    for read in (ledger_progress, lambda f: choose_rows(f, 2, pick="first")):
        with pytest.raises(MissingLedgerError, match="no manifest.json"):
            read(folder)


def test_rows_of_a_library_without_the_sampled_check_stay_readable_and_are_labelled(tmp_path, tiny_arm):
    folder = _complete(tmp_path, tiny_arm, "bfloat16", 3)
    events = [e for e in read_log(folder / "runlog.jsonl") if e["event"] not in (PENDING_EVENT, SAMPLE_EVENT)]
    (folder / "runlog.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))  # as an older library wrote
    ledger = read_ledger(folder)
    assert sorted(ledger.unchecked) == ["tiny-01", "tiny-02"]  # the preflight row carries its own check
    assert all(v.startswith("sampled check not run (library ") for v in ledger.unchecked.values())
    assert sampled_check_labels(folder, ledger.records) == ledger.unchecked


def test_the_check_runs_with_only_kvreplay_runner_imported(tmp_path, tiny_arm):
    """No registry a forgotten import can empty: a fresh process that imports only kvreplay.runner checks a chunk."""
    settings = tiny_arm()
    script = f"""
import sys
import kvreplay.runner as runner
from kvreplay.runner.row_checks import check_chunk
from kvreplay.decoding import decode
from kvreplay.decoding.contract import Caps
assert "kvreplay.experiments.matrix" not in sys.modules
settings = runner.ArmSettings(profile="t", dtype="bfloat16", caps=Caps{tuple(vars(settings.caps).values())!r},
                              model={settings.model!r}, fmt={settings.fmt!r}, threads=1, preflight=1)
lm, fmt = settings.load()
spec = settings.run_spec(lm, fmt, None)
sys.path.insert(0, {str(HERE)!r})
from conftest import tiny_problems
problems = tiny_problems(2)
recs = [{{"problem_id": p.problem_id, "prefix": list(decode.decode_live(lm, fmt, fmt.prompt_ids(p.question, p.options),
        spec.decoding).ids)}} for p in problems]
events = []
check_chunk(recs, spec, {{p.problem_id: p for p in problems}}, frozenset(), lambda **e: events.append(e))
assert events[0]["passed"] and len(events[0]["checks"]) == 2 and all("rel_l2" in c for c in events[0]["checks"])
print("CHECKED", events[0]["checks"])
"""
    env = os.environ | {"PYTHONPATH": str(HERE.parent / "lib")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "CHECKED" in proc.stdout, proc.stderr[-3000:]


def test_the_sample_grows_with_the_chunk_and_stays_outcome_blind():
    assert [sample_size(n) for n in (1, 8, 32, 33, 64, 200)] == [2, 2, 2, 3, 4, 13]
    rows = [{"problem_id": f"p{i:03d}", "prefix": [0] * (10 + i % 7)} for i in range(200)]
    ids = equivalence_sample(rows)
    assert len(ids) == 13 and ids[0] == "p006" and len(set(ids)) == 13
    assert equivalence_sample(list(reversed(rows))) == ids  # the draw does not depend on the rows' order


def test_the_batched_float32_rebuild_gives_each_row_the_rel_l2_it_gets_alone(tiny_arm):
    """The sampled rows rebuilt together at the fixed shape get the bits each gets alone at that shape."""
    from conftest import tiny_problems
    from kvreplay.decoding import decode
    from kvreplay.experiments.matrix import construction_equivalences

    settings = tiny_arm(step_path="engine-eager", batch=2)
    lm, fmt = settings.load()
    problems = growing_problems(3) + tiny_problems(2)
    run = settings.engine_run(fmt, problems, lm.model.config)
    items = [(p, list(decode.decode_live(lm, fmt, fmt.prompt_ids(p.question, p.options), settings.decoding).ids))
             for p in problems]
    together = construction_equivalences(settings.run_spec(lm, fmt, run), items)
    alone = [construction_equivalences(settings.run_spec(lm, fmt, run), [it])[0] for it in items]
    assert [r["rel_l2"] for r in together] == [r["rel_l2"] for r in alone]
    assert all(r["rel_l2"] < 1e-4 for r in together)


def test_the_writer_lock_holds_against_a_writer_with_another_tmpdir(tmp_path):
    from kvreplay.ledger import lock

    folder = tmp_path / "t" / "exp1-bfloat16-000000000000"
    lock.acquire(folder)
    try:
        script = ("import sys\nfrom kvreplay.ledger import lock\ntry:\n    lock.acquire(sys.argv[1])\n"
                  "except lock.LedgerBusyError:\n    print('BUSY')\n")
        other = tmp_path / "other-tmp"
        other.mkdir()
        env = os.environ | {"PYTHONPATH": str(HERE.parent / "lib"), "TMPDIR": str(other)}
        proc = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True, env=env,
                              timeout=120)
        assert proc.stdout.strip() == "BUSY", proc.stderr
    finally:
        lock.release(folder)


def test_taking_the_lock_removes_temporaries_a_killed_writer_left(tmp_path):
    from kvreplay.ledger import lock

    folder = tmp_path / "exp1-bfloat16-000000000000"
    folder.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = folder / f".manifest.json.tmp-{dead.stdout.strip()}"
    mine = folder / f".environment.json.tmp-{os.getpid()}"
    stale.write_text("{")
    mine.write_text("{")
    lock.acquire(folder)
    lock.release(folder)
    assert not stale.exists() and mine.exists()


@pytest.mark.parametrize("fields", [{"preflight": -3}, {"caps": (0, 8, 4)}, {"caps": (8, -1, 4)}, {"caps": (8, 8, -5)},
                                    {"batch": 0}, {"chunk": 0}, {"workers": 0}], ids=str)
def test_arm_settings_refuse_values_no_profile_could_hold(tiny_arm, fields):
    from kvreplay.decoding.contract import Caps

    if "caps" in fields:
        fields = {"caps": Caps(*fields["caps"])}
    with pytest.raises(ValueError, match=next(iter(fields))):
        tiny_arm(**fields)
