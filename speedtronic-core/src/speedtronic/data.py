"""Data: the synthetic stream, the text streams, user datasets, and resumable loaders.

Built-in sources emit micro-batches ``{"input_ids": [B, T], "labels": [B, T]}`` whose labels are
already shifted: ``labels[:, t]`` is the token that follows ``input_ids[:, t]`` (``-100`` would
be ignored by the loss). For the synthetic and byte-level streams, sample ``i`` depends only on
the seed (or the file) and ``i``, so the same seed gives the same samples whatever the
micro-batch size or worker count, and a resumed run restarts exactly at the first sample it has
not consumed.
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info

from speedtronic.config import SpeedtronicConfig
from speedtronic.errors import DataError

log = logging.getLogger("speedtronic.data")

Batch = dict[str, torch.Tensor]
Tokenizer = Callable[[str], Any]
"""``tokenizer(text)`` returns token ids: a sequence, an array, or a mapping with ``input_ids``."""

IGNORE_INDEX = -100
BYTE_VOCAB = 256

# The synthetic stream's hidden rule: next token = previous token + step (mod vocab), with these
# steps and probabilities. About 1.17 nats of irreducible entropy, so a model that learns the
# rule beats the log(vocab) of guessing by a wide, visible margin.
_SYNTHETIC_STEPS = np.array([1, 2, 3, 5], dtype=np.int64)
_SYNTHETIC_CDF = np.cumsum([0.55, 0.2, 0.15, 0.1])[:-1]

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


def split_windows(windows: np.ndarray) -> Batch:
    """Turn ``[B, T + 1]`` token windows into shifted ``input_ids`` / ``labels`` of ``[B, T]``."""
    return {
        "input_ids": torch.from_numpy(np.ascontiguousarray(windows[:, :-1])),
        "labels": torch.from_numpy(np.ascontiguousarray(windows[:, 1:])),
    }


class IndexedTokenStream(IterableDataset):
    """A stream of micro-batches where sample ``i`` is a pure function of ``i``.

    Micro-batch ``b`` holds samples ``[start + b*B, start + (b+1)*B)``. With ``n`` DataLoader
    workers, worker ``w`` builds only the batches ``b ≡ w (mod n)``; the loader collects workers
    round-robin, so the order is exactly the single-process order.
    """

    yields_batches = True

    def __init__(self, seq_len: int, micro_batch_size: int, start_sample: int = 0) -> None:
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.start_sample = start_sample

    def windows(self, first: int, count: int) -> np.ndarray:
        """Token windows ``[count, seq_len + 1]`` of samples ``first .. first + count - 1``."""
        raise NotImplementedError

    def batch(self, batch_index: int) -> Batch:
        """Micro-batch ``batch_index`` counted from ``start_sample``."""
        first = self.start_sample + batch_index * self.micro_batch_size
        return split_windows(self.windows(first, self.micro_batch_size))

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        batch_index = worker
        while True:
            yield self.batch(batch_index)
            batch_index += workers


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
    ) -> None:
        super().__init__(seq_len, micro_batch_size, start_sample)
        if vocab_size < 2:
            raise DataError(f"the synthetic stream needs vocab_size >= 2, got {vocab_size}")
        self.vocab_size = vocab_size
        self.seed = seed
        # Negative and huge seeds are fine: only the seed's value modulo 2**64 matters.
        self._seed_key = _mix64(np.array([seed & _MASK64], dtype=np.uint64))[0]
        self._positions = (np.arange(1, seq_len + 1, dtype=np.uint64) * _GOLDEN)[None, :]

    def windows(self, first: int, count: int) -> np.ndarray:
        indices = np.arange(first, first + count, dtype=np.uint64)
        keys = _mix64(self._seed_key ^ _mix64(indices * _GOLDEN + _GOLDEN))
        start = (keys % np.uint64(self.vocab_size)).astype(np.int64)
        uniform = (_mix64(keys[:, None] + self._positions) >> np.uint64(11)) * 2.0**-53
        steps = _SYNTHETIC_STEPS[np.searchsorted(_SYNTHETIC_CDF, uniform, side="right")]
        offsets = np.zeros((count, self.seq_len + 1), dtype=np.int64)
        np.cumsum(steps, axis=1, out=offsets[:, 1:])
        return (start[:, None] + offsets) % self.vocab_size


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
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        seq_len: int,
        micro_batch_size: int,
        start_sample: int = 0,
    ) -> None:
        super().__init__(seq_len, micro_batch_size, start_sample)
        self.path = str(path)
        size = check_text_file(self.path)
        self.num_blocks = (size - 1) // seq_len
        if self.num_blocks < 1:
            raise DataError(
                f"data.text_path: {self.path} has {size} bytes, fewer than one block of "
                f"seq_len + 1 = {seq_len + 1}"
            )

    def windows(self, first: int, count: int) -> np.ndarray:
        handle = self._file()
        width = self.seq_len + 1
        out = np.empty((count, width), dtype=np.int64)
        for row, index in enumerate(range(first, first + count)):
            handle.seek((index % self.num_blocks) * self.seq_len)
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

    def blocks(self, worker: int = 0, workers: int = 1) -> Iterator[np.ndarray]:
        """One pass over this worker's chunks, as token blocks of length ``seq_len + 1``."""
        width = self.seq_len + 1
        for chunk in range(worker, self.num_chunks, workers):
            start, end = self.chunk_range(chunk)
            handle = self._file()
            handle.seek(start)
            text = handle.read(end - start).decode("utf-8", errors="replace")
            tokens = _token_array(self.tokenizer(text))
            for offset in range(0, len(tokens) - width + 1, self.seq_len):
                yield tokens[offset : offset + width]

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        pending: list[np.ndarray] = []
        while True:
            produced = False
            for block in self.blocks(worker, workers):
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


