"""The composition root of a run: one function that turns a config into the trainer's parts.

:func:`build_parts` is the only place that decides the device, the precision and its
GradScaler, the optimizer (configured, or the caller's, wrapped in cautious masking when
``optimizer.cautious`` asks), the schedule, the checkpoint manager, the metric logger, the
plugin manager, gradient checkpointing, out-of-order backprop, ``torch.compile`` and the run's
:class:`~speedtronic.parallel.ParallelStrategy` (``parallel.strategy``: none, DDP, FSDP2 or a
plugin's), which wraps or shards the model and picks the GradScaler and checkpoint writer.
:func:`speedtronic.engine.runtime.build_runtime` calls it with the configured model and data;
``Trainer(model, config, ...)`` calls it with whatever a Python user passed, so both ways build
a run the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from speedtronic.checkpoint import CheckpointManager, SavePolicy
from speedtronic.config import SpeedtronicConfig
from speedtronic.data import DataSource
from speedtronic.engine.batch import label_mode
from speedtronic.engine.compile import CompiledModel
from speedtronic.engine.eval import Evaluator, build_eval_source
from speedtronic.engine.model_limits import model_limits
from speedtronic.engine.ooo_backprop import OOOBackprop, install_ooo_backprop
from speedtronic.engine.precision import Precision, resolve_device, resolve_precision
from speedtronic.errors import ConfigError
from speedtronic.observe.metrics import MetricLogger
from speedtronic.optim import build_optimizer, build_scheduler
from speedtronic.parallel import (
    SINGLE_PROCESS,
    ParallelContext,
    ParallelStrategy,
    SingleProcess,
    build_strategy,
)

__all__ = ["TrainingParts", "accumulation_steps", "build_parts", "model_limits"]


log = logging.getLogger("speedtronic.trainer")


@dataclass
class TrainingParts:
    """Everything a :class:`~speedtronic.engine.trainer.Trainer` trains with."""

    config: SpeedtronicConfig
    model: nn.Module
    data: DataSource | Iterable[Any]
    device: torch.device
    precision: Precision
    scaler: torch.amp.GradScaler
    optimizer: torch.optim.Optimizer
    scheduler: Any
    checkpoints: CheckpointManager
    metrics: MetricLogger
    plugin_manager: Any
    compiled: CompiledModel
    label_mode: str = "shifted"
    ooo_backprop: OOOBackprop | None = None
    """The queue of deferred weight gradients when ``ooo_backprop.enabled`` (drain it before
    reading ``.grad``), else None."""
    evaluator: Evaluator | None = None
    """Held-out evaluation when the ``eval`` section asks for it, else None."""
    parallel: ParallelContext = field(default_factory=ParallelContext)
    """This process's rank and world size (data parallel), single-process by default."""
    strategy: ParallelStrategy = field(default_factory=lambda: SingleProcess(SINGLE_PROCESS))
    """How the ranks share the work (:mod:`speedtronic.parallel`): it wrapped or sharded
    ``model`` and runs each step's gradient reduction, backward and clipping."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step on this rank: the global ``data.target_batch_size``
    divided by ``micro_batch_size`` x world size."""


