"""The README's "Audit your own model", run as a user would: its example profile, a local model folder, ``make paper``.

The profile is the README's YAML block as written, with its ``model`` pointing at a tiny random-weight Llama saved as
a local folder (``config.json``, weights, tokenizer) and, so the test takes minutes on CPU, the smoke profile's sizes
(``base: smoke``, two rows, caps of a few tokens). ``make paper PROFILE=<name>`` must run the whole chain, notebook
08 included, write ``build/<name>/results.md``, leave ``git status`` listing only the profile's own file and folders
(the README names them), and, run again, skip every notebook. The profile's folders are removed afterwards.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml
from conftest import make_model, make_tokenizer
from kvreplay.paths import BUILD, CHECKPOINTS, FIGURES, LEDGERS, PARAMS, ROOT

pytestmark = pytest.mark.notebook

FAST = {"base": "smoke", "n_rows": 2, "preflight": 1, "cap_branch": 4, "cap_merge": 4, "cap_answer": 2}
"""What the test changes in the README's example besides the model: the smoke profile's panel and training sizes."""


def readme_profile() -> dict:
    """The README's example profile (the YAML block of "Audit your own model"), parsed."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Audit your own model", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    assert block.startswith("# notebooks/params/mymodel.yaml"), block[:60]
    return yaml.safe_load(block)


def _status() -> set[str]:
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=normal"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    return {line[3:] for line in out.splitlines()}


def test_the_readme_example_runs_the_whole_chain_on_a_local_model_folder(tmp_path, progress):
    example = readme_profile()
    assert example["model"].startswith("/") and example["format"] == "chat_multibranch"
    name = f"own_{os.getpid()}"
    folder = tmp_path / "tiny-llama"
    tok = make_tokenizer()
    model = make_model("llama", len(tok))
    model.config.max_position_embeddings = 8192  # the byte-level tokenizer's staged training rows need over 2,048
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    profile = PARAMS / f"{name}.yaml"
    owned = [profile, LEDGERS / name, FIGURES / name, CHECKPOINTS / name, BUILD / name]
    before = _status()
    try:
        profile.write_text(yaml.safe_dump(example | {"profile": name, "model": str(folder)} | FAST, sort_keys=False))
        progress(f"own model: make paper PROFILE={name} (the whole chain on a tiny local folder)")
        env = dict(os.environ, KVREPLAY_EXPLORER_CACHE=str(tmp_path / "explorer-cache"))
        run = subprocess.run(["make", "--no-print-directory", "paper", f"PROFILE={name}"], cwd=ROOT, env=env,
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert (BUILD / name / "08_drift_explorer.ipynb").is_file(), "notebook 08 did not run"
        results = BUILD / name / "results.md"
        assert results.is_file(), run.stdout[-2000:]
        assert "results page:" in run.stdout and "no results page" not in run.stdout
        new = _status() - before
        want = {f"notebooks/params/{name}.yaml", f"data/ledgers/{name}/", f"figures/{name}/", f"data/checkpoints/{name}/"}
        assert new == want, f"git status after a user run: {sorted(new)}"
        readme = (ROOT / "README.md").read_text(encoding="utf-8")
        for path in ("notebooks/params/mymodel.yaml", "data/ledgers/mymodel/", "figures/mymodel/",
                     "data/checkpoints/mymodel/", "build/mymodel/"):
            assert path in readme, f"the README does not say a user run writes {path}"
        progress("own model: the same command again (every notebook up to date)")
        again = subprocess.run(["make", "--no-print-directory", "paper", f"PROFILE={name}"], cwd=ROOT, env=env,
                               capture_output=True, text=True)
        assert again.returncode == 0, again.stderr[-3000:]
        assert again.stdout.count("up to date") >= 9, again.stdout[-3000:]
    finally:
        for path in owned:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
