"""What notebook 03 and the results pages say about provenance is read from the ledgers, never assumed."""

from __future__ import annotations

import json

from kvreplay.experiments.bridge import replay_setting
from kvreplay.paths import LEDGERS
from kvreplay.report.summary import checkpoint_recipe


def _env(profile: str, prefix: str) -> dict:
    (folder,) = sorted((LEDGERS / profile).glob(f"{prefix}-*"))
    return json.loads((folder / "environment.json").read_text())


def test_notebook_03_names_both_libraries_when_the_bridge_and_experiment_1_differ():
    cpu = replay_setting(_env("cpu", "exp3-bfloat16"), _env("cpu", "exp1-bfloat16"))
    assert cpu == ("here the bridge ran on Experiment 1's execution contract (AMD EPYC, torch 2.13.0+cpu), its ledger "
                   "created by Experiment 1's library (88dc0f9db0ef)")
    paper = replay_setting(_env("paper", "exp3-bfloat16"), _env("paper", "exp1-bfloat16"))
    assert paper.endswith("its ledger created by library 3e6b5db5bd7c, Experiment 1's by ce2afad4d36c")
    moved = _env("cpu", "exp3-bfloat16")
    moved["execution_contract"] = dict(moved["execution_contract"], torch="2.99.0+cpu")
    assert "under another execution contract than Experiment 1's (torch '2.13.0+cpu' there, '2.99.0+cpu' here)" \
        in replay_setting(moved, _env("cpu", "exp1-bfloat16"))


def test_the_replication_checkpoint_names_its_recipe_and_whether_the_search_chose_it(tmp_path):
    def checkpoint(profile: str) -> dict:
        (folder,) = sorted((LEDGERS / profile).glob("exp5-bfloat16-*"))
        return json.loads((folder / "manifest.json").read_text())["config"]["checkpoint"]

    assert checkpoint_recipe(checkpoint("paper"), LEDGERS) == ("v1", "bal-b1")
    assert checkpoint_recipe(checkpoint("gpu"), LEDGERS) == ("v1", "bal-b1")
    assert checkpoint_recipe(checkpoint("cpu"), LEDGERS) == ("bal-b1", "bal-b1")
    assert checkpoint_recipe(checkpoint("paper"), tmp_path) == ("v1", None)  # no cpu pointer under that root
    assert checkpoint_recipe({"checkpoint_config_digest": "0" * 64}, LEDGERS) == (None, "bal-b1")
