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

import contextlib
import logging
import os
import re
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    get_token,
)
from huggingface_hub.errors import (
    HfUriError,
    RemoteEntryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import build_hf_headers

from speedtronic_diloco import __version__
from speedtronic_diloco.identity import validate_node_id
from speedtronic_diloco.transports.base import (
    GLOBAL_METADATA,
    GLOBAL_WEIGHTS,
    LEASE_FILE,
    LEASE_LIMIT,
    METADATA_LIMIT,
    DeltaInfo,
    GlobalMetadata,
    IntegrityError,
    Lease,
    LeaseConflictError,
    PermanentTransportError,
    TransientTransportError,
    Transport,
    UnsupportedOperation,
    check_fence,
    delta_path,
    is_global_file,
    named_fragments,
    parse_delta_path,
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
from speedtronic_diloco.transports.hub_errors import classify, raise_redacted, redact
from speedtronic_diloco.transports.hub_files import HubFiles
from speedtronic_diloco.transports.hub_members import HubMembers
from speedtronic_diloco.transports.hub_session import hub_call
from speedtronic_diloco.transports.side_files import check_side_path

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

DEFAULT_ENDPOINT = "https://huggingface.co"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_GIT_OID = re.compile(r"^[0-9a-f]{40}$")
_LIBRARY = {"library_name": "speedtronic-diloco", "library_version": __version__}
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


class _SideFiles:
    """:class:`~speedtronic_diloco.transports.side_files.SideFiles` of a Hub repository."""

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
            head, raw = self._head_file(LEASE_FILE, LEASE_LIMIT)
            if fence is not None:
                current = None if raw is None else Lease.loads(raw, f"{self.description}: lease")
                check_fence(current, fence.holder, fence.epoch, f"{self.description}: {path}")
            operations = self._side_operations(head, path, str(source), keep)
            return Commit(head, operations, f"DumbDiLoCo: {path}", lambda info: None)

        self._call(
            f"write {path}",
            lambda: commit_on_head(self._api, self.repo_id, self.description, path, prepare),
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

    def _take_staged(self, head: str) -> list[Any]:
        """The operations of the side file held back for this publication (none: [])."""
        return [] if self._staged is None else self._side_operations(head, *self._staged)

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
        return self._call(
            f"download {path}@{at[:12]}",
            lambda: self._files.download(path, at, Path(dest), size=size, sha256=sha256),
        )

    def list_side_files(self, folder: str) -> list[tuple[str, int]]:
        """``(path, size)`` of the side files in ``folder`` at the head."""
        return self._call(f"list {folder}", lambda: self._side_files_at(folder, "main"))

    def _side_files_at(self, folder: str, revision: str) -> list[tuple[str, int]]:
        try:
            entries = list(
                self._api.list_repo_tree(self.repo_id, path_in_repo=folder, revision=revision)
            )
        except RemoteEntryNotFoundError:
            return []
        found = []
        for entry in entries:
            if isinstance(entry, RepoFile):
                with contextlib.suppress(PermanentTransportError):
                    found.append((check_side_path(entry.path), int(entry.size or 0)))
        return found


class HubTransport(HubMembers, _SideFiles, Transport):
    """The DiLoCo store in the Hub model repository ``repo_id`` (``<user or org>/<name>``).

    Thread-safe: requests share the client's connection pool, publications are serialized.
    """

    supports_fragment_files = True

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
        self.request_timeout = float(request_timeout)
        self._token = token or None
        netloc = urlsplit(self.endpoint).netloc
        self._userinfo = netloc.rpartition("@")[0] if "@" in netloc else None
        self._api = HfApi(endpoint=self.endpoint, token=self._token, **_LIBRARY)
        shown = redact_userinfo(self.endpoint)
        where = "" if self.endpoint == DEFAULT_ENDPOINT else f" on {shown}"
        self.description = f"hf://{repo_id}{where}"
        self._publish_lock = threading.Lock()
        # The side file the next publication commits with it (see write_side_file).
        self._staged: tuple[str, bytes, Collection[str] | None] | None = None
        self._files = HubFiles(repo_id, self.endpoint, self._headers)

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

    # -- plumbing ------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with bounded requests; translate client failures (the token and the
        endpoint's credentials redacted, from the message and from the exception chain)."""
        try:
            with hub_call(self.request_timeout):
                return fn()
        except Exception as exc:
            failure = exc
            error = classify(exc, f"{self.description}: {what}")
            if error is None:  # a programming error: keep it as it is
                raise
        raise_redacted(failure, error, self._redact)

    def _redact(self, text: str) -> str:
        """``text`` without the token and the endpoint URL's credentials."""
        text = redact(text, self._secret())
        if self._userinfo:
            text = text.replace(self._userinfo, "<redacted>")
        return text

    def _secret(self) -> str | None:
        """The token in use, only ever to redact it from messages."""
        try:
            return self._token or get_token()
        except Exception:  # a broken token file must not hide the real error
            return self._token

    def _headers(self) -> dict[str, str]:
        return build_hf_headers(token=self._token, **_LIBRARY)

    # -- the Transport interface -----------------------------------------------------------

    def create_store(self, *, private: bool = True) -> None:
        """Create the repository (private by default; an existing one is left as it is), then
        warn loudly if it is public although ``private`` was asked for."""

        def create() -> None:
            try:
                self._api.create_repo(self.repo_id, private=private, exist_ok=True)
            except HfUriError:
                # create_repo was refused (401/402/403), found the repository through repo_info
                # and then failed to parse the URL of an endpoint that is not huggingface.co (a
                # mirror, a test server): the repository exists and can be read.
                log.debug("%s: the repository already exists", self.description)

        self._call("create repository", create)
        info = self._call(
            "check repository visibility",
            lambda: self._api.model_info(self.repo_id, timeout=self.request_timeout),
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
        return self._head_file(GLOBAL_METADATA)

    def _head_file(self, path: str, limit: int = METADATA_LIMIT) -> tuple[str, bytes | None]:
        """``(head commit, the file at that commit or None)``, consistent with each other: one
        GET of the branch head normally (the reply names its commit); if a proxy dropped that
        header, the head is looked up first and the file read pinned to it."""
        commit, raw = self._files.get_bytes(path, "main", limit)
        if commit is not None:
            return commit, raw
        head = self._api.model_info(self.repo_id, revision="main", timeout=self.request_timeout)
        if not head.sha:
            raise TransientTransportError(f"{self.description}: the Hub named no head commit")
        return head.sha, self._files.get_bytes(path, head.sha, limit)[1]

    def _lease_at(self, revision: str) -> Lease | None:
        raw = self._files.get_bytes(LEASE_FILE, revision, LEASE_LIMIT)[1]
        return None if raw is None else Lease.loads(raw, f"{self.description}: {LEASE_FILE}")

    def read_global_metadata(self) -> GlobalMetadata | None:
        """``global/step_count.json`` of the branch head, pinned to that head's commit."""
        commit, raw = self._call("read global metadata", self._head_metadata)
        return None if raw is None else GlobalMetadata.loads(raw, revision=commit)

    def download_global(self, metadata: GlobalMetadata, dest: Path) -> Path:
        """Download ``metadata.model_file`` at ``metadata.revision`` into ``dest``, verified."""
        if not is_global_file(metadata.model_file):
            raise PermanentTransportError(f"model_file {metadata.model_file!r} is not global/*")
        revision = metadata.revision or "main"

        def fetch() -> Path:
            try:
                return self._files.download(
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

        return self._call(f"download {metadata.model_file}@{revision[:12]}", fetch)

    def publish_global(self, weights: Path, metadata: GlobalMetadata) -> GlobalMetadata:
        """One commit with the weights and their metadata, on the head the current metadata
        was read at (see the module doc). Returns the metadata with the new commit."""
        published = metadata.with_revision(None, model_file=GLOBAL_WEIGHTS)
        with self._publish_lock:
            return self._call(
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
            return self._call(
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
                    self._lease_at(head),
                    published.master or "",
                    published.lease_epoch,
                    f"{self.description}: publishing outer step {published.outer_step}",
                )
            if current is not None:
                refuse_if_not_newer(self.description, current, head, published, raced)
            return Commit(
                head,
                [*files, *self._take_staged(head), CommitOperationAdd(GLOBAL_METADATA, payload)],
                f"DumbDiLoCo: global weights, outer step {published.outer_step}",
                lambda info: published.with_revision(info.oid),
            )

        try:
            return commit_on_head(
                self._api,
                self.repo_id,
                self.description,
                f"publishing outer step {published.outer_step}",
                prepare,
                hint=" (many concurrent uploads); try again",
            )
        finally:
            self._staged = None  # written with this publication, or not at all

    def upload_delta(self, node_id: str, local_step: int, source: Path) -> None:
        """One commit adding ``nodes/<node_id>/delta_<local_step>.safetensors`` (a commit is
        atomic: readers never see a partial file; re-uploading the same bytes is a no-op)."""
        validate_node_id(node_id)
        path = delta_path(node_id, local_step)

        def upload() -> None:
            operation = CommitOperationAdd(path, str(source))
            self._api.create_commit(
                self.repo_id,
                [operation],
                commit_message=f"DumbDiLoCo: delta of {node_id} at local step {local_step}",
            )

        self._call(f"upload {path}", upload)

    def list_deltas(self) -> list[DeltaInfo]:
        """Every delta under ``nodes/`` from one recursive tree listing (no downloads); the
        etag is the LFS sha256 when the file is in LFS, else its git blob id."""

        found = self._call("list deltas", lambda: self._deltas_at("main"))
        return sorted(found, key=lambda info: info.key)

    def download_delta(self, info: DeltaInfo, dest: Path) -> Path:
        """Download the delta at the branch head into ``dest``, checked against the listing's
        size and content id (a file replaced since the listing gives IntegrityError)."""
        etag = (info.etag or "").lower()
        return self._call(
            f"download {info.path}",
            lambda: self._files.download(
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
        _, raw = self._call("read the lease", lambda: self._head_file(LEASE_FILE, LEASE_LIMIT))
        return None if raw is None else Lease.loads(raw, f"{self.description}: {LEASE_FILE}")

    def write_lease(self, lease: Lease, expected: Lease | None) -> Lease:
        """Commit ``lease`` on the head at which the lease was read, if it still is
        ``expected`` (a branch moved by other commits is read again)."""
        return self._call(f"write {LEASE_FILE}", lambda: self._write_lease(lease, expected))

    def _write_lease(self, lease: Lease, expected: Lease | None) -> Lease:
        def prepare(raced: bool) -> Commit | Done:
            head, raw = self._head_file(LEASE_FILE, LEASE_LIMIT)
            try:
                current = None if raw is None else Lease.loads(raw, self.description)
            except PermanentTransportError:  # a malformed lease is no lease
                current = None
            if current == lease:  # an earlier attempt landed and only its reply was lost
                return Done(lease)
            if current != expected:
                raise LeaseConflictError(
                    f"{self.description}: the lease changed (now {current})", current
                )
            return Commit(
                head,
                [CommitOperationAdd(LEASE_FILE, lease.dumps())],
                f"DumbDiLoCo: lease of {lease.holder}, epoch {lease.epoch}",
                lambda info: lease,
            )

        return commit_on_head(
            self._api, self.repo_id, self.description, "writing the lease", prepare
        )

    def delete_deltas(self, infos: Sequence[DeltaInfo], *, fence: Lease | None = None) -> int:
        """One commit deleting the listed deltas whose content id at the head is still the
        listed one, on that head (fenced by the lease read there)."""
        if not infos:
            return 0
        return self._call(
            f"delete {len(infos)} processed deltas", lambda: self._delete(list(infos), fence)
        )

    def _delete(self, infos: list[DeltaInfo], fence: Lease | None) -> int:
        def prepare(raced: bool) -> Commit | Done:
            head, raw = self._head_file(LEASE_FILE, LEASE_LIMIT)
            if fence is not None:
                current = None if raw is None else Lease.loads(raw, f"{self.description}: lease")
                check_fence(current, fence.holder, fence.epoch, f"{self.description}: delete")
            present = {info.path: info.etag for info in self._deltas_at(head)}
            doomed = [info.path for info in infos if present.get(info.path) == info.etag]
            if not doomed:
                return Done(0)
            return Commit(
                head,
                [CommitOperationDelete(path_in_repo=path) for path in doomed],
                f"DumbDiLoCo: delete {len(doomed)} processed deltas",
                lambda info: len(doomed),
            )

        return commit_on_head(self._api, self.repo_id, self.description, "deleting deltas", prepare)

    def _deltas_at(self, revision: str) -> list[DeltaInfo]:
        try:
            entries = list(
                self._api.list_repo_tree(
                    self.repo_id, path_in_repo="nodes", recursive=True, revision=revision
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

    def squash_history(self) -> None:
        """Squash the branch into one commit (``HfApi.super_squash_history``): the storage of
        old versions is freed, and every older commit id stops resolving."""
        self._call(
            "squash the history",
            lambda: self._api.super_squash_history(
                self.repo_id, branch="main", commit_message="DumbDiLoCo: squashed history"
            ),
        )

    def store_bytes(self) -> int | None:
        """Bytes of the files at the branch head (the history the Hub keeps is not counted)."""

        def size() -> int:
            entries = self._api.list_repo_tree(self.repo_id, recursive=True, revision="main")
            return sum(entry.size or 0 for entry in entries if isinstance(entry, RepoFile))

        return self._call("measure the repository", size)

    def close(self) -> None:
        """Nothing to release: connections belong to the client's shared pool."""
