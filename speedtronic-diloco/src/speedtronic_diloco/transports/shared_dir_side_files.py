"""The side files of a shared-directory store (see
:mod:`~speedtronic_diloco.transports.side_files`): written atomically under the store's lock
(fenced by its lease when asked), read through the store's hostile-file checks
(:class:`~speedtronic_diloco.transports.shared_dir_files.StoreDirectory`)."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Collection
from pathlib import Path

from speedtronic_diloco.transports.base import (
    Lease,
    PermanentTransportError,
    check_fence,
    write_verified,
)
from speedtronic_diloco.transports.shared_dir_files import StoreDirectory, classify, local_chunks
from speedtronic_diloco.transports.side_files import check_side_path

__all__ = ["SharedDirSideFiles"]


class SharedDirSideFiles:
    """:class:`~speedtronic_diloco.transports.side_files.SideFiles` of the shared-directory
    store ``store``."""

    def __init__(self, store: StoreDirectory) -> None:
        self.store = store
        self.root = store.root

    def write_side_file(
        self,
        path: str,
        source: Path,
        *,
        fence: Lease | None = None,
        keep: Collection[str] | None = None,
        with_publication: bool = False,
    ) -> None:
        """Write ``source`` to ``path`` atomically (fenced under the lock), now even
        ``with_publication``; see :class:`~speedtronic_diloco.transports.side_files.SideFiles`."""
        target = self.root / check_side_path(path)

        def write() -> None:
            target.parent.mkdir(parents=True, exist_ok=True)
            with self.store.exclusive():
                if fence is not None:
                    check_fence(
                        self.store.lease_now(), fence.holder, fence.epoch, f"{target}: write"
                    )
                write_verified(local_chunks(Path(source)), target, where=str(source))
                for name in os.listdir(target.parent) if keep is not None else ():
                    rel = f"{path.rsplit('/', 1)[0]}/{name}"
                    if rel != path and rel not in keep and not name.startswith("."):
                        with contextlib.suppress(FileNotFoundError):
                            (target.parent / name).unlink()

        classify(f"write {target}", write)

    def read_side_file(
        self,
        path: str,
        dest: Path,
        *,
        size: int,
        sha256: str | None = None,
        revision: str | None = None,
    ) -> Path:
        """Copy the side file ``path`` to ``dest`` (bounded, checked); FileNotFoundError
        becomes a TransientTransportError."""
        source = self.root / check_side_path(path)
        return classify(
            f"read {source}", lambda: self.store.copy_verified(source, Path(dest), size, sha256)
        )

    def list_side_files(self, folder: str) -> list[tuple[str, int]]:
        """``(path, size)`` of the regular files in ``folder`` whose names are side files."""
        found = []
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for name in sorted(os.listdir(self.root / folder)):
                rel = f"{folder}/{name}"
                with contextlib.suppress(OSError, PermanentTransportError):
                    info = os.lstat(self.root / check_side_path(rel))
                    if stat.S_ISREG(info.st_mode):
                        found.append((rel, info.st_size))
        return found
