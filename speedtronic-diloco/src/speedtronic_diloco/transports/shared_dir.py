"""A DumbDiLoCo store in a plain directory: one machine, or a network filesystem.

Publication is atomic without locks. The weights are first written under an immutable
version name (``global/v<outer_step>-<sha12>.safetensors``: temp file, fsync, rename), then
``global/latest.safetensors`` is replaced by a hard link (or copy) of it, and only then is
``global/step_count.json`` replaced, pointing ``model_file`` at the version file. A reader that
follows the metadata therefore always finds exactly the weights the metadata describes, and
verifies them by sha256. Superseded version files are pruned, keeping a few so that a reader
holding slightly older metadata can still finish its download.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from speedtronic.checkpoint.fileio import atomic_write_bytes, fsync_dir
from speedtronic_diloco.identity import validate_node_id
from speedtronic_diloco.transports.base import (
    GLOBAL_METADATA,
    GLOBAL_WEIGHTS,
    DeltaInfo,
    GlobalMetadata,
    PermanentTransportError,
    TransientTransportError,
    Transport,
    delta_path,
    parse_delta_path,
    write_verified,
)

__all__ = ["KEEP_VERSIONS", "SharedDirectoryTransport", "shared_dir_root"]

log = logging.getLogger("speedtronic.diloco.shared_dir")

_VERSION = re.compile(r"^v(\d+)-[0-9a-f]{12}\.safetensors$")
KEEP_VERSIONS = 3
_CHUNK = 1 << 20
T = TypeVar("T")


def shared_dir_root(repo_id: str) -> Path | None:
    """The directory a ``file://`` URL or an absolute path names; None for a Hub repo id.

    ``file:///srv/run`` and ``file://localhost/srv/run`` are absolute; ``file://runs/shared``
    is relative to the working directory.
    """
    if repo_id.startswith("file://"):
        rest = repo_id[len("file://") :]
        if rest.startswith("localhost/"):
            rest = rest[len("localhost") :]
        if not rest:
            raise PermanentTransportError(f"distributed.repo_id {repo_id!r} names no directory")
        return Path(rest)
    path = Path(repo_id).expanduser() if repo_id.startswith("~") else Path(repo_id)
    return path if path.is_absolute() else None


def _classify(what: str, call: Callable[[], T]) -> T:
    """Run ``call``, turning OS errors into transport errors that say what failed."""
    try:
        return call()
    except PermissionError as exc:
        raise PermanentTransportError(f"{what}: permission denied ({exc})") from exc
    except OSError as exc:
        raise TransientTransportError(f"{what}: {exc}") from exc


def _read_chunks(source: Path) -> Iterator[bytes]:
    with open(source, "rb") as reader:
        while chunk := reader.read(_CHUNK):
            yield chunk


def _copy_verified(source: Path, dest: Path, size: int | None, sha256: str | None) -> Path:
    """Copy ``source`` to ``dest`` atomically, checking size/sha256 of the bytes copied."""
    try:
        return write_verified(
            _read_chunks(source), dest, where=str(source), size=size, sha256=sha256
        )
    except FileNotFoundError as exc:
        raise TransientTransportError(f"{source} is gone (replaced by a newer version?)") from exc


class SharedDirectoryTransport(Transport):
    """The layout of :mod:`speedtronic_diloco.transports.base` under ``root``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.description = f"file://{self.root}"
        self._publish_lock = threading.Lock()

    def create_store(self, *, private: bool = True) -> None:
        """Create ``root``, ``global/`` and ``nodes/`` (visibility is the filesystem's)."""
        for sub in ("global", "nodes"):
            _classify(
                f"create {self.root / sub}",
                lambda sub=sub: (self.root / sub).mkdir(parents=True, exist_ok=True),
            )

    def read_global_metadata(self) -> GlobalMetadata | None:
        """Parse ``global/step_count.json``; None when the store or the file does not exist."""
        path = self.root / GLOBAL_METADATA

        def read() -> bytes | None:
            try:
                return path.read_bytes()
            except FileNotFoundError:
                return None

        raw = _classify(f"read {path}", read)
        return None if raw is None else GlobalMetadata.loads(raw)

    def download_global(self, metadata: GlobalMetadata, dest: Path) -> Path:
        """Copy the version file the metadata names to ``dest``, verifying it."""
        source = self.root / metadata.model_file
        return _classify(
            f"download {source}",
            lambda: _copy_verified(source, Path(dest), metadata.size, metadata.sha256),
        )

    def publish_global(self, weights: Path, metadata: GlobalMetadata) -> GlobalMetadata:
        """Version file, then ``latest.safetensors``, then the metadata (see module doc)."""
        with self._publish_lock:
            return _classify(f"publish to {self.root}", lambda: self._publish(weights, metadata))

    def _publish(self, weights: Path, metadata: GlobalMetadata) -> GlobalMetadata:
        version = f"global/v{metadata.outer_step:08d}-{metadata.sha256[:12]}.safetensors"
        _copy_verified(Path(weights), self.root / version, metadata.size, metadata.sha256)
        self._replace_latest(self.root / version)
        published = metadata.with_revision(None, model_file=version)
        atomic_write_bytes(self.root / GLOBAL_METADATA, published.dumps())
        self._prune_versions(keep=version)
        return published

    def _replace_latest(self, version: Path) -> None:
        latest = self.root / GLOBAL_WEIGHTS
        tmp = latest.with_name(f".{latest.name}.{os.getpid()}.{threading.get_ident()}.link")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        try:
            os.link(version, tmp)
        except OSError:  # no hard links on this filesystem: copy instead
            shutil.copyfile(version, tmp)
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
        os.replace(tmp, latest)
        fsync_dir(latest.parent)

    def _prune_versions(self, keep: str) -> None:
        directory = self.root / "global"
        versions = []
        for name in os.listdir(directory):
            match = _VERSION.match(name)
            if match and f"global/{name}" != keep:
                versions.append((int(match.group(1)), name))
        for _, name in sorted(versions)[: max(0, len(versions) - (KEEP_VERSIONS - 1))]:
            with contextlib.suppress(FileNotFoundError):
                (directory / name).unlink()

    def upload_delta(self, node_id: str, local_step: int, source: Path) -> None:
        """Copy ``source`` into ``nodes/<node_id>/`` under a temp name, then rename."""
        validate_node_id(node_id)
        dest = self.root / delta_path(node_id, local_step)
        _classify(f"upload {dest}", lambda: _copy_verified(Path(source), dest, None, None))

    def list_deltas(self) -> list[DeltaInfo]:
        """Stat every ``nodes/*/delta_*.safetensors``; etag is size plus mtime in ns."""
        nodes = self.root / "nodes"
        try:
            node_dirs = sorted(os.listdir(nodes))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise TransientTransportError(f"list {nodes}: {exc}") from exc
        found: list[DeltaInfo] = []
        for node in node_dirs:
            try:
                names = os.listdir(nodes / node)
            except (NotADirectoryError, FileNotFoundError):
                continue
            except OSError as exc:
                raise TransientTransportError(f"list {nodes / node}: {exc}") from exc
            for name in names:
                rel = f"nodes/{node}/{name}"
                parsed = parse_delta_path(rel)
                if parsed is None:
                    continue
                try:
                    stat = (nodes / node / name).stat()
                except FileNotFoundError:
                    continue
                found.append(
                    DeltaInfo(
                        parsed[0],
                        parsed[1],
                        rel,
                        stat.st_size,
                        f"{stat.st_size}-{stat.st_mtime_ns}",
                    )
                )
        return sorted(found, key=lambda info: info.key)

    def download_delta(self, info: DeltaInfo, dest: Path) -> Path:
        """Copy the delta file to ``dest`` atomically."""
        source = self.root / info.path
        return _classify(
            f"download {source}", lambda: _copy_verified(source, Path(dest), None, None)
        )

    def __repr__(self) -> str:
        return f"SharedDirectoryTransport({str(self.root)!r})"
