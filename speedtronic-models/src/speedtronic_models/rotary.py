"""Rotary position embeddings (Su et al., RoFormer, 2021).

Each head's channels are paired as ``(i, i + head_dim / 2)`` and every pair is rotated by an
angle proportional to the token's position, so the dot product of a rotated query and key
depends only on how far apart they are.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RotaryEmbedding(nn.Module):
    """Cos/sin tables for positions ``0 .. max_seq_len - 1``, computed once at construction.

    The tables are non-persistent buffers: they follow ``.to(device)`` but stay out of the
    state dict, so checkpoints and published weights hold only learned tensors.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        # float64 while building: angles for late positions lose digits in float32.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        inv_freq = theta**-exponents
        positions = torch.arange(max_seq_len, dtype=torch.float64)
        # [T, 1, head_dim / 2]: the middle axis broadcasts over heads in [B, T, H, D] layout.
        angles = torch.outer(positions, inv_freq)[:, None, :]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, seq_len: int, start: int = 0) -> tuple[Tensor, Tensor]:
        """The ``(cos, sin)`` tables for ``seq_len`` positions from ``start`` (incremental
        decoding starts after the cached positions)."""
        return self.cos[start : start + seq_len], self.sin[start : start + seq_len]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` of shape ``[B, T, H, D]`` by the position angles in ``cos``/``sin``."""
    # Under autocast x is bf16/fp16; matching dtypes keeps the rotation from upcasting q and k.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
