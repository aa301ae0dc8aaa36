"""Compute arms of a profile's chain on a lent GPU exactly as its notebooks would, and bring the ledgers back.

Usage (on the GPU machine, after ``source scripts/offline_gpu_env.sh``)::

    python3 scripts/gpu_profile.py OUTDIR ARM [ARM ...] [--profile gpu] [--budget SECONDS] [--min-arm-s SECONDS]
        [--set NAME=VALUE ...]

    python3 scripts/gpu_profile.py --list-arms [NOTEBOOK ...]

``ARM`` is a ledger label ``<experiment>-<dtype>`` of an arm of :data:`kvreplay.arm_facts.ARM_FACTS` (``--help``
lists them, in chain order): ``exp1-bfloat16``, ``exp1-float32`` (notebook 01; the BF16 arm,
:data:`~kvreplay.arm_facts.PREFIX_BANK_SOURCE`, also writes the prefix bank, as the notebook does),
``exp1_ties-bfloat16`` (notebook 01's tie-rule control, one ledger per rule of the profile's ``tie_rules``),
``exp1_length-bfloat16`` (notebook 01's manipulated-length arm, one ledger per cap of ``length_branch_caps``),
``exp2-bfloat16``, ``exp2-float32`` (notebook 02, reading that bank), ``exp2_controls-bfloat16`` (notebook 02's
exploratory controls), and ``exp3-bfloat16``, ``exp4-bfloat16``, ``exp5-bfloat16`` (notebooks 03-05, each with its
panel frozen and written as the notebook writes it). ``--list-arms`` prints the paper's arms (no exploratory control)
of the notebooks numbered ``NOTEBOOK`` (``01``; default: all), BF16 arms first, space-separated, for a shell
script's default arm list (``scripts/gpu_gemma_trial.sh``).

Each arm is run through its one declaration (:data:`kvreplay.experiments.arms.ARMS`), under the notebook's own two
parameters, ``profile`` and ``overrides``, handed to :func:`kvreplay.session.open_session` as the notebook's setup
cell hands them, and :meth:`~kvreplay.session.Session.run`, the call of the notebook's run cell. So the ledgers written here
have the config digests the notebooks look for, and ``make paper
PROFILE=<profile>`` later reads them without computing anything. (``--set
NAME=VALUE`` adds an override, for a dry run of this script on the CPU or to
change the chunk; a key of the execution contract, e.g. ``--set chunk=32`` or
``--set device=cpu``, is put into the profile's ``execution`` mapping, over its
other keys; a CPU dry run of a graph profile also needs ``--set step_path=engine-eager``.
Anything but ``chunk`` or ``workers`` gives the ledgers other keys.
Every ``--set`` is checked against the chain's parameters before any arm starts.)

Ledgers are written under ``$KV_LEDGERS`` (default ``/tmp/kv/ledgers``), which
lasts while the machine stays warm; ledger folders and the prefix bank already
in the repository's ``data/ledgers/<profile>/`` are copied there first, so an
arm cut off earlier resumes from its last finished row (``--from-scratch``: none of them is copied, and
every arm is computed again, e.g. to recompute a whole profile under one library, see
``scripts/offline_gpu_env.sh`` for carrying a frozen one). Each arm runs in a
child process with a time limit (what is left of ``--budget``, default 560 s,
minus 25 s to pack); a killed arm keeps its finished rows (a cut-off last
line is removed on resume). The child is also given that limit as
``KV_CHUNK_DEADLINE``, so a batched arm does not start a chunk that its
longest chunk so far (its preflight gates left out) says would not finish (it stops with ``"stopped"`` in
its entry) instead of losing the chunk's rows to the kill; the child's first chunk is
held to the same rule through ``KV_FIRST_CHUNK_ESTIMATE`` (:func:`longest_chunk_s`: the longest earlier chunk of
the same size, gates included, in the arm's run logs, committed or on this machine; none: unguarded; an empty
value set by the caller turns it off), and an arm stopped before its first chunk counts as a failure
(``no_progress``). ``--from-scratch --upstream-of-this-library`` also copies the committed ledger folders that the
running library wrote (but not those of the arms it runs) and the prefix bank built from one of them, so that a later arm (Experiments 3-5, the
controls) is recomputed on a fresh machine without recomputing its upstream. With ``--from-scratch`` an arm whose ledger on this machine holds rows of another library is
refused (they would be resumed, not recomputed); each entry records ``rows_before``, the rows it resumed from. After each arm its ledger folder is packed,
rows sealed (gzip), into ``OUTDIR/<ledger folder>.tar.gz``, and
``OUTDIR/gpu_profile.json`` records per arm: wall time, rows done of rows
wanted, gate failures and the exit status. Nothing about outcomes is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "lib"))  # kvreplay.arm_facts imports no torch: the parent reads it
from kvreplay.arm_facts import PREFIX_BANK_SOURCE, arm_labels  # noqa: E402
PACK_S = 25.0
CHUNK_DEADLINE_ENV = "KV_CHUNK_DEADLINE"  # kvreplay.runner.CHUNK_DEADLINE_ENV (this process does not import torch)
FIRST_CHUNK_ESTIMATE_ENV = "KV_FIRST_CHUNK_ESTIMATE"  # kvreplay.runner.FIRST_CHUNK_ESTIMATE_ENV
DEADLINE_MARGIN_S = 10.0  # a chunk must end this long before the child's time limit


INPUTS = {"role_adaptation.json"}
"""Files of a profile's ledger folder that are inputs of its chain, not computed by its arms (the pointer to the
checkpoint family notebook 00 trains on the CPU): ``--from-scratch`` still copies them."""


def seed_ledger_root(here: Path, there: Path, from_scratch: bool = False, library: str | None = None,
                     arms: tuple[str, ...] = ()) -> list[str]:
    """Copy the committed ledger folders and files of ``here`` (``data/ledgers/<profile>``) into ``there`` (under
    ``$KV_LEDGERS``), so an arm resumes from them; never overwrite what ``there`` already holds. With
    ``from_scratch`` only :data:`INPUTS` are copied, and, when ``library`` (a ``library_sha256``) is given, also
    the ledger folders that library wrote (their ``environment.json``) and the prefix bank whose source ledger is
    one of them, except the folders of ``arms`` (``exp4-bfloat16``, ...: those are recomputed) and a bank built from
    one of those: the upstream an arm reads, never rows or a panel of another library. Returns the names copied."""
    def own(src: Path) -> bool:
        if src.is_dir():
            return _library_of(src) == library and not any(src.name.startswith(f"{arm}-") for arm in arms)
        if src.name.startswith("prefix_bank_") and src.name.endswith((".jsonl", ".jsonl.manifest.json")):
            manifest = here / (src.name if src.name.endswith(".manifest.json") else src.name + ".manifest.json")
            source = _json_file(manifest).get("source_ledger") if manifest.is_file() else None
            return bool(source) and own(here / source)  # not when its source arm is recomputed here
        return False

    copied = []
    if here.is_dir():
        for src in sorted(here.iterdir()):
            if (there / src.name).exists():
                continue
            if from_scratch and src.name not in INPUTS and not (library and own(src)):
                continue
            (shutil.copytree if src.is_dir() else shutil.copy2)(src, there / src.name)
            copied.append(src.name)
    return copied


def _json_file(path: Path) -> dict:
    """A JSON object from ``path``; a file that is not one stops the script with its name (before any arm runs)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {path}: not readable as JSON ({e})") from None
    if not isinstance(doc, dict):
        raise SystemExit(f"error: {path}: a JSON {type(doc).__name__}, not an object")
    return doc


