"""The sections of a run's config that core owns (``run``, ``data``, ``optimizer``, ...), each a
dataclass whose fields carry their default, bounds and the help text the config reference is
generated from. Each lives next to the code it configures (``speedtronic/<family>/config.py``);
this module gathers them, and :class:`speedtronic.config.SpeedtronicConfig` puts them together."""

from __future__ import annotations

from speedtronic.checkpoint.config import CheckpointConfig
from speedtronic.data.config import DataConfig
from speedtronic.engine.config import (
    CompileConfig,
    EvalConfig,
    ModelConfig,
    OOOBackpropConfig,
    PrecisionConfig,
    RunConfig,
)
from speedtronic.observe.config import LoggingConfig, ProfileConfig
from speedtronic.optim.config import MuonConfig, OptimizerConfig, SchedulerConfig
from speedtronic.parallel.config import FSDPConfig, ParallelConfig

__all__ = [
    "CheckpointConfig",
    "CompileConfig",
    "DataConfig",
    "EvalConfig",
    "FSDPConfig",
    "LoggingConfig",
    "ModelConfig",
    "MuonConfig",
    "OOOBackpropConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "ProfileConfig",
    "RunConfig",
    "SchedulerConfig",
]
