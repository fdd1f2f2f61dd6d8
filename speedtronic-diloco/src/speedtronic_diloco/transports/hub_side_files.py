"""The side files of a Hub store (:mod:`~speedtronic_diloco.transports.side_files`): each
written in one commit on the head the lease was read at (fenced), or held back and committed
with the next publication; read pinned to a commit, bounded and checked."""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, CommitOperationDelete
from huggingface_hub.errors import RemoteEntryNotFoundError
from huggingface_hub.hf_api import RepoFile

from speedtronic_diloco.transports.base import (
    LEASE_FILE,
    LEASE_LIMIT,
    Lease,
    PermanentTransportError,
    check_fence,
)
from speedtronic_diloco.transports.hub_commits import Commit, Done, commit_on_head
from speedtronic_diloco.transports.hub_repo import HubRepo
from speedtronic_diloco.transports.side_files import check_side_path

__all__ = ["HubSideFiles"]


class HubSideFiles:
    """:class:`~speedtronic_diloco.transports.side_files.SideFiles` of the Hub repository
    ``repo``; a file written ``with_publication`` waits here for the transport's next
    publication commit (:meth:`take_staged`)."""

    def __init__(self, repo: HubRepo) -> None:
        self.repo = repo
        self._staged: tuple[str, bytes, Collection[str] | None] | None = None

    def write_side_file(
        self,
        path: str,
        source: Path,
        *,
        fence: Lease | None = None,
        keep: Collection[str] | None = None,
        with_publication: bool = False,
    ) -> None:
        """One commit adding ``path`` (and deleting the other files of its folder not in
        ``keep``), on the head the lease was read at (fenced). ``with_publication``: held
        back and made part of the next publication's commit instead (one atomic step)."""
        check_side_path(path)
        if with_publication:
            self._staged = (path, Path(source).read_bytes(), keep)
            return

        def prepare(raced: bool) -> Commit | Done:
            head, raw = self.repo.head_file(LEASE_FILE, LEASE_LIMIT)
            if fence is not None:
                current = (
                    None if raw is None else Lease.loads(raw, f"{self.repo.description}: lease")
                )
                check_fence(current, fence.holder, fence.epoch, f"{self.repo.description}: {path}")
            operations = self._side_operations(head, path, str(source), keep)
            return Commit(head, operations, f"DumbDiLoCo: {path}", lambda info: None)

        self.repo.call(
            f"write {path}",
            lambda: commit_on_head(
                self.repo.api, self.repo.repo_id, self.repo.description, path, prepare
            ),
        )

    def _side_operations(
        self, head: str, path: str, source: str | bytes, keep: Collection[str] | None
    ) -> list[Any]:
        """Add ``path``; delete the other files of its folder at ``head`` not in ``keep``."""
        operations: list[Any] = [CommitOperationAdd(path, source)]
        if keep is not None:
            operations += [
                CommitOperationDelete(path_in_repo=other)
                for other, _ in self._side_files_at(path.rsplit("/", 1)[0], head)
                if other != path and other not in keep
            ]
        return operations

    def take_staged(self, head: str) -> list[Any]:
        """The operations of the side file held back for the publication committing on
        ``head`` (none: [])."""
        return [] if self._staged is None else self._side_operations(head, *self._staged)

    def drop_staged(self) -> None:
        """The publication ended: its side file was written with it, or not at all."""
        self._staged = None

    def read_side_file(
        self,
        path: str,
        dest: Path,
        *,
        size: int,
        sha256: str | None = None,
        revision: str | None = None,
    ) -> Path:
        """Download the side file ``path`` at ``revision`` (default: the head), checked."""
        check_side_path(path)
        at = revision or "main"
        return self.repo.call(
            f"download {path}@{at[:12]}",
            lambda: self.repo.files.download(path, at, Path(dest), size=size, sha256=sha256),
        )

    def list_side_files(self, folder: str) -> list[tuple[str, int]]:
        """``(path, size)`` of the side files in ``folder`` at the head."""
        return self.repo.call(f"list {folder}", lambda: self._side_files_at(folder, "main"))

    def _side_files_at(self, folder: str, revision: str) -> list[tuple[str, int]]:
        try:
            entries = list(
                self.repo.api.list_repo_tree(
                    self.repo.repo_id, path_in_repo=folder, revision=revision
                )
            )
        except RemoteEntryNotFoundError:
            return []
        found = []
        for entry in entries:
            if isinstance(entry, RepoFile):
                with contextlib.suppress(PermanentTransportError):
                    found.append((check_side_path(entry.path), int(entry.size or 0)))
        return found
