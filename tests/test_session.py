"""The notebooks' one setup call (kvreplay.notebook.session): `profile` and `overrides` in, settings and paths out; no model."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from kvreplay import adapt
from kvreplay.paths import PARAMS
from kvreplay.runner import EXECUTION_DEFAULTS, ArmSettings, resolve_execution
from kvreplay.notebook.session import open_session

NB = "notebooks/02_experiment2_fixed_prefix_precision.ipynb"


def _gpu_profile_script():
    """scripts/gpu_profile.py as a module (it is a script, not part of the package)."""
    import importlib.util

    from kvreplay.paths import ROOT

    spec = importlib.util.spec_from_file_location("gpu_profile", ROOT / "scripts" / "gpu_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_session_builds_the_arm_settings_the_notebooks_use(tmp_path, capsys):
    s = open_session(NB, "smoke", {"ledger_root": str(tmp_path / "l"), "figures_root": str(tmp_path / "f")})
    assert capsys.readouterr().out.startswith("profile smoke (notebooks/params/smoke.yaml, sha256 ")  # what the notebook shows
    assert s.params.n_rows == 1 and s.profile == "smoke"
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
    assert s.write_panel("p", sort_keys=True, rule="r", n=2).read_text() == '{\n "n": 2,\n "rule": "r"\n}\n'


def test_batched_settings_and_their_eager_fallback():
    s = open_session(NB, "smoke", {"execution": {"step_path": "engine-eager", "batch": 4, "chunk": 6, "workers": 2,
                                                 "attention": "grouped"}})
    a = s.settings("float32", 1)
    assert (a.step_path, a.batch, a.chunk, a.workers, a.threads, a.attention) == ("engine-eager", 4, 6, 2, 2, "grouped")
    eager = s.settings("bfloat16", 1, batched=False)  # an experiment without a batched runner
    assert (eager.step_path, eager.batch, eager.max_len, eager.chunk, eager.workers, eager.attention) == \
        ("eager", 8, None, None, 2, "sdpa")


def test_execution_defaults_are_the_arm_settings_defaults():
    """One set of defaults: a notebook's `execution = {}` gives the ArmSettings (and so the ledger key) of no contract at all."""
    assert dict(EXECUTION_DEFAULTS) == {"threads": 2, "sdpa_backends": ("math",), "device": "cpu", "deterministic": None,
                                        "allow_tf32": False, "workers": 1, "ray_address": None, "step_path": "eager",
                                        "batch": 8, "max_len": None, "chunk": None, "attention": "sdpa",
                                        "tie_rule": "lowest", "kernels": "default"}
    s = open_session(NB, "smoke", {"execution": {}})
    assert s.execution == dict(EXECUTION_DEFAULTS)
    assert s.settings("bfloat16", 1) == ArmSettings(profile="smoke", dtype="bfloat16", caps=s.caps, preflight=1)
    assert resolve_execution(NB, None) == dict(EXECUTION_DEFAULTS)
    gpu = yaml.safe_load((PARAMS / "gpu.yaml").read_text())["execution"]
    assert resolve_execution(NB, gpu) == dict(EXECUTION_DEFAULTS) | gpu  # the profile's keys over the defaults