@dataclass
class DataSource:
    """A resumable source of micro-batches: ``iterate(start_sample)`` starts the stream at a
    global sample index. ``exact_resume`` is False when resuming can only re-read and skip."""

    make_iterator: Callable[[int], Iterator[Any]]
    exact_resume: bool = True
    description: str = ""

    def iterate(self, start_sample: int = 0) -> Iterator[Any]:
        """An iterator over micro-batches starting at sample ``start_sample``."""
        return self.make_iterator(start_sample)


def build_dataloader(
    config: SpeedtronicConfig,
    dataset: Dataset | IterableDataset | None = None,
    tokenizer: Tokenizer | None = None,
    *,
    seq_len: int | None = None,
    vocab_size: int | None = None,
    seed: int | None = None,
) -> DataSource:
    """The run's data as a resumable :class:`DataSource` of micro-batches.

    ``dataset`` (any map-style or iterable dataset of samples) wins; otherwise the text stream
    when ``data.text_path`` is set (bytes, or ``tokenizer``), else the synthetic stream.
    ``seq_len``/``vocab_size`` are the model's limits: ``data.seq_len``/``data.vocab_size``
    default to them and may not exceed them. ``seed`` overrides ``data.seed``/``run.seed``.
    """
    data = config.data
    micro = data.micro_batch_size
    if dataset is not None:
        if data.text_path:
            log.warning("a dataset was passed, so data.text_path (%s) is not used", data.text_path)
        return _user_source(config, dataset, seed if seed is not None else config.data_seed)

    seq_len = _within("seq_len", data.seq_len, seq_len, "max_seq_len")
    if seq_len is None:
        raise DataError("data.seq_len is not set and the model has no max_seq_len to default to")
    if data.text_path:
        path = data.text_path
        if tokenizer is None or tokenizer is byte_tokenizer:
            if vocab_size is not None and vocab_size < BYTE_VOCAB:
                raise DataError(
                    f"data.text_path: byte-level text needs a vocabulary of at least "
                    f"{BYTE_VOCAB}, but the model's vocab_size is {vocab_size}; pass a tokenizer"
                )
            ByteTextStream(path, seq_len, micro)  # check the file now, in the main process
            return DataSource(
                lambda start: _loader(config, ByteTextStream(path, seq_len, micro, start)),
                description=f"text {path} (bytes, seq {seq_len})",
            )
        stream = TokenizedTextStream(path, seq_len, micro, tokenizer)

        def iterate_text(start: int) -> Iterator[Batch]:
            batches = _nonempty(
                _loader(config, stream),
                f"data.text_path: {path} yields no block of seq_len + 1 = {seq_len + 1} tokens "
                "with this tokenizer",
            )
            return _skip(batches, start, micro)

        return DataSource(
            iterate_text,
            exact_resume=False,
            description=f"text {path} ({getattr(tokenizer, '__name__', 'tokenizer')}, "
            f"seq {seq_len})",
        )

    vocab = _within("vocab_size", data.vocab_size, vocab_size, "vocab_size")
    if vocab is None:
        raise DataError("data.vocab_size is not set and the model has no vocab_size")
    stream_seed = seed if seed is not None else config.data_seed
    return DataSource(
        lambda start: _loader(
            config, SyntheticTokenStream(vocab, seq_len, micro, stream_seed, start)
        ),
        description=f"synthetic (vocab {vocab}, seq {seq_len}, seed {stream_seed})",
    )


def _within(field: str, configured: int | None, limit: int | None, model_field: str) -> int | None:
    if configured is None:
        return limit
    if limit is not None and configured > limit:
        raise DataError(f"data.{field} is {configured} but the model's {model_field} is {limit}")
    return configured


