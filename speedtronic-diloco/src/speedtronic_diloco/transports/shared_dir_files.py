"""The files of a shared-directory store, read as untrusted: :class:`StoreDirectory` opens
only regular files inside the store (never a FIFO, a device or a symlink out of it), reads at
most what it was promised, copies atomically, and holds the store's writer lock. The
transport (:mod:`~speedtronic_diloco.transports.shared_dir`), its side files and its left
records all read and write through it."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, TypeVar

from speedtronic_diloco.transports.base import (
    LEASE_FILE,
    LEASE_LIMIT,
    Lease,
    PermanentTransportError,
    TransientTransportError,
    write_verified,
)

try:
    import fcntl
except ImportError:  # not POSIX: only threads of this process are excluded
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "LOCK_FILE",
    "LOCK_WAIT",
    "StoreDirectory",
    "classify",
    "file_kind",
    "local_chunks",
    "store_lock",
]

log = logging.getLogger("speedtronic.diloco.shared_dir")

LOCK_FILE = "global/.lock"
LOCK_WAIT = 10.0
"""Seconds a writer waits for the store lock before a transient error (it is held for
milliseconds per write)."""
_CHUNK = 1 << 20
T = TypeVar("T")

_PROCESS_LOCKS: dict[str, threading.Lock] = {}
_PROCESS_LOCKS_GUARD = threading.Lock()


def classify(what: str, call: Callable[[], T]) -> T:
    """Run ``call``, turning OS errors into transport errors that say what failed."""
    try:
        return call()
    except PermissionError as exc:
        raise PermanentTransportError(f"{what}: permission denied ({exc})") from exc
    except OSError as exc:
        raise TransientTransportError(f"{what}: {exc}") from exc


def file_kind(mode: int) -> str | None:
    """What a non-regular file is, in words; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    for test, name in (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return name
    return "not a regular file"


class StoreDirectory:
    """The store under ``root``: safe reads, atomic copies, the writer lock (waited for at
    most ``lock_wait`` seconds) and the lease file as it is now."""

    def __init__(self, root: Path, lock_wait: float = LOCK_WAIT) -> None:
        self.root = root
        self.lock_wait = float(lock_wait)
        self._refused: set[tuple[str, str]] = set()

    def real_root(self) -> str:
        return os.path.realpath(self.root)

    def _inside(self, real: str) -> bool:
        root = self.real_root()
        return real == root or real.startswith(root.rstrip(os.sep) + os.sep)

    def refuse(self, path: Path, why: str) -> PermanentTransportError:
        """The error for a refused store file; logged once per file and reason."""
        message = f"{path}: {why}; refused"
        if (str(path), why) not in self._refused:
            if len(self._refused) > 10_000:
                self._refused.clear()
            self._refused.add((str(path), why))
            log.warning("%s (a hostile or broken file in the store)", message)
        return PermanentTransportError(message)

    def check_link(self, path: Path) -> None:
        """Refuse ``path`` when it resolves outside the store."""
        real = os.path.realpath(path)
        if not self._inside(real):
            raise self.refuse(path, f"a symlink pointing outside the store (to {real})")

    @contextlib.contextmanager
    def open_regular(self, path: Path) -> Iterator[tuple[BinaryIO, int]]:
        """``(reader, size)`` of the regular file ``path`` inside the store; refuses special
        files and symlinks out of the store without blocking on them (FileNotFoundError when
        it does not exist)."""
        self.check_link(path)
        real = os.path.realpath(path)
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(real, flags | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            if isinstance(exc, (FileNotFoundError, PermissionError)):
                raise
            with contextlib.suppress(OSError):  # ENXIO (socket), ELOOP (swapped for a link)...
                kind = file_kind(os.lstat(real).st_mode)
                if kind is not None:
                    raise self.refuse(path, f"{kind}, not a regular file") from None
            raise
        try:
            info = os.fstat(fd)
            kind = file_kind(info.st_mode)
            if kind is not None:
                raise self.refuse(path, f"{kind}, not a regular file")
            os.set_blocking(fd, True)
            reader = os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise
        with reader:
            yield reader, info.st_size

    def chunks(self, path: Path, limit: int | None) -> Iterator[bytes]:
        """The bytes of ``path``, at most ``limit + 1`` of them (one more than promised, so
        that a too-long file is detected without reading it all)."""
        with self.open_regular(path) as (reader, size):
            left = (size if limit is None else limit) + 1
            while left > 0 and (chunk := reader.read(min(_CHUNK, left))):
                left -= len(chunk)
                yield chunk

    def read_small(self, path: Path, limit: int) -> bytes | None:
        """A small file's bytes (None when missing); PermanentTransportError past ``limit``."""
        try:
            data = b"".join(self.chunks(path, limit))
        except FileNotFoundError:
            return None
        if len(data) > limit:
            raise PermanentTransportError(f"{path} is larger than {limit} bytes; not ours")
        return data

    def copy_verified(self, source: Path, dest: Path, size: int | None, sha256: str | None) -> Path:
        """Copy the store file ``source`` to ``dest`` atomically, reading at most ``size``
        bytes (+1) and checking size/sha256 of the bytes copied."""
        try:
            return write_verified(
                self.chunks(source, size), dest, where=str(source), size=size, sha256=sha256
            )
        except FileNotFoundError as exc:
            raise TransientTransportError(
                f"{source} is gone (replaced by a newer version?)"
            ) from exc

    def exclusive(self) -> contextlib.AbstractContextManager[None]:
        """The store's writer lock (see :func:`store_lock`)."""
        return store_lock(self.root / LOCK_FILE, self.real_root(), self.lock_wait)

    def lease_now(self) -> Lease | None:
        """The store's lease as ``global/lease.json`` says now (None: no lease)."""
        path = self.root / LEASE_FILE
        raw = self.read_small(path, LEASE_LIMIT)
        return None if raw is None else Lease.loads(raw, str(path))


def local_chunks(source: Path) -> Iterator[bytes]:
    """A local file of our own (the master's weights, a node's outbox delta)."""
    with open(source, "rb") as reader:
        while chunk := reader.read(_CHUNK):
            yield chunk


@contextlib.contextmanager
def store_lock(path: Path, real_root: str, lock_wait: float) -> Iterator[None]:
    """A store's writer lock: this process's threads, then other processes (lockf on
    ``path``), waited for at most ``lock_wait`` seconds in all; past that a retryable error
    naming the lock file."""

    def timeout(holder: str) -> TransientTransportError:
        return TransientTransportError(
            f"{path}: held by {holder} for more than {lock_wait:g} s (a writer frozen or "
            "stuck while writing?); retrying"
        )

    with _PROCESS_LOCKS_GUARD:
        thread_lock = _PROCESS_LOCKS.setdefault(real_root, threading.Lock())
    deadline = time.monotonic() + lock_wait
    if not thread_lock.acquire(timeout=lock_wait):
        raise timeout("another thread of this process")
    try:
        if fcntl is None:
            yield
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+b") as handle:
            pause = 0.005
            while True:
                try:
                    fcntl.lockf(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:  # EACCES or EAGAIN: another process holds it
                    if exc.errno not in (errno.EACCES, errno.EAGAIN):
                        raise
                left = deadline - time.monotonic()
                if left <= 0:
                    raise timeout("another process")
                time.sleep(min(pause, left))
                pause = min(pause * 2, 0.05)
            try:
                yield
            finally:
                fcntl.lockf(handle.fileno(), fcntl.LOCK_UN)
    finally:
        thread_lock.release()
