"""Shared fixtures: tiny random-weight Llama and Qwen2 models, and sliding-window Gemma 3 and Mistral ones, with an
in-memory byte-level tokenizer."""

from __future__ import annotations

import os
import sys

# Idle OpenMP threads sleep instead of spinning (read once, when torch loads its OpenMP runtime: before the import
# below). The Makefile exports the same for `make test`; this covers a plain pytest, and the notebook kernels, Ray
# workers and subprocesses the tests start inherit it. It changes no bit (tests/test_golden_rows.py passes under it).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The fused invariant kernels (kvreplay.model.kernels_fused, tests/test_kernels_fused.py) run under Triton's CPU
# interpreter, which triton reads when it is first imported (some import below may bring it in): set here, first.
# TRITON_INTERPRET=0 in the environment keeps compiled kernels (a CUDA machine).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from kvreplay.decoding.contract import Caps, resolve_format  # noqa: E402
from kvreplay.model.models import LoadedModel  # noqa: E402
from kvreplay.paths import LEDGERS as ROOT_LEDGERS  # noqa: E402
from kvreplay.data.problems import Problem  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

pytest_plugins = ["pytester"]  # tests/test_gate_registry.py runs a planted test file

torch.set_num_threads(1)  # tiny models: one thread is fastest and avoids oversubscription

CHATML = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
)

# A short format so byte-level prompts stay small.
TINY_FORMAT = {
    "name": "tiny-test",
    "kind": "chat_template",
    "system": "S",
    "question": "{question}\n{options}",
    "branches": ["b1", "b2", "b3"],
    "merge": "m",
    "answer": "a",
    "answer_prefix": "Ans:",
}

COMMITTED_PROFILES = ("cpu", "gemma", "gemma_smoke", "gpu", "own", "paper", "smoke")
"""The profile files committed under notebooks/params/ (tests/test_own_model.py writes a user's own there while it runs)."""

TINY_CAPS = Caps(branch=5, merge=6, answer=3)


def tracked(pattern: str) -> list[Path]:
    """The files git tracks that match ``pattern`` (a glob relative to the repository, ``*`` within one folder), sorted.

    Tests that read committed data go through this: a user's own profile, its ledgers and a refused run's leftovers
    are untracked, so they never fail ``make test``. Outside a git checkout (an unpacked archive) every match counts.
    """
    import subprocess

    from kvreplay.paths import ROOT

    run = subprocess.run(["git", "ls-files", "-z", "--", f":(glob){pattern}"], cwd=ROOT, capture_output=True)
    if run.returncode != 0:
        return sorted(ROOT.glob(pattern))
    return sorted(ROOT / name for name in run.stdout.decode().split("\0") if name)


def committed_profiles() -> list[str]:
    """The profile folders under ``data/ledgers/`` that hold a committed file (see :func:`tracked`)."""
    return sorted({path.relative_to(ROOT_LEDGERS).parts[0] for path in tracked("data/ledgers/**")})

TINY_WINDOW = 8
"""Sliding window of the tiny Gemma 3 and Mistral models: every boundary prefix of the tiny format is several times longer."""
GEMMA3_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def make_tokenizer(chat_template: bool = True) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: 3 special tokens + 256 byte tokens, no merges."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", bos_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    if chat_template:
        tok.chat_template = CHATML
    return tok


def make_model(arch: str, vocab: int, seed: int = 0, window: int = TINY_WINDOW) -> torch.nn.Module:
    """A 2-layer random-weight causal LM (GQA: 4 heads, 2 KV heads, head dim 16).

    ``gemma3``: 4 layers, sliding window :data:`TINY_WINDOW` on layers 0, 1 and 3, full attention on layer 2 (local
    RoPE base 10,000, global 1e6, QK-norm, scaled embeddings); ``mistral``: 2 layers, both with the window
    (``window`` changes it; the weights do not depend on it).
    """
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    if arch == "llama":
        m = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        m = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))
    elif arch == "gemma3":
        m = Gemma3ForCausalLM(Gemma3TextConfig(
            **(common | {"num_hidden_layers": len(GEMMA3_LAYER_TYPES)}), head_dim=16, query_pre_attn_scalar=16,
            sliding_window=window, layer_types=GEMMA3_LAYER_TYPES, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))
    elif arch == "mistral":
        m = MistralForCausalLM(MistralConfig(**common, head_dim=16, sliding_window=window))
    else:
        raise ValueError(arch)
    m.config._attn_implementation = "sdpa"
    # Random init gives near-uniform logits; sharpen them so greedy choices are well separated.
    with torch.no_grad():
        m.get_input_embeddings().weight.mul_(20.0)
    return m.eval()


