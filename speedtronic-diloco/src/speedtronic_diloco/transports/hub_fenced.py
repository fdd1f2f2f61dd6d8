"""The Hub store's fenced writes besides publication: the lease by compare-and-swap
(:func:`write_lease_on_head`) and the deletion of processed deltas (:func:`delete_on_head`),
each one commit on the head it read, and the listing of deltas at a commit (:func:`deltas_at`)."""

from __future__ import annotations

from huggingface_hub import CommitOperationAdd, CommitOperationDelete
from huggingface_hub.errors import RemoteEntryNotFoundError
from huggingface_hub.hf_api import RepoFile

from speedtronic_diloco.transports.base import (
    LEASE_FILE,
    LEASE_LIMIT,
    DeltaInfo,
    Lease,
    LeaseConflictError,
    PermanentTransportError,
    check_fence,
    parse_delta_path,
)
from speedtronic_diloco.transports.hub_commits import Commit, Done, commit_on_head
from speedtronic_diloco.transports.hub_repo import HubRepo

__all__ = ["delete_on_head", "deltas_at", "write_lease_on_head"]


def write_lease_on_head(repo: HubRepo, lease: Lease, expected: Lease | None) -> Lease:
    """Commit ``lease`` on the head the current lease was read at, if that lease is still
    ``expected`` (compare-and-swap; a branch moved by other commits is read again)."""

    def prepare(raced: bool) -> Commit | Done:
        head, raw = repo.head_file(LEASE_FILE, LEASE_LIMIT)
        try:
            current = None if raw is None else Lease.loads(raw, repo.description)
        except PermanentTransportError:  # a malformed lease is no lease
            current = None
        if current == lease:  # an earlier attempt landed and only its reply was lost
            return Done(lease)
        if current != expected:
            raise LeaseConflictError(
                f"{repo.description}: the lease changed (now {current})", current
            )
        return Commit(
            head,
            [CommitOperationAdd(LEASE_FILE, lease.dumps())],
            f"DumbDiLoCo: lease of {lease.holder}, epoch {lease.epoch}",
            lambda info: lease,
        )

    return commit_on_head(repo.api, repo.repo_id, repo.description, "writing the lease", prepare)


def delete_on_head(repo: HubRepo, infos: list[DeltaInfo], fence: Lease | None) -> int:
    """One commit deleting the ``infos`` whose content id at the head is still the listed
    one, on that head, fenced by the lease read there; the number deleted."""

    def prepare(raced: bool) -> Commit | Done:
        head, raw = repo.head_file(LEASE_FILE, LEASE_LIMIT)
        if fence is not None:
            current = None if raw is None else Lease.loads(raw, f"{repo.description}: lease")
            check_fence(current, fence.holder, fence.epoch, f"{repo.description}: delete")
        present = {info.path: info.etag for info in deltas_at(repo, head)}
        doomed = [info.path for info in infos if present.get(info.path) == info.etag]
        if not doomed:
            return Done(0)
        return Commit(
            head,
            [CommitOperationDelete(path_in_repo=path) for path in doomed],
            f"DumbDiLoCo: delete {len(doomed)} processed deltas",
            lambda info: len(doomed),
        )

    return commit_on_head(repo.api, repo.repo_id, repo.description, "deleting deltas", prepare)


def deltas_at(repo: HubRepo, revision: str) -> list[DeltaInfo]:
    """Every delta under ``nodes/`` at ``revision``, from one recursive tree listing."""
    try:
        entries = list(
            repo.api.list_repo_tree(
                repo.repo_id, path_in_repo="nodes", recursive=True, revision=revision
            )
        )
    except RemoteEntryNotFoundError:
        return []
    found = []
    for entry in entries:
        parsed = parse_delta_path(entry.path) if isinstance(entry, RepoFile) else None
        if parsed is not None:
            etag = entry.lfs.sha256 if entry.lfs is not None else entry.blob_id
            found.append(DeltaInfo(parsed[0], parsed[1], entry.path, entry.size, etag))
    return found
