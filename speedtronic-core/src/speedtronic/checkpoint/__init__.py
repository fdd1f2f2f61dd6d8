"""Checkpoints: the manager (atomic, verified, retained), the JSON+safetensors state codec,
durable file writes, and the process RNG state they carry.

Names are imported on first use: :mod:`speedtronic.checkpoint.fileio` (durable writes) needs no
torch, so ``speedtronic data prepare`` can use it without paying for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from speedtronic._lazy import lazy_exports

if TYPE_CHECKING:
    from speedtronic.checkpoint.manager import (
        CheckpointManager,
        LoadedCheckpoint,
        checkpoint_name,
        step_of,
    )
    from speedtronic.checkpoint.policy import SavedCheckpoint, SavePolicy
    from speedtronic.checkpoint.reader import (
        BEST_POINTER,
        FORMAT_VERSION,
        MANIFEST,
        POINTER,
        STATE,
        TENSORS,
    )
    from speedtronic.checkpoint.rng import rng_state, set_rng_state

__all__ = [
    "BEST_POINTER",
    "FORMAT_VERSION",
    "MANIFEST",
    "POINTER",
    "STATE",
    "TENSORS",
    "CheckpointManager",
    "LoadedCheckpoint",
    "SavePolicy",
    "SavedCheckpoint",
    "checkpoint_name",
    "rng_state",
    "set_rng_state",
    "step_of",
]

_MODULE_OF: dict[str, str] = {name: "manager" for name in __all__} | {
    **dict.fromkeys(
        ("BEST_POINTER", "FORMAT_VERSION", "MANIFEST", "POINTER", "STATE", "TENSORS"), "reader"
    ),
    "rng_state": "rng",
    "set_rng_state": "rng",
    "SavePolicy": "policy",
    "SavedCheckpoint": "policy",
}

__getattr__, __dir__ = lazy_exports(
    __name__, {name: (module, name) for name, module in _MODULE_OF.items()}, __all__
)
