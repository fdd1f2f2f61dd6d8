"""Sharded checkpoints: ``torch.distributed.checkpoint`` (DCP) directories, readable on any
world size.

What ``parallel.strategy: fsdp`` writes::

    step_00000100/
        dcp/                  DCP: .metadata and one __R_0.distcp per rank (its shards of the
                              model and of the optimizer's per-parameter tensors)
        tensors.safetensors   the small tensors of everything else (RNG states, plugin state)
        state.json            counters, scheduler, optimizer hyperparameters, per-rank RNG,
                              plugin state, with references into tensors.safetensors
        manifest.json         size and sha256 (per 32 MiB slice) of every file above

Every rank writes its own shards into a hidden staging directory that rank 0 created; rank 0
then writes the rest, hashes every file, fsyncs, renames the directory into place and only then
moves ``latest.json``: like a single-file checkpoint, a DCP checkpoint is complete or invisible.

Reading needs no conversion step: DCP reshards while it loads, so a checkpoint of 2 ranks loads
into 1 process, into 4 ranks, into a DDP or a single-process run
(:func:`load_sharded_weights`), and ``speedtronic export``/``eval``/``generate`` get the whole
state on the CPU (:func:`read_sharded_state` with ``weights=True``). Only tensors go through
DCP; its ``.metadata`` file (a pickle, torch's format) is read after the manifest check and
with an unpickler that admits only DCP's own metadata classes.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from speedtronic.checkpoint import statecodec
from speedtronic.checkpoint.fileio import free_space, fsync_dir, fsync_file, manifest_entry
from speedtronic.checkpoint.names import (
    FORMAT_VERSION,
    HASH_CHUNK_BYTES,
    MANIFEST,
    STATE,
    TENSORS,
    checkpoint_name,
)
from speedtronic.checkpoint.writer import CheckpointWriter, SaveTarget
from speedtronic.errors import CheckpointError

__all__ = [
    "DCP_DIR",
    "ShardedWriter",
    "is_sharded_checkpoint",
    "load_sharded_weights",
    "read_sharded_state",
    "save_sharded_checkpoint",
    "sharded_model_shapes",
]

log = logging.getLogger("speedtronic.checkpoint")

DCP_DIR = "dcp"

# The globals a DCP .metadata pickle refers to (torch 2.x): its own dataclasses, tensor sizes,
# dtypes and layouts, the path of the storage. Anything else is refused.
_METADATA_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint._extension",
)
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


def is_sharded_checkpoint(path: Path) -> bool:
    """True for a checkpoint directory written by :func:`save_sharded_checkpoint`."""
    return (path / DCP_DIR).is_dir()


# ---------------------------------------------------------------------- writing
class ShardedWriter(CheckpointWriter):
    """The ``writer`` of a :class:`~speedtronic.checkpoint.CheckpointManager` whose run
    shards ``model`` and ``optimizer`` (``parallel.strategy: fsdp``): each of the manager's
    saves (``save_now``, ``maybe_save``) becomes a :func:`save_sharded_checkpoint` on every
    rank; with ``checkpoint.async_save`` the manager calls :meth:`start` instead and runs the
    write it returns in a background thread."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self._background: Any = None  # the collectives of background saves, made at the first

    per_rank = True

    def save(self, manager: SaveTarget, step: int, state: dict[str, Any]) -> Path:
        return save_sharded_checkpoint(manager, step, state, self.model, self.optimizer)

    def start(self, manager: SaveTarget, step: int, state: dict[str, Any]) -> Callable[[], Path]:
        """Every rank, at the save step: copy this rank's shards (and, on rank 0, the rest of
        the state) to CPU memory, the only part the step waits for; returns the write to run
        in a background thread (every rank runs its own): the same collective save, commit
        and retry as :func:`save_sharded_checkpoint`, over a process group of its own."""
        from speedtronic.checkpoint.dcp_async import background_collectives, stage

        if self._background is None:
            self._background = background_collectives(manager.parallel)
        collectives = self._background
        tensors, rest = _split_weights(self.model, self.optimizer)
        staged = stage(tensors)
        encoded = _encode(step, {**state, **rest}, copy=True) if collectives.is_main else None

        def write() -> Path:
            return _retrying(
                manager, lambda: _save_once(manager, step, encoded, staged, collectives)
            )

        return write


