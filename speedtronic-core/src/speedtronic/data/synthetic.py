"""The synthetic stream: a deterministic, learnable token stream computed from a hash."""

from __future__ import annotations

import numpy as np

from speedtronic.data.streams import _GOLDEN, IndexedTokenStream, _mix64, _seed_key
from speedtronic.errors import DataError

__all__ = ["SyntheticTokenStream"]

# The synthetic stream's hidden rule: next token = previous token + step (mod vocab), with these
# steps and probabilities. About 1.17 nats of irreducible entropy, so a model that learns the
# rule beats the log(vocab) of guessing by a wide, visible margin.
_SYNTHETIC_STEPS = np.array([1, 2, 3, 5], dtype=np.int64)
_SYNTHETIC_CDF = np.cumsum([0.55, 0.2, 0.15, 0.1])[:-1]


class SyntheticTokenStream(IndexedTokenStream):
    """A deterministic, learnable token stream: each token is the previous one plus a small
    random step (mod ``vocab_size``), drawn from a hash of ``(seed, sample, position)``."""

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        micro_batch_size: int,
        seed: int = 0,
        start_sample: int = 0,
        *,
        rank: int = 0,
        num_ranks: int = 1,
    ) -> None:
        super().__init__(seq_len, micro_batch_size, start_sample, rank=rank, num_ranks=num_ranks)
        if vocab_size < 2:
            raise DataError(f"the synthetic stream needs vocab_size >= 2, got {vocab_size}")
        self.vocab_size = vocab_size
        self.seed = seed
        # Negative and huge seeds are fine: only the seed's value modulo 2**64 matters.
        self._seed_key = _seed_key(seed)
        self._positions = (np.arange(1, seq_len + 1, dtype=np.uint64) * _GOLDEN)[None, :]

    def windows_at(self, indices: np.ndarray) -> np.ndarray:
        count = len(indices)
        keys = _mix64(self._seed_key ^ _mix64(indices.astype(np.uint64) * _GOLDEN + _GOLDEN))
        start = (keys % np.uint64(self.vocab_size)).astype(np.int64)
        uniform = (_mix64(keys[:, None] + self._positions) >> np.uint64(11)) * 2.0**-53
        steps = _SYNTHETIC_STEPS[np.searchsorted(_SYNTHETIC_CDF, uniform, side="right")]
        offsets = np.zeros((count, self.seq_len + 1), dtype=np.int64)
        np.cumsum(steps, axis=1, out=offsets[:, 1:])
        return (start[:, None] + offsets) % self.vocab_size
