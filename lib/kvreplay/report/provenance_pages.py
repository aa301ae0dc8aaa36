"""``docs/provenance.md`` and the generated blocks of the README and ``docs/differences.md``, from the ledgers.

Every count and provenance statement of those docs is rendered here from data, never typed. Per ledger root
(``data/ledgers/<profile>``, ``data/kernel_ablation/<profile>``): its ledger folders and library digests, run-log
events with and without a digest, and rows whose sampled float32 check never ran
(:func:`kvreplay.ledger.provenance.sampled_check_missing`). Per digest: its first commit (``data/libraries.json``,
:func:`kvreplay.ledger.provenance.library_commits`). Also the checkpoint each Experiment 5 used, which profiles
run the same problems at two branch caps, the rules set after results were seen (``data/post_hoc_rules.yaml``)
and the README's kernel-ablation paragraph (:func:`kernel_paragraph`). ``make paper`` calls :func:`regenerate`::

    python -m kvreplay.report.provenance_pages          # rewrite docs/provenance.md and the blocks
    python -m kvreplay.report.provenance_pages --check  # change nothing; exit 1 naming what differs
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import Counter
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from ..ledger import provenance as prov
from ..ledger.files import read_log, read_manifest
from ..paths import DATA, ROOT
from ..analysis.stats import mcnemar_exact
from .kernel_ablation_legacy import load_ablation
from .markdown import table
from .prefix_length import length_arm_text
from .summary import checkpoint_recipe

TOOL = "python -m kvreplay.report.provenance_pages"
LIBRARIES = DATA / "libraries.json"
RULES = DATA / "post_hoc_rules.yaml"
ABLATION = DATA / "kernel_ablation"
PAGE = Path("docs") / "provenance.md"
BLOCK = re.compile(r"(<!-- generated:(?P<name>[\w-]+) [^\n]*-->\n)(?P<body>.*?)(<!-- /generated:(?P=name) -->)", re.S)


COMMITTED_ROOTS = ("ledgers/cpu", "ledgers/gpu", "ledgers/gpu_eager", "ledgers/paper", "kernel_ablation/cpu")
"""The committed folders of ledger folders, under ``data/``, that the page covers (named, not globbed: a user's own
profile writes ``data/ledgers/<name>/`` beside them). ``tests/test_provenance_pages.py`` requires every folder git
tracks there to be listed."""


def ledger_roots(data: Path = DATA) -> list[Path]:
    """The folders of :data:`COMMITTED_ROOTS` under ``data`` that hold a ledger folder, in that order."""
    return [data / r for r in COMMITTED_ROOTS if any((data / r).glob("*/manifest.json"))]


def day(when: datetime | str) -> str:
    """``1 Dec 2026``: a commit's or an event's day, as the docs write dates."""
    when = datetime.fromisoformat(when) if isinstance(when, str) else when
    return f"{when.day} {when:%b %Y}"


def _short(digest: str | None, libraries: Mapping[str, Any]) -> str:
    if not digest:
        return "none"
    return f"`{digest[:12]}`" + ("" if libraries.get(digest) else " (in no commit)")


def _row_libraries(folder: Path) -> Counter:
    """Library digest (``""``: none recorded) -> rows whose ``row`` event it logged."""
    return Counter(e.get("library_sha256") or "" for e in read_log(folder / "runlog.jsonl") if e.get("event") == "row")


def _rows_below_fp32(folder: Path) -> int:
    dtype = read_manifest(folder).get("config", {}).get("dtype", "float32")
    return 0 if dtype == "float32" else sum(_row_libraries(folder).values())


def _has_check(libraries: Mapping[str, Any]) -> dict[str, bool | None]:
    return {d: (c.sampled_check if c else None) for d, c in libraries.items()}


def _missing_counts(folder: Path, libraries: Mapping[str, Any]) -> Counter:
    return Counter(why.split(" (")[0] for why in prov.sampled_check_missing(folder, _has_check(libraries)).values())


def _exp5_recipe(root: Path, ledger_root: Path) -> str:
    found = sorted(root.glob("exp5-*/manifest.json"))
    if not found:
        return "—"
    names = []
    for f in found:
        recipe, _ = checkpoint_recipe(read_manifest(f.parent)["config"].get("checkpoint", {}), ledger_root)
        names.append(f"`{recipe}`" if recipe else "unknown")
    return ", ".join(names)


def roots_table(roots: Mapping[Path, list[prov.LedgerProvenance]], libraries: Mapping[str, Any],
                data: Path = DATA) -> str:
    """One line per ledger root (``roots``: each root's :func:`~kvreplay.ledger.provenance.profile_provenance`), then
    the totals of ``data/ledgers``: folders, digests, events, unchecked rows."""
    rows: list[list[Any]] = []
    total: Counter[str] = Counter()
    for root, ledgers in roots.items():
        events = sum(len(read_log(root / p.name / "runlog.jsonl")) for p in ledgers)
        unstamped = sum(p.unstamped for p in ledgers)
        below = sum(_rows_below_fp32(root / p.name) for p in ledgers)
        missing = sum((_missing_counts(root / p.name, libraries) for p in ledgers), Counter())
        metric = sum(p.name.startswith("adapt_eval-") for p in ledgers)
        digests = sorted({d for p in ledgers for d in p.digests})
        rows.append([f"`{root.relative_to(data)}`", f"{len(ledgers) - metric}" + (f" + {metric}" if metric else ""),
                     ", ".join(_short(d, libraries) for d in digests), events, unstamped, below,
                     below - sum(missing.values()), missing["not run"], missing["never ran"],
                     _exp5_recipe(root, data / "ledgers")])
        if root.parent.name == "ledgers":
            total.update(folders=len(ledgers), events=events, unstamped=unstamped, below=below,
                         missing=sum(missing.values()))
    rows.append(["all of `ledgers/`", total["folders"], "", total["events"], total["unstamped"], total["below"],
                 total["below"] - total["missing"], "", "", ""])
    return table(["ledger root", "ledger folders (experiments + checkpoint metric)", "library digests",
                  "run-log events", "of those, without a digest", "rows below FP32", "sampled FP32 check passed",
                  "check not run: library without it, of no known commit, or none named",
                  "check never ran: library with it",
                  "Experiment 5's checkpoint recipe"], rows)


def libraries_table(roots: Mapping[Path, list[prov.LedgerProvenance]], libraries: Mapping[str, Any],
                    data: Path = DATA) -> str:
    """One line per library digest: its first commit, whether it had the sampled check, what it created or appended
    (``roots``: as :func:`roots_table`)."""
    created: dict[str, list[str]] = {}
    appended: Counter = Counter()
    for root, ledgers in roots.items():
        for p in ledgers:
            if p.environment:
                created.setdefault(p.environment, []).append(f"{root.relative_to(data)}/{p.name}")
            for d, n in _row_libraries(root / p.name).items():
                appended[d] += n
    rows = []
    for d in sorted(libraries, key=lambda d: (libraries[d].date if libraries[d] else "~", d)):
        c = libraries[d]
        rows.append([f"`{d[:12]}`", f"`{c.commit[:7]}`" if c else "in no commit", day(c.date) if c else "—",
                     ("yes" if c.sampled_check else "no") if c else "unknown", len(created.get(d, [])),
                     appended[d]])
    rows.append(["none recorded", "—", "—", "—", "—", appended[""]])
    return table(["library digest", "first commit", "its date", "sampled FP32 check in its code",
                  "ledger folders it created", "rows its run-log events name"], rows)


def ledgers_table(roots: Mapping[Path, list[prov.LedgerProvenance]], libraries: Mapping[str, Any],
                  data: Path = DATA) -> str:
    """One line per ledger folder: the library that created it, the ones its rows name, events, unchecked rows
    (``roots``: as :func:`roots_table`)."""
    rows = []
    for root, ledgers in roots.items():
        for p in ledgers:
            folder = root / p.name
            by = _row_libraries(folder)
            missing = prov.sampled_check_missing(folder, _has_check(libraries))
            rows.append([f"`{root.relative_to(data)}/{p.name}`", _short(p.environment, libraries),
                         "; ".join(f"{_short(d or None, libraries)}: {n}" for d, n in sorted(by.items())),
                         p.runs, p.unstamped, len(missing)])
    return table(["ledger folder", "created by", "rows by the library of their run-log event", "runs (`start` events)",
                  "events without a digest", "rows below FP32 whose sampled check did not run"], rows)


def read_rules(path: Path = RULES) -> list[dict]:
    """``data/post_hoc_rules.yaml``'s entries, each checked for its fields.

    Raises:
        ValueError: an entry lacking a field or with one of the wrong type (naming the entry's index and field).
    """
    rules = yaml.safe_load(path.read_text(encoding="utf-8"))
    want = {"rule": str, "commits": list, "date": str, "seen": list, "replaced": bool, "governs": list}
    for i, r in enumerate(rules if isinstance(rules, list) else [None]):
        for field, kind in want.items():
            if not isinstance(r, dict) or not isinstance(r.get(field), kind):
                raise ValueError(f"{path}: entry {i}: field {field!r} missing or not a {kind.__name__}")
        removed = r.get("seen_removed")
        if removed is not None and not (isinstance(removed, dict) and isinstance(removed.get("commit"), str)
                                        and isinstance(removed.get("ledgers"), list)):
            raise ValueError(f"{path}: entry {i}: field 'seen_removed' is not {{commit: str, ledgers: list}}")
    return rules


def removed_ledgers(entry: Mapping[str, Any], root: Path = ROOT) -> list[tuple[str, datetime | None]]:
    """A rule's ``seen_removed`` ledgers: ``(folder under data/, time of its first run-log event)`` for each folder
    its globs match in its commit's tree. These are ledgers seen before the rule and removed later (e.g. replaced
    by a recomputation), which git history holds. ``[]`` for a rule without the field.

    Raises:
        subprocess.CalledProcessError, OSError: no git, or a commit this clone lacks (a shallow clone)."""
    import fnmatch
    import json
    import subprocess

    removed = entry.get("seen_removed")
    if not removed:
        return []

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout

    files = git("ls-tree", "-r", "--name-only", removed["commit"], "--", "data").split()
    out = []
    for path in sorted(f for f in files if any(fnmatch.fnmatch(f, f"data/{g}/manifest.json")
                                             for g in removed["ledgers"])):
        folder = path.rsplit("/", 1)[0]
        first = git("show", f"{removed['commit']}:{folder}/runlog.jsonl").split("\n", 1)[0]
        time = json.loads(first).get("time") if first.strip() else None
        out.append((folder.removeprefix("data/"), datetime.fromisoformat(time) if time else None))
    return out


def rule_ledgers(patterns: list[str], data: Path = DATA) -> list[Path]:
    """The ledger folders (holding ``manifest.json``) of :data:`COMMITTED_ROOTS` that globs under ``data`` match."""
    roots = {data / r for r in COMMITTED_ROOTS}
    return sorted({f.parent for pat in patterns for f in data.glob(f"{pat}/manifest.json") if f.parent.parent in roots})


def first_event(folder: Path) -> datetime | None:
    """The ``time`` of a ledger's first run-log event, ``None`` for an empty run log."""
    events = read_log(folder / "runlog.jsonl")
    return datetime.fromisoformat(events[0]["time"]) if events and events[0].get("time") else None


def rules_table(rules: list[dict], data: Path = DATA) -> str:
    """The post-hoc rules: commits, date, the ledgers seen before, the ledgers governed (written before / after)."""
    rows = []
    for r in rules:
        seen, governs = rule_ledgers(r["seen"], data), rule_ledgers(r["governs"], data)
        when = datetime.fromisoformat(r["date"])
        before = sum((first_event(f) or when) < when for f in governs)
        starts = [t for t in map(first_event, seen) if t]
        removed = r.get("seen_removed")
        gone = (f"{', '.join(f'`{g}`' for g in removed['ledgers'])} in `{removed['commit']}` (since removed; git "
                "history)") if removed else ""
        rows.append([r["rule"], ", ".join(f"`{c}`" for c in r["commits"]), day(r["date"]),
                     "; ".join(x for x in [f"{len(seen)}, from {day(min(starts))}" if starts else "", gone] if x)
                     or ("since replaced (git history)" if r["replaced"] else "—"),
                     f"{len(governs)}: {before} begun before the rule, {len(governs) - before} after"
                     if governs else "none committed"])
    return table(["rule", "commits", "date", "ledgers seen before it", "ledgers it governs"], rows)


def provenance_page(data: Path = DATA) -> str:
    """The text of ``docs/provenance.md``.

    Raises:
        FileNotFoundError, LedgerFileError: ``data/libraries.json`` missing or damaged; ValueError: a bad rule entry.
    """
    libraries = prov.read_library_commits(data / "libraries.json")
    roots = ledger_roots(data)
    read = {r: prov.profile_provenance(r) for r in roots}  # each ledger's rows parsed once for all the tables
    unknown = sorted({d for ledgers in read.values() for p in ledgers for d in p.digests} - set(libraries))
    if unknown:
        raise ValueError(f"{data / 'libraries.json'} lacks digests {[d[:12] for d in unknown]}: run "
                         f"`python -m kvreplay.ledger libraries data/ledgers/* data/kernel_ablation/*`")
    profiles = [r for r in roots if r.parent.name == "ledgers"]
    return "\n".join([
        f"<!-- generated from data/ledgers/, data/kernel_ablation/, data/libraries.json and data/post_hoc_rules.yaml "
        f"by `make paper` ({TOOL}); do not edit -->",
        "# Provenance: which code wrote which rows", "",
        "Every count on this page is read from the committed ledgers (`environment.json`, `runlog.jsonl` and the rows) "
        "and from `data/libraries.json`, which gives the first commit whose `lib/kvreplay` has each library digest "
        "(`python -m kvreplay.ledger libraries` recomputes it from git). `tests/test_provenance_pages.py` fails when "
        "this page differs from what they give. `python -m kvreplay.ledger digests data/ledgers/<profile>` prints the "
        "same digests per ledger ([reproducibility.md](reproducibility.md#which-library-wrote-a-profile)).", "",
        "A row's library is the digest of its run-log `row` event; run logs written before they recorded one name "
        "none, and then only the library that created the ledger (`environment.json`) is known, not what resumed it. "
        "A row below FP32 counts as checked by the sampled FP32 construction-equivalence check "
        "([gates.md](gates.md)) only when a passing `equivalence_sample` event of its run log lists it or covers its "
        "chunk (`kvreplay.ledger.provenance.sampled_check_missing`).", "",
        "## Ledger roots", "", roots_table(read, libraries, data), "",
        "## Libraries", "", libraries_table(read, libraries, data), "",
        "## Ledger folders", "", ledgers_table(read, libraries, data), "",
        "## The same problems at two branch caps", "", *(f"- {length_arm_text(r)}" for r in profiles), "",
        "## Rules set after results were seen", "",
        "From `data/post_hoc_rules.yaml`; [differences.md](differences.md#changes-made-after-results-were-seen) says "
        "why each was made. A ledger a rule governs whose first run-log event precedes the rule's first commit was "
        "written before the rule; "
        "`tests/test_provenance_pages.py` checks each rule's commit time against the first run-log event of the "
        "ledgers it names.", "", rules_table(read_rules(data / "post_hoc_rules.yaml"), data), "",
    ])


def kernel_paragraph(root: Path = ABLATION / "cpu", data: Path = DATA) -> str:
    """The README's paragraph on the kernel ablation (BF16), from its ledgers and ``data/libraries.json``.

    Raises:
        LedgerError, LedgerLineError, RowSchemaError: as :func:`kvreplay.report.kernel_ablation_legacy.load_ablation`.
        ValueError: no rows of ``default``, ``invariant`` or the attention or linear ablation value.
    """
    libraries = prov.read_library_commits(data / "libraries.json")
    lab = load_ablation(root, "bfloat16")
    by = {v: {r["problem_id"]: r for r in rows} for v, rows in lab.by_value.items()}
    lib = {v: {(e.get("key") or e.get("problem_id")): e.get("library_sha256")
               for e in read_log(lab.folders[f"kernels-bfloat16-{v}"] / "runlog.jsonl") if e.get("event") == "row"}
           for v in by}
    orphan = sorted({d for v in lib for d in lib[v].values() if d and not libraries.get(d)})
    mark = " †" if orphan else ""

    def n(v: str) -> int:
        return len(by[v])

    def parted(v: str) -> int:
        return sum(r["diverged"] for r in by[v].values())

    def marked(v: str) -> str:
        k = sum(lib[v][p] in orphan for p in by[v])
        return f"n = {n(v)}" + (f", {k}{mark}" if k else "")

    def paired(v: str, w: str) -> tuple[list[str], Any]:
        both = [p for p in by[v] if p in by[w]]
        return both, mcnemar_exact([by[v][p]["diverged"] for p in both], [by[w][p]["diverged"] for p in both])

    d, inv, att, lin = "default", "invariant", "invariant-except-attention", "invariant-except-linear"
    missing = [v for v in (d, inv, att, lin) if not by.get(v)]
    if missing:
        raise ValueError(f"{root}: no BF16 rows of kernels {missing}; the README's kernel-ablation paragraph needs them")
    both, test = paired(d, inv)
    same_inv = sum(by[d][p]["prefix"] == by[inv][p]["prefix"] for p in both)
    both_att, test_att = paired(d, att)
    same_att = sum(by[d][p]["prefix"] == by[att][p]["prefix"] for p in both_att)
    overlap = sum(by[d][p]["diverged"] and by[att][p]["diverged"] for p in both_att)
    ratio = statistics.median(by[att][p]["drift"]["rel_l2"] / by[d][p]["drift"]["rel_l2"] for p in both_att)
    rel = {v: statistics.median(r["drift"]["rel_l2"] for r in by[v].values()) for v in (d, att)}
    small = [v for v in by if v not in (d, inv, att, lin) and not v.startswith("invariant-attention")]
    orders = lab.orders
    others = [r for r in root.parent.glob("*") if r.name != root.name and r.is_dir()]
    orphans = [f"`{v}` {k}" + (f" ({j} of its {parted(v)} that part)" if j else "") for v in by
               if (k := sum(lib[v][p] in orphan for p in by[v]))
               for j in [sum(by[v][p]["diverged"] and lib[v][p] in orphan for p in by[v])]]
    return (
        "Changing only the reduction order at fixed precision (`cpu`, BF16; [invariant "
        "kernels](docs/execution-contract.md#invariant-kernels), `data/kernel_ablation/cpu/table.md`; notebook 09 repeats it on pinned inputs): "
        f"with every reducing operation in one fixed order (`{inv}`, {marked(inv)}) prefill equals live bit for bit "
        f"({sum(r['drift']['exact'] for r in by[inv].values())}/{n(inv)}) and {parted(inv)}/{n(inv)} suffixes part, "
        f"by construction, against {parted(d)}/{n(d)} under the default kernels ({marked(d)}; exact McNemar "
        f"{test.b} vs {test.c}, p = {test.pvalue:.3g}). Leaving only attention in its default order ({marked(att)}) "
        f"brings back the drift's size (median relative L2 {rel[att]:.2e} against {rel[d]:.2e}, median ratio per "
        f"problem {ratio:.3f}) and {parted(att)}/{n(att)} divergences, not the same ones: {overlap} problems part "
        f"under both (McNemar {test_att.b} vs {test_att.c}, p = {test_att.pvalue:.3g}). Leaving the linear layers "
        f"default brings back none ({parted(lin)}/{n(lin)}; {marked(lin)}); the "
        + ", ".join(f"`{v.removeprefix('invariant-except-')}`" for v in small)
        + (" arms hold one row each" if {n(v) for v in small} == {1} else
           " arms hold " + ", ".join(f"{n(v)}" for v in small) + " rows") + ". The arms' inputs are not paired: "
        f"each decodes its own live boundary, the default kernels' on {same_inv} of {len(both)} problems under "
        f"`{inv}` and {same_att} of {len(both_att)} under `{att}`."
        + (f" Two fixed attention orders on the same IDs part on {sum(r['diverged'] for r in orders)} of "
           f"{len(orders)} problems." if orders else "")
        + (" No kernel-ablation ledger computed on a GPU is committed." if not others else "")
        + (f" † Rows written by library `{orphan[0][:8]}…`, which no commit has (not recomputed): "
           + "; ".join(orphans) + "." if orphan else ""))


def replace_blocks(text: str, blocks: Mapping[str, str], where: str) -> str:
    """``text`` with the body of each ``<!-- generated:NAME ... -->`` block named in ``blocks`` replaced.

    Raises:
        ValueError: a named block that ``text`` lacks or holds twice (naming ``where``).
    """
    for name, body in blocks.items():
        found = [m for m in BLOCK.finditer(text) if m["name"] == name]
        if len(found) != 1:
            raise ValueError(f"{where} has {len(found)} `<!-- generated:{name} ... -->` blocks; it needs one")
        m = found[0]
        text = text[:m.start("body")] + body.rstrip("\n") + "\n" + text[m.end("body"):]
    return text


def expected(root: Path = ROOT, data: Path = DATA) -> dict[Path, str]:
    """Each generated file's text: ``docs/provenance.md``, the README's kernel block, ``differences.md``'s blocks."""
    lengths = "\n".join(f"- {length_arm_text(r)}" for r in ledger_roots(data) if r.parent.name == "ledgers")
    readme, diffs = root / "README.md", root / "docs" / "differences.md"
    return {
        root / PAGE: provenance_page(data),
        readme: replace_blocks(readme.read_text(encoding="utf-8"), {"kernel-ablation": kernel_paragraph(
            data / "kernel_ablation" / "cpu", data)}, "README.md"),
        diffs: replace_blocks(diffs.read_text(encoding="utf-8"), {"length-arm": lengths}, "docs/differences.md"),
    }


def check(root: Path = ROOT, data: Path = DATA) -> list[str]:
    """Each generated file that differs from what the ledgers give, with its first differing line; ``[]`` if none."""
    out = []
    for path, want in expected(root, data).items():
        have = path.read_text(encoding="utf-8") if path.is_file() else ""
        if have != want:
            a, b = have.splitlines(), want.splitlines()
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            x, y = (a[i] if i < len(a) else ""), (b[i] if i < len(b) else "")
            j = max(0, next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y))) - 40)
            out.append(f"{path.relative_to(root)}: line {i + 1}: has {x[j:j + 100]!r}, "
                       f"the ledgers give {y[j:j + 100]!r}")
    return out


def regenerate(root: Path = ROOT, data: Path = DATA) -> list[Path]:
    """Rewrite the generated files whose text differs; returns them."""
    changed = []
    for path, text in expected(root, data).items():
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    """Rewrite the generated provenance files, or with ``--check`` name what differs (exit 1); exit 2 on bad input."""
    ap = argparse.ArgumentParser(prog=TOOL, description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 naming each file that differs")
    args = ap.parse_args(argv)
    try:
        if args.check:
            diffs = check()
            print("\n".join(diffs) or f"the provenance pages agree with the ledgers under {DATA}")
            return 1 if diffs else 0
        print("\n".join(f"rewritten: {p.relative_to(ROOT)}" for p in regenerate()) or "unchanged")
        return 0
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
