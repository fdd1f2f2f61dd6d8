"""The run's ranks: torch.distributed process groups inside one machine.

A run launched by ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) or by
``speedtronic train --nproc-per-node N`` (which starts the ranks through torch's own elastic
launcher) trains on every rank: each reads its own disjoint share of the samples and rank 0
alone writes checkpoints and metrics. How the ranks share the model (whole replicas under
``ddp``, shards under ``fsdp``) is the run's :class:`~speedtronic.parallel.ParallelStrategy`.

:class:`ParallelContext` is what the rest of the engine sees: ``rank``, ``world_size``,
``is_main``, and the few collectives it needs (a mean of a device scalar at the log cadence, a
barrier around checkpoints, broadcasting a small object). On one process every collective is a
no-op, so code paths are the same with and without several ranks.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from speedtronic.errors import ConfigError, SpeedtronicError

__all__ = ["SINGLE_PROCESS", "ParallelContext", "init_parallel", "launched_world_size"]

log = logging.getLogger("speedtronic.parallel")


def launched_world_size() -> int:
    """``WORLD_SIZE`` from the environment torchrun sets (1 when not launched by it)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


@dataclass
class ParallelContext:
    """Where this process stands in the run: rank, world size and the device it trains on."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    device: torch.device | None = None
    owns_group: bool = False
    #: The process group the collectives below go over (None: the default group). A
    #: background sharded save has a gloo group of its own (checkpoint/dcp_async.py).
    group: Any = None

    @property
    def enabled(self) -> bool:
        """True when several processes train together (DDP)."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes checkpoints and metrics."""
        return self.rank == 0

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a scalar over all ranks (a copy; the input is unchanged)."""
        if not self.enabled:
            return value
        import torch.distributed as dist

        reduced = value.detach().clone().float()
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=self.group)
        return reduced / self.world_size

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of a tensor over all ranks (a copy)."""
        if not self.enabled:
            return value
        import torch.distributed as dist

        reduced = value.detach().clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=self.group)
        return reduced

    def max_each(self, values: list[int]) -> list[int]:
        """The maximum of each of a few small integers over all ranks, in one collective (how
        ranks agree on flags: any rank's True is everyone's)."""
        if not self.enabled:
            return [int(v) for v in values]
        import torch.distributed as dist

        tensor = torch.tensor([int(v) for v in values], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in tensor.tolist()]

    def barrier(self) -> None:
        """Wait until every rank got here."""
        if self.enabled:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a small picklable object: a decision, a step)."""
        if not self.enabled:
            return value
        import torch.distributed as dist

        holder = [value]
        dist.broadcast_object_list(holder, src=0, group=self.group)
        return holder[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank (small objects only)."""
        if not self.enabled:
            return [value]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def close(self) -> None:
        """Destroy the process group this context created (no-op otherwise)."""
        if self.owns_group:
            import torch.distributed as dist

            if dist.is_initialized():
                # Leave together: a rank that tears gloo down while a peer is still talking
                # to it aborts the peer.
                with contextlib.suppress(Exception):
                    dist.barrier()
                dist.destroy_process_group()
            self.owns_group = False


SINGLE_PROCESS = ParallelContext()


def init_parallel(section: Any, requested_device: str) -> ParallelContext:
    """Join the process group torchrun described in the environment, when the ``parallel``
    section and the launch ask for DDP; otherwise the single-process context.

    ``section`` is the ``parallel`` config section. Each rank trains on ``cuda:LOCAL_RANK`` on a
    GPU machine and on the CPU otherwise; the backend defaults to NCCL on CUDA and gloo on CPU.
    """
    world = launched_world_size()
    if world == 1 and section.strategy not in ("auto", "ddp"):
        return SINGLE_PROCESS  # one process holds everything: nothing to shard or reduce
    if section.strategy == "none" or (section.strategy == "auto" and world == 1):
        if world > 1:
            log.warning(
                "launched with WORLD_SIZE=%d but parallel.strategy is none: every rank trains "
                "on its own",
                world,
            )
        return SINGLE_PROCESS
    if world == 1:
        raise ConfigError(
            "is ddp, but this process was not launched with several ranks: use "
            "`speedtronic train --nproc-per-node N` or `torchrun --nproc-per-node N -m "
            "speedtronic train ...`",
            "parallel.strategy",
        )
    import torch.distributed as dist

    try:
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    except (KeyError, ValueError):
        raise SpeedtronicError(
            "WORLD_SIZE is set but RANK is missing or not a number: launch with torchrun"
        ) from None
    if not 0 <= rank < world:
        raise SpeedtronicError(
            f"RANK is {rank}, outside 0 .. WORLD_SIZE - 1 = {world - 1}: launch with torchrun"
        )
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing and not dist.is_initialized():
        raise SpeedtronicError(
            f"WORLD_SIZE is set but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
            "not: launch with torchrun"
        )
    use_cuda = requested_device in ("auto", "cuda") and torch.cuda.is_available()
    backend = section.backend
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if backend == "nccl" and not use_cuda:
        raise ConfigError("is nccl, which needs CUDA; use gloo on CPU", "parallel.backend")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    owns = False
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend, timeout=datetime.timedelta(seconds=section.timeout)
        )
        owns = True
    context = ParallelContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        backend=backend,
        device=device,
        owns_group=owns,
    )
    log.info(
        "%s: rank %d of %d (%s, %s)",
        {"fsdp": "sharded data parallel", "auto": "data parallel", "ddp": "data parallel"}.get(
            section.strategy, f"parallel strategy {section.strategy}"
        ),
        context.rank,
        context.world_size,
        backend,
        device,
    )
    return context
