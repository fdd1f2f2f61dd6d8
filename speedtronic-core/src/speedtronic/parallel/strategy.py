"""How a run's processes train one model together: the :class:`ParallelStrategy`.

One strategy object is built per run by the composition root (:func:`speedtronic.engine.parts.
build_parts`) and asked, wherever the engine used to test which of DDP or FSDP it runs under,
to do its part: shard the model before the optimizer exists, wrap the module the forward runs
through, hold back gradient reduction during accumulation, run the backward, clip gradients,
pick the GradScaler, read and load the whole model state, name the checkpoint writer and the
model the FLOP count runs on. Rank agreement (barriers, means, a flag any rank raises) goes
through :attr:`ParallelStrategy.parallel`, the run's :class:`ParallelContext`.

Strategies are registered by name, the way model factories are: the built-in ``none``
(:class:`SingleProcess`), ``ddp`` and ``fsdp`` (:mod:`speedtronic.parallel.builtin`), and
whatever a plugin returns from the ``parallel_strategies`` hook or a caller passes to
:func:`register_strategy`. ``parallel.strategy`` names one of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from speedtronic.checkpoint.writer import CheckpointWriter
from speedtronic.parallel.context import ParallelContext

if TYPE_CHECKING:
    from speedtronic.engine.precision import Precision

__all__ = ["ParallelStrategy", "SingleProcess"]


class ParallelStrategy:
    """The single-process strategy, and the interface every other one overrides.

    A subclass is built as ``cls(parallel)`` with the run's :class:`ParallelContext`; the
    methods are called in this order while the run is built (:meth:`shard`, :meth:`accept_
    optimizer`, :meth:`set_gradient_checkpointing`, :meth:`wrap`) and then at every step
    (:meth:`sync_gradients`, :meth:`backward`, :meth:`clip_grad_norm`)."""

    name: ClassVar[str] = "none"
    eval_lockstep: ClassVar[bool] = False
    """Every rank must run each held-out forward (the forward is a collective of the ranks)."""
    shards_parameters: ClassVar[bool] = False
    """Each rank holds only a shard of the parameters (``trainer.model`` is not whole)."""

    def __init__(self, parallel: ParallelContext) -> None:
        self.parallel = parallel

    def describe(self) -> str:
        return self.name

    # ------------------------------------------------------------------ building the run
    def shard(
        self, model: nn.Module, *, config: Any, device: torch.device, precision: Precision
    ) -> nn.Module:
        """Called before the optimizer is built over ``model``'s parameters; returns the model
        the run trains (here ``model`` itself)."""
        return model

    def accept_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Refuse (ConfigError) an optimizer the caller built, if this strategy cannot use it."""

    def set_gradient_checkpointing(self, model: nn.Module, enabled: bool) -> bool:
        """Turn on gradient checkpointing through the model's ``set_gradient_checkpointing``;
        False when the model has none (the caller warns)."""
        if not enabled:
            return True
        setter = getattr(model, "set_gradient_checkpointing", None)
        if not callable(setter):
            return False
        setter(True)
        return True

    def wrap(self, model: nn.Module, *, config: Any, ooo_backprop: Any = None) -> nn.Module:
        """The module the forward and backward run through (``model`` itself, or a wrapper
        that reduces gradients)."""
        return model

    @property
    def compile_units(self) -> list[nn.Module] | None:
        """The modules ``torch.compile`` compiles one by one instead of the whole model."""
        return None

    def grad_scaler(self, precision: Precision, device: torch.device) -> Any:
        """The run's GradScaler (disabled where the precision needs none)."""
        return precision.grad_scaler(device)

    def flops_model(self, model: nn.Module) -> nn.Module | None:
        """The whole model the FLOP count runs on (None: it cannot be counted)."""
        return model

    # ------------------------------------------------------------------ one step
    @contextlib.contextmanager
    def sync_gradients(self, last: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward: gradients are reduced over the ranks
        on the ``last`` micro-batch of an optimizer step only."""
        yield

    def backward(self, loss: torch.Tensor, *, last: bool, accumulating: bool) -> None:
        """The backward of one micro-batch's (scaled) loss."""
        loss.backward()

    def clip_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float) -> Any:
        """Clip to ``max_norm`` (``inf``: only measure) by the gradients' global L2 norm;
        returns that norm."""
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)

    # ------------------------------------------------------------------ state
    def checkpoint_writer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> CheckpointWriter:
        """How this run's checkpoints are written."""
        return CheckpointWriter()

    def full_model_state(self, model: nn.Module, *, only_main: bool = False) -> dict[str, Any]:
        """The whole model's state dict on the CPU (every rank calls it)."""
        from speedtronic.parallel.fsdp import full_model_state

        return full_model_state(model, only_main=only_main)

    def load_full_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Load a whole (unsharded) model state into this run's model."""
        from speedtronic.parallel.fsdp import load_full_model_state

        load_full_model_state(model, state)

    def load_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Load a whole optimizer state (of a run of any strategy) into this run's optimizer."""
        from speedtronic.parallel.fsdp import load_optimizer_state

        load_optimizer_state(model, optimizer, state)

    # ------------------------------------------------------------------ the ranks
    def barrier(self) -> None:
        self.parallel.barrier()

    def agree(self, flags: list[int]) -> list[int]:
        """Each flag's maximum over the ranks: any rank's raised flag is everyone's."""
        return self.parallel.max_each(flags)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        return self.parallel.mean(value)

    # What the engine reads of the strategies it knew before they were objects.
    @property
    def ddp(self) -> Any:
        """The DistributedDataParallel wrapper under ``ddp``, else None."""
        return None

    @property
    def sharded_run(self) -> Any:
        """The :class:`~speedtronic.parallel.fsdp.ShardedRun` when the parameters are sharded."""
        return None


class SingleProcess(ParallelStrategy):
    """``parallel.strategy: none``, and ``auto`` on one process: one process holds and trains
    the whole model."""
