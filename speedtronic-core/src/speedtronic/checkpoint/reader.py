"""Reading a run's checkpoints: the file names, the pointers (``latest.json``, ``best.json``),
verification against the manifest, and decoding with safetensors and JSON only (never pickle).
:class:`~speedtronic.checkpoint.manager.CheckpointManager` writes what this reads."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from speedtronic.checkpoint import statecodec
from speedtronic.checkpoint.fileio import read_regular, sha256_chunks
from speedtronic.checkpoint.names import (
    BEST_POINTER,
    FORMAT_VERSION,
    HASH_CHUNK_BYTES,
    MANIFEST,
    POINTER,
    STATE,
    TENSORS,
    existing_checkpoints,
    step_of,
)
from speedtronic.errors import CheckpointError

__all__ = [
    "BEST_POINTER",
    "FORMAT_VERSION",
    "HASH_CHUNK_BYTES",
    "MANIFEST",
    "POINTER",
    "STATE",
    "TENSORS",
    "CheckpointReader",
    "LoadedCheckpoint",
]

log = logging.getLogger("speedtronic.checkpoint")

# The files of a sharded (DCP) checkpoint's dcp/ folder that a manifest may list.
SHARD_FILE = re.compile(r"^dcp/(\.metadata|__\d{1,6}_\d{1,6}\.distcp)$")
# A pointer is one short JSON line; anything larger is not one.
MAX_POINTER_BYTES = 64 << 10
# A manifest lists one sha256 per 32 MiB slice: 16 MiB of them describe terabytes.
MAX_MANIFEST_BYTES = 16 << 20
# What a damaged or hostile manifest raises while it is read: OverflowError for a number such as
# 1e400 (JSON's infinity) where an integer belongs, RecursionError for arrays nested deep.
_MANIFEST_PROBLEMS = (
    OSError,
    ValueError,
    KeyError,
    TypeError,
    AttributeError,
    OverflowError,
    RecursionError,
)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A verified checkpoint: its directory, step and decoded state tree."""

    path: Path
    step: int
    state: Any
    shards: Path | None = None
    """A sharded (DCP) checkpoint read without its weights: the ``dcp/`` directory that
    :func:`speedtronic.checkpoint.dcp.load_sharded_weights` loads them from."""


