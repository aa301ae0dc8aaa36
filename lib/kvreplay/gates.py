"""Fail-closed integrity gates (paper §3.5–3.7 and Table 3).

Gates are conjunctive: every check must pass for a row's endpoints to be reported. Each gate is named once, in
:data:`GATES`, with what it checks and its paper section; a check raises :class:`GateError` naming the gate, the row
and the reason. Runners record the failure in the ledger and go on, or abort in preflight.
``python -m kvreplay.gates`` writes ``docs/gates.md`` from the registry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class Gate:
    """One integrity gate: its name, what it checks (one sentence), where it is checked, and its paper section."""
    name: str
    checks: str
    where: str
    section: str


GATES: Mapping[str, Gate] = {g.name: g for g in (
    Gate("nonfinite", "Every element of every boundary cache tensor and every step's logits is finite (no NaN, no "
         "infinity); checked before the duplicate and replica gates, since NaN never equals NaN.",
         "decoding.decode, engine.scheduler, gates.check_finite", "§3.5"),
    Gate("desync", "The two physical duplicate rows of a problem hold bit-identical logits after every model call "
         "and bit-identical boundary caches.", "decoding.decode, engine.scheduler, gates.check_duplicates", "§3.5"),
    Gate("replica", "A replica equals its source in tensor inventory, geometry (shape, stride, dtype, device, "
         "inference status) and every bit.", "decoding.caches.verify_replica", "§3.5"),
    Gate("storage", "Every compared cache or logit tensor uses storage no other arm's tensor uses.",
         "gates.check_disjoint", "§3.5"),
    Gate("functional_state", "All arms share token IDs, roles, the position IDs passed to the model, sliding "
         "windows and cache lengths; the engine's padding beyond a row's valid length is untouched.",
         "gates.check_functional_state, engine.step, decoding.caches.verify_transplant, experiments.matrix, runner.equivalence", "§3.5"),
    Gate("dtype", "Every boundary tensor has the run's dtype.", "gates.check_dtype, decoding.caches", "§3.5, Table 3"),
    Gate("equivalence", "Two constructions of one boundary, computed in float32, differ by no more than rounding "
         "(whole-cache relative L2 at most 1e-4).", "gates.check_equivalence, experiments.matrix, runner.equivalence, runner.row_checks, runner.loop", "§3.5"),
    Gate("suffix_replica", "A replica's greedy suffix equals its source's suffix token for token.",
         "experiments.matrix, .bridge, .transplant", "§3.5"),
    Gate("readout", "Building the float32 readout leaves the boundary caches bit-identical to the plain build.",
         "experiments.controls", "§3.5"),
    Gate("argmax", "Before a transplant, the raw next-token argmax already agrees between the two constructions.",
         "experiments.transplant, .replication", "§3.8"),
    Gate("provenance", "A row is computed from the inputs its ledger key names: the prefix bank, role table, "
         "format and transplanted layers, checked by digest.", "decoding.caches, ledger.prefix_bank, experiments.fixed_prefix, runner.arms, verify, report.rebuild",
         "§3.8, §3.9"),
    Gate("preflight", "The first rows of an arm pass every gate; a failing preflight row aborts the arm before any "
         "other row runs.", "ledger.store.run_rows", "§3.5"),
    Gate("report", "No endpoint is reported from a set of rows that holds a gate failure or lacks what the "
         "endpoint needs.", "experiments, ledger.prefix_bank", "§3.4"),
    Gate("live_equals_incremental", "A live boundary equals its teacher-forced incremental rebuild bit for bit.",
         "gates.check_live_equals_incremental", "§3.6"),
    Gate("composition", "A problem decoded twice at the arm's batch shape, beside different companions, gives one "
         "record byte for byte: a new arm's first problem again as the last job of its first chunk; a resumed arm's "
         "committed row alone, in a chunk of one, against its line.", "runner.batched", "§3.9"),
    Gate("graph_equals_eager", "The CUDA-graph step writes the same logits and keys/values as the eager step (the "
         "first 32 steps of every engine of an arm's first chunk, re-run eagerly).", "engine.step", "§3.9"),
    Gate("attention_tolerance", "The engine's attention stays within its tolerance of the math-SDPA reference on "
         "a step that holds a boundary.", "engine.step, runner.batched", "§3.9"),
)}
"""Every integrity gate by name; :class:`GateError` refuses any other name."""


class GateError(RuntimeError):
    """An integrity gate failed.

    Attributes:
        gate: the gate's name, a key of :data:`GATES`.
        reason: what differed, and where.

    Raises:
        ValueError: on construction, a gate name :data:`GATES` does not register.
    """
    def __init__(self, gate: str, reason: str):
        if gate not in GATES:
            raise ValueError(f"unregistered gate {gate!r}; kvreplay.gates.GATES names {', '.join(GATES)}")
        super().__init__(f"gate {gate!r} failed: {reason}")
        self.gate = gate
        self.reason = reason

    def __reduce__(self):  # picklable with its two arguments (rows computed in Ray actors raise it across processes)
        return type(self), (self.gate, self.reason)


def gates_markdown() -> str:
    """``docs/gates.md``: every gate of :data:`GATES` as a table (name, what it checks, where, paper section)."""
    lines = ["# Integrity gates", "",
             "Generated from `kvreplay.gates.GATES` by `python -m kvreplay.gates` (a test checks it is current).",
             "Every check is conjunctive and fails closed: a row that fails one is recorded with the gate's name and",
             "the reason, and reports no endpoint; a failing preflight row aborts its arm.", "",
             "| gate | what it checks | checked in | paper |", "|---|---|---|---|"]
    lines += [f"| `{g.name}` | {g.checks} | {g.where} | {g.section} |" for g in GATES.values()]
    return "\n".join(lines) + "\n" + EQUIVALENCE_SAMPLE_DOC


EQUIVALENCE_SAMPLE_DOC = """
## Which rows get the float32 `equivalence` check

