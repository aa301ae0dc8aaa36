"""Loading any model through the one `model` parameter, offline (the embedded model, local folders, GGUF files)."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_CAPS, TINY_FORMAT, make_model, make_tokenizer, tiny_lm
from kvreplay.decoding import decode
from kvreplay.decoding.contract import Caps, resolve_format
from kvreplay.model.execution import ExecutionContract
from kvreplay.model.models import (
    SELF_CHECK_RATIO,
    ModelLoadError,
    cache_refusal,
    environment_record,
    load_model,
    self_check,
)
from kvreplay.runner import model_key


@pytest.fixture
def qwen_dir(tmp_path):
    tok = make_tokenizer()
    m = make_model("qwen2", len(tok))
    m.save_pretrained(tmp_path / "tiny-qwen2")
    tok.save_pretrained(tmp_path / "tiny-qwen2")
    return tmp_path / "tiny-qwen2"


def test_local_folder_loads_and_decodes(qwen_dir):
    lm = load_model(str(qwen_dir), "float32")
    assert type(lm.model).__name__ == "Qwen2ForCausalLM"
    assert lm.identity["weights_sha256"] and lm.identity["layers"] == 2
    fmt = resolve_format(lm.tokenizer, TINY_FORMAT)
    live = decode.decode_live(lm, fmt, fmt.prompt_ids("Q?", ["a", "b"]), TINY_CAPS)
    assert live.cache.layers[0].keys.shape[:3] == (2, 2, len(live.ids))
    bf = load_model(str(qwen_dir), "bfloat16")
    assert bf.model.dtype == torch.bfloat16 and bf.identity["weights_sha256"] != lm.identity["weights_sha256"]
    assert model_key(str(qwen_dir))["files"]["config.json"]


def test_unknown_model_gives_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="unknown model"):
        model_key(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"), "float32")
    assert model_key("gpt2") == {"model": "gpt2"}  # a hub id (loading it needs the local cache)
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path), "float32")
    with pytest.raises(ModelLoadError, match="no hub model of that id in the local cache"):
        load_model("no-such-org/no-such-model", "float32")
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_model("embedded", "float8")
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_model(str(tmp_path / "x.gguf"), "float32")


def test_environment_record_records_the_numerical_contract(qwen_dir):
    lm = load_model(str(qwen_dir), "float32", contract=ExecutionContract(sdpa_backends=("math",)))
    c = environment_record(lm, threads=1)
    assert c["tf32_matmul"] is False and c["tf32_cudnn"] is False
    assert c["float32_matmul_precision"] == "highest"
    assert c["dtype"] == "float32" and c["attn_implementation"] == "sdpa"
    assert c["sdpa_backends_used"] == ["math"] and c["requested_threads"] == 1
    for key in ("torch", "transformers", "device_name", "deterministic_algorithms", "sdpa_backends", "model"):
        assert key in c
    with pytest.raises(ValueError, match="unknown SDPA backend"):
        load_model(str(qwen_dir), "float32", contract=ExecutionContract(sdpa_backends=("fastest",)))


def test_bench_runs_and_reports_ratios(qwen_dir):
    import ray
    from kvreplay.bench import run

    table = run(model=str(qwen_dir), dtype="float32", tokens=4, repeats=1, threads=1, caps=(3, 4, 2), workers=2)
    assert table.loc["2 actors / one process (throughput ratio)", "value"] > 0
    assert table.loc["Ray cluster", "value"] == "local, started here"
    assert not ray.is_initialized()  # the bench shut down the cluster it started
    assert table.loc["Ray cluster start-up or join (s)", "value"] > 0
    assert table.loc["2 Ray actors start-up, model loaded (s)", "value"] > 0
    assert table.loc["suffix decoder / generate (per-token ratio)", "value"] > 0
    assert table.loc["Experiment 1 rows per hour, one process", "value"] > 0


def test_bench_engine_section_runs_on_the_cpu_eager_step(qwen_dir):
    from kvreplay.bench import engine_table
    from kvreplay.runner import ArmSettings

    lm, fmt = ArmSettings(profile="bench", dtype="float32", caps=Caps(3, 4, 2), model=str(qwen_dir), threads=1).load()
    kw = dict(tokens=3, batches=(1, 2), branch_cap=3, exp1_caps=((3, 4, 2),), exp1_batch=2, compile_=False, repeats=1,
              step_path="eager")
    table = engine_table(lm, fmt, max_lens=(None, 1000), **kw)
    engine_rows = table[table["path"].str.startswith("engine.decode_suffixes")]
    assert list(engine_rows["B"]) == [1, 2, 1, 2] and (engine_rows["ms per problem-step"] > 0).all()
    assert engine_rows["note"].str.contains("sdpa math").all()
    assert engine_rows["note"].str.contains("max_len 1000,").tolist() == [False, False, True, True]
    exp1 = table[table["path"].str.startswith("Experiment 1")]
    assert exp1["note"].str.contains(", 0 gate failures").all() and (exp1["rows per hour"] > 0).all()
    with pytest.raises(ValueError, match="max_len=5 is shorter than the"):
        engine_table(lm, fmt, max_lens=(None, 5), **kw)


@pytest.mark.parametrize("args, says", [
    (["--engine-only"], "--step-path graph, --device cpu: "),  # --engine-only implies the engine section
    (["--engine", "--step-path", "engine-eager", "--batches", "1", "0"], "--batches 0, "),
    (["--engine", "--step-path", "engine-eager", "--exp1-batch", "0"], "--exp1-batch 0, "),
    (["--engine", "--step-path", "engine-eager", "--sdpa", "efficient"], "['efficient'] unknown or not on device 'cpu'"),
    (["--engine", "--step-path", "engine-eager", "--max-len", "-3"], "--max-len"),
])
def test_bench_refuses_bad_engine_arguments_before_any_work(args, says, capsys):
    from kvreplay.bench import main

    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and says in err, err
    if "--step-path graph" in says:
        assert "it needs device 'cuda'" in err
    if "batch" in says:
        assert "at least 1, got 0" in err


@pytest.mark.parametrize("backend", ["efficient", "cudnn"])
def test_cuda_only_sdpa_backend_is_refused_on_cpu(backend):
    contract = ExecutionContract(device="cpu", sdpa_backends=("math", backend))
    with pytest.raises(ValueError, match=rf"SDPA backend\(s\) \['{backend}'\] unknown or not on device 'cpu'"):
        contract.apply()
    ExecutionContract(device="cpu", sdpa_backends=("math", "flash")).apply()  # both exist on CPU


def _save(model, tmp_path, name):
    tok = make_tokenizer()
    model.save_pretrained(tmp_path / name)
    tok.save_pretrained(tmp_path / name)
    return tmp_path / name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_self_check_passes_on_models_that_honour_mask_and_positions(arch, dtype):
    result = self_check(tiny_lm(arch, dtype))
    assert result["passed"] and result["dtype"] == str(dtype).removeprefix("torch.")
    assert result["hidden_vs_visible"] > 0.05  # hiding one token moves the last logits clearly
    assert result["hidden_vs_removed"] <= SELF_CHECK_RATIO * result["hidden_vs_visible"]
    assert result["hidden_vs_shifted_steps"] > 0 and result["shifted_vs_shifted_steps"] > 0  # positions matter
    assert result["schedule"][0] > 1 and result["schedule"][1:] == [1] * (result["tokens"] - result["schedule"][0])


def test_load_model_records_the_self_check(qwen_dir):
    lm = load_model(str(qwen_dir), "bfloat16")
    check = lm.identity["self_check"]
    assert check["passed"] and check["dtype"] == "bfloat16" and check["hidden_vs_visible"] > 0
    assert environment_record(lm)["model"]["self_check"] == check  # lands in every ledger's environment


def _ignoring(model, **replace):
    """Wrap ``model.forward`` so the given keyword arguments are replaced (by value or by a function of the call)."""
    forward = model.forward

    def patched(*args, **kwargs):
        for key, value in replace.items():
            kwargs[key] = value(kwargs) if callable(value) else value
        return forward(*args, **kwargs)

    model.forward = patched
    return model


def _arange_positions(kwargs):
    past = kwargs["past_key_values"].get_seq_length()
    q = kwargs["inputs_embeds"].shape[1]
    return torch.arange(past, past + q).unsqueeze(0)


def test_self_check_fails_when_the_4d_mask_is_ignored(arch):
    lm = tiny_lm(arch)
    _ignoring(lm.model, attention_mask=None)  # transformers then builds its own causal mask
    with pytest.raises(ModelLoadError, match=r"ignores the explicit attention mask or position IDs it is given \(hiding a token with the mask changed nothing\).*transformers"):
        self_check(lm)


def test_self_check_fails_when_position_ids_are_ignored(arch):
    lm = tiny_lm(arch)
    _ignoring(lm.model, position_ids=_arange_positions)
    with pytest.raises(ModelLoadError, match=r"ignores the explicit attention mask or position IDs it is given \(moving "
                                             r"the position IDs of the one-token calls changed nothing; moving the "
                                             r"position IDs inside the multi-token call changed nothing\)"):
        self_check(lm)


@pytest.mark.parametrize("calls", ["one-token", "multi-token"])
def test_self_check_fails_when_position_ids_are_ignored_in_one_kind_of_call(calls):
    lm = tiny_lm("qwen2")
    one = calls == "one-token"
    _ignoring(lm.model, position_ids=lambda kw: _arange_positions(kw) if (kw["inputs_embeds"].shape[1] == 1) == one
              else kw["position_ids"])
    with pytest.raises(ModelLoadError, match=f"moving the position IDs (of|inside) the {calls} call"):
        self_check(lm)


def test_self_check_fails_when_the_mask_is_ignored_only_in_one_token_calls():
    lm = tiny_lm("llama")
    _ignoring(lm.model, attention_mask=lambda kw: None if kw["inputs_embeds"].shape[1] == 1 else kw["attention_mask"])
    with pytest.raises(ModelLoadError, match="does not match removing it"):
        self_check(lm)


def test_load_model_refuses_a_model_that_ignores_the_mask(tmp_path, monkeypatch):
    from transformers import LlamaForCausalLM

    folder = _save(make_model("llama", len(make_tokenizer())), tmp_path, "tiny-llama")
    forward = LlamaForCausalLM.forward
    monkeypatch.setattr(LlamaForCausalLM, "forward", lambda self, *a, **kw: forward(self, *a, **(kw | {"attention_mask": None})))
    with pytest.raises(ModelLoadError, match=r"tiny-llama.*failed the load self-check.*cannot audit"):
        load_model(str(folder), "float32")


def test_sliding_window_model_loads_with_its_layout(tmp_path):
    """A Mistral with a sliding window, refused before sliding windows were defined under role visibility, loads: its
    every layer keeps all positions and slides by the mask (tests/test_sliding_window.py checks the constructions)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=len(make_tokenizer()), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=32)
    folder = _save(MistralForCausalLM(config), tmp_path, "tiny-mistral")
    lm = load_model(str(folder), "float32")
    assert lm.identity["attention"] == {"layer_types": ["sliding", "sliding"], "sliding_window": 32}
    assert lm.identity["self_check"]["window"] == 32 and lm.layout.windows == (32, 32)