def build_parts(
    config: SpeedtronicConfig,
    model: nn.Module,
    data: DataSource | Iterable[Any],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    metric_logger: MetricLogger | None = None,
    plugin_manager: Any = None,
    device: torch.device | None = None,
    checkpoints: CheckpointManager | None = None,
    evaluator: Evaluator | None = None,
    eval_dataset: Any = None,
    parallel: ParallelContext = SINGLE_PROCESS,
) -> TrainingParts:
    """The parts of a run over ``model`` and ``data``; any part given is used as it is.

    ``eval_dataset`` is a held-out dataset for the ``eval`` section (else the config says
    where the held-out samples come from, see :func:`speedtronic.engine.eval.build_eval_source`)."""
    from speedtronic.plugins import get_plugin_manager

    config.validate()  # a config changed in place since it was loaded
    manager = plugin_manager if plugin_manager is not None else get_plugin_manager()
    strategy = build_strategy(config.parallel.strategy, parallel, manager)
    strategy.accept_optimizer(optimizer)
    device = device or parallel.device or resolve_device(config.run.device)
    accumulation = accumulation_steps(config, parallel.world_size)
    model = model.to(device)
    precision = resolve_precision(config.precision.mode, device)
    # Before the optimizer exists: under FSDP it must hold the sharded (DTensor) parameters.
    model = strategy.shard(model, config=config, device=device, precision=precision)
    optimizer = build_optimizer(model, config.optimizer, device, optimizer)
    if scheduler is None:
        scheduler = build_scheduler(optimizer, config.scheduler, config.run.max_steps)
    if not strategy.set_gradient_checkpointing(model, config.gradient_checkpointing):
        log.warning(
            "gradient_checkpointing is on but %s has no set_gradient_checkpointing(); "
            "training without it",
            type(model).__name__,
        )
    # The swap is an instance attribute on each nn.Linear: state_dict keys and module types stay.
    ooo = install_ooo_backprop(model, config.ooo_backprop, device)
    if ooo is not None:
        ooo.guard_optimizer(optimizer)
    labels = _label_mode(config, model)
    if evaluator is None and config.eval.configured:
        evaluator = Evaluator(
            build_eval_source(
                config,
                **model_limits(model, config.model.params),
                dataset=eval_dataset,
                rank=parallel.rank,
                num_ranks=parallel.world_size,
            ),
            config.eval.batches,
            device=device,
            precision=precision,
            label_mode=labels,
            parallel=parallel,
            lockstep=strategy.eval_lockstep,
        )
        log.info("eval: %s", evaluator.describe())
    forward = strategy.wrap(model, config=config, ooo_backprop=ooo)
    checkpoints = _checkpoint_manager(config, checkpoints, parallel)
    checkpoints.writer = strategy.checkpoint_writer(model, optimizer)
    return TrainingParts(
        config=config,
        model=model,
        data=data,
        device=device,
        precision=precision,
        scaler=strategy.grad_scaler(precision, device),
        optimizer=optimizer,
        scheduler=scheduler,
        checkpoints=checkpoints,
        metrics=metric_logger if metric_logger is not None else MetricLogger(),
        plugin_manager=manager,
        compiled=CompiledModel(forward, config.compile, units=strategy.compile_units),
        label_mode=labels,
        ooo_backprop=ooo,
        evaluator=evaluator,
        parallel=parallel,
        strategy=strategy,
        accumulation_steps=accumulation,
    )


def _checkpoint_manager(
    config: SpeedtronicConfig, given: CheckpointManager | None, parallel: ParallelContext
) -> CheckpointManager:
    """The run's manager: a given one keeps its directory and retention but saves when the
    config's ``checkpoint`` section says, among this run's ranks (the strategy then names its
    writer: under ``parallel.strategy: fsdp``, on one process too, so the layout does not
    depend on the launcher, sharded DCP checkpoints)."""
    policy = SavePolicy.from_config(config.checkpoint)
    manager = given or CheckpointManager(config.checkpoint_dir, config.checkpoint.keep_last)
    manager.policy, manager.parallel = policy, parallel
    return manager


def accumulation_steps(config: SpeedtronicConfig, world_size: int = 1) -> int:
    """Micro-batches per optimizer step on each rank: ``data.target_batch_size`` is the global
    batch (default: one micro-batch per rank), split over ``world_size`` ranks."""
    micro = config.data.micro_batch_size
    target = config.data.target_batch_size or micro * world_size
    if target % (micro * world_size):
        raise ConfigError(
            f"is {target}, which {world_size} ranks x micro_batch_size {micro} do not divide; "
            f"use a multiple of {micro * world_size}",
            "data.target_batch_size",
        )
    return target // (micro * world_size)


def _label_mode(config: SpeedtronicConfig, model: nn.Module) -> str:
    mode = label_mode(config.data.labels, model)
    if config.data.labels is None and mode == "inputs":
        log.info(
            "data.labels: inputs (%s shifts labels itself, so batches carry labels = input_ids)",
            type(model).__name__,
        )
    return mode