A float32 run checks every row from its own comparison. A run below float32 checks, in float32, the
incremental rebuild of each preflight row's boundary prefix against its prefill, and records the result in
that row (`equivalence`). `preflight: 0` is refused below float32, by the profile and by the library
(`Arm.run`), so no run skips it. The same check also runs, in the process that loads the model, on a
sample of every chunk's other rows: a chunk is the engine's chunk in a batched run, or 8 consecutive rows
in an eager one. The sample holds 2 rows per 32 rows of the chunk, rounded up, and at least 2 (a chunk of
up to 32 rows: 2; of 200 rows: 13): the chunk's longest boundary prefix (ties: the smaller problem ID),
then the others in the order of sha256(`"construction_equivalence:<problem_id>"`). Only rows with a
`prefix` and no gate failure are drawn (`kvreplay.runner.row_checks.equivalence_sample`); the draw reads no
outcome of the rows. In a batched run the sampled prefixes are rebuilt in float32 together, in one engine
call of 16 slots (idle slots stay empty; more prefixes refill them), one fixed shape for every arm, so a
process compiles or captures it once; each prefill is built alone. At that fixed shape a row's result does
not depend on the rows beside it.

The check's record lives in the ledger folder's run log, which sealing and packing keep. Before the first
row of a chunk is appended, an `equivalence_pending` event names the chunk's rows; after the check, an
`equivalence_sample` event names them again (`rows`) with `passed` and each checked row's `prefix_len`,
`rel_l2` (or `error`) and seconds. Nothing goes into a row, so rows stay byte-identical. A row counts as
clean only once a passing check names it:

- a failed check stops the arm after its chunk's rows were appended. Every reader (the lookup the notebooks
  and the explorer use, the tables, `make verify`) refuses those rows, naming the file, the line and why,
  and the arm refuses that ledger before any model is loaded: delete the folder and run it again once the
  construction is fixed;
- rows whose check never ran (a kill, Ctrl-C or crash between the append and the check) are refused the
  same way and not counted as finished; the arm's next run checks them, in chunks of the same size, before
  it computes any new row (a failure then stops it as above);
- rows below float32 that no check covers (written by a library without the sampled check, or on Ray row
  actors, which do not take the sample) stay readable; every reader labels them `sampled check not run
  (library <digest12>)` (`LoadedLedger.unchecked`), or `sampled check ran, its rows not recorded (library
  <digest12>)` where a library logged passing checks without naming the rows each covered.
  `python -m kvreplay.ledger digests data/ledgers/<profile>` counts them per folder.