def _library_of(folder: Path) -> str | None:
    """The ``library_sha256`` a ledger folder was written by (its ``environment.json``), or ``None``."""
    env = folder / "environment.json"
    return _json_file(env).get("library_sha256") if env.is_file() else None


def _rows_in(folder: Path) -> int:
    """Finished rows of a ledger folder (plain or sealed), 0 when none."""
    from kvreplay.ledger.store import read_rows_text

    return read_rows_text(folder).count("\n") if (folder / "manifest.json").is_file() else 0


def longest_chunk_s(folders: list[Path], arm: str, chunk: int, resuming: bool) -> float | None:
    """The estimate of a call's first chunk of ``arm``: its longest earlier chunk of the same size, from run logs.

    A batched arm logs each chunk's wall time on the chunk's first row (its other rows get ~0 s), and a run's first
    chunk carries that run's preflight gates: a new arm's (``composition``, ``graph_equals_eager``: 100-200 s at the
    paper caps) or a resumed arm's (one committed row, 30-80 s). Counted here: the row times under an ``engine``
    event of ``chunk`` problems per chunk (``chunk``, else ``batch``), in every ledger folder of the arm
    (``<arm>-*``) in ``folders`` (the committed profile folder and this machine's); when ``resuming``, a new arm's
    first chunk is left out (this call runs the cheaper resumed-arm gate). A line cut off by a kill is skipped.

    Returns:
        seconds, or ``None`` when no run log has a chunk of that size (the first chunk is then not guarded).
    """
    times = []
    for folder in folders:
        for log in sorted(folder.glob(f"{arm}-*/runlog.jsonl")) if folder.is_dir() else []:
            size, new_arm, first = None, False, False
            for line in log.read_text().splitlines():
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                kind = event.get("event")
                if kind == "engine":
                    size = event.get("chunk") or event.get("batch")
                elif kind == "start":
                    new_arm, first = event.get("todo") == event.get("rows"), True
                elif kind == "row" and isinstance(event.get("seconds"), (int, float)):
                    if size is not None and size == chunk and not (first and new_arm and resuming):
                        times.append(float(event["seconds"]))
                    first = False
    return max(times) if times else None