@pytest.mark.parametrize("execution, match", [
    ({"step-path": "graph"}, r"02_experiment2_fixed_prefix_precision.ipynb: .*: unknown execution key 'step-path' \(did you mean 'step_path'\?\)"),
    ({"threads": 2, "gpu": True}, r"02_experiment2_fixed_prefix_precision.ipynb: .*: unknown execution key 'gpu'"),
    ({"threads": "4"}, r"02_experiment2_fixed_prefix_precision.ipynb: .*: execution key 'threads' must be a whole number of at least 1, got '4'"),
    ({"threads": 0}, r"execution key 'threads' must be a whole number of at least 1, got 0"),
    ({"batch": 8.0}, r"execution key 'batch' must be a whole number, got 8.0"),
    ({"allow_tf32": "no"}, r"execution key 'allow_tf32' must be true or false, got 'no'"),
    ({"sdpa_backends": "math"}, r"execution key 'sdpa_backends' must be a non-empty list of SDPA backend names, got 'math'"),
    ({"workers": 0}, r"02_experiment2_fixed_prefix_precision.ipynb: .*: execution: workers must be a whole number of at least 1"),
    ({"step_path": "fast"}, r"execution: unknown step path 'fast'"),
    ({"chunk": 64}, r"execution: batch, max_len and chunk drive the batched engine"),  # chunk without a batched step path
    ({"step_path": "graph"}, r"execution: step path 'graph' replays CUDA graphs: it needs device 'cuda', not 'cpu'"),
    ({"device": "gpu0"}, r"execution: unknown device 'gpu0'"),
    ({"sdpa_backends": ["flash_attention"]}, r"execution: SDPA backend\(s\) \['flash_attention'\] unknown or not on device 'cpu'"),
    (["threads", 2], r"execution: Input should be a valid dictionary"),
])
def test_a_bad_execution_contract_is_refused_before_anything_is_read(monkeypatch, execution, match):
    import kvreplay.notebook.session as session_module

    def no_bank(*a, **k):
        raise AssertionError("the problem bank was read before the execution contract was checked")

    monkeypatch.setattr(session_module, "load_bank", no_bank)
    with pytest.raises(ValueError, match=match):
        open_session(NB, "smoke", {"execution": execution})


def test_bad_parameters_and_bad_paths_are_named():
    with pytest.raises(ValueError, match=r"02_experiment2_fixed_prefix_precision.ipynb: .*'cap_marge' \(did you mean 'cap_merge'\?\)"):
        open_session(NB, "smoke", {"cap_marge": 4})
    with pytest.raises(ValueError, match=r"cap_merge: Input should be a valid integer"):
        open_session(NB, "smoke", {"cap_merge": None})
    with pytest.raises(FileNotFoundError, match="unknown profile 'smok'"):
        open_session(NB, "smok")
    with pytest.raises(ValueError, match="not under notebooks/"):
        open_session("02.ipynb")
    with pytest.raises(FileNotFoundError):
        open_session(NB, "smoke", {"ledger_root": "/nonexistent/l"}).fixed  # notebook 01 has not written the bank


def test_every_notebook_takes_profile_and_overrides_and_opens_a_session():
    """The parameters are defined once (kvreplay.notebook.profiles); a notebook's parameters cell only names the profile and
    the overrides (the drift explorer adds its own explorer parameters), and its setup call takes both."""
    from kvreplay.paper import CHAIN, assigned_names, code_cells
    from kvreplay.paths import NOTEBOOKS
    from kvreplay.notebook.profiles import FIELDS

    for name in CHAIN:
        cells = code_cells(NOTEBOOKS / name)
        (declared,) = [assigned_names(src) for tags, src in cells if "parameters" in tags]
        assert {"profile", "overrides"} <= declared, name
        assert not (declared - {"profile", "overrides"}) & set(FIELDS) - {"model"}, name  # 08's `model`: the explorer's
        if not name.startswith("08"):
            assert declared == {"profile", "overrides"}, name
        assert sum(f'open_session("notebooks/{name}", profile, overrides)' in src for _, src in cells) == 1, name


