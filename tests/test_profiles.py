"""The chain's parameters (kvreplay.profiles): one typed definition, the profiles that set them, bad input refused."""

from __future__ import annotations

import pydantic
import pytest
import yaml
from kvreplay.paths import PARAMS
from kvreplay.profiles import PROFILE_KEYS, ChainParameters, describe, load_parameters, profile_path
from kvreplay.runner import resolve_execution


def test_the_defaults_are_the_smoke_profile():
    """A notebook opened as is runs the smoke profile: the model's defaults cannot drift from smoke.yaml."""
    smoke = yaml.safe_load((PARAMS / "smoke.yaml").read_text())
    defaults = ChainParameters()
    dumped = defaults.model_dump(mode="json")
    for key, value in smoke.items():
        if key == "execution":  # the same contract: `{}` over the defaults is smoke's `threads: 2`
            assert defaults.contract == resolve_execution("smoke.yaml", value), key
        else:
            assert dumped[key] == value, key
    assert load_parameters("smoke").contract == defaults.contract
    assert load_parameters("smoke").model_dump(exclude={"execution"}) == defaults.model_dump(exclude={"execution"})


def test_every_committed_profile_loads():
    for path in sorted(PARAMS.glob("*.yaml")):
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
    with pytest.raises(FileNotFoundError, match=r"unknown profile 'nope'.*'cpu', 'gemma', 'gemma_smoke', 'gpu', 'paper', 'smoke'"):
        profile_path("nope")


def test_the_summary_line_names_the_file_and_its_digest():
    line = describe(load_parameters("paper"), "paper")
    assert line.startswith("profile paper (notebooks/params/paper.yaml, sha256 ")
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
        load_parameters("smoke", {"adapt_checkpoints": checkpoints})
    assert load_parameters("smoke", {"n_rows": 1}).preflight == 1  # all rows preflight rows: allowed


def test_the_paper_profiles_done_list_is_what_its_committed_ledgers_hold():
    """`done:` in notebooks/params/paper.yaml names every started arm of data/ledgers/paper with its finished rows."""

    from kvreplay.ledger.lookup import ledger_progress
    from kvreplay.paths import LEDGERS, ROOT

    done = yaml.safe_load((ROOT / "notebooks" / "params" / "paper.yaml").read_text())["done"]
    held = {}
    for folder in sorted(p for p in (LEDGERS / "paper").iterdir() if p.is_dir()):
        arm = folder.name.rsplit("-", 1)[0]
        assert arm not in held, f"two ledgers of {arm} under data/ledgers/paper"
        held[arm] = ledger_progress(folder)[0]
    assert done == held
