"""Checkpoint directory names (``step_NNNNNNNN``) and the names of the files in and beside
one, readable without torch: the CLI checks a run's output directory before it imports torch,
and both writers (:mod:`~speedtronic.checkpoint.manager`, :mod:`~speedtronic.checkpoint.dcp`)
lay checkpoints out by these names."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = [
    "BEST_POINTER",
    "FORMAT_VERSION",
    "HASH_CHUNK_BYTES",
    "MANIFEST",
    "NAME_PATTERN",
    "POINTER",
    "STATE",
    "TENSORS",
    "checkpoint_name",
    "existing_checkpoints",
    "overwrite_refusal",
    "step_of",
]

# 8 to 18 digits: every step an int64 holds, and never a number too long to convert.
NAME_PATTERN = re.compile(r"^step_(\d{8,18})$")
FORMAT_VERSION = 1
POINTER = "latest.json"
# Names the checkpoint with the lowest eval loss (checkpoint.keep_best); retention keeps it.
BEST_POINTER = "best.json"
TENSORS = "tensors.safetensors"
STATE = "state.json"
MANIFEST = "manifest.json"
# Files are hashed in slices of this size, in parallel, so big checkpoints verify quickly.
HASH_CHUNK_BYTES = 32 << 20


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint taken after optimizer step ``step``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step encoded in a checkpoint directory name, or None for any other name."""
    match = NAME_PATTERN.match(name)
    return int(match.group(1)) if match else None


def existing_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint directories in ``directory`` by name, newest first, complete or not (no
    symlinks)."""
    if not directory.is_dir():
        return []
    dirs = [
        p
        for p in directory.iterdir()
        if step_of(p.name) is not None and p.is_dir() and not p.is_symlink()
    ]
    return sorted(dirs, key=lambda p: step_of(p.name) or 0, reverse=True)


def overwrite_refusal(directory: Path, newest: Path) -> str:
    """Why a fresh run does not start in ``directory``, which holds checkpoints up to
    ``newest``, and what to do instead."""
    return (
        f"{directory} already holds checkpoints (up to {newest.name}) from an earlier run; "
        "pass --resume (checkpoint.resume: true) to continue it, or choose another "
        "--output-dir (run.output_dir) for a new run, or delete that directory to start over"
    )
