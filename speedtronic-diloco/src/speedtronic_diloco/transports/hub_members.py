"""The left records of a Hub store (:mod:`~speedtronic_diloco.transports.members`):
``nodes/<node_id>/left.json``, written in one commit by the node itself, read from one tree
listing of ``nodes/`` plus one bounded download per record whose content id is new (a record
already read is not downloaded again)."""

from __future__ import annotations

from typing import TypeVar

from huggingface_hub import CommitOperationAdd, CommitOperationDelete
from huggingface_hub.errors import RemoteEntryNotFoundError
from huggingface_hub.hf_api import RepoFile

from speedtronic_diloco.identity import validate_node_id
from speedtronic_diloco.transports.base import PermanentTransportError
from speedtronic_diloco.transports.hub_commits import Commit, Done, commit_on_head
from speedtronic_diloco.transports.hub_repo import HubRepo
from speedtronic_diloco.transports.members import (
    LEFT_LIMIT,
    MAX_LEFT_RECORDS,
    LeftListing,
    LeftRecord,
    MemberRecords,
    left_path,
    parse_left_path,
)

__all__ = ["HubMembers"]

T = TypeVar("T")
_CACHE = 4 * MAX_LEFT_RECORDS


class HubMembers(MemberRecords):
    """Left records of the Hub repository ``repo``."""

    def __init__(self, repo: HubRepo) -> None:
        self.repo = repo
        self._cache: dict[tuple[str, str], LeftRecord | str] = {}

    def write_left(self, record: LeftRecord) -> None:
        """One commit adding (or replacing) ``nodes/<node_id>/left.json``."""
        validate_node_id(record.node_id)
        path = left_path(record.node_id)
        operation = CommitOperationAdd(path, record.dumps())
        self.repo.call(
            f"write {path}",
            lambda: self.repo.api.create_commit(
                self.repo.repo_id,
                [operation],
                commit_message=f"DumbDiLoCo: {record.node_id} left after step {record.last_step}",
            ),
        )

    def clear_left(self, node_id: str) -> None:
        """One commit deleting ``nodes/<node_id>/left.json`` when the head has it, on that
        head (read again if the branch moved meanwhile)."""
        validate_node_id(node_id)
        path = left_path(node_id)

        def prepare(raced: bool) -> Commit | Done:
            head, raw = self.repo.head_file(path, LEFT_LIMIT)
            if raw is None:
                return Done(None)
            delete = [CommitOperationDelete(path_in_repo=path)]
            return Commit(head, delete, f"DumbDiLoCo: {node_id} is back", lambda info: None)

        self.repo.call(
            f"delete {path}",
            lambda: commit_on_head(
                self.repo.api, self.repo.repo_id, self.repo.description, f"deleting {path}", prepare
            ),
        )

    def read_left(self) -> LeftListing:
        """The records of the branch head (see the module docstring)."""
        return self.repo.call("read left records", self._read_left)

    def _read_left(self) -> LeftListing:
        try:
            entries = list(
                self.repo.api.list_repo_tree(
                    self.repo.repo_id, path_in_repo="nodes", recursive=True, revision="main"
                )
            )
        except RemoteEntryNotFoundError:
            return LeftListing()
        cache = self._cache
        records: dict[str, LeftRecord] = {}
        refused: list[str] = []
        for entry in entries:
            node = parse_left_path(entry.path) if isinstance(entry, RepoFile) else None
            if node is None or len(records) + len(refused) >= MAX_LEFT_RECORDS:
                continue
            key = (entry.path, str(entry.blob_id))
            found = cache.get(key)
            if found is None:
                found = self._fetch_left(entry.path, node, entry.size)
                if found is None:  # deleted since the listing (the node is back)
                    continue
                if len(cache) >= _CACHE:
                    cache.clear()
                cache[key] = found
            if isinstance(found, LeftRecord):
                records[node] = found
            else:
                refused.append(found)
        return LeftListing(records, tuple(refused))

    def _fetch_left(self, path: str, node: str, size: int | None) -> LeftRecord | str | None:
        """The record at ``path``, the message saying why it is refused, or None when it is
        gone."""
        where = f"{self.repo.description}: {path}"
        if size is not None and size > LEFT_LIMIT:
            return f"{where}: larger than {LEFT_LIMIT} bytes; not ours"
        try:
            _, raw = self.repo.files.get_bytes(path, "main", LEFT_LIMIT)
            return None if raw is None else LeftRecord.loads(raw, where, node)
        except PermanentTransportError as exc:
            return str(exc)
