"""One provenance per profile, and committed rows that recompute byte for byte (the golden-row test).

The row-algorithm version of each experiment (``kvreplay.runner.ROW_ALGORITHM``)
is recorded in every ledger. A refactor that changes no bit keeps it; a change
to what a row computes bumps it, and this test then fails until the committed
ledgers are recomputed. BF16 bits depend on the CPU kind, so the byte
comparison runs where the environment matches the committed one (the machine
that wrote them: CI's); elsewhere each row is checked for what must hold
anywhere, and the test says what it skipped.
"""

from __future__ import annotations

import json

import pytest
from conftest import committed_profiles, tracked
from kvreplay.paths import LEDGERS
from kvreplay.runner import ROW_ALGORITHM

COMMITTED = "cpu"
PENDING: set[str] = set()
"""Experiments whose committed cpu ledgers await recomputation under the current row algorithm (README,
"Results"): their superseded ledgers were removed, so none of the profile's ledgers is of another version.
Empty this set when they are committed; the tests below then expect them."""
OPTIONAL = {"exp1_ties", "exp1_length", "exp2_kernels"}
"""Experiments a profile computes only when it asks for them (the tie-rule control: its ``tie_rules``; the
manipulated-length arm: its ``length_branch_caps``; the kernel attribution: its ``kernel_values``). The first two run
Experiment 1's row function, the last Experiment 2's, which their golden rows cover."""


def _ledgers(profile: str):
    for folder in (m.parent for m in tracked(f"data/ledgers/{profile}/*/manifest.json")):  # committed ledgers only
        if (folder / "manifest.json").is_file():
            yield folder, json.loads((folder / "manifest.json").read_text())["config"]["experiment"], \
                json.loads((folder / "environment.json").read_text())


def test_the_committed_profile_is_one_code_version_with_no_copied_rows():
    found = {}
    for folder, experiment, env in _ledgers(COMMITTED):
        found[folder.name] = env.get("row_algorithm")
        assert env.get("row_algorithm") == ROW_ALGORITHM[experiment], (
            f"{folder.name} was written by row algorithm {env.get('row_algorithm')}, the code computes "
            f"{ROW_ALGORITHM[experiment]}: recompute the {COMMITTED} profile")
        assert "salvag" not in (folder / "runlog.jsonl").read_text(), f"{folder.name}: rows copied from another ledger"
    # an optional experiment is there when the profile asks for it (cpu lists length_branch_caps)
    assert {name.split("-")[0] for name in found} - OPTIONAL == set(ROW_ALGORITHM) - PENDING - OPTIONAL, found


def test_every_profile_is_written_by_one_version_per_experiment():
    for profile in committed_profiles():
        states = {env.get("row_algorithm") == ROW_ALGORITHM.get(exp) for _, exp, env in _ledgers(profile)}
        assert len(states) <= 1, f"profile {profile} mixes current and stale ledgers"


ONE_LIBRARY = {"cpu": "88dc0f9db0ef75b485a60a6a35776380d8309e8caedad68821b143ccdfe8d078",
               "gpu": "88dc0f9db0ef75b485a60a6a35776380d8309e8caedad68821b143ccdfe8d078",
               "gpu_eager": "88dc0f9db0ef75b485a60a6a35776380d8309e8caedad68821b143ccdfe8d078"}
"""The library (``library_sha256``: the package's sources at commit aa77a87) that created each of these profiles'
ledgers (their ``environment.json``). It is not a record of what resumed a ledger: their run logs name no library,
and some were resumed (docs/provenance.md). A refactor changes the digest without changing a bit (``make verify``
and the golden rows below show that), so this pins what created the ledgers, not what the code is now."""
LIBRARY_PENDING: dict[str, set[str]] = {"cpu": {"adapt_eval", "exp5", "exp1_length"}, "gpu": set(), "gpu_eager": set()}
"""Experiments of each profile written by another library than the one ``ONE_LIBRARY`` names: ``cpu``'s checkpoint
metric and Experiment 5 were recomputed on the family its recipe search chose (notebook 00), after the rest; its
manipulated-length arm was added later still."""


def test_each_recomputed_profile_was_written_by_one_library():
    for profile, digest in ONE_LIBRARY.items():
        written = {folder.name: env.get("library_sha256") for folder, _, env in _ledgers(profile)}
        ours = {name: lib for name, lib in written.items() if name.split("-")[0] not in LIBRARY_PENDING[profile]}
        assert ours and all(lib == digest for lib in ours.values()), (
            f"{profile}: ledgers written by another library than {digest[:12]}: "
            f"{ {n: (lib or '')[:12] for n, lib in ours.items() if lib != digest} } (recompute the whole profile "
            "with one library and update ONE_LIBRARY, or list the experiment in LIBRARY_PENDING)")
        pending = {name for name in written if name.split("-")[0] in LIBRARY_PENDING[profile]}
        assert all(written[name] != digest for name in pending), (
            f"{profile}: {sorted(n for n in pending if written[n] == digest)} are recomputed: "
            "take them out of LIBRARY_PENDING")


