"""Token shards written by ``speedtronic data prepare``: the index, its checks, and the
memory-mapped, window-shuffled stream.

A split (``train`` or ``eval``) is a list of shards; shard ``s`` of ``n_s`` tokens holds the
windows ``k = 0 .. (n_s - 1) // seq_len - 1`` of ``seq_len + 1`` tokens at offset
``k * seq_len`` (consecutive windows share one token, as the byte text stream's blocks do; a
shard's last ``< seq_len`` tokens are in no window). All windows of all shards are numbered
``0 .. W - 1`` in shard order.

Global sample ``g`` is window ``perm_e(g mod W)`` of epoch ``e = g // W``, where ``perm_e`` is
a pseudo-random permutation of ``[0, W)`` keyed by ``(seed, e)``: a keyed bijective mixer on
the window number's bits (rounds of xor, odd multiply and xorshift) with cycle walking,
computed per sample in O(1) memory, so it scales to billions of windows. Every window is read
exactly once per epoch, each epoch in a new order, and sample ``g`` depends only on
``(seed, g)``: the micro-batch size, the worker count and a resume do not change what is read.
Rank ``r`` of ``R`` (a DDP rank or a DiLoCo node, sharing the seed) reads ``g = i * R + r``
(see :class:`~speedtronic.data.streams.IndexedTokenStream`).

Shards are opened lazily, per process, as ``numpy.memmap``: a process maps only the shards
whose windows it reads, and nothing is loaded whole.
"""

from __future__ import annotations

import functools
import json
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from speedtronic._files import read_regular, regular_file_problem
from speedtronic.data.format import (
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_NAME,
    MAX_INDEX_BYTES,
    NO_EVAL_SPLIT_HINT,
    SHARD_FILE,
    SPLITS,
)
from speedtronic.data.source import DataSource, Windows, stream_batches
from speedtronic.data.streams import (
    _GOLDEN,
    _MASK64,
    Batch,
    IndexedTokenStream,
    _mix64,
    _seed_key,
    split_windows,
)
from speedtronic.errors import DataError

if TYPE_CHECKING:
    from speedtronic.config import SpeedtronicConfig

__all__ = [
    "Shard",
    "ShardIndex",
    "ShardTokenStream",
    "check_shards",
    "permute_windows",
    "read_index",
    "shard_source",
]

_ROUNDS = 4
_ROUND_SALTS = np.arange(1, _ROUNDS + 1, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)
_SCALAR_BELOW = 64
_SHA256_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Shard:
    """One shard file of a split: its path, its name in ``index.json``, tokens and sha256."""

    path: str
    file: str
    tokens: int
    sha256: str