def test_gpu_profile_passes_the_notebooks_parameters_and_sets_contract_keys_inside_execution():
    """scripts/gpu_profile.py hands open_session the notebook's two parameters; `--set chunk=32` changes the profile's
    `execution` mapping (its other keys kept), so the arm keeps its ledger key; a misspelled `--set` is refused with the
    closest parameter or execution key."""
    gpu_profile = _gpu_profile_script()
    nb = "notebooks/01_experiment1_live_vs_prefill.ipynb"
    paper = yaml.safe_load((PARAMS / "paper.yaml").read_text())
    assert gpu_profile.arm_overrides("paper", {}) == {}
    chunk = 2 * paper["execution"]["chunk"]  # another chunk than the profile's
    over = gpu_profile.arm_overrides("paper", {"chunk": chunk, "n_rows": 4})
    assert over == {"execution": paper["execution"] | {"chunk": chunk}, "n_rows": 4}
    as_is, changed = open_session(nb, "paper"), open_session(nb, "paper", over)
    assert as_is.params.execution == paper["execution"] and as_is.params.n_rows == paper["n_rows"]
    assert changed.execution["chunk"] == chunk and changed.params.n_rows == 4
    config = {k: s.settings("float32", 8).config("exp1", []) for k, s in (("as_is", as_is), ("changed", changed))}
    assert config["as_is"] == config["changed"]  # the chunk is not part of the ledger key
    own = {"device": "cpu", "step_path": "engine-eager", "batch": 4}  # --set execution={...} replaces the profile's
    assert gpu_profile.arm_overrides("paper", {"execution": own, "chunk": 8}) == {"execution": own | {"chunk": 8}}
    with pytest.raises(ValueError, match=r"--set n_row=\.\.\.: 'n_row' is neither .*did you mean 'n_rows'\?"):
        gpu_profile.arm_overrides("paper", {"n_row": 4})
    with pytest.raises(ValueError, match=r"did you mean 'chunk'\?"):
        gpu_profile.arm_overrides("paper", {"chunks": 64})
    with pytest.raises(ValueError, match=r"--set chunk='x': .*execution key 'chunk'"):
        gpu_profile.arm_overrides("paper", {"chunk": "x"})


