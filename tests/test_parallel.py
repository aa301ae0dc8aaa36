"""Rows on Ray actors and the execution contract: same bytes as a sequential run, resumable, fail-closed.

One local Ray cluster (2 CPUs) serves the whole module; each arm starts its own actors (one thread each)
and kills them when it ends.
"""

from __future__ import annotations

import json

import pytest
import ray
import torch
import yaml
from conftest import tiny_problems
from kvreplay.experiments.live_vs_prefill import EXP1, live_vs_prefill_row
from kvreplay.gates import GateError
from kvreplay.ledger.store import Ledger, run_rows
from kvreplay.model.execution import DeviceUnavailableError, ExecutionContract
from kvreplay.model.models import environment_record, load_model
from kvreplay.paths import LEDGERS
from kvreplay.data.problems import load_bank
from kvreplay.runner import ROW_ALGORITHM, ArmSettings, run_arm
from kvreplay.runner import actors as parallel
from kvreplay.runner.actors import RowActors, actor_resources


@pytest.fixture(scope="module")
def cluster():
    parallel.shutdown()  # a cluster another module left (e.g. the bench's) would have other resources
    info = parallel.connect(num_cpus=2)
    assert info["started"] and info["resources"]["CPU"] == 2
    yield info
    parallel.shutdown()


def _events(ledger) -> list[dict]:
    return [json.loads(x) for x in (ledger.dir / "runlog.jsonl").read_text().splitlines()]


def test_actors_give_the_sequential_ledger_bytes_and_resume(tmp_path, tiny_arm, cluster):
    problems = tiny_problems(5)
    seq, ledger_seq = EXP1.run(tiny_arm(), problems, ledger_root=tmp_path / "seq", progress=False)
    par, ledger_par = EXP1.run(tiny_arm(workers=2), problems, ledger_root=tmp_path / "par", progress=False)
    assert ledger_seq.dir.name == ledger_par.dir.name  # workers are not part of the scientific key
    assert ledger_par.rows_path.read_bytes() == ledger_seq.rows_path.read_bytes()
    assert par == seq
    # the contract was applied in the actors as in this process: the recorded flags agree
    assert (ledger_par.dir / "environment.json").read_bytes() == (ledger_seq.dir / "environment.json").read_bytes()
    (start,) = [e for e in _events(ledger_par) if e["event"] == "workers"]
    assert start["workers"] == 2 and start["devices"] == ["cpu", "cpu"] and start["ray"] == cluster["address"]
    # resume: keep two finished rows (and half of a third, as a crash mid-write leaves it), finish on actors
    lines = ledger_par.rows_path.read_bytes().splitlines(keepends=True)
    ledger_par.rows_path.write_bytes(b"".join(lines[:2]) + lines[2][:17])
    again, _ = EXP1.run(tiny_arm(workers=2), problems, ledger_root=tmp_path / "par", progress=False)
    assert ledger_par.rows_path.read_bytes() == ledger_seq.rows_path.read_bytes()
    assert again == seq


def test_batched_actors_give_the_sequential_batched_ledger_bytes(tmp_path, tiny_arm, cluster):
    """Each actor computes whole chunks of the engine, and each passes the composition gate on its own first chunk."""
    problems = tiny_problems(5)
    arm = dict(step_path="engine-eager", batch=2)
    seq, ledger_seq = EXP1.run(tiny_arm(**arm), problems, ledger_root=tmp_path / "seq", progress=False)
    par, ledger_par = EXP1.run(tiny_arm(**arm, workers=2), problems, ledger_root=tmp_path / "par", progress=False)
    assert ledger_seq.dir.name == ledger_par.dir.name
    assert ledger_par.rows_path.read_bytes() == ledger_seq.rows_path.read_bytes() and par == seq
    assert (ledger_par.dir / "environment.json").read_bytes() == (ledger_seq.dir / "environment.json").read_bytes()
    gates = [c for e in _events(ledger_par) if e["event"] == "gates" for c in e["checks"]]
    # chunks {00, 01} {02, 03} {04} on two actors: the arm's first problem, and the first problem of the other
    # actor's first chunk (which chunk that is depends on Ray's timing)
    assert [c["gate"] for c in gates] == ["composition"] * 2 and len({c["actor_pid"] for c in gates}) == 2
    assert gates[0]["problem_id"] == "tiny-00" and gates[1]["problem_id"] in {"tiny-02", "tiny-04"}
    # resumed on actors: every actor recomputes the committed row with the shortest line and must equal it
    lines = ledger_par.rows_path.read_bytes().splitlines(keepends=True)
    ledger_par.rows_path.write_bytes(b"".join(lines[:2]))
    shortest = json.loads(min(lines[:2], key=len))["problem_id"]
    again, _ = EXP1.run(tiny_arm(**arm, workers=2), problems, ledger_root=tmp_path / "par", progress=False)
    assert ledger_par.rows_path.read_bytes() == ledger_seq.rows_path.read_bytes() and again == seq
    resumed = [c for e in _events(ledger_par) if e["event"] == "gates" for c in e["checks"]][len(gates):]
    assert [(c["gate"], c["problem_id"], c.get("reference")) for c in resumed] == [("composition", shortest,
                                                                                   "committed row")] * 2
    assert len({c["actor_pid"] for c in resumed}) == 2  # chunks {02, 03} and {04}: one on each actor