def save_sharded_checkpoint(
    manager: SaveTarget,
    step: int,
    state: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> Path:
    """Write ``state`` (a trainer state: its ``model`` and ``optimizer`` entries are replaced
    by ``model``'s and ``optimizer``'s shards) as the DCP checkpoint of ``step`` in
    ``manager``'s directory, among ``manager.parallel``'s ranks; every rank calls this. A failed
    attempt is retried once after the policy's ``retry_pause``; a second failure raises
    :class:`CheckpointError` on every rank, the previous checkpoint intact."""
    parallel = manager.parallel
    tensors, rest = _split_weights(model, optimizer)
    encoded = _encode(step, {**state, **rest}) if parallel.is_main else None
    return _retrying(manager, lambda: _save_once(manager, step, encoded, tensors, parallel))


def _retrying(manager: SaveTarget, attempt: Callable[[], Path]) -> Path:
    try:
        return attempt()
    except CheckpointError as exc:
        pause = manager.policy.retry_pause
        log.warning("%s; retrying once in %.0f s", exc, pause)
        time.sleep(pause)
        return attempt()


def _encode(step: int, state: dict[str, Any], copy: bool = False) -> tuple[str, dict] | str:
    """The state.json text and the small tensors of ``state`` (``copy``: a snapshot that
    training may go on changing), or why it cannot be encoded: a message every rank raises
    in :func:`_save_once`, as it cannot be raised on rank 0 alone before a collective."""
    try:
        json_tree, small = statecodec.encode(state, copy=copy)
        text = json.dumps(json_tree, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        return f"cannot serialise the state for checkpoint {checkpoint_name(step)}: {exc}"
    return text, small


def _save_once(
    manager: SaveTarget,
    step: int,
    encoded: tuple[str, dict] | str | None,
    tensors: dict[str, Any],
    parallel: Any,
) -> Path:
    """One attempt by every rank of ``parallel`` (the run's ParallelContext, or the background
    saves' own over their ``group``, which DCP then uses too); ``encoded`` is rank 0's."""
    import torch.distributed.checkpoint as dcp

    name = checkpoint_name(step)
    staging_text, problem = None, encoded if isinstance(encoded, str) else None
    if parallel.is_main and problem is None:
        try:
            manager.directory.mkdir(parents=True, exist_ok=True)
            staging_text = tempfile.mkdtemp(
                prefix=f".{name}.", suffix=".tmp", dir=manager.directory
            )
        except OSError as exc:
            problem = _failure(manager, name, exc)
    staging_text, problem = parallel.broadcast((staging_text, problem))
    if problem:
        raise CheckpointError(problem)
    staging = Path(staging_text)
    error = None
    try:
        writer = dcp.FileSystemWriter(staging / DCP_DIR, single_file_per_rank=True)
        dcp.save(tensors, storage_writer=writer, process_group=parallel.group)
    except Exception as exc:  # a full disk on any rank fails DCP's collective save everywhere
        error = _failure(manager, name, exc)
    errors = [e for e in parallel.gather(error) if e]
    problem = errors[0] if errors else None
    final = manager.directory / name
    if parallel.is_main:
        if problem is None:
            assert isinstance(encoded, tuple)
            try:
                _finish(manager, staging, final, step, encoded)
            except Exception as exc:
                problem = _failure(manager, name, exc)
        if problem is not None:
            shutil.rmtree(staging, ignore_errors=True)
    problem = parallel.broadcast(problem)
    if problem:
        raise CheckpointError(problem)
    if parallel.is_main:
        manager.storage.apply_retention(step)
    parallel.barrier()  # no rank reads the directory before retention is done
    return final


def _failure(manager: SaveTarget, name: str, exc: BaseException) -> str:
    return (
        f"could not write checkpoint {name} in {manager.directory}: "
        f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''} "
        f"({free_space(manager.directory)})"
    )


def _split_weights(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(what DCP writes: the model's and the optimizer's per-parameter tensors, sharded; what
    state.json keeps: optimizer hyperparameters and any non-tensor per-parameter value)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    per_param: dict[str, dict[str, Any]] = {}
    other: dict[str, dict[str, Any]] = {}
    for fqn, values in optim_state.get("state", {}).items():
        for key, value in values.items():
            target = per_param if isinstance(value, torch.Tensor) else other
            target.setdefault(fqn, {})[key] = value
    tensors = {"model": dict(model_state), "optimizer": per_param}
    rest = {
        "model": {},
        "optimizer": {"param_groups": optim_state.get("param_groups", []), "state": other},
    }
    return tensors, rest


def _finish(
    manager: SaveTarget,
    staging: Path,
    final: Path,
    step: int,
    encoded: tuple[str, dict],
) -> None:
    """Rank 0, after every rank's shards are in ``staging``: the rest of the state (encoded
    by :func:`_encode`), the manifest over every file, the rename into place, then
    ``latest.json``."""
    text, small = encoded
    save_file(small, str(staging / TENSORS), metadata={"format": str(FORMAT_VERSION)})
    (staging / STATE).write_text(text, encoding="utf-8")
    shard_files = sorted(f.name for f in (staging / DCP_DIR).iterdir() if f.is_file())
    names = [TENSORS, STATE, *(f"{DCP_DIR}/{name}" for name in shard_files)]
    for filename in names:
        fsync_file(staging / filename)
    fsync_dir(staging / DCP_DIR)
    files = {filename: manifest_entry(staging / filename, HASH_CHUNK_BYTES) for filename in names}
    manifest = {"format": FORMAT_VERSION, "step": step, "layout": "dcp", "files": files}
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    fsync_file(staging / MANIFEST)
    fsync_dir(staging)
    manager.storage.move_into_place(staging, final)
    manager.storage.point_latest(step)


# ---------------------------------------------------------------------- reading
class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = module in _METADATA_MODULES or (module, name) in _METADATA_GLOBALS
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not DCP metadata")
        return super().find_class(module, name)


def _reader(directory: Path) -> Any:
    import torch.distributed.checkpoint as dcp

    class Reader(dcp.FileSystemReader):
        """DCP's file reader, with the metadata read by the restricted unpickler."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            raw = (Path(self.path) / ".metadata").read_bytes()
            metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(str(directory))


def read_sharded_state(path: Path, weights: bool = True) -> dict[str, Any]:
    """The trainer state of the DCP checkpoint ``path`` (verify it first). With ``weights``
    the model and optimizer tensors are read whole onto the CPU (in one process, without a
    process group); without, ``model`` is ``{}`` and the optimizer holds its hyperparameters
    only (:func:`load_sharded_weights` fills them in)."""
    tensors = load_file(str(path / TENSORS))
    state = statecodec.decode(json.loads((path / STATE).read_text(encoding="utf-8")), tensors)
    if not isinstance(state, dict) or not isinstance(state.get("optimizer"), dict):
        raise CheckpointError("the trainer state has no 'optimizer' mapping")
    if not weights:
        return state
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = _reader(path / DCP_DIR)
    metadata = reader.read_metadata()
    template: dict[str, Any] = {"model": {}, "optimizer": {}}
    for key, entry in metadata.state_dict_metadata.items():
        where = (metadata.planner_data or {}).get(key)
        if not isinstance(entry, TensorStorageMetadata) or not where or len(where) < 2:
            raise CheckpointError(f"{DCP_DIR}: unexpected entry {key!r:.80}")
        node = template
        for part in where[:-1]:
            node = node.setdefault(str(part), {})
        node[str(where[-1])] = torch.empty(entry.size, dtype=entry.properties.dtype)
    dcp.load(template, storage_reader=reader, no_dist=True)
    state["model"] = template["model"]
    state["optimizer"] = _merged_optimizer(state["optimizer"], template["optimizer"])
    return state


def _merged_optimizer(saved: dict[str, Any], per_param: dict[str, Any]) -> dict[str, Any]:
    merged: dict[str, dict[str, Any]] = {}
    for source in (saved.get("state") or {}, per_param):
        for fqn, values in source.items():
            merged.setdefault(fqn, {}).update(values)
    return {"state": merged, "param_groups": saved.get("param_groups", [])}


def sharded_model_shapes(directory: Path) -> dict[str, torch.Tensor]:
    """The model tensors a DCP directory holds, by state-dict key, as meta tensors of their
    whole (unsharded) shapes: what a loader checks against its model before
    :func:`load_sharded_weights`."""
    metadata = _reader(directory).read_metadata()
    return {
        where[1]: torch.empty(entry.size, device="meta")
        for key, entry in metadata.state_dict_metadata.items()
        if (where := (metadata.planner_data or {}).get(key)) and where[0] == "model"
    }


def load_sharded_weights(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    saved_optimizer: dict[str, Any],
) -> None:
    """Load the model and optimizer shards of the DCP directory ``directory`` (a checkpoint's
    ``dcp/``) into ``model`` and ``optimizer``, resharding to however this run is laid out
    (FSDP on any number of ranks, DDP, one process). ``saved_optimizer`` is the checkpoint's
    optimizer entry from state.json (hyperparameters). Every rank calls it; check the shapes
    first (:func:`sharded_model_shapes`) for an error naming each tensor that differs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    reader = _reader(directory)
    model_state, optim_state = get_state_dict(model, optimizer)
    per_param: dict[str, dict[str, Any]] = {}
    for fqn, values in optim_state.get("state", {}).items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                per_param.setdefault(fqn, {})[key] = value
    tensors = {"model": dict(model_state), "optimizer": per_param}
    try:
        dcp.load(tensors, storage_reader=reader)
        restored = _merged_optimizer(saved_optimizer, tensors["optimizer"])
        set_state_dict(
            model,
            optimizer,
            model_state_dict=tensors["model"],
            optim_state_dict=restored,
        )
    except (RuntimeError, KeyError, ValueError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(
            f"the checkpoint's model/optimizer shards do not fit this run (was model.* or "
            f"optimizer.* changed?): {first[:300]}"
        ) from exc