def test_gpu_profile_exits_non_zero_with_the_reason_when_an_arm_fails(tmp_path):
    """A failed arm (here: a model path that does not exist) makes scripts/gpu_profile.py exit 1 and records the
    child's error in gpu_profile.json; an arm name with a dtype the script does not run is refused before any arm."""
    import json
    import os
    import subprocess
    import sys

    from kvreplay.paths import ROOT

    script = str(ROOT / "scripts" / "gpu_profile.py")
    env = os.environ | {"KV_LEDGERS": str(tmp_path / "ledgers")}
    run = subprocess.run([sys.executable, script, str(tmp_path / "out"), "exp1-float32", "--profile", "smoke",
                          "--set", f"model={tmp_path / 'no-such-model'}", "--budget", "120"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 1, run.stderr[-2000:]
    entry = json.loads((tmp_path / "out" / "gpu_profile.json").read_text())["arms"]["exp1-float32"]
    assert entry["exit"] == 1 and entry["error"].startswith("ModelLoadError: unknown model")
    bad = subprocess.run([sys.executable, script, str(tmp_path / "out"), "exp3-float32"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert bad.returncode == 1 and "unknown arm(s) ['exp3-float32']" in bad.stderr


def test_gpu_profile_reads_gate_failures_from_the_ledger_also_for_a_stopped_arm(tmp_path):
    """An arm stopped by the chunk deadline reports no records from its child, so its gate failures come from the
    ledger's rows (a last line cut off by the time limit is skipped)."""
    import json

    gpu_profile = _gpu_profile_script()
    failure = {"gate": "argmax", "reason": "raw next-token argmax differs between constructions (4590 vs 504)"}
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"problem_id": "a", "gate_failure": None}) + "\n"
                    + json.dumps({"problem_id": "b", "gate_failure": failure}) + "\n" + '{"problem_id": "c", "gate_fa')
    assert gpu_profile.ledger_gate_failures(tmp_path) == [("b", failure)]
    (tmp_path / "runlog.jsonl").write_text(json.dumps({"event": "equivalence_pending", "rows": ["a", "b", "c"]}) + "\n")
    assert [(pid, f["gate"]) for pid, f in gpu_profile.ledger_gate_failures(tmp_path)] == [
        ("a", "equivalence"), ("b", "argmax")]  # a row whose chunk's sampled check never ran is never counted clean


def test_adapt_config_comes_from_the_profile_and_the_training_model_loads_only_when_asked():
    s = open_session("notebooks/00_role_adaptation.ipynb", "smoke", {"adapt_steps": 8, "adapt_checkpoints": [2, 8]})
    plain, balanced = s.adapt_recipes()  # smoke's two recipes: the adapt_* values, and the same letter-balanced
    assert (plain.steps, plain.checkpoints, plain.name, plain.source) == (8, (2, 8), "smoke", s.params.adapt_source)
    assert (balanced.name, balanced.letter_balanced, plain.letter_balanced) == ("smoke-balanced", True, False)
    assert dataclasses.replace(balanced, name="smoke", letter_balanced=False) == plain  # nothing else differs
    assert (plain.threads, plain.sdpa_backends) == (s.execution["threads"], tuple(s.execution["sdpa_backends"]))
    assert s.adapt_criterion() == adapt.Criterion(2, 0.6)  # smoke.yaml: adapt_selection.n_heldout 2
    assert s._training_model is None  # nothing loaded until a loader call
    with pytest.raises(ValueError, match="checkpoints"):
        open_session("notebooks/00_role_adaptation.ipynb", "smoke", {"adapt_steps": 4, "adapt_checkpoints": [2, 8]})
    recipe = {"n_heldout": 4, "max_letter_share": 0.6, "recipes": [{"name": "long", "steps": 8, "checkpoints": [4, 8],
                                                                     "lr": 0.001, "batch": 4, "n_train": 12}]}
    (cfg,) = open_session("notebooks/00_role_adaptation.ipynb", "smoke", {"adapt_selection": recipe}).adapt_recipes()
    assert (cfg.name, cfg.steps, cfg.checkpoints, cfg.lr, cfg.batch, cfg.n_train) == ("long", 8, (4, 8), 0.001, 4, 12)


def test_gpu_profile_from_scratch_copies_only_the_chain_inputs(tmp_path):
    """`--from-scratch` resumes nothing committed (ledger folders, prefix bank, panels), only the checkpoint pointer;
    without it every committed entry is copied; neither overwrites what the machine already holds."""
    gpu_profile = _gpu_profile_script()
    here = tmp_path / "committed"
    (here / "exp1-bfloat16-abc").mkdir(parents=True)
    (here / "exp1-bfloat16-abc" / "rows.jsonl").write_text("{}\n")
    for name in ("prefix_bank_bf16.jsonl", "exp4_panel.json", "role_adaptation.json"):
        (here / name).write_text(name)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert gpu_profile.seed_ledger_root(here, fresh, from_scratch=True) == ["role_adaptation.json"]
    assert sorted(p.name for p in fresh.iterdir()) == ["role_adaptation.json"]
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    (resumed / "exp4_panel.json").write_text("this machine's")
    assert gpu_profile.seed_ledger_root(here, resumed) == ["exp1-bfloat16-abc", "prefix_bank_bf16.jsonl",
                                                          "role_adaptation.json"]
    assert (resumed / "exp4_panel.json").read_text() == "this machine's"


def test_gpu_profile_from_scratch_can_seed_the_upstream_this_library_wrote(tmp_path):
    """`--upstream-of-this-library`: ledger folders written by this library and the prefix bank built from one of
    them are copied; a folder of another library, a bank built from one, and panels are not."""
    import json

    gpu_profile = _gpu_profile_script()
    here = tmp_path / "committed"
    for name, library in (("exp1-bfloat16-abc", "ours"), ("exp4-bfloat16-def", "theirs")):
        (here / name).mkdir(parents=True)
        (here / name / "environment.json").write_text(json.dumps({"library_sha256": library}))
    for name in ("exp4_panel.json", "role_adaptation.json", "prefix_bank_bf16.jsonl"):
        (here / name).write_text(name)
    bank_manifest = here / "prefix_bank_bf16.jsonl.manifest.json"
    bank_manifest.write_text(json.dumps({"source_ledger": "exp1-bfloat16-abc"}))
    seeded = tmp_path / "seeded"
    seeded.mkdir()
    assert gpu_profile.seed_ledger_root(here, seeded, from_scratch=True, library="ours") == [
        "exp1-bfloat16-abc", "prefix_bank_bf16.jsonl", "prefix_bank_bf16.jsonl.manifest.json", "role_adaptation.json"]
    rerun = tmp_path / "rerun"  # an arm named on the command line is recomputed, even if this library wrote it
    rerun.mkdir()
    assert gpu_profile.seed_ledger_root(here, rerun, from_scratch=True, library="ours", arms=("exp1-bfloat16",)) == [
        "role_adaptation.json"]  # nor the bank built from it
    upstream = tmp_path / "upstream"
    upstream.mkdir()
    assert gpu_profile.seed_ledger_root(here, upstream, from_scratch=True, library="ours",
                                        arms=("exp4-bfloat16", "exp2_controls-bfloat16")) == [
        "exp1-bfloat16-abc", "prefix_bank_bf16.jsonl", "prefix_bank_bf16.jsonl.manifest.json", "role_adaptation.json"]
    bank_manifest.write_text(json.dumps({"source_ledger": "exp4-bfloat16-def"}))
    other = tmp_path / "other"
    other.mkdir()
    assert gpu_profile.seed_ledger_root(here, other, from_scratch=True, library="ours") == [
        "exp1-bfloat16-abc", "role_adaptation.json"]
    (tmp_path / "none").mkdir()
    assert gpu_profile.seed_ledger_root(here, tmp_path / "none", from_scratch=True,
                                        library="nobody's") == ["role_adaptation.json"]


def test_gpu_profile_estimates_a_first_chunk_from_earlier_run_logs(tmp_path):
    """The estimate is the longest earlier chunk of the same size in the arm's run logs (a chunk's time sits on its
    first row), committed or on this machine; a resumed call leaves out a new arm's first chunk (its gates are the
    dearer ones); other chunk sizes, other arms, eager rows and a cut-off line do not count; none: None."""
    import json

    gpu_profile = _gpu_profile_script()
    committed, machine = tmp_path / "committed", tmp_path / "machine"

    def log(folder, *runs):
        folder.mkdir(parents=True)
        lines = []
        for engine, todo, times in runs:
            lines += [json.dumps({"event": "engine", **engine}) if engine else json.dumps({"event": "note"}),
                      json.dumps({"event": "start", "rows": 200, "todo": todo})]
            lines += [json.dumps({"event": "row", "seconds": t}) for t in times]
        (folder / "runlog.jsonl").write_text("\n".join(lines) + "\n" + '{"event": "row", "seco')

    log(committed / "exp4-bfloat16-aaa", ({"batch": 32, "chunk": 64}, 200, [520.0, 0.001, 300.0]),  # chunks of 64
        ({"batch": 32, "chunk": 32}, 136, [150.0, 0.001, 140.0]), ({"batch": 32, "chunk": 32}, 72, [90.0]))
    log(machine / "exp4-bfloat16-bbb", ({"batch": 32}, 200, [190.0, 0.001, 120.0]))  # chunk = batch = 32, new arm
    log(machine / "exp4_controls-bfloat16-ccc", ({"batch": 32}, 200, [900.0]))
    log(machine / "exp5-bfloat16-ddd", (None, 200, [999.0]))  # the eager path: no engine event
    assert gpu_profile.longest_chunk_s([committed, machine], "exp4-bfloat16", 32, resuming=False) == 190.0
    assert gpu_profile.longest_chunk_s([committed, machine], "exp4-bfloat16", 32, resuming=True) == 150.0
    assert gpu_profile.longest_chunk_s([committed], "exp4-bfloat16", 64, resuming=False) == 520.0
    assert gpu_profile.longest_chunk_s([committed, machine], "exp5-bfloat16", 32, resuming=False) is None
    assert gpu_profile.longest_chunk_s([committed, tmp_path / "none"], "exp2-float32", 32, resuming=False) is None


def test_gpu_profile_from_scratch_refuses_rows_of_another_library_on_the_machine(tmp_path):
    """Rows a machine holds from a call that resumed committed ones (another library) would be resumed, not
    recomputed: `--from-scratch` refuses that arm before starting it, exits 1, and says why."""
    import json
    import os
    import subprocess
    import sys

    from kvreplay.paths import ROOT

    folder = tmp_path / "ledgers" / "smoke" / "exp1-float32-000000000000"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}\n")
    (folder / "environment.json").write_text(json.dumps({"library_sha256": "0" * 64}) + "\n")
    (folder / "rows.jsonl").write_text('{"problem_id": "p"}\n')
    env = os.environ | {"KV_LEDGERS": str(tmp_path / "ledgers")}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_profile.py"), str(tmp_path / "out"),
                          "exp1-float32", "--profile", "smoke", "--from-scratch"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 1, run.stderr[-2000:]
    entry = json.loads((tmp_path / "out" / "gpu_profile.json").read_text())["arms"]["exp1-float32"]
    assert "written by another library" in entry["error"] and "exit" not in entry


