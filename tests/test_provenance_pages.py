"""docs/provenance.md and the generated blocks of the README and docs/differences.md agree with the ledgers; the rows
whose sampled float32 check never ran are read from run logs written by the real runner code; each rule set after
results were seen is checked against git and the first run-log event of the ledgers it names."""

from __future__ import annotations

import json
import shutil
import subprocess
from datetime import datetime
from pathlib import Path

import pytest
from kvreplay.ledger import provenance as prov
from kvreplay.ledger.__main__ import main as ledger_main
from kvreplay.ledger.store import Ledger, library_digest, run_rows
from kvreplay.paths import DATA, ROOT
from kvreplay.report import provenance_pages as pp
from kvreplay.runner import row_checks


def test_the_committed_provenance_docs_agree_with_the_ledgers():
    assert pp.check() == []


def test_the_check_names_a_count_typed_by_hand(tmp_path, monkeypatch):
    import functools

    monkeypatch.setattr(pp, "provenance_page", functools.cache(pp.provenance_page))  # the ledgers read once, not twice
    for rel in ("README.md", "docs/differences.md", "docs/provenance.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    page = tmp_path / "docs" / "provenance.md"
    text = page.read_text()
    line = next(x for x in text.splitlines() if x.startswith("| all of `ledgers/`"))
    cells = line.split("|")
    cells[4] = " 999999 "  # the run-log events of all of ledgers/, as if typed by hand
    page.write_text(text.replace(line, "|".join(cells)))
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text().replace("exact McNemar 4 vs 0", "exact McNemar 5 vs 0"))
    diffs = pp.check(tmp_path)
    assert [d.split(":")[0] for d in diffs] == ["docs/provenance.md", "README.md"]
    assert "| all of `ledgers/` |" in diffs[0] and "McNemar 5 vs 0" in diffs[1]
    (tmp_path / "docs" / "differences.md").write_text("no generated block here\n")
    with pytest.raises(ValueError, match="0 `<!-- generated:length-arm"):
        pp.check(tmp_path)


def test_the_kernel_paragraph_marks_the_rows_of_a_library_no_commit_has(tmp_path):
    text = pp.kernel_paragraph()
    assert "exact McNemar 4 vs 0, p = 0.125" in text and "7 of 14 problems under `invariant`" in text
    assert "† Rows written by library `8c0380f3…`, which no commit has" in text
    libraries = json.loads((DATA / "libraries.json").read_text())
    orphan = next(d for d, c in libraries["libraries"].items() if c is None)
    libraries["libraries"][orphan] = {"commit": "0" * 40, "date": "2026-12-06T00:00:00+00:00", "sampled_check": True}
    data = tmp_path / "data"
    shutil.copytree(DATA / "kernel_ablation", data / "kernel_ablation")
    (data / "libraries.json").write_text(json.dumps(libraries))
    assert "†" not in pp.kernel_paragraph(data / "kernel_ablation" / "cpu", data)


def _ledger(root: Path, dtype: str) -> Ledger:
    return Ledger(root, f"exp1-{dtype}", {"experiment": "exp1", "dtype": dtype}, environment={}, row_algorithm=1)


def test_rows_whose_sampled_check_never_ran_are_read_from_the_runners_run_log(tmp_path, monkeypatch):
    """Chunks of 2 through :func:`kvreplay.runner.row_checks.sampled_equivalence` and :func:`run_rows`: a passing
    chunk counts its rows as checked; a run stopped before its last chunk was checked leaves that row unchecked."""
    from kvreplay.runner import equivalence

    monkeypatch.setattr(equivalence, "construction_equivalences", lambda spec, pairs: [{"rel_l2": 0.0} for _ in pairs])
    ledger = _ledger(tmp_path, "bfloat16")
    ids = ["p1", "p2", "p3"]

    def mapper(items):
        for i in items:
            if i == "p3" and stop:
                raise KeyboardInterrupt
            yield {"problem_id": i, "prefix": [1] * (len(i) + ids.index(i))}

    checked = row_checks.sampled_equivalence(mapper, None, {i: i for i in ids}, frozenset(), 2, ledger.log,
                                             key=lambda k: k)
    stop = False
    run_rows(ledger, ids[:2], None, key=lambda k: k, mapper=checked, progress=False)
    stop = True
    with pytest.raises(KeyboardInterrupt):
        run_rows(ledger, ids, None, key=lambda k: k, mapper=checked, progress=False)
    stop = False
    log = ledger.dir / "runlog.jsonl"
    events = [json.loads(x) for x in log.read_text().splitlines()]
    assert [e["event"] for e in events].count("equivalence_sample") == 1
    assert prov.sampled_check_missing(ledger.dir, {library_digest(): True}) == {}  # p3 not appended yet
    # a row appended after the last sample event, by a run that was then killed, is unchecked
    with log.open("a") as f:
        f.write(json.dumps({"event": "start"}) + "\n" + json.dumps({"event": "row", "key": "p3"}) + "\n")
        f.write(json.dumps({"event": "row", "key": "p4", "library_sha256": library_digest()}) + "\n")
    missing = prov.sampled_check_missing(ledger.dir, {library_digest(): True})
    assert missing == {"p3": "not run (run log names no library)",
                       "p4": f"never ran (library {library_digest()[:12]})"}
    assert prov.sampled_check_missing(ledger.dir, {})["p4"] == \
        f"not run (library {library_digest()[:12]}, in no commit)"
    assert prov.sampled_check_missing(ledger.dir, {library_digest(): False})["p4"] == \
        f"not run (library {library_digest()[:12]})"
    # a failed sample checks nothing; a float32 ledger checks every row itself
    with log.open("a") as f:
        f.write(json.dumps({"event": "equivalence_sample", "passed": False, "checks": [{"problem_id": "p4"}]}) + "\n")
    assert set(prov.sampled_check_missing(ledger.dir, {})) == {"p3", "p4"}
    fp32 = _ledger(tmp_path, "float32")
    run_rows(fp32, ids, lambda k: {"problem_id": k}, key=lambda k: k, progress=False)
    assert prov.sampled_check_missing(fp32.dir, {}) == {}


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