class CheckpointReader:
    """Finds, verifies and decodes the checkpoints in ``directory`` (read only)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def candidates(self) -> list[Path]:
        """Checkpoint directories by name, newest first, complete or not (no symlinks)."""
        return existing_checkpoints(self.directory)

    def pointer_target(self, pointer_name: str = POINTER) -> Path | None:
        """The checkpoint directory a pointer file (``latest.json`` by default, or
        ``best.json``) names, or None if there is no usable pointer.

        The name must match ``step_NNNNNNNN`` exactly, so it can never lead outside the
        directory; a pointer that fails that check is reported and ignored.
        """
        pointer = self.directory / pointer_name
        try:
            raw = read_regular(pointer, MAX_POINTER_BYTES)  # a FIFO there must not hang us
            if len(raw) > MAX_POINTER_BYTES:
                raise ValueError(f"larger than {MAX_POINTER_BYTES} bytes")
            data = json.loads(raw.decode("utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RecursionError) as exc:  # RecursionError: deep nesting
            log.warning(
                "checkpoint pointer %s is unreadable (%s); looking for checkpoints in %s",
                pointer,
                exc,
                self.directory,
            )
            return None
        name = data.get("checkpoint") if isinstance(data, dict) else None
        if not isinstance(name, str) or step_of(name) is None:
            log.warning(
                "checkpoint pointer %s names %r, which is not a checkpoint name "
                "(step_NNNNNNNN); ignoring it",
                pointer,
                name,
            )
            return None
        return self.directory / name

    def verify(self, path: Path) -> int:
        """Check ``path`` against its manifest; returns its step or raises CheckpointError."""
        step = step_of(path.name)
        if step is None:
            raise CheckpointError(f"{path.name} is not a checkpoint name (step_NNNNNNNN)")
        if path.is_symlink() or not path.is_dir():
            raise CheckpointError(f"{path.name} is missing or not a directory")
        try:
            raw = read_regular(path / MANIFEST, MAX_MANIFEST_BYTES)
            if len(raw) > MAX_MANIFEST_BYTES:
                raise ValueError(f"larger than {MAX_MANIFEST_BYTES >> 20} MiB")
            manifest = json.loads(raw.decode("utf-8"))
            files = manifest["files"]
            manifest_step = int(manifest["step"])
            expected_files = {
                name: (int(f["size"]), int(f["chunk_bytes"]), [str(h) for h in f["sha256"]])
                for name, f in files.items()
            }
        except FileNotFoundError:
            raise CheckpointError(f"{path.name}: no manifest (incomplete checkpoint)") from None
        except _MANIFEST_PROBLEMS as exc:
            raise CheckpointError(f"{path.name}: unreadable manifest ({exc})") from None
        if manifest_step != step:
            raise CheckpointError(f"{path.name}: manifest is for step {manifest_step}")
        shard_files = set(expected_files) - {TENSORS, STATE}
        if not {TENSORS, STATE} <= set(expected_files) or not _valid_shard_set(shard_files):
            raise CheckpointError(
                f"{path.name}: manifest lists unexpected files {sorted(expected_files)[:8]}"
            )
        if shard_files and (path / "dcp").is_symlink():
            raise CheckpointError(f"{path.name}/dcp is a symlink")
        for filename, (size, chunk_bytes, digests) in expected_files.items():
            file = path / filename
            if file.is_symlink() or not file.is_file():
                raise CheckpointError(f"{path.name}/{filename} is missing")
            actual = file.stat().st_size
            if actual != size:
                raise CheckpointError(
                    f"{path.name}/{filename} has {actual} bytes, manifest says {size} (truncated?)"
                )
            slices = max(1, -(-size // chunk_bytes)) if chunk_bytes >= 1 << 20 else -1
            if len(digests) != slices or sha256_chunks(file, chunk_bytes) != digests:
                raise CheckpointError(f"{path.name}/{filename} fails its sha256 check")
        return step

    def read(
        self, path: Path, check: Callable[[Any], None] | None = None, *, weights: bool = True
    ) -> LoadedCheckpoint:
        """Verify and decode one checkpoint directory (safetensors and JSON, never pickle).

        ``check(state)`` may raise :class:`CheckpointError` for a state that decodes but is not
        what its reader needs (a tampered file with a consistent manifest). A sharded (DCP)
        checkpoint is read whole onto the CPU; with ``weights=False`` its model and optimizer
        tensors are left where they are and ``shards`` names them."""
        step = self.verify(path)
        shards = None
        try:
            from speedtronic.checkpoint import dcp

            if dcp.is_sharded_checkpoint(path):
                state = dcp.read_sharded_state(path, weights)
                shards = None if weights else path / dcp.DCP_DIR
            else:
                tensors = load_file(str(path / TENSORS))
                json_tree = json.loads((path / STATE).read_text(encoding="utf-8"))
                state = statecodec.decode(json_tree, tensors)
        except Exception as exc:
            raise CheckpointError(
                f"{path.name}: cannot decode ({type(exc).__name__}: {exc})"
            ) from None
        if check is not None:
            try:
                check(state)
            except CheckpointError as exc:
                raise CheckpointError(f"{path.name}: {exc}") from None
        return LoadedCheckpoint(path=path, step=step, state=state, shards=shards)

    def load(
        self, which: str = "latest", check: Callable[[Any], None] | None = None
    ) -> LoadedCheckpoint:
        """``which``: ``latest`` (the newest usable checkpoint), ``best`` (the one ``best.json``
        names) or the path of a checkpoint directory. Raises :class:`CheckpointError` naming
        what is missing or unusable."""
        if which == "latest":
            loaded = self.load_latest(check)
            if loaded is None:
                raise CheckpointError(f"no checkpoint in {self.directory}")
            return loaded
        if which == "best":
            target = self.pointer_target(BEST_POINTER)
            if target is None and os.path.lexists(self.directory / BEST_POINTER):
                raise CheckpointError(
                    f"no best checkpoint in {self.directory}: {BEST_POINTER} is unusable (the "
                    "warning above says why); give --checkpoint latest or a step_NNNNNNNN "
                    "directory"
                )
            if target is None:
                raise CheckpointError(
                    f"no best checkpoint in {self.directory} ({BEST_POINTER} is missing: the run "
                    "needs checkpoint.keep_best and an eval section)"
                )
            return self.read(target, check)
        path = Path(which)
        if step_of(path.name) is None:
            raise CheckpointError(f"{which} is not a checkpoint directory (step_NNNNNNNN)")
        try:
            return CheckpointReader(path.parent).read(path, check)
        except CheckpointError as exc:
            raise CheckpointError(f"checkpoint {path.parent}/{exc}") from None

    def load_latest(
        self, check: Callable[[Any], None] | None = None, *, weights: bool = True
    ) -> LoadedCheckpoint | None:
        """The newest usable checkpoint, or None when the directory holds none at all.

        ``latest.json``'s target is tried first, then the checkpoints older than it, newest
        first (every checkpoint when there is no usable pointer); each one that is missing or
        fails verification is named in a warning. If checkpoints exist but none is usable,
        raises :class:`CheckpointError` rather than letting the caller start over silently.
        ``weights`` as in :meth:`read`.
        """
        target = self.pointer_target()
        candidates = self.candidates()
        if target is None:
            order = candidates
        else:
            limit = step_of(target.name) or 0
            order = [target, *(p for p in candidates if (step_of(p.name) or 0) < limit)]
        if not order:
            return None
        failures = []
        for path in order:
            try:
                return self.read(path, check, weights=weights)
            except CheckpointError as exc:
                log.warning("skipping unusable checkpoint %s: %s", path, exc)
                failures.append(str(exc))
        raise CheckpointError(
            f"no usable checkpoint in {self.directory} ({'; '.join(failures)}); "
            "set checkpoint.allow_fresh_start: true to start over"
        )


def _valid_shard_set(names: set[str]) -> bool:
    """A sharded checkpoint's manifest lists DCP's metadata and shard files, nothing else."""
    if not names:
        return True
    return all(SHARD_FILE.match(n) for n in names) and "dcp/.metadata" in names
