"""Recompute committed ledger rows and compare them with the ledger bit for bit (``make verify``).

A reviewer's check, and the golden-row test of the row-algorithm versions.
For each experiment ledger of a profile, it rebuilds the arm's settings from the
ledger's own manifest (model, dtype, caps, format, threads, SDPA backends,
execution contract). It recomputes a few of its rows with the same per-row
function the notebooks use, and compares each recomputed record with the
committed line byte for byte (canonical JSON).

BF16 bits depend on the CPU's kernels (AMX, AVX-512-BF16, AVX2 pick different
oneDNN paths) and on the torch build; on a GPU on its compute capability, SM
count, CUDA and cuBLAS, and on the step path and batch shape. Under invariant kernels a row owes
nothing to its batch, and a batched row is recomputed alone (B = 1). So records are
compared byte for byte where those match the ledger's recorded environment
(:func:`compare_environments`). On the machine kind that wrote the ledger a
difference is a failure (mode ``bytes``). On another GPU with the same
bit-relevant fields it is reported as "bits differ" with the first differing
field, not as a failure (mode ``bits``). Elsewhere the check falls back to what
must hold anywhere -- every gate passes, and in float32 the token IDs (prefix
and every suffix) are identical -- and says what it skipped (mode
``portable``). The command says before the first model loads which ledgers'
bits can be compared on this machine, and why not where they cannot; it prints
each row's time and how many remain, and a summary also when interrupted. A row still running after a minute
prints a line every minute with its phase and step (:mod:`kvreplay.runner.heartbeat`).

Usage::

    python -m kvreplay.verify --profile cpu --rows 1
    python -m kvreplay.verify --profile gpu --rows 3 --pick random --seed 7   # rows drawn by seed
    python -m kvreplay.verify --profile gpu --ids mmlu-ddcc9f44cbfb7b0c       # rows a reviewer names
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .model import kernels
from .experiments import arms
from .gates import GateError
from .runner.heartbeat import Heartbeat
from .ledger.lookup import PREFIX_BANK
from .ledger.prefix_bank import read_prefix_bank
from .ledger.files import LedgerError, read_environment, read_log, read_manifest
from .ledger.checked import checked_rows
from .ledger.store import canonical_json
from .model.execution import gpu_record
from .model.models import context_length, environment_record
from .paths import LEDGERS, ROOT
from .data.problems import Problem, load_bank
from .runner import ROW_ALGORITHM, ArmPlan, ArmSettings, RunSpec, arm_environment, check_prompts
from .runner.batched import first_difference, leaves
from .runner.spec import model_key

ENVIRONMENT_KEYS = ("device_name", "cpu_capability", "cpu_isa_flags", "torch", "intra_op_threads")
"""What must match for a CPU ledger's bits to be compared (and owed): the CPU kind and kernel ISA, torch, threads."""

GPU_BIT_KEYS = ("gpu_capability", "gpu_sm_count", "cuda_runtime", "cublas", "torch", "engine.step_path", "engine.batch")
"""What must match for a GPU ledger's bits to be compared: compute capability, SM count, CUDA runtime, cuBLAS,
torch, step path and batch shape (dotted: inside the record's ``engine``). Ledgers written before
:func:`kvreplay.model.execution.gpu_record` existed lack ``gpu_sm_count`` and ``cublas``: those are named as not recorded."""

MODES = ("bytes", "bits", "portable", "stale")
"""How a row is checked: ``bytes`` (the ledger's environment: identical records owed), ``bits`` (another GPU with
the same :data:`GPU_BIT_KEYS`: compared, a difference reported and not a failure), ``portable`` (gates and float32
token IDs only), ``stale`` (another row algorithm: not comparable, a failure)."""


