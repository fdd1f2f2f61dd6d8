"""The small interface every DumbDiLoCo store implements, its errors and metadata, and the one
verified download every implementation writes through.

A store holds one run::

    global/latest.safetensors                   the newest global weights
    global/step_count.json                      their metadata (:class:`GlobalMetadata`)
    global/lease.json                           the master's lease (:class:`Lease`)
    nodes/<node_id>/delta_<local_step>.safetensors   pseudo-gradients, one file per upload

Implementations (:mod:`~speedtronic_diloco.transports.shared_dir`,
:mod:`~speedtronic_diloco.transports.hub`) import this module and nothing imports them back.
Transports classify failures but never retry: the coordinator and the outer loop retry
:class:`TransientTransportError` with backoff and give up at once on
:class:`PermanentTransportError`. See ``TRANSPORT_INTERFACE.md`` for the full contract.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from speedtronic.checkpoint.fileio import atomic_writer, sha256_file
from speedtronic.errors import TransportError
from speedtronic_diloco.identity import is_valid_node_id
from speedtronic_diloco.timestamps import parse_timestamp

__all__ = [
    "GLOBAL_METADATA",
    "GLOBAL_WEIGHTS",
    "LEASE_FILE",
    "LEASE_LIMIT",
    "MAX_FRAGMENT_FILES",
    "METADATA_LIMIT",
    "DeltaInfo",
    "FragmentFile",
    "GlobalMetadata",
    "IntegrityError",
    "Lease",
    "LeaseConflictError",
    "LeaseError",
    "LeaseLostError",
    "MalformedLeaseError",
    "PermanentTransportError",
    "TransientTransportError",
    "Transport",
    "TransportError",
    "UnsupportedOperation",
    "check_fence",
    "delta_path",
    "is_global_file",
    "named_fragments",
    "parse_delta_path",
    "redact_userinfo",
    "write_verified",
]

GLOBAL_WEIGHTS = "global/latest.safetensors"
GLOBAL_METADATA = "global/step_count.json"
LEASE_FILE = "global/lease.json"
METADATA_FORMAT = 1
#: A ``step_count.json`` larger than this is not ours (ours stays a few KiB per node).
METADATA_LIMIT = 4 << 20
#: A ``lease.json`` larger than this is not ours.
LEASE_LIMIT = 64 << 10
#: A ``step_count.json`` naming more fragment files than this is not ours.
MAX_FRAGMENT_FILES = 1024
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@?#]*@")
_DELTA_PATH = re.compile(r"^nodes/([^/\\]+)/delta_(\d+)\.safetensors$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class TransientTransportError(TransportError):
    """A failure that may go away when retried: timeout, dropped connection, 5xx, 429, a lock
    held by another writer, a file replaced while it was being read."""

    #: Seconds the server asked to wait (``Retry-After``); None when it said nothing.
    retry_after: float | None = None


class PermanentTransportError(TransportError):
    """A failure that retrying cannot fix: bad credentials, no permission, missing repository,
    malformed request or metadata."""


class MalformedLeaseError(PermanentTransportError):
    """``lease.json`` cannot be used (not JSON, a field missing, a time that is no time); its
    ``epoch`` when that could be read, so that a master taking it over numbers after it."""

    def __init__(self, message: str, epoch: int | None = None) -> None:
        super().__init__(message)
        self.epoch = epoch


class UnsupportedOperation(PermanentTransportError):
    """The store cannot do this at all (for example granting write access)."""


class IntegrityError(TransientTransportError):
    """Downloaded bytes do not match the size or sha256 that the metadata announced.

    Transient because re-reading the metadata and downloading again usually succeeds (the file
    was replaced by a newer publication mid-read, or a transfer was torn)."""


class LeaseError(PermanentTransportError):
    """The master's lease on the store is held by another master, or was lost."""


class LeaseConflictError(LeaseError):
    """A lease write found another lease than the one it was based on (compare-and-swap
    failed): another master took or renewed it. ``current`` is what the store holds."""

    def __init__(self, message: str, current: Lease | None = None) -> None:
        super().__init__(message)
        self.current = current


class LeaseLostError(LeaseError):
    """A fenced write (publication, deletion) was refused: the store's lease no longer names
    this master and epoch. The master must stop publishing."""