def tiny_lm(arch: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 0, role_table=None,
            window: int = TINY_WINDOW) -> LoadedModel:
    tok = make_tokenizer()
    m = make_model(arch, len(tok), seed, window).to(dtype)
    return LoadedModel(model=m, tokenizer=tok, dtype=dtype, role_table=role_table, identity={"model": f"tiny-{arch}"})


@pytest.fixture(params=["llama", "qwen2"])
def arch(request) -> str:
    return request.param


@pytest.fixture(params=["gemma3", "mistral"])
def windowed_arch(request) -> str:
    """A tiny model with sliding-window layers: Gemma 3 (mixed local/global layers) or Mistral (every layer)."""
    return request.param


@pytest.fixture
def tiny_format():
    return lambda lm: resolve_format(lm.tokenizer, TINY_FORMAT)


def tiny_problems(n: int = 3) -> list[Problem]:
    out = []
    for i in range(n):
        out.append(
            Problem(
                problem_id=f"tiny-{i:02d}", source="test", source_line=i + 1, question=f"Q{i}?",
                options=("x", "y", f"z{i}", "w"), answer="ABCD"[i % 4],
            )
        )
    return out


def key_paths(obj, prefix: str = "") -> set[str]:
    """Every key path of nested dicts (list items share their list's path): a record's layout."""
    out = {prefix}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out |= key_paths(v, f"{prefix}.{k}")
    elif isinstance(obj, list):
        for v in obj:
            out |= key_paths(v, f"{prefix}[]")
    return out


# ----------------------------------------------------------------------------- progress of long tests

HEARTBEAT_S = float(os.environ.get("KVREPLAY_TEST_HEARTBEAT_S", "60"))
"""A test (setup, call and teardown together) that runs longer than this prints a line to the terminal every
``HEARTBEAT_S`` seconds, whatever pytest captures: `make test` never sits silent for minutes. 0 turns it off."""


def _terminal(config):
    """``write(line)`` on the terminal past pytest's output capture, or ``None`` with the terminal plugin off.

    In a pytest-xdist worker (``make test`` runs two) there is no terminal reporter: the line goes to the worker's
    standard error, which is the terminal of the ``pytest`` that started it, tagged with the worker's name."""
    tr = config.pluginmanager.get_plugin("terminalreporter")
    capman = config.pluginmanager.get_plugin("capturemanager")
    worker = getattr(config, "workerinput", {}).get("workerid")
    if tr is None and worker is None:
        return None

    def emit(line: str) -> None:
        if worker is None:
            tr.write_line(line)
        else:
            sys.stderr.write(f"[{worker}] {line.lstrip()}\n")
            sys.stderr.flush()

    def write(line: str) -> None:
        if capman is None:
            emit(line)
            return
        with capman.global_and_fixture_disabled():
            emit(line)
    return write


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import threading
    import time

    tr = _terminal(item.config)
    stop = threading.Event()
    _PHASE[item.nodeid] = ("setup", time.monotonic())
    if tr is not None and HEARTBEAT_S > 0:
        def beat():
            while not stop.wait(HEARTBEAT_S):
                phase, since = _PHASE.get(item.nodeid, ("call", time.monotonic()))
                tr(f"  [{HEARTBEAT_WORDS[phase]} {time.monotonic() - since:.0f} s] {item.nodeid}")

        threading.Thread(target=beat, name="test-heartbeat", daemon=True).start()
    try:
        yield
    finally:
        stop.set()
        _PHASE.pop(item.nodeid, None)


_PHASE: dict[str, tuple[str, float]] = {}
"""A running test's phase (``setup``, ``call``, ``teardown``) and when it began: the heartbeat names it, so a fixture
torn down after a test has finished (a module's notebook chain, a JupyterLab server) is not read as that test still
running."""

