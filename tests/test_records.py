"""kvreplay.ledger.records: every committed ledger row fits its typed record, and the check refuses what it should."""

from __future__ import annotations

import copy
import functools
import json
import math
from pathlib import Path

import pytest
import typing_extensions
from kvreplay.experiments.matrix import gate_failure
from kvreplay.gates import GateError
from kvreplay.ledger import records, row_parts
from kvreplay.ledger.lookup import finished_rows
from kvreplay.ledger.records import (
    FAILED_ROW_TYPES,
    ROW_TYPES,
    RowSchemaError,
    experiment_of,
    validate_row,
    validate_rows,
)
from kvreplay.ledger.store import canonical_json
from kvreplay.runner import ROW_ALGORITHM

ROOT = Path(__file__).resolve().parents[1]
LEDGERS = sorted(p for p in (ROOT / "data" / "ledgers").glob("*/*") if (p / "manifest.json").is_file())


@functools.cache
def _rows(folder: Path) -> tuple[dict, ...]:
    return tuple(finished_rows(folder))


def a_row(experiment: str) -> dict:
    """A fresh copy of the first committed row of ``experiment`` (the cpu ledgers sort first and are small)."""
    folder = next(p for p in LEDGERS if experiment_of(p.name) == experiment)
    return copy.deepcopy(_rows(folder)[0])


# ----------------------------------------------------------------------------- the committed ledgers


