"""Two model families on the same problems, side by side: the cross-family table as data and as markdown.

:func:`family_table` joins two profiles' :class:`~kvreplay.report.results.ProfileResults` into one row per endpoint,
beside the paper's value from ``data/paper/reference.yaml``. The endpoints are Experiment 1's suffix divergence with
its tie split, its FP32 rate, cache drift per layer kind, the Experiment 3 bridge, Experiment 4's recovery and
Experiment 5's verdict. A cell is a summary object (:class:`~kvreplay.analysis.stats.Proportion`, :class:`Count`, a float, a
label), never formatted text. The two profiles must hold the same problems (:func:`same_problems`).

:data:`FAMILY_PAIRS` names the profiles compared. The results page of a pair's second profile shows the table once
both chains are complete, and one line until the first's is (:func:`family_results`, :func:`families_section`,
called by :mod:`kvreplay.report.results_pages`)::

    python -m kvreplay.report.cross_family paper gemma    # print the section
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeAlias

import pandas as pd

from ..analysis.drift import aggregate
from ..experiments.endpoints import require_gates
from ..experiments.transplant import reported_ways
from ..ledger.lookup import MissingLedgerError
from ..ledger.provenance import ledger_provenance
from ..ledger.records import comparison_of
from ..paths import LEDGERS
from ..analysis.stats import Proportion, wilson
from .markdown import caps_text, dtype_label, rate, table
from .results import ProfileResults, profile_results, profile_stats

FAMILY_PAIRS: tuple[tuple[str, str], ...] = (("paper", "gemma"),)
"""Profiles run on the same problems by two model families, ``(first, second)``: SmolLM2-135M and Gemma 3 270M at
the paper's size. The results page of the second shows the table."""

PRECISIONS = ("bfloat16", "float32")
LAYER_KINDS = ("full", "sliding")
"""Attention layer kinds, in table order (``layer_kind`` of a drift record; a model without sliding layers: full)."""
WAYS = ("left_out", "counted_as_failure")
"""How an Experiment 4 rate treats panel rows failing the transplant's precondition (``reported_ways``)."""
TOOL = "python -m kvreplay.report.cross_family"


@dataclasses.dataclass(frozen=True)
class Count:
    """``k`` of ``n`` rows, shown without an interval (a split of the divergent rows, a bridge count)."""
    k: int
    n: int


Cell: TypeAlias = Proportion | Count | float | str | None
"""One value of the table: None where a profile has none (a precision not run, a layer kind its model lacks, a way
its precondition rule does not report) or the paper reports none."""


@dataclasses.dataclass(frozen=True)
class FamilyRow:
    """One endpoint: ``key`` (e.g. ``exp1.bfloat16.suffix``), its label, the paper's value and each profile's."""
    key: str
    endpoint: str
    paper: Cell
    a: Cell
    b: Cell


@dataclasses.dataclass(frozen=True)
class Side:
    """What one profile of the pair is, read from its ledgers.

    Attributes:
        profile: the profile's name.
        model: the environment record's model entry of Experiment 1 BF16 (file, architecture, geometry, attention).
        problems, dataset, problems_sha256: Experiment 1's row count, source name and problem-content digest.
        caps: branch, merge and answer caps (tokens); precisions: dtype names.
        devices: the devices its ledgers were computed on.
        library_digests: every library digest that wrote its ledgers (:mod:`kvreplay.ledger.provenance`).
    """
    profile: str
    model: dict
    problems: int
    dataset: str
    problems_sha256: str
    caps: dict
    precisions: tuple[str, ...]
    devices: tuple[str, ...]
    library_digests: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class FamilyTable:
    """The cross-family table: both sides and one :class:`FamilyRow` per endpoint."""
    a: Side
    b: Side
    rows: tuple[FamilyRow, ...]

    def frame(self) -> pd.DataFrame:
        """The rows indexed by ``key``: ``endpoint``, ``the paper``, then one column per profile, cells as they are."""
        return pd.DataFrame([{"key": r.key, "endpoint": r.endpoint, "the paper": r.paper, self.a.profile: r.a,
                              self.b.profile: r.b} for r in self.rows]).set_index("key")

    def row(self, key: str) -> FamilyRow:
        """The row of ``key``.

        Raises:
            KeyError: no such row.
        """
        for r in self.rows:
            if r.key == key:
                return r
        raise KeyError(f"no cross-family row {key!r}")


