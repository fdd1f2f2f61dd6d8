"""Device and precision resolution: what the hardware can do, and one warning when it can't."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("speedtronic.precision")


def resolve_device(requested: str) -> torch.device:
    """``auto`` -> CUDA, then MPS, then CPU; an explicit device that is absent falls back to CPU
    with a warning."""
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        log.warning("run.device is cuda but CUDA is not available; training on CPU")
        return torch.device("cpu")
    if requested == "mps" and not (
        getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()
    ):
        log.warning("run.device is mps but MPS is not available; training on CPU")
        return torch.device("cpu")
    return torch.device(requested)


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


def _bf16_ok(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def resolve_precision(mode: str, device: torch.device) -> Precision:
    """``auto`` = bf16 on capable CUDA, fp16 + GradScaler on other CUDA, fp32 on CPU/MPS.
    Explicit modes are honoured where the hardware can run them, else fp32 with a warning."""
    if mode == "auto":
        if device.type == "cuda":
            mode = "bf16" if _bf16_ok(device) else "fp16"
        else:
            mode = "fp32"
    if mode == "bf16":
        if _bf16_ok(device):
            return Precision("bf16", torch.bfloat16, False)
        log.warning("precision.mode bf16 is not supported on %s; using fp32", device.type)
        return Precision("fp32", None, False)
    if mode == "fp16":
        if device.type == "cuda":
            return Precision("fp16", torch.float16, True)
        log.warning("precision.mode fp16 needs CUDA (got %s); using fp32", device.type)
        return Precision("fp32", None, False)
    return Precision("fp32", None, False)
