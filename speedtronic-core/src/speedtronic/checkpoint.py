"""Local checkpoints that survive a crash at any instant, and loading without pickle.

Layout of ``checkpoint_dir``::

    step_00000100/
        tensors.safetensors   every tensor of the state (model, optimizer, RNG, plugins)
        state.json            everything else, with references into the tensor file
        manifest.json         size and sha256 of the two files above (written last)
    latest.json               {"checkpoint": "step_00000100", "step": 100, ...}

A checkpoint is first assembled in a hidden temporary directory, every file fsynced, then the
directory is renamed into place, and only then is ``latest.json`` atomically replaced. Old
checkpoints are deleted only after the new pointer is durable. On load, the newest checkpoint
that verifies against its manifest wins; a torn or tampered one is skipped with a warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from speedtronic import statecodec
from speedtronic.errors import CheckpointError
from speedtronic.fileio import atomic_write_text, fsync_dir, sha256_file

log = logging.getLogger("speedtronic.checkpoint")

FORMAT_VERSION = 1
POINTER = "latest.json"
TENSORS = "tensors.safetensors"
STATE = "state.json"
MANIFEST = "manifest.json"
NAME_PATTERN = re.compile(r"^step_(\d{8,})$")


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint taken after optimizer step ``step``."""
    return f"step_{step:08d}"


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A verified checkpoint: its directory, step and decoded state tree."""

    path: Path
    step: int
    state: dict[str, Any]


class CheckpointManager:
    """Writes, verifies, retains and loads the checkpoints of one run."""

    def __init__(self, directory: str | os.PathLike[str], keep_last: int = 3) -> None:
        self.directory = Path(directory)
        self.keep_last = keep_last

    # ------------------------------------------------------------------ writing
    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Durably write ``state`` as the checkpoint of ``step`` and point ``latest.json`` at it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        name = checkpoint_name(step)
        final = self.directory / name
        json_tree, tensors = statecodec.encode(state)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=self.directory))
        try:
            save_file(tensors, str(staging / TENSORS), metadata={"format": str(FORMAT_VERSION)})
            (staging / STATE).write_text(json.dumps(json_tree), encoding="utf-8")
            files = {}
            for filename in (TENSORS, STATE):
                _fsync_file(staging / filename)
                files[filename] = {
                    "size": (staging / filename).stat().st_size,
                    "sha256": sha256_file(staging / filename),
                }
            manifest = {"format": FORMAT_VERSION, "step": step, "files": files}
            atomic_write_text(staging / MANIFEST, json.dumps(manifest, indent=1))
            fsync_dir(staging)
            self._move_into_place(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        pointer = {"checkpoint": name, "step": step, "files": files}
        atomic_write_text(self.directory / POINTER, json.dumps(pointer, indent=1))
        self._apply_retention(keep=name)
        return final

    def _move_into_place(self, staging: Path, final: Path) -> None:
        if final.exists():
            # Re-saving a step (e.g. after a resume): park the old copy, swap, then delete it.
            # A crash in between leaves latest.json naming a missing or complete directory,
            # both of which load() handles.
            parked = final.with_name(f".{final.name}.old")
            shutil.rmtree(parked, ignore_errors=True)
            os.replace(final, parked)
            os.replace(staging, final)
            fsync_dir(self.directory)
            shutil.rmtree(parked, ignore_errors=True)
        else:
            os.replace(staging, final)
            fsync_dir(self.directory)

    def _apply_retention(self, keep: str) -> None:
        complete = [p for p in self.candidates() if p.name != keep]
        excess = len(complete) + 1 - self.keep_last
        for path in sorted(complete, key=_step_of)[: max(0, excess)]:
            shutil.rmtree(path, ignore_errors=True)
        for stale in self.directory.glob(".step_*"):
            # Leftovers of an interrupted save; never referenced by latest.json.
            shutil.rmtree(stale, ignore_errors=True)
        fsync_dir(self.directory)

    # ------------------------------------------------------------------ reading
    def candidates(self) -> list[Path]:
        """Checkpoint directories by name (newest first), complete or not."""
        if not self.directory.is_dir():
            return []
        dirs = [p for p in self.directory.iterdir() if p.is_dir() and NAME_PATTERN.match(p.name)]
        return sorted(dirs, key=_step_of, reverse=True)

    def pointer_target(self) -> Path | None:
        """The directory ``latest.json`` names, validated against the naming pattern."""
        pointer = self.directory / POINTER
        if not pointer.exists():
            return None
        try:
            data = json.loads(pointer.read_text(encoding="utf-8"))
            name = data["checkpoint"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("checkpoint pointer %s is unreadable (%s); scanning the directory",
                        pointer, exc)
            return None
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise CheckpointError(
                f"{pointer} names {name!r}, which is not a checkpoint name (step_NNNNNNNN); "
                "refusing to follow it"
            )
        target = (self.directory / name).resolve()
        if target.parent != self.directory.resolve():
            raise CheckpointError(f"{pointer} points outside {self.directory}: {name!r}")
        return self.directory / name

    def verify(self, path: Path) -> int:
        """Check ``path`` against its manifest; returns its step or raises CheckpointError."""
        manifest_path = path / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            files = manifest["files"]
            step = int(manifest["step"])
        except FileNotFoundError:
            raise CheckpointError(f"{path.name}: no manifest (incomplete checkpoint)") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path.name}: unreadable manifest ({exc})") from None
        if set(files) != {TENSORS, STATE}:
            raise CheckpointError(f"{path.name}: manifest lists unexpected files {sorted(files)}")
        for filename, expected in files.items():
            file = path / filename
            if not file.is_file():
                raise CheckpointError(f"{path.name}/{filename} is missing")
            size = file.stat().st_size
            if size != expected["size"]:
                raise CheckpointError(
                    f"{path.name}/{filename} has {size} bytes, manifest says {expected['size']}"
                )
            if sha256_file(file) != expected["sha256"]:
                raise CheckpointError(f"{path.name}/{filename} fails its sha256 check")
        return step

    def read(self, path: Path) -> LoadedCheckpoint:
        """Verify and decode one checkpoint directory."""
        step = self.verify(path)
        try:
            tensors = load_file(str(path / TENSORS))
            json_tree = json.loads((path / STATE).read_text(encoding="utf-8"))
            state = statecodec.decode(json_tree, tensors)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{path.name}: cannot decode ({type(exc).__name__}: {exc})")
        return LoadedCheckpoint(path=path, step=step, state=state)

    def load_latest(self) -> LoadedCheckpoint | None:
        """The newest usable checkpoint, or None when the directory holds none at all.

        The pointer's target is tried first, then every other checkpoint newest-first; each one
        that fails verification is named in a warning. If checkpoints exist but none is usable,
        raises :class:`CheckpointError` instead of silently starting over.
        """
        order: list[Path] = []
        target = self.pointer_target()
        if target is not None:
            order.append(target)
        order.extend(p for p in self.candidates() if p not in order)
        if not order:
            return None
        failures = []
        for path in order:
            if not path.exists():
                log.warning("checkpoint %s named by latest.json is missing; trying older ones",
                            path.name)
                failures.append(f"{path.name}: missing")
                continue
            try:
                return self.read(path)
            except CheckpointError as exc:
                log.warning("skipping unusable checkpoint %s: %s", path.name, exc)
                failures.append(str(exc))
        raise CheckpointError(
            f"no usable checkpoint in {self.directory} ({'; '.join(failures)}); "
            "set checkpoint.allow_fresh_start: true to start over"
        )


def _step_of(path: Path) -> int:
    match = NAME_PATTERN.match(path.name)
    return int(match.group(1)) if match else -1


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle, contextlib.suppress(OSError):
        os.fsync(handle.fileno())