@dataclasses.dataclass(frozen=True)
class Families:
    """The cross-family comparison a results page shows (:func:`family_results`).

    Attributes:
        first, second: the pair's profiles (the page is the second's).
        table: the table, or None while the first profile's chain is not complete.
    """
    first: str
    second: str
    table: FamilyTable | None


# ----------------------------------------------------------------------------- data


def problem_set(res: ProfileResults) -> tuple[list[str], str]:
    """A profile's Experiment 1 problem IDs (frozen order) and the digest of their content (``problems_sha256``)."""
    config = res.ledgers["exp1-bfloat16"].config
    return list(config["problem_ids"]), config["problems_sha256"]


def same_problems(a: ProfileResults, b: ProfileResults) -> None:
    """Refuse two profiles that do not hold the same problems: the same IDs, in order, with the same content.

    Raises:
        ValueError: naming both profiles and how their problems differ.
    """
    (ids_a, sha_a), (ids_b, sha_b) = problem_set(a), problem_set(b)
    if ids_a != ids_b:
        only_a, only_b = len(set(ids_a) - set(ids_b)), len(set(ids_b) - set(ids_a))
        how = (f"{only_a} ID(s) only in {a.profile!r}, {only_b} only in {b.profile!r}" if only_a or only_b
               else "the same IDs in another order")
        raise ValueError(f"profiles {a.profile!r} and {b.profile!r} do not hold the same problems ({len(ids_a)} and "
                         f"{len(ids_b)} Experiment 1 rows; {how}): a cross-family table compares one problem set")
    if sha_a != sha_b:
        raise ValueError(f"profiles {a.profile!r} and {b.profile!r} hold the same problem IDs with other content "
                         f"(problems_sha256 {sha_a[:12]} vs {sha_b[:12]})")


def drift_by_kind(records: Sequence[Any], comparison: str = "prefill_vs_live") -> dict[str, float]:
    """Median over rows of each attention layer kind's cache drift.

    A row's drift of one kind is the relative L2 over that kind's K and V tensors concatenated
    (:func:`kvreplay.analysis.drift.aggregate`); a sliding layer's covers its attended positions. Rows without ``layer_kind``
    come from a model whose every layer is full attention.

    Args:
        records: an Experiment 1 or 2 arm's rows.
        comparison: the boundary comparison with per-tensor drift (``prefill_vs_live``, ``prefill_vs_incremental``).

    Returns:
        kind -> median relative L2, for the kinds present, in :data:`LAYER_KINDS` order.

    Raises:
        GateError: a row failed a gate.
        KeyError: a row has no per-tensor drift for ``comparison``.
    """
    per_kind: dict[str, list[float]] = {}
    for r in require_gates(records):
        groups: dict[str, list[dict]] = {}
        for t in comparison_of(r, comparison)["tensors"]:
            groups.setdefault(t.get("layer_kind", "full"), []).append(dict(t))
        for kind, tensors in groups.items():
            per_kind.setdefault(kind, []).append(aggregate(tensors)["rel_l2"])
    order = [*LAYER_KINDS, *sorted(set(per_kind) - set(LAYER_KINDS))]
    return {k: statistics.median(per_kind[k]) for k in order if k in per_kind}


def side_of(res: ProfileResults) -> Side:
    """The :class:`Side` of one profile."""
    _, sha = problem_set(res)
    digests = {d for ledger in res.ledgers.values() for d in ledger_provenance(ledger.dir).digests}
    return Side(res.profile, dict(res.model), res.problems, res.dataset, sha, dict(res.caps), tuple(res.precisions),
                tuple(dict.fromkeys(s.device for s in res.setups)), tuple(sorted(digests)))


