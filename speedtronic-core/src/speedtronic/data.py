"""Data: the synthetic stream, the text stream, user datasets, and resumable loaders.

Every source emits micro-batches of ``{"input_ids": [B, T], "labels": [B, T]}`` where labels are
already shifted: ``labels[:, t]`` is the token that follows ``input_ids[:, t]`` (``-100`` is
ignored). Sample ``i`` of a stream depends only on the seed and ``i``, so the same seed gives the
same samples whatever the micro-batch size or worker count, and a resumed run restarts the
stream exactly at the first sample it has not consumed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from speedtronic.config import SpeedtronicConfig
from speedtronic.errors import DataError

log = logging.getLogger("speedtronic.data")

Batch = dict[str, torch.Tensor]
Tokenizer = Callable[[str], list[int]]

# Step sizes of the synthetic stream's hidden rule and how often each is taken: next token =
# previous token + step (mod vocab). About 1.2 nats of irreducible entropy, so a model that
# learns the rule beats the log(vocab) of guessing by a wide, visible margin.
_SYNTHETIC_STEPS = np.array([1, 2, 3, 5])
_SYNTHETIC_PROBS = np.array([0.55, 0.2, 0.15, 0.1])


class _BatchIndexedStream(IterableDataset):
    """Yields micro-batch ``b`` = samples ``[b*B, (b+1)*B)`` for ``b = first, first+1, ...``.

    With several DataLoader workers, worker ``w`` builds the batches ``b ≡ w (mod n)``; the
    loader's round-robin collection then returns them in exactly the single-process order.
    """

    def __init__(self, micro_batch_size: int, start_sample: int = 0) -> None:
        self.micro_batch_size = micro_batch_size
        self.start_sample = start_sample

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, labels)`` of global sample ``index``."""
        raise NotImplementedError

    def batch(self, batch_index: int) -> Batch:
        first = self.start_sample + batch_index * self.micro_batch_size
        pairs = [self.sample(first + j) for j in range(self.micro_batch_size)]
        inputs = torch.from_numpy(np.stack([p[0] for p in pairs]))
        labels = torch.from_numpy(np.stack([p[1] for p in pairs]))
        return {"input_ids": inputs, "labels": labels}

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        batch_index = worker
        while True:
            yield self.batch(batch_index)
            batch_index += workers


class SyntheticTokenStream(_BatchIndexedStream):
    """A deterministic, learnable token stream: each token is the previous one plus a small
    random step (mod ``vocab_size``)."""

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        micro_batch_size: int,
        seed: int = 0,
        start_sample: int = 0,
    ) -> None:
        super().__init__(micro_batch_size, start_sample)
        if vocab_size < 2:
            raise DataError(f"synthetic stream needs vocab_size >= 2, got {vocab_size}")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, index])
        start = rng.integers(self.vocab_size)
        steps = rng.choice(_SYNTHETIC_STEPS, size=self.seq_len, p=_SYNTHETIC_PROBS)
        tokens = (start + np.concatenate(([0], np.cumsum(steps)))) % self.vocab_size
        tokens = tokens.astype(np.int64)
        return tokens[:-1], tokens[1:]


def byte_tokenizer(text: str) -> list[int]:
    """The default tokenizer: UTF-8 bytes, vocabulary 256."""
    return list(text.encode("utf-8"))


class ByteTextStream(_BatchIndexedStream):
    """A UTF-8 file read as bytes, in blocks of ``seq_len + 1`` bytes with stride ``seq_len``.

    Each sample is one ``seek`` + ``read`` of its own block, so nothing loads the file into RAM
    and each DataLoader worker reads only the byte ranges of the batches it builds. The stream
    wraps around at the end of the file.
    """

    def __init__(self, path: str | os.PathLike[str], seq_len: int, micro_batch_size: int,
                 start_sample: int = 0) -> None:
        super().__init__(micro_batch_size, start_sample)
        self.path = str(path)
        self.seq_len = seq_len
        size = check_text_file(self.path)
        self.num_blocks = (size - 1) // seq_len
        if self.num_blocks < 1:
            raise DataError(
                f"text file {self.path} has {size} bytes, fewer than one block of "
                f"seq_len + 1 = {seq_len + 1} bytes"
            )
        self._handle: Any = None
        self._pid = -1

    def _file(self) -> Any:
        # One handle per process: DataLoader workers are forked/spawned copies.
        if self._handle is None or self._pid != os.getpid():
            self._handle = open(self.path, "rb")  # noqa: SIM115 - kept open for the stream
            self._pid = os.getpid()
        return self._handle

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        handle = self._file()
        handle.seek((index % self.num_blocks) * self.seq_len)
        block = np.frombuffer(handle.read(self.seq_len + 1), dtype=np.uint8).astype(np.int64)
        return block[:-1], block[1:]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handle"] = None
        return state


