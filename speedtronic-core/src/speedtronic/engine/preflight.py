"""Errors the config and the file system decide alone, found before anything is built.

Building a model, its data and its optimizer can take a minute on a busy machine, and importing
torch several seconds; a run that will stop anyway because its output directory already holds
another run's checkpoints, or because a file it names is missing, should say so at once. The
checks here import no torch; the builders keep their own, more detailed checks (this module
only finds what is certain to fail).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from speedtronic.checkpoint.names import existing_checkpoints, overwrite_refusal
from speedtronic.config import SpeedtronicConfig
from speedtronic.data.format import INDEX_NAME, MAX_INDEX_BYTES, NO_EVAL_SPLIT_HINT
from speedtronic.errors import CheckpointError, DataError

__all__ = ["check_before_building"]


def check_before_building(
    config: SpeedtronicConfig,
    *,
    training: bool = True,
    own_data: bool = False,
    own_eval_data: bool = False,
) -> None:
    """Raise the one-line error a run of ``config`` would raise later, for what needs no
    model: a fresh training run into a directory holding checkpoints (``training``), a
    data or eval file or shard directory that does not exist, an eval split that a shard
    directory lacks. ``own_data``/``own_eval_data``: the caller brings that data itself, so
    the config's paths for it are not read."""
    if training:
        _check_fresh_output(config)
    data = config.data
    if not own_data and not data.dataset:
        if data.text_path:
            _check_file(data.text_path, "data.text_path")
        if data.shards:
            _check_shard_dir(data.shards, "data.shards")
    section = config.eval
    if own_eval_data or not (section.configured or not training):
        return
    if section.text_path:
        _check_file(section.text_path, "eval.text_path")
    elif section.shards or (data.shards and not own_data and not data.dataset):
        where = "eval.shards" if section.shards else "data.shards"
        directory = section.shards or data.shards
        assert directory is not None
        _check_eval_split(directory, where)


def _check_fresh_output(config: SpeedtronicConfig) -> None:
    section = config.checkpoint
    if section.resume or not (section.interval or section.save_final):
        return
    if os.environ.get("RANK", "0") != "0":
        return  # under DDP rank 0 decides for the run (the trainer broadcasts it)
    existing = existing_checkpoints(config.checkpoint_dir)
    if existing:
        raise CheckpointError(overwrite_refusal(config.checkpoint_dir, existing[0]))


def _check_file(path: str, where: str) -> None:
    file = Path(path).expanduser()
    if not file.exists():
        raise DataError(f"{where}: file not found: {path}")
    if file.is_dir():
        raise DataError(f"{where}: not a regular file: {path}")


def _check_shard_dir(directory: str, where: str) -> None:
    root = Path(directory).expanduser()
    if not root.exists():
        raise DataError(f"{where}: directory not found: {root}")
    if not root.is_dir():
        raise DataError(f"{where}: not a directory: {root}")
    if not (root / INDEX_NAME).exists():
        raise DataError(
            f"{where}: {root} has no {INDEX_NAME}: it is not a token-shard directory, or its "
            "`speedtronic data prepare` did not finish (run it again)"
        )


def _check_eval_split(directory: str, where: str) -> None:
    _check_shard_dir(directory, where)
    path = Path(directory).expanduser() / INDEX_NAME
    try:
        if not path.is_file() or path.stat().st_size > MAX_INDEX_BYTES:
            return  # the reader explains what is wrong with it
        index = json.loads(path.read_text(encoding="utf-8"))
        shards = index["splits"]["eval"]["shards"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return  # a damaged index: the reader says how
    if isinstance(shards, list) and not shards:
        raise DataError(
            f"{where}: {Path(directory).expanduser()} has no eval split ({NO_EVAL_SPLIT_HINT})"
        )