def _ways(res: ProfileResults, key: str) -> dict[str, Proportion | None]:
    """An Experiment 4 rate as the profile's precondition rule reports it: way -> rate (``""`` when counting the
    failing rows changes nothing, then the same rate under each way)."""
    t = res.summary["transplant"]
    ways = reported_ways(t, t[key], t["counted_as_failure"][key])
    return dict.fromkeys(("", *WAYS), ways[0][1]) if ways[0][0] == "" else dict(ways)


def _values(res: ProfileResults) -> dict[str, Cell]:
    """Every cell of one profile's column, by row key (summary objects from :func:`profile_results`)."""
    S = res.summary
    out: dict[str, Cell] = {}
    for d in res.precisions:
        s = S["exp1"][d]
        k, ties = s["suffix"].k, s["tie_initiated"]
        out |= {f"exp1.{d}.suffix": s["suffix"], f"exp1.{d}.tie_initiated": Count(ties, k),
                f"exp1.{d}.nonzero_margin": Count(k - ties, k)}
        for exp in ("exp1", "exp2"):
            out[f"{exp}.{d}.drift"] = S[exp][d]["drift_median"]
            kinds = drift_by_kind(res.ledgers[f"{exp}-{d}"].records, f"prefill_vs_{S[exp][d]['ref']}")
            out |= {f"{exp}.{d}.drift.{kind}": v for kind, v in kinds.items()}
    b = S["bridge"]
    out |= {f"exp3.bridge.{k}": Count(b[k], b["n"]) for k in ("layers_exact", "logits_exact", "suffix_exact")}
    for key in ("joint_recovery", "third_among_exact"):
        out |= {f"exp4.{key}" + (f".{w}" if w else ""): p for w, p in _ways(res, key).items()}
    r = S["replication"]
    out |= {f"exp5.{k}": r[k] for k in ("divergence", "joint_recovery", "third_among_exact")}
    out["exp5.interpretation"] = r["interpretation"].label
    return out


def _paper_rate(res: ProfileResults, endpoint_id: str) -> Proportion:
    v = res.paper(endpoint_id)
    return wilson(v["k"], v["n"])


def _paper_count(res: ProfileResults, endpoint_id: str) -> Count:
    v = res.paper(endpoint_id)
    return Count(v["k"], v["n"])


KIND_LABELS = {"full": "full-attention layers", "sliding": "sliding-window layers (attended positions)"}
TAGS = {"left_out": ", panel rows failing the precondition left out",
        "counted_as_failure": ", panel rows failing the precondition counted as failures"}


def _rows(a: ProfileResults, b: ProfileResults, present: set[str]) -> list[tuple[str, str, Cell]]:
    """``(key, endpoint, the paper's value)`` of every row, in table order, for the precisions, layer kinds and
    precondition ways of either profile (``present``: the keys of either profile's :func:`_values`)."""
    out: list[tuple[str, str, Cell]] = []
    for d in (d for d in PRECISIONS if d in a.precisions or d in b.precisions):
        D = dtype_label(d)
        out += [(f"exp1.{d}.suffix", f"**Exp 1 {D}: suffixes part, prefill vs live**",
                 _paper_rate(a, "exp1.bf16.suffix" if d == "bfloat16" else "exp1.fp32.decoded")),
                (f"exp1.{d}.tie_initiated", f"Exp 1 {D}: of those, begun at an exact top-1/top-2 logit tie", None),
                (f"exp1.{d}.nonzero_margin", f"Exp 1 {D}: of those, begun at a nonzero top-1/top-2 margin", None)]
    for exp, what in (("exp1", "prefill vs live"), ("exp2", "prefill vs incremental (fixed prefixes)")):
        for d in (d for d in PRECISIONS if d in a.precisions or d in b.precisions):
            label = f"Exp {exp[-1]} {dtype_label(d)}: cache drift, {what}, median relative L2"
            out.append((f"{exp}.{d}.drift", f"{label}: all layers", a.paper("exp2.drift")[d] if exp == "exp2" else None))
            found = {k.rsplit(".", 1)[1] for k in present if k.startswith(f"{exp}.{d}.drift.")}
            out += [(f"{exp}.{d}.drift.{k}", f"{label}: {KIND_LABELS.get(k, f'{k} layers')}", None)
                    for k in [*(k for k in LAYER_KINDS if k in found), *sorted(found - set(LAYER_KINDS))]]
    out += [("exp3.bridge.layers_exact", "**Exp 3 bridge: incremental bit-exact to live on every layer**",
             _paper_count(a, "exp3.bridge.layers_exact")),
            ("exp3.bridge.logits_exact", "Exp 3 bridge: boundary logits exact", _paper_count(a, "exp3.bridge.logits_exact")),
            ("exp3.bridge.suffix_exact", "Exp 3 bridge: complete suffix exact", _paper_count(a, "exp3.bridge.suffix_exact"))]
    for key, label in (("joint_recovery", "**Exp 4: joint donor recovery, both ways** (integrity check)"),
                       ("third_among_exact", "Exp 4: third trajectory among exact controls")):
        tags = [w for w in WAYS if any(w in _ways(res, key) and "" not in _ways(res, key) for res in (a, b))] or [""]
        out += [(f"exp4.{key}" + (f".{w}" if w else ""), label + TAGS.get(w, ""), _paper_rate(a, f"exp4.{key}"))
                for w in tags]
    out += [("exp5.divergence", "**Exp 5 (later checkpoint): suffixes part, prefill vs incremental**",
             _paper_rate(a, "exp5.divergence")),
            ("exp5.joint_recovery", "Exp 5: donor recovery both ways", _paper_rate(a, "exp5.joint_recovery")),
            ("exp5.third_among_exact", "Exp 5: new trajectory among exact controls", _paper_rate(a, "exp5.third_among_exact")),
            ("exp5.interpretation", "**Exp 5: frozen interpretation** (the paper's thresholds)",
             a.paper_text("exp5.interpretation"))]
    return out