def test_linear_attention_model_is_refused_at_load(tmp_path):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=len(make_tokenizer()), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"],
    )
    folder = _save(Qwen3NextForCausalLM(config), tmp_path, "tiny-qwen3-next")
    with pytest.raises(ModelLoadError, match=r"tiny-qwen3-next.*linear_attention \(layer 0 of 2\).*no KV cache"):
        load_model(str(folder), "float32")


def test_cache_refusal_reads_the_layer_types_and_the_cache_layers():
    from transformers import LlamaConfig, Qwen2Config

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    assert cache_refusal(LlamaConfig(**small)) is None
    # Qwen2 configs carry sliding_window while use_sliding_window=False: not used, so fine
    assert cache_refusal(Qwen2Config(**small, sliding_window=32, use_sliding_window=False)) is None
    used = Qwen2Config(**small, sliding_window=32, use_sliding_window=True, max_window_layers=1)
    assert used.layer_types == ["full_attention", "sliding_attention"]
    assert cache_refusal(used) is None  # a sliding layer keeps all positions in the decoders' cache
    chunked = LlamaConfig(**small)
    chunked.layer_types = ["full_attention", "chunked_attention"]
    chunked.attention_chunk_size = 16
    assert "attention_chunk_size=16" in cache_refusal(chunked)
    odd = LlamaConfig(**small)
    odd.layer_types = ["full_attention", "deepseek_sparse_attention"]
    assert "deepseek_sparse_attention" in cache_refusal(odd)


