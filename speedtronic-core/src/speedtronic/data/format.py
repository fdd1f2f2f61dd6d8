"""The on-disk format of a token-shard directory, shared by the writer and the reader.

```
DIR/index.json            the commit record: written last, atomically
DIR/train/shard_00000.bin little-endian uint16 (vocab <= 65536) or uint32 token ids
DIR/eval/shard_00000.bin  the held-out split (``--eval-fraction``, see ``--eval-split``)
```

A directory without ``index.json`` is an unfinished (or killed) prepare and is never read.
"""

from __future__ import annotations

import re

import numpy as np

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_NAME",
    "NO_EVAL_SPLIT_HINT",
    "SPLITS",
    "dtype_for_vocab",
    "shard_file",
]

FORMAT_NAME = "speedtronic-token-shards"
FORMAT_VERSION = 1
INDEX_NAME = "index.json"
SPLITS = ("train", "eval")
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
# index.json lists at most a few hundred bytes per shard; anything larger is not ours.
MAX_INDEX_BYTES = 64 << 20
SHARD_FILE = re.compile(r"^(train|eval)/shard_[0-9]{5,9}\.bin$")
SHARD_GLOB = "shard_*.bin"
# What to do about a shard directory without an eval split (the error says it after the path).
NO_EVAL_SPLIT_HINT = (
    "prepare it with --eval-fraction F; for a corpus of few documents, such as one text file, "
    "add --eval-split tail to hold out the end of the token stream, or --blank-line-documents "
    "to make each blank-line-separated block a document"
)


def dtype_for_vocab(vocab_size: int) -> str:
    """``uint16`` when every id of a ``vocab_size`` vocabulary fits in 16 bits, else ``uint32``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_file(split: str, number: int) -> str:
    """The path of shard ``number`` of ``split``, relative to the shard directory."""
    return f"{split}/shard_{number:05d}.bin"
