"""The chain's parameters (kvreplay.notebook.profiles): one typed definition, the profiles that set them, bad input refused."""

from __future__ import annotations

import json

import pydantic
import pytest
import yaml
from kvreplay.paths import PARAMS
from kvreplay.notebook.profiles import (
    MIN_HELDOUT, PROFILE_KEYS, AdaptSelection, ChainParameters, base_of, describe, load_parameters,
    profile_path,
)
from kvreplay.runner import resolve_execution

from conftest import COMMITTED_PROFILES


def test_the_defaults_are_the_smoke_profile():
    """A notebook opened as is runs the smoke profile: the model's defaults cannot drift from smoke.yaml."""
    smoke = yaml.safe_load((PARAMS / "smoke.yaml").read_text())
    defaults = ChainParameters()
    dumped = defaults.model_dump(mode="json")
    for key, value in smoke.items():
        if key == "execution":  # the same contract: `{}` over the defaults is smoke's `threads: 2`
            assert defaults.contract == resolve_execution("smoke.yaml", value), key
        elif key == "adapt_selection":  # a typed block: the file's mapping, typed, is the default
            assert defaults.adapt_selection == AdaptSelection(**value), key
        else:
            assert dumped[key] == value, key
    assert load_parameters("smoke").contract == defaults.contract
    assert load_parameters("smoke").model_dump(exclude={"execution"}) == defaults.model_dump(exclude={"execution"})


def test_every_committed_profile_loads():
    assert set(COMMITTED_PROFILES) <= {p.stem for p in PARAMS.glob("*.yaml")}
    for path in (PARAMS / f"{name}.yaml" for name in COMMITTED_PROFILES):
        params = load_parameters(path.stem)
        assert params.profile == path.stem
        assert load_parameters(path) == params  # a path to the file gives the same
        assert set(yaml.safe_load(path.read_text())) - set(ChainParameters.model_fields) <= set(PROFILE_KEYS)


def test_overrides_replace_the_profiles_values():
    params = load_parameters("gpu", {"n_rows": 4, "execution": {"device": "cuda"}, "ledger_root": "/tmp/l"})
    assert (params.n_rows, params.execution, params.ledger_root) == (4, {"device": "cuda"}, "/tmp/l")
    assert params.cap_merge == 160 and params.profile == "gpu"
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        params.n_rows = 5  # resolved once: a notebook cannot change them on the way


def test_a_misspelled_override_is_refused_with_the_closest_name():
    with pytest.raises(ValueError, match=r"profile notebooks/params/cpu.yaml, overrides: 'n_row' \(did you mean 'n_rows'\?\) "
                                         r"is not a chain parameter"):
        load_parameters("cpu", {"n_row": 4})
    with pytest.raises(ValueError, match=r"'executon' \(did you mean 'execution'\?\)"):
        load_parameters("cpu", {"executon": {}})


def _profile(tmp_path, text: str):
    path = tmp_path / "mini.yaml"
    path.write_text(text)
    return path


def test_a_misspelled_profile_key_is_refused_with_the_closest_name(tmp_path):
    path = _profile(tmp_path, "profile: mini\nn_rows: 2\nexecuton:\n  device: cuda\nnotebooks: ['01']\ndone: {}\n")
    with pytest.raises(ValueError, match=rf"profile {path}: 'executon' \(did you mean 'execution'\?\) is not a chain parameter"):
        load_parameters(path)


@pytest.mark.parametrize("text, match", [
    ("threads: 4\nstep_path: graph\n", "threads, step_path belong to the execution contract: put them under `execution:`"),
    ("n_rows: '4'\n", r"n_rows: Input should be a valid integer, got '4'"),
    ("cap_branch: 0\n", r"cap_branch: Input should be greater than or equal to 1"),
    ("precisions: [float16]\n", r"precisions.0: Input should be 'bfloat16' or 'float32'"),
    ("execution:\n  step-path: graph\n", r"unknown execution key 'step-path' \(did you mean 'step_path'\?\)"),
    ("execution:\n  step_path: graph\n", r"step path 'graph' replays CUDA graphs: it needs device 'cuda'"),
    ("profile: other\n", r"its `profile: other` differs from the file's name 'mini'"),
    ("- n_rows\n", "expected a mapping"),
])
def test_bad_values_are_refused_naming_the_file(tmp_path, text, match):
    path = _profile(tmp_path, text)
    with pytest.raises(ValueError, match=match) as e:
        load_parameters(path)
    assert str(path) in str(e.value)


def test_an_unknown_profile_names_the_known_ones():
    """Every profile file there is, the committed ones and any of the user's own (README: "Audit your own model")."""
    with pytest.raises(FileNotFoundError, match=r"unknown profile 'nope'") as e:
        profile_path("nope")
    known = sorted(p.stem for p in PARAMS.glob("*.yaml"))
    assert f"profiles: {known}" in str(e.value) and {"cpu", "gpu", "paper", "smoke"} <= set(known)


