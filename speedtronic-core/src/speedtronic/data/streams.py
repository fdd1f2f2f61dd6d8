"""The batch contract and the indexed-stream base class shared by the built-in streams.

Built-in sources emit micro-batches ``{"input_ids": [B, T], "labels": [B, T]}`` (int64) whose
labels are already shifted: ``labels[:, t]`` is the token that follows ``input_ids[:, t]``
(``-100`` would be ignored by the loss).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from speedtronic.errors import DataError

__all__ = ["IGNORE_INDEX", "Batch", "IndexedTokenStream", "split_windows"]

Batch = dict[str, torch.Tensor]

IGNORE_INDEX = -100

# SplitMix64 constants: a counter-based hash is as random as a seeded generator per sample but
# is computed for a whole micro-batch in a handful of vectorised NumPy operations, which keeps
# data generation off the training loop's critical path.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def _mix64(x: np.ndarray) -> np.ndarray:
    """The SplitMix64 finaliser applied elementwise (wrapping uint64 arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX_1
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX_2
    return x ^ (x >> np.uint64(31))


def _seed_key(seed: int) -> np.uint64:
    """A well-mixed 64-bit key of any Python int (only its value modulo 2**64 matters)."""
    return _mix64(np.array([seed & _MASK64], dtype=np.uint64))[0]


def split_windows(windows: np.ndarray) -> Batch:
    """Turn ``[B, T + 1]`` token windows into shifted ``input_ids`` / ``labels`` of ``[B, T]``."""
    return {
        "input_ids": torch.from_numpy(np.ascontiguousarray(windows[:, :-1])),
        "labels": torch.from_numpy(np.ascontiguousarray(windows[:, 1:])),
    }


def check_rank(rank: int, num_ranks: int) -> None:
    """A :class:`DataError` unless ``0 <= rank < num_ranks``."""
    if num_ranks < 1 or not 0 <= rank < num_ranks:
        raise DataError(f"data rank {rank} of {num_ranks} is out of range: need 0 <= rank < count")


class IndexedTokenStream(IterableDataset):
    """A stream of micro-batches where global sample ``g`` is a pure function of ``g``.

    This process (rank ``r`` of ``num_ranks``: a DDP rank or a DiLoCo node) reads the global
    samples ``g = i * num_ranks + r`` for its own sample index ``i = 0, 1, ...``, so ranks read
    disjoint samples that together are exactly the single-process sequence. Micro-batch ``b``
    holds this rank's samples ``[start + b*B, start + (b+1)*B)``. With ``n`` DataLoader workers,
    worker ``w`` builds only the batches ``b ≡ w (mod n)``; the loader collects workers
    round-robin, so the order is exactly the single-process order.

    Subclasses implement :meth:`windows_at` (any global samples) or :meth:`windows` (a
    contiguous run of them).
    """

    yields_batches = True

    def __init__(
        self,
        seq_len: int,
        micro_batch_size: int,
        start_sample: int = 0,
        *,
        rank: int = 0,
        num_ranks: int = 1,
    ) -> None:
        check_rank(rank, num_ranks)
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.start_sample = start_sample
        self.rank = rank
        self.num_ranks = num_ranks

    def windows(self, first: int, count: int) -> np.ndarray:
        """Token windows ``[count, seq_len + 1]`` of global samples ``first .. first+count-1``."""
        if type(self).windows_at is IndexedTokenStream.windows_at:
            raise NotImplementedError(f"{type(self).__name__} implements neither windows method")
        return self.windows_at(np.arange(first, first + count, dtype=np.int64))

    def windows_at(self, indices: np.ndarray) -> np.ndarray:
        """Token windows ``[len(indices), seq_len + 1]`` of the given global samples."""
        if len(indices) and bool(np.all(np.diff(indices) == 1)):
            return self.windows(int(indices[0]), len(indices))
        return np.concatenate([self.windows(int(index), 1) for index in indices])

    def global_indices(self, first: int, count: int) -> np.ndarray:
        """The global sample indices of this rank's samples ``first .. first + count - 1``."""
        local = np.arange(first, first + count, dtype=np.int64)
        return local * self.num_ranks + self.rank if self.num_ranks > 1 else local

    def batch(self, batch_index: int) -> Batch:
        """Micro-batch ``batch_index`` counted from ``start_sample``."""
        first = self.start_sample + batch_index * self.micro_batch_size
        if self.num_ranks == 1:
            return split_windows(self.windows(first, self.micro_batch_size))
        return split_windows(self.windows_at(self.global_indices(first, self.micro_batch_size)))

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        batch_index = worker
        while True:
            yield self.batch(batch_index)
            batch_index += workers
