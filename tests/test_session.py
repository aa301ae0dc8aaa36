"""The experiment notebooks' one setup call (kvreplay.session): parameters in, settings and paths out; no model."""

from __future__ import annotations

import pytest
import yaml
from kvreplay.paths import PARAMS
from kvreplay.session import open_session

NB = "notebooks/02_experiment2_fixed_prefix_precision.ipynb"


def _params(**over):
    p = yaml.safe_load((PARAMS / "smoke.yaml").read_text()) | {"model": "embedded", "problems": "bank", "format": "chat_multibranch",
                                                               "role_table": None, "sdpa_backends": ["math"], "device": "cpu",
                                                               "deterministic": None, "allow_tf32": False, "workers": 1,
                                                               "ray_address": None, "ledger_root": None, "figures_root": None}
    return p | over


def test_session_builds_the_arm_settings_the_notebooks_use(tmp_path):
    s = open_session(NB, _params(ledger_root=str(tmp_path / "l"), figures_root=str(tmp_path / "f"), unrelated=object()))
    assert s.ledger_root == tmp_path / "l" and s.out_dir == tmp_path / "f" / "smoke"
    assert (s.caps.branch, s.caps.merge, s.caps.answer) == (8, 8, 4) and len(s.bank) == 200
    a = s.settings("bfloat16", 1)
    assert (a.profile, a.dtype, a.preflight, a.threads, a.model, a.step_path) == ("smoke", "bfloat16", 1, 2, "embedded", "eager")
    later = s.settings("bfloat16", 0, model="x.gguf", role_table="t.pt")
    assert (later.model, later.role_table) == ("x.gguf", "t.pt")
    assert s.rows(3) == s.bank[:3]
    with pytest.raises(ValueError, match="n_rows=201"):
        s.rows(201)
    path = s.write_panel("p", rule="r", problem_ids=["b", "a"])
    assert path.read_text() == '{\n "rule": "r",\n "problem_ids": [\n  "b",\n  "a"\n ]\n}\n'  # keys in the order given


def test_batched_settings_and_their_eager_fallback():
    s = open_session(NB, _params(step_path="engine-eager", batch=4, max_len=None))
    assert (s.settings("float32", 1).step_path, s.settings("float32", 1).batch) == ("engine-eager", 4)
    eager = s.settings("bfloat16", 1, batched=False)  # an experiment without a batched runner
    assert (eager.step_path, eager.batch, eager.max_len) == ("eager", 8, None)


def test_missing_parameters_and_bad_paths_are_named():
    params = _params()
    del params["cap_merge"]
    with pytest.raises(ValueError, match="cap_merge"):
        open_session(NB, params)
    with pytest.raises(ValueError, match="not under notebooks/"):
        open_session("02.ipynb", _params())
    with pytest.raises(FileNotFoundError):
        open_session(NB, _params(ledger_root="/nonexistent/l")).fixed  # notebook 01 has not written the bank