Cost, counted in model calls, not timed: a check replays the row's live call schedule and makes one prefill
call, in float32 (`schedule_calls + 1` calls). On the committed `cpu` profile's Experiment 1 BF16 rows (the
14 after its 2 preflight rows, eager, chunks of 8 and 6), the sample adds 1,010 float32 calls to the rows'
12,276 calls (live schedule, its live check, four suffixes, two prefill calls): 8 % (7.5 % and 9.2 % per
chunk). It reuses the float32 copy of the model made for the preflight rows (the weights once more in memory).
"""


def cache_tensors(cache) -> list[tuple[str, torch.Tensor]]:
    """Inventory of a ``DynamicCache``: ``[("L00.key", [b, kv_heads, seq, head_dim]), ("L00.value", ...), ...]``."""
    out = []
    for i, layer in enumerate(cache.layers):
        out.append((f"L{i:02d}.key", layer.keys))
        out.append((f"L{i:02d}.value", layer.values))
    return out


def geometry(t: torch.Tensor) -> dict:
    """Recorded geometry of a tensor: shape, stride, dtype, device, inference-tensor status."""
    return {
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "dtype": str(t.dtype).replace("torch.", ""),
        "device": str(t.device),
        "inference": bool(t.is_inference()),
    }


def storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    """Data pointers of the untyped storages behind the tensors."""
    return {t.untyped_storage().data_ptr() for t in tensors}


def check_disjoint(groups: dict[str, Sequence[torch.Tensor]]) -> None:
    """Every named group of tensors must use storage no other group uses.

    Raises:
        GateError: gate ``storage``, naming the two groups that share storage.
    """
    seen: dict[int, str] = {}
    for name, tensors in groups.items():
        for ptr in storages(tensors):
            if ptr in seen and seen[ptr] != name:
                raise GateError("storage", f"{name} aliases storage of {seen[ptr]}")
            seen[ptr] = name


def check_exact(name: str, a: Sequence[tuple[str, torch.Tensor]], b: Sequence[tuple[str, torch.Tensor]], gate: str = "replica") -> None:
    """Two tensor inventories must be identical in names, geometry and every bit.

    Raises:
        GateError: naming the first tensor whose inventory, geometry or values differ.
    """
    names_a, names_b = [n for n, _ in a], [n for n, _ in b]
    if names_a != names_b:
        raise GateError(gate, f"{name}: tensor inventories differ ({len(names_a)} vs {len(names_b)} tensors)")
    for (n, x), (_, y) in zip(a, b):
        gx, gy = geometry(x), geometry(y)
        if gx != gy:
            raise GateError(gate, f"{name}: {n} geometry differs: {gx} vs {gy}")
        if not torch.equal(x, y):
            raise GateError(gate, f"{name}: {n} values differ")


def check_duplicates(name: str, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Rows 0 and 1 (the physical duplicates) must be bit-identical in every tensor.

    Raises:
        GateError: gate ``desync``.
    """
    for n, t in tensors:
        if not torch.equal(t[0], t[1]):
            raise GateError("desync", f"{name}: duplicate rows of {n} differ")


