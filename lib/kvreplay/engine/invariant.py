"""The batched engine under the invariant-kernel contract (``kernels: invariant``): what it refuses, and its step.

Under ``kernels`` other than ``default`` the engine's eager step runs the model inside
:func:`kvreplay.model.kernels.installed`, the kernels the eager decoders run (:func:`kvreplay.decoding.decode.forward`). Under ``invariant-fused`` those are the fused Triton kernels (:mod:`kvreplay.model.kernels_fused`), same code for
one query or many; what follows describes the reference, whose guarantees they share. The linear
layers, the MLP, RMSNorm, the rotary embedding and the LM head run one token row at a time. Attention runs one query
at a time over keys in blocks of :data:`kvreplay.model.kernels.ATTENTION_BLOCK` positions anchored at key 0. The static
cache (:class:`~kvreplay.engine.cache.RowCache`) holds ``max_len`` positions per row; a row's keys beyond its
position are zero padding that its mask hides, and the invariant attention reads them as exact zeros. So it reads
the blocks up to the one holding the row's last visible key, as over the eager decoders' cache of the row's own
length. The choice statistics (:func:`~kvreplay.engine.step.choice_stats`) are maxima, comparisons and one
subtraction per row, exact as they are. So under ``invariant`` a row's logits, choices, margins and keys/values are
those the eager decoders give it alone. Its companions, their lengths, its slot, ``B`` and ``max_len`` change no bit.

:func:`check_engine` refuses, before any row, what the engine does not run under the contract
(:class:`~kvreplay.decoding.contract.ContractError`). The ``graph`` step path: the reference kernels read each row's last
visible key on the host, which a captured graph cannot do. An attention other than ``sdpa``: ``flex`` and
``grouped`` are other reduction orders, and the invariant attention replaces the step's attention. The FP32
readout: copies of the norm and head outside the covered modules, which the eager decoders refuse too. The
ablation values (``invariant-except-<class>``) run; the class left default computes as the model's own kernels do
over the engine's shapes. So such a row may depend on its batch: a diagnostic, and the runner allows only
``invariant`` on the engine (:func:`kvreplay.model.kernels.check_step_path`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..decoding import decode
from ..model import kernels
from ..decoding.contract import ContractError
from ..model.models import LoadedModel


def check_engine(lm: LoadedModel, step_path: str, attention: str, readout: object | None) -> None:
    """Refuse engine settings the ``kernels`` contract of ``lm`` does not cover (nothing under ``default``).

    Raises:
        ContractError: under a ``kernels`` value other than ``default``, naming the setting: ``step_path`` other than
            ``eager``, ``attention`` other than ``sdpa``, or an FP32 ``readout``. Under ``invariant-fused`` the
            ``graph`` path runs: its kernels read nothing on the host while a graph is captured.
        kvreplay.model.kernels.KernelContractError: a model the contract does not cover
            (:func:`kvreplay.model.kernels.check_model`).
    """
    value = decode.kernels_of(lm)
    spec = kernels.parse_kernels(value)
    if spec.default:
        return
    where = (f"kernels {value!r}: the batched engine runs the invariant kernels on its eager step with the model's "
             f"attention call replaced by the invariant one")
    if step_path != "eager" and not (spec.fused and step_path == "graph"):
        raise ContractError(f"{where}; step_path {step_path!r} is not covered (the reference kernels read each row's "
                            f"last visible key on the host, which a CUDA graph cannot replay): use step_path 'eager' "
                            f"('engine-eager' in a profile)")
    if attention != "sdpa":
        raise ContractError(f"{where}; attention {attention!r} is another reduction order over the keys, not covered: "
                            f"use attention 'sdpa' (replaced by the fixed 64-key blocks under this contract)")
    if readout is not None:
        raise ContractError(f"{where}; the FP32 readout runs copies of the norm and LM head that the contract does "
                            f"not cover")
    kernels.check_model(lm.model)


@contextlib.contextmanager
def step_kernels(lm: LoadedModel) -> Iterator[None]:
    """Within the block ``lm``'s model runs under its ``kernels`` value (:func:`kvreplay.model.kernels.installed`;
    nothing changes under ``default``).

    Raises:
        kvreplay.model.kernels.UncoveredOperationError: (inside the block) an operation the contract does not cover ran.
    """
    with kernels.installed(lm.model, decode.kernels_of(lm)):
        yield