def test_gpu_profile_names_an_unreadable_manifest_instead_of_a_traceback(tmp_path):
    import pytest

    gpu_profile = _gpu_profile_script()
    here = tmp_path / "committed"
    (here / "exp1-bfloat16-abc").mkdir(parents=True)
    (here / "exp1-bfloat16-abc" / "environment.json").write_text("[1, 2]")
    (tmp_path / "there").mkdir()
    with pytest.raises(SystemExit, match="environment.json: a JSON list, not an object"):
        gpu_profile.seed_ledger_root(here, tmp_path / "there", from_scratch=True, library="ours")
    (here / "exp1-bfloat16-abc" / "environment.json").write_text("{not json")
    with pytest.raises(SystemExit, match="not readable as JSON"):
        gpu_profile.seed_ledger_root(here, tmp_path / "there", from_scratch=True, library="ours")


def test_gpu_profile_all_lists_every_arm_the_profile_turns_on_in_chain_order():
    """`--all` runs what notebooks 01-05 compute: the exploratory arms only where the profile turns them on."""
    gpu_profile = _gpu_profile_script()
    assert gpu_profile.profile_arms("paper", {}) == [
        "exp1-bfloat16", "exp1-float32", "exp2-bfloat16", "exp2-float32", "exp3-bfloat16", "exp4-bfloat16",
        "exp5-bfloat16"]
    declared = {"tie_rules": ["highest", "hash:0"], "exploratory_controls": True, "length_branch_caps": [384, 1536]}
    assert gpu_profile.profile_arms("paper", declared) == [
        "exp1-bfloat16", "exp1-float32", "exp1_ties-bfloat16", "exp1_length-bfloat16", "exp2-bfloat16",
        "exp2-float32", "exp2_controls-bfloat16", "exp3-bfloat16", "exp4-bfloat16", "exp5-bfloat16"]
    import yaml

    from kvreplay.paths import ROOT

    recompute = yaml.safe_load((ROOT / "data" / "paper" / "recompute.yaml").read_text())
    assert (ROOT / recompute.pop("role_adaptation")).is_file()
    gpu_profile.arm_overrides("paper", recompute)  # every declared value is one the profile accepts


