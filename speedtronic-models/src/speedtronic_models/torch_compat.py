"""The two newer PyTorch features the model uses, with equivalents for torch 2.1-2.4.

``nn.RMSNorm`` arrived in torch 2.4 and SDPA's ``enable_gqa`` in 2.5. On newer versions the
built-ins are used as they are; older ones get a plain RMSNorm module and key/value heads
repeated to the query head count, which computes the same attention with more memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _probe_gqa() -> bool:
    # SDPA is a C builtin without an inspectable signature: ask it directly, once, at import.
    q = torch.zeros(1, 2, 1, 2)
    kv = torch.zeros(1, 1, 1, 2)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


SDPA_HAS_GQA = _probe_gqa()


class _RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned per-channel scale (torch < 2.4)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (x.float() * scale).type_as(x) * self.weight


RMSNorm: type[nn.Module] = getattr(nn, "RMSNorm", _RMSNorm)


def grouped_sdpa(q: Tensor, k: Tensor, v: Tensor, **kwargs: object) -> Tensor:
    """``scaled_dot_product_attention`` where ``k``/``v`` may have fewer heads than ``q``."""
    n_head, n_kv_head = q.shape[1], k.shape[1]
    if n_head == n_kv_head:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    if SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
    repeat = n_head // n_kv_head
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1), **kwargs
    )
