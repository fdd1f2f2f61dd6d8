"""The SwiGLU feed-forward layer (Shazeer, "GLU Variants Improve Transformer", 2020)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speedtronic_models.torch_compat import eager_cpu_training


class _CPUSiluGate(torch.autograd.Function):
    """``silu(gate) * up`` of a fused ``[..., 2 * hidden]`` projection, differentiated by
    hand: it keeps only the projection for backward and writes both halves of its gradient
    in place, where autograd keeps ``silu(gate)`` too and joins the two halves with a copy.
    On a CPU the activation-sized temporaries saved are what makes it faster."""

    @staticmethod
    def forward(ctx: Any, gate_up: Tensor) -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        ctx.save_for_backward(gate_up)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        sigmoid = torch.sigmoid(gate)
        out = torch.empty_like(gate_up)
        grad_gate, grad_up = out.chunk(2, dim=-1)
        torch.mul(gate, sigmoid, out=grad_up)  # silu(gate), for now
        # silu'(gate) = sigmoid + silu * (1 - sigmoid)
        torch.addcmul(sigmoid, grad_up, sigmoid, value=-1, out=grad_gate)
        grad_gate.add_(grad_up).mul_(up).mul_(grad)
        grad_up.mul_(grad)
        return out


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, with gate and up fused into one projection."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the layer to ``x`` ``[..., d_model]``."""
        gate_up = self.gate_up(x)
        if eager_cpu_training(gate_up) and gate_up.requires_grad:
            return self.down(_CPUSiluGate.apply(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)