def test_gpu_profile_measures_an_arm_from_its_run_log_and_its_floor():
    """The per-arm table's numbers come from the chunk, gate and end events an arm logged in the call."""
    gpu_profile = _gpu_profile_script()
    events = [{"event": "chunk", "steps": 100, "seconds": 2.0, "slot_steps": 400, "busy_slot_steps": 300,
               "kv_positions": 30_000, "capture_s": 1.5},
              {"event": "gates", "checks": [{"gate": "composition", "problem_id": "a"},
                                            {"gate": "live_equals_incremental", "seconds": 9.0}]},
              {"event": "equivalence_sample", "checks": [{"seconds": 0.75}, {"seconds": 0.75}]},  # one shared call
              {"event": "end", "compute_s": 7.0}]
    layout = {"weights_bytes": 1_000_000, "kv_bytes_per_position": 100}
    m = gpu_profile.arm_measures(events, layout, 1e9)  # 1 GB/s
    assert (m["steps"], m["ms_per_step"], m["occupancy"], m["capture_s"], m["compute_s"]) == (100, 20.0, 0.75, 1.5, 7.0)
    assert m["gate_s"] == round(0.75, 1)  # the shared call once, the live checks (inside the chunk) left out
    # per step: the weights once and 2 rows x 300 key positions x 100 bytes: 1.06 MB at 1 GB/s = 1.06 ms
    assert m["floor_ms_per_step"] == 1.06 and m["x_floor"] == 18.9
    assert "floor_ms_per_step" not in gpu_profile.arm_measures(events, None, None)
