"""The durable half of checkpoints: write, point at, retain and mark the checkpoints of one
directory, with no notion of a run's policy or ranks (:class:`CheckpointManager` decides when
and on which rank; :class:`~speedtronic.checkpoint.dcp.ShardedWriter` reuses the renames and
retention).

A checkpoint is assembled in a hidden staging directory (``.step_00000100.<random>.tmp``),
every file is fsynced, the staging directory is renamed into place and the parent directory
fsynced; only then is ``latest.json`` atomically replaced, and only after that pointer is
durable are older checkpoints removed.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from speedtronic.checkpoint import statecodec
from speedtronic.checkpoint.fileio import (
    atomic_write_text,
    free_space,
    fsync_dir,
    fsync_file,
    manifest_entry,
    probe_writable,
)
from speedtronic.checkpoint.names import checkpoint_name, step_of
from speedtronic.checkpoint.reader import (
    BEST_POINTER,
    FORMAT_VERSION,
    HASH_CHUNK_BYTES,
    MANIFEST,
    POINTER,
    STATE,
    TENSORS,
    CheckpointReader,
)
from speedtronic.errors import CheckpointError

__all__ = ["CheckpointStorage"]

log = logging.getLogger("speedtronic.checkpoint")

# Anything in the directory starting with this is ours and unreferenced: staging directories
# of interrupted saves, parked copies of a re-saved step, checkpoints being deleted.
_HIDDEN_PREFIX = ".step_"


class CheckpointStorage(CheckpointReader):
    """Reads (as its base) and durably writes the checkpoints in ``directory``, keeping the
    newest ``keep_last`` (and the best one)."""

    def __init__(self, directory: str | os.PathLike[str], keep_last: int = 3) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        super().__init__(directory)
        self.keep_last = keep_last

    def save(self, step: int, state: Any) -> Path:
        """Durably write ``state`` as the checkpoint of ``step``, point ``latest.json`` at it,
        then apply retention. Raises :class:`CheckpointError`; on failure the previous
        checkpoint stays the latest one. This is the storage step alone: when to save, retries
        and ranks are :meth:`CheckpointManager.maybe_save`'s business."""
        return self.write_encoded(step, *self.encode(step, state))

    def encode(self, step: int, state: Any, copy: bool = False) -> tuple[str, dict[str, Any]]:
        try:
            json_tree, tensors = statecodec.encode(state, copy=copy)
            text = json.dumps(json_tree, allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise CheckpointError(
                f"cannot serialise the state for checkpoint {checkpoint_name(step)}: {exc}"
            ) from exc
        return text, tensors

    def write_encoded(self, step: int, text: str, tensors: dict[str, Any]) -> Path:
        """Write an encoded state (:meth:`encode`) as the checkpoint of ``step``, move
        ``latest.json`` to it and apply retention (the durable half of :meth:`save`)."""
        name = checkpoint_name(step)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            final = self._write_staged(name, step, state_json=text, tensors=tensors)
            self.point_latest(step)
        except Exception as exc:  # OSError, or safetensors' own error for a full disk
            raise CheckpointError(
                f"could not write checkpoint {name} in {self.directory}: "
                f"{type(exc).__name__}: {exc} ({free_space(self.directory)})"
            ) from None
        self.apply_retention(step)
        log.debug("checkpoint %s written", final)
        return final

    def _write_staged(
        self, name: str, step: int, *, state_json: str, tensors: dict[str, Any]
    ) -> Path:
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=self.directory))
        try:
            save_file(tensors, str(staging / TENSORS), metadata={"format": str(FORMAT_VERSION)})
            (staging / STATE).write_text(state_json, encoding="utf-8")
            # Hash (from the page cache) while the kernel flushes the same files to disk.
            with ThreadPoolExecutor(1, thread_name_prefix="fsync") as flusher:
                flushed = [flusher.submit(fsync_file, staging / f) for f in (TENSORS, STATE)]
                files = {f: manifest_entry(staging / f, HASH_CHUNK_BYTES) for f in (TENSORS, STATE)}
                for future in flushed:
                    future.result()
            manifest = {"format": FORMAT_VERSION, "step": step, "files": files}
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
            fsync_file(staging / MANIFEST)
            fsync_dir(staging)
            final = self.directory / name
            self.move_into_place(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        # Cheap last check before the pointer moves: the files in place are the ones hashed.
        for filename, expected in files.items():
            size = (final / filename).stat().st_size
            if size != expected["size"]:
                raise OSError(
                    f"{final / filename} has {size} bytes after the rename, "
                    f"expected {expected['size']}"
                )
        return final

    def point_latest(self, step: int) -> None:
        """Atomically point ``latest.json`` at the checkpoint of ``step`` (already in place)."""
        name = checkpoint_name(step)
        atomic_write_text(
            self.directory / POINTER,
            json.dumps({"checkpoint": name, "step": step, "format": FORMAT_VERSION}) + "\n",
        )

    def move_into_place(self, staging: Path, final: Path) -> None:
        """Rename a fully written, fsynced ``staging`` directory to ``final`` (replacing a
        checkpoint of the same step) and fsync the directory."""
        if final.exists():
            # Re-saving a step, normally after resuming from an older checkpoint, so latest.json
            # names that older one and a crash between the two renames is harmless. (Should it
            # name this very step, saved twice, such a crash makes the next resume fall back
            # to the next older checkpoint, with a warning.)
            parked = self.directory / f"{_HIDDEN_PREFIX}{final.name[5:]}.old"
            shutil.rmtree(parked, ignore_errors=True)
            os.replace(final, parked)
            os.replace(staging, final)
            fsync_dir(self.directory)
            shutil.rmtree(parked, ignore_errors=True)
        else:
            os.replace(staging, final)
            fsync_dir(self.directory)

    def apply_retention(self, step: int) -> None:
        """Delete the checkpoints older than ``step`` past ``keep_last`` (never the best one)."""
        # Only checkpoints older than the new one count: a higher-numbered directory is either
        # one that failed verification on resume (it is replaced when the run gets there) or
        # one from an earlier run in the same directory, which is not ours to delete.
        best = self.pointer_target(BEST_POINTER)
        older = [p for p in self.candidates() if (step_of(p.name) or 0) < step and p != best]
        for path in older[self.keep_last - 1 :]:
            # Hide first (atomic), then delete: a crash mid-delete never leaves a visible,
            # half-deleted checkpoint that a later resume would have to skip.
            doomed = self.directory / f"{_HIDDEN_PREFIX}{path.name[5:]}.deleting"
            try:
                shutil.rmtree(doomed, ignore_errors=True)
                os.replace(path, doomed)
            except OSError as exc:
                log.warning("could not remove old checkpoint %s: %s", path, exc)
                continue
            log.debug("retention: removing %s", path.name)
        # No fsync here: if a crash undoes the hiding rename, an old complete checkpoint
        # simply reappears and is removed by the next save.
        for stale in self.directory.glob(f"{_HIDDEN_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        # A kill during an earlier pointer update can leave its temp file behind; the pointer
        # just written is durable, so any such file is garbage.
        for stale in self.directory.glob(f".{POINTER}.*.tmp"):
            stale.unlink(missing_ok=True)

    def check_writable(self, best: bool = False) -> None:
        """Prove, before a run trains, that its saves can write every path they will: the
        directory (a probe file is created, fsynced, renamed and removed), ``latest.json``
        (and ``best.json`` with ``best``), which a save replaces by a rename that fails if a
        directory stands there, and the ``step_NNNNNNNN`` names, where a dangling symlink
        makes the rename of a new checkpoint fail. Raises ``OSError`` naming the path."""
        probe_writable(self.directory)
        for name in (POINTER, BEST_POINTER) if best else (POINTER,):
            path = self.directory / name
            if path.is_dir() and not path.is_symlink():
                raise IsADirectoryError(
                    errno.EISDIR, "a directory stands where a save writes", str(path)
                )
        for path in self.directory.iterdir():
            if step_of(path.name) is not None and path.is_symlink() and not path.exists():
                raise FileExistsError(
                    errno.EEXIST, "a dangling symlink stands where a save writes", str(path)
                )

    def mark_best(self, step: int, eval_loss: float) -> None:
        """Point ``best.json`` at the (already written) checkpoint of ``step``."""
        name = checkpoint_name(step)
        if not (self.directory / name / MANIFEST).is_file():
            raise CheckpointError(f"cannot mark {name} as best: it is not a complete checkpoint")
        atomic_write_text(
            self.directory / BEST_POINTER,
            json.dumps({"checkpoint": name, "step": step, "eval_loss": eval_loss}) + "\n",
        )
