"""Public row functions guard themselves: a model built by hand, a problem too long for the model, and profile values
that would switch the construction checks off get the run loop's clear errors, before anything is decoded."""

from __future__ import annotations

import pytest
import torch
import yaml
from conftest import COMMITTED_PROFILES, TINY_CAPS, TINY_FORMAT, make_tokenizer, tiny_lm, tiny_problems
from kvreplay.decoding import decode
from kvreplay.model import models
from kvreplay.decoding.contract import ContractError, resolve_format
from kvreplay.decoding.settings import Decoding
from kvreplay.experiments.fixed_prefix import fixed_prefix_row
from kvreplay.experiments.live_vs_prefill import live_vs_prefill_row
from kvreplay.ledger.store import Ledger
from kvreplay.model.models import LoadedModel, ModelLoadError
from kvreplay.paths import LEDGERS, PARAMS
from kvreplay.data.problems import Problem
from kvreplay.notebook.profiles import load_parameters
from kvreplay.runner import RunSpec


def _hand_built(model: torch.nn.Module, name: str) -> LoadedModel:
    """A LoadedModel assembled by hand, as a user calling the row functions directly would: no load_model."""
    model.config._attn_implementation = "sdpa"
    return LoadedModel(model=model.eval(), tokenizer=make_tokenizer(), dtype=torch.float32, role_table=None,
                       identity={"model": name})


def _spec(lm: LoadedModel) -> RunSpec:
    return RunSpec(lm=lm, fmt=resolve_format(lm.tokenizer, TINY_FORMAT), decoding=Decoding.of(TINY_CAPS))


SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_a_hand_built_sliding_window_model_runs_with_its_window_not_a_shape_error():
    """A sliding-window model built by hand takes its attention layout from its config, as through load_model:
    the row runs (window applied by the per-layer masks) and its drift rows name each layer's kind."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    lm = _hand_built(MistralForCausalLM(MistralConfig(vocab_size=len(make_tokenizer()), sliding_window=8, **SMALL)),
                     "tiny-mistral")
    rec = live_vs_prefill_row(_spec(lm), tiny_problems(1)[0])
    assert rec["gate_failure"] is None
    assert {t["layer_kind"] for t in rec["boundary"]["prefill_vs_live"]["tensors"]} == {"sliding"}


def test_a_hand_built_linear_attention_hybrid_gets_the_load_refusal_not_an_attribute_error():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=len(make_tokenizer()), head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"], **SMALL)
    lm = _hand_built(Qwen3NextForCausalLM(config), "tiny-qwen3-next")
    with pytest.raises(ModelLoadError, match=r"tiny-qwen3-next.*linear_attention \(layer 0 of 2\).*no KV cache"):
        _spec(lm)


def test_a_hand_built_model_that_ignores_the_mask_fails_the_self_check_when_its_spec_is_built():
    lm = tiny_lm("llama")
    forward = lm.model.forward
    lm.model.forward = lambda *a, **kw: forward(*a, **(kw | {"attention_mask": None}))
    with pytest.raises(ModelLoadError, match=r"failed the load self-check.*ignores the explicit attention mask"):
        _spec(lm)


def test_a_loaded_models_self_check_record_is_reused_and_a_hand_built_one_is_checked_once(monkeypatch):
    calls = []
    real = models.self_check
    monkeypatch.setattr("kvreplay.runner.spec.self_check", lambda lm: calls.append(1) or real(lm))
    lm = tiny_lm("qwen2")
    spec = _spec(lm)
    RunSpec(lm=lm, fmt=spec.fmt, decoding=Decoding.of(TINY_CAPS))  # the same model object again
    assert calls == [1]
    loaded = tiny_lm("llama")
    loaded.identity["self_check"] = {"passed": True}  # what load_model records
    _spec(loaded)
    assert calls == [1]


@pytest.fixture
def short_context_lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return _hand_built(LlamaForCausalLM(LlamaConfig(vocab_size=len(make_tokenizer()), max_position_embeddings=256,
                                                    **SMALL)), "tiny-llama-256")


def test_a_2040_token_prompt_on_a_256_position_model_is_refused_by_the_row_function_itself(short_context_lm):
    spec = _spec(short_context_lm)
    long = Problem("long-1", "test", 5, "w" * 2000 + "?", ("x", "y"), "A")
    assert len(spec.fmt.prompt_ids(long.question, long.options)) >= 2040 - 30
    with pytest.raises(ContractError, match=r"problem long-1 \(test line 5\): its full sequence can need \d+ positions"
                                            r".*only 256 \(max_position_embeddings\)"):
        live_vs_prefill_row(spec, long)
    assert short_context_lm.calls == 0  # refused before any forward call
    from kvreplay.experiments.live_vs_prefill import live_vs_prefill_chunk

    with pytest.raises(ContractError, match="only 256"):
        live_vs_prefill_chunk(spec, tiny_problems(1) + [long])


def test_a_fixed_prefix_too_long_for_the_model_is_refused_before_the_matrix(short_context_lm):
    spec = _spec(short_context_lm)
    p = tiny_problems(1)[0]
    short = live_vs_prefill_row(_spec(tiny_lm("llama")), p)["prefix"]
    fmt = spec.fmt
    parsed = fmt.boundary_parse(short)
    b1 = parsed.content[1]

    def stretched(n):  # branch 1's content stretched so that the prefix holds n tokens
        return short[: b1[0]] + [short[b1[0]]] * (n - len(short) + b1[1] - b1[0]) + short[b1[1]:]

    assert len(stretched(250)) == 250
    with pytest.raises(ContractError, match=r"problem tiny-00 \(test line 1\): its prefix of 250 tokens and longest "
                                            r"suffix .* can need \d+ positions, but the model has only 256"):
        fixed_prefix_row(spec, p, stretched(250))  # the prefix fits, its suffix would not: refused before the matrix
    with pytest.raises(ContractError, match=r"positions 256\.\.256, but the model has only 256"):
        fixed_prefix_row(spec, p, stretched(300))  # the rebuild itself would not fit: refused at its first call past it


def test_a_forward_call_beyond_the_models_positions_is_refused(short_context_lm):
    fmt = resolve_format(short_context_lm.tokenizer, TINY_FORMAT)
    prompt = fmt.prompt_ids("w" * 300 + "?", ["x", "y"])
    with pytest.raises(ContractError, match=r"positions 0\.\.\d+, but the model has only 256"):
        decode.decode_live(short_context_lm, fmt, prompt, TINY_CAPS)


def test_preflight_zero_is_refused_naming_the_key_and_why(tmp_path):
    with pytest.raises(ValueError, match=r"overrides \{'preflight': 0\}: preflight: .*would switch off the checks that "
                                         r"run on preflight rows .*live_equals_incremental.*use at least 1, got 0"):
        load_parameters("smoke", {"preflight": 0})
    with pytest.raises(ValueError, match=r"preflight_fixed: .*construction-equivalence gate\).*use at least 1"):
        load_parameters("smoke", {"preflight_fixed": 0})
    f = tmp_path / "mine.yaml"
    f.write_text("profile: mine\npreflight: 0\n")
    with pytest.raises(ValueError, match=r"profile .*mine.yaml: preflight: "):
        load_parameters(f)
    for name in COMMITTED_PROFILES:  # every committed profile keeps its checks on
        params = load_parameters(name)
        assert params.preflight >= 1 and params.preflight_fixed >= 1, name
    with pytest.raises(ValueError, match=r"live_check_fraction: Input should be less than or equal to 1"):
        load_parameters("smoke", {"live_check_fraction": 2})
    assert load_parameters("smoke", {"live_check_fraction": 0}).live_check_fraction == 0


@pytest.mark.parametrize("profile", ["cpu", "gpu", "paper"])
def test_the_committed_exp1_ledgers_keep_their_keys(profile):
    """The live check's fraction is not part of the key: a profile that does not set it finds its ledgers."""
    from kvreplay.notebook.session import open_session

    s = open_session("notebooks/01_experiment1_live_vs_prefill.ipynb", profile)
    rows = s.rows(s.params.n_rows)
    for dtype in s.params.precisions:
        for fraction in (s.params.live_check_fraction, 0.0, 0.5):
            settings = s.settings(dtype, s.params.preflight)
            import dataclasses

            config = dataclasses.replace(settings, live_check_fraction=fraction).config("exp1", rows)
            assert Ledger.folder(LEDGERS / profile, f"exp1-{dtype}", config).is_dir(), (profile, dtype, fraction)
    assert yaml.safe_load((PARAMS / f"{profile}.yaml").read_text()).get("live_check_fraction") is None
