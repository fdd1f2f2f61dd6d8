"""``build_dataloader``: the run's data source, picked from the config and the model's limits."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

from torch.utils.data import Dataset, IterableDataset

from speedtronic.config import SpeedtronicConfig
from speedtronic.data.shards import shard_source
from speedtronic.data.source import DataSource, Windows, nonempty, skip_samples, stream_batches
from speedtronic.data.streams import Batch, check_rank, split_windows
from speedtronic.data.synthetic import SyntheticTokenStream
from speedtronic.data.text import (
    BYTE_VOCAB,
    ByteTextStream,
    TokenizedTextStream,
    Tokenizer,
    byte_tokenizer,
)
from speedtronic.data.user import user_source
from speedtronic.errors import DataError

__all__ = ["build_dataloader", "build_eval_source", "build_holdout_source", "text_holdout"]

log = logging.getLogger("speedtronic.data")


def build_dataloader(
    config: SpeedtronicConfig,
    dataset: Dataset | IterableDataset | None = None,
    tokenizer: Tokenizer | None = None,
    *,
    seq_len: int | None = None,
    vocab_size: int | None = None,
    seed: int | None = None,
    rank: int = 0,
    num_ranks: int = 1,
    participant_seed: int | None = None,
) -> DataSource:
    """The run's data as a resumable :class:`DataSource` of micro-batches.

    ``dataset`` (any map-style or iterable dataset of samples) wins; otherwise the token shards
    of ``data.shards``, the text stream when ``data.text_path`` is set (bytes, or
    ``tokenizer``), else the synthetic stream. ``seq_len``/``vocab_size`` are the model's
    limits: ``data.seq_len``/``data.vocab_size`` default to them and may not exceed them.
    ``seed`` overrides ``data.seed``/``run.seed``.

    ``rank``/``num_ranks`` give this process its own share of the samples (a DDP rank or a
    DiLoCo node): the shard, synthetic and byte-level streams read the global samples
    ``i * num_ranks + rank``, disjoint between ranks that pass the same ``seed``.

    ``participant_seed`` (the ``data_seed`` hook's answer: a DiLoCo node keyed by its id) wins
    over ``seed`` and gives this process its own sample order from every built-in source: the
    synthetic stream's samples and the shards' shuffle are drawn from it, and the byte-level
    and tokenized text streams and map-style datasets, read in order otherwise, are visited in
    an order drawn from it. The source's ``split`` says which of these applies.
    """
    data = config.data
    micro = data.micro_batch_size
    check_rank(rank, num_ranks)
    own_order = participant_seed is not None
    stream_seed = participant_seed if own_order else seed if seed is not None else config.data_seed
    split = _split_text(rank, num_ranks, participant_seed)
    if dataset is not None:
        if data.text_path or data.shards:
            log.warning(
                "a dataset was passed, so data.%s (%s) is not used",
                "shards" if data.shards else "text_path",
                data.shards or data.text_path,
            )
        if own_order and isinstance(dataset, IterableDataset):
            log.warning(
                "%s is an iterable dataset: this process reads what it yields, the same as "
                "every other node with this config (take `rank`/`num_ranks` in its "
                "data.dataset factory and set distributed.num_nodes/node_rank to split it)",
                type(dataset).__name__,
            )
        return _with_split(
            user_source(
                config,
                dataset,
                stream_seed,
                rank=rank,
                num_ranks=num_ranks,
                shuffle=data.shuffle or own_order,
            ),
            split,
        )

    seq_len = _within("seq_len", data.seq_len, seq_len, "max_seq_len")
    if seq_len is None:
        raise DataError(MISSING_SEQ_LEN)
    if data.shards:
        source = _configured_shards(
            config,
            data.shards,
            vocab_size,
            seq_len=seq_len,
            micro_batch_size=micro,
            seed=stream_seed,
            rank=rank,
            num_ranks=num_ranks,
        )
        return _with_split(source, split)
    if data.text_path:
        path = data.text_path
        if tokenizer is None or tokenizer is byte_tokenizer:
            source = _byte_text_source(
                config,
                seq_len,
                vocab_size,
                rank=rank,
                num_ranks=num_ranks,
                held_out=False,
                order_seed=participant_seed,
            )
            return _with_split(source, split)
        if text_holdout(config):
            raise DataError(
                "eval.holdout_fraction holds out blocks of byte-level text only; with a "
                "tokenizer, set eval.text_path to a separate file"
            )
        if num_ranks > 1:
            log.warning("a tokenized text stream is not split by rank; rank %d reads all", rank)
            split = _split_text(0, 1, participant_seed) + " (tokenized text: not split by rank)"
        stream = TokenizedTextStream(path, seq_len, micro, tokenizer, order_seed=participant_seed)

        def iterate_text(start: int) -> Iterator[Batch]:
            batches = nonempty(
                stream_batches(config, stream),
                f"data.text_path: {path} yields no block of seq_len + 1 = {seq_len + 1} tokens "
                "with this tokenizer",
            )
            return skip_samples(batches, start, micro)

        return DataSource(
            iterate_text,
            exact_resume=False,
            description=f"text {path} ({getattr(tokenizer, '__name__', 'tokenizer')}, "
            f"seq {seq_len})",
            split=split,
        )

    vocab = _within("vocab_size", data.vocab_size, vocab_size, "vocab_size")
    if vocab is None:
        raise DataError(MISSING_VOCAB)
    reader = SyntheticTokenStream(vocab, seq_len, micro, stream_seed)
    return DataSource(
        lambda start: stream_batches(
            config,
            SyntheticTokenStream(
                vocab, seq_len, micro, stream_seed, start, rank=rank, num_ranks=num_ranks
            ),
        ),
        description=f"synthetic (vocab {vocab}, seq {seq_len}, seed {stream_seed})",
        split=split,
        windows=Windows(lambda indices: split_windows(reader.windows_at(indices)), micro),
    )


def _split_text(rank: int, num_ranks: int, participant_seed: int | None) -> str:
    """How this process's share of the data is chosen, for logs and the train_start event."""
    parts = []
    if participant_seed is not None:
        parts.append(f"own order (participant seed {participant_seed})")
    if num_ranks > 1:
        parts.append(f"disjoint slice {rank} of {num_ranks}")
    return ", ".join(parts) or "not split"


def _with_split(source: DataSource, split: str) -> DataSource:
    # A source that knows better (an iterable dataset, which cannot be split) keeps its own.
    if not source.split:
        source.split = split
    return source


def build_eval_source(
    config: SpeedtronicConfig,
    *,
    directory: str | os.PathLike[str] | None = None,
    seq_len: int | None = None,
    vocab_size: int | None = None,
    micro_batch_size: int | None = None,
    rank: int = 0,
    num_ranks: int = 1,
) -> DataSource:
    """The held-out ``eval/`` split of a shard directory (``directory``, else ``data.shards``)
    as a :class:`DataSource`: its windows in shard order, the same ones every time, split by
    ``rank``/``num_ranks`` like training (for rank-sharded evaluation), endless (the evaluator
    takes as many micro-batches as it wants). Nothing here is ever read by training, which
    uses ``train/`` only. The limits follow :func:`build_dataloader`; ``micro_batch_size``
    defaults to ``data.micro_batch_size``.
    """
    data = config.data
    directory = directory or data.shards
    if not directory:
        raise DataError("eval data from token shards needs data.shards (or a shard directory)")
    seq_len = _within("seq_len", data.seq_len, seq_len, "max_seq_len")
    if seq_len is None:
        raise DataError(MISSING_SEQ_LEN)
    return _configured_shards(
        config,
        directory,
        vocab_size,
        split="eval",
        seq_len=seq_len,
        micro_batch_size=micro_batch_size or data.micro_batch_size,
        shuffle=False,
        rank=rank,
        num_ranks=num_ranks,
        where="eval.shards" if directory != data.shards else "data.shards",
    )


def _configured_shards(
    config: SpeedtronicConfig, directory: str, vocab_size: int | None, **options: Any
) -> DataSource:
    """:func:`shard_source` over ``directory`` with what the ``data`` section says of every
    shard read (the vocabulary limit and its name, whether to verify the files)."""
    data = config.data
    return shard_source(
        directory,
        vocab_size=_within("vocab_size", data.vocab_size, vocab_size, "vocab_size"),
        vocab_label="data.vocab_size" if data.vocab_size else "the model's vocab_size",
        verify=data.verify_shards,
        config=config,
        **options,
    )


def text_holdout(config: SpeedtronicConfig) -> float:
    """The fraction of ``data.text_path`` held out for evaluation (0 when eval reads another
    source)."""
    section = config.eval
    if section.text_path or section.shards or not config.data.text_path:
        return 0.0
    return section.holdout_fraction


def build_holdout_source(
    config: SpeedtronicConfig,
    *,
    seq_len: int | None = None,
    vocab_size: int | None = None,
    rank: int = 0,
    num_ranks: int = 1,
) -> DataSource:
    """The held-out tail of ``data.text_path`` (``eval.holdout_fraction`` of its blocks, which
    the training stream skips), in order, split by rank like training."""
    data = config.data
    path = data.text_path
    holdout = text_holdout(config)
    if not path or not holdout:
        raise DataError("a text holdout needs data.text_path and eval.holdout_fraction > 0")
    seq_len = _within("seq_len", data.seq_len, seq_len, "max_seq_len")
    if seq_len is None:
        raise DataError(MISSING_SEQ_LEN)
    return _byte_text_source(
        config, seq_len, vocab_size, rank=rank, num_ranks=num_ranks, held_out=True
    )


def _byte_text_source(
    config: SpeedtronicConfig,
    seq_len: int,
    vocab_size: int | None,
    *,
    rank: int,
    num_ranks: int,
    held_out: bool,
    order_seed: int | None = None,
) -> DataSource:
    """``data.text_path`` read as bytes: the training blocks, or (``held_out``) the held-out
    tail that training skips; both split by rank, the training blocks in the order keyed by
    ``order_seed`` when one is given. The file is checked now, in this process."""
    path = config.data.text_path
    if vocab_size is not None and vocab_size < BYTE_VOCAB:
        raise DataError(
            f"data.text_path: byte-level text needs a vocabulary of at least {BYTE_VOCAB}, but "
            f"the model's vocab_size is {vocab_size}; pass a tokenizer"
        )
    holdout = text_holdout(config)
    micro = config.data.micro_batch_size
    options = {
        "rank": rank,
        "num_ranks": num_ranks,
        "holdout_fraction": holdout,
        "held_out": held_out,
        "order_seed": order_seed,
    }
    reader = ByteTextStream(path, seq_len, micro, **options)
    blocks = reader.num_blocks

    def iterate(start: int) -> Iterator[Batch]:
        return stream_batches(config, ByteTextStream(path, seq_len, micro, start, **options))

    if held_out:
        description = f"held-out last {holdout:.0%} of {path} (bytes)"
    else:
        held = f", last {holdout:.0%} held out for eval" if holdout else ""
        description = f"text {path} (bytes, seq {seq_len}{held})"
    epoch = max(1, blocks // (micro * num_ranks))
    windows = Windows(lambda indices: split_windows(reader.windows_at(indices)), micro, blocks)
    return DataSource(iterate, description=description, epoch_batches=epoch, windows=windows)


MISSING_SEQ_LEN = (
    "the sequence length is unknown: set data.seq_len, or model.max_seq_len (a model without a "
    "max_seq_len attribute takes it from the model section)"
)
MISSING_VOCAB = (
    "the vocabulary size is unknown: set data.vocab_size, or model.vocab_size (a model without "
    "a vocab_size attribute takes it from the model section)"
)


def _within(field: str, configured: int | None, limit: int | None, model_field: str) -> int | None:
    if configured is None:
        return limit
    if limit is not None and configured > limit:
        raise DataError(f"data.{field} is {configured} but the model's {model_field} is {limit}")
    return configured