class TokenizedTextStream(IterableDataset):
    """A text file tokenized by any ``tokenizer(str) -> list[int]``, streamed in chunks.

    The file is cut into byte chunks at line boundaries; worker ``w`` of ``n`` reads and
    tokenizes only the chunks ``c ≡ w (mod n)``, so no worker reads the whole file. Each chunk
    yields complete, disjoint blocks of ``seq_len + 1`` tokens (a chunk's short tail is dropped).
    Token ids are carried, never text across chunk edges.
    """

    def __init__(self, path: str | os.PathLike[str], seq_len: int, micro_batch_size: int,
                 tokenizer: Tokenizer, chunk_bytes: int = 1 << 20) -> None:
        self.path = str(path)
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.tokenizer = tokenizer
        self.chunk_bytes = chunk_bytes
        self.size = check_text_file(self.path)

    def chunk_bounds(self) -> list[tuple[int, int]]:
        """Byte ranges of the chunks, each ending just after a newline (or at EOF)."""
        bounds = []
        start = 0
        with open(self.path, "rb") as handle:
            while start < self.size:
                end = min(start + self.chunk_bytes, self.size)
                if end < self.size:
                    handle.seek(end)
                    rest = handle.readline()
                    end += len(rest)
                bounds.append((start, end))
                start = end
        return bounds

    def blocks(self, worker: int = 0, workers: int = 1) -> Iterator[np.ndarray]:
        """One pass over this worker's chunks, as token blocks of length ``seq_len + 1``."""
        width = self.seq_len + 1
        with open(self.path, "rb") as handle:
            for chunk_index, (start, end) in enumerate(self.chunk_bounds()):
                if chunk_index % workers != worker:
                    continue
                handle.seek(start)
                text = handle.read(end - start).decode("utf-8", errors="replace")
                tokens = np.asarray(self.tokenizer(text), dtype=np.int64)
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
                    stacked = torch.from_numpy(np.stack(pending))
                    pending = []
                    yield {"input_ids": stacked[:, :-1], "labels": stacked[:, 1:]}
            if not produced:
                raise DataError(
                    f"text file {self.path} yields no block of {width_text(self.seq_len)} "
                    "tokens with this tokenizer"
                )


def width_text(seq_len: int) -> str:
    return f"seq_len + 1 = {seq_len + 1}"


def check_text_file(path: str) -> int:
    """Size of a readable, non-empty text file, or a DataError naming it."""
    file = Path(path)
    if not file.exists():
        raise DataError(f"data.text_path: file not found: {path}")
    if not file.is_file():
        raise DataError(f"data.text_path: not a regular file: {path}")
    if not os.access(file, os.R_OK):
        raise DataError(f"data.text_path: file is not readable: {path}")
    size = file.stat().st_size
    if size == 0:
        raise DataError(f"data.text_path: file is empty: {path}")
    return size


