"""Integrity gates catch planted faults through the same runner the notebooks use (paper §3.5, Table 3)."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_CAPS, tiny_lm, tiny_problems
from kvreplay.decoding import caches, decode
from kvreplay.decoding.settings import Decoding
from kvreplay.experiments.live_vs_prefill import live_vs_prefill_row
from kvreplay.experiments.matrix import matrix_summary
from kvreplay.gates import GateError, cache_tensors
from kvreplay.ledger.store import Ledger, run_rows
from kvreplay.runner import RunSpec


@pytest.fixture
def spec_factory(tiny_format):
    def make(faults=None, arch="llama", dtype=torch.float32):
        lm = tiny_lm(arch, dtype)
        return RunSpec(lm=lm, fmt=tiny_format(lm), decoding=Decoding.of(TINY_CAPS), faults=faults)

    return make


def test_clean_row_passes_every_gate(spec_factory):
    rec = live_vs_prefill_row(spec_factory(), tiny_problems(1)[0])
    assert rec["gate_failure"] is None
    assert rec["boundary"]["live_replica"]["cache"]["exact"]
    assert rec["boundary"]["prefill_replica"]["cache"]["exact"]
    assert set(rec["arms"]) == {"live", "live_replica", "prefill", "prefill_replica"}
    assert rec["arms"]["live"]["suffix"] == rec["arms"]["live_replica"]["suffix"]
    assert len(rec["boundary"]["prefill_vs_live"]["tensors"]) == 2 * 2  # 2 layers x (K, V)


def _alias(states):
    # the prefill replica's layer-0 keys become a view of the prefill's storage: same values, shared memory
    states["prefill_replica"].cache.layers[0].keys = states["prefill"].cache.layers[0].keys[:]


def _desync(states):
    with torch.inference_mode():
        states["prefill"].cache.layers[1].values[1, 0, -1, 0] += 1.0


def _roles(states):
    roles = states["prefill"].roles.clone()
    roles[:, 3] = 2
    states["prefill"].roles = roles


def _dtype(states):
    with torch.inference_mode():
        states["live_replica"].cache.layers[0].keys = states["live_replica"].cache.layers[0].keys.to(torch.float64)


def _replica_value(states):
    with torch.inference_mode():
        states["live_replica"].cache.layers[1].keys[:, 0, 2, 1] += 0.5


@pytest.mark.parametrize(
    "fault, gate",
    [pytest.param(_alias, "storage", marks=pytest.mark.gate("storage")),
     pytest.param(_desync, "desync", marks=pytest.mark.gate("desync")),
     pytest.param(_roles, "functional_state", marks=pytest.mark.gate("functional_state")),
     pytest.param(_dtype, "dtype", marks=pytest.mark.gate("dtype")),
     pytest.param(_replica_value, "replica", marks=pytest.mark.gate("replica"))],
)
def test_planted_fault_is_caught(spec_factory, fault, gate):
    rec = live_vs_prefill_row(spec_factory(fault), tiny_problems(1)[0])
    assert rec["gate_failure"] is not None, "fault was not caught"
    assert rec["gate_failure"]["gate"] == gate, rec["gate_failure"]
    assert "arms" not in rec  # no endpoints from a failed row


@pytest.mark.gate("desync")
def test_desync_during_decode_fails_closed(spec_factory):
    """A duplicate row that drifts inside the decoder (as cuDNN SDPA did on an H200) stops the row."""
    spec = spec_factory()
    real = spec.lm.model.forward

    def skewed(*args, **kwargs):
        out = real(*args, **kwargs)
        if spec.lm.calls > 3:
            out.logits[1, -1, 5] += 1e-3
        return out

    spec.lm.model.forward = skewed
    rec = live_vs_prefill_row(spec, tiny_problems(1)[0])
    assert rec["gate_failure"]["gate"] == "desync"


def test_prefill_replica_is_a_second_model_call(spec_factory):
    spec = spec_factory()
    live = decode.decode_live(spec.lm, spec.fmt, spec.fmt.prompt_ids("Q?", ["a", "b"]), TINY_CAPS)
    before = spec.lm.calls
    a = decode.build_prefill(spec.lm, spec.fmt, live.ids)
    b = decode.build_prefill(spec.lm, spec.fmt, live.ids)
    assert spec.lm.calls - before == 2
    caches.verify_replica(a, b)  # exact, and disjoint storage
    for (_, x), (_, y) in zip(cache_tensors(a.cache), cache_tensors(b.cache)):
        assert torch.equal(x, y) and x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()


def test_live_replica_is_deep_and_exact(spec_factory):
    spec = spec_factory()
    live = decode.decode_live(spec.lm, spec.fmt, spec.fmt.prompt_ids("Q?", ["a", "b"]), TINY_CAPS)
    before = spec.lm.calls
    rep = caches.live_replica(live)
    assert spec.lm.calls == before  # a copy, not a call
    for (_, x), (_, y) in zip(cache_tensors(live.cache), cache_tensors(rep.cache)):
        assert torch.equal(x, y) and x.is_inference() and y.is_inference()
        assert x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()


@pytest.mark.gate("preflight")
@pytest.mark.gate("report")
def test_preflight_failure_aborts_and_full_run_failure_is_recorded(spec_factory, tmp_path):
    problems = tiny_problems(3)
    bad = problems[1].problem_id
    spec = spec_factory(faults=None)
    faulty = spec_factory(faults=_desync)

    def row(p):
        return live_vs_prefill_row(faulty if p.problem_id == bad else spec, p)

    ledger = Ledger(tmp_path, "exp1-test", {"k": 1})
    records = run_rows(ledger, problems, row, key=lambda p: p.problem_id, preflight=1, progress=False)
    assert [r["gate_failure"] is not None for r in records] == [False, True, False]
    with pytest.raises(GateError, match="report") as e:
        matrix_summary(records, "float32", n_resamples=100)
    assert bad in str(e.value)
    ledger2 = Ledger(tmp_path, "exp1-test-preflight", {"k": 2})
    with pytest.raises(GateError, match="preflight"):
        run_rows(ledger2, problems, row, key=lambda p: p.problem_id, preflight=2, progress=False)
    assert len(ledger2.records()) == 2  # the failing preflight row is kept, nothing after it ran


def test_experiment2_row_gates_and_endpoints(spec_factory):
    from kvreplay.experiments.fixed_prefix import fixed_prefix_row

    spec = spec_factory()
    live_rec = live_vs_prefill_row(spec, tiny_problems(1)[0])
    rec = fixed_prefix_row(spec, tiny_problems(1)[0], live_rec["prefix"])
    assert rec["gate_failure"] is None
    assert set(rec["arms"]) == {"incremental", "incremental_replica", "prefill", "prefill_replica"}
    # incremental replays the live schedule: it reproduces the live suffix and cache summaries exactly
    assert rec["arms"]["incremental"]["suffix"] == live_rec["arms"]["live"]["suffix"]
    assert rec["boundary"]["prefill_vs_incremental"] == live_rec["boundary"]["prefill_vs_live"]
    bad = fixed_prefix_row(spec_factory(_alias), tiny_problems(1)[0], live_rec["prefix"])
    assert bad["gate_failure"]["gate"] == "storage"


def _positions(states):
    pos = states["prefill"].positions.clone()
    pos[:, -1] += 1  # as if the last token had been fed at a shifted position
    states["prefill"].positions = pos


def test_shifted_positions_are_caught(spec_factory):
    rec = live_vs_prefill_row(spec_factory(_positions), tiny_problems(1)[0])
    assert rec["gate_failure"]["gate"] == "functional_state"


def test_live_positions_are_recorded_from_the_calls(spec_factory):
    spec = spec_factory()
    live = decode.decode_live(spec.lm, spec.fmt, spec.fmt.prompt_ids("Q?", ["a", "b"]), TINY_CAPS)
    assert live.positions.shape == (2, len(live.ids))
    assert torch.equal(live.positions[0], torch.arange(len(live.ids)))


def test_a_desync_on_any_single_call_is_caught(spec_factory):
    """The greedy loop reads each call's duplicate check with the next choice; none may slip through, the last included."""
    spec = spec_factory()
    prompt = spec.fmt.prompt_ids("Q?", ["a", "b"])
    decode.decode_live(spec.lm, spec.fmt, prompt, TINY_CAPS)
    n_calls = spec.lm.calls
    real = spec.lm.model.forward
    for k in range(1, n_calls + 1):
        start = spec.lm.calls

        def skewed(*args, _k=k, _start=start, **kwargs):
            out = real(*args, **kwargs)
            if spec.lm.calls - _start == _k - 1:
                out.logits[1, -1, 5] += 1e-3
            return out

        spec.lm.model.forward = skewed
        with pytest.raises(GateError, match="desync"):
            decode.decode_live(spec.lm, spec.fmt, prompt, TINY_CAPS)
    spec.lm.model.forward = real
