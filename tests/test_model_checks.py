"""A model is checked when its profile is read: from its config and tokenizer, before any weight loads or anything trains.

The models that must pass are tiny random-weight folders of the families the protocol supports (Llama, Qwen2,
Mistral with a sliding window, Gemma 3, GPT-2) and the embedded SmolLM2 (a Llama). The refused ones are saved
without weights (config and tokenizer only), so a refusal that needed a weight would fail here. ``make paper`` on a
refused model exits 2 with the project's error and leaves no folder behind.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import make_model, make_tokenizer
from kvreplay import paper
from kvreplay.model.models import ModelLoadError, check_model, load_model, load_tokenizer
from kvreplay.paths import BUILD, CHECKPOINTS, FIGURES, LEDGERS
from kvreplay.notebook.profiles import load_parameters
from kvreplay.notebook.session import check_profile_model
from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, MambaConfig

LONG = 8192
"""Positions of the folders that must pass: the byte-level test tokenizer makes MMLU prompts thousands of tokens long."""


def _save(tmp_path, name: str, model=None, config=None) -> str:
    """A model folder: ``model`` saved whole, or ``config`` alone (no weights); the byte-level tokenizer beside it."""
    folder = tmp_path / name
    if model is not None:
        model.save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return str(folder)


def _family(arch: str):
    m = make_model(arch, len(make_tokenizer()))
    m.config.max_position_embeddings = LONG
    return m


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=len(make_tokenizer()), n_embd=64, n_layer=2, n_head=4, n_positions=LONG))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3", "gpt2"])
def test_supported_families_pass_the_profile_check(tmp_path, arch):
    folder = _save(tmp_path, f"tiny-{arch}", _gpt2() if arch == "gpt2" else _family(arch))
    line = check_profile_model(load_parameters("smoke", {"model": folder}))
    assert f"model {folder}: a causal decoder with a plain KV cache" in line
    assert f"of its {LONG} positions (notebook 00 included)" in line


def test_the_embedded_llama_passes():
    assert check_model("embedded") is None  # the project's own digest-checked model
    assert check_profile_model(load_parameters("cpu")) == "model embedded: embedded, digest-checked at load"


def _refused(tmp_path, name: str, config) -> str:
    return _save(tmp_path, name, config=config)


def test_a_bert_masked_lm_is_refused_before_its_weights_are_read(tmp_path):
    folder = _refused(tmp_path, "tiny-bert", BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2,
                                                        num_attention_heads=2, intermediate_size=64,
                                                        architectures=["BertForMaskedLM"]))
    with pytest.raises(ModelLoadError, match=r"tiny-bert' cannot be audited.*'bert' \(BertForMaskedLM\) is a "
                                             r"bidirectional encoder.*is_decoder: true.*Use a model whose"):
        check_profile_model(load_parameters("smoke", {"model": folder}))
    with pytest.raises(ModelLoadError, match="bidirectional encoder"):
        load_model(folder, "float32")  # the loader refuses it the same way, before the (absent) weights


def test_a_saved_bert_with_weights_is_refused_by_the_loader(tmp_path):
    torch.manual_seed(0)
    bert = BertForMaskedLM(BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64))
    with pytest.raises(ModelLoadError, match="bidirectional encoder"):
        load_model(_save(tmp_path, "tiny-bert-weights", bert), "float32")


def test_a_mamba_model_is_refused_by_the_project_rule(tmp_path):
    folder = _refused(tmp_path, "tiny-mamba", MambaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2,
                                                          state_size=4))
    with pytest.raises(ModelLoadError, match=r"tiny-mamba' cannot be audited.*linear_attention.*no KV cache"):
        check_model(folder)
    with pytest.raises(ModelLoadError, match=r"linear_attention") as e:
        load_model(folder, "float32")
    assert "attn_implementation" not in str(e.value)  # not transformers' advice to load it eagerly


def test_a_missing_folder_is_named_by_the_project(tmp_path):
    missing = str(tmp_path / "no-such-model")
    for call in (lambda: check_model(missing), lambda: load_tokenizer(missing),
                 lambda: check_profile_model(load_parameters("smoke", {"model": missing}))):
        with pytest.raises(ModelLoadError, match=r"no-such-model': the path .* does not exist. Fix the profile's"):
            call()


@pytest.mark.parametrize("text, says", [("{not json", "cannot be read"),
                                         ('{"hidden_size": 64}', "cannot be read")])
def test_a_broken_config_is_named_with_its_file(tmp_path, text, says):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text(text)
    with pytest.raises(ModelLoadError, match=rf"broken': its config .*config.json {says}.*Fix or regenerate"):
        check_model(str(folder))


def test_a_folder_without_config_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        check_model(str(tmp_path / "empty"))


def test_a_512_position_model_is_refused_with_the_positions_it_lacks(tmp_path):
    m = make_model("llama", len(make_tokenizer()))
    m.config.max_position_embeddings = 512
    folder = _save(tmp_path, "tiny-llama-512", config=m.config)
    with pytest.raises(ModelLoadError, match=r"tiny-llama-512' has 512 positions \(max_position_embeddings\) but "
                                             r"profile 'smoke' needs \d+: problem mmlu-\w+ \(.*line \d+\).*Lower the caps"):
        check_profile_model(load_parameters("smoke", {"model": folder}))


def test_role_table_sequences_count_against_the_context(tmp_path):
    """Caps small enough for the rows: notebook 00's staged training sequences (no caps) are what overflow."""
    m = make_model("llama", len(make_tokenizer()))
    params = load_parameters("smoke", {"n_rows": 1, "n_adapt_eval": 1, "problems": "bank"})
    # the recipe search's four held-out MMLU rows (the smoke profile now scores two): one of them overflows 1400
    params = params.model_copy(update={"adapt_selection": params.adapt_selection.model_copy(update={"n_heldout": 4})})
    m.config.max_position_embeddings = 1400  # above the first bank row's capped sequence, below a held-out row's
    folder = _save(tmp_path, "tiny-llama-1400", config=m.config)
    with pytest.raises(ModelLoadError, match=r"has 1400 positions.*notebook 00's role-table training.*-token "
                                             r"sequence.*give replication_model"):
        check_profile_model(params.model_copy(update={"model": folder}))


