"""The left records of a shared-directory store (:mod:`~speedtronic_diloco.transports.members`):
``nodes/<node_id>/left.json``, written with temp file, fsync and rename, read through the
store's hostile-file checks (no FIFOs, devices or symlinks out of the store; at most
:data:`~speedtronic_diloco.transports.members.LEFT_LIMIT` bytes)."""

from __future__ import annotations

import os

from speedtronic.checkpoint.fileio import atomic_write_bytes
from speedtronic_diloco.identity import is_valid_node_id, validate_node_id
from speedtronic_diloco.transports.base import PermanentTransportError, TransientTransportError
from speedtronic_diloco.transports.members import (
    LEFT_LIMIT,
    MAX_LEFT_RECORDS,
    LeftListing,
    LeftRecord,
    MemberRecords,
    left_path,
)
from speedtronic_diloco.transports.shared_dir_files import StoreDirectory

__all__ = ["SharedDirMembers"]


class SharedDirMembers(MemberRecords):
    """Left records of the shared-directory store ``store``."""

    def __init__(self, store: StoreDirectory) -> None:
        self.store = store
        self.root = store.root

    def write_left(self, record: LeftRecord) -> None:
        """Write ``nodes/<node_id>/left.json`` atomically."""
        validate_node_id(record.node_id)
        path = self.root / left_path(record.node_id)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, record.dumps())
        except PermissionError as exc:
            raise PermanentTransportError(f"write {path}: permission denied ({exc})") from exc
        except OSError as exc:
            raise TransientTransportError(f"write {path}: {exc}") from exc

    def clear_left(self, node_id: str) -> None:
        """Delete ``nodes/<node_id>/left.json`` if it is there."""
        validate_node_id(node_id)
        path = self.root / left_path(node_id)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise TransientTransportError(f"delete {path}: {exc}") from exc

    def read_left(self) -> LeftListing:
        """Every ``nodes/*/left.json`` that parses; the others in ``refused``."""
        nodes = self.root / "nodes"
        try:
            names = sorted(os.listdir(nodes))
        except FileNotFoundError:
            return LeftListing()
        except OSError as exc:
            raise TransientTransportError(f"list {nodes}: {exc}") from exc
        records: dict[str, LeftRecord] = {}
        refused: list[str] = []
        for node in names:
            if len(records) >= MAX_LEFT_RECORDS:
                break
            if not is_valid_node_id(node):
                continue
            path = self.root / left_path(node)
            try:
                raw = self.store.read_small(path, LEFT_LIMIT)
                if raw is not None:
                    records[node] = LeftRecord.loads(raw, str(path), node)
            except PermanentTransportError as exc:
                refused.append(str(exc))
            except PermissionError as exc:
                refused.append(f"{path}: permission denied ({exc})")
            except (NotADirectoryError, IsADirectoryError):
                continue
            except OSError as exc:
                raise TransientTransportError(f"read {path}: {exc}") from exc
        return LeftListing(records, tuple(refused[:MAX_LEFT_RECORDS]))