GOLDEN = ("exp1-bfloat16",)
"""The committed cpu ledger whose fastest row is recomputed here: the anchor that the committed profile, not only
the code, recomputes (``make verify`` recomputes the others). Every experiment's row function, at both precisions,
is compared byte for byte with committed golden rows by the smoke chain (tests/golden_smoke.py, run in
tests/test_notebooks.py), at no extra cost."""


@pytest.mark.notebook
def test_a_committed_row_recomputes(capsys):
    from kvreplay.verify import verify_profile

    results = verify_profile(LEDGERS, COMMITTED, rows=1, only=[f"{g}-" for g in GOLDEN], pick="fastest")
    with capsys.disabled():
        for r in results:
            print(f"\n  golden row {r.ledger} {r.problem_id} ({r.seconds:.0f} s): {r.mode}, {r.detail}",
                  end="")
    assert {r.ledger.rsplit("-", 1)[0] for r in results} == set(GOLDEN)
    bad = [r for r in results if not r.ok]
    assert not bad, bad


def test_every_experiment_has_golden_smoke_rows():
    """Every experiment a profile always computes has its rows among the golden smoke rows, at each precision the
    smoke profile runs it (the optional arms run Experiment 1's or 2's row function)."""
    from golden_smoke import GOLDEN as SMOKE_GOLDEN

    keys = {p.name.split(".")[0].split("-")[0] for p in SMOKE_GOLDEN.glob("*-*.jsonl")}
    assert keys == set(ROW_ALGORITHM) - OPTIONAL, keys
    assert {"exp1-bfloat16.jsonl", "exp1-float32.jsonl", "exp2-bfloat16.jsonl", "exp2-float32.jsonl"} <= {
        p.name for p in SMOKE_GOLDEN.iterdir()}


def _fewest_decoder_steps(folder) -> str:
    """The problem ID of the ledger's row that decodes the fewest tokens (its boundary's generated tokens and its
    arms' suffix tokens; ties by ID). On the CPU a row's time follows them; the wall time a GPU ledger logs (a
    chunk's, on its first row) does not."""
    from kvreplay.verify import checked_rows

    def steps(row: dict) -> tuple[int, str]:
        suffixes = sum(len(arm["suffix"]) for arm in row["arms"].values())
        return row["prefix_len"] - row["prompt_len"] + suffixes, row["problem_id"]
    return min((r.record for r in checked_rows(folder)), key=steps)["problem_id"]


@pytest.mark.notebook
def test_a_gpu_row_recomputes_on_this_cpu(capsys):
    """A committed H200 row (graph engine, FP32) recomputed here on the CPU's eager path: gates and token IDs. The row
    is the one with the fewest decoder steps (:func:`_fewest_decoder_steps`)."""
    import torch

    from kvreplay.verify import verify_profile

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the row would be recomputed on it")
    (folder,) = [m.parent for m in tracked("data/ledgers/gpu/exp1-float32-*/manifest.json")]
    results = verify_profile(LEDGERS, "gpu", only=["exp1-float32-"], ids=[_fewest_decoder_steps(folder)])
    with capsys.disabled():
        for r in results:
            print(f"\n  gpu row {r.ledger} {r.problem_id}: {r.mode}, {r.detail}", end="")
    assert len(results) == 1 and results[0].mode == "portable"
    assert "recomputed on this CPU through the eager path" in results[0].detail
    assert results[0].ok, results[0]


def test_verify_refuses_an_unknown_profile_and_a_selection_of_nothing(capsys):
    """`make verify` with a typo: exit 2 and a message saying what exists, not a traceback or '0 of 0 match'."""
    from kvreplay.verify import main

    assert main(["--profile", "no-such-profile"]) == 2
    assert "profiles with ledgers" in capsys.readouterr().err
    assert main(["--profile", COMMITTED, "--only", "exp9"]) == 2
    assert "matches --only exp9" in capsys.readouterr().err


def test_kept_models_load_once_per_precision_role_table_and_contract(monkeypatch):
    """Inside ``keep_models`` (a GPU profile's one process) a second arm of the same model, precision, role table and
    contract gets the first one's model; any of the four changed loads anew, and outside the scope every call loads."""
    from kvreplay.model.execution import ExecutionContract
    from kvreplay.runner import kept

    loads = []
    monkeypatch.setattr(kept, "load_model", lambda *a, **k: loads.append((a, k)) or object())
    math, other = ExecutionContract(sdpa_backends=("math",)), ExecutionContract(sdpa_backends=("math",), threads=2)
    with kept.keep_models() as models:
        first = kept.load_kept("m", "bfloat16", None, math)
        assert kept.load_kept("m", "bfloat16", None, ExecutionContract(sdpa_backends=("math",))) is first
        others = [kept.load_kept("m", "float32", None, math), kept.load_kept("m", "bfloat16", "t.pt", math),
                  kept.load_kept("m", "bfloat16", None, other), kept.load_kept("n", "bfloat16", None, math)]
        assert len({id(x) for x in [first, *others]}) == 5 and len(models) == 5 and len(loads) == 5
    kept.load_kept("m", "bfloat16", None, math)
    assert len(loads) == 6
