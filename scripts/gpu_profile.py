"""Compute a profile's arms on a GPU exactly as its notebooks would, in one process, and bring the ledgers back.

Usage (on the GPU machine, after ``source scripts/offline_gpu_env.sh``)::

    python3 scripts/gpu_profile.py OUTDIR --all --profile paper [--budget SECONDS] [--from-scratch]
    python3 scripts/gpu_profile.py OUTDIR ARM [ARM ...] [--profile gpu] [--budget SECONDS] [--min-arm-s SECONDS]
        [--set NAME=VALUE ...]
    python3 scripts/gpu_profile.py --list-arms [NOTEBOOK ...]

``--all`` computes every arm the profile's notebooks 01-05 compute (:func:`profile_arms`), in chain order:
Experiments 1 and 2 at the profile's precisions, the tie-rule control (one ledger per rule of ``tie_rules``), the
manipulated-length arm (one per cap of ``length_branch_caps``), Experiment 2's exploratory controls when
``exploratory_controls`` is on, and Experiments 3-5 (Experiment 5 on the checkpoint the profile's
``role_adaptation.json`` names). ``ARM`` names arms instead, by ledger label ``<experiment>-<dtype>`` of
:data:`kvreplay.arm_facts.ARM_FACTS` (``--help`` lists them, in chain order; ``exp1-bfloat16``,
:data:`~kvreplay.arm_facts.PREFIX_BANK_SOURCE`, also writes the prefix bank Experiments 2-5 read, as notebook 01
does). ``--list-arms`` prints the paper's arms (no exploratory control) of the notebooks numbered ``NOTEBOOK``
(``01``; default: all), BF16 arms first, space-separated, for a shell script's default arm list.

Each arm is run through its one declaration (:data:`kvreplay.experiments.arms.ARMS`), under the notebook's own two
parameters, ``profile`` and ``overrides``, handed to :func:`kvreplay.notebook.session.open_session` as the notebook's setup
cell hands them, and :meth:`~kvreplay.notebook.session.Session.run`, the call of the notebook's run cell; Experiments 3-5
freeze and write their panels as their notebooks do. So the ledgers written here have the config digests the
notebooks look for, and ``make paper PROFILE=<profile>`` later reads them without computing anything. (``--set
NAME=VALUE`` adds an override, checked against the chain's parameters before any arm starts; a key of the
execution contract, e.g. ``--set chunk=32`` or ``--set device=cpu``, goes into the profile's ``execution``
mapping; a CPU dry run of a graph profile also needs ``--set step_path=engine-eager``. Anything but ``chunk`` or
``workers`` gives the ledgers other keys.)

All arms run in this one process, under :func:`kvreplay.runner.keep_models`: each model loads (and self-checks)
once per precision, and torch's compiled kernels serve every arm of one shape. Ledgers are written under
``$KV_LEDGERS`` (default ``/tmp/kv/ledgers``), which lasts while the machine stays warm; ledger folders and the
prefix bank already in the repository's ``data/ledgers/<profile>/`` are copied there first, so an arm cut off
earlier resumes from its last finished chunk (``--from-scratch``: none of them is copied, and every arm is
computed again, e.g. to recompute a whole profile under one library, see ``scripts/offline_gpu_env.sh`` for
carrying a frozen one). ``--budget`` (default 560 s) is handed to each arm as ``KV_CHUNK_DEADLINE``: a batched
arm does not start a chunk that its longest chunk so far says would not end in time (it stops with ``"stopped"``
in its entry, its finished rows kept), and its first chunk is held to the same rule through
``KV_FIRST_CHUNK_ESTIMATE`` (:func:`longest_chunk_s`: the longest earlier chunk of the same size in the arm's run
logs, committed or on this machine; none: unguarded; an empty value set by the caller turns it off). An arm
stopped before its first chunk counts as a failure (``no_progress``); an arm that raises is reported and the next
one runs. ``--from-scratch --upstream-of-this-library`` also copies the committed ledger folders that the running
library wrote (but not those of the arms it runs) and the prefix bank built from one of them, so that a later arm
(Experiments 3-5, the controls) is recomputed without recomputing its upstream. With ``--from-scratch`` an arm
whose ledger on this machine holds rows of another library is refused (they would be resumed, not recomputed);
each entry records ``rows_before``, the rows it resumed from.

After each arm its ledger folder is packed, rows sealed (gzip), into ``OUTDIR/<ledger folder>.tar.gz``, and two
files are rewritten: ``OUTDIR/gpu_profile.json`` (per arm: wall time, rows done of rows wanted, gate failures,
the exit status, what it measured, :func:`arm_measures`, and the GPU memory it peaked at and left, :func:`release_memory`) and ``OUTDIR/gpu_profile.md``, the command on its
first line, then one row per arm: rows, wall s, compute s, graph capture s, gate s, steps, ms per step, slot
occupancy and the step's multiple of its memory floor (``--bandwidth-tbs``, by default the card's datasheet
figure, :data:`BANDWIDTH_TBS`). Nothing about outcomes is asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("kvreplay") is None:  # not on PYTHONPATH (a carried .frozen library) nor installed
    sys.path.insert(0, str(ROOT / "lib"))  # kvreplay.arm_facts imports no torch: --list-arms reads it alone
from kvreplay.arm_facts import PREFIX_BANK_SOURCE, arm_labels  # noqa: E402
PACK_S = 25.0
CHUNK_DEADLINE_ENV = "KV_CHUNK_DEADLINE"  # kvreplay.runner.CHUNK_DEADLINE_ENV (this process does not import torch)
FIRST_CHUNK_ESTIMATE_ENV = "KV_FIRST_CHUNK_ESTIMATE"  # kvreplay.runner.FIRST_CHUNK_ESTIMATE_ENV
DEADLINE_MARGIN_S = 10.0  # a chunk must end this long before the budget's end (the arm's packing)


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
            :func:`kvreplay.notebook.profiles.load_parameters` refuses.
    """
    import difflib

    from kvreplay.notebook.profiles import FIELDS, load_parameters
    from kvreplay.runner import EXECUTION_KEYS

    for name in sets:
        if name not in FIELDS and name not in EXECUTION_KEYS:
            near = difflib.get_close_matches(name, [*FIELDS, *EXECUTION_KEYS], n=1)
            raise ValueError(f"--set {name}=...: {name!r} is neither a chain parameter (kvreplay.notebook.profiles.ChainParameters) "
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
    """Compute one arm in this process through its declaration, as its notebook does; returns what it did.

    The arm is planned by :meth:`kvreplay.notebook.session.Session.plan` (its panel frozen and written as the notebook writes
    it) and run by :meth:`~kvreplay.notebook.session.Session.run`; Experiment 1's BF16 arm also writes the prefix bank.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    from kvreplay.experiments.arms import ARMS
    from kvreplay.notebook.session import open_session

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
    # the gate failures are read from the ledger it packs (also for an arm stopped at the deadline)
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


BANDWIDTH_TBS = {"H100": 3.35, "H200": 4.8}
"""Peak memory bandwidth of a card by name (the vendors' datasheet figures, TB/s): the memory floor's divisor."""


def profile_arms(profile: str, overrides: dict) -> list[str]:
    """Every arm the profile's notebooks 01-05 compute, in chain order: Experiments 1-5 at the profile's precisions
    and the arms the profile turns on (tie rules, branch caps, the exploratory controls). Notebooks 06-08 compute
    nothing; an arm of a notebook outside make paper's chain (09's ``exp2_kernels``) runs only when named."""
    from kvreplay.arm_facts import chain_facts
    from kvreplay.paper.chain import CHAIN
    from kvreplay.notebook.profiles import load_parameters

    params = load_parameters(profile, overrides)
    return [label for f in chain_facts()
            if f.notebook in CHAIN and (f.enabled_by is None or getattr(params, f.enabled_by))
            for label in f.labels(tuple(params.precisions))]


def _events_since(folder: Path, offset: int) -> list[dict]:
    """The run-log events a ledger folder got after byte ``offset`` of its ``runlog.jsonl`` (a cut line skipped)."""
    path = folder / "runlog.jsonl"
    if not path.is_file():
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        lines = f.read().decode("utf-8", "replace").splitlines()
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def arm_measures(events: list[dict], layout: dict | None, bandwidth: float | None) -> dict:
    """What one arm's run measured, from the run-log events its ledger(s) got in this call.

    ``steps``, ``ms_per_step`` (the chunks' wall time per engine step: the step, the host's work between steps and
    every boundary's prefill calls and gates), ``occupancy`` (busy slot-steps over slot-steps), ``capture_s`` (CUDA
    graph captures, a new shape's compile included), ``gate_s`` (the sampled float32 equivalence checks and a resumed
    arm's reference row, which run outside the chunks), ``compute_s`` (the arms' own count: model load included) and,
    with the model's ``layout`` (:func:`kvreplay.bench.generate.memory_layout`) and a ``bandwidth`` (bytes/s), the
    memory floor of the mean step (the weights read once and every busy row's keys and values once:
    ``floor_ms_per_step``) and the measured step's multiple of it.
    """
    chunks = [e for e in events if e.get("event") == "chunk"]
    steps = sum(e.get("steps", 0) for e in chunks)
    seconds = sum(e.get("seconds", 0.0) for e in chunks)
    slot_steps = sum(e.get("slot_steps", 0) for e in chunks)
    busy = sum(e.get("busy_slot_steps", 0) for e in chunks)
    positions = sum(e.get("kv_positions", 0) for e in chunks)
    gate_s = sum(c.get("seconds", 0.0) for e in events if e.get("event") == "gates"
                 for c in e.get("checks", []) if c.get("gate") != "live_equals_incremental")
    # a sampled check's rows are rebuilt in one call and each names that call's seconds: count it once
    gate_s += sum(max([c.get("seconds", 0.0) for c in e.get("checks", [])], default=0.0)
                  for e in events if e.get("event") == "equivalence_sample")
    out: dict = {"steps": steps, "chunk_s": round(seconds, 1),
                 "ms_per_step": round(1e3 * seconds / steps, 2) if steps else None,
                 "occupancy": round(busy / slot_steps, 3) if slot_steps else None,
                 "capture_s": round(sum(e.get("capture_s", 0.0) for e in chunks), 1), "gate_s": round(gate_s, 1),
                 "compute_s": round(sum(e.get("compute_s", 0.0) for e in events if e.get("event") == "end"), 1)}
    if layout and bandwidth and steps:
        from kvreplay.bench.generate import floor_ms

        floor = floor_ms(layout, 2 * positions / steps, bandwidth)  # both rows of each duplicate pair are read
        out["floor_ms_per_step"] = round(floor, 4)
        out["x_floor"] = round(out["ms_per_step"] / floor, 1)
    return out


TABLE_COLUMNS = ("arm", "rows", "wall_s", "compute_s", "capture_s", "gate_s", "steps", "ms_per_step", "occupancy",
                 "floor_ms_per_step", "x_floor", "status")


def release_memory(torch) -> dict | None:
    """After an arm: collect what it left unreachable (engines, captured graphs' pools, suffix states) and hand the
    cached blocks back to the driver, so the next arm of the process starts with only the kept models on the card.
    Returns GiB: the arm's peak allocation, and what is still allocated and reserved afterwards (``None`` off CUDA);
    the peak counter restarts for the next arm."""
    import gc

    gc.collect()
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    gib = 2.0 ** 30
    out = {"peak": round(torch.cuda.max_memory_allocated() / gib, 2),
           "allocated_after": round(torch.cuda.memory_allocated() / gib, 2),
           "reserved_after": round(torch.cuda.memory_reserved() / gib, 2)}
    torch.cuda.reset_peak_memory_stats()
    return out


def write_table(report: dict, path: Path) -> None:
    """``gpu_profile.md``: the command on its first line, then one row per arm (:data:`TABLE_COLUMNS`)."""
    lines = [f"`{report['command']}`", "", f"{report.get('device', '?')}, torch {report.get('torch', '?')}, "
             f"library {report['library_sha256'][:12]}, profile {report['profile']}; memory floor at "
             f"{report.get('bandwidth_tbs')} TB/s; {report.get('elapsed_s', '?')} s in all", "",
             "| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for arm, e in report["arms"].items():
        done = sum(n or 0 for n in e.get("packed", {}).values())
        status = ("error: " + e["error"][:80]) if "error" in e else "stopped (deadline)" if "stopped" in e else \
            "skipped" if "skipped" in e else f"{len(e.get('gate_failures', []))} gate failures"
        row = {"arm": arm, "rows": f"{done}/{e.get('rows_wanted', '?')}", "status": status, **e.get("measures", {}),
               "wall_s": e.get("wall_s")}
        lines.append("| " + " | ".join("" if row.get(c) is None else str(row.get(c)) for c in TABLE_COLUMNS) + " |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--list-arms"]:
        print(" ".join(list_arms(argv[1:])))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("out", type=Path, help="folder for the packed ledgers (<ledger folder>.tar.gz), gpu_profile.json "
                    "and gpu_profile.md (on the device: $OUT)")
    ap.add_argument("arms", nargs="*", help=f"arms in order: {', '.join(arm_labels())}. Exits 1 when an arm failed (its "
                    "error is in gpu_profile.json), was refused (--from-scratch) or stopped before computing a row "
                    "(no_progress); an arm skipped by --min-arm-s is not a failure")
    ap.add_argument("--all", action="store_true", help="every arm the profile's notebooks compute, in chain order "
                    "(profile_arms), after any named")
    ap.add_argument("--profile", default="gpu", help="the profile whose arms run (notebooks/params/<profile>.yaml)")
    ap.add_argument("--budget", type=float, default=560.0, help="seconds for all arms, packing included: no chunk "
                    "starts that would end after it (KV_CHUNK_DEADLINE)")
    ap.add_argument("--min-arm-s", type=float, default=30.0,
                    help="do not start an arm with less time left than this. Its first chunk is not begun when the "
                         "longest earlier chunk of its size in its run logs (KV_FIRST_CHUNK_ESTIMATE; set it empty to "
                         "turn that off) says it would not end in time")
    ap.add_argument("--bandwidth-tbs", type=float, default=None,
                    help=f"memory bandwidth for the floor, TB/s (default by card: {BANDWIDTH_TBS})")
    ap.add_argument("--overrides", type=Path, default=None, metavar="FILE",
                    help="a YAML mapping of parameter overrides, as --set gives them (--set wins), declared in a "
                         "committed file before computing (data/paper/recompute.yaml); its optional key "
                         "`role_adaptation` names a checkpoint pointer (a role_adaptation.json) put in place of the "
                         "profile's before any arm")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="override a parameter (YAML value); an execution-contract key (e.g. chunk=32) goes into the "
                         "profile's `execution` mapping, over its other keys (a CPU dry run of a CUDA profile needs "
                         "both device=cpu and step_path=engine-eager, and writes ledgers under other keys)")
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

    declared: dict = {}
    if args.overrides is not None:
        try:
            declared = yaml.safe_load(args.overrides.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise SystemExit(f"error: --overrides {args.overrides}: {e}") from None
        if not isinstance(declared, dict):
            raise SystemExit(f"error: --overrides {args.overrides}: not a YAML mapping")
    pointer = declared.pop("role_adaptation", None)
    if pointer is not None and not (ROOT / pointer).is_file():
        raise SystemExit(f"error: --overrides {args.overrides}: role_adaptation {pointer!r} is not a file")
    sets = declared | {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    try:
        overrides = arm_overrides(args.profile, sets)  # refused here, before any arm starts
        arms = list(dict.fromkeys([*args.arms, *(profile_arms(args.profile, overrides) if args.all else [])]))
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    if not arms:
        ap.error("name the arms to compute, or --all")
    unknown = [arm for arm in arms if arm not in arm_labels()]
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}; arms: {', '.join(arm_labels())}")
    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    ledger_root = Path(os.environ.get("KV_LEDGERS", "/tmp/kv/ledgers"))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    from kvreplay.notebook.profiles import load_parameters

    params = load_parameters(args.profile, overrides)
    profile = params.profile  # the ledger folder (an override may relabel it)
    here, there = ROOT / "data" / "ledgers" / profile, ledger_root / profile
    there.mkdir(parents=True, exist_ok=True)
    from kvreplay.ledger.store import library_digest

    library = library_digest()
    seeded = seed_ledger_root(here, there, from_scratch=args.from_scratch,
                              library=library if args.upstream_of_this_library else None, arms=tuple(arms))
    if pointer is not None:  # Experiment 5's checkpoint family, as declared
        shutil.copy2(ROOT / pointer, there / "role_adaptation.json")
    execution = params.execution
    chunk = execution.get("chunk") or execution.get("batch")  # kvreplay.runner.EngineRun.problems_per_chunk
    if args.upstream_of_this_library and not set(seeded) - INPUTS:
        written = sorted({str(_library_of(f))[:12] for f in here.iterdir() if f.is_dir()}) if here.is_dir() else []
        print(f"warning: --upstream-of-this-library: no committed folder of {here} was written by this library "
              f"({library[:12]}; they were written by {written or 'none'}), so an arm that reads upstream ledgers will "
              "find none (carry the library that wrote them, see scripts/offline_gpu_env.sh)", file=sys.stderr)
    import shlex

    import torch

    from kvreplay.runner import ChunkDeadline, keep_models

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    bandwidth = args.bandwidth_tbs or next((v for k, v in BANDWIDTH_TBS.items() if k in device), None)
    report: dict = {"command": "python3 scripts/gpu_profile.py " + " ".join(shlex.quote(a) for a in argv),
                    "profile": args.profile, "overrides": overrides, "role_adaptation": pointer,
                    "library_sha256": library, "seeded": seeded,
                    "device": device, "torch": torch.__version__, "bandwidth_tbs": bandwidth, "arms": {}}
    estimate_off = os.environ.get(FIRST_CHUNK_ESTIMATE_ENV) == ""
    with keep_models() as kept:  # one load per model and precision; torch's compiled kernels stay for every arm
        for arm in arms:
            left = args.budget - (time.perf_counter() - t0) - PACK_S
            if left < args.min_arm_s:
                report["arms"][arm] = {"skipped": f"{left:.0f} s left, --min-arm-s {args.min_arm_s:.0f}"}
                print(arm, json.dumps(report["arms"][arm]), flush=True)
                continue
            before = {p.name for p in there.iterdir()}
            held = {p.name: _rows_in(p) for p in sorted(there.glob(f"{arm}-*")) if p.is_dir()}
            offsets = {name: (there / name / "runlog.jsonl").stat().st_size
                       if (there / name / "runlog.jsonl").is_file() else 0 for name in held}
            entry: dict = {"rows_before": sum(held.values())}
            if args.from_scratch:  # rows this machine holds from a run that resumed committed ones are not recomputed
                stale = [name for name in held if held[name] and _library_of(there / name) != library]
                if stale:
                    entry["error"] = (f"--from-scratch: {there} already holds {stale} written by another library than "
                                      f"this one ({library[:12]}); move it away first")
                    report["arms"][arm] = entry
                    print(arm, json.dumps(entry), flush=True)
                    continue
            os.environ[CHUNK_DEADLINE_ENV] = f"{time.time() + left - DEADLINE_MARGIN_S:.0f}"
            estimate = longest_chunk_s([here, there], arm, chunk, resuming=any(held.values()))
            if estimate_off:  # the caller set KV_FIRST_CHUNK_ESTIMATE empty: no first chunk is held back
                pass
            elif estimate is not None:  # a first chunk that would be cut off is not begun
                os.environ[FIRST_CHUNK_ESTIMATE_ENV] = f"{estimate:.0f}"
                entry["first_chunk_estimate_s"] = estimate
            else:
                os.environ.pop(FIRST_CHUNK_ESTIMATE_ENV, None)
            t = time.perf_counter()
            try:
                entry |= run_one(arm, args.profile, ledger_root, overrides)
                entry["exit"] = 0
            except ChunkDeadline as stop:  # finished rows are in the ledger; packed below
                entry |= {"stopped": str(stop), "exit": 0}
            except Exception as e:  # reported, then the next arm runs; the script exits non-zero at the end
                entry |= {"error": f"{type(e).__name__}: {e}"[:1000], "exit": 1}
                import traceback

                traceback.print_exc()
            entry["wall_s"] = round(time.perf_counter() - t, 1)
            experiment, dtype = arm.rsplit("-", 1)
            named = entry.get("ledger")
            folders = [there / n for n in ([named] if isinstance(named, str) else named)] if named else sorted(
                p for p in there.iterdir() if p.is_dir() and p.name.startswith(f"{experiment}-{dtype}-")
                and (p.name not in before or (p / "rows.jsonl").exists()))
            events: list[dict] = []
            for folder in folders:  # tarball name -> finished rows in the ledger
                rows = folder / "rows.jsonl"
                n = rows.read_bytes().count(b"\n") if rows.exists() else None
                entry.setdefault("packed", {})[pack(folder, args.out).name] = n
                entry.setdefault("gate_failures", []).extend(ledger_gate_failures(folder) if rows.exists() else [])
                events += _events_since(folder, offsets.get(folder.name, 0))
            entry["rows_wanted"] = sum(len(_json_file(f / "manifest.json").get("config", {}).get("problem_ids", []))
                                       for f in folders if (f / "manifest.json").is_file())
            lm = next((m for m in kept.values() if str(m.dtype).endswith(dtype)), None)
            from kvreplay.bench.generate import memory_layout

            entry["measures"] = arm_measures(events, memory_layout(lm) if lm is not None else None,
                                             bandwidth * 1e12 if bandwidth else None)
            if arm == PREFIX_BANK_SOURCE and (there / "prefix_bank_bf16.jsonl").exists():
                for f in ("prefix_bank_bf16.jsonl", "prefix_bank_bf16.jsonl.manifest.json"):
                    shutil.copy2(there / f, args.out / f)
            for panel in there.glob(f"{experiment}*_panel.json"):  # the frozen panel the notebook wrote
                shutil.copy2(panel, args.out / panel.name)
            if "stopped" in entry and sum(n or 0 for n in entry.get("packed", {}).values()) <= entry["rows_before"]:
                entry["no_progress"] = True  # stopped before its first chunk: nothing computed in this call
            entry["cuda_gib"] = release_memory(torch)  # nothing of this arm is kept for the next one
            report["arms"][arm] = entry
            print(arm, json.dumps(entry, default=str), flush=True)
            report["elapsed_s"] = round(time.perf_counter() - t0, 1)
            (args.out / "gpu_profile.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
            write_table(report, args.out / "gpu_profile.md")
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    (args.out / "gpu_profile.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    write_table(report, args.out / "gpu_profile.md")
    failed = [arm for arm, e in report["arms"].items() if e.get("exit", 0) != 0 or "error" in e or e.get("no_progress")]
    if failed:
        print(f"error: arm(s) {failed} failed, were refused, or stopped before computing a row: "
              f"see {args.out / 'gpu_profile.json'}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
