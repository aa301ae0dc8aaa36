"""Recompute committed ledger rows and compare them with the ledger bit for bit (``make verify``).

A reviewer's check, and the golden-row test of the row-algorithm versions.
For each experiment ledger of a profile, it rebuilds the arm's settings from the
ledger's own manifest (model, dtype, caps, format, threads, SDPA backends,
execution contract). It recomputes a few of its rows with the same per-row
function the notebooks use, and compares each recomputed record with the
committed line byte for byte (canonical JSON).

BF16 bits depend on the CPU's kernels (AMX, AVX-512-BF16, AVX2 pick different
oneDNN paths) and on the torch build. So a byte comparison is only owed where
the environment matches the one that wrote the ledger (same CPU capability and
ISA flags, device name, torch version and threads). Elsewhere the check falls
back to what must hold anywhere -- every gate passes, and in float32 the token
IDs (prefix and every suffix) are identical -- and says what it skipped.

Usage::

    python -m kvreplay.verify --profile cpu --rows 1
    python -m kvreplay.verify --profile gpu --rows 3 --pick random --seed 7   # rows drawn by seed
    python -m kvreplay.verify --profile gpu --ids mmlu-ddcc9f44cbfb7b0c       # rows a reviewer names
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .experiments import arms
from .gates import GateError
from .ledger.lookup import PREFIX_BANK
from .ledger.prefix_bank import read_prefix_bank
from .ledger.files import LedgerError, read_environment, read_log, read_manifest
from .ledger.store import canonical_json, ledger_rows
from .models import context_length, environment_record
from .paths import LEDGERS, ROOT
from .problems import Problem, load_bank
from .runner import ROW_ALGORITHM, ArmPlan, ArmSettings, RunSpec, check_prompts
from .runner.batched import first_difference, leaves
from .runner.spec import model_key

ENVIRONMENT_KEYS = ("device_name", "cpu_capability", "cpu_isa_flags", "torch", "intra_op_threads")
"""Execution-contract fields that must match for a byte-for-byte comparison to be owed."""


@dataclasses.dataclass
class RowCheck:
    """The verdict on one recomputed row.

    Attributes:
        ledger: the ledger folder's name; problem_id: the row.
        mode: ``"bytes"`` (same environment: the record must be identical) or
            ``"portable"`` (another environment: gates and float32 tokens only).
        ok: whether every owed check held.
        parted: where the recomputed record first parts from the committed one
            (a dotted path such as ``arms.prefill.suffix[12]``), or None.
        detail: a one-line account (what was compared, what was skipped).
    """
    ledger: str
    problem_id: str
    mode: str
    ok: bool
    parted: str | None
    detail: str


def same_environment(recorded: dict, current: dict) -> list[str]:
    """The :data:`ENVIRONMENT_KEYS` that differ between a ledger's recorded contract and this machine's."""
    return [k for k in ENVIRONMENT_KEYS if recorded.get(k) != current.get(k)]


def _token_fields(rec: dict) -> dict:
    """Every token-ID list of a record (prefix and suffixes), by dotted path."""
    return {k: v for k, v in leaves(rec, empty=True).items()
            if ("suffix" in k or k.startswith("prefix[") or "baseline." in k) and ("margins" not in k)}


def settings_from_manifest(folder: Path) -> tuple[ArmSettings, dict]:
    """The :class:`~kvreplay.runner.ArmSettings` that wrote a ledger (:meth:`~kvreplay.runner.ArmSettings.from_config`
    of its manifest's config), and that config.

    Raises:
        ValueError: a contract the settings refuse.
    """
    config = read_manifest(folder)["config"]
    return ArmSettings.from_config(config), config


def _bank_prefixes(folder: Path, config: dict) -> dict[str, list[int]]:
    """The profile's prefix bank, problem ID -> prefix z, checked against the digest the ledger was keyed with.

    Raises:
        GateError: ``provenance``, the bank is not the one the ledger was computed from.
    """
    entries, digest = read_prefix_bank(folder.parent / PREFIX_BANK)
    if config.get("prefix_bank_sha256") not in (None, digest):
        raise GateError("provenance", f"{folder.name} was computed from prefix bank {config['prefix_bank_sha256'][:12]}, "
                        f"the profile's bank is {digest[:12]}")
    return {e["problem_id"]: e["prefix"] for e in entries}


def ledger_plan(folder: Path, config: dict, problems: Sequence[Problem]) -> ArmPlan[Any]:
    """The arm that wrote a ledger, bound to the inputs its key names (:data:`kvreplay.experiments.arms.ARMS`).

    The problems are the key's ``problem_ids``; the key entries are the manifest's; the prefixes are the profile's
    prefix bank's (checked against the key's digest).

    Raises:
        ValueError: an experiment without a declared arm, or a manifest without the key entries the arm adds.
        KeyError: a problem ID of the key that ``problems`` lacks.
        GateError: ``provenance``, the profile's prefix bank is not the ledger's.
    """
    arm = arms.arm(config["experiment"])
    missing = [k for k in arm.key if k not in config]
    if missing:
        raise ValueError(f"{folder.name}: its manifest lacks the key entries {missing} of arm {arm.experiment}")
    by_id = {p.problem_id: p for p in problems}
    return arm.plan([by_id[i] for i in config["problem_ids"]], key={k: config[k] for k in arm.key},
                    prefixes=_bank_prefixes(folder, config) if arm.prefixes else None)


PICKS = ("shortest", "fastest", "first", "random")
"""The rules that choose which committed rows :func:`verify_ledger` recomputes (besides rows named by ID)."""


def choose_rows(folder: str | Path, rows: int = 1, *, pick: str = "shortest", seed: int | None = None,
                ids: Sequence[str] | None = None) -> list[int]:
    """Which committed rows of a ledger :func:`verify_ledger` recomputes: their indices in ledger order.

    ``pick`` is one of :data:`PICKS` (see :func:`verify_ledger`). ``random`` draws ``rows`` rows without replacement,
    seeded by ``seed`` and the ledger folder's name, so the same seed draws the same rows on any machine. ``ids``
    (problem IDs) replaces ``pick`` and ``rows``: exactly those rows, in the order given.

    Raises:
        ValueError: an unknown ``pick``; ``random`` without a ``seed``; an ID the ledger does not hold (the ledger
            and the missing IDs are named).
    """
    folder = Path(folder)
    read = ledger_rows(folder)  # a damaged line or a duplicated ID: LedgerLineError naming file, line and ID
    lines, committed = [r.text for r in read], [r.record for r in read]
    if ids:
        where = {r["problem_id"]: i for i, r in enumerate(committed)}
        missing = [i for i in ids if i not in where]
        if missing:
            raise ValueError(f"ledger {folder} holds no row {', '.join(missing)} ({len(committed)} rows, e.g. "
                             f"{', '.join(r['problem_id'] for r in committed[:3])})")
        return [where[i] for i in dict.fromkeys(ids)]
    if pick not in PICKS:
        raise ValueError(f"pick must be one of {', '.join(PICKS)}, not {pick!r}")
    if pick == "random":
        if seed is None:
            raise ValueError("pick 'random' needs a seed (--seed N), so that the draw can be repeated")
        return sorted(random.Random(f"kvreplay-verify:{seed}:{folder.name}").sample(range(len(committed)),
                                                                                     min(rows, len(committed))))
    config = read_manifest(folder)["config"]
    cost: dict[str, float] = {}  # "fastest": logged seconds, or on a batched ledger the line's length
    if pick == "fastest" and "engine" in config:  # a chunk's seconds sit on its first row: cost by line length
        cost = {r["problem_id"]: len(x) for r, x in zip(committed, lines)}
    elif pick == "fastest" and (folder / "runlog.jsonl").is_file():
        for event in read_log(folder / "runlog.jsonl"):
            if event.get("event") == "row":
                cost[event["key"]] = event["seconds"]
    order = list(range(len(committed))) if pick == "first" else sorted(
        range(len(committed)),
        key=lambda i: (cost.get(committed[i]["problem_id"], float("inf")), committed[i].get("prefix_len", 0), i))
    return order[:rows]


def verify_ledger(folder: str | Path, rows: int = 1, *, pick: str = "shortest", problems=None,
                  model: str | None = None, report: Callable[[RowCheck], None] | None = None,
                  seed: int | None = None, ids: Sequence[str] | None = None) -> list[RowCheck]:
    """Recompute ``rows`` committed rows of one ledger and compare them with the committed lines.

    Args:
        folder: the ledger folder.
        rows: how many rows to recompute.
        pick: ``"shortest"`` (rows with the shortest prefix first), ``"fastest"``, ``"first"`` (ledger order) or
            ``"random"`` (drawn by ``seed``; :func:`choose_rows`).
            ``"fastest"`` takes the rows that took the least wall time, from ``runlog.jsonl``, and the shortest
            prefix where the log has none. A batched ledger logs a whole chunk's seconds on its first row, so
            there it takes the shortest committed line (a proxy for the fewest decoded tokens, as the
            resumed-arm gate picks).
        seed: the draw of ``pick="random"``.
        ids: problem IDs to recompute instead of ``pick`` and ``rows``; each must be in the ledger.
        problems: the problem set (default: the frozen bank).
        model: where the ledger's model is, for a local folder (the manifest keys it by folder name and file
            digests only); it must have the manifest's model key.
        report: called with each row's :class:`RowCheck` as soon as that row is recomputed.

    Returns:
        One :class:`RowCheck` per recomputed row.

    Raises:
        ValueError: an experiment this module cannot recompute; MissingLedgerError-like ``FileNotFoundError``
            when the folder is not a ledger; a ``model`` whose key differs from the manifest's; a bad
            ``pick``, ``seed`` or ``ids`` (:func:`choose_rows`), before any model is loaded.
    """
    import torch

    folder = Path(folder)
    if not (folder / "manifest.json").is_file():
        raise FileNotFoundError(f"{folder} is not a ledger (no manifest.json)")
    settings, config = settings_from_manifest(folder)
    if model is not None:
        if model_key(model) != config["model"]:
            raise ValueError(f"{folder.name}: model {model!r} is not the model that wrote the ledger "
                             f"({config['model'].get('model')!r}: other files or digests)")
        settings = dataclasses.replace(settings, model=model)
    env = read_environment(folder)
    read = ledger_rows(folder)
    lines, committed = [r.text for r in read], [r.record for r in read]
    chosen = choose_rows(folder, rows, pick=pick, seed=seed, ids=ids)
    if env.get("row_algorithm") != ROW_ALGORITHM.get(config["experiment"]):
        return [RowCheck(folder.name, committed[i]["problem_id"], "stale", False, None,
                         f"written by row algorithm {env.get('row_algorithm')}, this code computes "
                         f"{ROW_ALGORITHM.get(config['experiment'])}: not comparable") for i in chosen]
    bank = list(problems if problems is not None else load_bank())
    by_id = {p.problem_id: p for p in bank}
    plan = ledger_plan(folder, config, bank)
    row, chunk = plan.row_function(), plan.chunk_function()
    fn: Callable[[RunSpec, Problem], dict] = row
    recorded = env["execution_contract"]
    where = ""
    if settings.contract().device_type == "cuda" and not torch.cuda.is_available():
        # a GPU ledger on a machine without one: recompute on this CPU through the eager reference path
        settings = dataclasses.replace(settings.eager(), device="cpu", deterministic=None)
        path = recorded.get("engine") or {"step_path": "eager"}
        where = (f"; recorded on {recorded.get('device_name', 'a GPU')} ({path['step_path']} path"
                 + (f", B={path['batch']}" if "batch" in path else "") + "), recomputed on this CPU through the eager path")
    elif config.get("engine"):
        # a batched ledger: the row alone in a chunk of one at the recorded batch shape (the composition gate's run)
        settings = dataclasses.replace(settings, max_len=recorded["engine"]["max_len"])
        fn = lambda spec, p: chunk(spec, [p])[0]  # noqa: E731 (the row alone in a chunk of one)
    lm, fmt = settings.load()
    run = settings.engine_run(fmt, [by_id[committed[i]["problem_id"]] for i in chosen], lm.model.config)
    check_prompts(fmt, [by_id[committed[i]["problem_id"]] for i in chosen], context_length(lm.model.config),
                  caps=settings.caps)
    spec = settings.run_spec(lm, fmt, run, equivalence_ids=frozenset(config["problem_ids"][: settings.preflight]))
    current = environment_record(lm, settings.threads)
    differs = same_environment(recorded, current)
    shown = "; ".join(f"{k} {recorded.get(k)!r} in the ledger, {current.get(k)!r} here" for k in differs)
    out = []
    for i in chosen:
        old = committed[i]
        new = fn(spec, by_id[old["problem_id"]])
        if not differs:
            ok = canonical_json(new) == lines[i]
            parted = None if ok else first_difference(old, new)
            detail = "byte-identical" if ok else f"differs first at {parted}"
            out.append(RowCheck(folder.name, old["problem_id"], "bytes", ok, parted, detail))
            if report is not None:
                report(out[-1])
            continue
        checks, parted = [], None
        gates_ok = new.get("gate_failure") is None and old.get("gate_failure") is None
        checks.append(f"gates {'pass' if gates_ok else 'FAIL: ' + str(new.get('gate_failure'))}")
        ok = gates_ok
        if lm.dtype == torch.float32:
            a, b = _token_fields(old), _token_fields(new)
            tok_ok = a == b
            if not tok_ok:
                parted = first_difference(a, b)
            checks.append("float32 token IDs " + ("identical" if tok_ok else f"differ first at {parted}")
                          + " (cache summaries and margins not compared)")
            ok = ok and tok_ok
        else:
            checks.append("BF16 bits not compared")
        out.append(RowCheck(folder.name, old["problem_id"], "portable", ok, parted,
                            f"{'; '.join(checks)} (another environment: {shown}{where})"))
        if report is not None:
            report(out[-1])
    return out


def recomputable_ledgers(ledger_root: str | Path, profile: str, only: Sequence[str] = ()) -> list[Path]:
    """The experiment ledger folders of a profile :func:`verify_profile` recomputes (``only``: name prefixes)."""
    out = []
    for folder in sorted(Path(ledger_root, profile).iterdir()):
        if not (folder / "manifest.json").is_file():
            continue
        name = read_manifest(folder)["config"].get("experiment")
        if name not in ROW_ALGORITHM or name == "adapt_eval" or (only and not any(folder.name.startswith(o) for o in only)):
            continue
        out.append(folder)
    return out


def ids_by_ledger(ledgers: Sequence[Path], ids: Sequence[str]) -> dict[Path, list[str]]:
    """The problem IDs of ``ids`` each ledger holds, for the ledgers that hold any (a panel ledger holds a few).

    Raises:
        ValueError: an ID no ledger holds, naming it and the ledgers searched.
    """
    held = {f: {r.record["problem_id"] for r in ledger_rows(f)} for f in ledgers}
    nowhere = [i for i in ids if not any(i in h for h in held.values())]
    if nowhere:
        raise ValueError(f"no row {', '.join(nowhere)} in ledger(s) {', '.join(str(f) for f in ledgers)}")
    out = {f: [i for i in dict.fromkeys(ids) if i in h] for f, h in held.items()}
    return {f: v for f, v in out.items() if v}


def verify_profile(ledger_root: str | Path, profile: str, rows: int = 1, *, only: Sequence[str] = (),
                   pick: str = "shortest", report: Callable[[RowCheck], None] | None = None,
                   seed: int | None = None, ids: Sequence[str] | None = None) -> list[RowCheck]:
    """:func:`verify_ledger` on every recomputable experiment ledger of a profile (``only``: name prefixes);
    ``report`` is told each row as it is recomputed. With ``ids``, each ledger holding any of them recomputes
    those rows (:func:`ids_by_ledger`; an ID no ledger holds raises ``ValueError`` before any model loads)."""
    ledgers = recomputable_ledgers(ledger_root, profile, only)
    wanted = ids_by_ledger(ledgers, ids) if ids else {f: None for f in ledgers}
    for folder, mine in wanted.items():  # every selection checked before the first model loads
        choose_rows(folder, rows, pick=pick, seed=seed, ids=mine)
    out = []
    for folder, mine in wanted.items():
        out.extend(verify_ledger(folder, rows, pick=pick, report=report, seed=seed, ids=mine))
    return out


def main(argv: Sequence[str] | None = None) -> int:

    ap = argparse.ArgumentParser(prog="python -m kvreplay.verify", description=__doc__.split("\n\n")[0],
                                 epilog="Byte-identical rows are expected only where the ledger's environment (device, CPU "
                                        "kernel ISA, torch, threads, step path, batch shape) matches this machine; "
                                        "elsewhere the portable checks run (gates pass, FP32 token IDs equal).",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--profile", default="cpu", help="profile whose committed ledgers are recomputed")
    ap.add_argument("--rows", type=int, default=1, help="rows recomputed per ledger")
    ap.add_argument("--pick", choices=PICKS, default="shortest",
                    help="which rows: shortest prefixes, least logged wall time (batched ledgers: shortest lines), "
                         "ledger order, or drawn at random by --seed (the same seed draws the same rows)")
    ap.add_argument("--seed", type=int, default=None, help="the draw of --pick random (required with it)")
    ap.add_argument("--ids", nargs="+", default=None, metavar="ID",
                    help="problem IDs to recompute, in every selected ledger that holds them (replaces --pick and --rows)")
    ap.add_argument("--ledger-root", default=str(LEDGERS), help="folder holding <profile>/ ledger folders")
    ap.add_argument("--only", nargs="*", default=(), help="ledger name prefixes, e.g. exp1-bfloat16 exp3")
    args = ap.parse_args(argv)
    if args.rows < 1:
        ap.error(f"--rows {args.rows}: must be at least 1")
    if (args.pick == "random") != (args.seed is not None):
        ap.error("--pick random needs --seed N" if args.seed is None else "--seed goes with --pick random")
    if args.ids and (args.pick != "shortest" or args.seed is not None):
        ap.error("--ids names the rows itself: leave out --pick and --seed")
    folder = Path(args.ledger_root, args.profile)
    if not folder.is_dir():
        known = sorted(p.name for p in Path(args.ledger_root).iterdir() if p.is_dir()) if Path(args.ledger_root).is_dir() else []
        print(f"error: no ledgers of profile {args.profile!r} under {args.ledger_root} (profiles with ledgers: {known})",
              file=sys.stderr)
        return 2
    ledgers = recomputable_ledgers(args.ledger_root, args.profile, args.only)
    if not ledgers:
        print(f"error: no recomputable ledger of profile {args.profile!r} under {folder}"
              + (f" matches --only {' '.join(args.only)}" if args.only else ""), file=sys.stderr)
        return 2
    if args.ids:
        try:
            held = ids_by_ledger(ledgers, args.ids)
        except (ValueError, LedgerError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        what = f"rows {' '.join(args.ids)} where held"
        ledgers = list(held)
    else:
        what = f"{args.rows} committed row(s) ({args.pick}{f', seed {args.seed}' if args.seed is not None else ''})"
    print(f"make verify: recomputing {what} of each of {len(ledgers)} ledgers of "
          f"profile {args.profile} ({', '.join(f.name for f in ledgers)}); each ledger loads its model, and a row "
          "takes seconds to minutes. One line per row as it is done:", flush=True)

    def said(r: RowCheck) -> None:
        print(f"{'OK  ' if r.ok else 'FAIL'} {r.mode:8s} {r.ledger:40s} {r.problem_id:24s} {r.detail}", flush=True)

    try:
        results = verify_profile(args.ledger_root, args.profile, args.rows, only=args.only, pick=args.pick,
                                 report=said, seed=args.seed, ids=args.ids)
    except LedgerError as e:  # a damaged line, a duplicated row or a damaged small file: named, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    bad = [r for r in results if not r.ok]
    exact = sum(r.ok and r.mode == "bytes" for r in results)
    portable = len(results) - len(bad) - exact
    print(f"{exact} of {len(results)} recomputed rows match byte for byte"
          + (f"; {portable} pass the portable checks (gates, and what must hold on any machine; their BF16 bits are "
             "not compared here)" if portable else "") + ("" if not bad else f"; {len(bad)} do not"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
