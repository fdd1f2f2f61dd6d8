"""A DumbDiLoCo store in a Hugging Face Hub repository: the Hub repo is the parameter server.

The layout is the one of :mod:`speedtronic_diloco.transports.base`. What the Hub adds:

* **Atomic, checked publication.** The weights and ``global/step_count.json`` (hashes and the
  processed-delta ledger included) go in ONE commit, so a reader never sees new metadata with
  other weights. The commit names as ``parent_commit`` the head at which the current metadata
  was just read; if anything was committed in between, the Hub refuses it with HTTP 412. The
  transport then reads again: when only workers' deltas moved the branch it commits again on
  the new head; when another master published this outer step or a newer one it raises
  :class:`PublishConflictError` instead of overwriting that work.
* **Fragment files.** With streaming fragments each fragment's global lives at a fixed path,
  ``global/fragment_<j>.safetensors``; a fragment round commits that file and the metadata
  listing every fragment's file, sha256 and size (``fragment_files``) in ONE commit, fenced and
  checked like any publication. Readers download each file at the commit the metadata was read
  at, so a fixed path is never ambiguous, and the head holds K fragment files, never more.
* **Pinned, verified downloads.** Metadata is read together with the commit it was read at
  (``X-Repo-Commit``); the weights are downloaded at that commit and checked against the
  metadata's size and sha256 (the client itself only checks sizes). Downloads stream straight
  to the caller's file, bypassing the client's cache, which can serve stale or tampered bytes.
* **Listing without downloads.** New deltas are found from one recursive tree listing of
  ``nodes/`` (names, sizes, content ids); a delta download is checked against that content id.
* **Bounded requests.** Every call runs inside
  :func:`~speedtronic_diloco.transports.hub_session.hub_call`: each request has
  ``request_timeout`` and the client's hidden retries are cut short, so the DiLoCo retry policy
  is the only one. Failures become transport errors
  (:mod:`speedtronic_diloco.transports.hub_errors`), with the token redacted from every message.
* **The lease and its fence.** ``global/lease.json`` is written by compare-and-swap: a commit
  whose ``parent_commit`` is the head the current lease was read at. A publication (and a
  deletion) reads the lease at the head it commits on and refuses unless the lease names its
  master and epoch; the commit's ``parent_commit`` makes that check and the commit one atomic
  step.
* **Bounded storage.** Processed deltas are deleted in one commit per round (separate from the
  publication; only files whose content id is still the listed one), and
  ``squash_history`` squashes the branch into one commit (``HfApi.super_squash_history``).
* **Explicit endpoint and token.** ``huggingface_hub`` reads ``HF_ENDPOINT`` once, at import;
  here the endpoint comes from the config or from ``HF_ENDPOINT`` when the transport is built.
  The token comes from the config or, when unset, from the client's own lookup (``HF_TOKEN``,
  ``hf auth login``) at each request. It is never logged or stored, and neither are the
  credentials of an endpoint URL (``https://user:pass@host`` prints as ``<redacted>@host``).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from huggingface_hub import (
    CommitOperationAdd,
)
from huggingface_hub.errors import (
    HfUriError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile

from speedtronic_diloco.identity import validate_node_id
from speedtronic_diloco.transports.base import (
    GLOBAL_METADATA,
    GLOBAL_WEIGHTS,
    LEASE_FILE,
    LEASE_LIMIT,
    DeltaInfo,
    GlobalMetadata,
    IntegrityError,
    Lease,
    PermanentTransportError,
    Transport,
    UnsupportedOperation,
    check_fence,
    delta_path,
    is_global_file,
    named_fragments,
    redact_userinfo,
)
from speedtronic_diloco.transports.hub_commits import (
    Commit,
    Done,
    PublishConflictError,
    checked_add,
    commit_on_head,
    refuse_if_not_newer,
)
from speedtronic_diloco.transports.hub_fenced import delete_on_head, deltas_at, write_lease_on_head
from speedtronic_diloco.transports.hub_members import HubMembers
from speedtronic_diloco.transports.hub_repo import DEFAULT_ENDPOINT, HubRepo
from speedtronic_diloco.transports.hub_side_files import HubSideFiles

if TYPE_CHECKING:
    from speedtronic_diloco.config import DistributedConfig

__all__ = [
    "DEFAULT_ENDPOINT",
    "HubTransport",
    "PublishConflictError",
    "fragment_path",
    "resolve_endpoint",
]

log = logging.getLogger("speedtronic.diloco.hub")

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_GIT_OID = re.compile(r"^[0-9a-f]{40}$")
T = TypeVar("T")


def resolve_endpoint(endpoint: str | None = None) -> str:
    """The Hub base URL: ``endpoint``, else ``$HF_ENDPOINT`` read now (not the value the client
    froze at import), else ``https://huggingface.co``."""
    url = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise PermanentTransportError(
            f"Hub endpoint {redact_userinfo(url)!r} is not an http(s) URL"
        )
    return url