def redact_userinfo(text: str) -> str:
    """``text`` with the credentials of every URL in it (``https://user:pass@host``) replaced
    by ``<redacted>``: endpoint URLs end up in log lines and error messages."""
    return _USERINFO.sub(r"\1<redacted>@", text)


@dataclass(frozen=True)
class Lease:
    """``global/lease.json``: which master may publish, until when, under which epoch.

    ``epoch`` grows by one at every change of hands (and at every restart of the master), and
    every publication carries it: a store accepts a publication only while its lease still
    names that holder and epoch (the *fence*). ``expires_at`` is a wall-clock time of the
    holder's machine; ``released`` marks a lease given up by a master that stopped cleanly.
    """

    holder: str
    epoch: int
    expires_at: float
    renewed_at: float | None = None
    instance: str | None = None
    released: bool = False

    def live(self, now: float | None = None) -> bool:
        """True while the lease is held (not released, not expired)."""
        return not self.released and (time.time() if now is None else now) < self.expires_at

    def dumps(self) -> bytes:
        """The JSON document as UTF-8 bytes."""
        return json.dumps({"format": 1, **asdict(self)}, indent=1, sort_keys=True).encode()

    @classmethod
    def loads(cls, raw: bytes, where: str = LEASE_FILE) -> Lease:
        """Parse ``lease.json``; MalformedLeaseError naming ``where`` (and the field of a time
        that is no time: :func:`~speedtronic_diloco.timestamps.parse_timestamp`) if malformed."""
        try:
            data = json.loads(raw.decode("utf-8"))
            if not isinstance(data, dict):
                raise TypeError("not an object")
            holder, epoch = str(data["holder"]), int(data["epoch"])
            instance = None if data.get("instance") is None else str(data["instance"])
            released = bool(data.get("released", False))
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, OverflowError) as exc:
            raise MalformedLeaseError(f"{where}: malformed lease ({exc})") from None
        if epoch < 0:
            raise MalformedLeaseError(f"{where}: malformed lease (epoch {epoch})")
        try:
            expires_at = parse_timestamp(data.get("expires_at"), where, "expires_at")
            renewed_at = parse_timestamp(data.get("renewed_at"), where, "renewed_at")
        except ValueError as exc:
            raise MalformedLeaseError(str(exc), epoch) from None
        if expires_at is None:
            raise MalformedLeaseError(f"{where}: expires_at is missing", epoch)
        return cls(holder, epoch, expires_at, renewed_at, instance, released)


def check_fence(current: Lease | None, holder: str, epoch: int, where: str) -> None:
    """Raise LeaseLostError unless ``current`` (the store's lease) names ``holder`` and
    ``epoch``: the check a store makes right before a fenced write becomes visible."""
    if current is not None and current.holder == holder and current.epoch == epoch:
        return
    now = f"{current.holder!r} holds it with epoch {current.epoch}" if current else "none is held"
    raise LeaseLostError(
        f"{where}: refused: this write was made under the lease of {holder!r} epoch {epoch}, "
        f"but {now}. Another master took over; this one must stop publishing."
    )