def test_make_paper_refuses_a_bert_folder_at_once_and_leaves_nothing(tmp_path, capsys):
    folder = _refused(tmp_path, "tiny-bert", BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2,
                                                        num_attention_heads=2, intermediate_size=64))
    name = f"refused_{tmp_path.name[-12:].replace('-', '_')}"
    profile = tmp_path / f"{name}.yaml"
    profile.write_text(yaml.safe_dump({"profile": name, "base": "smoke", "model": folder}))
    assert paper.main(["--profile", str(profile), "--no-html"]) == 2
    err = capsys.readouterr().err
    assert f"error: profile {name!r}: model {folder!r} cannot be audited" in err and "Traceback" not in err
    for root in (LEDGERS, FIGURES, CHECKPOINTS, BUILD):
        assert not (root / name).exists(), f"a refused model left {root / name}"


def test_the_config_check_reads_no_weights(tmp_path):
    folder = _save(tmp_path, "tiny-qwen2", _family("qwen2"))
    (tmp_path / "tiny-qwen2" / "model.safetensors").unlink()
    assert check_model(folder).model_type == "qwen2"
    assert json.loads((tmp_path / "tiny-qwen2" / "config.json").read_text())["max_position_embeddings"] == LONG


def test_a_gpt2_folder_loads_and_passes_the_self_check(tmp_path):
    lm = load_model(_save(tmp_path, "tiny-gpt2", _gpt2()), "float32")
    assert lm.identity["architecture"] == "GPT2LMHeadModel" and lm.identity["self_check"]


def test_a_replication_model_is_checked_too(tmp_path):
    good = _save(tmp_path, "tiny-llama", _family("llama"))
    short = make_model("llama", len(make_tokenizer()))
    short.config.max_position_embeddings = 512
    folder = _save(tmp_path, "tiny-llama-512", config=short.config)
    with pytest.raises(ModelLoadError, match=r"tiny-llama-512' has 512 positions"):
        check_profile_model(load_parameters("smoke", {"model": good, "replication_model": folder}))
    with pytest.raises(ModelLoadError, match=r"no-such' cannot|no-such': the path"):
        check_profile_model(load_parameters("smoke", {"model": good, "replication_model": str(tmp_path / "no-such")}))