MYMODEL = """profile: mymodel
model: /models/Qwen2.5-0.5B-Instruct
problems: bank
format: chat_multibranch
n_rows: 8
preflight: 2
cap_branch: 64
cap_merge: 160
cap_answer: 12
precisions: [bfloat16, float32]
execution:
  threads: 2
"""
"""A user's own profile that names no ``base:`` (README, "Audit your own model", writes ``base: own``): what it leaves
out comes from ``cpu``."""


def test_a_users_profile_takes_what_it_leaves_out_from_cpu_not_smoke(tmp_path, capsys):
    path = tmp_path / "mymodel.yaml"
    path.write_text(MYMODEL)
    params, cpu = load_parameters(path), load_parameters("cpu")
    assert (params.model, params.n_rows, params.cap_branch, params.profile) == ("/models/Qwen2.5-0.5B-Instruct", 8, 64, "mymodel")
    left_out = set(ChainParameters.model_fields) - set(yaml.safe_load(MYMODEL))
    assert {k: getattr(params, k) for k in left_out} == {k: getattr(cpu, k) for k in left_out}
    assert (params.adapt_steps, params.n_bridge, params.n_exp5) == (64, 6, 16)  # not smoke's 2, 1, 1
    assert params.adapt_selection == cpu.adapt_selection and params.adapt_selection.n_heldout >= MIN_HELDOUT
    assert base_of(path) == "cpu" and "the rest from base cpu" in describe(params, path)
    # an explicit base: any profile name or file, or the field defaults
    (tmp_path / "small.yaml").write_text("base: smoke\nmodel: /models/x\n")
    small = load_parameters(tmp_path / "small.yaml")
    assert (small.adapt_steps, small.n_rows, small.model) == (2, 1, "/models/x")
    (tmp_path / "on_mine.yaml").write_text(f"base: {path}\nn_rows: 3\n")
    on_mine = load_parameters(tmp_path / "on_mine.yaml")
    assert (on_mine.n_rows, on_mine.cap_branch, on_mine.profile) == (3, 64, "on_mine")  # the base's label is not taken
    (tmp_path / "bare.yaml").write_text("base: defaults\n")
    assert load_parameters(tmp_path / "bare.yaml").model_dump(exclude={"profile"}) == \
        ChainParameters().model_dump(exclude={"profile"})


def test_the_committed_profiles_resolve_over_their_documented_base():
    """smoke and cpu over the field defaults (smoke's values), gpu and paper over cpu; paper sets every value in
    which cpu and the defaults differ, gpu leaves notebook 00's adapt_* out (it reads cpu's checkpoint family) but
    declares cpu's recipe search, for when it is recomputed."""
    assert [base_of(n) for n in ("smoke", "cpu", "gpu", "paper")] == ["defaults", "defaults", "cpu", "cpu"]
    cpu = load_parameters("cpu")
    gpu = load_parameters("gpu")
    assert (gpu.adapt_steps, gpu.n_adapt_eval) == (cpu.adapt_steps, cpu.n_adapt_eval)
    assert gpu.adapt_selection == cpu.adapt_selection == load_parameters("paper").adapt_selection
    assert "adapt_selection" in yaml.safe_load((PARAMS / "gpu.yaml").read_text())  # declared, not only inherited
    assert (gpu.n_rows, gpu.cap_merge, gpu.n_exp5) == (200, 160, 48)


@pytest.mark.parametrize("files, match", [
    ({"a.yaml": "base: b.yaml\n", "b.yaml": "base: a.yaml\n"}, r"its `base:` chain returns to itself \(.*a.yaml -> .*b.yaml -> .*a.yaml\)"),
    ({"a.yaml": "base: 3\n"}, r"`base:` must name a profile \(e.g. cpu\) or be `defaults`, got 3"),
    ({"a.yaml": "base: b.yaml\n", "b.yaml": "n_row: 2\n"}, r"b.yaml: 'n_row' \(did you mean 'n_rows'\?\)"),
])
def test_a_bad_base_is_refused_naming_the_file(tmp_path, monkeypatch, files, match):
    monkeypatch.chdir(tmp_path)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=match):
        load_parameters("a.yaml")
    with pytest.raises(FileNotFoundError, match=r"profile .*c.yaml: base 'nope': unknown profile 'nope'"):
        (tmp_path / "c.yaml").write_text("base: nope\n")
        load_parameters(tmp_path / "c.yaml")


