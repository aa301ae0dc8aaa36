"""Append-only, resumable ledgers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvreplay.ledger.store import Ledger, LedgerError, canonical_json

WORKER = Path(__file__).with_name("ledger_worker.py")


def _run(root, *args):
    return subprocess.run([sys.executable, str(WORKER), str(root), *map(str, args)], capture_output=True, text=True)


def test_killed_run_resumes_to_byte_identical_ledger(tmp_path):
    straight = _run(tmp_path / "a")
    assert straight.returncode == 0, straight.stderr
    killed = _run(tmp_path / "b", 2)
    assert killed.returncode != 0  # SIGKILL mid-write
    (rows_b,) = (tmp_path / "b").glob("*/rows.jsonl")
    assert not rows_b.read_bytes().endswith(b"\n")  # a torn last line is on disk
    resumed = _run(tmp_path / "b")
    assert resumed.returncode == 0, resumed.stderr
    (rows_a,) = (tmp_path / "a").glob("*/rows.jsonl")
    assert rows_a.read_bytes() == rows_b.read_bytes()
    assert len(rows_a.read_text().splitlines()) == 4
    log = [json.loads(x) for x in (rows_b.parent / "runlog.jsonl").read_text().splitlines()]
    assert [e["todo"] for e in log if e["event"] == "start"] == [4, 2]  # the resume skipped finished rows


def test_append_only_and_keyed(tmp_path):
    ledger = Ledger(tmp_path, "x", {"a": 1})
    ledger.append({"problem_id": "p1", "v": 1.5})
    with pytest.raises(LedgerError, match="already recorded"):
        ledger.append({"problem_id": "p1", "v": 2})
    assert ledger.records() == [{"problem_id": "p1", "v": 1.5}]
    assert ledger.complete(["p1"]) and not ledger.complete(["p1", "p2"])
    other = Ledger(tmp_path, "x", {"a": 2})
    assert other.dir != ledger.dir  # another config, another folder


def test_manifest_mismatch_is_refused(tmp_path):
    ledger = Ledger(tmp_path, "x", {"a": 1})
    manifest = json.loads((ledger.dir / "manifest.json").read_text())
    manifest["config_digest"] = "0" * 64
    (ledger.dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(LedgerError, match="belongs to config"):
        Ledger(tmp_path, "x", {"a": 1})


def test_other_environment_warns_but_reuses_and_is_not_stale(tmp_path):
    ledger = Ledger(tmp_path, "x", {"a": 1}, environment={"torch": "1"}, row_algorithm=3)
    ledger.append({"problem_id": "p"})
    with pytest.warns(UserWarning, match="computed in another environment .torch differ"):
        again = Ledger(tmp_path, "x", {"a": 1}, environment={"torch": "2"}, row_algorithm=3)
    assert again.records() == [{"problem_id": "p"}]
    assert again.stale == [] and again.other_environment == ["torch"]


def test_row_algorithm_version_decides_staleness(tmp_path):
    import warnings

    Ledger(tmp_path, "x", {"a": 1}, environment={"torch": "1"}, row_algorithm=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same version, same environment: silent, whatever the library source
        same = Ledger(tmp_path, "x", {"a": 1}, environment={"torch": "1"}, row_algorithm=3)
    assert same.stale == [] and same.other_environment == []
    with pytest.warns(UserWarning, match="stale: written by row algorithm 3, this code computes version 4"):
        newer = Ledger(tmp_path, "x", {"a": 1}, environment={"torch": "1"}, row_algorithm=4)
    assert newer.stale == ["row_algorithm"]


def test_canonical_json_is_stable():
    assert canonical_json({"b": 1, "a": [1.0, None, "é"]}) == '{"a":[1.0,null,"é"],"b":1}'


def test_stale_incomplete_ledger_refuses_to_resume(tmp_path, monkeypatch):
    from kvreplay.ledger.store import run_rows

    ledger = Ledger(tmp_path, "x", {"a": 1}, environment={"torch": "1"}, row_algorithm=1)
    run_rows(ledger, ["p1"], lambda k: {"problem_id": k}, key=lambda k: k, progress=False)
    with pytest.warns(UserWarning, match="stale"):
        stale = Ledger(tmp_path, "x", {"a": 1}, environment={"torch": "1"}, row_algorithm=2)
    with pytest.raises(LedgerError, match="another row-algorithm version; refusing"):
        run_rows(stale, ["p1", "p2"], lambda k: {"problem_id": k}, key=lambda k: k, progress=False)
    with pytest.warns(UserWarning, match="another environment"):
        again = Ledger(tmp_path, "x", {"a": 1}, environment={"torch": "2"}, row_algorithm=1)
    with pytest.raises(LedgerError, match="in another environment .torch differ.; refusing"):
        run_rows(again, ["p1", "p2"], lambda k: {"problem_id": k}, key=lambda k: k, progress=False)
    assert run_rows(again, ["p1"], lambda k: {"problem_id": k}, key=lambda k: k, progress=False) == [{"problem_id": "p1"}]
    monkeypatch.setenv("KVREPLAY_ALLOW_STALE", "1")
    assert len(run_rows(again, ["p1", "p2"], lambda k: {"problem_id": k}, key=lambda k: k, progress=False)) == 2


def test_parquet_export_is_columnar_and_deterministic(tmp_path):
    import pandas as pd
    from kvreplay.ledger.store import export_parquet

    ledger = Ledger(tmp_path, "x", {"a": 1})
    for i in range(3):
        ledger.append({"problem_id": f"p{i}", "prefix": [1, 2, 3], "endpoints": {"suffix_differs": i == 1},
                    "boundary": {"prefill_vs_live": {"cache": {"rel_l2": 0.1 * i},
                                 "tensors": [{"tensor": "L00.key", "rel_l2": 0.2, "ref_geometry": {"shape": [2]}}]}}})
    first = [p.read_bytes() for p in export_parquet(ledger.dir)]
    assert first == [p.read_bytes() for p in export_parquet(ledger.dir)]
    rows = pd.read_parquet(ledger.dir / "rows.parquet")
    assert list(rows["endpoints.suffix_differs"]) == [False, True, False] and "prefix" not in rows
    tensors = pd.read_parquet(ledger.dir / "tensors.parquet")
    assert tensors.shape == (3, 4) and set(tensors["comparison"]) == {"prefill_vs_live"}


def test_a_sealed_ledger_reads_the_same_and_takes_more_rows(tmp_path):
    """Sealing (rows.jsonl -> rows.jsonl.gz) is deterministic and lossless; readers take either form; appending unseals."""
    from kvreplay.ledger.lookup import read_ledger
    from kvreplay.ledger.store import read_rows_text, seal, unseal

    config = {"a": 1, "problem_ids": ["p0", "p1", "p2"]}  # not an experiment's label: these rows have no row type
    ledger = Ledger(tmp_path, "sealing-bfloat16", config)
    for i in range(3):
        ledger.append({"problem_id": f"p{i}", "v": [i, 0.5]})
    plain = (ledger.dir / "rows.jsonl").read_bytes()
    first = seal(ledger.dir)
    assert first.name == "rows.jsonl.gz" and not (ledger.dir / "rows.jsonl").exists()
    sealed_bytes = first.read_bytes()
    assert len(sealed_bytes) < len(plain) and read_rows_text(ledger.dir).encode() == plain
    assert seal(ledger.dir).read_bytes() == sealed_bytes  # sealing a sealed ledger changes nothing
    unseal(ledger.dir)
    assert (ledger.dir / "rows.jsonl").read_bytes() == plain
    assert seal(ledger.dir).read_bytes() == sealed_bytes  # deterministic: no time stamp in the header

    again = Ledger(tmp_path, "sealing-bfloat16", config)
    assert again.records() == [json.loads(x) for x in plain.decode().splitlines()] and again.complete(["p0", "p2"])
    assert read_ledger(ledger.dir).records == again.records()
    assert (ledger.dir / "rows.jsonl.gz").exists()  # reading did not unseal it
    again.append({"problem_id": "p3", "v": [3, 0.5]})  # resuming a sealed ledger
    assert not (ledger.dir / "rows.jsonl.gz").exists()
    assert (ledger.dir / "rows.jsonl").read_bytes() == plain + (canonical_json({"problem_id": "p3", "v": [3, 0.5]}) + "\n").encode()

    (ledger.dir / "rows.jsonl.gz").write_bytes(sealed_bytes)  # both forms at once is refused, not guessed
    with pytest.raises(LedgerError, match="both"):
        read_rows_text(ledger.dir)
    (ledger.dir / "rows.jsonl.gz").unlink()
    (ledger.dir / "rows.jsonl").write_bytes(plain[:-3])  # a cut-off last line is never sealed
    with pytest.raises(LedgerError, match="cut-off"):
        seal(ledger.dir)


def test_seal_command(tmp_path):
    ledger = Ledger(tmp_path, "x", {"a": 1})
    ledger.append({"problem_id": "p0"})
    run = lambda *a: subprocess.run([sys.executable, "-m", "kvreplay.ledger", *a], capture_output=True, text=True)  # noqa: E731
    out = run("seal", str(ledger.dir), str(tmp_path))
    assert out.returncode == 2 and "not a ledger folder" in out.stderr and (ledger.dir / "rows.jsonl.gz").exists()
    assert run("unseal", str(ledger.dir)).returncode == 0 and (ledger.dir / "rows.jsonl").exists()


def test_reading_an_experiment_ledger_checks_every_row_against_its_row_type(tmp_path):
    """What the notebooks read has the declared layout: a row of the wrong shape stops the read, naming it."""
    from kvreplay.ledger.lookup import read_ledger
    from kvreplay.ledger.records import RowSchemaError

    ledger = Ledger(tmp_path, "exp1-bfloat16", {"problem_ids": ["p0"]})
    ledger.append({"problem_id": "p0", "v": [0, 0.5]})
    with pytest.raises(RowSchemaError, match=r"problem_id 'p0'.*Exp1Row"):
        read_ledger(ledger.dir)


def test_compare_tells_identical_unfinished_and_parting_recomputations(tmp_path, capsys):
    """`python -m kvreplay.ledger compare`: rows, manifest and plain files byte for byte; where rows first part; what
    exit status each case gets (missing counterpart, nothing compared, --complete, folders that cannot be compared).
    The first call runs the command itself; the others call its ``main`` in this process (each new process would
    import torch again)."""
    import gzip
    import shutil

    from kvreplay.ledger.__main__ import main
    from kvreplay.ledger.compare import compare_ledger_roots, compare_rows

    def run(*args: str) -> subprocess.CompletedProcess:
        """``python -m kvreplay.ledger ARGS`` in this process: its exit status (argparse's too) and what it printed."""
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code
        said = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, said.out, said.err)

    committed, recomputed = tmp_path / "committed", tmp_path / "recomputed"
    config = {"a": 1, "problem_ids": ["p0", "p1", "p2"]}
    ledger = Ledger(committed, "x-bfloat16", config, environment={"library": "this"})
    for i in range(3):
        ledger.append({"problem_id": f"p{i}", "v": i})
    (committed / "panel.json").write_text("[1]\n")
    (committed / "only_committed.json").write_text("{}\n")
    again = Ledger(recomputed, "x-bfloat16", config, environment={"library": "other"})
    for i in range(2):  # unfinished, identical so far
        again.append({"problem_id": f"p{i}", "v": i})
    (recomputed / "panel.json").write_text("[1]\n")
    (recomputed / "tmp-x").mkdir()  # not a ledger: left out
    by_name = {e["name"]: e for e in compare_ledger_roots(recomputed, committed)}
    assert "tmp-x" not in by_name
    entry = by_name[ledger.dir.name]
    assert entry["rows"] == {"rows": (2, 3), "identical": 2, "state": "prefix", "first_difference": None}
    assert entry["manifest"] == "identical" and entry["environment"] == ["execution_contract.library"]
    assert by_name["panel.json"] == {"name": "panel.json", "kind": "file", "file": "identical"}
    assert by_name["only_committed.json"]["not_recomputed"]
    out = subprocess.run([sys.executable, "-m", "kvreplay.ledger", "compare", str(recomputed), str(committed)],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "identical so far (2 of 3 committed)" in out.stdout, out.stdout
    assert "1 ledger(s) compared, 0 identical, 1 committed entries not recomputed" in out.stdout
    assert run("compare", "--complete", str(recomputed), str(committed)).returncode == 1

    rows = again.dir / "rows.jsonl"
    text = ledger.rows_path.read_text()
    rows.write_text(text[: text.index("p2") + 1])  # a last line being written, the same so far: unfinished
    assert compare_rows(rows.read_text(), text)["state"] == "prefix"
    rows.write_text(text.replace('"v":2', '"v":99'))  # the third row parts
    out = run("compare", str(recomputed), str(committed))
    assert out.returncode == 1 and "rows part after 2 identical rows, at row 3 (p2)" in out.stdout, out.stdout
    rows.write_text(text[:-5] + "\u2028" + text[-5:])  # a raw line separator inside a row is not a new row
    assert compare_rows(rows.read_text(), text)["rows"] == (3, 3)
    rows.unlink()
    shutil.copy(ledger.rows_path, rows)
    (recomputed / "panel.json").write_text("[2]\n")
    (recomputed / "extra.json").write_text("{}\n")
    out = run("compare", str(recomputed), str(committed))
    assert out.returncode == 1 and "rows identical (3)" in out.stdout and "panel.json: differs" in out.stdout
    assert "extra.json: recomputed, not in the committed folder" in out.stdout
    (recomputed / "panel.json").write_text("[1]\n")
    (recomputed / "extra.json").unlink()
    assert run("compare", str(recomputed), str(committed)).returncode == 0
    assert run("compare", "--complete", str(recomputed), str(committed)).returncode == 1  # only_committed.json
    (committed / "only_committed.json").unlink()
    assert run("compare", "--complete", str(recomputed), str(committed)).returncode == 0

    empty = tmp_path / "empty"
    empty.mkdir()
    out = run("compare", str(empty), str(committed))
    assert out.returncode == 1 and "nothing compared" in out.stderr
    (again.dir / "rows.jsonl.gz").write_bytes(gzip.compress(b"x")[:-4])  # a broken gzip beside the rows
    rows.unlink()
    out = run("compare", str(recomputed), str(committed))
    assert out.returncode == 2 and "cannot be read" in out.stderr, out.stderr
    out = run("compare", str(ledger.dir), str(committed))
    assert out.returncode == 2 and "is a ledger folder" in out.stderr
    assert run("compare", str(recomputed)).returncode == 2  # argparse: two folders
    assert run("compare", str(tmp_path / "nowhere"), str(committed)).returncode == 2


def test_a_row_holding_a_unicode_line_separator_reads_back_as_one_row(tmp_path):
    """canonical_json writes U+2028 / U+0085 raw inside strings (ensure_ascii=False): every reader splits rows at
    newlines only, so such a row (e.g. a decoded suffix) is neither split nor mistaken for a cut-off write."""
    from kvreplay.ledger.lookup import read_ledger
    from kvreplay.ledger.store import read_rows_text, row_lines, seal

    ledger = Ledger(tmp_path, "sep-bfloat16", {"a": 1, "problem_ids": ["p0", "p1"]})
    rows = [{"problem_id": "p0", "text": "a\u2028b\x85c"}, {"problem_id": "p1", "text": "d"}]
    for row in rows:
        ledger.append(row)
    assert "\u2028" in ledger.rows_path.read_text(encoding="utf-8")
    assert ledger.records() == rows and len(row_lines(read_rows_text(ledger.dir))) == 2
    seal(ledger.dir)
    assert read_ledger(ledger.dir).records == rows
    assert Ledger(tmp_path, "sep-bfloat16", {"a": 1, "problem_ids": ["p0", "p1"]}).complete(["p0", "p1"])


def test_a_read_only_ledger_root_keeps_its_prefix_bank(tmp_path, monkeypatch):
    """Under KV_LEDGERS_READ_ONLY=1 the bank is left untouched when it already holds the same bank (same source
    ledger), and refused when it would be created or its manifest would change."""
    import pytest
    from kvreplay.ledger import READ_ONLY_ENV, ReadOnlyLedgerError
    from kvreplay.ledger.prefix_bank import write_prefix_bank

    rows = [{"problem_id": "p1", "prompt_len": 3, "prefix": [1, 2, 3, 4]}]
    bank = tmp_path / "prefix_bank_bf16.jsonl"
    digest = write_prefix_bank(rows, bank, "exp1-bfloat16-abc")
    manifest = bank.with_name(bank.name + ".manifest.json")
    stamps = (bank.stat().st_mtime_ns, manifest.stat().st_mtime_ns)
    monkeypatch.setenv(READ_ONLY_ENV, "1")
    assert write_prefix_bank(rows, bank, "exp1-bfloat16-abc") == digest
    assert (bank.stat().st_mtime_ns, manifest.stat().st_mtime_ns) == stamps  # not even rewritten
    with pytest.raises(ReadOnlyLedgerError, match="prefix bank .* would be changed"):
        write_prefix_bank(rows, bank, "exp1-bfloat16-other")
    with pytest.raises(ReadOnlyLedgerError, match="would be created"):
        write_prefix_bank(rows, tmp_path / "new" / "prefix_bank_bf16.jsonl", "exp1-bfloat16-abc")
    assert not (tmp_path / "new").exists() and '"exp1-bfloat16-abc"' in manifest.read_text()
