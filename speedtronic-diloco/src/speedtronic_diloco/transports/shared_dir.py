"""A DumbDiLoCo store in a plain directory: one machine, or a network filesystem.

**Publication** is atomic. The lease is checked first (a fenced master writes nothing), then
the weights are written under an immutable version name
(``global/v<outer_step>-<sha12>.safetensors``: temp file, fsync, rename). Then, under the store's
exclusive lock, the lease in ``global/lease.json`` is checked against the publication's holder
and epoch (the fence; see :mod:`speedtronic_diloco.lease`), ``global/latest.safetensors`` is
replaced by a hard link (or copy) of the version file, and ``global/step_count.json`` is replaced,
pointing ``model_file`` at the version file. A reader that follows the metadata therefore always
finds exactly the weights the metadata describes, and verifies them by sha256. Superseded version
files are pruned, keeping a few so that a reader holding slightly older metadata can still finish
its download.

**Fragment files** (streaming fragments, ``distributed.fragments: K``). Each fragment's global
is written under an immutable name of its own, ``global/fragment<j>-v<outer_step>-<sha12>
.safetensors``, before the metadata that lists it (``fragment_files``) replaces the old one
under the lock, after the same fence check. Pruning keeps every file the new metadata lists
and, per fragment, the newest ones it no longer lists (``KEEP_VERSIONS`` files per fragment in
all), so a reader holding slightly older metadata can still finish.

**The lock** is ``global/.lock``, held with ``fcntl.lockf`` (POSIX record locks, which NFS
serves through its lock manager: NFSv4, or NFSv3 with ``lockd`` running; not on mounts with
``nolock``) plus a per-process thread lock (POSIX locks do not exclude threads of one process).
Only writers of ``global/`` take it (publication, lease, deletion); readers never wait. A writer
waits for it at most ``lock_wait`` seconds (:data:`LOCK_WAIT` by default), then gets a transient
error naming the lock file, which the retry policy retries: a process frozen while holding it (a
paused VM, a SIGSTOP) delays writers until it resumes or dies (the kernel releases a dead
process's lock), but never hangs one, and a standby keeps watching.

**Hostile files.** Everything read from the store is opened without following a final symlink
after resolving it, must resolve to a path inside the store, and must be a regular file: FIFOs,
devices, sockets and symlinks pointing outside the store are refused with their path (a FIFO
would block a read forever, ``/dev/zero`` would fill the disk). Reads stop at the size the
metadata or the listing promised (``step_count.json`` and ``lease.json`` at a fixed limit).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from speedtronic.checkpoint.fileio import atomic_write_bytes, fsync_dir
from speedtronic_diloco.identity import validate_node_id
from speedtronic_diloco.transports.base import (
    GLOBAL_METADATA,
    GLOBAL_WEIGHTS,
    LEASE_FILE,
    METADATA_LIMIT,
    DeltaInfo,
    FragmentFile,
    GlobalMetadata,
    Lease,
    LeaseConflictError,
    PermanentTransportError,
    TransientTransportError,
    Transport,
    check_fence,
    delta_path,
    named_fragments,
    parse_delta_path,
    redact_userinfo,
    write_verified,
)
from speedtronic_diloco.transports.shared_dir_files import (
    LOCK_FILE,
    LOCK_WAIT,
    StoreDirectory,
    classify,
    file_kind,
    local_chunks,
)
from speedtronic_diloco.transports.shared_dir_members import SharedDirMembers
from speedtronic_diloco.transports.shared_dir_side_files import SharedDirSideFiles

__all__ = [
    "KEEP_VERSIONS",
    "LOCK_FILE",
    "LOCK_WAIT",
    "SharedDirectoryTransport",
    "fragment_file_name",
    "shared_dir_root",
]

log = logging.getLogger("speedtronic.diloco.shared_dir")

_VERSION = re.compile(r"^v(\d+)-[0-9a-f]{12}\.safetensors$")
_FRAGMENT_VERSION = re.compile(r"^fragment(\d+)-v(\d+)-[0-9a-f]{12}\.safetensors$")
KEEP_VERSIONS = 3


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
            raise PermanentTransportError(
                f"distributed.repo_id {redact_userinfo(repr(repo_id))} names no directory"
            )
        return Path(rest)
    path = Path(repo_id).expanduser() if repo_id.startswith("~") else Path(repo_id)
    return path if path.is_absolute() else None


class SharedDirectoryTransport(Transport):
    """The layout of :mod:`speedtronic_diloco.transports.base` under ``root``."""

    supports_fragment_files = True

    def __init__(self, root: str | os.PathLike[str], *, lock_wait: float = LOCK_WAIT) -> None:
        self.root = Path(root)
        self.description = redact_userinfo(f"file://{self.root}")
        self.files = StoreDirectory(self.root, lock_wait)
        self.side_files = SharedDirSideFiles(self.files)
        self.members = SharedDirMembers(self.files)

    @property
    def lock_wait(self) -> float:
        """Seconds a writer waits for the store lock (the store directory's)."""
        return self.files.lock_wait

    # ------------------------------------------------------------------ interface
    def create_store(self, *, private: bool = True) -> None:
        """Create ``root``, ``global/`` and ``nodes/`` (visibility is the filesystem's)."""
        for sub in ("global", "nodes"):
            classify(
                f"create {self.root / sub}",
                lambda sub=sub: (self.root / sub).mkdir(parents=True, exist_ok=True),
            )

    def read_global_metadata(self) -> GlobalMetadata | None:
        """Parse ``global/step_count.json``; None when the store or the file does not exist."""
        path = self.root / GLOBAL_METADATA
        raw = classify(f"read {path}", lambda: self.files.read_small(path, METADATA_LIMIT))
        return None if raw is None else GlobalMetadata.loads(raw)

    def download_global(self, metadata: GlobalMetadata, dest: Path) -> Path:
        """Copy the version file the metadata names to ``dest``, verifying it."""
        source = self.root / metadata.model_file
        return classify(
            f"download {source}",
            lambda: self.files.copy_verified(source, Path(dest), metadata.size, metadata.sha256),
        )

    def publish_global(self, weights: Path, metadata: GlobalMetadata) -> GlobalMetadata:
        """Version file, then (locked, fenced) ``latest.safetensors`` and the metadata."""
        return classify(f"publish to {self.root}", lambda: self._publish(weights, metadata))

    def _publish(self, weights: Path, metadata: GlobalMetadata) -> GlobalMetadata:
        version = f"global/v{metadata.outer_step:08d}-{metadata.sha256[:12]}.safetensors"
        self._fence_publication(metadata)  # a fenced master writes no file at all (unlocked)
        write_verified(
            local_chunks(Path(weights)),
            self.root / version,
            where=str(weights),
            size=metadata.size,
            sha256=metadata.sha256,
        )
        published = metadata.with_revision(None, model_file=version)
        with self.files.exclusive():
            self._fence_publication(metadata)
            self._replace_latest(self.root / version)
            atomic_write_bytes(self.root / GLOBAL_METADATA, published.dumps())
        self._prune_versions(keep=version)
        return published

    def publish_fragments(
        self, files: Mapping[int, Path], metadata: GlobalMetadata
    ) -> GlobalMetadata:
        """Fragment files under immutable names, then (locked, fenced) the metadata."""
        return classify(f"publish to {self.root}", lambda: self._publish_fragments(files, metadata))

    def _publish_fragments(
        self, files: Mapping[int, Path], metadata: GlobalMetadata
    ) -> GlobalMetadata:
        names = {}
        self._fence_publication(metadata)  # as in _publish: no files from a fenced master
        for index, source in sorted(files.items()):
            entry = metadata.fragment_files[index]
            name = fragment_file_name(index, entry)
            write_verified(
                local_chunks(Path(source)),
                self.root / name,
                where=str(source),
                size=entry.size,
                sha256=entry.sha256,
            )
            names[index] = name
        published = named_fragments(metadata, names)
        with self.files.exclusive():
            self._fence_publication(metadata)
            for entry in published.fragment_files:
                if not (self.root / entry.file).is_file():
                    raise PermanentTransportError(
                        f"{self.root / entry.file}: listed by the metadata being published "
                        "but not in the store"
                    )
            atomic_write_bytes(self.root / GLOBAL_METADATA, published.dumps())
        self._prune_fragments({entry.file for entry in published.fragment_files})
        return published

    def _prune_fragments(self, listed: set[str]) -> None:
        """Delete old fragment files: never one in ``listed``; per fragment, all but the
        newest ``KEEP_VERSIONS - 1`` of the others."""
        directory = self.root / "global"
        others: dict[int, list[tuple[int, str]]] = {}
        for name in os.listdir(directory):
            match = _FRAGMENT_VERSION.match(name)
            if match and f"global/{name}" not in listed:
                others.setdefault(int(match.group(1)), []).append((int(match.group(2)), name))
        for found in others.values():
            for _, name in sorted(found)[: max(0, len(found) - (KEEP_VERSIONS - 1))]:
                with contextlib.suppress(FileNotFoundError):
                    (directory / name).unlink()

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
        classify(
            f"upload {dest}",
            lambda: write_verified(local_chunks(Path(source)), dest, where=str(source)),
        )

    def list_deltas(self) -> list[DeltaInfo]:
        """Stat every ``nodes/*/delta_*.safetensors`` (no content is read); the etag is size,
        mtime, ctime and inode, which change whenever the file does. Special files and
        symlinks out of the store are left out (logged once with their path)."""
        nodes = self.root / "nodes"
        try:
            node_dirs = sorted(os.listdir(nodes))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise TransientTransportError(f"list {nodes}: {exc}") from exc
        found: list[DeltaInfo] = []
        for node in node_dirs:
            directory = nodes / node
            try:
                if os.path.islink(directory):
                    self.files.check_link(directory)
                names = os.listdir(directory)
            except (NotADirectoryError, FileNotFoundError, PermanentTransportError):
                continue
            except OSError as exc:
                raise TransientTransportError(f"list {directory}: {exc}") from exc
            for name in names:
                info = self._delta_info(directory / name, f"nodes/{node}/{name}")
                if info is not None:
                    found.append(info)
        return sorted(found, key=lambda info: info.key)

    def _delta_info(self, path: Path, rel: str) -> DeltaInfo | None:
        parsed = parse_delta_path(rel)
        if parsed is None:
            return None
        try:
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                self.files.check_link(path)
                info = os.stat(path)
        except (FileNotFoundError, PermanentTransportError):
            return None
        kind = file_kind(info.st_mode)
        if kind is not None:
            self.files.refuse(path, f"{kind}, not a regular file")
            return None
        etag = f"{info.st_size}-{info.st_mtime_ns}-{info.st_ctime_ns}-{info.st_ino}"
        return DeltaInfo(parsed[0], parsed[1], rel, info.st_size, etag, info.st_mtime)

    def download_delta(self, info: DeltaInfo, dest: Path) -> Path:
        """Copy the delta file to ``dest`` atomically, reading at most the listed size."""
        source = self.root / info.path
        return classify(
            f"download {source}",
            lambda: self.files.copy_verified(source, Path(dest), info.size, None),
        )

    # ------------------------------------------------------------------ lease, storage
    def _fence_publication(self, metadata: GlobalMetadata) -> None:
        """Under the writer lock: refuse a publication whose lease epoch is no longer the
        store's (another master took over)."""
        if metadata.lease_epoch is not None:
            check_fence(
                self.files.lease_now(),
                metadata.master or "",
                metadata.lease_epoch,
                f"{self.description}: publishing outer step {metadata.outer_step}",
            )

    def read_lease(self) -> Lease | None:
        """Parse ``global/lease.json``; None when there is none."""
        return classify(f"read {self.root / LEASE_FILE}", self.files.lease_now)

    def write_lease(self, lease: Lease, expected: Lease | None) -> Lease:
        """Replace ``global/lease.json`` under the lock if it still is ``expected`` (None: no
        lease, or a malformed one)."""

        def write() -> Lease:
            with self.files.exclusive():
                try:
                    current = self.files.lease_now()
                except PermanentTransportError:  # a malformed lease is no lease
                    current = None
                if current != expected:
                    raise LeaseConflictError(
                        f"{self.description}: the lease changed (now {current})", current
                    )
                atomic_write_bytes(self.root / LEASE_FILE, lease.dumps())
            return lease

        (self.root / "global").mkdir(parents=True, exist_ok=True)
        return classify(f"write {self.root / LEASE_FILE}", write)

    def delete_deltas(self, infos: Sequence[DeltaInfo], *, fence: Lease | None = None) -> int:
        """Unlink each listed delta whose etag is unchanged (under the lock, fenced)."""

        def delete() -> int:
            count = 0
            with self.files.exclusive():
                if fence is not None:
                    check_fence(
                        self.files.lease_now(),
                        fence.holder,
                        fence.epoch,
                        f"{self.description}: delete",
                    )
                for info in infos:
                    parsed = parse_delta_path(info.path)
                    if parsed is None:
                        continue
                    current = self._delta_info(self.root / info.path, info.path)
                    if current is None or current.etag != info.etag:
                        continue  # replaced since the listing (or gone): not ours to delete
                    with contextlib.suppress(FileNotFoundError):
                        (self.root / info.path).unlink()
                        count += 1
            return count

        return classify(f"delete deltas from {self.root}", delete)

    def store_bytes(self) -> int | None:
        """Bytes of the regular files under ``root`` (symlinks are not followed)."""
        total = 0
        for folder, _, files in os.walk(self.root):
            for name in files:
                with contextlib.suppress(OSError):
                    info = os.lstat(os.path.join(folder, name))
                    if stat.S_ISREG(info.st_mode):
                        total += info.st_size
        return total

    def __repr__(self) -> str:
        return f"SharedDirectoryTransport({str(self.root)!r})"


def fragment_file_name(index: int, entry: FragmentFile) -> str:
    """The immutable store path of fragment ``index``'s file described by ``entry``."""
    return f"global/fragment{index}-v{entry.outer_step:08d}-{entry.sha256[:12]}.safetensors"