def _loader_kwargs(config: SpeedtronicConfig) -> dict[str, Any]:
    data = config.data
    kwargs: dict[str, Any] = {"num_workers": data.num_workers, "pin_memory": data.pin_memory}
    if data.num_workers > 0:
        kwargs["prefetch_factor"] = data.prefetch_factor or 2
    elif data.prefetch_factor is not None:
        log.info("data.prefetch_factor only applies with num_workers > 0; ignored")
    return kwargs


def _loader(config: SpeedtronicConfig, stream: IterableDataset) -> Iterator[Batch]:
    if config.data.num_workers == 0 and not config.data.pin_memory:
        # In-process and unpinned, a DataLoader would only add per-batch bookkeeping.
        return iter(stream)
    # The streams yield whole micro-batches, so the loader must not batch again.
    return iter(DataLoader(stream, batch_size=None, **_loader_kwargs(config)))


def _user_source(
    config: SpeedtronicConfig, dataset: Dataset | IterableDataset, seed: int
) -> DataSource:
    data = config.data
    micro = data.micro_batch_size
    batch_size = None if getattr(dataset, "yields_batches", False) else micro
    name = type(dataset).__name__

    if isinstance(dataset, IterableDataset):
        if data.shuffle:
            log.warning(
                "data.shuffle applies to map-style datasets only; %s is iterable, so "
                "shuffle inside its stream if you need it",
                name,
            )

        def iterate(start: int) -> Iterator[Any]:
            loader = DataLoader(dataset, batch_size=batch_size, **_loader_kwargs(config))
            return _skip(
                repeat_epochs(loader, f"the dataset {name} produced no batches"), start, micro
            )

        return DataSource(iterate, exact_resume=False, description=name)

    try:
        length = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise DataError(f"the dataset {name} is neither iterable-style nor sized") from None
    if length == 0:
        raise DataError(f"the dataset {name} passed to build_dataloader is empty")

    def order(start: int) -> Iterator[int]:
        # Epoch e's order depends only on (seed, e), so resuming at any sample is exact.
        epoch, offset = divmod(start, length)
        while True:
            if data.shuffle:
                generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) & _MASK64)
                indices = torch.randperm(length, generator=generator).tolist()
            else:
                indices = list(range(length))
            yield from indices[offset:]
            offset = 0
            epoch += 1

    def iterate_map(start: int) -> Iterator[Any]:
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=_OrderSampler(order, start),
            **_loader_kwargs(config),
        )
        return iter(loader)

    return DataSource(iterate_map, description=f"{name} ({length} samples)")


class _OrderSampler(Sampler[int]):
    """An endless sampler over ``order(start)``."""

    def __init__(self, order: Callable[[int], Iterator[int]], start: int) -> None:
        self.order = order
        self.start = start

    def __iter__(self) -> Iterator[int]:
        return self.order(self.start)


def repeat_epochs(
    data: Iterable[Any], empty_message: str = "the training data yielded no batches"
) -> Iterator[Any]:
    """Iterate ``data`` epoch after epoch when it can be iterated again (a list, a DataLoader);
    a one-shot iterator (a generator) is iterated once. An empty epoch raises
    ``DataError(empty_message)``."""
    # The first iterator is made now, not on first use: a DataLoader's iterator draws its seed
    # from the global RNG, and the trainer restores a resumed run's RNG right after this call.
    return _repeat_epochs(data, iter(data), empty_message)


def _repeat_epochs(
    data: Iterable[Any], iterator: Iterator[Any], empty_message: str
) -> Iterator[Any]:
    if iterator is data:
        yield from iterator
        return
    while True:
        empty = True
        for batch in iterator:
            empty = False
            yield batch
        if empty:
            raise DataError(empty_message)
        iterator = iter(data)


def _nonempty(iterator: Iterator[Any], message: str) -> Iterator[Any]:
    """Pass ``iterator`` through, raising ``DataError(message)`` if it ends before any item."""
    empty = True
    for item in iterator:
        empty = False
        yield item
    if empty:
        raise DataError(message)


def _skip(iterator: Iterator[Any], start_sample: int, micro: int) -> Iterator[Any]:
    skip_batches = start_sample // micro
    if skip_batches:
        log.warning(
            "resuming this data source re-reads and skips %d consumed micro-batches", skip_batches
        )
        # Skip now rather than lazily on first use, for the same reason as in repeat_epochs:
        # re-reading may start DataLoader epochs, whose seeds come from the global RNG.
        deque(islice(iterator, skip_batches), maxlen=0)
    return iterator


__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "ByteTextStream",
    "DataSource",
    "IndexedTokenStream",
    "SyntheticTokenStream",
    "TokenizedTextStream",
    "Tokenizer",
    "build_dataloader",
    "byte_tokenizer",
    "check_text_file",
    "repeat_epochs",
    "split_windows",
]
