"""The small interface every DumbDiLoCo store implements, its errors and metadata, and the one
verified download every implementation writes through.

A store holds one run::

    global/latest.safetensors                   the newest global weights
    global/step_count.json                      their metadata (:class:`GlobalMetadata`)
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
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from speedtronic.checkpoint.fileio import atomic_writer, sha256_file
from speedtronic.errors import TransportError
from speedtronic_diloco.identity import is_valid_node_id

__all__ = [
    "GLOBAL_METADATA",
    "GLOBAL_WEIGHTS",
    "DeltaInfo",
    "GlobalMetadata",
    "IntegrityError",
    "PermanentTransportError",
    "TransientTransportError",
    "Transport",
    "TransportError",
    "UnsupportedOperation",
    "delta_path",
    "is_global_file",
    "parse_delta_path",
    "write_verified",
]

GLOBAL_WEIGHTS = "global/latest.safetensors"
GLOBAL_METADATA = "global/step_count.json"
METADATA_FORMAT = 1
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


class UnsupportedOperation(PermanentTransportError):
    """The store cannot do this at all (for example granting write access)."""


class IntegrityError(TransientTransportError):
    """Downloaded bytes do not match the size or sha256 that the metadata announced.

    Transient because re-reading the metadata and downloading again usually succeeds (the file
    was replaced by a newer publication mid-read, or a transfer was torn)."""


@dataclass(frozen=True)
class GlobalMetadata:
    """What ``global/step_count.json`` says about the published global weights.

    ``sha256`` and ``size`` describe the weights file and are verified on download.
    ``model_file`` is the store path of that file; ``revision`` pins the store version
    (a Hub commit id) when the store has versions, and is not part of the JSON document.
    ``processed`` is the master's ledger of aggregated deltas, ``[node_id, local_step, etag]``
    triples, so a master that lost its local state does not aggregate old deltas again.
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
            **({"extra": self.extra} if self.extra else {}),
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
        published = data.get("published_at")
        return cls(
            outer_step=outer_step,
            sha256=sha256,
            size=size,
            model_file=model_file,
            revision=revision,
            published_at=float(published) if published is not None else None,
            master=data.get("master"),
            deltas_included=int(data.get("deltas_included") or 0),
            processed=tuple(processed),
            extra=dict(data.get("extra") or {}),
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

    ``etag`` is a cheap content fingerprint from the listing (the Hub's LFS sha256 or blob
    id; size and mtime on a shared directory). A file re-uploaded under the same name (a
    restarted worker repeating a local step) gets a new etag and is therefore new.
    """

    node_id: str
    local_step: int
    path: str
    size: int | None = None
    etag: str | None = None

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

    def close(self) -> None:  # noqa: B027 - optional hook with a do-nothing default
        """Release connections and handles (idempotent)."""


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