def arm_overrides(profile: str, sets: dict) -> dict:
    """The ``overrides`` parameter for ``--set NAME=VALUE`` values, checked against the chain's parameters.

    A name that is an execution-contract key (:data:`kvreplay.runner.EXECUTION_KEYS`, e.g. ``chunk``) goes into
    the profile's ``execution`` mapping (or over ``--set execution={...}`` when given, which replaces the
    profile's, as any override does), over its other keys; any other name is an override as given.

    Raises:
        ValueError: a name that is not a chain parameter (with the closest one), or a value
            :func:`kvreplay.profiles.load_parameters` refuses.
    """
    import difflib

    from kvreplay.profiles import FIELDS, load_parameters
    from kvreplay.runner import EXECUTION_KEYS

    for name in sets:
        if name not in FIELDS and name not in EXECUTION_KEYS:
            near = difflib.get_close_matches(name, [*FIELDS, *EXECUTION_KEYS], n=1)
            raise ValueError(f"--set {name}=...: {name!r} is neither a chain parameter (kvreplay.profiles.ChainParameters) "
                             f"nor an execution-contract key (kvreplay.runner.EXECUTION_KEYS)"
                             + (f"; did you mean {near[0]!r}?" if near else ""))
    overrides = {k: v for k, v in sets.items() if k not in EXECUTION_KEYS}
    contract = {k: v for k, v in sets.items() if k in EXECUTION_KEYS}
    if contract:
        base = overrides["execution"] if isinstance(overrides.get("execution"), dict) else load_parameters(profile).execution
        overrides["execution"] = {**base, **contract}
    try:
        load_parameters(profile, overrides)
    except ValueError as e:
        raise ValueError(f"--set {', '.join(f'{k}={v!r}' for k, v in sets.items())}: {e}") from None
    return overrides