def check_finite(name: str, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Every element of every tensor must be finite (no NaN, no infinity).

    Checked before the duplicate and replica gates: NaN never equals NaN, so a
    NaN state would otherwise be misreported as a desync.

    Raises:
        GateError: gate ``nonfinite``, naming the arm and the first tensor.
    """
    for n, t in tensors:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise GateError("nonfinite", f"{name}: {n} holds NaN or infinite values")


EQUIVALENCE_TOLERANCE = 1e-4
"""Largest whole-cache relative L2 allowed between two constructions computed in float32.

Two constructions of the same boundary (live or incremental, and prefill)
compute the same function; in float32 they differ only by rounding. Measured
on the embedded SmolLM2-135M over 56 committed rows (2-core CPU and H200):
3.6e-7 to 9.4e-7; on the tiny random-weight test models up to about 1e-5.
BF16 drift between constructions is about 8e-3, and a construction that
passes wrong position IDs to one call gives about 0.25. A tolerance of 1e-4
sits 100 times above the largest measured rounding drift and 2,000 times
below such a fault.
"""


def check_equivalence(name: str, rel_l2: float, tolerance: float = EQUIVALENCE_TOLERANCE) -> None:
    """Construction-equivalence gate: float32 drift between two constructions must be rounding-sized.

    Args:
        name: what was compared (e.g. ``"prefill vs live (float32)"``).
        rel_l2: whole-cache relative L2 of the difference (:func:`kvreplay.analysis.drift.aggregate`), float32 states.
        tolerance: see :data:`EQUIVALENCE_TOLERANCE`.

    Raises:
        GateError: gate ``equivalence`` when ``rel_l2`` exceeds the tolerance or is not finite.
    """
    if not rel_l2 <= tolerance:
        raise GateError("equivalence", f"{name}: whole-cache relative L2 {rel_l2:.3g} exceeds the float32 tolerance "
                        f"{tolerance:g}; the constructions do not compute the same function (a construction bug, not "
                        f"precision)")


def check_identical(gate: str, name: str, a: Sequence[tuple[str, torch.Tensor]],
                    b: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Two tensor inventories must hold the same names, shapes, dtypes and bits (strides and storage may differ).

    Args:
        gate: the gate's name to raise under.
        name: what was compared, for the message.
        a, b: ``[(name, tensor), ...]`` in the same order (e.g. :func:`cache_tensors` plus the logits).

    Raises:
        GateError: ``gate``, naming the first tensor that differs: its shape or dtype, or how many
            elements differ and the largest absolute difference (float32 units of the values).
    """
    names_a, names_b = [n for n, _ in a], [n for n, _ in b]
    if names_a != names_b:
        raise GateError(gate, f"{name}: tensor inventories differ ({len(names_a)} vs {len(names_b)} tensors)")
    for (n, x), (_, y) in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype:
            raise GateError(gate, f"{name}: {n} is {list(x.shape)} {x.dtype} vs {list(y.shape)} {y.dtype}")
        if not torch.equal(x, y):
            diff = (x.float() - y.float()).abs()
            raise GateError(gate, f"{name}: {n} differs in {int((x != y).sum())} of {x.numel()} elements "
                            f"(largest |difference| {float(diff.max()):.3g})")


def check_live_equals_incremental(live: Any, incremental: Any, where: str = "") -> None:
    """Live-construction gate: the live boundary equals its teacher-forced incremental rebuild bit for bit (paper §3.6).

    Incremental replays the live call schedule from the live token IDs, so a
    correct live decoder gives the same bits (Experiment 3's bridge). A live
    decoder that computes another function (e.g. a dropped 4-D mask) does not.

    Args:
        live, incremental: boundary states (:class:`~kvreplay.decoding.decode.Boundary`) of one prefix z at the
            run's dtype: caches ``[2, kv_heads, |z|, head_dim]`` and logits ``[2, vocab]``.
        where: the row, for the message (e.g. its problem ID).

    Raises:
        GateError: gate ``live_equals_incremental`` naming the first cache tensor (or the logits) that differs.
    """
    if list(live.ids) != list(incremental.ids):
        raise GateError("live_equals_incremental", f"{where}: the rebuild's token IDs differ from live's")
    check_identical("live_equals_incremental", f"{where} live vs its incremental rebuild",
                    [*cache_tensors(live.cache), ("boundary logits", live.logits)],
                    [*cache_tensors(incremental.cache), ("boundary logits", incremental.logits)])


def check_dtype(name: str, tensors: Sequence[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
    """Every tensor must have the run's dtype.

    Raises:
        GateError: gate ``dtype``.
    """
    for n, t in tensors:
        if t.dtype != dtype:
            raise GateError("dtype", f"{name}: {n} is {t.dtype}, expected {dtype}")


def check_functional_state(states: Mapping[str, Any]) -> None:
    """All arms share token IDs, roles, the position IDs actually passed to the model, windows, and cache lengths.

    There is no padding in the duplicate design: every token is valid, which
    the cache-length check (every layer holds exactly |z| positions) confirms.
    The batched engine's static cache pads every row to ``max_len``; its
    boundaries are copied out at their valid length, and each row's valid
    length is checked in place by :meth:`kvreplay.engine.StepEngine.check_valid_length`
    (roles and untouched zero keys/values beyond it).

    Args:
        states: arm name -> :class:`~kvreplay.decoding.decode.Boundary`.

    Raises:
        GateError: gate ``functional_state``, naming the arm and the field.
    """
    items = list(states.items())
    ref_name, ref = items[0]
    for name, s in items[1:]:
        if s.ids != ref.ids:
            raise GateError("functional_state", f"{name}: token IDs differ from {ref_name}")
        if s.roles.shape != ref.roles.shape or not torch.equal(s.roles, ref.roles):
            raise GateError("functional_state", f"{name}: role array differs from {ref_name}")
        if s.positions.shape != ref.positions.shape or not torch.equal(s.positions, ref.positions):
            raise GateError("functional_state", f"{name}: position IDs passed to the model differ from {ref_name}")
        if getattr(s, "windows", None) != getattr(ref, "windows", None):
            raise GateError("functional_state", f"{name}: sliding windows per layer differ from {ref_name}")
        for n, t in cache_tensors(s.cache):
            if t.shape[-2] != len(s.ids):
                raise GateError("functional_state", f"{name}: {n} holds {t.shape[-2]} positions, prefix has {len(s.ids)}")


def check_equal_sequences(gate: str, name: str, a: Sequence[int], b: Sequence[int]) -> None:
    """Two token sequences must be identical (suffix replicas, prefix identity).

    Raises:
        GateError: with the first differing index.
    """
    if list(a) != list(b):
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        raise GateError(gate, f"{name}: sequences differ at index {i} (lengths {len(a)}, {len(b)})")


if __name__ == "__main__":
    out = Path(__file__).resolve().parents[2] / "docs" / "gates.md"
    out.write_text(gates_markdown())
    print(f"wrote {out}")
