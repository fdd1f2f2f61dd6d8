"""RMSNorm with a lean backward pass on the CPU.

PyTorch's ``F.rms_norm`` has a fused forward kernel on the CPU but no backward kernel there:
autograd differentiates it as a chain of about a dozen elementwise operations, each writing a
new activation-sized tensor. On a CPU those allocations (fresh pages, first touched) cost more
than the arithmetic: a step of a small model spent more in RMSNorm than a GPT-2 spends in its
LayerNorms. :class:`RMSNorm` differentiates it by hand in three such tensors instead, on the
CPU in eager mode; elsewhere (CUDA, ``torch.compile``, autocast) it is ``F.rms_norm`` as is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speedtronic_models.torch_compat import eager_cpu_training

_FUSED = getattr(torch.ops.aten, "_fused_rms_norm", None)
HAS_RMS_NORM = hasattr(F, "rms_norm")  # torch >= 2.4


class _CPURMSNorm(torch.autograd.Function):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last axis, forward and backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if _FUSED is not None:
            y, rstd = _FUSED(x, [x.shape[-1]], weight, eps)
        else:
            rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))
            y = x * rstd * weight
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        # With n = x_hat = x * rstd and g' = grad * weight:
        #   d weight = sum over rows of grad * x_hat
        #   d x      = rstd * (g' - x_hat * mean(g' * x_hat))
        x_hat = x * rstd
        product = grad * x_hat
        grad_weight = product.flatten(0, -2).sum(0)
        dot = product.mul_(weight).mean(-1, keepdim=True)
        grad_x = (grad * weight).sub_(x_hat.mul_(dot)).mul_(rstd)
        return grad_x, grad_weight, None


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned per-channel scale (``weight``), the
    same parameters and results as ``torch.nn.RMSNorm``."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """Normalise ``x`` ``[..., dim]``."""
        if eager_cpu_training(x) and (x.requires_grad or self.weight.requires_grad):
            return _CPURMSNorm.apply(x, self.weight, self.eps)
        if HAS_RMS_NORM:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (x.float() * scale).type_as(x) * self.weight

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
