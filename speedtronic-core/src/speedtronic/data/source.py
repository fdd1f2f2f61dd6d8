"""The resumable :class:`DataSource` and the loader plumbing every source shares."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Dataset, IterableDataset

from speedtronic.config import SpeedtronicConfig
from speedtronic.data.streams import Batch
from speedtronic.errors import DataError, SpeedtronicError

__all__ = ["DataSource", "Windows", "repeat_epochs"]

log = logging.getLogger("speedtronic.data")


@dataclass(frozen=True)
class Windows:
    """Random access to the samples (windows) of an indexed source, whatever its rank split:
    ``read(indices)`` is the micro-batch of the given global sample numbers, ``count`` the
    distinct samples of the whole split (all ranks together; None for an endless stream).
    Evaluation uses it to pick samples spread over the whole split."""

    read: Callable[[np.ndarray], Any]
    micro_batch_size: int
    count: int | None = None


@dataclass
class DataSource:
    """A resumable source of micro-batches: ``iterate(start_sample)`` starts the stream at a
    global sample index. ``exact_resume`` is False when resuming can only re-read and skip."""

    make_iterator: Callable[[int], Iterator[Any]]
    exact_resume: bool = True
    description: str = ""
    # Micro-batches (of this rank) in one pass over finite data before samples repeat; None
    # for an endless stream (synthetic) or an unknown size. Evaluation reads at most this many.
    epoch_batches: int | None = None
    # How this process's share was chosen ("not split", "disjoint slice 1 of 3", "own order
    # (participant seed ...)"): logged and sent with the train_start event.
    split: str = ""
    # Random access to the samples by number (the built-in streams and map-style datasets).
    windows: Windows | None = None

    def iterate(self, start_sample: int = 0) -> Iterator[Any]:
        """An iterator over micro-batches starting at sample ``start_sample``."""
        return self.make_iterator(start_sample)

    def __iter__(self) -> Iterator[Any]:
        """``for batch in source``: the micro-batches from the first sample (endless for the
        built-in streams: stop when you have enough)."""
        return self.iterate(0)


def loader_kwargs(config: SpeedtronicConfig) -> dict[str, Any]:
    """``num_workers``, ``pin_memory`` and ``prefetch_factor`` for a DataLoader."""
    data = config.data
    kwargs: dict[str, Any] = {"num_workers": data.num_workers, "pin_memory": data.pin_memory}
    if data.num_workers > 0:
        kwargs["prefetch_factor"] = data.prefetch_factor or 2
    elif data.prefetch_factor is not None:
        log.info("data.prefetch_factor only applies with num_workers > 0; ignored")
    return kwargs


def make_loader(
    config: SpeedtronicConfig, dataset: Dataset | IterableDataset, **kwargs: Any
) -> DataLoader:
    """A DataLoader over ``dataset`` with the config's worker and pinning options."""
    return DataLoader(dataset, **kwargs, **loader_kwargs(config))


def stream_batches(config: SpeedtronicConfig, stream: IterableDataset) -> Iterator[Batch]:
    """Iterate a stream that yields whole micro-batches, through a DataLoader when needed."""
    if config.data.num_workers == 0 and not config.data.pin_memory:
        # In-process and unpinned, a DataLoader would only add per-batch bookkeeping.
        return iter(stream)
    # The streams yield whole micro-batches, so the loader must not batch again.
    return _worker_errors(iter(make_loader(config, stream, batch_size=None)))


_WORKER_TRACEBACK = "Original Traceback (most recent call last):"


def _worker_errors(batches: Iterator[Batch]) -> Iterator[Batch]:
    """``batches``, but a :class:`SpeedtronicError` a DataLoader worker raised keeps its own
    one-line message: torch re-raises it as the same class with the worker's whole traceback
    as its message (``Caught DataError in DataLoader worker process 0. Original Traceback
    ...``), which would reach the CLI as an error line holding a traceback."""
    try:
        yield from batches
    except SpeedtronicError as exc:
        text = str(exc)
        if _WORKER_TRACEBACK not in text:
            raise
        # The traceback's last line is "speedtronic.errors.DataError: <the message>".
        message = text.rstrip().splitlines()[-1].partition(": ")[2]
        raise type(exc)(message or text) from None


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


def nonempty(iterator: Iterator[Any], message: str) -> Iterator[Any]:
    """Pass ``iterator`` through, raising ``DataError(message)`` if it ends before any item."""
    empty = True
    for item in iterator:
        empty = False
        yield item
    if empty:
        raise DataError(message)


def skip_samples(iterator: Iterator[Any], start_sample: int, micro: int) -> Iterator[Any]:
    """``iterator`` after re-reading and dropping the micro-batches before ``start_sample``."""
    skip_batches = start_sample // micro
    if skip_batches:
        log.warning(
            "resuming this data source re-reads and skips %d consumed micro-batches", skip_batches
        )
        # Skip now rather than lazily on first use, for the same reason as in repeat_epochs:
        # re-reading may start DataLoader epochs, whose seeds come from the global RNG.
        deque(islice(iterator, skip_batches), maxlen=0)
    return iterator