def test_the_summary_line_names_the_file_and_its_digest():
    line = describe(load_parameters("paper"), "paper")
    assert line.startswith("profile paper (notebooks/params/paper.yaml, sha256 ")
    assert "; the rest from base cpu); overrides none; model embedded; problems bank; " in line
    assert "rows 200 (preflight 8); caps 768/512/64; precisions bfloat16, float32" in line
    chunk = yaml.safe_load(profile_path("paper").read_text())["execution"]["chunk"]
    assert line.endswith(f"execution threads=4, device=cuda, workers=1, step_path=graph, batch=32, chunk={chunk}, "
                         "other keys default")
    assert describe(ChainParameters(), "smoke").endswith("execution: every key default")


def test_overrides_that_are_not_a_mapping_and_bad_yaml_are_refused_with_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"overrides must be a mapping.*-y 'overrides:"):
        load_parameters("smoke", '{"n_rows": 1}')  # papermill's -p overrides '{...}' passes a string
    bad = tmp_path / "bad.yaml"
    bad.write_text("profile: bad\ncaps: [1, 2\n")
    with pytest.raises(ValueError, match=r"profile .*bad\.yaml: not valid YAML"):
        load_parameters(bad)


@pytest.mark.parametrize("checkpoints", [[4, 2], [2, 8], [0, 4]])
def test_checkpoints_outside_the_training_are_refused_before_anything_runs(checkpoints):
    with pytest.raises(ValueError, match=r"adapt_checkpoints=.* must satisfy 0 < early < later <= adapt_steps \(4\)"):
        load_parameters("smoke", {"adapt_steps": 4, "adapt_checkpoints": checkpoints})
    assert load_parameters("smoke", {"n_rows": 1}).preflight == 1  # all rows preflight rows: allowed


def test_the_paper_profiles_done_list_is_what_its_committed_ledgers_hold():
    """`done:` in notebooks/params/paper.yaml names every started arm of data/ledgers/paper with its finished rows
    (an arm with variants, one ledger each, by variant as make paper names it: `exp1_ties-bfloat16 (highest)`,
    `exp1_length-bfloat16 (384)`)."""

    from kvreplay.arm_facts import facts
    from kvreplay.ledger.lookup import ledger_progress
    from kvreplay.paths import LEDGERS, ROOT

    done = yaml.safe_load((ROOT / "notebooks" / "params" / "paper.yaml").read_text())["done"]
    held = {}
    for folder in sorted(p for p in (LEDGERS / "paper").iterdir() if p.is_dir()):
        arm = folder.name.rsplit("-", 1)[0]
        key = facts(arm.rsplit("-", 1)[0]).variant_key
        if key:
            arm += f" ({json.loads((folder / 'manifest.json').read_text())['config'][key]})"
        assert arm not in held, f"two ledgers of {arm} under data/ledgers/paper"
        held[arm] = ledger_progress(folder)[0]
    assert done == held


