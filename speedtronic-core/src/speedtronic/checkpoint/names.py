"""Checkpoint directory names (``step_NNNNNNNN``), readable without torch: the CLI checks a
run's output directory before it imports torch."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = [
    "NAME_PATTERN",
    "checkpoint_name",
    "existing_checkpoints",
    "overwrite_refusal",
    "step_of",
]

NAME_PATTERN = re.compile(r"^step_(\d{8,18})$")


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
