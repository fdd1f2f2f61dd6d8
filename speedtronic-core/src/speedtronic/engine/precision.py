"""Device and precision resolution: what the hardware can do, and one warning when it can't."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch

from speedtronic.errors import ConfigError

__all__ = [
    "BF16",
    "FP16",
    "FP32",
    "Precision",
    "available_devices",
    "mps_available",
    "resolve_device",
    "resolve_precision",
    "supports",
]

log = logging.getLogger("speedtronic.precision")


def mps_available() -> bool:
    """Whether Apple's Metal backend can be used in this process."""
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def resolve_device(requested: str) -> torch.device:
    """``auto`` -> CUDA, then MPS, then CPU. An explicit device that this machine does not
    have is a :class:`ConfigError` naming what was found: training a long run on the CPU by
    surprise is worse than stopping."""
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    if (requested == "cuda" and not torch.cuda.is_available()) or (
        requested == "mps" and not mps_available()
    ):
        raise ConfigError(
            f"is {requested}, but this machine has no usable {requested.upper()} device "
            f"(found: {', '.join(available_devices())}; torch {torch.__version__}); "
            "set run.device: auto or cpu",
            "run.device",
        )
    return torch.device(requested)


def available_devices() -> list[str]:
    """The device types torch can use here, e.g. ``["cuda", "cpu"]``."""
    found = []
    if torch.cuda.is_available():
        found.append(f"cuda x{torch.cuda.device_count()}")
    if mps_available():
        found.append("mps")
    return [*found, "cpu"]


@dataclass(frozen=True)
class Precision:
    """The resolved precision: the autocast dtype (None = fp32) and whether to scale grads."""

    mode: str
    dtype: torch.dtype | None
    use_grad_scaler: bool

    def autocast(self, device: torch.device) -> Any:
        """The autocast context for forward passes (a no-op for fp32)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.dtype)

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        """A GradScaler for ``device``, enabled only when this precision needs one (fp16)."""
        return torch.amp.GradScaler(device.type, enabled=self.use_grad_scaler)


FP32 = Precision("fp32", None, False)
BF16 = Precision("bf16", torch.bfloat16, False)
FP16 = Precision("fp16", torch.float16, True)


def _cpu_supports(dtype: torch.dtype) -> bool:
    # oneDNN reports whether this CPU has native instructions for the dtype (AVX512-BF16/AMX,
    # AVX512-FP16); without them autocast would run slow emulated kernels.
    probe = {
        torch.bfloat16: "_is_mkldnn_bf16_supported",
        torch.float16: "_is_mkldnn_fp16_supported",
    }[dtype]
    try:
        return bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):
        return False


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether mixed precision with ``dtype`` runs natively on ``device``.

    CUDA: fp16 always, bf16 where ``torch.cuda.is_bf16_supported()``. CPU: where oneDNN has
    native kernels. MPS: not used (its autocast coverage is still partial).
    """
    if device.type == "cuda":
        return dtype == torch.float16 or torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return _cpu_supports(dtype)
    return False


def resolve_precision(mode: str, device: torch.device) -> Precision:
    """``auto`` = bf16 on capable CUDA, fp16 + GradScaler on other CUDA, fp32 on CPU/MPS.

    An explicit ``bf16``/``fp16`` is honoured where :func:`supports` says the device can run
    it (fp16 always comes with a GradScaler), otherwise the run uses fp32 and warns once.
    """
    if mode == "auto":
        if device.type != "cuda":
            return FP32
        return BF16 if supports(device, torch.bfloat16) else FP16
    if mode == "fp32":
        return FP32
    wanted = {"bf16": BF16, "fp16": FP16}.get(mode)
    if wanted is None:
        raise ConfigError(f"unknown mode {mode!r}; use auto, bf16, fp16 or fp32", "precision.mode")
    if supports(device, wanted.dtype):  # type: ignore[arg-type]
        return wanted
    log.warning(
        "precision.mode %s is not supported on this %s device; training in fp32", mode, device.type
    )
    return FP32
