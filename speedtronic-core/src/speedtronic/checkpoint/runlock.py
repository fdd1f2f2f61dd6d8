"""One live run per checkpoint directory: ``.run.lock``, held while a run trains.

Two runs writing one checkpoint directory replace each other's ``latest.json`` and
same-numbered steps. The usual way to get there is not a typo but a launcher killed with
SIGKILL whose ranks went on training: a new run started in the same directory must be
refused while they live.

The lock is an exclusive ``flock`` on ``.run.lock`` taken without waiting. The kernel drops it
when the holding process dies, however it dies, so a lock left by a killed run is never
stale: the next run simply takes it (the pid, host and start time written into the file by a
dead holder are overwritten). A run that ends removes the file while it still holds the lock,
and a run taking the lock checks that the file it locked still has the name, so two runs can
never lock two different files of the same name. A filesystem without ``flock`` (some network
mounts) runs unlocked, with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import time
from pathlib import Path

from speedtronic.errors import CheckpointError

__all__ = ["LOCK_NAME", "RunLock"]

log = logging.getLogger("speedtronic.checkpoint")

LOCK_NAME = ".run.lock"
# What a holder writes into the lock is one short line; read no more of a stranger's file.
_MAX_HOLDER_BYTES = 512


class RunLock:
    """The run lock of one checkpoint directory, held from :meth:`acquire` to
    :meth:`release`."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path = path
        self._fd = fd

    @property
    def held(self) -> bool:
        """True while this process holds the lock (False on a filesystem without locks)."""
        return self._fd is not None

    @classmethod
    def acquire(cls, directory: str | os.PathLike[str]) -> RunLock:
        """Lock ``directory`` (created if needed) for this run, or raise
        :class:`~speedtronic.errors.CheckpointError` naming the live run that holds it."""
        try:
            import fcntl
        except ImportError:  # not POSIX
            return cls(Path(directory) / LOCK_NAME, None)
        path = Path(directory) / LOCK_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(10):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise CheckpointError(
                    f"{path.parent} is in use by another live run ({holder}); wait for it to "
                    "finish or stop it (after a killed launcher, its ranks may still run), or "
                    "choose another --output-dir (run.output_dir) / checkpoint.directory"
                ) from None
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    log.warning(
                        "%s: no file locks on this filesystem; running without a run lock", path
                    )
                    return cls(path, None)
                raise
            # A releasing run unlinks the file before unlocking it: the lock only counts if
            # it is on the file that still has the name.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            raise CheckpointError(f"{path}: the run lock kept being replaced; try again")
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        line = f"pid {os.getpid()} on {socket.gethostname()} since {stamp}\n".encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, line, 0)
        except OSError as exc:  # the lock holds without its note; say so, nothing more
            log.debug("could not write %s: %s", path, exc)
        return cls(path, fd)

    def release(self) -> None:
        """Give the lock up (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        import fcntl

        # Unlinked while still locked (see acquire), so the directory keeps no trace of the
        # run; unlocked explicitly, as a forked child (a data worker) may share the descriptor.
        with contextlib.suppress(OSError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, _MAX_HOLDER_BYTES, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text.splitlines()[0][:200] if text else "holder unknown"
