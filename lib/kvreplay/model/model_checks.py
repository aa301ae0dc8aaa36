"""What a model must be before any weight is read: found offline, its config readable, a causal decoder whose every
layer keeps a plain key/value cache and whose ``transformers`` class runs SDPA attention.

:func:`check_model` reads the model's ``config.json`` alone (no weights, no tokenizer) and raises the project's
:class:`~kvreplay.model.layout.ModelLoadError` naming the model, the rule it breaks and what to change. :func:`load_model`
and :func:`load_tokenizer` (:mod:`kvreplay.model.models`) call it first; :func:`kvreplay.notebook.session.check_profile_model`
adds the context-length check when a profile is read. Re-exported by :mod:`kvreplay.model.models`.
"""

from __future__ import annotations

import os
from pathlib import Path

from .layout import _WORKS, ModelLoadError, cache_refusal

EMBEDDED_NAMES = ("embedded", "gemma3")
"""``model`` names of the embedded GGUF models (:data:`kvreplay.model.models.EMBEDDED_MODELS`): their config is the
project's own, digest-checked, so :func:`check_model` does not read it."""


def looks_like_path(model: str) -> bool:
    """True for strings that can only mean a filesystem path (absolute, ``./``, ``../``, ``~``)."""
    return model.startswith(("/", "./", "../", "~")) or model in (".", "..")


def model_source(model: str) -> tuple[str, dict]:
    """Where ``transformers`` reads a non-embedded model from: a folder or hub id, and ``gguf_file`` for a GGUF.

    Raises:
        ModelLoadError: a ``.gguf`` that is not a file, a folder without ``config.json``, or a path that does not
            exist.
    """
    if model.endswith(".gguf"):
        path = Path(model).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"model {model!r}: GGUF file not found: {path}. Give the path of an existing .gguf file")
        return str(path.parent), {"gguf_file": path.name}
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model {model!r}: the folder {path} has no config.json, so it is not a Hugging Face "
                                 "checkpoint. Give the folder that holds config.json, the weights and the tokenizer")
        return str(path), {}
    if looks_like_path(model):
        raise ModelLoadError(f"model {model!r}: the path {path} does not exist. Fix the profile's `model` (a local "
                             "folder with config.json, a .gguf file, or a hub id in the local cache)")
    return model, {}


def read_config(model: str):
    """The ``transformers`` config of a non-embedded model, read offline without weights.

    Raises:
        ModelLoadError: see :func:`model_source`; a ``config.json`` that is not valid JSON or names no known model
            type; a hub id not in the local cache (nothing is downloaded).
    """
    from transformers import AutoConfig

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    source, kwargs = model_source(model)
    try:
        return AutoConfig.from_pretrained(source, **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as e:
        cause = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if Path(source).exists():
            where = Path(source) / "config.json" if not kwargs else Path(source) / kwargs["gguf_file"]
            raise ModelLoadError(f"model {model!r}: its config {where} cannot be read ({cause}). Fix or regenerate "
                                 "the file (it must be valid JSON with a `model_type` transformers knows)") from None
        raise ModelLoadError(f"model {model!r}: there is no local folder of that name and no hub model of that id in "
                             "the local cache (nothing is downloaded). Give 'embedded', 'gemma3', a local folder with "
                             f"config.json, a .gguf file, or a cached hub id ({cause})") from None


def decoder_refusal(config) -> str | None:
    """Why a model of this config is not a causal decoder this protocol can run, or ``None``.

    Refused: an encoder-decoder, a model type without a causal-LM class in ``transformers``, and a bidirectional
    encoder family (one ``transformers`` also gives a masked-LM head, e.g. BERT, RoBERTa) whose config does not set
    ``is_decoder: true``. Decoder-only configs (Llama, Qwen2) carry no ``is_decoder`` flag, so it is not read there.
    """
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    kind = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        return (f"model_type {kind!r} is an encoder-decoder (is_encoder_decoder: true); the protocol decodes one "
                "token sequence with a causal decoder")
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return f"model_type {kind!r} has no causal-LM class in transformers, so it cannot decode greedily here"
    if kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        heads = ", ".join(getattr(config, "architectures", None) or []) or "no architectures listed"
        return (f"model_type {kind!r} ({heads}) is a bidirectional encoder: its config does not set is_decoder: true, "
                "so its tokens attend to later tokens and there is no causal decoder to audit")
    return None


def attention_refusal(config) -> str | None:
    """Why the model class ``transformers`` builds for this config cannot run SDPA attention, or ``None``."""
    from transformers import AutoModelForCausalLM

    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        return None  # decoder_refusal names it
    if not getattr(cls, "_supports_sdpa", False):
        return (f"{cls.__name__} has no SDPA attention in transformers, and every decoder here passes explicit 4-D "
                "masks through SDPA")
    return None


def check_model(model: str, config=None):
    """Refuse, from its config alone, a model the protocol cannot audit; return the config (``None`` for an
    embedded model).

    The rules, in order: it is found offline with a readable config (:func:`read_config`); it is a causal
    decoder (:func:`decoder_refusal`); every layer keeps a plain key/value cache, so no linear-attention, recurrent,
    hybrid or chunked layer (:func:`~kvreplay.model.layout.cache_refusal`); its class runs SDPA (:func:`attention_refusal`).

    Args:
        model: the ``model`` parameter as the user gave it.
        config: its config when already read (skips :func:`read_config`).

    Raises:
        ModelLoadError: naming the model, the rule and what would work.
    """
    if model in EMBEDDED_NAMES:
        return None
    config = config if config is not None else read_config(model)
    reason = decoder_refusal(config) or cache_refusal(config) or attention_refusal(config)
    if reason is not None:
        raise ModelLoadError(f"model {model!r} cannot be audited by this protocol: {reason}. {_WORKS}")
    return config
