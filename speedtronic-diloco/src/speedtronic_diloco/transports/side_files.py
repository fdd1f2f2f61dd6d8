"""Small files a store keeps beside the global: the master's outer state and the standby
records (fail-over, ``distributed.failover``).

* ``global/outer/s<outer_step>-<sha12>.safetensors``: the master's
  :class:`~speedtronic_diloco.master.state.OuterState` of one outer step, written under an
  immutable name *before* the publication whose metadata names it
  (``extra["outer_state"]``), or in the same commit on the Hub. The metadata is the commit
  point: a master killed between the two leaves the old metadata naming the old state, so a
  successor always reads a state and a global of the same outer step.
* ``standbys/<node_id>.json``: a standby master's announcement (``speedtronic diloco status``
  lists the standbys seen).

A transport offers them through a :class:`SideFiles` it holds as its ``side_files`` (the shared
directory and the Hub do); a store without them runs as before, its outer state on the master's
disk only.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path
from typing import Protocol, runtime_checkable

from speedtronic_diloco.transports.base import Lease, PermanentTransportError

__all__ = [
    "OUTER_STATE_DIR",
    "STANDBY_DIR",
    "STANDBY_LIMIT",
    "SideFiles",
    "check_side_path",
    "outer_state_path",
    "side_files_of",
    "standby_path",
]

OUTER_STATE_DIR = "global/outer"
STANDBY_DIR = "standbys"
STANDBY_LIMIT = 4 << 10
"""A standby record larger than this is not ours."""

_SIDE_PATH = re.compile(
    r"^(global/outer/s\d{8}-[0-9a-f]{12}\.safetensors|standbys/[A-Za-z0-9][\w.-]{0,95}\.json)$"
)


def outer_state_path(outer_step: int, sha256: str) -> str:
    """The store path of the outer state of ``outer_step`` whose bytes hash to ``sha256``."""
    return f"{OUTER_STATE_DIR}/s{outer_step:08d}-{sha256[:12]}.safetensors"


def standby_path(node_id: str) -> str:
    """The store path of the standby record of ``node_id``."""
    return f"{STANDBY_DIR}/{node_id}.json"


def check_side_path(path: str) -> str:
    """``path`` when it is a side file's path; PermanentTransportError otherwise (metadata
    written by someone else must not point readers at arbitrary files)."""
    if not isinstance(path, str) or not _SIDE_PATH.match(path) or ".." in path:
        raise PermanentTransportError(f"{path!r} is not a side file path of this store")
    return path


@runtime_checkable
class SideFiles(Protocol):
    """What a store offers for side files (see the module docstring)."""

    def write_side_file(
        self,
        path: str,
        source: Path,
        *,
        fence: Lease | None = None,
        keep: Collection[str] | None = None,
        with_publication: bool = False,
    ) -> None:
        """Write ``source`` to ``path``; with ``fence``, only while the store's lease names its
        holder and epoch (:class:`~speedtronic_diloco.transports.base.LeaseLostError`); with
        ``keep``, every other file of ``path``'s folder not in ``keep`` is deleted with it.
        ``with_publication``: the store may hold the file back and write it in the same
        atomic step as the next publication (the Hub does: one commit); it is written at
        the latest with that publication, and not at all if that publication fails."""

    def read_side_file(
        self,
        path: str,
        dest: Path,
        *,
        size: int,
        sha256: str | None = None,
        revision: str | None = None,
    ) -> Path:
        """Copy ``path`` (at ``revision`` where the store has revisions) to ``dest``, reading
        at most ``size`` bytes and checking size and sha256 where given."""

    def list_side_files(self, folder: str) -> list[tuple[str, int]]:
        """``(path, size)`` of the side files in ``folder`` (empty when it has none)."""


def side_files_of(transport: object) -> SideFiles | None:
    """The side files ``transport`` keeps (its ``side_files``), or None when it keeps none."""
    files = getattr(transport, "side_files", None)
    return files if isinstance(files, SideFiles) else None