def _read_each_gguf_once(monkeypatch) -> dict:
    """Make ``transformers`` read each GGUF file once (model and tokenizer): a later ``from_pretrained`` of the same
    file gets the objects of the first read. Returns the reads, by class, folder and file name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reads: dict = {}
    for cls in (AutoModelForCausalLM, AutoTokenizer):
        def from_pretrained(source, *args, _cls=cls, _real=cls.from_pretrained, **kwargs):
            if "gguf_file" not in kwargs:
                return _real(source, *args, **kwargs)
            key = (_cls.__name__, str(source), kwargs["gguf_file"])
            if key not in reads:
                reads[key] = _real(source, *args, **kwargs)
            return reads[key]
        monkeypatch.setattr(cls, "from_pretrained", from_pretrained)
    return reads


def test_embedded_checkpoint_is_the_gguf_converted_once(tmp_path, monkeypatch):
    """The cached folder gives the GGUF's weights, self-check, tokens and chat template; a damaged copy is rebuilt.

    ``transformers`` reads the GGUF once (about 20 s on 2 cores): the GGUF load and the rebuild get what the
    conversion's read made of it, so the folder is compared with the GGUF as ``transformers`` reads it."""
    import json

    from kvreplay.model import models
    from kvreplay.data.problems import load_bank

    reads = _read_each_gguf_once(monkeypatch)
    monkeypatch.setenv(models.MODEL_CACHE_ENV, str(tmp_path))
    folder = models.embedded_checkpoint()
    assert len(reads) == 2, sorted(reads)  # the conversion read the GGUF's model and tokenizer
    assert folder.parent == tmp_path and (folder / "model.safetensors").is_file()
    contract = ExecutionContract(threads=2)
    via_folder = load_model("embedded", "float32", contract=contract)
    via_gguf = load_model(str(models.embedded_model_path()), "float32", contract=contract)  # transformers reads the GGUF
    for k in ("weights_sha256", "self_check", "layers", "heads", "kv_heads", "head_dim"):
        assert via_folder.identity[k] == via_gguf.identity[k], k
    texts = [p.question + "\n" + "\n".join(p.options) for p in load_bank()[:40]]
    assert [via_folder.tokenizer(t)["input_ids"] for t in texts] == [via_gguf.tokenizer(t)["input_ids"] for t in texts]
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": texts[0]}]
    assert via_folder.tokenizer.apply_chat_template(msgs, add_generation_prompt=True) == \
        via_gguf.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)

    assert len(reads) == 2, sorted(reads)  # the GGUF load was handed the conversion's read

    weights = folder / "model.safetensors"
    converted = models.file_sha256(weights)
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # a damaged cache is found by its digest and converted again
    weights.write_bytes(bytes(data))
    assert models.embedded_checkpoint() == folder
    assert models.file_sha256(weights) == converted == \
        json.loads((folder / "conversion.json").read_text())["model_safetensors_sha256"]
    assert bytes(data) != weights.read_bytes()


def test_a_bpe_tokenizer_decodes_without_the_ignored_cleanup_warning(capsys):
    """transformers ignores clean_up_tokenization_spaces for BPE and warns on every decode: it is turned off there
    (same text), and kept on for a WordPiece tokenizer, where it changes the text."""
    from conftest import make_tokenizer
    from kvreplay.model.models import without_ignored_cleanup
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = make_tokenizer()
    tok.clean_up_tokenization_spaces = True
    ids = tok.encode("a , b .")
    before = tok.decode(ids)
    assert without_ignored_cleanup(tok) is tok and tok.clean_up_tokenization_spaces is False
    assert tok.decode(ids) == before
    forced = make_tokenizer()
    forced.clean_up_tokenization_spaces = True
    forced.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    assert without_ignored_cleanup(forced).clean_up_tokenization_spaces is True  # its config asks for the cleanup
    wp = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, ",": 2}, unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece = PreTrainedTokenizerFast(tokenizer_object=wp, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    assert without_ignored_cleanup(wordpiece).clean_up_tokenization_spaces is True
