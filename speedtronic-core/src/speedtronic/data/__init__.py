"""Data: the synthetic stream, text streams, token shards, user datasets, resumable loaders,
and ``speedtronic data prepare``.

Built-in sources emit micro-batches ``{"input_ids": [B, T], "labels": [B, T]}`` whose labels are
already shifted: ``labels[:, t]`` is the token that follows ``input_ids[:, t]`` (``-100`` would
be ignored by the loss). For the synthetic, byte-level and token-shard streams, sample ``i``
depends only on the seed (or the files) and ``i``, so the same seed gives the same samples
whatever the micro-batch size or worker count, and a resumed run restarts exactly at the first
sample it has not consumed.

Rooms: :mod:`~speedtronic.data.streams` (batch contract, indexed streams, rank split),
:mod:`~speedtronic.data.synthetic`, :mod:`~speedtronic.data.text`,
:mod:`~speedtronic.data.shards` (reading token shards), :mod:`~speedtronic.data.user` (your
datasets), :mod:`~speedtronic.data.source` (:class:`DataSource`), :mod:`~speedtronic.data.loader`
(``build_dataloader``), and the writer side: :mod:`~speedtronic.data.preparation`,
:mod:`~speedtronic.data.documents`, :mod:`~speedtronic.data.encoders`,
:mod:`~speedtronic.data.format`.

Names are imported on first use, so that ``speedtronic data prepare`` and its worker processes
do not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from speedtronic._lazy import lazy_exports

if TYPE_CHECKING:
    from speedtronic.data.format import FORMAT_VERSION
    from speedtronic.data.loader import build_dataloader, build_eval_source, build_holdout_source
    from speedtronic.data.preparation import PrepareResult, prepare
    from speedtronic.data.shards import (
        Shard,
        ShardIndex,
        ShardTokenStream,
        check_shards,
        permute_windows,
        read_index,
        shard_source,
    )
    from speedtronic.data.source import DataSource, Windows, repeat_epochs
    from speedtronic.data.streams import IGNORE_INDEX, Batch, IndexedTokenStream, split_windows
    from speedtronic.data.synthetic import SyntheticTokenStream
    from speedtronic.data.text import (
        BYTE_VOCAB,
        ByteTextStream,
        TokenizedTextStream,
        Tokenizer,
        byte_tokenizer,
        check_text_file,
    )

__all__ = [
    "BYTE_VOCAB",
    "FORMAT_VERSION",
    "IGNORE_INDEX",
    "Batch",
    "ByteTextStream",
    "DataSource",
    "IndexedTokenStream",
    "PrepareResult",
    "Shard",
    "ShardIndex",
    "ShardTokenStream",
    "SyntheticTokenStream",
    "TokenizedTextStream",
    "Tokenizer",
    "Windows",
    "build_dataloader",
    "build_eval_source",
    "build_holdout_source",
    "byte_tokenizer",
    "check_shards",
    "check_text_file",
    "permute_windows",
    "prepare",
    "read_index",
    "repeat_epochs",
    "shard_source",
    "split_windows",
]

# public name -> (module, attribute)
_EXPORTS: dict[str, tuple[str, str]] = {
    "BYTE_VOCAB": ("text", "BYTE_VOCAB"),
    "FORMAT_VERSION": ("format", "FORMAT_VERSION"),
    "IGNORE_INDEX": ("streams", "IGNORE_INDEX"),
    "Batch": ("streams", "Batch"),
    "ByteTextStream": ("text", "ByteTextStream"),
    "DataSource": ("source", "DataSource"),
    "IndexedTokenStream": ("streams", "IndexedTokenStream"),
    "PrepareResult": ("preparation", "PrepareResult"),
    "Shard": ("shards", "Shard"),
    "ShardIndex": ("shards", "ShardIndex"),
    "ShardTokenStream": ("shards", "ShardTokenStream"),
    "SyntheticTokenStream": ("synthetic", "SyntheticTokenStream"),
    "TokenizedTextStream": ("text", "TokenizedTextStream"),
    "Tokenizer": ("text", "Tokenizer"),
    "Windows": ("source", "Windows"),
    "build_dataloader": ("loader", "build_dataloader"),
    "build_eval_source": ("loader", "build_eval_source"),
    "build_holdout_source": ("loader", "build_holdout_source"),
    "byte_tokenizer": ("text", "byte_tokenizer"),
    "check_shards": ("shards", "check_shards"),
    "check_text_file": ("text", "check_text_file"),
    "permute_windows": ("shards", "permute_windows"),
    "prepare": ("preparation", "prepare"),
    "read_index": ("shards", "read_index"),
    "repeat_epochs": ("source", "repeat_epochs"),
    "shard_source": ("shards", "shard_source"),
    "split_windows": ("streams", "split_windows"),
    # Names the single-module speedtronic.data had (internal helpers included), kept working.
    "_GOLDEN": ("streams", "_GOLDEN"),
    "_MASK64": ("streams", "_MASK64"),
    "_mix64": ("streams", "_mix64"),
    "_SYNTHETIC_STEPS": ("synthetic", "_SYNTHETIC_STEPS"),
    "_SYNTHETIC_CDF": ("synthetic", "_SYNTHETIC_CDF"),
    "_OwnFileHandle": ("text", "_OwnFileHandle"),
    "_token_array": ("text", "_token_array"),
    "_loader": ("source", "stream_batches"),
    "_loader_kwargs": ("source", "loader_kwargs"),
    "_repeat_epochs": ("source", "_repeat_epochs"),
    "_nonempty": ("source", "nonempty"),
    "_skip": ("source", "skip_samples"),
    "_user_source": ("user", "user_source"),
    "_OrderSampler": ("user", "_OrderSampler"),
    "_within": ("loader", "_within"),
    "DataLoader": ("source", "DataLoader"),
    "Dataset": ("source", "Dataset"),
    "IterableDataset": ("source", "IterableDataset"),
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