def test_actors_stop_at_a_failing_preflight_row(tmp_path, tiny_arm, cluster):
    def plant(states):  # runs inside the actors (this module is sent by value)
        with torch.inference_mode():
            states["live_replica"].logits[:, 0] += 1.0

    with pytest.raises(GateError, match="preflight"):
        run_arm("exp1", tiny_arm(workers=2, preflight=2), tiny_problems(4), live_vs_prefill_row,
                ledger_root=tmp_path, progress=False, faults=plant)
    (folder,) = (tmp_path / "t").iterdir()
    rows = [json.loads(x) for x in (folder / "rows.jsonl").read_text().splitlines()]
    assert [r["problem_id"] for r in rows] == ["tiny-00"]  # aborted before any non-preflight row was started
    assert rows[0]["gate_failure"]["gate"].startswith("replica")


def test_a_killed_actor_loses_no_finished_row(tmp_path, tiny_arm, cluster):
    """Actor 1 is killed for good (its rows go to actor 0); actor 0 is killed mid-run, restarted by Ray, its row retried."""
    problems = tiny_problems(6)
    _, ledger_seq = EXP1.run(tiny_arm(), problems, ledger_root=tmp_path / "seq", progress=False)
    settings = tiny_arm(workers=2)
    with RowActors(settings, live_vs_prefill_row, equivalence_ids=frozenset({"tiny-00"})) as pool:
        environment, run = pool.prepare(problems)
        ledger = Ledger(tmp_path / "par" / "t", "exp1-float32", settings.config("exp1", problems),
                        environment=environment, row_algorithm=ROW_ALGORITHM["exp1"])
        mapper = pool.mapper(problems, key=lambda p: p.problem_id, run=run)
        first_pid = pool.info[0]["pid"]
        ray.kill(pool.actors[1], no_restart=True)

        def killing(items):
            for i, rec in enumerate(mapper(items)):
                if i == 0:
                    ray.kill(pool.actors[0], no_restart=False)  # mid-run; it holds the next row
                yield rec

        run_rows(ledger, problems, None, key=lambda p: p.problem_id, mapper=killing, preflight=0, progress=False)
        assert ray.get(pool.actors[0].ready.remote())["pid"] != first_pid  # Ray restarted it (the model reloaded)
    assert ledger.dir.name == ledger_seq.dir.name
    assert ledger.rows_path.read_bytes() == ledger_seq.rows_path.read_bytes()
    assert [(e["event"], e["actor"]) for e in pool.events] == [("actor_lost", 1)]


def test_actor_resources_and_cluster_limits(tmp_path, tiny_arm, cluster):
    assert actor_resources("cpu", 3, 2, 0) == {"num_cpus": 2, "num_gpus": 0}
    assert actor_resources("cuda", 2, 1, 2) == {"num_cpus": 1, "num_gpus": 1.0}
    assert actor_resources("cuda", 4, 1, 2) == {"num_cpus": 1, "num_gpus": 0.5}
    assert actor_resources("cuda", 15, 1, 1) == {"num_cpus": 1, "num_gpus": 0.0666}  # 15 shares fit on one GPU
    with pytest.raises(ValueError, match="at least 1"):
        actor_resources("cpu", 0, 1, 0)
    with pytest.raises(ValueError, match="pins one GPU"):
        actor_resources("cuda:1", 2, 1, 2)
    with pytest.raises(ValueError, match="no GPU"):
        actor_resources("cuda", 2, 1, 0)
    with pytest.raises(ValueError, match="unknown device 'mps' for row actors"):
        actor_resources("mps", 2, 1, 2)
    with pytest.raises(ValueError, match="unknown device 'gpu0'; use 'cpu', 'cuda' or 'cuda:N'"):
        actor_resources("gpu0", 2, 1, 2)
    # more actors than the cluster's CPUs: refused before any actor or ledger exists (Ray would wait forever)
    with pytest.raises(ValueError, match=r"3 row actors need 3 CPUs \(1 each\), but the Ray cluster at .* has 2"):
        EXP1.run(tiny_arm(workers=3), tiny_problems(3), ledger_root=tmp_path, progress=False)
    with pytest.raises(RuntimeError, match="connected to the Ray cluster at .*, not '127.0.0.1:1'"):
        EXP1.run(tiny_arm(workers=2, ray_address="127.0.0.1:1"), tiny_problems(3), ledger_root=tmp_path, progress=False)
    assert not (tmp_path / "t").exists()