@dataclass(frozen=True)
class ShardIndex:
    """A validated ``index.json``."""

    directory: Path
    dtype: str
    vocab_size: int
    eos_id: int | None
    tokenizer: dict[str, Any]
    splits: dict[str, tuple[Shard, ...]]
    raw: dict[str, Any]

    @property
    def path(self) -> Path:
        """The ``index.json`` file."""
        return self.directory / INDEX_NAME

    @property
    def numpy_dtype(self) -> np.dtype:
        """The shards' little-endian NumPy dtype."""
        return DTYPES[self.dtype]

    def shards(self, split: str) -> tuple[Shard, ...]:
        """The shards of ``split`` (``train`` or ``eval``; empty when it has none)."""
        return self.splits.get(split, ())

    def tokens(self, split: str) -> int:
        """How many tokens ``split`` holds."""
        return sum(shard.tokens for shard in self.shards(split))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_index(directory: str | os.PathLike[str], where: str = "data.shards") -> ShardIndex:
    """Read and check ``DIR/index.json``; any problem is one :class:`DataError` naming the file
    (and the field or shard) and starting with ``where``."""
    root = Path(directory)
    if not root.exists():
        raise DataError(f"{where}: directory not found: {root}")
    if not root.is_dir():
        raise DataError(f"{where}: not a directory: {root}")
    path = root / INDEX_NAME
    try:
        raw = read_regular(path, MAX_INDEX_BYTES)  # a FIFO there must not hang the reader
    except FileNotFoundError:
        raise DataError(
            f"{where}: {root} has no {INDEX_NAME}: it is not a token-shard directory, or its "
            "`speedtronic data prepare` did not finish (run it again)"
        ) from None
    except OSError as exc:
        raise DataError(f"{where}: cannot read {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_INDEX_BYTES:
        raise DataError(f"{where}: {path} is larger than {MAX_INDEX_BYTES >> 20} MiB: not an index")

    def bad(problem: str) -> DataError:
        return DataError(f"{where}: {path}: {problem}")

    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise bad("not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise bad(f"not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except (ValueError, RecursionError):
        raise bad("not valid JSON") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise bad(f'not a token-shard index (no "format": "{FORMAT_NAME}")')
    version = data.get("version")
    if not _is_int(version) or version < 1:
        raise bad(f"version must be a positive integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise bad(
            f"format version {version} is newer than this speedtronic-core reads "
            f"({FORMAT_VERSION}); upgrade speedtronic-core"
        )
    dtype = data.get("dtype")
    if dtype not in DTYPES:
        raise bad(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if data.get("byte_order", "little") != "little":
        raise bad(f"byte_order must be 'little', got {data.get('byte_order')!r}")
    vocab = data.get("vocab_size")
    if not _is_int(vocab) or vocab < 1:
        raise bad(f"vocab_size must be a positive integer, got {vocab!r}")
    capacity = 1 << (8 * DTYPES[dtype].itemsize)
    if vocab > capacity:
        raise bad(f"dtype {dtype} cannot hold the ids of vocab_size {vocab} (a dtype mismatch)")
    eos = data.get("eos_id")
    if eos is not None and (not _is_int(eos) or not 0 <= eos < vocab):
        raise bad(f"eos_id must be null or an id below vocab_size {vocab}, got {eos!r}")
    tokenizer = data.get("tokenizer", {})
    if not isinstance(tokenizer, dict):
        raise bad("tokenizer must be an object")
    splits_data = data.get("splits")
    if not isinstance(splits_data, dict) or "train" not in splits_data:
        raise bad("splits must be an object with a train split")
    splits: dict[str, tuple[Shard, ...]] = {}
    seen: set[str] = set()
    for split, entry in splits_data.items():
        if split not in SPLITS:
            raise bad(f"unknown split {split!r} (expected {' or '.join(SPLITS)})")
        shards_data = entry.get("shards") if isinstance(entry, dict) else None
        if not isinstance(shards_data, list):
            raise bad(f"splits.{split}.shards must be a list")
        shards = []
        for number, item in enumerate(shards_data):
            at = f"splits.{split}.shards[{number}]"
            if not isinstance(item, dict):
                raise bad(f"{at} must be an object")
            file, tokens, digest = item.get("file"), item.get("tokens"), item.get("sha256")
            # The name is checked against the one pattern prepare writes: a hostile index
            # cannot point outside the directory.
            if not isinstance(file, str) or not SHARD_FILE.match(file):
                raise bad(f"{at}.file must look like {split}/shard_00000.bin, got {file!r}")
            if not file.startswith(f"{split}/"):
                raise bad(f"{at}.file {file!r} is not in the {split}/ folder")
            if file in seen:
                raise bad(f"{at}.file {file!r} is listed twice")
            seen.add(file)
            if not _is_int(tokens) or tokens < 1:
                raise bad(f"{at}.tokens must be a positive integer, got {tokens!r}")
            if not (isinstance(digest, str) and len(digest) == 64 and set(digest) <= _SHA256_HEX):
                raise bad(f"{at}.sha256 must be 64 lowercase hex digits")
            shards.append(Shard(str(root / file), file, tokens, digest))
        splits[split] = tuple(shards)
    return ShardIndex(
        directory=root,
        dtype=dtype,
        vocab_size=vocab,
        eos_id=eos,
        tokenizer=tokenizer,
        splits=splits,
        raw=data,
    )


def check_shards(
    index: ShardIndex, split: str, verify: bool = False, where: str = "data.shards"
) -> tuple[Shard, ...]:
    """Check that every shard of ``split`` exists with the size the index gives it and, with
    ``verify``, the same sha256 and only ids below the vocabulary; return the shards."""
    itemsize = index.numpy_dtype.itemsize
    shards = index.shards(split)
    for shard in shards:
        expected = shard.tokens * itemsize
        try:
            info = os.stat(shard.path)
        except FileNotFoundError:
            raise DataError(
                f"{where}: shard {shard.path} is missing (listed in index.json)"
            ) from None
        except OSError as exc:
            raise DataError(f"{where}: cannot read shard {shard.path}: {exc.strerror}") from None
        problem = regular_file_problem(info.st_mode)
        if problem is not None:  # a directory or a FIFO, say, cannot be memory-mapped
            raise DataError(f"{where}: shard {shard.path} is {problem}")
        size = info.st_size
        if size != expected:
            raise DataError(f"{where}: {_size_problem(shard, size, index.dtype)}")
    if verify:
        from speedtronic.checkpoint.fileio import sha256_file

        for shard in shards:
            try:
                digest = sha256_file(shard.path)
            except OSError as exc:
                raise DataError(
                    f"{where}: cannot read shard {shard.path}: {exc.strerror}"
                ) from None
            if digest != shard.sha256:
                raise DataError(
                    f"{where}: shard {shard.path} fails data.verify_shards: its sha256 is "
                    f"{digest[:16]}..., index.json says {shard.sha256[:16]}...: the shard is "
                    "corrupt or was changed after prepare"
                )
            largest = _max_token(shard, index.numpy_dtype)
            if largest >= index.vocab_size:
                raise DataError(
                    f"{where}: shard {shard.path} holds token id {largest}, outside the "
                    f"vocabulary of {index.vocab_size} that index.json declares"
                )
    return shards


def _size_problem(shard: Shard, size: int, dtype: str) -> str:
    itemsize = DTYPES[dtype].itemsize
    expected = shard.tokens * itemsize
    listed = f"index.json lists {shard.tokens} tokens of {dtype} ({expected} bytes)"
    if size < expected:
        return f"shard {shard.path} is truncated: it has {size} bytes, but {listed}"
    for other, other_dtype in DTYPES.items():
        if other != dtype and size == shard.tokens * other_dtype.itemsize:
            return (
                f"shard {shard.path} has {size} bytes, {shard.tokens} tokens of {other}, but "
                f"{listed}: a dtype mismatch"
            )
    return f"shard {shard.path} has {size} bytes, but {listed}: a size mismatch"


def _max_token(shard: Shard, dtype: np.dtype, chunk: int = 1 << 24) -> int:
    tokens = np.memmap(shard.path, dtype=dtype, mode="r", shape=(shard.tokens,))
    try:
        return max(int(tokens[i : i + chunk].max()) for i in range(0, shard.tokens, chunk))
    finally:
        del tokens


@functools.lru_cache(maxsize=64)
def _round_keys(seed: int, epoch: int) -> tuple[tuple[int, int], ...]:
    """The rounds' ``(xor key, odd multiplier)`` of one epoch: a pure function of (seed, epoch)."""
    epoch_key = _mix64(
        _seed_key(seed) ^ _mix64(np.array([epoch & _MASK64], np.uint64) * _GOLDEN + _GOLDEN)
    )
    keys = _mix64(epoch_key + _ROUND_SALTS)
    multipliers = _mix64(epoch_key ^ _ROUND_SALTS * _GOLDEN) | np.uint64(1)
    return tuple(zip(keys.tolist(), multipliers.tolist()))


def _walk(value: int, size: int, bits: int, rounds: tuple[tuple[int, int], ...]) -> int:
    """:func:`_walk_array` for one value, in Python integers (faster for a few values)."""
    mask, shift = (1 << bits) - 1, (bits + 1) // 2
    while True:
        for key, multiplier in rounds:
            value = ((value ^ key) * multiplier) & mask
            value ^= value >> shift
        if value < size:
            return value


def _walk_array(
    values: np.ndarray, size: int, bits: int, rounds: tuple[tuple[int, int], ...]
) -> np.ndarray:
    """Cycle-walk ``values`` (uint64, all below ``size``) through a keyed bijection of
    ``[0, 2**bits)``: rounds of xor with a key, multiplication by an odd number and an
    xorshift, each a bijection of ``bits``-bit words. Walking until the value is below
    ``size`` again is a bijection of ``[0, size)``; ``2**bits < 2 * size``, so about two
    applications suffice on average."""
    mask, shift, limit = np.uint64((1 << bits) - 1), np.uint64((bits + 1) // 2), np.uint64(size)
    keys = [(np.uint64(key), np.uint64(multiplier)) for key, multiplier in rounds]

    def mix(x: np.ndarray) -> np.ndarray:
        for key, multiplier in keys:
            x = ((x ^ key) * multiplier) & mask
            x ^= x >> shift
        return x

    values = mix(values)
    outside = values >= limit
    while outside.any():
        values = np.where(outside, mix(values), values)
        outside = values >= limit
    return values


def permute_windows(
    positions: np.ndarray, size: int, seed: int, epochs: np.ndarray | int = 0
) -> np.ndarray:
    """Apply epoch ``epochs[i]``'s pseudo-random permutation of ``[0, size)`` (keyed by
    ``seed``) to ``positions[i]``; each epoch's map is a bijection of ``[0, size)``."""
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size and (positions.min() < 0 or positions.max() >= size):
        raise ValueError(f"positions must lie in [0, {size})")
    if size <= 1:
        return np.zeros_like(positions)
    bits = max(2, (size - 1).bit_length())
    epochs = np.broadcast_to(np.asarray(epochs, dtype=np.int64), positions.shape)
    if positions.size <= _SCALAR_BELOW:  # a micro-batch: Python integers beat NumPy's overhead
        flat = [
            _walk(position, size, bits, _round_keys(seed, epoch))
            for position, epoch in zip(positions.ravel().tolist(), epochs.ravel().tolist())
        ]
        return np.array(flat, dtype=np.int64).reshape(positions.shape)
    out = np.empty(positions.shape, dtype=np.uint64)
    for epoch in np.unique(epochs).tolist():
        mask = epochs == epoch
        out[mask] = _walk_array(
            positions[mask].astype(np.uint64), size, bits, _round_keys(seed, epoch)
        )
    return out.astype(np.int64)


class ShardTokenStream(IndexedTokenStream):
    """``seq_len + 1``-token windows of memory-mapped shards, in a seeded per-epoch shuffle
    (``shuffle=True``) or in shard order (``shuffle=False``, for evaluation).

    A process keeps at most ``max_open`` shards mapped (each map holds a file descriptor),
    unmapping the least recently used one beyond that."""

    max_open = 256

    def __init__(
        self,
        shards: Sequence[Shard],
        dtype: str | np.dtype,
        seq_len: int,
        micro_batch_size: int,
        seed: int = 0,
        start_sample: int = 0,
        *,
        shuffle: bool = True,
        rank: int = 0,
        num_ranks: int = 1,
        where: str = "data.shards",
        vocab_size: int | None = None,
    ) -> None:
        super().__init__(seq_len, micro_batch_size, start_sample, rank=rank, num_ranks=num_ranks)
        self.shards = tuple(shards)
        self.vocab_size = vocab_size
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else np.dtype(dtype)
        self.seed = seed
        self.shuffle = shuffle
        self.where = where
        counts = np.array([max(0, (s.tokens - 1) // seq_len) for s in self.shards], np.int64)
        self.num_windows = int(counts.sum())
        if self.num_windows == 0:
            largest = max((s.tokens for s in self.shards), default=0)
            raise DataError(
                f"{where}: no shard holds a window of seq_len + 1 = {seq_len + 1} tokens "
                f"({len(self.shards)} shards, the largest has {largest} tokens)"
            )
        self._first_window = np.concatenate([[0], np.cumsum(counts)])
        self._maps: OrderedDict[int, np.ndarray] = OrderedDict()
        self._pid = -1

    def window_ids(self, indices: np.ndarray) -> np.ndarray:
        """The window numbers of the given global samples."""
        epochs, positions = np.divmod(np.asarray(indices, dtype=np.int64), self.num_windows)
        if not self.shuffle:
            return positions
        return permute_windows(positions, self.num_windows, self.seed, epochs)

    def locate(self, window_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(shard numbers, token offsets)`` of the given windows."""
        shard = np.searchsorted(self._first_window, window_ids, side="right") - 1
        return shard, (window_ids - self._first_window[shard]) * self.seq_len

    def windows_at(self, indices: np.ndarray) -> np.ndarray:
        shards, offsets = self.locate(self.window_ids(indices))
        width = self.seq_len + 1
        out = np.empty((len(offsets), width), dtype=np.int64)
        for row, (shard, offset) in enumerate(zip(shards.tolist(), offsets.tolist())):
            out[row] = self._shard(shard)[offset : offset + width]
        if self.vocab_size is not None and out.size and int(out.max()) >= self.vocab_size:
            self._out_of_vocabulary(out, shards, offsets)
        return out

    def _out_of_vocabulary(self, out: np.ndarray, shards: np.ndarray, offsets: np.ndarray) -> None:
        """Name the first id of ``out`` outside the vocabulary (without this check such an id
        reaches the model's embedding as an opaque index error)."""
        assert self.vocab_size is not None
        row, column = (int(i[0]) for i in np.nonzero(out >= self.vocab_size))
        shard = self.shards[int(shards[row])]
        raise DataError(
            f"{self.where}: shard {shard.path} holds token id {int(out[row, column])} (token "
            f"{int(offsets[row]) + column}), outside the vocabulary of {self.vocab_size} that "
            "index.json declares: the shard is corrupt or was changed after prepare "
            "(data.verify_shards: true checks every shard before training)"
        )

    def opened(self) -> list[int]:
        """The shards this process has mapped so far."""
        return sorted(self._maps) if self._pid == os.getpid() else []

    def _shard(self, number: int) -> np.ndarray:
        if self._pid != os.getpid():  # a DataLoader worker: map its own
            self._maps, self._pid = OrderedDict(), os.getpid()
        tokens = self._maps.get(number)
        if tokens is None:
            if len(self._maps) >= self.max_open:
                # Each map holds a file descriptor: keep the most recently used ones only.
                self._maps.popitem(last=False)
            tokens = self._maps[number] = self._open_shard(number)
        else:
            self._maps.move_to_end(number)
        return tokens

    def _open_shard(self, number: int) -> np.ndarray:
        """Map shard ``number`` read-only (a seam for tests that record what is opened)."""
        shard = self.shards[number]
        try:
            info = os.stat(shard.path)
        except OSError as exc:
            raise DataError(
                f"{self.where}: cannot open shard {shard.path}: {exc.strerror}"
            ) from None
        size = info.st_size if regular_file_problem(info.st_mode) is None else -1
        if size != shard.tokens * self.dtype.itemsize:
            raise DataError(
                f"{self.where}: shard {shard.path} changed after it was checked: {size} bytes, "
                f"expected {shard.tokens * self.dtype.itemsize}"
            )
        # A plain ndarray view of the map (the map stays alive as its base): slicing a
        # np.memmap builds a memmap object per slice, several times slower.
        return np.memmap(shard.path, dtype=self.dtype, mode="r", shape=(shard.tokens,)).view(
            np.ndarray
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"], state["_pid"] = OrderedDict(), -1
        return state


def shard_source(
    directory: str | os.PathLike[str],
    *,
    seq_len: int,
    micro_batch_size: int,
    split: str = "train",
    vocab_size: int | None = None,
    vocab_label: str = "the model's vocab_size",
    seed: int = 0,
    shuffle: bool | None = None,
    rank: int = 0,
    num_ranks: int = 1,
    verify: bool = False,
    config: SpeedtronicConfig | None = None,
    where: str = "data.shards",
) -> DataSource:
    """A resumable :class:`DataSource` over one split of a shard directory.

    Checked now, in the calling process: the index, every shard's size (and sha256 with
    ``verify``), the vocabulary against ``vocab_size`` (the model's limit) and that at least one
    window fits. ``shuffle`` defaults to True for ``train`` and False otherwise (an evaluation
    reads the same windows in the same order every time). ``rank``/``num_ranks`` split the
    samples between DDP ranks or DiLoCo nodes, which must share ``seed``. ``config`` supplies
    the DataLoader options (workers, pinning); without it the stream runs in-process.
    """
    index = read_index(directory, where)
    if vocab_size is not None and index.vocab_size > vocab_size:
        raise DataError(
            f"{where}: {index.path} declares a vocabulary of {index.vocab_size} tokens "
            f"(tokenizer {index.tokenizer.get('name', '?')}), more than {vocab_label} "
            f"{vocab_size}: prepare the corpus with the model's tokenizer or grow the model"
        )
    shards = check_shards(index, split, verify=verify, where=where)
    if not shards:
        hint = f" ({NO_EVAL_SPLIT_HINT})" if split == "eval" else ""
        raise DataError(f"{where}: {index.directory} has no {split} split{hint}")
    shuffle = split == "train" if shuffle is None else shuffle

    def stream(start: int) -> ShardTokenStream:
        return ShardTokenStream(
            shards,
            index.dtype,
            seq_len,
            micro_batch_size,
            seed,
            start,
            shuffle=shuffle,
            rank=rank,
            num_ranks=num_ranks,
            where=where,
            vocab_size=index.vocab_size,
        )

    reader = stream(0)  # fails now if no window fits
    windows = reader.num_windows

    def iterate(start: int) -> Iterator[Batch]:
        built = stream(start)
        return stream_batches(config, built) if config is not None else iter(built)

    order = f"shuffled by seed {seed}" if shuffle else "in order"
    ranks = f", rank {rank} of {num_ranks}" if num_ranks > 1 else ""
    return DataSource(
        iterate,
        epoch_batches=max(1, windows // (micro_batch_size * num_ranks)),
        # A shuffled split is read by sample number like any other: sample g < W is the
        # first epoch's g-th window, so samples 0 .. W - 1 are every window once.
        windows=Windows(
            lambda indices: split_windows(reader.windows_at(indices)), micro_batch_size, windows
        ),
        description=f"shards {index.directory}/{split} ({len(shards)} shards, "
        f"{index.tokens(split)} {index.dtype} tokens, {windows} windows of seq {seq_len}, "
        f"{order}{ranks})",
    )