@dataclass
class DataSource:
    """A resumable source of micro-batches: ``iterate(start_sample)`` restarts the stream at a
    global sample index. ``exact_resume`` is False when resuming can only skip samples."""

    make_iterator: Callable[[int], Iterator[Any]]
    exact_resume: bool = True
    description: str = ""

    def iterate(self, start_sample: int = 0) -> Iterator[Any]:
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
    """The run's data as a :class:`DataSource` (micro-batches, resumable).

    Without ``dataset``: the text stream when ``data.text_path`` is set, else the synthetic
    stream. ``seq_len``/``vocab_size`` default to the data section, then to the caller's
    (usually the model's) values. ``seed`` overrides ``data.seed``/``run.seed``.
    """
    data = config.data
    seq_len = data.seq_len or seq_len
    vocab_size = data.vocab_size or vocab_size
    stream_seed = seed if seed is not None else (data.seed if data.seed is not None else config.run.seed)
    micro = data.micro_batch_size

    if dataset is not None:
        return _user_source(config, dataset)
    if seq_len is None:
        raise DataError("data.seq_len is not set and the model has no max_seq_len to default to")
    if data.text_path:
        path = data.text_path
        if tokenizer is None:
            ByteTextStream(path, seq_len, micro)  # validate the file now, in the main process
            return DataSource(
                lambda start: _loader(config, ByteTextStream(path, seq_len, micro, start)),
                description=f"text {path} (bytes)",
            )
        stream = TokenizedTextStream(path, seq_len, micro, tokenizer)
        return DataSource(
            lambda start: _skip(_loader(config, stream), start, micro),
            exact_resume=False,
            description=f"text {path} (custom tokenizer)",
        )
    if vocab_size is None:
        raise DataError("data.vocab_size is not set and the model has no vocab_size")
    return DataSource(
        lambda start: _loader(
            config, SyntheticTokenStream(vocab_size, seq_len, micro, stream_seed, start)
        ),
        description=f"synthetic (vocab {vocab_size}, seq {seq_len}, seed {stream_seed})",
    )


def _loader(config: SpeedtronicConfig, stream: IterableDataset) -> Iterator[Batch]:
    data = config.data
    kwargs: dict[str, Any] = {"batch_size": None, "num_workers": data.num_workers,
                              "pin_memory": data.pin_memory}
    if data.num_workers > 0:
        kwargs["prefetch_factor"] = data.prefetch_factor or 2
        kwargs["persistent_workers"] = False
    return iter(DataLoader(stream, **kwargs))


def _user_source(config: SpeedtronicConfig, dataset: Dataset | IterableDataset) -> DataSource:
    data = config.data
    micro = data.micro_batch_size
    if isinstance(dataset, IterableDataset):
        def iterate(start: int) -> Iterator[Any]:
            loader = DataLoader(dataset, batch_size=micro, num_workers=data.num_workers,
                                pin_memory=data.pin_memory,
                                prefetch_factor=_prefetch(config))
            return _skip(_repeat(loader), start, micro)

        return DataSource(iterate, exact_resume=False, description=type(dataset).__name__)

    length = len(dataset)  # type: ignore[arg-type]
    if length == 0:
        raise DataError("the dataset passed to build_dataloader is empty")
    seed = data.seed if data.seed is not None else config.run.seed

    def order(start: int) -> Iterator[int]:
        epoch, offset = divmod(start, length)
        while True:
            if data.shuffle:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
                indices = torch.randperm(length, generator=gen).tolist()
            else:
                indices = list(range(length))
            yield from indices[offset:]
            offset = 0
            epoch += 1

    def iterate_map(start: int) -> Iterator[Any]:
        loader = DataLoader(dataset, batch_size=micro, sampler=_IndexSampler(order, start),
                            num_workers=data.num_workers, pin_memory=data.pin_memory,
                            prefetch_factor=_prefetch(config))
        return iter(loader)

    return DataSource(iterate_map, description=type(dataset).__name__)


class _IndexSampler(torch.utils.data.Sampler[int]):
    """An endless sampler over ``order(start)`` (deterministic epochs, optional shuffle)."""

    def __init__(self, order: Callable[[int], Iterator[int]], start: int) -> None:
        self.order = order
        self.start = start

    def __iter__(self) -> Iterator[int]:
        return self.order(self.start)


def _prefetch(config: SpeedtronicConfig) -> int | None:
    if config.data.num_workers == 0:
        return None
    return config.data.prefetch_factor or 2


def _repeat(loader: Iterable[Any]) -> Iterator[Any]:
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise DataError("the dataset produced no batches")


def _skip(iterator: Iterator[Any], start_sample: int, micro: int) -> Iterator[Any]:
    skip_batches = start_sample // micro
    if skip_batches:
        log.warning(
            "resuming this data source means re-reading and skipping %d consumed batches",
            skip_batches,
        )
    return islice(iterator, skip_batches, None)
