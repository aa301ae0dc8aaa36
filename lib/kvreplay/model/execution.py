"""The execution contract: the device and kernel choices that fix a run's numerics, and their record (paper Table 3).

:class:`ExecutionContract` says on which device a run computes, with which SDPA backends, deterministic or not,
with or without TF32, and how many CPU threads. :meth:`ExecutionContract.apply` sets the device, threads, TF32,
matmul precision and deterministic flags in one place before a model is loaded (:func:`kvreplay.model.models.load_model`
calls it) and checks the SDPA backends against the device. The backends themselves are entered around each
forward call (:func:`sdpa_backend_list` with ``torch.nn.attention.sdpa_kernel``: the decoders, the engine, the
training forward and the self-check). What was in force is recorded in every
ledger's ``environment.json`` by :func:`kvreplay.model.models.environment_record`, with the model, the torch and
transformers versions, the device's name and the CPU's kernel ISA (:func:`cpu_isa_flags`, :func:`cpu_name`): BF16
bits depend on all of these.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Sequence
from pathlib import Path

import torch

from . import kernels as _kernels


class DeviceUnavailableError(RuntimeError):
    """The contract asks for a device this machine does not have (``cuda`` where torch sees no GPU)."""


DEVICE_SDPA_BACKENDS = {"cpu": ("math", "flash"), "cuda": ("math", "flash", "efficient", "cudnn")}
"""SDPA backends torch implements per device type (the memory-efficient and cuDNN kernels exist only on CUDA)."""


def set_precision_flags(allow_tf32: bool = False) -> None:
    """TF32 off everywhere unless asked (FP32 means FP32, paper §3.5); float32 matmul precision 'highest' then."""
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32
    torch.set_float32_matmul_precision("high" if allow_tf32 else "highest")


@dataclasses.dataclass(frozen=True)
class ExecutionContract:
    """Device and kernel choices that fix a run's numerics (paper §3.5, Table 3); applied in one place.

    Attributes:
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. Ray row actors
            (:mod:`kvreplay.runner.actors`) each get their own GPU for ``"cuda"``
            (an explicit ``"cuda:N"`` runs in one process only); the ledger
            key holds only the device type.
        sdpa_backends: SDPA backends every forward call may use. The default
            ``("math",)`` kept the two duplicate rows of a step in sync on
            every machine we tried. The fused flash kernel desynced them once on
            a 2-core CPU (FP32, decode step 1; not reproduced later), and a
            backend set with cuDNN attention on an H200 (BF16). :meth:`apply` refuses
            backends the device lacks (see :data:`DEVICE_SDPA_BACKENDS`).
        deterministic: ``torch.use_deterministic_algorithms`` and cuDNN
            deterministic mode; ``None`` means on for CUDA and off for CPU
            (the CPU kernels used here are deterministic already).
        allow_tf32: TF32 for float32 matmuls and convolutions (default off:
            the paper's FP32 arm is true FP32).
        cublas_workspace_config: exported as ``CUBLAS_WORKSPACE_CONFIG`` on
            CUDA when deterministic (cuBLAS needs it for reproducible GEMMs).
        threads: intra-op CPU threads (``torch.set_num_threads``); ``None``
            leaves torch's choice.
        kernels: ``"default"`` (the model's own kernels) or ``"invariant"`` (and its
            ``"invariant-except-<class>"`` ablations): every reducing operation gives a row
            the same bits whatever its call (:mod:`kvreplay.model.kernels`); entered around every
            eager forward call by :func:`kvreplay.decoding.decode.forward` and every engine step
            (:mod:`kvreplay.engine.invariant`).
    """
    device: str = "cpu"
    sdpa_backends: tuple[str, ...] = ("math",)
    deterministic: bool | None = None
    allow_tf32: bool = False
    cublas_workspace_config: str = ":4096:8"
    threads: int | None = None
    kernels: str = _kernels.DEFAULT

    @property
    def device_type(self) -> str:
        """``"cpu"``, ``"cuda"``, ... (:func:`device_type`; ValueError naming a device torch cannot parse)."""
        return device_type(self.device)

    def check_device(self) -> str:
        """The device's type once this machine can run it (:func:`check_device`, with its errors)."""
        return check_device(self.device)

    def resolved_deterministic(self) -> bool:
        return self.device_type == "cuda" if self.deterministic is None else bool(self.deterministic)

    def key(self) -> dict:
        """Entries for a ledger's scientific config: empty for the CPU default, so CPU keys stay as they were."""
        out: dict = {}
        if self.device_type != "cpu":
            out["device"] = self.device_type
            out["cublas_workspace_config"] = self.cublas_workspace_config if self.resolved_deterministic() else None
        if self.resolved_deterministic() != (self.device_type == "cuda"):
            out["deterministic"] = self.resolved_deterministic()
        if self.allow_tf32:
            out["allow_tf32"] = True
        if self.kernels != _kernels.DEFAULT:
            out["kernels"] = self.kernels
        return out

    def apply(self) -> None:
        """Set threads, TF32, matmul precision, deterministic flags and the cuBLAS workspace.

        Raises:
            ValueError: unknown SDPA backend, unknown device type, or an SDPA
                backend that torch does not implement on the device (on CPU only
                ``math`` and ``flash`` exist; ``efficient`` and ``cudnn`` are CUDA-only).
            DeviceUnavailableError: ``cuda`` asked for but not available.
        """
        sdpa_backend_list(self.sdpa_backends)
        kind = self.check_device()
        check_sdpa_on_device(self.sdpa_backends, self.device)
        det = self.resolved_deterministic()
        if kind == "cuda" and det:
            current = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
            if current not in (None, self.cublas_workspace_config):
                raise ValueError(f"CUBLAS_WORKSPACE_CONFIG is {current!r} in the environment, the contract asks for "
                                 f"{self.cublas_workspace_config!r}")
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = self.cublas_workspace_config
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        set_precision_flags(self.allow_tf32)
        torch.use_deterministic_algorithms(det)
        if kind == "cuda":
            # Deterministic mode also fills every new allocation with NaN (a debugging aid that changes no
            # result of a correct kernel) at a launch per tensor: most of a small model's step time.
            torch.utils.deterministic.fill_uninitialized_memory = not det
        torch.backends.cudnn.deterministic = det
        torch.backends.cudnn.benchmark = False
        if kind == "cuda" and torch.device(self.device).index is not None:
            torch.cuda.set_device(torch.device(self.device))


def resolve_contract(*, device: str = "cpu", sdpa_backends: Sequence[str] = ("math",), deterministic: bool | None = None,
                     allow_tf32: bool = False, threads: int | None = None,
                     kernels: str = _kernels.DEFAULT) -> ExecutionContract:
    """The one builder of an :class:`ExecutionContract`, checked before anything is loaded (paper Table 3).

    Arms build theirs through :meth:`kvreplay.runner.ArmSettings.contract`; role-table training, the
    checkpoint metric and :func:`kvreplay.model.models.load_model`'s default come here too.

    Raises:
        ValueError: a device torch cannot parse; an SDPA backend unknown, or missing on the device
            (:func:`check_sdpa_on_device`); ``threads`` below 1; an unknown ``kernels`` value.
    """
    sdpa_backend_list(tuple(sdpa_backends))
    check_sdpa_on_device(sdpa_backends, device)
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be at least 1 (or None: torch's choice), got {threads!r}")
    _kernels.parse_kernels(kernels)
    return ExecutionContract(device=device, sdpa_backends=tuple(sdpa_backends), deterministic=deterministic,
                             allow_tf32=allow_tf32, threads=threads, kernels=kernels)


def device_type(device: str) -> str:
    """The type of a device name: ``"cpu"``, ``"cuda"``, ...

    Raises:
        ValueError: naming a device string torch cannot parse.
    """
    try:
        return torch.device(device).type
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:N'") from e


def check_device(device: str) -> str:
    """The device's type (``"cpu"`` or ``"cuda"``), once this machine can run it.

    Raises:
        ValueError: a device torch cannot parse, or another type than CPU and CUDA.
        DeviceUnavailableError: ``cuda`` asked for but torch sees no CUDA device.
    """
    kind = device_type(device)
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:N'")
    if kind == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailableError(f"device {device!r} asked for, but torch {torch.__version__} sees no CUDA device")
    return kind


def device_or_exit(parser, device: str) -> str:
    """A command line's ``--device``, checked before anything runs (:func:`check_device`): its
    type (``"cpu"``, ``"cuda"``), or ``parser.error`` (exit 2, one line) naming why this machine cannot run it."""
    try:
        return check_device(device)
    except (ValueError, DeviceUnavailableError) as e:
        parser.error(f"--device {device}: {e}")


def check_sdpa_on_device(backends: Sequence[str], device: str) -> None:
    """Refuse SDPA backend names that torch does not implement on ``device`` (see :data:`DEVICE_SDPA_BACKENDS`).

    On CPU only ``math`` and ``flash`` exist; ``efficient`` and ``cudnn`` are CUDA-only. The one rule for
    :meth:`ExecutionContract.apply` and a profile's ``execution`` block.

    Raises:
        ValueError: naming the backends unknown or missing on the device, and those it has; or an unknown device.
    """
    kind = device_type(device)
    allowed = DEVICE_SDPA_BACKENDS.get(kind, ())
    bad = [b for b in backends if b not in allowed]
    if bad:
        raise ValueError(f"SDPA backend(s) {bad} unknown or not on device {device!r}: on {kind} torch implements "
                         f"only {list(allowed)}; choose sdpa_backends among those")


def sdpa_backend_list(names: tuple[str, ...]) -> list:
    """``SDPBackend`` members for backend names such as ``("math",)`` or ``("flash", "efficient")``.

    Raises:
        ValueError: naming an unknown backend.
    """
    from torch.nn.attention import SDPBackend

    table = {
        "math": SDPBackend.MATH,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }
    unknown = [n for n in names if n not in table]
    if unknown or not names:
        raise ValueError(f"unknown SDPA backend(s) {unknown or names}; use some of {sorted(table)}")
    return [table[n] for n in names]


CPU_ISA_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")
"""CPU flags that decide which BF16 and FP32 kernels oneDNN and ATen pick (recorded, never used to choose)."""


def cpu_isa_flags() -> list[str]:
    """The :data:`CPU_ISA_FLAGS` this CPU reports in ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in CPU_ISA_FLAGS if f in have]
    except OSError:
        pass
    return []


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_record(dev: torch.device) -> dict:
    """What fixes a CUDA GPU's BF16 bits besides torch: ``cuda_runtime`` (e.g. ``"13.0"``), ``gpu_capability``
    (``"9.0"``), ``gpu_sm_count`` (streaming multiprocessors, e.g. 132; split-K and tile choices follow it) and
    ``cublas`` (the installed ``nvidia-cublas*`` distribution as ``name==version``, None for a cuBLAS that did not
    come from pip). Every ledger written on a GPU records them (:func:`kvreplay.model.models.environment_record`); ``make verify``
    compares bits where they match (:mod:`kvreplay.verify`).
    """
    from importlib import metadata

    cublas = sorted(f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()
                    if (d.metadata["Name"] or "").lower().startswith("nvidia-cublas"))
    return {"cuda_runtime": torch.version.cuda,
            "gpu_capability": ".".join(map(str, torch.cuda.get_device_capability(dev))),
            "gpu_sm_count": torch.cuda.get_device_properties(dev).multi_processor_count,
            "cublas": cublas[0] if cublas else None}