def fragment_path(index: int) -> str:
    """The store path of fragment ``index``'s global file on the Hub (one per fragment)."""
    return f"global/fragment_{index}.safetensors"


class HubTransport(Transport):
    """The DiLoCo store in the Hub model repository ``repo_id`` (``<user or org>/<name>``).

    Thread-safe: requests share the client's connection pool, publications are serialized.
    """

    supports_fragment_files = True
    min_wait_look_s = 2.0  # the Hub rate-limits API calls; a waiting master's look lists the repo

    def __init__(
        self,
        repo_id: str,
        *,
        token: str | None = None,
        endpoint: str | None = None,
        request_timeout: float = 60.0,
    ) -> None:
        if not _REPO_ID.match(repo_id or ""):
            raise PermanentTransportError(
                f"distributed.repo_id {redact_userinfo(repr(repo_id))} is not a Hub repository "
                "id of the form "
                "'<user or org>/<name>' (use a file:// URL or an absolute path for a shared "
                "directory)"
            )
        if request_timeout <= 0:
            raise PermanentTransportError("distributed.request_timeout must be > 0")
        self.repo_id = repo_id
        self.endpoint = resolve_endpoint(endpoint)
        #: The repository every request goes through (client, bounded and redacted calls).
        self.repo = HubRepo(repo_id, self.endpoint, token, request_timeout)
        self.description = self.repo.description
        self._publish_lock = threading.Lock()
        self.side_files = HubSideFiles(self.repo)
        self.members = HubMembers(self.repo)

    @property
    def request_timeout(self) -> float:
        """Seconds each request may take (the repository's)."""
        return self.repo.request_timeout

    @classmethod
    def from_config(cls, config: DistributedConfig | Any) -> HubTransport:
        """Build from a DistributedConfig (or anything ``distributed_config`` accepts)."""
        from speedtronic_diloco.config import distributed_config

        section = distributed_config(config)
        return cls(
            section.repo_id or "",
            token=section.token,
            endpoint=section.endpoint,
            request_timeout=section.request_timeout,
        )

    def __repr__(self) -> str:
        return f"HubTransport({self.repo_id!r}, endpoint={redact_userinfo(self.endpoint)!r})"

    # -- the Transport interface -----------------------------------------------------------

    def create_store(self, *, private: bool = True) -> None:
        """Create the repository (private by default; an existing one is left as it is), then
        warn loudly if it is public although ``private`` was asked for."""

        def create() -> None:
            try:
                self.repo.api.create_repo(self.repo_id, private=private, exist_ok=True)
            except HfUriError:
                # create_repo was refused (401/402/403), found the repository through repo_info
                # and then failed to parse the URL of an endpoint that is not huggingface.co (a
                # mirror, a test server): the repository exists and can be read.
                log.debug("%s: the repository already exists", self.description)

        self.repo.call("create repository", create)
        info = self.repo.call(
            "check repository visibility",
            lambda: self.repo.api.model_info(self.repo_id, timeout=self.repo.request_timeout),
        )
        if private and info.private is False:
            log.warning(
                "%s is PUBLIC: anyone can download the global weights and every node's deltas. "
                "It existed before this run, so it was not created private. Make it private "
                "(repository Settings > Change visibility) or use a new repo_id.",
                self.description,
            )

    def grant_write_access(self, users: Sequence[str]) -> None:
        """Not possible through the client: raises :class:`UnsupportedOperation` whose message
        says how to grant access by hand (nothing to do for an empty list)."""
        if not users:
            return
        owner = self.repo_id.split("/", 1)[0]
        raise UnsupportedOperation(
            f"{self.description}: huggingface_hub has no API to add collaborators, so "
            f"{', '.join(users)} did not get write access automatically. Either keep the "
            f"repository in an organization and give each worker's account the 'write' role "
            f"(https://huggingface.co/organizations/{owner}/settings/members), or give each "
            f"worker a fine-grained token with write access to {self.repo_id}. See docs/hub.md."
        )

    def _head_metadata(self) -> tuple[str, bytes | None]:
        """``(head commit, step_count.json at that commit or None)``."""
        return self.repo.head_file(GLOBAL_METADATA)

    def read_global_metadata(self) -> GlobalMetadata | None:
        """``global/step_count.json`` of the branch head, pinned to that head's commit."""
        commit, raw = self.repo.call("read global metadata", self._head_metadata)
        return None if raw is None else GlobalMetadata.loads(raw, revision=commit)

    def download_global(self, metadata: GlobalMetadata, dest: Path) -> Path:
        """Download ``metadata.model_file`` at ``metadata.revision`` into ``dest``, verified."""
        if not is_global_file(metadata.model_file):
            raise PermanentTransportError(f"model_file {metadata.model_file!r} is not global/*")
        revision = metadata.revision or "main"

        def fetch() -> Path:
            try:
                return self.repo.files.download(
                    metadata.model_file,
                    revision,
                    Path(dest),
                    size=metadata.size,
                    sha256=metadata.sha256,
                )
            except RevisionNotFoundError as exc:  # history rewritten: the metadata is stale
                raise IntegrityError(
                    f"{self.description}: commit {revision[:12]} no longer exists; "
                    "re-read the metadata"
                ) from exc

        return self.repo.call(f"download {metadata.model_file}@{revision[:12]}", fetch)

    def publish_global(self, weights: Path, metadata: GlobalMetadata) -> GlobalMetadata:
        """One commit with the weights and their metadata, on the head the current metadata
        was read at (see the module doc). Returns the metadata with the new commit."""
        published = metadata.with_revision(None, model_file=GLOBAL_WEIGHTS)
        with self._publish_lock:
            return self.repo.call(
                f"publish outer step {published.outer_step}",
                lambda: self._publish(Path(weights), published),
            )

    def publish_fragments(
        self, files: Mapping[int, Path], metadata: GlobalMetadata
    ) -> GlobalMetadata:
        """One commit with the fragment files and the metadata listing every fragment's file,
        on the head the current metadata was read at (see the module doc)."""
        published = named_fragments(metadata, {j: fragment_path(j) for j in files})
        with self._publish_lock:
            return self.repo.call(
                f"publish outer step {published.outer_step}",
                lambda: self._publish_fragments(files, published),
            )

    def _publish_fragments(
        self, files: Mapping[int, Path], published: GlobalMetadata
    ) -> GlobalMetadata:
        operations = []
        for index, source in sorted(files.items()):
            entry = published.fragment_files[index]
            what = f"fragment {index} is published with"
            operations.append(checked_add(entry.file, source, entry.sha256, entry.size, what))
        return self._commit_global(operations, published)

    def _publish(self, weights: Path, published: GlobalMetadata) -> GlobalMetadata:
        what = "of the metadata being published"
        add = checked_add(GLOBAL_WEIGHTS, weights, published.sha256, published.size, what)
        return self._commit_global([add], published)

    def _commit_global(
        self, files: list[CommitOperationAdd], published: GlobalMetadata
    ) -> GlobalMetadata:
        """Commit ``files`` and ``published`` on the head, fenced and checked (module doc)."""
        payload = published.dumps()

        def prepare(raced: bool) -> Commit | Done:
            head, current = self._head_metadata()
            if current == payload:  # an earlier attempt landed and only its reply was lost
                log.info(
                    "%s: outer step %d was already published at %s",
                    self.description,
                    published.outer_step,
                    head[:12],
                )
                return Done(published.with_revision(head))
            if published.lease_epoch is not None:
                check_fence(
                    self.repo.lease_at(head),
                    published.master or "",
                    published.lease_epoch,
                    f"{self.description}: publishing outer step {published.outer_step}",
                )
            if current is not None:
                refuse_if_not_newer(self.description, current, head, published, raced)
            return Commit(
                head,
                [
                    *files,
                    *self.side_files.take_staged(head),
                    CommitOperationAdd(GLOBAL_METADATA, payload),
                ],
                f"DumbDiLoCo: global weights, outer step {published.outer_step}",
                lambda info: published.with_revision(info.oid),
            )

        try:
            return commit_on_head(
                self.repo.api,
                self.repo_id,
                self.description,
                f"publishing outer step {published.outer_step}",
                prepare,
                hint=" (many concurrent uploads); try again",
            )
        finally:
            self.side_files.drop_staged()  # written with this publication, or not at all

    def upload_delta(self, node_id: str, local_step: int, source: Path) -> None:
        """One commit adding ``nodes/<node_id>/delta_<local_step>.safetensors`` (a commit is
        atomic: readers never see a partial file; re-uploading the same bytes is a no-op)."""
        validate_node_id(node_id)
        path = delta_path(node_id, local_step)

        def upload() -> None:
            operation = CommitOperationAdd(path, str(source))
            self.repo.api.create_commit(
                self.repo_id,
                [operation],
                commit_message=f"DumbDiLoCo: delta of {node_id} at local step {local_step}",
            )

        self.repo.call(f"upload {path}", upload)

    def list_deltas(self) -> list[DeltaInfo]:
        """Every delta under ``nodes/`` from one recursive tree listing (no downloads); the
        etag is the LFS sha256 when the file is in LFS, else its git blob id."""

        found = self.repo.call("list deltas", lambda: deltas_at(self.repo, "main"))
        return sorted(found, key=lambda info: info.key)

    def download_delta(self, info: DeltaInfo, dest: Path) -> Path:
        """Download the delta at the branch head into ``dest``, checked against the listing's
        size and content id (a file replaced since the listing gives IntegrityError)."""
        etag = (info.etag or "").lower()
        return self.repo.call(
            f"download {info.path}",
            lambda: self.repo.files.download(
                info.path,
                "main",
                Path(dest),
                size=info.size,
                sha256=etag if _SHA256.match(etag) else None,
                git_oid=etag if _GIT_OID.match(etag) else None,
            ),
        )

    # -- the lease, bounded storage, status -------------------------------------------------

    def read_lease(self) -> Lease | None:
        """``global/lease.json`` at the branch head; None when there is none."""
        _, raw = self.repo.call(
            "read the lease", lambda: self.repo.head_file(LEASE_FILE, LEASE_LIMIT)
        )
        return None if raw is None else Lease.loads(raw, f"{self.description}: {LEASE_FILE}")

    def write_lease(self, lease: Lease, expected: Lease | None) -> Lease:
        """Commit ``lease`` on the head at which the lease was read, if it still is
        ``expected`` (a branch moved by other commits is read again)."""
        return self.repo.call(
            f"write {LEASE_FILE}", lambda: write_lease_on_head(self.repo, lease, expected)
        )

    def delete_deltas(self, infos: Sequence[DeltaInfo], *, fence: Lease | None = None) -> int:
        """One commit deleting the listed deltas whose content id at the head is still the
        listed one, on that head (fenced by the lease read there)."""
        if not infos:
            return 0
        return self.repo.call(
            f"delete {len(infos)} processed deltas",
            lambda: delete_on_head(self.repo, list(infos), fence),
        )

    def squash_history(self) -> None:
        """Squash the branch into one commit (``HfApi.super_squash_history``): the storage of
        old versions is freed, and every older commit id stops resolving."""
        self.repo.call(
            "squash the history",
            lambda: self.repo.api.super_squash_history(
                self.repo_id, branch="main", commit_message="DumbDiLoCo: squashed history"
            ),
        )

    def store_bytes(self) -> int | None:
        """Bytes of the files at the branch head (the history the Hub keeps is not counted)."""

        def size() -> int:
            entries = self.repo.api.list_repo_tree(self.repo_id, recursive=True, revision="main")
            return sum(entry.size or 0 for entry in entries if isinstance(entry, RepoFile))

        return self.repo.call("measure the repository", size)

    def close(self) -> None:
        """Nothing to release: connections belong to the client's shared pool."""
