"""The built-in strategies beside :class:`~speedtronic.parallel.strategy.SingleProcess`:
``ddp`` (a whole replica per rank, gradients all-reduced by DistributedDataParallel) and
``fsdp`` (parameters, gradients and optimizer state sharded over the ranks by FSDP2, sharded
DCP checkpoints, see :mod:`speedtronic.parallel.fsdp`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from speedtronic.errors import ConfigError
from speedtronic.parallel.strategy import ParallelStrategy

if TYPE_CHECKING:
    from speedtronic.checkpoint.writer import CheckpointWriter
    from speedtronic.engine.precision import Precision

__all__ = ["DataParallel", "FullyShardedDataParallel"]


class DataParallel(ParallelStrategy):
    """``parallel.strategy: ddp`` (and ``auto`` on several ranks): every rank trains a whole
    replica; only the last micro-batch of a step all-reduces the gradients."""

    name = "ddp"

    def __init__(self, parallel: Any) -> None:
        super().__init__(parallel)
        self._ddp: Any = None

    def wrap(self, model: nn.Module, *, config: Any, ooo_backprop: Any = None) -> nn.Module:
        if not self.parallel.enabled:
            return model
        if ooo_backprop is not None:
            raise ConfigError(
                "cannot be combined with data parallel yet: DDP reduces gradients in autograd "
                "hooks that deferred weight-gradient products bypass",
                "ooo_backprop.enabled",
            )
        from torch.nn.parallel import DistributedDataParallel

        device = next(model.parameters(), torch.empty(0)).device
        self._ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=config.parallel.find_unused_parameters,
            static_graph=config.parallel.static_graph,
        )
        return self._ddp

    @contextlib.contextmanager
    def sync_gradients(self, last: bool) -> Iterator[None]:
        if self._ddp is None or last:
            yield
            return
        with self._ddp.no_sync():
            yield

    @property
    def ddp(self) -> Any:
        return self._ddp


class FullyShardedDataParallel(ParallelStrategy):
    """``parallel.strategy: fsdp``: FSDP2 over the ranks (on one process nothing is sharded,
    but checkpoints are still sharded DCP directories, so their layout does not depend on the
    launcher)."""

    name = "fsdp"

    def __init__(self, parallel: Any) -> None:
        super().__init__(parallel)
        self._run: Any = None  # speedtronic.parallel.fsdp.ShardedRun once the model is sharded

    @property
    def shards_parameters(self) -> bool:  # type: ignore[override]
        return self.parallel.enabled  # on one process there is nothing to shard

    @property
    def eval_lockstep(self) -> bool:  # type: ignore[override]
        return self.parallel.enabled

    def accept_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is not None and self.parallel.enabled:
            raise ConfigError(
                "is fsdp: the optimizer must be built over the sharded parameters, so pass "
                "none and let the optimizer section build it",
                "parallel.strategy",
            )

    def shard(
        self, model: nn.Module, *, config: Any, device: torch.device, precision: Precision
    ) -> nn.Module:
        if not self.parallel.enabled:
            return model
        from speedtronic.parallel.fsdp import ShardedRun, meta_shadow, shard_model

        # The FLOP count needs the model whole; a meta copy of it costs no memory.
        shadow = meta_shadow(model)
        units = shard_model(
            model,
            config.parallel.fsdp,
            device=device,
            world_size=self.parallel.world_size,
            compute_dtype=precision.dtype,
            activation_checkpointing=config.gradient_checkpointing,
        )
        self._run = ShardedRun(model, units, shadow)
        return model

    def set_gradient_checkpointing(self, model: nn.Module, enabled: bool) -> bool:
        if self._run is not None:
            return True  # applied per unit while sharding
        return super().set_gradient_checkpointing(model, enabled)

    @property
    def compile_units(self) -> list[nn.Module] | None:
        return self._run.units if self._run is not None else None

    def grad_scaler(self, precision: Precision, device: torch.device) -> Any:
        # Each rank sees only its shards' infs: this scaler agrees across ranks on an
        # overflow, so every rank skips the same steps.
        if self.shards_parameters and precision.use_grad_scaler:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(device.type)
        return precision.grad_scaler(device)

    def flops_model(self, model: nn.Module) -> nn.Module | None:
        # Counted on the copy taken before sharding (None when it could not be copied).
        return self._run.shadow if self._run is not None else model

    def backward(self, loss: torch.Tensor, *, last: bool, accumulating: bool) -> None:
        if self._run is not None and accumulating:
            self._run.before_backward(last)
        loss.backward()

    def clip_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float) -> Any:
        if self._run is None:
            return super().clip_grad_norm(parameters, max_norm)
        return self._run.clip_grad_norm(parameters, max_norm)  # summed over the ranks' shards

    def checkpoint_writer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> CheckpointWriter:
        from speedtronic.checkpoint.dcp import ShardedWriter

        return ShardedWriter(model, optimizer)

    @property
    def sharded_run(self) -> Any:
        return self._run
