"""Checkpoints: the manager (atomic, verified, retained), the JSON+safetensors state codec,
durable file writes, and the process RNG state they carry."""

from __future__ import annotations

from speedtronic.checkpoint.manager import (
    BEST_POINTER,
    FORMAT_VERSION,
    MANIFEST,
    POINTER,
    STATE,
    TENSORS,
    CheckpointManager,
    LoadedCheckpoint,
    checkpoint_name,
    step_of,
)
from speedtronic.checkpoint.policy import SavedCheckpoint, SavePolicy
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