def test_cpu_contract_adds_nothing_to_committed_ledger_keys():
    """The CUDA parameters must not move CPU ledgers: the committed cpu ledger's folder is found again."""
    from kvreplay.decoding.contract import Caps

    params = yaml.safe_load((LEDGERS.parent.parent / "notebooks" / "params" / "cpu.yaml").read_text())
    rows = load_bank()[: params["n_rows"]]
    s = ArmSettings(profile="cpu", dtype="bfloat16", caps=Caps(params["cap_branch"], params["cap_merge"], params["cap_answer"]),
                    threads=params["execution"]["threads"], preflight=params["preflight"], workers=4,
                    ray_address="auto")
    config = s.config("exp1", rows)
    assert "execution" not in config
    assert Ledger.folder(LEDGERS / "cpu", "exp1-bfloat16", config).is_dir()
    cuda = ArmSettings(profile="cpu", dtype="bfloat16", caps=s.caps, device="cuda").config("exp1", rows)
    assert cuda["execution"] == {"device": "cuda", "cublas_workspace_config": ":4096:8"}
    tf32 = ArmSettings(profile="cpu", dtype="float32", caps=s.caps, device="cuda", allow_tf32=True, deterministic=False)
    assert tf32.config("exp1", rows)["execution"] == {"device": "cuda", "cublas_workspace_config": None,
                                                       "deterministic": False, "allow_tf32": True}


def test_contract_is_applied_and_recorded(tmp_path, tiny_arm):
    c = ExecutionContract()
    assert c.key() == {} and c.resolved_deterministic() is False
    assert ExecutionContract(device="cuda:0").resolved_deterministic() is True
    lm, _ = tiny_arm(deterministic=True).load()
    try:
        rec = environment_record(lm, 1)
        assert torch.are_deterministic_algorithms_enabled() and rec["deterministic_algorithms"] is True
        assert rec["contract"]["deterministic_resolved"] is True and rec["contract"]["device"] == "cpu"
        assert rec["contract"]["sdpa_backends"] == ["math"] and rec["contract"]["allow_tf32"] is False
        assert rec["tf32_matmul"] is False and rec["float32_matmul_precision"] == "highest"
    finally:
        ExecutionContract().apply()
    rec = environment_record(tiny_arm().load()[0], 1)
    assert rec["deterministic_algorithms"] is False and rec["contract"]["deterministic_resolved"] is False
    with pytest.raises(ValueError, match="unknown device"):
        ExecutionContract(device="tpu").apply()
    with pytest.raises(ValueError, match="unknown SDPA backend"):
        ExecutionContract(sdpa_backends=("fastest",)).apply()
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailableError, match="sees no CUDA device"):
            load_model("embedded", "bfloat16", contract=ExecutionContract(device="cuda"))


def test_bad_worker_counts_and_an_actor_that_cannot_start(tmp_path, tiny_arm, cluster):
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="workers must be"):
            tiny_arm(workers=bad)
    for bad in ("", 6379):
        with pytest.raises(ValueError, match="ray_address must be"):
            tiny_arm(ray_address=bad)
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(RuntimeError, match=r"row actor \(pid \d+, device cpu\) failed to start: ModelLoadError: model .*broken-model.: its config .* cannot be read"):
        EXP1.run(tiny_arm(workers=2, model=str(broken)), tiny_problems(3), ledger_root=tmp_path, progress=False)
    assert not any((tmp_path / "t").glob("*/rows.jsonl"))  # nothing was computed


def test_actors_refuse_a_problem_longer_than_the_context_before_any_ledger_exists(tmp_path, tiny_arm, cluster):
    from kvreplay.decoding.contract import ContractError
    from kvreplay.data.problems import Problem

    long = Problem("long-1", "test", 9, " ".join(["word"] * 450) + "?", ("x", "y"), "A")  # > 2048 byte tokens
    with pytest.raises(ContractError, match=r"problem long-1 \(test line 9\).*only 2048 \(max_position_embeddings\)"):
        EXP1.run(tiny_arm(workers=2), tiny_problems(2) + [long], ledger_root=tmp_path / "ledgers", progress=False)
    assert not (tmp_path / "ledgers").exists()
