"""Your own ``Dataset`` or ``IterableDataset`` of samples as a resumable source."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, default_collate

from speedtronic.config import SpeedtronicConfig
from speedtronic.data.source import (
    DataSource,
    Windows,
    make_loader,
    repeat_epochs,
    skip_samples,
)
from speedtronic.data.streams import _MASK64
from speedtronic.errors import DataError

__all__ = ["user_source"]

log = logging.getLogger("speedtronic.data")


def user_source(
    config: SpeedtronicConfig,
    dataset: Dataset | IterableDataset,
    seed: int,
    *,
    rank: int = 0,
    num_ranks: int = 1,
    shuffle: bool | None = None,
) -> DataSource:
    """A :class:`DataSource` over a user dataset: a map-style one in a seeded per-epoch order
    (``shuffle``, default ``data.shuffle``; exact resume), an iterable one epoch after epoch
    (resume re-reads and skips).

    A map-style dataset is split by ``rank``/``num_ranks`` like the built-in streams: rank
    ``r`` takes positions ``i * num_ranks + r`` of the shared order (as DistributedSampler
    does), so ranks and DiLoCo nodes never train on the same samples. An iterable dataset
    cannot be split from outside: it must honour the rank itself (a ``data.dataset`` factory
    that takes ``rank``/``num_ranks`` receives them)."""
    data = config.data
    micro = data.micro_batch_size
    shuffle = data.shuffle if shuffle is None else shuffle
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
            loader = make_loader(config, dataset, batch_size=batch_size)
            return skip_samples(
                repeat_epochs(loader, f"the dataset {name} produced no batches"), start, micro
            )

        if num_ranks > 1:
            log.warning(
                "%s is an iterable dataset: it is not split by rank; rank %d of %d reads what "
                "it yields (take `rank`/`num_ranks` in its data.dataset factory to split it)",
                name,
                rank,
                num_ranks,
            )
        return DataSource(
            iterate,
            exact_resume=False,
            description=name,
            split="not split (an iterable dataset decides what each process reads)",
        )

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
            if shuffle:
                generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) & _MASK64)
                indices = torch.randperm(length, generator=generator).tolist()
            else:
                indices = list(range(length))
            yield from indices[offset:]
            offset = 0
            epoch += 1

    def ranked_order(start: int) -> Iterator[int]:
        # This rank's sample i is position i * num_ranks + rank of the shared order.
        shared = order(start * num_ranks)
        return itertools.islice(shared, rank, None, num_ranks) if num_ranks > 1 else shared

    def iterate_map(start: int) -> Iterator[Any]:
        loader = make_loader(
            config, dataset, batch_size=batch_size, sampler=_OrderSampler(ranked_order, start)
        )
        return iter(loader)

    split = f", rank {rank} of {num_ranks}" if num_ranks > 1 else ""
    windows = None
    if batch_size is not None:  # items are samples: a micro-batch is their collation

        def read(indices: np.ndarray) -> Any:
            return default_collate([dataset[int(index)] for index in indices])

        windows = Windows(read, micro, length)
    return DataSource(iterate_map, description=f"{name} ({length} samples{split})", windows=windows)


class _OrderSampler(Sampler[int]):
    """An endless sampler over ``order(start)``."""

    def __init__(self, order: Callable[[int], Iterator[int]], start: int) -> None:
        self.order = order
        self.start = start

    def __iter__(self) -> Iterator[int]:
        return self.order(self.start)