@dataclasses.dataclass
class RowCheck:
    """The verdict on one recomputed row.

    Attributes:
        ledger: the ledger folder's name; problem_id: the row.
        mode: one of :data:`MODES`.
        ok: whether every owed check held (in mode ``bits`` a bit difference does not fail it).
        parted: where the recomputed record first parts from the committed one
            (a dotted path such as ``arms.prefill.suffix[12]``), or None.
        detail: a one-line account (what was compared, what was skipped).
        seconds: wall seconds the row's recomputation took (model load not included).
    """
    ledger: str
    problem_id: str
    mode: str
    ok: bool
    parted: str | None
    detail: str
    seconds: float = 0.0

    @property
    def bits_differ(self) -> bool:
        """Compared on another GPU of the same bit-relevant fields, and the bits part (not a failure)."""
        return self.mode == "bits" and self.parted is not None


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Whether a ledger's bits can be compared here (:func:`compare_environments`).

    Attributes:
        mode: ``bytes``, ``bits`` or ``portable`` (:data:`MODES`).
        differs: the fields that differ (mode ``portable``), in :data:`ENVIRONMENT_KEYS` / :data:`GPU_BIT_KEYS` order.
        unrecorded: bit-relevant fields the ledger does not record (compared as far as recorded).
        why: one line saying what was compared against what.
    """
    mode: str
    differs: tuple[str, ...]
    unrecorded: tuple[str, ...]
    why: str


def _field(record: dict, key: str) -> Any:
    """A possibly dotted field of an environment record (``engine.batch``); None where absent."""
    value: Any = record
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _recorded(record: dict, key: str) -> bool:
    head, _, rest = key.partition(".")
    return head in record and (not rest or isinstance(record[head], dict) and rest in record[head])


def _path(record: dict) -> str:
    engine = record.get("engine") or {"step_path": "eager"}
    return f"{engine['step_path']} path" + (f", B={engine['batch']}" if "batch" in engine else "")


def compare_environments(recorded: dict, current: dict) -> Comparison:
    """Whether rows of a ledger written under ``recorded`` can be compared bit for bit under ``current``.

    Both are execution-contract records (:func:`kvreplay.model.models.environment_record`, plus ``engine`` for a batched
    arm). A CPU ledger: bytes where every :data:`ENVIRONMENT_KEYS` field matches, else portable. A GPU ledger
    recomputed on a GPU: where every recorded :data:`GPU_BIT_KEYS` field matches, bytes on the same device name
    and bits on another; else portable, naming the first field that differs. A GPU ledger recomputed on a CPU
    (no GPU here): portable.
    """
    on_gpu = str(recorded.get("device", "")).startswith("cuda")
    if on_gpu and not str(current.get("device", "")).startswith("cuda"):
        return Comparison("portable", ("device",), (), f"written on {recorded.get('device_name', 'a GPU')} "
                          f"({_path(recorded)}); this machine has no GPU, so rows are recomputed on this CPU through the "
                          "eager path")
    keys: tuple[str, ...] = GPU_BIT_KEYS if on_gpu else ENVIRONMENT_KEYS
    if _field(recorded, "contract.kernels") not in (None, kernels.DEFAULT):  # the batch owes no bit: verified alone
        keys = tuple(k for k in keys if k != "engine.batch")
    unrecorded = tuple(k for k in keys if on_gpu and not _recorded(recorded, k))
    differs = tuple(k for k in keys if k not in unrecorded and _field(recorded, k) != _field(current, k))
    if differs:
        return Comparison("portable", differs, unrecorded, "; ".join(
            f"{k} {_field(recorded, k)!r} in the ledger, {_field(current, k)!r} here" for k in differs))
    missing = f"; not recorded by the ledger: {', '.join(unrecorded)}" if unrecorded else ""
    if not on_gpu or recorded.get("device_name") == current.get("device_name"):
        return Comparison("bytes", (), unrecorded, f"the ledger's environment ({recorded.get('device_name')}){missing}")
    return Comparison("bits", (), unrecorded, f"written on {recorded.get('device_name')}, recomputed on "
                      f"{current.get('device_name')}: same {', '.join(k for k in keys if k not in unrecorded)}{missing}")


def expected_environment(recorded: dict, threads: int) -> dict:
    """The fields :func:`compare_environments` reads, as this machine will have them when it recomputes a ledger
    written under ``recorded`` at ``threads`` intra-op threads: without loading a model, so that the command can say
    up front which ledgers' bits it can compare. A GPU ledger is recomputed on ``cuda:0`` where there is one, at its
    recorded step path and batch shape."""
    import torch

    current = environment_record(None, threads) | {"intra_op_threads": threads}
    if str(recorded.get("device", "")).startswith("cuda") and torch.cuda.is_available():
        dev = torch.device("cuda", 0)
        current |= {"device": str(dev), "device_name": torch.cuda.get_device_name(dev)} | gpu_record(dev)
        if "engine" in recorded:
            current["engine"] = recorded["engine"]
    return current


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
    read = checked_rows(folder)  # a damaged, duplicated, malformed or unchecked row: named by file, line and ID
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

    The shape a row is recomputed at: an eager-path ledger's row as it was written (one problem, two duplicate
    rows). A batched ledger's row: alone in a chunk of one at the recorded batch shape (``B``, ``max_len``), the
    composition gate's run. Under ``kernels`` other than ``default``, alone at ``B = 1`` and its own ``max_len``:
    the contract makes its bits independent of the batch (its detail ends ``(alone: B=1)``).

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
    read = checked_rows(folder)
    lines, committed = [r.text for r in read], [r.record for r in read]
    chosen = choose_rows(folder, rows, pick=pick, seed=seed, ids=ids)
    if env.get("row_algorithm") != ROW_ALGORITHM.get(config["experiment"]):
        stale = [RowCheck(folder.name, committed[i]["problem_id"], "stale", False, None,
                          f"written by row algorithm {env.get('row_algorithm')}, this code computes "
                          f"{ROW_ALGORITHM.get(config['experiment'])}: not comparable") for i in chosen]
        if report is not None:
            for check in stale:
                report(check)
        return stale
    bank = list(problems if problems is not None else load_bank())
    by_id = {p.problem_id: p for p in bank}
    plan = ledger_plan(folder, config, bank)
    row, chunk = plan.row_function(), plan.chunk_function()
    fn: Callable[[RunSpec, Problem], dict] = row
    alone = False
    recorded = env["execution_contract"]
    if settings.contract().device_type == "cuda" and not torch.cuda.is_available():
        # a GPU ledger on a machine without one: recompute on this CPU through the eager reference path
        settings = dataclasses.replace(settings.eager(), device="cpu", deterministic=None)
    elif config.get("engine"):
        if settings.kernels != kernels.DEFAULT:
            # invariant kernels: a row's bits owe nothing to its batch, so it is recomputed alone (B = 1, its max_len)
            settings, alone = dataclasses.replace(settings, batch=1, chunk=None, max_len=None), True
        else:  # a batched ledger: the row alone in a chunk of one at the recorded batch shape (the composition gate's)
            settings = dataclasses.replace(settings, max_len=recorded["engine"]["max_len"])
        fn = lambda spec, p: chunk(spec, [p])[0]  # noqa: E731 (the row alone in a chunk of one)
    lm, fmt = settings.load()
    run = settings.engine_run(fmt, [by_id[committed[i]["problem_id"]] for i in chosen], lm.model.config)
    check_prompts(fmt, [by_id[committed[i]["problem_id"]] for i in chosen], context_length(lm.model.config),
                  caps=settings.caps)
    spec = settings.run_spec(lm, fmt, run, equivalence_ids=frozenset(config["problem_ids"][: settings.preflight]))
    current = arm_environment(lm, fmt, settings, run)
    comparison = compare_environments(recorded, current)
    out = []
    for i in chosen:
        old = committed[i]
        start = time.perf_counter()
        with Heartbeat(f"{folder.name} {old['problem_id']}", lambda: lm.calls):  # a line a minute in a long row
            new = fn(spec, by_id[old["problem_id"]])
        check = judge_row(folder.name, old, new, lines[i], comparison, float32=lm.dtype == torch.float32,
                          seconds=time.perf_counter() - start)
        out.append(dataclasses.replace(check, detail=f"{check.detail} (alone: B=1)") if alone else check)
        if report is not None:
            report(out[-1])
    return out


def judge_row(ledger: str, old: dict, new: dict, line: str, comparison: Comparison, *, float32: bool,
              seconds: float = 0.0) -> RowCheck:
    """The verdict on one recomputed record ``new`` against its committed record ``old`` (committed line ``line``).

    Mode ``bytes``: the canonical JSON must equal ``line``. Mode ``bits``: byte-identical passes; otherwise the
    row says "bits differ" at the first differing field and passes if the portable checks do. Mode ``portable``:
    every gate passes on both, and in float32 the token IDs are identical.
    """
    pid = old["problem_id"]
    same = canonical_json(new) == line
    if comparison.mode == "bytes":
        parted = None if same else first_difference(old, new)
        return RowCheck(ledger, pid, "bytes", same, parted, "byte-identical" if same else f"differs first at {parted}",
                        seconds)
    if comparison.mode == "bits" and same:
        return RowCheck(ledger, pid, "bits", True, None, f"byte-identical ({comparison.why})", seconds)
    checks, parted = [], None
    if comparison.mode == "bits":
        parted = first_difference(old, new)
        checks.append(f"bits differ first at {parted} (not a gate failure)")
    gates_ok = new.get("gate_failure") is None and old.get("gate_failure") is None
    checks.append(f"gates {'pass' if gates_ok else 'FAIL: ' + str(new.get('gate_failure'))}")
    ok = gates_ok
    if float32:
        a, b = _token_fields(old), _token_fields(new)
        tok_ok = a == b
        where = None if tok_ok else first_difference(a, b)
        parted = parted or where
        checks.append("float32 token IDs " + ("identical" if tok_ok else f"differ first at {where}")
                      + ("" if comparison.mode == "bits" else " (cache summaries and margins not compared)"))
        ok = ok and tok_ok
    elif comparison.mode == "portable":
        checks.append("BF16 bits not compared")
    what = "another environment" if comparison.mode == "portable" else "another GPU"
    return RowCheck(ledger, pid, comparison.mode, ok, parted, f"{'; '.join(checks)} ({what}: {comparison.why})", seconds)


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
    held = {f: {r.record["problem_id"] for r in checked_rows(f)} for f in ledgers}
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
    wanted = selection(recomputable_ledgers(ledger_root, profile, only), rows, pick=pick, seed=seed, ids=ids)
    out = []
    for folder, mine in wanted.items():
        out.extend(verify_ledger(folder, rows, pick=pick, report=report, seed=seed, ids=mine))
    return out


def selection(ledgers: Sequence[Path], rows: int, *, pick: str, seed: int | None,
              ids: Sequence[str] | None) -> dict[Path, list[str] | None]:
    """Each ledger to recompute -> the problem IDs it recomputes (None: ``rows`` rows by ``pick``), every choice
    checked (:func:`choose_rows`) before the first model loads.

    Raises:
        ValueError: an ID no ledger holds, a bad ``pick`` or ``seed`` (:func:`ids_by_ledger`, :func:`choose_rows`).
    """
    wanted: dict[Path, list[str] | None] = dict(ids_by_ledger(ledgers, ids)) if ids else {f: None for f in ledgers}
    for folder, mine in wanted.items():
        choose_rows(folder, rows, pick=pick, seed=seed, ids=mine)
    return wanted


def forecast(ledgers: Sequence[Path]) -> list[str]:
    """What the command says before the first model loads: for which ledgers this machine compares bits, and for
    which it cannot and why (:func:`compare_environments` on :func:`expected_environment`), one line per reason."""
    groups: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for folder in ledgers:
        settings, config = settings_from_manifest(folder)
        recorded = read_environment(folder)["execution_contract"]
        c = compare_environments(recorded, expected_environment(recorded, settings.threads))
        groups.setdefault((c.mode, c.why), []).append((folder.name, config["dtype"]))
    out = []
    for (mode, why), named in groups.items():
        names = ", ".join(n for n, _ in named)
        if mode == "bytes":
            out.append(f"Bits compared byte for byte (a difference fails) in {names}: this machine matches {why}.")
        elif mode == "bits":
            out.append(f"Bits compared on another GPU in {names} ({why}); where they part the row says "
                       "\"bits differ\" with the first differing field, not a failure.")
        else:
            fp32 = [n for n, d in named if d == "float32"]
            out.append(f"BF16 bits cannot be compared on this machine for {names}: {why}. Their rows get the portable "
                       "checks: every gate passes" + (f", and the float32 ledgers' token IDs ({', '.join(fp32)}) are "
                                                      "identical" if fp32 else "") + ".")
    return out


def summary(results: Sequence[RowCheck], total: int, seconds: float, *, interrupted: bool = False) -> str:
    """The closing line of ``make verify``: rows byte-identical, with bits that differ on another GPU, passing the
    portable checks only, failing; when ``interrupted``, how many of ``total`` were never recomputed."""
    bad = sum(not r.ok for r in results)
    differ = sum(r.ok and r.bits_differ for r in results)
    portable = sum(r.ok and r.mode == "portable" for r in results)
    exact = len(results) - bad - differ - portable
    head = f"interrupted after {len(results)} of {total} rows: " if interrupted else ""
    return (head + f"{exact} of {len(results)} recomputed rows match byte for byte"
            + (f"; {differ} pass with bits that differ on another GPU (first differing fields above)" if differ else "")
            + (f"; {portable} pass the portable checks (gates, and what must hold on any machine; their BF16 bits are "
               "not compared here)" if portable else "") + (f"; {bad} do not" if bad else "")
            + (f"; {total - len(results)} not recomputed" if interrupted else "") + f" ({seconds:.0f} s)")


def main(argv: Sequence[str] | None = None) -> int:

    ap = argparse.ArgumentParser(prog="python -m kvreplay.verify", description=__doc__.split("\n\n")[0],
                                 epilog="Bits are compared where the ledger's recorded environment matches this machine "
                                        "(CPU: CPU kind and kernel ISA, torch, threads; GPU: compute capability, SM "
                                        "count, CUDA, cuBLAS, torch, step path, batch shape); on another GPU of the "
                                        "same fields a difference is reported as 'bits differ', not a failure; "
                                        "elsewhere the portable checks run (gates pass, FP32 token IDs equal). "
                                        "Ctrl-C prints the summary of the rows done.",
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
    try:
        wanted = selection(ledgers, args.rows, pick=args.pick, seed=args.seed, ids=args.ids)
    except (ValueError, LedgerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.ids:
        what = f"rows {' '.join(args.ids)} where held"
        ledgers = list(wanted)
    else:
        what = f"{args.rows} committed row(s) ({args.pick}{f', seed {args.seed}' if args.seed is not None else ''})"
    total = sum(len(choose_rows(f, args.rows, pick=args.pick, seed=args.seed, ids=mine)) for f, mine in wanted.items())
    print(f"make verify: recomputing {what} of each of {len(ledgers)} ledgers of "
          f"profile {args.profile} ({', '.join(f.name for f in ledgers)}), {total} rows; each ledger loads its model, "
          "and a row takes seconds to minutes.", flush=True)
    for line in forecast(ledgers):
        print(line, flush=True)
    print("One line per row as it is done (its time, how many remain); Ctrl-C stops with a summary:", flush=True)
    done: list[RowCheck] = []
    start = time.perf_counter()

    def said(r: RowCheck) -> None:
        done.append(r)
        tag = "DIFF" if r.ok and r.bits_differ else "OK  " if r.ok else "FAIL"
        print(f"{tag} {r.mode:8s} {r.ledger:40s} {r.problem_id:24s} {r.detail} [{r.seconds:.1f} s; {len(done)} of "
              f"{total} done, {total - len(done)} left, {time.perf_counter() - start:.0f} s so far]", flush=True)

    # Ctrl-C raises KeyboardInterrupt here whatever handler a library loaded earlier left for SIGINT
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler) if main_thread else None
    try:
        verify_profile(args.ledger_root, args.profile, args.rows, only=args.only, pick=args.pick, report=said,
                       seed=args.seed, ids=args.ids)
    except KeyboardInterrupt:
        print(summary(done, total, time.perf_counter() - start, interrupted=True), flush=True)
        return 130
    except LedgerError as e:  # a damaged line, a duplicated row or a damaged small file: named, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)
    print(summary(done, total, time.perf_counter() - start))
    return 1 if any(not r.ok for r in done) else 0


if __name__ == "__main__":
    sys.exit(main())
