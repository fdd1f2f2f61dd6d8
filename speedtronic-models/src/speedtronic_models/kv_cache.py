"""The key/value cache of incremental decoding: what each layer computed for earlier tokens.

Generation without a cache runs the whole sequence through the model for every new token.
With one, each layer keeps the rotated keys and the values of every position it has seen, so
a new token costs one position's worth of work: its query attends to the cached keys.

The tensors are allocated once, for ``max_len`` positions, the first time a layer writes
(with that layer's dtype and device, so autocast and ``model.to(...)`` just work), and filled
in place; :attr:`KVCache.length` counts the positions already stored.
"""

from __future__ import annotations

import torch
from torch import Tensor

from speedtronic import DataError

__all__ = ["KVCache", "LayerCache"]


class KVCache:
    """Keys and values of ``n_layer`` attention layers, for up to ``max_len`` positions."""

    def __init__(self, n_layer: int, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0
        self.layers = [LayerCache(self, index) for index in range(n_layer)]

    def get_seq_length(self) -> int:
        """Positions already cached (the name Hugging Face caches use for it)."""
        return self.length

    def reserve(self, new_tokens: int) -> int:
        """Check that ``new_tokens`` more positions fit; returns the position of the first."""
        if self.length + new_tokens > self.max_len:
            raise DataError(
                f"the KV cache holds {self.max_len} positions (the model's max_seq_len); "
                f"{self.length} are used and {new_tokens} more do not fit"
            )
        return self.length

    def advance(self, new_tokens: int) -> None:
        """Count ``new_tokens`` positions as stored (after every layer wrote them)."""
        self.length += new_tokens


class LayerCache:
    """One layer's slice of a :class:`KVCache`: ``[B, n_kv_head, max_len, head_dim]`` each."""

    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache = cache
        self.index = index
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``k``/``v`` ``[B, H, T, D]`` after the cached positions; returns the keys and
        values of every position so far (views, no copy)."""
        start, new = self.cache.length, k.shape[2]
        if self.keys is None or self.values is None:
            shape = (k.shape[0], k.shape[1], self.cache.max_len, k.shape[3])
            self.keys = torch.empty(shape, dtype=k.dtype, device=k.device)
            self.values = torch.empty(shape, dtype=v.dtype, device=v.device)
        self.keys[:, :, start : start + new] = k
        self.values[:, :, start : start + new] = v
        return self.keys[:, :, : start + new], self.values[:, :, : start + new]
