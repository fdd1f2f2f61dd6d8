"""Where ``speedtronic data prepare`` writes: shards of one split (temp name, fsync, rename),
the output directory's lock, the checks before an ``--out`` is replaced, and the commit that
moves staged shards into place and writes ``index.json`` last."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from speedtronic._files import read_regular
from speedtronic.data.format import (
    FORMAT_NAME,
    INDEX_NAME,
    MAX_INDEX_BYTES,
    SHARD_GLOB,
    SPLITS,
    shard_file,
)
from speedtronic.errors import DataError

__all__ = [
    "LOCK_NAME",
    "SplitWriter",
    "check_replaceable",
    "commit_output",
    "make_readable",
    "prepare_lock",
    "removed_on_failure",
]

LOCK_NAME = ".prepare.lock"


class SplitWriter:
    """Writes one split's token stream as shards of exactly ``shard_tokens`` tokens (the last
    one shorter), each to a temp name, fsynced and renamed; sha256 computed on the way."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory = directory
        self.split = split
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._stack: contextlib.ExitStack | None = None
        self._handle: BinaryIO | None = None
        self._hash = hashlib.sha256()
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while tokens.size:
            if self._handle is None:
                self._open()
            room = self.shard_tokens - self._count
            chunk = tokens[:room]
            data = memoryview(np.ascontiguousarray(chunk)).cast("B")
            self._handle.write(data)  # type: ignore[union-attr]
            self._hash.update(data)
            self._count += chunk.size
            tokens = tokens[room:]
            if self._count == self.shard_tokens:
                self._finish()

    def cut_tail(self, count: int, into: SplitWriter) -> None:
        """Move the last ``count`` tokens written (all in closed shards) into ``into``: the
        shard the cut falls in is rewritten shorter, those after it are removed."""
        assert self._handle is None, "close() first"
        kept = sum(shard["tokens"] for shard in self.shards) - count
        if count <= 0:
            return
        position, start = 0, 0
        while start + self.shards[position]["tokens"] <= kept:
            start += self.shards[position]["tokens"]
            position += 1
        moved = self.shards[position:]
        self.shards = self.shards[:position]
        for number, shard in enumerate(moved):
            path = self.directory / shard["file"]
            tokens = np.fromfile(path, dtype=self.dtype)
            head = kept - start if number == 0 else 0
            into.write(tokens[head:])
            path.unlink()
            if head:
                self.write(tokens[:head])
        self.close()

    def close(self) -> list[dict[str, Any]]:
        if self._handle is not None:
            self._finish()
        return self.shards

    def abort(self) -> None:
        if self._stack is not None:
            stack, self._stack, self._handle = self._stack, None, None
            with contextlib.suppress(Exception):
                stack.__exit__(DataError, DataError("aborted"), None)

    def _open(self) -> None:
        from speedtronic.checkpoint.fileio import atomic_writer

        name = shard_file(self.split, len(self.shards))
        self._stack = contextlib.ExitStack()
        self._handle = self._stack.enter_context(atomic_writer(self.directory / name))
        make_readable(self._handle)
        self._hash = hashlib.sha256()
        self._count = 0

    def _finish(self) -> None:
        assert self._stack is not None
        stack, self._stack, self._handle = self._stack, None, None
        stack.close()  # flush, fsync, rename
        self.shards.append(
            {
                "file": shard_file(self.split, len(self.shards)),
                "tokens": self._count,
                "sha256": self._hash.hexdigest(),
            }
        )


def make_readable(handle: BinaryIO) -> None:
    """Give a temp file (created 0600) the mode a plain ``open`` would: datasets are shared."""
    umask = os.umask(0)
    os.umask(umask)
    with contextlib.suppress(OSError, AttributeError):
        os.fchmod(handle.fileno(), 0o666 & ~umask)


@contextlib.contextmanager
def prepare_lock(out: Path) -> Iterator[None]:
    """One prepare at a time per output directory."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    with open(out / LOCK_NAME, "a+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise DataError(f"another `speedtronic data prepare` is writing {out}") from None
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def removed_on_failure(out: Path, created: Path | None) -> Iterator[None]:
    """A failed prepare leaves no trace of directories it created itself (``created``: the
    highest of them, ``--out`` or a parent): its lock file goes, then each directory up to
    ``created`` that is empty (the lock is released by then)."""
    try:
        yield
    except BaseException:
        if created is not None:
            with contextlib.suppress(OSError):
                (out / LOCK_NAME).unlink(missing_ok=True)
                for directory in (out, *out.parents):
                    directory.rmdir()  # only when empty: never someone else's files
                    if directory == created:
                        break
        raise


def check_replaceable(out: Path) -> None:
    """Refuse, before any work, an ``--out`` whose contents a prepare would destroy without
    them being a prepare's output: someone else's ``index.json``, or a file where the
    ``train/`` or ``eval/`` folder goes (the commit would fail after deleting the old index)."""
    index = out / INDEX_NAME
    if os.path.lexists(index):
        try:
            raw = read_regular(index, MAX_INDEX_BYTES)
        except OSError as exc:
            raise DataError(
                f"--out {out}: cannot replace its {INDEX_NAME}: {exc.strerror or exc}"
            ) from None
        try:
            data = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError):
            data = None  # a damaged index, most likely a prepare's: replaced
        if data is not None and not (isinstance(data, dict) and data.get("format") == FORMAT_NAME):
            raise DataError(
                f"--out {out} holds an {INDEX_NAME} that is not a token-shard index (no "
                f'"format": "{FORMAT_NAME}"); refusing to replace it: pick another --out'
            )
    for split in SPLITS:
        target = out / split
        if os.path.lexists(target) and not target.is_dir():
            raise DataError(
                f"--out {out}: {target} exists and is not a directory; move it away or pick "
                "another --out"
            )


def commit_output(out: Path, staging: Path, index: dict[str, Any]) -> None:
    """Move the staged shards into place and write ``index.json`` last."""
    from speedtronic.checkpoint.fileio import atomic_writer, fsync_dir

    old_index = out / INDEX_NAME
    if old_index.exists():
        old_index.unlink()  # from here until the new index lands, the directory reads as unfinished
        fsync_dir(out)
    for split in SPLITS:
        target = out / split
        new = {Path(entry["file"]).name for entry in index["splits"][split]["shards"]}
        if target.is_dir():
            for stale in target.glob(SHARD_GLOB):
                if stale.name not in new:
                    stale.unlink()
        if new:
            target.mkdir(exist_ok=True)
            for name in sorted(new):
                os.replace(staging / split / name, target / name)
            fsync_dir(target)
        elif target.is_dir() and not any(target.iterdir()):
            target.rmdir()
    with atomic_writer(old_index) as handle:
        make_readable(handle)
        handle.write((json.dumps(index, indent=2) + "\n").encode("utf-8"))