@dataclass(frozen=True)
class FragmentFile:
    """One fragment's global file as ``step_count.json`` lists it (``fragment_files``).

    ``file`` is its store path (a ``global/*.safetensors`` name the transport chose),
    ``sha256`` and ``size`` describe its bytes and are verified on download, ``outer_step`` is
    the outer step of the fragment's last update: the one written in the file's header (and
    signed with it), equal to the fragment's version in ``extra.fragments``.
    """

    file: str
    sha256: str
    size: int
    outer_step: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # file, sha256, size, outer_step

    @classmethod
    def from_json(cls, data: Any, where: str) -> FragmentFile:
        """Parse and check one entry; PermanentTransportError naming ``where`` if malformed."""
        if not isinstance(data, dict):
            raise PermanentTransportError(f"{where}: expected a JSON object")
        try:
            file, sha256 = data["file"], data["sha256"]
            size, outer_step = data["size"], data["outer_step"]
        except KeyError as exc:
            raise PermanentTransportError(f"{where}: missing field {exc}") from None
        if not isinstance(file, str) or not is_global_file(file):
            raise PermanentTransportError(
                f"{where}: file {file!r} is not a global/*.safetensors path"
            )
        if not isinstance(sha256, str) or not _SHA256.match(sha256):
            raise PermanentTransportError(f"{where}: sha256 is not 64 lowercase hex digits")
        for name, value in (("size", size), ("outer_step", outer_step)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PermanentTransportError(f"{where}: {name} is not an integer >= 0")
        return cls(file, sha256, size, outer_step)


def _fragment_files(data: Any) -> tuple[FragmentFile, ...]:
    """The ``fragment_files`` list of a ``step_count.json`` document (checked, bounded)."""
    if data is None:
        return ()
    if not isinstance(data, list) or len(data) > MAX_FRAGMENT_FILES:
        raise PermanentTransportError(
            f"{GLOBAL_METADATA}: fragment_files is not a list of at most "
            f"{MAX_FRAGMENT_FILES} entries"
        )
    return tuple(
        FragmentFile.from_json(entry, f"{GLOBAL_METADATA}: fragment_files[{index}]")
        for index, entry in enumerate(data)
    )


@dataclass(frozen=True)
class GlobalMetadata:
    """What ``global/step_count.json`` says about the published global weights.

    ``sha256`` and ``size`` describe the weights file and are verified on download.
    ``model_file`` is the store path of that file; ``revision`` pins the store version
    (a Hub commit id) when the store has versions, and is not part of the JSON document.
    ``processed`` is the recent window of the master's ledger of processed deltas,
    ``[node_id, local_step, content id]`` triples (the content id is the sha256 of the delta
    file), and ``nodes`` its per-node summary (highest processed local step, counts, the last
    delta's base outer step, norm, rejection reason...): together they let a master that lost
    its local state recognise every old delta (see :mod:`speedtronic_diloco.ledger`). Both are
    bounded, so the document stays the same size however long the run. ``lease_epoch`` is the
    epoch of the lease the publication was made under (the fence); ``eval_loss`` the global's
    held-out loss when the master evaluated it.

    With streaming fragments published as files of their own (``fragment_files``, one
    :class:`FragmentFile` per fragment, in fragment order), the global is the union of those
    files, and ``model_file``, ``sha256`` and ``size`` describe the file this publication
    added (the first of them when it added several). Without (``fragment_files`` empty, every
    K = 1 run) the document is exactly the one of a single weights file.
    """

    outer_step: int
    sha256: str
    size: int
    model_file: str = GLOBAL_WEIGHTS
    revision: str | None = None
    published_at: float | None = None
    master: str | None = None
    deltas_included: int = 0
    processed: tuple[tuple[str, int, str | None], ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    lease_epoch: int | None = None
    eval_loss: float | None = None
    fragment_files: tuple[FragmentFile, ...] = ()

    @classmethod
    def for_file(cls, path: str | Path, outer_step: int, **kwargs: Any) -> GlobalMetadata:
        """Metadata describing the weights file at ``path`` (hashes it)."""
        return cls(
            outer_step=outer_step,
            sha256=sha256_file(path),
            size=Path(path).stat().st_size,
            **kwargs,
        )

    def with_revision(self, revision: str | None, model_file: str | None = None) -> GlobalMetadata:
        """A copy pinned to ``revision`` (and ``model_file`` when given)."""
        return replace(self, revision=revision, model_file=model_file or self.model_file)

    def to_json(self) -> dict[str, Any]:
        """The ``step_count.json`` document (``revision`` excluded: a commit cannot name itself)."""
        return {
            "format": METADATA_FORMAT,
            "outer_step": self.outer_step,
            "model_file": self.model_file,
            "sha256": self.sha256,
            "size": self.size,
            "published_at": self.published_at,
            "master": self.master,
            "deltas_included": self.deltas_included,
            "processed": [list(item) for item in self.processed],
            **({"nodes": self.nodes} if self.nodes else {}),
            **({"lease_epoch": self.lease_epoch} if self.lease_epoch is not None else {}),
            **({"eval_loss": self.eval_loss} if self.eval_loss is not None else {}),
            **({"extra": self.extra} if self.extra else {}),
            **(
                {"fragment_files": [entry.to_json() for entry in self.fragment_files]}
                if self.fragment_files
                else {}
            ),
        }

    def dumps(self) -> bytes:
        """The JSON document as UTF-8 bytes."""
        return json.dumps(self.to_json(), indent=1, sort_keys=True).encode("utf-8")

    @classmethod
    def from_json(cls, data: Any, revision: str | None = None) -> GlobalMetadata:
        """Parse and check a ``step_count.json`` document; PermanentTransportError if malformed.

        ``model_file`` must be a ``global/*.safetensors`` path without ``..``: metadata written
        by a collaborator cannot point readers at arbitrary files.
        """
        if not isinstance(data, dict):
            raise PermanentTransportError(f"{GLOBAL_METADATA}: expected a JSON object")
        try:
            outer_step = int(data["outer_step"] if "outer_step" in data else data["step"])
            sha256 = str(data["sha256"]).lower()
            size = int(data["size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise PermanentTransportError(
                f"{GLOBAL_METADATA}: missing or bad field {exc}"
            ) from None
        model_file = str(data.get("model_file") or GLOBAL_WEIGHTS)
        if outer_step < 0 or size < 0 or not _SHA256.match(sha256):
            raise PermanentTransportError(f"{GLOBAL_METADATA}: bad outer_step, size or sha256")
        if not is_global_file(model_file):
            raise PermanentTransportError(
                f"{GLOBAL_METADATA}: model_file {model_file!r} is not a global/*.safetensors path"
            )
        processed = []
        for item in data.get("processed") or ():
            try:
                node, step, etag = item
                processed.append((str(node), int(step), None if etag is None else str(etag)))
            except (TypeError, ValueError):
                raise PermanentTransportError(f"{GLOBAL_METADATA}: bad processed entry") from None
        nodes = data.get("nodes") or {}
        if not isinstance(nodes, dict) or not all(
            isinstance(k, str) and isinstance(v, dict) for k, v in nodes.items()
        ):
            raise PermanentTransportError(f"{GLOBAL_METADATA}: bad nodes summary")
        try:
            epoch, loss = data.get("lease_epoch"), data.get("eval_loss")
            lease_epoch = None if epoch is None else int(epoch)
            eval_loss = None if loss is None else float(loss)
        except (TypeError, ValueError):
            raise PermanentTransportError(
                f"{GLOBAL_METADATA}: bad lease_epoch or eval_loss"
            ) from None
        try:
            when = parse_timestamp(data.get("published_at"), GLOBAL_METADATA, "published_at")
        except ValueError as exc:
            raise PermanentTransportError(str(exc)) from None
        return cls(
            outer_step=outer_step,
            sha256=sha256,
            size=size,
            model_file=model_file,
            revision=revision,
            published_at=when,
            master=data.get("master"),
            deltas_included=int(data.get("deltas_included") or 0),
            processed=tuple(processed),
            extra=dict(data.get("extra") or {}),
            nodes={k: dict(v) for k, v in nodes.items()},
            lease_epoch=lease_epoch,
            eval_loss=eval_loss,
            fragment_files=_fragment_files(data.get("fragment_files")),
        )

    def fragment_view(self, index: int) -> GlobalMetadata:
        """The metadata of fragment ``index``'s file alone, for :meth:`Transport.download_global`
        and the cache: its path, sha256, size and outer step, at this revision."""
        entry = self.fragment_files[index]
        return replace(
            self,
            outer_step=entry.outer_step,
            model_file=entry.file,
            sha256=entry.sha256,
            size=entry.size,
            fragment_files=(),
        )

    @classmethod
    def loads(cls, raw: bytes, revision: str | None = None) -> GlobalMetadata:
        """Parse the JSON bytes of ``step_count.json``."""
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PermanentTransportError(f"{GLOBAL_METADATA}: not valid JSON ({exc})") from None
        return cls.from_json(data, revision)


@dataclass(frozen=True)
class DeltaInfo:
    """One delta file as a listing shows it, before anything is downloaded.

    ``etag`` is a cheap fingerprint from the listing that changes whenever the file does (the
    Hub's LFS sha256 or git blob id; size, mtime, ctime and inode on a shared directory). It
    tells the master which files it must look at again; whether a file is a delta it already
    processed is decided by its content (sha256), see :mod:`speedtronic_diloco.ledger`.
    ``modified`` is the file's modification time where the listing shows one (None on the Hub).
    """

    node_id: str
    local_step: int
    path: str
    size: int | None = None
    etag: str | None = None
    modified: float | None = None

    @property
    def key(self) -> tuple[str, int]:
        """The ledger key: ``(node_id, local_step)``."""
        return (self.node_id, self.local_step)


def delta_path(node_id: str, local_step: int) -> str:
    """The store path of a node's delta for ``local_step``."""
    return f"nodes/{node_id}/delta_{local_step}.safetensors"


def parse_delta_path(path: str) -> tuple[str, int] | None:
    """``(node_id, local_step)`` of a delta path, or None for anything else (temp files...)."""
    match = _DELTA_PATH.match(path)
    if not match or not is_valid_node_id(match.group(1)):
        return None
    return match.group(1), int(match.group(2))


def is_global_file(path: str) -> bool:
    """True for a store path of the form ``global/<name>.safetensors`` (no traversal)."""
    parts = path.split("/")
    return (
        len(parts) == 2
        and parts[0] == "global"
        and parts[1].endswith(".safetensors")
        and not parts[1].startswith(".")
        and "\\" not in path
    )


class Transport(ABC):
    """The store a DumbDiLoCo run syncs through. Implementations must be safe to call from
    several threads at once (the upload lane, the poll lane and the master's outer thread).

    Every method raises :class:`TransientTransportError` or :class:`PermanentTransportError`
    (or a subclass) for store failures, never a library-specific exception.
    """

    #: Human-readable location for logs (``file:///srv/run`` or ``hf://org/run``).
    description: str = "transport"
    #: True where :meth:`publish_fragments` is implemented (else a master with streaming
    #: fragments publishes the whole global with :meth:`publish_global`).
    supports_fragment_files: bool = False
    min_wait_look_s: float = 0.0  # shortest pause (s) between a sync wait's looks (node.rounds)

    @abstractmethod
    def create_store(self, *, private: bool = True) -> None:
        """Create the store if it does not exist (private when the store has visibility);
        existing content is left alone."""

    def grant_write_access(self, users: Sequence[str]) -> None:
        """Give ``users`` write access; :class:`UnsupportedOperation` where the store cannot."""
        raise UnsupportedOperation(f"{self.description}: granting write access is not supported")

    @abstractmethod
    def read_global_metadata(self) -> GlobalMetadata | None:
        """The current global metadata (with ``revision`` pinned where the store has versions),
        or None when nothing was published yet."""

    @abstractmethod
    def download_global(self, metadata: GlobalMetadata, dest: Path) -> Path:
        """Fetch the weights ``metadata`` describes to ``dest`` (written atomically), verifying
        size and sha256; :class:`IntegrityError` on mismatch (``dest`` is then absent)."""

    @abstractmethod
    def publish_global(self, weights: Path, metadata: GlobalMetadata) -> GlobalMetadata:
        """Publish ``weights`` and ``metadata`` as one atomic change: a reader sees the old pair
        or the new pair, never new metadata with other weights. Returns the metadata as
        published (``revision`` and ``model_file`` filled in)."""

    def publish_fragments(
        self, files: Mapping[int, Path], metadata: GlobalMetadata
    ) -> GlobalMetadata:
        """Publish the fragment files ``files`` (fragment index -> local file, maybe none) and
        ``metadata`` as one atomic change: a reader sees the old metadata or the new one, and
        then every file it lists. ``metadata.fragment_files`` lists every fragment; entries of
        ``files`` carry sha256, size and outer step (checked here) and get their store path
        (``file``) from the transport; the others are kept. Returns the metadata as published
        (``model_file``/``sha256``/``size``: the first file published, unchanged if none).
        :class:`UnsupportedOperation` where ``supports_fragment_files`` is False."""
        raise UnsupportedOperation(f"{self.description}: fragment files are not supported")

    @abstractmethod
    def upload_delta(self, node_id: str, local_step: int, source: Path) -> None:
        """Store the file ``source`` as ``nodes/<node_id>/delta_<local_step>.safetensors``;
        readers never see it half-written."""

    @abstractmethod
    def list_deltas(self) -> list[DeltaInfo]:
        """Every delta file in the store, from a listing only (no downloads); paths that do not
        match the layout or carry an invalid node id are left out."""

    @abstractmethod
    def download_delta(self, info: DeltaInfo, dest: Path) -> Path:
        """Fetch the delta ``info`` names to ``dest`` (written atomically)."""

    # -- optional: the master's lease, bounded storage, status ------------------------------

    def read_lease(self) -> Lease | None:
        """The store's lease (None when there is none); :class:`UnsupportedOperation` where
        the store has no lease (then one master is not enforced)."""
        raise UnsupportedOperation(f"{self.description}: leases are not supported")

    def write_lease(self, lease: Lease, expected: Lease | None) -> Lease:
        """Replace the store's lease by ``lease`` if it still is ``expected`` (None: no lease),
        atomically (compare-and-swap); :class:`LeaseConflictError` (carrying the current
        lease) otherwise. Returns ``lease``."""
        raise UnsupportedOperation(f"{self.description}: leases are not supported")

    def delete_deltas(self, infos: Sequence[DeltaInfo], *, fence: Lease | None = None) -> int:
        """Delete the listed delta files whose etag is still the listed one (a file replaced
        since the listing is kept), in one change where the store has changes (one Hub
        commit). With ``fence``, only while the store's lease is that holder and epoch
        (:class:`LeaseLostError` otherwise). Returns how many files were deleted."""
        raise UnsupportedOperation(f"{self.description}: deleting deltas is not supported")

    def squash_history(self) -> None:  # noqa: B027 - optional hook with a do-nothing default
        """Drop the store's history of old versions where it keeps one (the Hub's commits);
        nothing to do elsewhere."""

    def store_bytes(self) -> int | None:
        """Bytes the store's current files take (None where the store cannot tell)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook with a do-nothing default
        """Release connections and handles (idempotent)."""


def named_fragments(metadata: GlobalMetadata, names: Mapping[int, str]) -> GlobalMetadata:
    """``metadata`` with the fragment files ``names`` (index -> store path) filled in; the
    top-level ``model_file``/``sha256``/``size`` become those of the first of them."""
    entries = list(metadata.fragment_files)
    for index, name in names.items():
        if not 0 <= index < len(entries):
            raise PermanentTransportError(
                f"fragment {index} is not listed in the metadata being published"
            )
        entries[index] = replace(entries[index], file=name)
    published = replace(metadata, fragment_files=tuple(entries), revision=None)
    if not names:
        return published
    first = entries[min(names)]
    return replace(published, model_file=first.file, sha256=first.sha256, size=first.size)


def _git_blob_hash(size: int) -> Any:
    """A sha1 primed like git's blob id (``blob <size>\\0`` + content): the Hub's ``oid``."""
    digest = hashlib.sha1(usedforsecurity=False)
    digest.update(b"blob %d\0" % size)
    return digest


def write_verified(
    chunks: Iterable[bytes],
    dest: str | Path,
    *,
    where: str,
    size: int | None = None,
    sha256: str | None = None,
    git_oid: str | None = None,
) -> Path:
    """Write ``chunks`` to ``dest`` atomically (temp file, fsync, rename), checking the byte
    count, the sha256 and the git blob id where given.

    Reading stops as soon as more than ``size`` bytes arrived. On any mismatch this raises
    :class:`IntegrityError` naming ``where`` and leaves no ``dest`` behind (nor a temp file).
    """
    try:
        _write_checked(chunks, Path(dest), where, size, sha256, git_oid)
    except IntegrityError:
        Path(dest).unlink(missing_ok=True)  # an older file there must not pass for this one
        raise
    return Path(dest)


def _write_checked(
    chunks: Iterable[bytes],
    dest: Path,
    where: str,
    size: int | None,
    sha256: str | None,
    git_oid: str | None,
) -> None:
    content = hashlib.sha256()
    blob = _git_blob_hash(size) if git_oid is not None and size is not None else None
    received = 0
    # Raising inside atomic_writer discards the temp file before anything replaces dest.
    with atomic_writer(dest) as out:
        for chunk in chunks:
            received += len(chunk)
            if size is not None and received > size:
                raise IntegrityError(f"{where}: more than the expected {size} bytes")
            content.update(chunk)
            if blob is not None:
                blob.update(chunk)
            out.write(chunk)
        if size is not None and received != size:
            raise IntegrityError(f"{where}: got {received} bytes, expected {size}")
        got = content.hexdigest()
        if sha256 is not None and got != sha256:
            raise IntegrityError(
                f"{where}: sha256 {got[:12]}... does not match the expected "
                f"{sha256[:12]}... (tampered or replaced file); not used"
            )
        got_oid = blob.hexdigest() if blob is not None else None
        if git_oid is not None and got_oid is not None and got_oid != git_oid:
            raise IntegrityError(
                f"{where}: content id {got_oid[:12]}... does not match the listing's "
                f"{git_oid[:12]}... (replaced since it was listed?)"
            )