def _full_clone() -> bool:
    try:
        return _git("rev-parse", "--is-shallow-repository") == "false"
    except (OSError, subprocess.CalledProcessError):
        return False


@pytest.mark.skipif(not _full_clone(), reason="needs the repository's full git history")
def test_the_committed_library_map_is_what_git_gives(tmp_path, capsys):
    roots = [str(r) for r in pp.ledger_roots()]
    assert ledger_main(["libraries", "--check", *roots]) == 0
    out = capsys.readouterr().out
    committed = json.loads((DATA / "libraries.json").read_text())["libraries"]
    assert all((f"{d[:12]}: in no commit" in out) == (c is None) for d, c in committed.items())
    stale = tmp_path / "libraries.json"
    stale.write_text((DATA / "libraries.json").read_text().replace('"sampled_check": true', '"sampled_check": false'))
    assert ledger_main(["libraries", "--check", "--out", str(stale), *roots]) == 1
    assert ledger_main(["libraries", "--out", str(stale), *roots]) == 0
    assert stale.read_text() == (DATA / "libraries.json").read_text()


@pytest.mark.skipif(not _full_clone(), reason="needs git")
def test_every_committed_ledger_root_is_on_the_page():
    tracked = {"/".join(Path(f).parts[1:3]) for f in _git("ls-files", "data/ledgers", "data/kernel_ablation").split()
               if f.endswith("/manifest.json")}
    assert tracked == set(pp.COMMITTED_ROOTS)


def test_each_post_hoc_rule_follows_the_results_it_names():
    rules = pp.read_rules()
    git = _full_clone()
    for r in rules:
        when = datetime.fromisoformat(r["date"])
        if git:
            times = [datetime.fromisoformat(_git("log", "-1", "--format=%cI", c)) for c in r["commits"]]
            assert times[0] == when, f"{r['rule']}: date {r['date']} is not commit {r['commits'][0]}'s"
            when_last = max(times)
        else:
            when_last = when
        seen = pp.rule_ledgers(r["seen"])
        removed = pp.removed_ledgers(r) if git else []
        assert seen or r["replaced"] or r.get("seen_removed"), (
            f"{r['rule']}: names no ledger seen before it and none replaced")
        assert removed or not (git and r.get("seen_removed")), f"{r['rule']}: seen_removed matches no ledger there"
        for folder, first in [(f.name, pp.first_event(f)) for f in seen] + removed:
            assert first is not None and first < when, f"{r['rule']}: {folder} begins {first}, after the rule"
        for pattern in r["seen"] + r["governs"]:
            assert pp.rule_ledgers([pattern]), f"{r['rule']}: {pattern!r} matches no ledger folder under data/"
        if r["replaced"]:
            for folder in pp.rule_ledgers(r["governs"]):
                first = pp.first_event(folder)
                assert first is not None and first > when_last, (
                    f"{r['rule']}: {folder.name} begins {first}, before the rule that replaced what was seen")


def test_ledgers_seen_and_removed_are_read_from_the_commit_that_held_them(tmp_path):
    """A rule's ``seen_removed`` globs are matched in a commit's tree and dated by the first run-log event there."""
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    folder = tmp_path / "data" / "ledgers" / "p" / "exp1-bfloat16-abc"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    (folder / "runlog.jsonl").write_text('{"event": "start", "time": "2026-12-01T00:00:00+00:00"}\n')
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    git("rm", "-rq", "data")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "y")
    rule = {"seen_removed": {"commit": "HEAD~1", "ledgers": ["ledgers/p/exp1-*"]}}
    assert pp.removed_ledgers(rule, tmp_path) == [("ledgers/p/exp1-bfloat16-abc",
                                                   datetime.fromisoformat("2026-12-01T00:00:00+00:00"))]
    assert pp.removed_ledgers({"seen_removed": {"commit": "HEAD", "ledgers": ["ledgers/p/*"]}}, tmp_path) == []
    assert pp.removed_ledgers({}, tmp_path) == []


def test_a_rule_entry_missing_a_field_is_named(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text("- rule: x\n  commits: [abc]\n  date: '2026-12-06T00:00:00+00:00'\n  seen: []\n  governs: []\n")
    with pytest.raises(ValueError, match=r"entry 0: field 'replaced'"):
        pp.read_rules(path)
