"""A profile's results as data, recomputed from its committed ledgers (paper §4): what the docs render.

:func:`profile_results` runs the experiments' own summary functions over a
profile's finished ledgers: :func:`kvreplay.report.summary.summarize`, the
controls', the checkpoint metric's and the cross-hardware counts. It also
reads where and how each ledger was computed from its environment record.
It returns numbers and summary objects, never formatted text;
:mod:`kvreplay.report.results_pages` renders them. No model is loaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import yaml

from ..adapt.metric import accuracy_summary
from ..experiments.controls import controls_summary
from ..experiments.transplant import DEFAULT_PRECONDITION_RULE, localization_table
from ..ledger.files import read_json, read_manifest
from ..ledger.lookup import PREFIX_BANK, LoadedLedger, ProfileLedgers, ledger_progress, load_profile_ledgers, read_ledger
from ..paths import LEDGERS, NOTEBOOKS
from ..runner import EXECUTION_DEFAULTS
from .cross_hardware import SETUPS, compare, exp1_records
from .paper_tables import REFERENCE, load_reference
from .summary import summarize

SEED = 20260729
"""Bootstrap seed of every committed profile (the chain parameter ``seed``'s default)."""
N_RESAMPLES = 20000
"""Bootstrap replicates of every committed profile (the chain parameter ``n_resamples``'s default)."""


@dataclasses.dataclass(frozen=True)
class Setup:
    """Where and how a group of ledgers was computed, read from their ``environment.json``.

    Attributes:
        ledgers: the ledger keys (``exp1-bfloat16``, ...) computed this way.
        device: the GPU's name, or the CPU's name and kernel ISA for a CPU run.
        step_path: ``eager`` (the reference decoders) or the batched engine's ``engine-eager`` / ``graph``.
        batch: problems per batched step (None on the eager path).
        attention: the engine step's attention (``sdpa`` unless the ledger key names another).
        sdpa_backends: the SDPA backends every forward call could use.
        threads: intra-op CPU threads.
        torch: the torch version.
    """
    ledgers: tuple[str, ...]
    device: str
    step_path: str
    batch: int | None
    attention: str
    sdpa_backends: tuple[str, ...]
    threads: int
    torch: str


@dataclasses.dataclass
class ProfileResults:
    """Every number the results pages show for one profile (counts, Wilson and bootstrap objects, labels).

    Attributes:
        profile: the profile name (a folder of the ledger root).
        summary: :func:`kvreplay.report.summary.summarize` of the profile's chain ledgers.
        ledgers: ledger key -> its :class:`~kvreplay.ledger.lookup.LoadedLedger` (controls included when run).
        setups: distinct :class:`Setup` among the ledgers, in ledger order.
        model: the environment record's model entry of Experiment 1 BF16 (file, architecture, geometry).
        problems: how many problems (Experiment 1 rows); dataset: their source name (``MMLU``).
        caps: branch, merge and answer caps (tokens); precisions: dtype names.
        gate_failures: ledger key -> rows recorded with a gate failure.
        localization: Experiment 4's :func:`~kvreplay.experiments.transplant.localization_table` records.
        controls: :func:`~kvreplay.experiments.controls.controls_summary`, or None when not run.
        adapt: the checkpoint metric's :func:`~kvreplay.adapt.metric.accuracy_summary`, or None.
        cross_hardware: one dict per (setup pair, precision) of :func:`kvreplay.report.cross_hardware.compare`
            counts, for the pairs that include this profile and share rows; empty when none.
        reference: the paper's reported numbers (``data/paper/reference.yaml``).
        seed, n_resamples: the bootstrap's seed and replicates.
    """
    profile: str
    summary: dict
    ledgers: dict[str, LoadedLedger]
    setups: list[Setup]
    model: dict
    problems: int
    dataset: str
    caps: dict
    precisions: list[str]
    gate_failures: dict[str, int]
    localization: list[dict]
    controls: dict | None
    adapt: dict | None
    cross_hardware: list[dict]
    reference: dict
    seed: int
    n_resamples: int

    def paper(self, endpoint_id: str) -> dict:
        """The ``value`` mapping of a reference endpoint (the paper's number as data).

        Raises:
            KeyError: no such endpoint, or it has no ``value``.
        """
        for e in self.reference["endpoints"]:
            if e["id"] == endpoint_id:
                if "value" not in e:
                    raise KeyError(f"{REFERENCE}: endpoint {endpoint_id!r} has no `value`")
                return e["value"]
        raise KeyError(f"{REFERENCE} has no endpoint {endpoint_id!r}")

    def paper_text(self, endpoint_id: str) -> str:
        """The paper's value of a reference endpoint as the paper states it (its ``paper`` string)."""
        for e in self.reference["endpoints"]:
            if e["id"] == endpoint_id:
                return e["paper"]
        raise KeyError(f"{REFERENCE} has no endpoint {endpoint_id!r}")


def setup_of(ledger: LoadedLedger) -> tuple:
    """``(device, step_path, batch, attention, sdpa_backends, threads, torch)`` of one ledger's environment record."""
    env = ledger.contract
    engine = env.get("engine") or {}
    device = env.get("device_name") if str(env.get("device", "")).startswith("cuda") else (
        f"{env.get('cpu_name', '?')} CPU ({env.get('cpu_capability', '?')})")
    return (device, engine.get("step_path", "eager"), engine.get("batch"),
            engine.get("attention", EXECUTION_DEFAULTS["attention"]),
            tuple(env.get("contract", {}).get("sdpa_backends", ())), env.get("intra_op_threads"), env.get("torch", "?"))


def group_setups(ledgers: Mapping[str, LoadedLedger]) -> list[Setup]:
    """Ledgers grouped by :func:`setup_of`, groups in the order their first ledger appears."""
    groups: dict[tuple, list[str]] = {}
    for key, ledger in ledgers.items():
        groups.setdefault(setup_of(ledger), []).append(key)
    return [Setup(tuple(keys), *fields) for fields, keys in groups.items()]


def _finished_folder(root: Path, pattern: str, match=lambda manifest: True) -> Path | None:
    """The one finished ledger folder ``root/pattern`` whose manifest ``match`` accepts (None if none).

    Raises:
        ValueError: more than one (two configs of one arm: move the stale one away).
    """
    found = [p for p in sorted(root.glob(pattern)) if (p / "manifest.json").is_file()
             and match(read_manifest(p)) and ledger_progress(p)[0] == ledger_progress(p)[1]]
    if len(found) > 1:
        raise ValueError(f"{len(found)} finished ledgers {pattern} under {root}: {[p.name for p in found]}")
    return found[0] if found else None


def controls_ledger(root: Path, profile: str) -> LoadedLedger | None:
    """The finished exploratory-controls ledger built on the profile's prefix bank, or None when not run."""
    bank = read_json(root / profile / f"{PREFIX_BANK}.manifest.json", "write the prefix bank again (notebook 01)")["sha256"]
    folder = _finished_folder(root / profile, "exp2_controls-bfloat16-*",
                              lambda m: m["config"].get("prefix_bank_sha256") == bank)
    return read_ledger(folder, "exp2_controls-bfloat16") if folder else None


def adapt_ledger(root: Path, profile: str) -> LoadedLedger | None:
    """The profile's finished checkpoint-metric ledger on the MMLU bank (notebook 00's ``adapt_eval`` with
    ``problem_set`` ``bank``; not the recipe search's held-out one), or None (a profile that reads another profile's
    checkpoint family has none)."""
    folder = _finished_folder(root / profile, "adapt_eval-float32-*",
                              lambda m: m["config"].get("problem_set", "bank") == "bank")
    return read_ledger(folder, "adapt_eval-float32") if folder else None


def length_ledgers(root: Path, profile: str) -> dict[str, LoadedLedger]:
    """The profile's finished manipulated-length ledgers (``exp1_length``), keyed ``exp1_length-bfloat16-cap<N>`` by
    branch cap; none when the profile did not run the arm."""
    out = {}
    for folder in sorted((root / profile).glob("exp1_length-bfloat16-*")):
        if (folder / "manifest.json").is_file() and ledger_progress(folder)[0] == ledger_progress(folder)[1]:
            cap = read_manifest(folder)["config"]["caps"]["branch"]
            out[f"exp1_length-bfloat16-cap{cap}"] = read_ledger(folder, "exp1_length-bfloat16")
    return out


def cross_hardware_counts(root: Path, profile: str) -> list[dict]:
    """:func:`~kvreplay.report.cross_hardware.compare` counts for every pair of
    :data:`~kvreplay.report.cross_hardware.SETUPS` that share rows, per precision, when ``profile`` is one of them
    (``[]`` otherwise)."""
    if profile not in {p for p, _ in SETUPS}:
        return []
    out = []
    for i, (pa, la) in enumerate(SETUPS):
        for pb, lb in SETUPS[i + 1:]:
            if not (root / pa).is_dir() or not (root / pb).is_dir():
                continue
            for dtype in ("bfloat16", "float32"):
                c = compare(exp1_records(root, pa, dtype), exp1_records(root, pb, dtype))
                if c["rows"]:
                    out.append({"a": pa, "a_label": la, "b": pb, "b_label": lb, "dtype": dtype, **c})
    return out


def profile_stats(profile: str) -> dict:
    """``seed``, ``n_resamples`` and ``precondition_failures`` (``exp4_precondition_failures``) as
    ``notebooks/params/<profile>.yaml`` sets them (the chain's defaults otherwise)."""
    path = NOTEBOOKS / "params" / f"{profile}.yaml"
    doc = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return {"seed": doc.get("seed", SEED), "n_resamples": doc.get("n_resamples", N_RESAMPLES),
            "precondition_failures": doc.get("exp4_precondition_failures", DEFAULT_PRECONDITION_RULE)}


def profile_results(profile: str, ledger_root: str | Path = LEDGERS, *, seed: int = SEED,
                    n_resamples: int = N_RESAMPLES, precondition_failures: str = DEFAULT_PRECONDITION_RULE) -> ProfileResults:
    """Every number of a profile's results pages, recomputed from its finished ledgers.

    Args:
        profile: a folder of ``ledger_root`` holding a complete chain (Experiments 1-5).
        ledger_root: the ledger root (default ``data/ledgers``).
        seed, n_resamples: the bootstrap's seed and replicates (the profile's ``seed`` and ``n_resamples``).
        precondition_failures: the profile's ``exp4_precondition_failures`` (Experiment 4's rows that failed the
            transplant's precondition: ``left_out``, ``counted_as_failure`` or ``report_both``).

    Raises:
        MissingLedgerError: a ledger of the chain is missing or unfinished (names the notebook to run).
        GateError: a row failed a gate that withholds its experiment's endpoints.
        ValueError: two finished controls or checkpoint-metric ledgers of one profile.
    """
    root = Path(ledger_root)
    chain: ProfileLedgers = load_profile_ledgers(root, profile)
    summary = summarize(chain, seed=seed, n_resamples=n_resamples, precondition_failures=precondition_failures)
    ledgers = dict(chain.ledgers)
    controls = controls_ledger(root, profile)
    if controls is not None:
        ledgers["exp2_controls-bfloat16"] = controls
    adapt = adapt_ledger(root, profile)
    if adapt is not None:
        ledgers["adapt_eval-float32"] = adapt
    ledgers.update(length_ledgers(root, profile))
    exp1 = chain["exp1-bfloat16"]
    return ProfileResults(
        profile=profile, summary=summary, ledgers=ledgers, setups=group_setups(ledgers),
        model=exp1.contract.get("model", {}), problems=len(exp1.records),
        dataset="/".join(sorted({str(i).split("-", 1)[0].upper() for i in exp1.config["problem_ids"]})),
        caps=dict(exp1.config["caps"]), precisions=chain.precisions,
        gate_failures={k: sum(r.get("gate_failure") is not None for r in v.records) for k, v in ledgers.items()},
        localization=localization_table(chain.records("exp4-bfloat16")).to_dict("records"),
        controls=controls_summary(controls.records) if controls is not None else None,
        adapt=(accuracy_summary(adapt.records, "ckpt0", "later", seed=seed, n_resamples=n_resamples)
               if adapt is not None else None),
        cross_hardware=cross_hardware_counts(root, profile), reference=load_reference(), seed=seed,
        n_resamples=n_resamples,
    )