HEARTBEAT_WORDS = {"setup": "setting up its fixtures for", "call": "still running after",
                   "teardown": "test done; tearing down its fixtures for"}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    import time

    _PHASE[item.nodeid] = ("setup", time.monotonic())
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    import time

    _PHASE[item.nodeid] = ("teardown", time.monotonic())
    yield


@pytest.fixture(scope="session")
def progress(pytestconfig):
    """``progress(message)``: one line on the terminal at once, past pytest's capture (what a long test is doing)."""
    tr = _terminal(pytestconfig)

    def say(message: str) -> None:
        if tr is not None:
            tr(f"  [{message}]")
    return say


FIRST = ("test_notebooks.py", "test_browser.py", "test_own_model.py", "test_parallel.py", "test_models.py",
         "test_golden_rows.py", "test_live_check.py", "test_provenance_pages.py", "test_ledger.py", "test_static_types.py",
         "test_progress.py", "test_gemma.py", "test_engine_row_digests.py", "test_batched_experiments.py",
         "test_honest_endpoints.py", "test_paper_cli.py", "test_kernel_ablation.py")
"""Test files that run first, longest first (the files that took longest in a full run): the notebook chain (by far the
longest), the explorer in a browser, the README's own-model example through `make paper`, then the other long
ones. ``make test``
spreads files over two pytest-xdist workers in this order (``--dist loadfile``). So the chain starts at once on one
worker while the other takes everything else, and the run ends on short files, not on a long one with a worker idle."""


def pytest_collection_modifyitems(config, items):
    """Test files in :data:`FIRST` go first (the order of the rest is kept). Tests marked ``slow`` (the Gemma 3 smoke
    chain) run only with ``KVREPLAY_SLOW=1``: not in the default CI run."""
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))
    if os.environ.get("KVREPLAY_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set KVREPLAY_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test marked ``@pytest.mark.gate(name)`` fails unless a :class:`~kvreplay.gates.GateError` of that gate is
    raised while it runs (in this process, or in a Ray actor and unpickled here): its planted fault must make that
    gate fire. ``tests/test_gate_registry.py`` checks that every registered gate has such a test."""
    import time

    _PHASE[item.nodeid] = ("call", time.monotonic())
    names = [m.args[0] for m in item.iter_markers("gate")]
    if not names:
        return (yield)
    from kvreplay import gates

    unknown = [n for n in names if n not in gates.GATES]
    if unknown:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.gate names unregistered gates {unknown}")
    fired: list[str] = []
    init = gates.GateError.__init__

    def record(self, gate, reason):
        init(self, gate, reason)
        fired.append(gate)

    gates.GateError.__init__ = record
    try:
        result = yield
    finally:
        gates.GateError.__init__ = init
    silent = [n for n in names if n not in fired]
    assert not silent, f"{item.nodeid}: its planted fault never made gate(s) {silent} fire (fired: {sorted(set(fired))})"
    return result


@pytest.fixture
def tiny_arm(tmp_path, request):
    """A factory of :class:`~kvreplay.runner.ArmSettings` on a tiny random Llama saved under ``tmp_path`` and the
    tiny block format (caps :data:`TINY_CAPS`, one thread, one preflight row): ``tiny_arm(**fields)`` overrides any
    field. The dtype defaults to the test module's ``TINY_ARM_DTYPE``, ``"float32"`` where it sets none."""
    from kvreplay.runner import ArmSettings

    tok = make_tokenizer()
    make_model("llama", len(tok)).save_pretrained(tmp_path / "tiny-llama")
    tok.save_pretrained(tmp_path / "tiny-llama")
    fmt = tmp_path / "tiny.yaml"
    fmt.write_text(yaml.safe_dump(TINY_FORMAT))
    base = dict(profile="t", dtype=getattr(request.module, "TINY_ARM_DTYPE", "float32"), caps=TINY_CAPS,
                model=str(tmp_path / "tiny-llama"), fmt=str(fmt), threads=1, preflight=1)

    def settings(**fields):
        return ArmSettings(**(base | fields))

    return settings
