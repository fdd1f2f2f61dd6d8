"""``left`` records: how a node tells the store it ended.

A node whose run ends (its ``max_steps``, a stop signal, an error) writes
``nodes/<node_id>/left.json`` with its last local step; a node that starts again (a resume)
deletes its record first. The master reads every record at each poll and counts the node as
gone (see :mod:`speedtronic_diloco.membership`).

Anyone with write access to the store can write such a file, so a record is read like every
other remote file: at most :data:`LEFT_LIMIT` bytes, a JSON object whose fields have the
right types, whose node id is the one of the folder it is in; anything else is refused with
the file named, and never stops a reader. A listing returns at most :data:`MAX_LEFT_RECORDS`.

Stores offer the records through a :class:`MemberRecords`, an optional capability a transport
holds as its ``members`` (a store without it has no records: silence alone then says a node is
gone).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from speedtronic_diloco.identity import is_valid_node_id
from speedtronic_diloco.timestamps import parse_timestamp
from speedtronic_diloco.transports.base import PermanentTransportError, UnsupportedOperation

__all__ = [
    "LEFT_FILE",
    "LEFT_LIMIT",
    "LEFT_REASONS",
    "MAX_LEFT_RECORDS",
    "LeftListing",
    "LeftRecord",
    "MemberRecords",
    "left_path",
    "member_records_of",
    "parse_left_path",
]

LEFT_FILE = "left.json"
#: A ``left.json`` larger than this is not ours (ours is about 100 bytes).
LEFT_LIMIT = 4096
#: A listing stops after this many records (a store flooded with folders stays readable).
MAX_LEFT_RECORDS = 10_000
#: Why a node left: its last step was ``run.max_steps``, a stop signal, an error.
LEFT_REASONS = ("max_steps", "stopped", "error")
_LEFT_PATH = re.compile(r"^nodes/([^/\\]+)/left\.json$")
_MAX_STEP = 1 << 62


def left_path(node_id: str) -> str:
    """The store path of ``node_id``'s left record."""
    return f"nodes/{node_id}/{LEFT_FILE}"


def parse_left_path(path: str) -> str | None:
    """The node id of a left record's store path, or None for anything else."""
    match = _LEFT_PATH.match(path)
    return match.group(1) if match and is_valid_node_id(match.group(1)) else None


@dataclass(frozen=True)
class LeftRecord:
    """``nodes/<node_id>/left.json``: ``node_id`` ended after local step ``last_step``, for
    ``reason`` (one of :data:`LEFT_REASONS`), at wall-clock time ``left_at``."""

    node_id: str
    last_step: int
    reason: str
    left_at: float | None = None

    def dumps(self) -> bytes:
        """The JSON document as UTF-8 bytes."""
        document = {
            "format": 1,
            "node_id": self.node_id,
            "last_step": self.last_step,
            "reason": self.reason,
            "left_at": self.left_at,
        }
        return json.dumps(document, indent=1, sort_keys=True).encode("utf-8")

    @classmethod
    def loads(cls, raw: bytes, where: str, node_id: str) -> LeftRecord:
        """Parse the record read from ``where`` (the folder of ``node_id``), checking every
        field; PermanentTransportError naming ``where`` and the field otherwise."""
        if len(raw) > LEFT_LIMIT:
            raise PermanentTransportError(f"{where}: larger than {LEFT_LIMIT} bytes; not ours")
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise PermanentTransportError(f"{where}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise PermanentTransportError(f"{where}: expected a JSON object")
        if data.get("node_id") != node_id:
            raise PermanentTransportError(f"{where}: node_id is not {node_id!r} (its folder)")
        step = data.get("last_step")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < _MAX_STEP:
            raise PermanentTransportError(f"{where}: last_step is not an integer >= 0")
        reason = data.get("reason")
        if reason not in LEFT_REASONS:
            raise PermanentTransportError(
                f"{where}: reason is not one of {', '.join(LEFT_REASONS)}"
            )
        try:
            left_at = parse_timestamp(data.get("left_at"), where, "left_at")
        except ValueError as exc:
            raise PermanentTransportError(str(exc)) from None
        return cls(node_id, step, reason, left_at)


@dataclass(frozen=True)
class LeftListing:
    """What :meth:`MemberRecords.read_left` found: ``records`` by node id, and one message
    (naming the file) per record refused."""

    records: dict[str, LeftRecord] = field(default_factory=dict)
    refused: tuple[str, ...] = ()


class MemberRecords:
    """The left records of a store: a transport that keeps them holds one as its ``members``
    (:func:`member_records_of`). Safe to call from several threads, like the rest of a
    transport."""

    def write_left(self, record: LeftRecord) -> None:
        """Store ``record`` as ``nodes/<node_id>/left.json`` (atomically: a reader sees the
        old record or the new one)."""
        raise UnsupportedOperation("this store keeps no left records")

    def clear_left(self, node_id: str) -> None:
        """Delete ``node_id``'s left record (nothing to do when there is none)."""
        raise UnsupportedOperation("this store keeps no left records")

    def read_left(self) -> LeftListing:
        """Every well-formed left record (at most :data:`MAX_LEFT_RECORDS`); a malformed or
        hostile one is left out, its problem (naming the file) in ``refused``."""
        raise UnsupportedOperation("this store keeps no left records")


def member_records_of(transport: object) -> MemberRecords | None:
    """The left records ``transport`` keeps (its ``members``), or None when it keeps none."""
    members = getattr(transport, "members", None)
    return members if isinstance(members, MemberRecords) else None
