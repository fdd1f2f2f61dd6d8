"""Durable file writes: temp name, fsync, atomic rename, fsync of the directory.

A crash at any instant leaves either the old file or the complete new one, never a torn one.
Used by checkpoints, saved configs and the shared-directory transport.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from speedtronic._files import read_regular, regular_file_problem

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_with",
    "atomic_writer",
    "free_space",
    "fsync_dir",
    "fsync_file",
    "manifest_entry",
    "probe_writable",
    "read_regular",
    "regular_file_problem",
    "sha256_chunks",
    "sha256_file",
]


def free_space(directory: Path) -> str:
    """ "N MiB free" on the filesystem of ``directory`` (or its nearest existing parent)."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return f"{shutil.disk_usage(probe).free / 2**20:.0f} MiB free there"
    except OSError:
        return "free space unknown"


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename or unlink inside ``directory`` durable (a no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a file that was written through another handle (or by a library) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _replacing(path: str | os.PathLike[str]) -> Iterator[tuple[int, str]]:
    """A temp file beside ``path`` as ``(fd, name)``: renamed over ``path`` on clean exit (the
    caller has closed and fsynced it), removed on error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        yield fd, tmp_name
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Open a temp file beside ``path``; on clean exit fsync it and rename it over ``path``."""
    with _replacing(path) as (fd, _), os.fdopen(fd, "wb") as handle:
        yield handle
        handle.flush()
        os.fsync(handle.fileno())


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Durably replace ``path`` with ``data``."""
    with atomic_writer(path) as handle:
        handle.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Durably replace ``path`` with UTF-8 ``text``."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_with(path: str | os.PathLike[str], write: Callable[[str], None]) -> None:
    """Let ``write(tmp_path)`` produce the file (for libraries that want a path), then fsync and
    rename it over ``path``."""
    with _replacing(path) as (fd, tmp_name):
        os.close(fd)
        write(tmp_name)
        fsync_file(tmp_name)


def sha256_file(path: str | os.PathLike[str], chunk_size: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_entry(path: str | os.PathLike[str], chunk_bytes: int) -> dict[str, Any]:
    """A checkpoint manifest's entry for one file: its size and the sha256 of each
    ``chunk_bytes`` slice (:func:`sha256_chunks`)."""
    return {
        "size": os.stat(path).st_size,
        "chunk_bytes": chunk_bytes,
        "sha256": sha256_chunks(path, chunk_bytes),
    }


def sha256_chunks(
    path: str | os.PathLike[str], chunk_bytes: int = 32 << 20, workers: int | None = None
) -> list[str]:
    """Hex sha256 of each ``chunk_bytes`` slice of a file, hashed on several threads.

    hashlib and ``os.pread`` release the GIL, so a big file hashes at several times the speed
    of :func:`sha256_file` on a multi-core machine. An empty file has one (empty) chunk.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        offsets = list(range(0, size, chunk_bytes)) or [0]

        def digest(offset: int) -> str:
            hasher = hashlib.sha256()
            end = min(offset + chunk_bytes, size)
            while offset < end:
                data = os.pread(fd, min(4 << 20, end - offset), offset)
                if not data:
                    raise OSError(f"{path} shrank while it was being hashed")
                hasher.update(data)
                offset += len(data)
            return hasher.hexdigest()

        threads = min(len(offsets), workers or os.cpu_count() or 1, 16)
        if threads <= 1:
            return [digest(offset) for offset in offsets]
        with ThreadPoolExecutor(threads, thread_name_prefix="sha256") as pool:
            return list(pool.map(digest, offsets))
    finally:
        os.close(fd)


def probe_writable(directory: str | os.PathLike[str]) -> None:
    """Prove that files can be written into ``directory`` the way checkpoints are: create it
    if needed, then create, write, fsync and rename a probe file (removed again). Raises
    ``OSError`` naming what failed."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=".write-probe.", suffix=".tmp", dir=directory)
    final = Path(temp).with_suffix(".done")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(b"speedtronic write probe\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, final)
        fsync_dir(directory)
    finally:
        for leftover in (temp, final):
            with contextlib.suppress(OSError):
                os.unlink(leftover)
