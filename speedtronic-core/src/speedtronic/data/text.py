"""Text files as streams: raw bytes (exact, indexed) or any tokenizer (chunked)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from speedtronic.data.shards import permute_windows
from speedtronic.data.streams import Batch, IndexedTokenStream, split_windows
from speedtronic.errors import DataError

__all__ = [
    "BYTE_VOCAB",
    "ByteTextStream",
    "TokenizedTextStream",
    "Tokenizer",
    "byte_tokenizer",
    "check_text_file",
]

Tokenizer = Callable[[str], Any]
"""``tokenizer(text)`` returns token ids: a sequence, an array, or a mapping with ``input_ids``."""

BYTE_VOCAB = 256


def byte_tokenizer(text: str) -> list[int]:
    """The default tokenizer: the text's UTF-8 bytes (vocabulary 256)."""
    return list(text.encode("utf-8"))


def check_text_file(path: str | os.PathLike[str]) -> int:
    """The size of a readable, non-empty file, or a :class:`DataError` naming it."""
    file = Path(path)
    if not file.exists():
        raise DataError(f"data.text_path: file not found: {path}")
    if not file.is_file():
        raise DataError(f"data.text_path: not a regular file: {path}")
    try:
        with open(file, "rb") as handle:
            first = handle.read(1)
    except OSError as exc:
        raise DataError(f"data.text_path: cannot read {path}: {exc.strerror or exc}") from None
    if not first:
        raise DataError(f"data.text_path: file is empty: {path}")
    return file.stat().st_size


class _OwnFileHandle:
    """One open handle per process: DataLoader workers are forked or spawned copies and must
    not share a file position."""

    path: str
    _handle: BinaryIO | None = None
    _pid: int = -1

    def _open(self) -> BinaryIO:
        """Open the file for reading (a seam for tests that record what is read)."""
        return open(self.path, "rb")

    def _file(self) -> BinaryIO:
        if self._handle is None or self._pid != os.getpid():
            self._handle = self._open()
            self._pid = os.getpid()
        return self._handle

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_handle", None)
        state.pop("_pid", None)
        return state


