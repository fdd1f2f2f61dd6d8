"""From a config to a running trainer: ``build_runtime`` and ``train_from_config``.

``build_runtime`` builds what the config names (the model through the ``build_model`` hook,
the data, the metric sinks) and hands it to :func:`speedtronic.parts.build_parts`, the one
place that turns a config into the trainer's parts.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from speedtronic.config import SpeedtronicConfig
from speedtronic.data import DataSource, Tokenizer, build_dataloader
from speedtronic.metrics import ConsoleSink, JsonlSink, MetricLogger, TextFileSink, import_hook
from speedtronic.parallel import init_parallel
from speedtronic.parts import build_parts, model_limits
from speedtronic.plugins import get_plugin_manager
from speedtronic.registry import build_model_from_hook
from speedtronic.shape_advice import warn_shape_advice
from speedtronic.trainer import Trainer, TrainResult

__all__ = [
    "Runtime",
    "build_metric_logger",
    "build_runtime",
    "seed_everything",
    "train_from_config",
]

log = logging.getLogger("speedtronic.runtime")


@dataclass
class Runtime:
    """The wired pieces of one run."""

    config: SpeedtronicConfig
    model: nn.Module
    data: DataSource
    trainer: Trainer
    metrics: MetricLogger


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_metric_logger(
    config: SpeedtronicConfig, hooks: Iterable[Any] = (), console: bool = True
) -> MetricLogger:
    """stdout, optional text/JSONL files, ``logging.hooks`` and ``hooks``."""
    sinks: list[Any] = []
    if console:
        sinks.append(ConsoleSink(config.run.max_steps, progress=config.logging.progress))
    if config.logging.file:
        sinks.append(TextFileSink(config.logging.file))
    if config.logging.json_file:
        sinks.append(JsonlSink(config.logging.json_file))
    sinks.extend(import_hook(path) for path in config.logging.hooks)
    sinks.extend(hooks)
    return MetricLogger(sinks)


def build_runtime(
    config: Any,
    *,
    model: nn.Module | None = None,
    dataset: Any = None,
    tokenizer: Tokenizer | None = None,
    hooks: Iterable[Any] = (),
    console: bool = True,
    eval_dataset: Any = None,
) -> Runtime:
    """Validate ``config`` and build model, data, optimizer, metrics and trainer.

    ``model`` and ``dataset`` replace the configured ones; ``eval_dataset`` is a held-out
    dataset for the ``eval`` section; ``hooks`` are extra metric sinks.
    """
    config = SpeedtronicConfig.load(config)
    logging.getLogger("speedtronic").setLevel(config.logging.level)
    pm = get_plugin_manager()
    parallel = init_parallel(config.parallel, config.run.device)
    if not parallel.is_main:  # rank 0 speaks for the run; the others only warn
        level = max(logging.WARNING, logging.getLevelName(config.logging.level))
        logging.getLogger("speedtronic").setLevel(level)
    seed_everything(config.run.seed)
    if model is None:
        model = build_model_from_hook(config.model.name, **config.model.params)
        warn_shape_advice(model, config.model.params)
    else:
        warn_shape_advice(model)
    seed = config.data_seed
    adjusted = pm.hook.data_seed(config=config, seed=seed)
    data = build_dataloader(
        config,
        dataset,
        tokenizer,
        **model_limits(model, config.model.params),
        seed=adjusted if adjusted is not None else seed,
        rank=parallel.rank,
        num_ranks=parallel.world_size,
    )
    log.info("data: %s", data.description)
    # Under DDP, rank 0 alone prints and writes metric files.
    metrics = build_metric_logger(config, hooks, console) if parallel.is_main else MetricLogger()
    try:
        parts = build_parts(
            config,
            model,
            data,
            metric_logger=metrics,
            plugin_manager=pm,
            eval_dataset=eval_dataset,
            parallel=parallel,
        )
        trainer = Trainer.from_parts(parts)
    except BaseException:
        metrics.close()
        parallel.close()
        raise
    return Runtime(config=config, model=model, data=data, trainer=trainer, metrics=metrics)


def train_from_config(config: Any, **kwargs: Any) -> TrainResult:
    """Build the runtime for ``config`` and train; returns the :class:`TrainResult`. A process
    group this call joined (DDP under torchrun) is left again at the end."""
    runtime = build_runtime(config, **kwargs)
    try:
        return runtime.trainer.fit()
    finally:
        runtime.trainer.parallel.close()
