"""Reading files that someone else may have put there: regular files only, bounded.

Free of heavy imports, so that ``speedtronic data prepare``'s worker processes can use it
without importing torch (as :mod:`speedtronic.checkpoint` does);
:mod:`speedtronic.checkpoint.fileio` re-exports it.
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["read_regular", "regular_file_problem"]


def regular_file_problem(mode: int) -> str | None:
    """None for a regular file's ``st_mode``, else what it is instead (``a directory``, ...)."""
    if stat.S_ISREG(mode):
        return None
    kinds = {
        stat.S_ISDIR: "a directory",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
    }
    kind = next((name for test, name in kinds.items() if test(mode)), "an unusual file")
    return f"not a regular file ({kind})"


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """At most ``limit + 1`` bytes of the regular file ``path`` (the caller tells a file over
    ``limit`` by the length). Anything else (a FIFO, a device, a directory) is an
    :class:`OSError` saying what it is, raised without blocking: a FIFO put where a small file
    is expected would otherwise hang its reader until someone writes to it."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        problem = regular_file_problem(os.fstat(fd).st_mode)
        if problem is not None:
            raise OSError(errno.EINVAL, problem, str(path))
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return handle.read(limit + 1)
    finally:
        os.close(fd)