class ByteTextStream(_OwnFileHandle, IndexedTokenStream):
    """A file read as bytes: sample ``i`` is block ``i mod num_blocks``, the ``seq_len + 1``
    bytes at offset ``block * seq_len``, so consecutive samples tile the file.

    Each sample is one ``seek`` + ``read`` of its own block: nothing loads the file into RAM and
    each DataLoader worker reads only the blocks of the batches it builds. After the last
    complete block the stream wraps around to the start of the file.

    With ``order_seed`` (a participant of a multi-node run reading its own order), epoch ``e``
    (samples ``e * num_blocks ..``) visits the blocks in the pseudo-random permutation keyed by
    ``(order_seed, e)`` instead: every block once per epoch, a different order per seed.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        seq_len: int,
        micro_batch_size: int,
        start_sample: int = 0,
        *,
        rank: int = 0,
        num_ranks: int = 1,
        holdout_fraction: float = 0.0,
        held_out: bool = False,
        order_seed: int | None = None,
    ) -> None:
        super().__init__(seq_len, micro_batch_size, start_sample, rank=rank, num_ranks=num_ranks)
        self.path = str(path)
        self.order_seed = order_seed
        size = check_text_file(self.path)
        total = (size - 1) // seq_len
        # The last `holdout_fraction` of the blocks are held out: training (held_out=False)
        # never reads them, evaluation (held_out=True) reads only them.
        kept = total - math.ceil(total * holdout_fraction) if holdout_fraction else total
        self.first_block = kept if held_out else 0
        self.num_blocks = total - kept if held_out else kept
        if self.num_blocks < 1:
            what = "held-out block" if held_out else "block"
            raise DataError(
                f"data.text_path: {self.path} has {size} bytes, fewer than one {what} of "
                f"seq_len + 1 = {seq_len + 1}"
                + (f" (eval.holdout_fraction {holdout_fraction})" if holdout_fraction else "")
            )

    def windows_at(self, indices: np.ndarray) -> np.ndarray:
        handle = self._file()
        width = self.seq_len + 1
        out = np.empty((len(indices), width), dtype=np.int64)
        blocks = indices % self.num_blocks
        if self.order_seed is not None:
            epochs = indices // self.num_blocks
            blocks = permute_windows(blocks, self.num_blocks, self.order_seed, epochs)
        for row, block in enumerate(blocks.tolist()):
            handle.seek((self.first_block + block) * self.seq_len)
            out[row] = np.frombuffer(handle.read(width), dtype=np.uint8)
        return out


def _token_array(tokens: Any) -> np.ndarray:
    if isinstance(tokens, Mapping):
        tokens = tokens["input_ids"]
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.numpy()
    return np.asarray(tokens, dtype=np.int64).reshape(-1)


class TokenizedTextStream(_OwnFileHandle, IterableDataset):
    """A text file tokenized by any ``tokenizer(text)``, streamed in chunks of about
    ``chunk_bytes``.

    Chunk ``c`` nominally covers bytes ``[c*C, (c+1)*C)``; both of its edges move forward to just
    after the next newline (or, on a line longer than ``scan_bytes``, to the next UTF-8
    character start), so adjacent chunks agree on their shared edge without a global index.
    Worker ``w`` of ``n`` reads, decodes and tokenizes only chunks ``c ≡ w (mod n)``, plus at most
    ``scan_bytes`` past each edge to find it. Each chunk yields complete, non-overlapping blocks
    of ``seq_len + 1`` tokens (stride ``seq_len``); its short tail is dropped. The blocks of all
    workers together are exactly those of a single process.

    With ``order_seed`` (a participant of a multi-node run reading its own order), pass ``p``
    over the file visits the chunks, and the blocks inside each chunk, in orders drawn from
    ``(order_seed, p)``: the same blocks, a different sequence per seed.
    """

    yields_batches = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        seq_len: int,
        micro_batch_size: int,
        tokenizer: Tokenizer,
        chunk_bytes: int = 1 << 20,
        scan_bytes: int = 1 << 16,
        order_seed: int | None = None,
    ) -> None:
        if chunk_bytes < 2:
            raise DataError(f"chunk_bytes must be at least 2, got {chunk_bytes}")
        self.path = str(path)
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.tokenizer = tokenizer
        self.chunk_bytes = chunk_bytes
        # Edges must move by less than a chunk so that every chunk stays non-empty.
        self.scan_bytes = max(1, min(scan_bytes, chunk_bytes // 2))
        self.size = check_text_file(self.path)
        self.num_chunks = math.ceil(self.size / chunk_bytes)
        self.order_seed = order_seed

    def edge(self, nominal: int) -> int:
        """Where the chunk edge nominally at byte ``nominal`` really is."""
        if nominal <= 0:
            return 0
        if nominal >= self.size:
            return self.size
        handle = self._file()
        handle.seek(nominal - 1)
        window = handle.read(self.scan_bytes + 1)  # bytes [nominal - 1, nominal + scan_bytes)
        newline = window.find(b"\n")
        if newline >= 0:
            return nominal + newline
        for offset in range(1, len(window)):
            if window[offset] & 0xC0 != 0x80:  # not a UTF-8 continuation byte
                return nominal - 1 + offset
        return min(self.size, nominal - 1 + len(window))

    def chunk_range(self, chunk: int) -> tuple[int, int]:
        """The byte range ``[start, end)`` of chunk ``chunk``."""
        return self.edge(chunk * self.chunk_bytes), self.edge((chunk + 1) * self.chunk_bytes)

    def _rng(self, *key: int) -> np.random.Generator:
        assert self.order_seed is not None
        return np.random.default_rng([self.order_seed & ((1 << 64) - 1), *key])

    def blocks(self, worker: int = 0, workers: int = 1, epoch: int = 0) -> Iterator[np.ndarray]:
        """Pass ``epoch`` over this worker's chunks, as token blocks of length ``seq_len + 1``."""
        width = self.seq_len + 1
        chunks = np.arange(self.num_chunks)
        if self.order_seed is not None:
            chunks = self._rng(epoch).permutation(self.num_chunks)
        for chunk in chunks[worker::workers].tolist():
            start, end = self.chunk_range(chunk)
            handle = self._file()
            handle.seek(start)
            text = handle.read(end - start).decode("utf-8", errors="replace")
            tokens = _token_array(self.tokenizer(text))
            offsets = np.arange(0, len(tokens) - width + 1, self.seq_len)
            if self.order_seed is not None:
                offsets = self._rng(epoch, chunk).permutation(offsets)
            for offset in offsets.tolist():
                yield tokens[offset : offset + width]

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        pending: list[np.ndarray] = []
        epoch = 0
        while True:
            produced = False
            for block in self.blocks(worker, workers, epoch):
                produced = True
                pending.append(block)
                if len(pending) == self.micro_batch_size:
                    yield split_windows(np.stack(pending))
                    pending = []
            if not produced:
                # This worker's chunks hold no complete block. Ending here lets the other
                # workers carry on; if none has a block, the loader ends and
                # build_dataloader reports it.
                return
            epoch += 1
