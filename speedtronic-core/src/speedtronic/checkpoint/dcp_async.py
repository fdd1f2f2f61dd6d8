"""Sharded checkpoints written in the background (``checkpoint.async_save`` with
``parallel.strategy: fsdp``).

A sharded save is a collective: every rank writes its shards, rank 0 commits. Off the training
path it runs the way ``torch.distributed.checkpoint.async_save`` runs one (stage the state dict
to CPU memory with DCP's own stager, then ``dcp.save`` in a thread), with two things added
that the manager's guarantees need and ``async_save`` leaves to its caller:

- the commit (state.json, manifest, rename, ``latest.json`` last) and the one retry follow the
  write in the same thread, from the same staged copy: a retry cannot re-read the live model,
  which has trained on;
- every collective of the background write, DCP's and ours, goes over a process group of its
  own (gloo: the staged tensors are on the CPU), created once by every rank at the first
  background save, so it never interleaves with the training step's collectives on the
  default group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from speedtronic.parallel.context import ParallelContext

__all__ = ["GroupCollectives", "background_collectives", "stage"]


@dataclass
class GroupCollectives:
    """The few collectives a sharded save takes (:class:`~speedtronic.parallel.ParallelContext`
    's ``broadcast``, ``gather``, ``barrier``), over ``group``; on one process, no-ops."""

    rank: int = 0
    world_size: int = 1
    group: Any = None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a small picklable object)."""
        if not self.enabled:
            return value
        import torch.distributed as dist

        holder = [value]
        dist.broadcast_object_list(holder, src=0, group=self.group)
        return holder[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank."""
        if not self.enabled:
            return [value]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def barrier(self) -> None:
        """Wait until every rank's background write got here."""
        if self.enabled:
            import torch.distributed as dist

            dist.barrier(group=self.group)


def background_collectives(parallel: ParallelContext) -> GroupCollectives:
    """The collectives of this run's background saves: a new gloo group of all ranks (every
    rank must call this at the same point, as ``new_group`` is collective), or no-ops on one
    process."""
    if not parallel.enabled:
        return GroupCollectives()
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    return GroupCollectives(parallel.rank, parallel.world_size, group)


def stage(tensors: dict[str, Any]) -> dict[str, Any]:
    """A CPU copy of a state dict of (possibly DTensor) shards that training may go on
    changing: what ``dcp.async_save`` stages before its thread writes (DCP's
    :class:`~torch.distributed.checkpoint.staging.BlockingAsyncStager`)."""
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    return BlockingAsyncStager().stage(tensors)