def run_one(arm: str, profile: str, ledger_root: Path, overrides: dict) -> dict:
    """Compute one arm in this process (the child) through its declaration, as its notebook does; returns what it did.

    The arm is planned by :meth:`kvreplay.session.Session.plan` (its panel frozen and written as the notebook writes
    it) and run by :meth:`~kvreplay.session.Session.run`; Experiment 1's BF16 arm also writes the prefix bank.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    from kvreplay.experiments.arms import ARMS
    from kvreplay.session import open_session

    experiment, dtype = arm.rsplit("-", 1)
    declared = ARMS[experiment]
    session = open_session(declared.notebook, profile, overrides | {"ledger_root": str(ledger_root)})
    t = time.perf_counter()
    if declared.variants is not None:  # one ledger per variant (the tie rules, the branch caps of the length arm)
        done = [session.run(plan, dtype) for plan in session.plans(declared)]
        if not done:
            listing = declared.facts.variants
            raise ValueError(f"arm {arm}: the profile lists no variant ({listing} is empty); --set {listing}=...")
        return {"ledger": [ledger.dir.name for _, ledger in done], "rows": sum(len(r) for r, _ in done),
                "wall_s": round(time.perf_counter() - t, 1)}
    records, ledger = session.run(declared, dtype)
    if arm == PREFIX_BANK_SOURCE:  # notebook 01's next cell: the bank Experiments 2-5 read
        session.write_prefix_bank(records, ledger)
    # the parent reads the gate failures from the ledger it packs (also for an arm stopped or cut off)
    return {"ledger": ledger.dir.name, "rows": len(records), "wall_s": round(time.perf_counter() - t, 1)}


def ledger_gate_failures(folder: Path) -> list[tuple[str, dict]]:
    """``(problem_id, gate_failure)`` of every finished row of a ledger folder that failed a gate, or whose chunk's
    sampled float32 check failed or never ran (gate ``equivalence``; :mod:`kvreplay.ledger.checked`). A last line cut
    off by the time limit is left out, as every reader leaves it out."""
    from kvreplay.ledger.checked import check_status
    from kvreplay.ledger.files import read_log
    from kvreplay.ledger.store import ledger_rows

    status = check_status(read_log(folder / "runlog.jsonl"))
    out = []
    for r in (row.record for row in ledger_rows(folder)):
        if r.get("gate_failure"):
            out.append((r["problem_id"], r["gate_failure"]))
        elif status.get(r["problem_id"]) in ("failed", "pending"):
            out.append((r["problem_id"], {"gate": "equivalence", "reason": f"its chunk's sampled float32 check "
                                          f"{'failed' if status[r['problem_id']] == 'failed' else 'never ran'}"}))
    return out


def pack(folder: Path, out: Path) -> Path:
    """``OUTDIR/<folder>.tar.gz`` of a copy of the ledger folder with its rows sealed (the original stays appendable)."""
    from kvreplay.ledger.store import seal

    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / folder.name
        shutil.copytree(folder, copy)
        if (copy / "rows.jsonl").exists():
            data = (copy / "rows.jsonl").read_bytes()
            if data and not data.endswith(b"\n"):  # a row cut off by the time limit
                (copy / "rows.jsonl").write_bytes(data[: data.rfind(b"\n") + 1])
            if (copy / "rows.jsonl").stat().st_size:
                seal(copy)
            else:
                (copy / "rows.jsonl").unlink()
        dest = out / f"{folder.name}.tar.gz"
        with tarfile.open(dest, "w:gz") as tar:
            tar.add(copy, arcname=folder.name)
    return dest


def list_arms(notebooks: list[str]) -> list[str]:
    """The labels of the paper's arms (no exploratory control) of the notebooks numbered ``notebooks`` (all when
    empty), in chain order with the BF16 arms first: a budgeted run's upstream arms come first."""
    from kvreplay.arm_facts import chain_facts

    labels = [label for f in chain_facts() if not f.exploratory and (not notebooks or f.notebook[:2] in notebooks)
              for label in f.labels()]
    return sorted(labels, key=lambda label: not label.endswith("-bfloat16"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--list-arms"]:
        print(" ".join(list_arms(argv[1:])))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("out", type=Path, help="folder for the packed ledgers (<ledger folder>.tar.gz) and gpu_profile.json "
                    "(on the device: $OUT)")
    ap.add_argument("arms", nargs="+", help=f"arms in order: {', '.join(arm_labels())}. Exits 1 when an arm failed (its error "
                    "is in gpu_profile.json), was killed at the budget, was refused (--from-scratch) or stopped before "
                    "computing a row (no_progress); an arm skipped by --min-arm-s is not a failure")
    ap.add_argument("--profile", default="gpu", help="the profile whose arms run (notebooks/params/<profile>.yaml)")
    ap.add_argument("--budget", type=float, default=560.0, help="seconds for all arms, packing included")
    ap.add_argument("--min-arm-s", type=float, default=30.0,
                    help="do not start an arm with less time left than this. Its first chunk is not begun when the "
                         "longest earlier chunk of its size in its run logs (KV_FIRST_CHUNK_ESTIMATE; set it empty to "
                         "turn that off) says it would not end in time; with no such run log it runs to its end or to "
                         "the kill (at the paper caps a call's gates and first chunk of 32 took 390-460 s: set ~480)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="override a parameter (YAML value); an execution-contract key (e.g. chunk=32) goes into the "
                         "profile's `execution` mapping, over its other keys (a CPU dry run of a CUDA profile needs "
                         "both device=cpu and step_path=engine-eager, and writes ledgers under other keys)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--from-scratch", action="store_true",
                    help="copy none of the committed ledgers, prefix bank or panels of the profile (only "
                         f"{', '.join(sorted(INPUTS))}): every arm computes its rows again under this code, to be "
                         "compared with the committed ones by `python -m kvreplay.ledger compare` (what this "
                         "machine already holds under $KV_LEDGERS is resumed if this library wrote it, else refused)")
    ap.add_argument("--upstream-of-this-library", action="store_true",
                    help="with --from-scratch: also copy the committed ledger folders this library wrote (their "
                         "environment.json), except those of the arms named here, and the prefix bank whose source ledger is one of them, so that an arm "
                         "reading upstream ledgers (Experiments 3-5, the controls) finds them instead of needing "
                         "them computed in the same call; nothing written by another library is copied")
    args = ap.parse_args(argv)
    if args.upstream_of_this_library and not args.from_scratch:
        ap.error("--upstream-of-this-library needs --from-scratch")
    import yaml

    sets = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    try:
        overrides = arm_overrides(args.profile, sets)  # refused here, before any arm starts
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    ledger_root = Path(os.environ.get("KV_LEDGERS", "/tmp/kv/ledgers"))
    if args.child:
        from kvreplay.runner import ChunkDeadline

        try:
            res = run_one(args.arms[0], args.profile, ledger_root, overrides)
        except ChunkDeadline as stop:  # finished rows are in the ledger; the parent packs it
            res = {"stopped": str(stop)}
        except Exception as e:  # the parent reports why the arm failed, then exits non-zero
            (args.out / f".{args.arms[0]}.json").write_text(
                json.dumps({"error": f"{type(e).__name__}: {e}"[:1000]}, default=str) + "\n")
            raise
        (args.out / f".{args.arms[0]}.json").write_text(json.dumps(res, default=str) + "\n")
        return 0
    unknown = [arm for arm in args.arms if arm not in arm_labels()]
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}; arms: {', '.join(arm_labels())}")
    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    from kvreplay.profiles import load_parameters

    profile = load_parameters(args.profile, overrides).profile  # the ledger folder (an override may relabel it)
    here, there = ROOT / "data" / "ledgers" / profile, ledger_root / profile
    there.mkdir(parents=True, exist_ok=True)
    from kvreplay.ledger.store import library_digest

    library = library_digest()
    seeded = seed_ledger_root(here, there, from_scratch=args.from_scratch,
                              library=library if args.upstream_of_this_library else None, arms=tuple(args.arms))
    execution = load_parameters(args.profile, overrides).execution
    chunk = execution.get("chunk") or execution.get("batch")  # kvreplay.runner.EngineRun.problems_per_chunk
    if args.upstream_of_this_library and not set(seeded) - INPUTS:
        written = sorted({str(_library_of(f))[:12] for f in here.iterdir() if f.is_dir()}) if here.is_dir() else []
        print(f"warning: --upstream-of-this-library: no committed folder of {here} was written by this library "
              f"({library[:12]}; they were written by {written or 'none'}), so an arm that reads upstream ledgers will "
              "find none (carry the library that wrote them, see scripts/offline_gpu_env.sh)", file=sys.stderr)
    report: dict = {"profile": args.profile, "overrides": overrides, "library_sha256": library, "seeded": seeded,
                    "arms": {}}
    for arm in args.arms:
        left = args.budget - (time.perf_counter() - t0) - PACK_S
        if left < args.min_arm_s:
            report["arms"][arm] = {"skipped": f"{left:.0f} s left, --min-arm-s {args.min_arm_s:.0f}"}
            print(arm, json.dumps(report["arms"][arm]), flush=True)
            continue
        before = {p.name for p in there.iterdir()}
        t = time.perf_counter()
        cmd = [sys.executable, __file__, str(args.out), arm, "--profile", args.profile, "--child"]
        cmd += [x for s in args.set for x in ("--set", s)]
        env = os.environ | {CHUNK_DEADLINE_ENV: f"{time.time() + left - DEADLINE_MARGIN_S:.0f}"}
        held = {p.name: _rows_in(p) for p in sorted(there.glob(f"{arm}-*")) if p.is_dir()}
        if args.from_scratch:  # rows this machine holds from a run that resumed committed ones are not recomputed
            stale = [name for name in held if held[name] and _library_of(there / name) != library]
            if stale:
                report["arms"][arm] = {"error": f"--from-scratch: {there} already holds {stale} written by another "
                                                f"library than this one ({library[:12]}); move it away first"}
                print(arm, json.dumps(report["arms"][arm]), flush=True)
                continue
        estimate = longest_chunk_s([here, there], arm, chunk, resuming=any(held.values()))
        if estimate is not None and FIRST_CHUNK_ESTIMATE_ENV not in os.environ:  # set it empty to turn this off
            env[FIRST_CHUNK_ESTIMATE_ENV] = f"{estimate:.0f}"  # a first chunk that would be killed is not begun
        try:
            rc = subprocess.run(cmd, check=False, timeout=left, env=env).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        entry: dict = {"exit": rc, "wall_s": round(time.perf_counter() - t, 1), "rows_before": sum(held.values())}
        if env.get(FIRST_CHUNK_ESTIMATE_ENV):
            entry["first_chunk_estimate_s"] = float(env[FIRST_CHUNK_ESTIMATE_ENV])
        done = args.out / f".{arm}.json"
        if done.exists():
            entry |= json.loads(done.read_text())
            done.unlink()
        experiment, dtype = arm.rsplit("-", 1)
        # the arm's folder(s) (the tie-rule control: one per rule): named by the child, else (cut off) the ones it
        # created or was appending to
        named = entry.get("ledger")
        folders = [there / n for n in ([named] if isinstance(named, str) else named)] if named else sorted(
            p for p in there.iterdir() if p.is_dir() and p.name.startswith(f"{experiment}-{dtype}-")
            and (p.name not in before or (p / "rows.jsonl").exists()))
        for folder in folders:  # tarball name -> finished rows in the ledger
            rows = folder / "rows.jsonl"
            n = rows.read_bytes().count(b"\n") if rows.exists() else None
            entry.setdefault("packed", {})[pack(folder, args.out).name] = n
            # every row's gate failure, from the ledger itself: also for an arm stopped by the chunk deadline
            # or cut off, whose child reported no records
            entry.setdefault("gate_failures", []).extend(ledger_gate_failures(folder) if rows.exists() else [])
        if arm == PREFIX_BANK_SOURCE and (there / "prefix_bank_bf16.jsonl").exists():
            for f in ("prefix_bank_bf16.jsonl", "prefix_bank_bf16.jsonl.manifest.json"):
                shutil.copy2(there / f, args.out / f)
        for panel in there.glob(f"{experiment}*_panel.json"):  # the frozen panel the notebook wrote
            shutil.copy2(panel, args.out / panel.name)
        if "stopped" in entry and sum(n or 0 for n in entry.get("packed", {}).values()) <= entry["rows_before"]:
            entry["no_progress"] = True  # stopped before its first chunk: nothing computed in this call
        report["arms"][arm] = entry
        print(arm, json.dumps(entry, default=str), flush=True)
        (args.out / "gpu_profile.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    (args.out / "gpu_profile.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    failed = [arm for arm, e in report["arms"].items() if e.get("exit", 0) != 0 or "error" in e or e.get("no_progress")]
    if failed:
        print(f"error: arm(s) {failed} failed, were killed at the budget (their rows so far are packed), were refused, "
              "or stopped before computing a row: "
              f"see {args.out / 'gpu_profile.json'}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
