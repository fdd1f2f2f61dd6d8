"""How one checkpoint save is written: the whole state by rank 0, or every rank its part.

A :class:`~speedtronic.checkpoint.CheckpointManager` decides when a run saves, and keeps the
retention and the pointers; its ``writer`` (the run's :class:`ParallelStrategy
<speedtronic.parallel.ParallelStrategy>` picks it) writes each save.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from speedtronic.checkpoint.policy import SavePolicy

if TYPE_CHECKING:  # not at runtime: importing speedtronic.parallel imports this module
    from speedtronic.parallel.context import ParallelContext

__all__ = ["CheckpointWriter", "LayoutSteps", "SaveTarget"]


class LayoutSteps(Protocol):
    """The steps of the shared layout every writer ends with
    (:class:`~speedtronic.checkpoint.storage.CheckpointStorage` has them)."""

    def move_into_place(self, staging: Path, final: Path) -> None: ...

    def point_latest(self, step: int) -> None: ...

    def apply_retention(self, step: int) -> None: ...


class SaveTarget(Protocol):
    """What a writer needs of the :class:`~speedtronic.checkpoint.CheckpointManager` it writes
    for: its directory, ranks and retry policy, its whole-state format, and its ``storage``,
    whose steps of the shared layout every writer ends with (``move_into_place``: a staged
    checkpoint renamed into place, ``point_latest``, then ``apply_retention``)."""

    directory: Path
    parallel: ParallelContext
    policy: SavePolicy
    storage: LayoutSteps

    def write_whole(self, step: int, state: Any) -> Path: ...

    def snapshot_whole(self, step: int, state: Any) -> Callable[[], Path] | None: ...


class CheckpointWriter:
    """How a :class:`~speedtronic.checkpoint.CheckpointManager` writes one save: the whole
    state by rank 0 (this class: the manager's own file format), or every rank its own part
    (``per_rank``: :class:`speedtronic.checkpoint.dcp.ShardedWriter`). The manager keeps the
    policy, retention and pointers either way."""

    per_rank: ClassVar[bool] = False
    """Every rank writes (and, with ``async_save``, runs a background write) of its own."""

    def save(self, manager: SaveTarget, step: int, state: Any) -> Path:
        """Write ``state`` as the checkpoint of ``step`` now; every rank calls this and gets
        the checkpoint's path (or the same :class:`CheckpointError`)."""
        return manager.write_whole(step, state)

    def start(self, manager: SaveTarget, step: int, state: Any) -> Callable[[], Path] | None:
        """Copy what the write needs now (the only part the step waits for) and return the
        write to run in a background thread; None on a rank that writes nothing."""
        return manager.snapshot_whole(step, state)
