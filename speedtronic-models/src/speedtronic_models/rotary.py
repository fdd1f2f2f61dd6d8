"""Rotary position embeddings (Su et al., RoFormer, 2021).

Each head's channels are paired as ``(i, i + head_dim / 2)`` and every pair is rotated by an
angle proportional to the token's position, so the dot product of a rotated query and key
depends only on how far apart they are.

The tables span the whole head: ``cos = [cos, cos]`` and ``sin = [-sin, sin]``, so a rotation
is ``x * cos + swap_halves(x) * sin``: one roll and one fused multiply-add over the whole head,
where rotating each half separately costs four multiplies, two adds and a concatenation (in
the forward pass, and again in the backward pass). On a CPU those small elementwise kernels,
not the arithmetic, are what a rotation costs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from speedtronic_models.torch_compat import is_compiling


class RotaryEmbedding(nn.Module):
    """Cos/sin tables for positions ``0 .. max_seq_len - 1``, computed once at construction.

    The tables are non-persistent buffers: they follow ``.to(device)`` but stay out of the
    state dict, so checkpoints and published weights hold only learned tensors. Copies in
    another dtype (what autocast computes in) are made once per device and dtype and kept.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        # float64 while building: angles for late positions lose digits in float32.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        inv_freq = theta**-exponents
        positions = torch.arange(max_seq_len, dtype=torch.float64)
        # [T, 1, head_dim]: the middle axis broadcasts over heads in [B, T, H, D] layout.
        angles = torch.outer(positions, inv_freq)[:, None, :]
        cos, sin = angles.cos(), angles.sin()
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1).float(), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1).float(), persistent=False)
        # dtype -> (the buffer it was cast from, cos, sin); a moved or re-cast buffer is a new
        # tensor, which invalidates its entry.
        self._casts: dict[torch.dtype, tuple[Tensor, Tensor, Tensor]] = {}

    def forward(
        self, seq_len: int, start: int = 0, dtype: torch.dtype | None = None
    ) -> tuple[Tensor, Tensor]:
        """The ``(cos, sin)`` tables for ``seq_len`` positions from ``start`` (incremental
        decoding starts after the cached positions), in ``dtype`` (default: the buffers')."""
        cos, sin = self.cos, self.sin
        if dtype is not None and dtype != cos.dtype:
            cos, sin = self._cast(dtype)
        return cos[start : start + seq_len], sin[start : start + seq_len]

    def _cast(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if is_compiling():  # a compiled graph folds the cast into its kernels
            return self.cos.to(dtype), self.sin.to(dtype)
        kept = self._casts.get(dtype)
        if kept is None or kept[0] is not self.cos:
            kept = (self.cos, self.cos.to(dtype), self.sin.to(dtype))
            self._casts[dtype] = kept
        return kept[1], kept[2]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` of shape ``[..., T, H, D]`` by the tables of :class:`RotaryEmbedding`."""
    if cos.dtype != x.dtype:  # keeps a bf16 q/k in bf16 with tables of another dtype
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    # roll by D/2 swaps the halves: [x1, x2] -> [x2, x1], the pair partner of every channel.
    # In place on x * cos, a temporary autograd does not keep: one activation-sized tensor
    # fewer to allocate.
    return (x * cos).addcmul_(x.roll(x.shape[-1] // 2, dims=-1), sin)