def family_table(a: ProfileResults, b: ProfileResults) -> FamilyTable:
    """The cross-family table of two profiles (any two, even of one model): one row per endpoint, the paper's beside.

    Raises:
        ValueError: the same profile twice, or profiles that do not hold the same problems (:func:`same_problems`).
    """
    if a.profile == b.profile:
        raise ValueError(f"a cross-family table compares two profiles, got {a.profile!r} twice")
    same_problems(a, b)
    va, vb = _values(a), _values(b)
    rows = tuple(FamilyRow(key, label, paper, va.get(key), vb.get(key)) for key, label, paper in _rows(a, b, {*va, *vb}))
    return FamilyTable(side_of(a), side_of(b), rows)


def partners(profile: str) -> list[str]:
    """The profiles whose ledgers the results page of ``profile`` also reads (the first of each pair it ends)."""
    return [first for first, second in FAMILY_PAIRS if second == profile]


def family_results(res: ProfileResults, ledger_root: str | Path = LEDGERS) -> Families | None:
    """What the results page of ``res`` shows across families: None unless its profile ends a :data:`FAMILY_PAIRS`
    pair; a :class:`Families` without a table while the pair's first profile has no complete chain under
    ``ledger_root``.

    Raises:
        ValueError: as :func:`family_table`.
    """
    for first in partners(res.profile):
        try:
            other = profile_results(first, ledger_root, **profile_stats(first))
        except MissingLedgerError:
            return Families(first, res.profile, None)
        return Families(first, res.profile, family_table(other, res))
    return None


# ----------------------------------------------------------------------------- markdown


def cell_text(x: Cell, none: str = "—") -> str:
    """A cell as the page shows it: a rate with its Wilson interval, ``k/n``, a drift to three digits, a label."""
    if x is None:
        return none
    if isinstance(x, Proportion):
        return rate(x)
    if isinstance(x, Count):
        return f"{x.k}/{x.n}"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def _attention(model: dict) -> str:
    kinds = (model.get("attention") or {}).get("layer_types")
    if not kinds:
        return f"{model.get('layers', '?')} full"
    window = model["attention"].get("sliding_window")
    return ", ".join(f"{kinds.count(k)} {k}" + (f" (window {window})" if k == "sliding" else "")
                     for k in LAYER_KINDS if k in kinds)


