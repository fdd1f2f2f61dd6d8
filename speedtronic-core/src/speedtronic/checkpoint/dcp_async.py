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

from typing import Any

from speedtronic.parallel.context import ParallelContext

__all__ = ["background_collectives", "stage"]


def background_collectives(parallel: ParallelContext) -> ParallelContext:
    """The collectives of this run's background saves: a new gloo group of all ranks (every
    rank must call this at the same point, as ``new_group`` is collective), or no-ops on one
    process: a context whose ``broadcast``, ``gather`` and ``barrier`` go over that group."""
    if not parallel.enabled:
        return ParallelContext()
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    return ParallelContext(parallel.rank, parallel.world_size, group=group)


def stage(tensors: dict[str, Any]) -> dict[str, Any]:
    """A CPU copy of a state dict of (possibly DTensor) shards that training may go on
    changing: what ``dcp.async_save`` stages before its thread writes (DCP's
    :class:`~torch.distributed.checkpoint.staging.BlockingAsyncStager`)."""
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    return BlockingAsyncStager().stage(tensors)
