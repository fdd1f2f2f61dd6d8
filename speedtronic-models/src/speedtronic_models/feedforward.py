"""The SwiGLU feed-forward layer (Shazeer, "GLU Variants Improve Transformer", 2020)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, with gate and up fused into one projection."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the layer to ``x`` ``[..., d_model]``."""
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)