def _constructions(name: str) -> list[str]:
    """``module.function`` of every call ``name(...)`` in lib/kvreplay (a call at module level: ``module``)."""
    import ast

    from kvreplay.paths import ROOT

    out = []
    for path in sorted((ROOT / "lib" / "kvreplay").rglob("*.py")):
        tree = ast.parse(path.read_text())
        module = ".".join(path.relative_to(ROOT / "lib").with_suffix("").parts).removesuffix(".__init__")
        owner: dict[ast.AST, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):  # the outermost function first (ast.walk is breadth-first)
                    owner.setdefault(inner, f"{module}.{node.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name:
                out.append(owner.get(node, module))
    return out


def test_the_execution_contract_and_the_engine_run_are_each_built_in_one_function():
    """The contract is resolved once: every ExecutionContract comes from execution.resolve_contract (arms through
    ArmSettings.contract), every arm's EngineRun from ArmSettings.engine_run; nothing else constructs either. (The
    engine's decoders default to ``EngineRun()`` for direct calls, and the benchmarks time shapes no arm has.)"""
    assert _constructions("ExecutionContract") == ["kvreplay.model.execution.resolve_contract"]
    runs = [c for c in _constructions("EngineRun") if not c.startswith("kvreplay.engine.decoders.")]
    benches = {"kvreplay.bench.engine_table", "kvreplay.bench.engine_suite.main", "kvreplay.bench.invariance._run_check",
               "kvreplay.bench.generate.engine_vs_generate", "kvreplay.bench.generate.profile_step"}
    assert sorted(set(runs) - benches) == ["kvreplay.runner.spec.engine_run"], runs  # benchmarks time shapes of their own
    assert {c.rsplit(".", 1)[1] for c in _constructions("EngineRun") if c.startswith("kvreplay.engine.")} == {
        "decode_suffixes", "decode_lives", "build_incrementals", "decode_chains", "decode_forced"}  # the defaults
    assert "kvreplay.runner.spec.contract" in _constructions("resolve_contract")


def test_resolve_contract_checks_before_anything_is_loaded():
    from kvreplay.model.execution import resolve_contract

    assert resolve_contract().sdpa_backends == ("math",) and resolve_contract(threads=3).threads == 3
    with pytest.raises(ValueError, match="unknown SDPA backend"):
        resolve_contract(sdpa_backends=("fast",))
    with pytest.raises(ValueError, match=r"SDPA backend\(s\) \['cudnn'\] unknown or not on device 'cpu'"):
        resolve_contract(sdpa_backends=("cudnn",))
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        resolve_contract(device="gpu0")
    with pytest.raises(ValueError, match="threads must be at least 1"):
        resolve_contract(threads=0)


def test_settings_come_back_from_a_ledger_key():
    """ArmSettings.from_config (make verify, the drift explorer) gives back the settings whose key it is."""
    import dataclasses

    from kvreplay.decoding.contract import Caps
    from kvreplay.runner import ArmSettings

    base = ArmSettings(profile="t", dtype="bfloat16", caps=Caps(4, 4, 4), threads=3, preflight=2)
    for settings in (base, dataclasses.replace(base, step_path="engine-eager", batch=4, attention="grouped"),
                     dataclasses.replace(base, step_path="engine-eager", batch=4, max_len=256)):
        again = ArmSettings.from_config(settings.config("exp1", []))  # the format as the key holds it: its spec
        assert dataclasses.replace(again, fmt=settings.fmt) == settings
        assert again.config("exp1", []) == settings.config("exp1", [])
    again = ArmSettings.from_config(dataclasses.replace(base, step_path="engine-eager").config("exp1", []))
    assert dataclasses.replace(again.eager(), fmt=base.fmt) == base


def test_profiles_that_report_results_choose_their_recipe_on_at_least_100_held_out_rows():
    """The recipe search's held-out selection set: at least MIN_HELDOUT rows in every profile that scores the bank on
    that many rows (cpu, gpu, paper, gemma); a smaller one refused there, naming the rule; toy profiles exempt."""
    for name in COMMITTED_PROFILES:  # not a user profile another test writes there
        params = load_parameters(name)
        toy = params.n_adapt_eval < MIN_HELDOUT
        assert params.adapt_selection.n_heldout >= MIN_HELDOUT or toy, name
        assert toy == (name in ("smoke", "gemma_smoke", "own")), name
        assert 0 < params.adapt_selection.max_letter_share <= 0.6, name
    small = load_parameters("smoke").adapt_selection.model_dump()
    with pytest.raises(ValueError, match=rf"adapt_selection.n_heldout={small['n_heldout']}: a profile that scores the bank on 100 rows or "
                                         r"more \(n_adapt_eval=200\) chooses its recipe on at least 100 held-out rows"):
        load_parameters("cpu", {"adapt_selection": small})
    assert load_parameters("cpu", {"adapt_selection": small, "n_adapt_eval": 20}).adapt_selection.n_heldout == small["n_heldout"] < 100


@pytest.mark.parametrize("block, match", [
    ({"n_heldot": 120}, r"adapt_selection: Value error, 'n_heldot' \(did you mean 'n_heldout'\?\): not a key of "
                        r"AdaptSelection"),
    ({"recipes": [{"name": "a", "stpes": 8}]}, r"adapt_selection.recipes.0: Value error, 'stpes' \(did you mean "
                                               r"'steps'\?\): not a key of AdaptRecipe"),
    ({"recipes": [{"name": "a"}, {"name": "a"}]}, r"recipe names must be unique and not 'ckpt0'"),
    ({"recipes": [{"name": "ckpt0"}]}, r"recipe names must be unique and not 'ckpt0'"),
    ({"recipes": [{"name": "Big Recipe"}]}, r"adapt_selection.recipes.0.name: String should match pattern"),
    ({"recipes": []}, r"adapt_selection.recipes: Tuple should have at least 1 item"),
    ({"recipes": [{"name": "a", "lr": "0.001"}]}, r"adapt_selection.recipes.0.lr: Input should be a valid number"),
    ({"recipes": [{"name": "a", "steps": 1}]}, r"recipe 'a': checkpoints \[1, 2\] must satisfy 0 < early < later <= "
                                               r"steps \(1\); a recipe that changes steps gives its checkpoints"),
    ({"max_letter_share": 1.5}, r"adapt_selection.max_letter_share: Input should be less than or equal to 1"),
    ({"min_accuracy": "chance"}, r"adapt_selection.min_accuracy: Input should be 'checkpoint0'"),
])
def test_a_bad_recipe_search_is_refused_before_anything_runs(block, match):
    smoke = load_parameters("smoke").adapt_selection.model_dump()
    with pytest.raises(ValueError, match=match):
        load_parameters("smoke", {"adapt_selection": smoke | block})
