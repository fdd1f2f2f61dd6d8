"""Speedtronic: a fast, honest PyTorch training loop with a plugin system.

Be fast, be efficient.
"""

from __future__ import annotations

from typing import Any

from speedtronic.config import SpeedtronicConfig
from speedtronic.engine.run import ConfigLike, TrainerLike
from speedtronic.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    PluginError,
    SpeedtronicError,
    TransportError,
)
from speedtronic.hookspecs import hookimpl
from speedtronic.registry import build_model_from_hook as build_model
from speedtronic.registry import register_model

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "ConfigLike",
    "DataError",
    "PluginError",
    "SpeedtronicConfig",
    "SpeedtronicError",
    "TrainerLike",
    "TransportError",
    "__version__",
    "build_model",
    "hookimpl",
    "register_model",
]

# Seed-era names that now live in speedtronic-diloco, resolved only when touched: public name
# -> name in speedtronic_diloco (`DumbDiLoCo` has always been an alias of the coordinator).
_DILOCO_NAMES = {
    "DumbDiLoCoCoordinator": "DumbDiLoCoCoordinator",
    "DumbDiLoCo": "DumbDiLoCoCoordinator",
    "SyncResult": "SyncResult",
}
# Heavier core names, imported on first use so `import speedtronic` stays light.
_CORE_LAZY = {
    "Trainer": "speedtronic.engine.trainer",
    "TrainResult": "speedtronic.engine.trainer",
    "MetricLogger": "speedtronic.observe.metrics",
    "train_from_config": "speedtronic.engine.runtime",
    "build_runtime": "speedtronic.engine.runtime",
    "TrainingParts": "speedtronic.engine.parts",
    "build_parts": "speedtronic.engine.parts",
}


def __getattr__(name: str) -> Any:
    if name in _DILOCO_NAMES:
        from speedtronic._lazy import import_plugin_attr

        return import_plugin_attr("speedtronic_diloco", _DILOCO_NAMES[name], "speedtronic-diloco")
    if name == "distributed":
        import importlib

        return importlib.import_module("speedtronic.distributed")
    if name in _CORE_LAZY:
        import importlib

        return getattr(importlib.import_module(_CORE_LAZY[name]), name)
    raise AttributeError(f"module 'speedtronic' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_CORE_LAZY, *_DILOCO_NAMES, "distributed"})