def sides_table(t: FamilyTable, reference: dict) -> str:
    """Model, geometry, problems, caps, precisions, devices and library digests of both profiles, and the paper's."""
    p = reference["setup"]

    def col(s: Side) -> list[str]:
        m = s.model
        return [f"`{m.get('file') or m.get('model')}` ({m.get('architecture', '?')}; {m.get('package', '—')})",
                f"{m.get('layers', '?')}; {m.get('kv_heads', '?')}; {m.get('head_dim', '?')}", _attention(m),
                f"{s.problems} {s.dataset} (content sha256 `{s.problems_sha256[:12]}`)", caps_text(s.caps),
                ", ".join(dtype_label(d) for d in s.precisions), ", ".join(s.devices),
                ", ".join(f"`{d[:12]}`" for d in s.library_digests) or "none recorded"]

    paper = [p["model_short"], f"{p['layers']}; {p['kv_heads']}; {p['head_dim']}", "—", f"{p['rows']['exp1']} {p['dataset']}",
             caps_text(p["caps"]), p["precisions"], p["hardware"], "—"]
    labels = ["model", "layers; KV heads; head dim", "attention layers", "problems (Experiment 1 rows)",
              "caps, tokens (branch / merge / answer)", "precisions", "device", "library digests (first 12 hex)"]
    return table(["", f"`{t.a.profile}`", f"`{t.b.profile}`", "the paper"],
                 [[label, x, y, z] for label, x, y, z in zip(labels, col(t.a), col(t.b), paper)])


def _model_name(s: Side) -> str:
    return str(s.model.get("file") or s.model.get("model") or "?")


def render(t: FamilyTable, reference: dict) -> list[str]:
    """The table's markdown lines: both sides, then every endpoint beside the paper's (no heading)."""
    rows = [[r.endpoint, cell_text(r.paper, "not reported"), cell_text(r.a), cell_text(r.b)] for r in t.rows]
    return [sides_table(t, reference), "",
            table(["endpoint", f"the paper ({reference['setup']['model_short']})",
                   f"`{t.a.profile}` ({_model_name(t.a)})", f"`{t.b.profile}` ({_model_name(t.b)})"], rows), "",
            "Brackets hold Wilson 95% intervals in percent. A drift is a row's relative L2 over the named layers' K "
            "and V tensors, median over rows; — marks what a profile has not got (a precision, a layer kind, a way its "
            "precondition rule does not report). Experiments 3-5 run on panels each profile draws from its own rows.", ""]


def families_section(f: Families | None, reference: dict) -> list[str]:
    """The results page's "Across model families" section: nothing when ``f`` is None, one line without a table."""
    if f is None:
        return []
    head = ["## Across model families", ""]
    if f.table is None:
        return head + [f"The `{f.first}` profile's chain is not complete, so its model is not set beside this one yet: "
                       f"the table appears once `data/ledgers/{f.first}/` holds it (`make paper PROFILE={f.first}`).", ""]
    return head + [
        f"The same problems (IDs and content) in two profiles, one model family each: `{f.first}` "
        f"([results-{f.first}.md](results-{f.first}.md)) and this one. Every cell is recomputed from each profile's "
        f"ledgers by the experiments' summary functions (`{TOOL} {f.first} {f.second}`); the paper's come from "
        "`data/paper/reference.yaml`.", "", *render(f.table, reference)]


def main(argv: list[str] | None = None) -> int:
    """Print the cross-family section of two profiles. Exit status: 0 printed; 2 a chain is missing or the problems
    differ (named)."""
    ap = argparse.ArgumentParser(prog=TOOL, description=__doc__.split("\n\n")[0])
    ap.add_argument("first", help="a profile with a complete chain (e.g. paper: SmolLM2-135M)")
    ap.add_argument("second", help="another, on the same problems (e.g. gemma: Gemma 3 270M)")
    ap.add_argument("--ledger-root", type=Path, default=LEDGERS, help="folder holding <profile>/ ledger folders")
    args = ap.parse_args(argv)
    try:
        a, b = (profile_results(p, args.ledger_root, **profile_stats(p)) for p in (args.first, args.second))
        t = family_table(a, b)
    except (MissingLedgerError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(families_section(Families(args.first, args.second, t), b.reference)).rstrip("\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
