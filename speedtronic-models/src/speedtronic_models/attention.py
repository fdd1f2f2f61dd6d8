"""Causal grouped-query self-attention on top of ``scaled_dot_product_attention``."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from speedtronic_models.config import TransformerConfig
from speedtronic_models.kv_cache import LayerCache
from speedtronic_models.rotary import apply_rotary
from speedtronic_models.torch_compat import grouped_sdpa


class GroupedQueryAttention(nn.Module):
    """Self-attention where ``n_head`` query heads share ``n_kv_head`` key/value heads.

    Fewer key/value heads shrink the K/V projections (and an inference KV cache); with
    ``n_kv_head == n_head`` this is ordinary multi-head attention. Queries, keys and values
    come from one fused projection so the forward pass runs one matmul instead of three.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        qkv_heads = config.n_head + 2 * config.n_kv_head
        self.qkv = nn.Linear(config.d_model, qkv_heads * config.head_dim, bias=False)
        self.out = nn.Linear(config.n_head * config.head_dim, config.d_model, bias=False)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> Tensor:
        """Attend over ``x`` ``[B, T, d_model]``; ``mask`` (``True`` = may attend) replaces the
        plain causal pattern when the batch carries padding.

        With ``cache`` (incremental decoding) ``x`` holds the positions after the cached ones:
        their keys and values are stored, and their queries attend to every cached position
        too. ``cos``/``sin`` must then be the tables of those later positions.
        """
        batch, seq_len, _ = x.shape
        qkv = self.qkv(x).view(batch, seq_len, -1, self.head_dim)
        qk, v = qkv.split((self.n_head + self.n_kv_head, self.n_kv_head), dim=2)
        # Queries and keys rotate in one pass (half the kernels of two). SDPA wants
        # [B, H, T, D]; rotating first lets cos/sin broadcast over heads as stored.
        q, k = apply_rotary(qk, cos, sin).split((self.n_head, self.n_kv_head), dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # Without a mask SDPA builds causality into the kernel: no [T, T] tensor at all.
        is_causal = mask is None
        if cache is not None:
            past = cache.cache.length
            k, v = cache.update(k, v)
            if past:
                # Every cached position is visible; among the new ones causality still holds
                # (SDPA's is_causal would align the triangle top-left, which is wrong here).
                is_causal = False
                mask = None if seq_len == 1 else _offset_causal_mask(seq_len, past, x.device)
        y = grouped_sdpa(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal,
        )
        return self.out(y.transpose(1, 2).reshape(batch, seq_len, -1))


def _offset_causal_mask(seq_len: int, past: int, device: torch.device) -> Tensor:
    """``[T, past + T]`` boolean mask: new query ``i`` sees keys ``0 .. past + i``."""
    keys = torch.arange(past + seq_len, device=device)
    queries = torch.arange(past, past + seq_len, device=device)
    return keys[None, :] <= queries[:, None]


def padding_causal_mask(attention_mask: Tensor) -> Tensor:
    """Combine a ``[B, T]`` padding mask with causality into a boolean ``[B, 1, T, T]`` mask
    (``True`` = may attend), for ``scaled_dot_product_attention``."""
    seq_len = attention_mask.shape[1]
    device = attention_mask.device
    keep_keys = attention_mask.to(torch.bool)[:, None, None, :]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    # A padded query with only padding before it (left padding) would see no key at all and
    # softmax to NaN; letting every query see itself keeps its ignored output finite.
    diagonal = torch.eye(seq_len, dtype=torch.bool, device=device)
    return (causal & keep_keys) | diagonal