@pytest.mark.parametrize("folder", LEDGERS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_committed_row_fits_its_record(folder):
    rows = list(_rows(folder))
    assert rows, f"{folder} has no rows"
    assert validate_rows(experiment_of(folder.name), rows) == rows


def test_every_row_kind_has_committed_ledgers_and_a_record():
    committed = {experiment_of(p.name) for p in LEDGERS}
    # the tie-rule control (exp1_ties) is exploratory: a profile computes it only when its tie_rules lists a rule;
    # the kernel attribution (exp2_kernels, Experiment 2's record) runs in notebook 09, off make paper's chain
    assert set(ROW_TYPES) - {"exp1_ties", "exp2_kernels"} <= committed <= set(ROW_TYPES)
    assert set(FAILED_ROW_TYPES) == set(ROW_TYPES) - {"adapt_eval"}  # the checkpoint metric has no gates


def test_the_schema_describes_the_current_row_algorithms():
    """An experiment's row-algorithm version and its record are declared side by side (kvreplay.arm_facts), so a
    bump (a change to what rows record) is made beside the record's name; each named record exists."""
    from kvreplay.arm_facts import ARM_FACTS

    assert set(ROW_ALGORITHM) == set(ROW_TYPES) == set(ARM_FACTS)
    assert all(ROW_TYPES[e].__name__ == f.record for e, f in ARM_FACTS.items())


def test_every_record_is_strict_and_closed():
    typed = {name: t for name, t in vars(records).items()
             if typing_extensions.is_typeddict(t)  # not pydantic's ConfigDict
             and t.__module__ in (records.__name__, row_parts.__name__)}  # the rows and their parts
    assert len(typed) > 30
    assert set(ROW_TYPES.values()) | set(FAILED_ROW_TYPES.values()) <= set(typed.values())
    for name, t in typed.items():
        config = getattr(t, "__pydantic_config__", None)
        assert config is not None and config.get("extra") == "forbid" and config.get("strict") is True, name


def test_failed_records_mirror_their_passed_records():
    """A gate-failed row keeps fields of the passed row's layout; only ``gate_failure`` (and Experiment 4/5's
    partial interventions) differ."""
    for experiment, failed in FAILED_ROW_TYPES.items():
        passed = typing_extensions.get_type_hints(ROW_TYPES[experiment])
        mine = typing_extensions.get_type_hints(failed)
        assert set(mine) <= set(passed), experiment
        assert {k for k in mine if mine[k] != passed[k]} <= {"gate_failure", "interventions"}, experiment


# ----------------------------------------------------------------------------- what the check refuses


def _margin_step(r: dict) -> int:
    return next(i for i, m in enumerate(r["arms"]["live"]["margins"]) if m is not None)


def _set(path: str, value):
    """A mutation setting the value at a dotted path (``[i]`` for a list index)."""
    def mutate(r):
        *parents, last = path.replace("[", ".[").split(".")
        node = r
        for p in parents:
            node = node[int(p[1:-1])] if p.startswith("[") else node[p]
        if last.startswith("["):
            node[int(last[1:-1])] = value
        else:
            node[last] = value
    return mutate


def _delete(path: str):
    def mutate(r):
        *parents, last = path.split(".")
        node = r
        for p in parents:
            node = node[p]
        del node[last]
    return mutate


BAD = [
    # (experiment, what, mutation, path of the first error, words in its message)
    ("exp1", "missing key", _delete("arms.live.correct"), "arms.live.correct", "Field required"),
    ("exp1", "missing top-level key", _delete("schedule_calls"), "schedule_calls", "Field required"),
    ("exp2", "missing key in a tensor", _delete("boundary.prefill_vs_incremental.cache.numel"),
     "boundary.prefill_vs_incremental.cache.numel", "Field required"),
    ("exp1", "extra key", _set("endpoints.surprise", True), "endpoints.surprise", "Extra inputs"),
    ("exp1", "extra top-level key", _set("seconds", 1.5), "seconds", "Extra inputs"),
    ("exp1", "extra key in a geometry", _set("boundary.prefill_vs_live.tensors[0].ref_geometry.contiguous", True),
     "boundary.prefill_vs_live.tensors[0].ref_geometry.contiguous", "Extra inputs"),
    ("exp1", "bool for an int", _set("prefix_len", True), "prefix_len", "valid integer"),
    ("exp2", "bool for a token ID", _set("first_token.prefill", False), "first_token.prefill", "valid integer"),
    ("exp3", "bool for a count", _set("endpoints.layers", True), "endpoints.layers", "valid integer"),
    ("exp1", "float for an int", _set("boundary.prefill_vs_live.tensors[2].n_diff", 3.0),
     "boundary.prefill_vs_live.tensors[2].n_diff", "valid integer"),
    ("exp1", "None for an int", _set("prompt_len", None), "prompt_len", "valid integer"),
    ("exp1", "int for a bool", _set("arms.prefill.correct", 1), "arms.prefill.correct", "valid boolean"),
    ("exp2_controls", "int for a bool", _set("null_perturbation.moved", 0), "null_perturbation.moved", "valid boolean"),
    ("exp1", "string in a list of ints", _set("prefix[5]", "5"), "prefix[5]", "valid integer"),
    ("exp2", "string in a suffix", _set("arms.incremental.suffix[0]", "x"), "arms.incremental.suffix[0]",
     "valid integer"),
    ("exp4", "bool in a list of layers", _set("interventions.whole.layers[0]", True), "interventions.whole.layers[0]",
     "valid integer"),
    ("exp1", "int for a float", _set("boundary.prefill_vs_live.cache.rel_l2", 0),
     "boundary.prefill_vs_live.cache.rel_l2", "float, not int"),
    ("adapt_eval", "int for a logit", _set("checkpoints.ckpt0.logits.A", 3), "checkpoints.ckpt0.logits.A",
     "float, not int"),
    ("exp1", "string for a float", _set("boundary.live_replica.logits.margin_ref", "0.5"),
     "boundary.live_replica.logits.margin_ref", "valid number"),
    ("exp1", "rule outside the matcher's", _set("arms.live.rule", "letter"), "arms.live.rule", "'answer_is'"),
    ("exp4", "unknown outcome", _set("interventions.whole.prefill<-incremental.outcome", "follows"),
     "interventions.whole.prefill<-incremental.outcome", "'donor'"),
    ("exp5", "stratum of another experiment", _set("stratum", "divergent"), "stratum", "'panel'"),
    ("exp5", "extra key in a score", _set("scores.prefill.suffix", [1, 2]), "scores.prefill.suffix", "Extra inputs"),
    ("exp5", "an exploratory intervention", _set("interventions.keys_only", {}), "interventions.keys_only",
     "Extra inputs"),
    ("exp4", "a passed row with a direction missing", _delete("interventions.whole.incremental<-prefill"),
     "interventions.whole.incremental<-prefill", "Field required"),
    ("exp1", "a row of row-algorithm version 1", _delete("endpoints.tie_initiated"), "endpoints.tie_initiated",
     "Field required"),
    ("adapt_eval", "a gate failure where there are no gates", _set("gate_failure", {"gate": "x", "reason": "y"}),
     "gate_failure", "None"),
]


@pytest.mark.parametrize("experiment, what, mutate, path, words", BAD, ids=[f"{b[0]}: {b[1]}" for b in BAD])
def test_a_row_that_does_not_fit_is_refused_by_path_and_problem(experiment, what, mutate, path, words):
    row = a_row(experiment)
    validate_row(experiment, row)  # fits before the mutation
    mutate(row)
    with pytest.raises(RowSchemaError) as info:
        validate_row(experiment, row)
    e = info.value
    assert (e.experiment, e.problem_id, e.path) == (experiment, row["problem_id"], path)
    message = str(e)
    assert message.startswith(f"{experiment} ledger, problem_id {row['problem_id']!r}, as ")
    assert f": {path}: " in message and words in message, message
    assert isinstance(e, ValueError)


def test_a_bad_intervention_name_is_refused():
    row = a_row("exp4")
    row["interventions"]["layer_x"] = copy.deepcopy(row["interventions"]["whole"])
    with pytest.raises(RowSchemaError, match=r"interventions\.layer_x\.\[key\]: String should match pattern"):
        validate_row("exp4", row)
    row["interventions"]["layer_07"] = row["interventions"].pop("layer_x")  # the sweep's names are fine
    validate_row("exp4", row)


def test_a_row_without_problem_id_or_not_a_dict():
    row = a_row("exp2_controls")
    del row["problem_id"]
    with pytest.raises(RowSchemaError, match=r"a row without problem_id, as ControlsRow: problem_id: Field required"):
        validate_row("exp2_controls", row)
    with pytest.raises(RowSchemaError, match=r"<row>: Input should be a valid dictionary"):
        validate_row("exp1", [1, 2])  # type: ignore[arg-type]


def test_an_unknown_experiment_is_not_a_schema_error():
    with pytest.raises(ValueError, match="unknown experiment 'exp9'") as info:
        validate_row("exp9", {})
    assert not isinstance(info.value, RowSchemaError)


# ----------------------------------------------------------------------------- gate-failed rows


FAILURE = gate_failure(GateError("desync", "planted"))  # the field as the experiments write it
MATRIX_STAGES = [("prompt_len", "prefix_len", "prefix", "schedule_calls"), ("boundary",),
                 ("equivalence", "first_token", "raw_argmax")]
STAGES = {
    # experiment: (keys set when the row is made, the stages a gate can stop after, keys only a passed row has)
    "exp1": (("problem_id",), MATRIX_STAGES, ("arms", "endpoints")),
    "exp2": (("problem_id",), MATRIX_STAGES, ("arms", "endpoints")),
    "exp2_controls": (("problem_id", "prefix_len"), [], ("baseline", "fp32_readout", "null_perturbation")),
    "exp3": (("problem_id",), [("prefix_len", "prefix", "saved_prefix_len", "same_as_saved"), ("equivalence",)],
             ("boundary", "arms", "endpoints")),
    "exp4": (("problem_id", "stratum"), [("prefix_len", "prefix"), ("equivalence",), ("baseline",)], ()),
    "exp5": (("problem_id", "stratum"), [("prefix_len", "prefix"), ("equivalence",), ("baseline",)], ("scores",)),
}


@pytest.mark.parametrize("experiment", sorted(STAGES))
def test_gate_failed_rows_keep_the_stages_they_finished(experiment):
    full = a_row(experiment)
    head, stages, never = STAGES[experiment]
    keys = list(head)
    for stage in [(), *stages]:
        keys += stage
        row = {k: full[k] for k in keys} | {"gate_failure": FAILURE}
        assert validate_row(experiment, row) is row
    for key in never:  # fields only a row that passed every gate has
        row = {k: full[k] for k in keys} | {"gate_failure": FAILURE, key: full[key]}
        with pytest.raises(RowSchemaError, match=rf"as {FAILED_ROW_TYPES[experiment].__name__}: {key}: Extra inputs"):
            validate_row(experiment, row)
    with pytest.raises(RowSchemaError, match=r"gate_failure\.reason: Field required"):
        validate_row(experiment, {k: full[k] for k in head} | {"gate_failure": {"gate": "desync"}})
    with pytest.raises(RowSchemaError, match=r"gate_failure: Input should be a valid dictionary"):  # or None
        validate_row(experiment, full | {"gate_failure": False})


@pytest.mark.parametrize("experiment", ["exp4", "exp5"])
def test_a_transplant_row_stopped_between_directions(experiment):
    """Row by row (``transplant_row``), a gate in the second direction's transplant leaves the first one recorded."""
    full = a_row(experiment)
    whole = {k: v for k, v in full["interventions"]["whole"].items() if k != "incremental<-prefill"}
    row = {k: full[k] for k in ("problem_id", "stratum", "prefix_len", "prefix", "equivalence", "baseline")}
    row |= {"gate_failure": FAILURE, "interventions": {"whole": whole}}
    validate_row(experiment, row)
    del whole["prefill<-incremental"]  # the first direction's decoding failed
    validate_row(experiment, row)
    row["gate_failure"] = None  # a passed row needs both directions and its other fields
    with pytest.raises(RowSchemaError):
        validate_row(experiment, row)


def test_the_planted_gate_failure_of_the_assembly_test_fits():
    """tests/test_assembly.py plants an Experiment 1 row of this shape."""
    full = a_row("exp1")
    validate_row("exp1", {"problem_id": full["problem_id"], "gate_failure": {"gate": "desync", "reason": "planted"},
                          "prefix": full["prefix"]})


# ----------------------------------------------------------------------------- what the check gives back


def test_validate_row_returns_the_row_itself_unchanged():
    row = a_row("exp1")
    before = canonical_json(row)
    assert validate_row("exp1", row) is row
    assert canonical_json(row) == before
    rows = [a_row("exp4"), a_row("exp4")]
    out = validate_rows("exp4", rows)
    assert out == rows and all(a is b for a, b in zip(out, rows))


def test_nan_and_infinity_are_floats():
    """The writers' JSON allows NaN and Infinity (e.g. rel_l2 of a tensor whose reference is all zeros)."""
    row = a_row("exp1")
    row["boundary"]["prefill_vs_live"]["tensors"][0]["rel_l2"] = math.inf
    row["arms"]["live"]["margins"][_margin_step(row)] = math.nan
    text = canonical_json(row)
    assert "Infinity" in text and "NaN" in text
    back = json.loads(text)
    assert validate_row("exp1", back) is back


@pytest.mark.parametrize("name, experiment", [
    ("exp2_controls-bfloat16-2057f13994a1", "exp2_controls"),
    ("adapt_eval-float32-05b7a9d7a4eb", "adapt_eval"),
    ("exp1-float32-7477e5d43f62", "exp1"),
    (Path("data/ledgers/gpu/exp5-bfloat16-27e296beeb3c"), "exp5"),
])
def test_experiment_of_a_ledger_folder(name, experiment):
    assert experiment_of(name) == experiment


@pytest.mark.parametrize("name", ["prefix_bank_bf16.jsonl", "exp1-bfloat16", "exp9-bfloat16-2057f13994a1",
                                  "exp4_panel.json", "Exp1-bfloat16-2057f13994a1"])
def test_experiment_of_refuses_other_names(name):
    with pytest.raises(ValueError):
        experiment_of(name)


def test_row_functions_return_the_schema_layouts():
    """Each experiment's per-row and per-chunk functions are annotated with its two layouts (passed, failed), and
    its summary reads them: the schema here is the type the lib writes and reads, not a second description."""
    import types
    import typing

    from kvreplay import adapt
    from kvreplay.experiments import bridge, controls, fixed_prefix, live_vs_prefill, replication, transplant

    functions = {"exp1": (live_vs_prefill.live_vs_prefill_row, live_vs_prefill.live_vs_prefill_chunk, None),
                 # the tie-rule control: Experiment 1's own functions under another rule
                 "exp1_ties": (live_vs_prefill.live_vs_prefill_row, live_vs_prefill.live_vs_prefill_chunk, None),
                 # the manipulated-length arm: Experiment 1's own functions at another branch cap
                 "exp1_length": (live_vs_prefill.live_vs_prefill_row, live_vs_prefill.live_vs_prefill_chunk, None),
                 "exp2": (fixed_prefix.fixed_prefix_row, fixed_prefix.fixed_prefix_chunk, None),
                 "exp2_controls": (controls.controls_row, controls.controls_chunk, controls.controls_summary),
                 "exp3": (bridge.bridge_row, bridge.bridge_chunk, bridge.bridge_summary),
                 "exp4": (transplant.transplant_row, transplant.transplant_chunk, transplant.transplant_summary),
                 "exp5": (replication.replication_row, replication.replication_chunk, replication.replication_summary),
                 # the kernel attribution: Experiment 2's own functions under another kernels value
                 "exp2_kernels": (fixed_prefix.fixed_prefix_row, fixed_prefix.fixed_prefix_chunk, None)}
    assert set(functions) | {"adapt_eval"} == set(ROW_TYPES)
    for experiment, (row, chunk, summary) in functions.items():
        layouts = {ROW_TYPES[experiment], FAILED_ROW_TYPES[experiment]}
        assert set(typing.get_args(typing.get_type_hints(row)["return"])) == layouts, experiment
        (item,) = typing.get_args(typing.get_type_hints(chunk)["return"])  # list[...]
        assert set(typing.get_args(item)) == layouts, experiment
        if summary is not None:  # Sequence[...], or (Experiment 4's, which also reads Experiment 5's) a union of them
            hint = typing.get_type_hints(summary)["records"]
            items = [typing.get_args(s)[0] for s in typing.get_args(hint)] if typing.get_origin(hint) in (
                typing.Union, types.UnionType) else list(typing.get_args(hint))
            assert layouts in [set(typing.get_args(item)) for item in items], experiment
    assert typing.get_type_hints(adapt.letter_row)["return"] is ROW_TYPES["adapt_eval"]


def test_the_typed_overloads_agree_with_the_schema():
    """validate_rows, require_gates and ProfileLedgers.records spell the experiment -> record map again as
    overloads (mypy cannot read it from ROW_TYPES): each overload must name the records ROW_TYPES and
    FAILED_ROW_TYPES give its experiment."""
    import typing

    from kvreplay.experiments.endpoints import require_gates
    from kvreplay.ledger.lookup import LEDGER_SPECS, ProfileLedgers
    from kvreplay.ledger.records import validate_rows

    def layouts(experiment):
        return {ROW_TYPES[experiment]} | ({FAILED_ROW_TYPES[experiment]} if experiment in FAILED_ROW_TYPES else set())

    def members(t):  # A | B -> {A, B}; A -> {A}
        return set(typing.get_args(t)) or {t}

    def returned(hints):  # list[A | B] -> {A, B}
        (item,) = typing.get_args(hints["return"])
        return members(item)

    literal = {}
    for f in typing.get_overloads(validate_rows):
        hints = typing.get_type_hints(f)
        if typing.get_origin(hints["experiment"]) is typing.Literal:
            (experiment,) = typing.get_args(hints["experiment"])
            literal[experiment] = returned(hints)
    assert literal == {e: layouts(e) for e in ROW_TYPES}

    typed = {}
    for f in typing.get_overloads(ProfileLedgers.records):
        hints = typing.get_type_hints(f)
        if typing.get_origin(hints["key"]) is typing.Literal:
            typed.update(dict.fromkeys(typing.get_args(hints["key"]), returned(hints)))
    assert typed == {k: layouts(s.experiment) for k, s in LEDGER_SPECS.items()}

    passed = {frozenset(members(typing.get_args(h["records"])[0])): returned(h)
              for h in map(typing.get_type_hints, typing.get_overloads(require_gates))}
    for experiment in ROW_TYPES:
        assert passed[frozenset(layouts(experiment))] == {ROW_TYPES[experiment]}, experiment
