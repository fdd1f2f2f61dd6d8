"""DumbDiLoCo for Speedtronic: asynchronous DiLoCo-style training through a shared store.

Nodes train locally for ``inner_steps`` optimizer steps, upload the pseudo-gradient to a store
(a shared directory or a Hugging Face Hub repository) and pick up the global weights that the
master's outer loop (mean of deltas, Nesterov SGD) publishes.

The torch-dependent names load on first use, so discovering the plugin stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from speedtronic_diloco.config import DistributedConfig

__version__ = "0.1.0"

_LAZY = {
    "DumbDiLoCoCoordinator": "speedtronic_diloco.coordinator",
    "DumbDiLoCo": "speedtronic_diloco.coordinator",
    "SyncResult": "speedtronic_diloco.coordinator",
    "MasterOuterLoop": "speedtronic_diloco.master.loop",
}

__all__ = [
    "DistributedConfig",
    "DumbDiLoCo",
    "DumbDiLoCoCoordinator",
    "MasterOuterLoop",
    "SyncResult",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'speedtronic_diloco' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
