"""From a config to a running trainer: ``build_runtime`` and ``train_from_config``.

``build_runtime`` builds what the config names (the model through the ``build_model`` hook,
the data, the metric sinks) and hands it to :func:`speedtronic.engine.parts.build_parts`, the one
place that turns a config into the trainer's parts.
"""

from __future__ import annotations

import gc
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
from speedtronic.engine.model_limits import model_limits
from speedtronic.engine.parts import build_parts
from speedtronic.engine.preflight import check_before_building
from speedtronic.engine.shape_advice import warn_shape_advice
from speedtronic.engine.trainer import Trainer, TrainResult
from speedtronic.errors import ConfigError, PluginError
from speedtronic.observe.metrics import (
    ConsoleSink,
    JsonlSink,
    MetricLogger,
    TextFileSink,
    import_hook,
)
from speedtronic.observe.step_estimate import estimate_config_step
from speedtronic.observe.threads import apply_threads
from speedtronic.parallel.context import SINGLE_PROCESS, init_parallel
from speedtronic.plugins import get_plugin_manager
from speedtronic.registry import build_model_from_hook, import_factory

__all__ = [
    "Runtime",
    "build_metric_logger",
    "build_runtime",
    "check_runtime",
    "data_rank",
    "dataset_from_config",
    "memory_report",
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
    """stdout, the JSONL metrics file (:attr:`SpeedtronicConfig.metrics_file`), an optional
    text file, ``logging.hooks`` and ``hooks``."""
    sinks: list[Any] = []
    if console:
        sinks.append(ConsoleSink(config.run.max_steps, progress=config.logging.progress))
    if config.logging.file:
        sinks.append(TextFileSink(config.logging.file))
    if config.metrics_file is not None:
        sinks.append(JsonlSink(config.metrics_file))
    sinks.extend(import_hook(path) for path in config.logging.hooks)
    sinks.extend(hooks)
    return MetricLogger(sinks)


def data_rank(config: SpeedtronicConfig, parallel: Any = None) -> tuple[int, int]:
    """``(rank, count)`` of this process among everything that must read disjoint samples:
    the ``data_rank`` hook's participant (a DiLoCo node) times the DDP ranks inside it. A
    dataset you build yourself should honour it (``(0, 1)``: read everything)."""
    answer = get_plugin_manager().hook.data_rank(config=config)
    node, nodes = answer if answer is not None else (0, 1)
    if not (isinstance(node, int) and isinstance(nodes, int) and 0 <= node < nodes):
        raise PluginError(f"the data_rank hook answered {answer!r}; expected (rank, count)")
    inner = parallel if parallel is not None else SINGLE_PROCESS
    return node * inner.world_size + inner.rank, nodes * inner.world_size


def dataset_from_config(config: SpeedtronicConfig, rank: int = 0, num_ranks: int = 1) -> Any:
    """The dataset ``data.dataset`` names (``package.module:factory``), called with
    ``data.dataset_args`` and, when the factory takes them, ``rank`` and ``num_ranks``."""
    import inspect

    factory = import_factory(config.data.dataset or "", "data.dataset")
    kwargs = dict(config.data.dataset_args)
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        parameters = {}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    for name, value in (("rank", rank), ("num_ranks", num_ranks)):
        if name in parameters or takes_any:
            kwargs.setdefault(name, value)
    try:
        return factory(**kwargs)
    except TypeError as exc:
        raise ConfigError(
            f"calling {config.data.dataset} failed: {exc}", "data.dataset_args"
        ) from None
    except Exception as exc:  # the factory refused its arguments; --debug shows its traceback
        raise ConfigError(
            f"calling {config.data.dataset} failed ({type(exc).__name__}: {exc})",
            "data.dataset_args",
        ) from exc


def check_runtime(config: Any, world_size: int = 1) -> str:
    """Check that ``config`` would build: the model (on the meta device, so no weights are
    allocated), its data and eval data against the model's limits, a ``data.dataset`` factory's
    import path, ``parallel.fsdp.units``. Raises the same one-line errors ``train`` would;
    returns a short summary, with the per-rank state memory of ``ddp`` and ``fsdp`` on
    ``world_size`` ranks and the estimated time per step on this CPU
    (:func:`speedtronic.observe.step_estimate.estimate_config_step`)."""
    config = SpeedtronicConfig.load(config)
    with torch.device("meta"):
        model = build_model_from_hook(config.model.name, **config.model.params)
    memory = memory_report(model, config, world_size)
    limits = model_limits(model, config.model.params)
    parameters = sum(p.numel() for p in model.parameters())
    if config.data.dataset:
        import_factory(config.data.dataset, "data.dataset")
        data_text = f"dataset {config.data.dataset}"
    else:
        data_text = build_dataloader(config, **limits).description
    if config.eval.configured:
        from speedtronic.engine.eval import build_eval_source

        source = build_eval_source(config, **limits)
        data_text += f"; eval: {getattr(source, 'description', type(source).__name__)}"
    summary = f"model {config.model.name}: {parameters:,} parameters; data: {data_text}"
    return f"{summary}\n{memory}\n{estimate_config_step(config, model, world_size)}"


def memory_report(model: nn.Module, config: SpeedtronicConfig, world_size: int) -> str:
    """Estimated bytes per rank of parameters, gradients and optimizer state (AdamW's two
    moments per parameter) under ``ddp`` and under ``fsdp`` on ``world_size`` ranks."""
    from speedtronic.parallel.fsdp import find_units, state_bytes_per_rank

    units = find_units(model, config.parallel.fsdp.units)
    parts = []
    for strategy in ("ddp", "fsdp"):
        estimate = state_bytes_per_rank(model, world_size, strategy, units=units)
        text = (
            f"{strategy} {_gib(estimate.total)} (params {_gib(estimate.params)}, grads "
            f"{_gib(estimate.grads)}, optimizer {_gib(estimate.optimizer)})"
        )
        if estimate.gathered:
            text += f" + {_gib(estimate.gathered)} gathered while a unit runs"
        parts.append(text)
    ranks = f"{world_size} rank{'s' if world_size > 1 else ''}"
    return f"state per rank on {ranks} (estimate): " + "; ".join(parts)


def _gib(count: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift:
            return f"{count / (1 << shift):.2f} {unit}"
    return f"{count} B"


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
    check_before_building(
        config, own_data=dataset is not None, own_eval_data=eval_dataset is not None
    )
    apply_threads(config.run.threads)  # a process setting: before any work
    pm = get_plugin_manager()
    parallel = init_parallel(config.parallel, config.run.device)
    if not parallel.is_main:  # rank 0 speaks for the run; the others only warn
        level = max(logging.WARNING, logging.getLevelName(config.logging.level))
        logging.getLogger("speedtronic").setLevel(level)
    seed_everything(config.run.seed)
    # Tile-size advice is for CUDA: where the model will not run on one, it stays quiet.
    on_gpu = config.run.device in ("auto", "cuda") and torch.cuda.is_available()
    device = parallel.device or ("cuda" if on_gpu else config.run.device.replace("auto", "cpu"))
    if model is None:
        model = build_model_from_hook(config.model.name, **config.model.params)
        warn_shape_advice(model, config.model.params, device)
    else:
        warn_shape_advice(model, device=device)
    seed = config.data_seed
    adjusted = pm.hook.data_seed(config=config, seed=seed)
    rank, num_ranks = data_rank(config, parallel)
    if dataset is None and config.data.dataset:
        dataset = dataset_from_config(config, rank, num_ranks)
    data = build_dataloader(
        config,
        dataset,
        tokenizer,
        **model_limits(model, config.model.params),
        seed=seed,
        rank=rank,
        num_ranks=num_ranks,
        participant_seed=adjusted,
    )
    log.info("data: %s; split: %s", data.description, data.split or "not split")
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
    parallel = runtime.trainer.parallel
    try:
        return runtime.trainer.fit()
    finally:
        # The DDP wrapper (its reducer) holds the process group: free the run first, so the
        # group's threads end inside destroy_process_group rather than at interpreter exit,
        # where gloo aborted the process ("terminate called", about 1 run in 15).
        del runtime
        gc.collect()
        parallel.close()
