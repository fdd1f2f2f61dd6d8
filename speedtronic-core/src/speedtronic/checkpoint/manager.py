"""Local checkpoints that survive a crash at any instant, and loading without pickle.

Layout of a checkpoint directory::

    step_00000100/
        tensors.safetensors   every tensor of the state (model, optimizer, RNG, plugins)
        state.json            everything else, with references into the tensor file
        manifest.json         step, size and sha256 (per 32 MiB slice) of the two files above
    latest.json               {"checkpoint": "step_00000100", "step": 100, "format": 1}

A run with ``parallel.strategy: fsdp`` writes sharded checkpoints instead, the same way (see
:mod:`speedtronic.checkpoint.dcp`: a ``dcp/`` folder beside the two files, all in the manifest).

A checkpoint is assembled in a hidden staging directory (``.step_00000100.<random>.tmp``),
every file is fsynced, the staging directory is renamed into place and the parent directory
fsynced; only then is ``latest.json`` atomically replaced, and only after that pointer is
durable are older checkpoints removed. A crash at any instant therefore leaves ``latest.json``
naming either the previous checkpoint or the new, complete one.

Loading follows ``latest.json`` (whose name must match ``step_NNNNNNNN``: it cannot point
outside the directory), verifies the checkpoint against its manifest and decodes it with
safetensors and JSON only. A checkpoint that is missing, truncated or fails its hashes is named
in a warning and the next older one is tried.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
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
    probe_writable,
    sha256_chunks,
)
from speedtronic.checkpoint.names import (
    checkpoint_name,
    overwrite_refusal,
    step_of,
)
from speedtronic.checkpoint.policy import BackgroundWrite, SavedCheckpoint, SavePolicy
from speedtronic.checkpoint.reader import (
    BEST_POINTER,
    FORMAT_VERSION,
    HASH_CHUNK_BYTES,
    MANIFEST,
    POINTER,
    STATE,
    TENSORS,
    CheckpointReader,
    LoadedCheckpoint,
)
from speedtronic.checkpoint.runlock import RunLock
from speedtronic.checkpoint.writer import CheckpointWriter
from speedtronic.errors import CheckpointError
from speedtronic.parallel.context import SINGLE_PROCESS, ParallelContext

__all__ = [
    "BEST_POINTER",
    "FORMAT_VERSION",
    "HASH_CHUNK_BYTES",
    "MANIFEST",
    "POINTER",
    "STATE",
    "TENSORS",
    "CheckpointManager",
    "LoadedCheckpoint",
    "checkpoint_name",
    "free_space",
    "step_of",
]

log = logging.getLogger("speedtronic.checkpoint")

# Anything in the directory starting with this is ours and unreferenced: staging directories
# of interrupted saves, parked copies of a re-saved step, checkpoints being deleted.
_HIDDEN_PREFIX = ".step_"


class CheckpointManager(CheckpointReader):
    """Writes, verifies, retains and loads the checkpoints of one run in ``directory``, and
    decides when a run saves (:meth:`maybe_save`, after its ``policy``).

    Under data parallel (``parallel``) every rank calls the run-facing methods at the same
    points: rank 0 alone touches the directory and the others learn its outcome, so every rank
    raises the same :class:`CheckpointError`. Its ``writer`` (the run's strategy picks it: the
    whole state by rank 0, or under ``parallel.strategy: fsdp`` a
    :class:`speedtronic.checkpoint.dcp.ShardedWriter` whose ranks each write their shards)
    writes each save; the policy, retention and pointers stay the same.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        keep_last: int = 3,
        *,
        policy: SavePolicy | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        super().__init__(directory)
        self.keep_last = keep_last
        self.policy = policy or SavePolicy()
        self.parallel = parallel or SINGLE_PROCESS
        # What checkpoint.every_seconds measures with; a test may give its own.
        self.clock: Callable[[], float] = time.monotonic
        self.last_saved_step: int | None = None
        self._last_save_time = self.clock()
        self._in_flight: BackgroundWrite | None = None
        self._unreported: list[SavedCheckpoint] = []
        # Held from start_run to close: no second live run writes this directory.
        self._run_lock: RunLock | None = None
        # Writes each save on every rank: save() now, or start() for a background one.
        self.writer: CheckpointWriter = CheckpointWriter()

    # ------------------------------------------------------------------ a run's saves
    def resume_point(
        self, check: Callable[[Any], None] | None = None, *, weights: bool = True
    ) -> LoadedCheckpoint | None:
        """The checkpoint a resumed run continues from (:meth:`load_latest`, ``weights`` as in
        :meth:`read`), or None for a fresh start: no checkpoint yet, or none usable and
        ``allow_fresh_start`` set."""
        try:
            loaded = self.load_latest(check=check, weights=weights)
        except CheckpointError as exc:
            if not self.policy.allow_fresh_start:
                raise
            log.warning("%s; starting fresh because checkpoint.allow_fresh_start is set", exc)
            return None
        if loaded is None:
            log.info("no checkpoint in %s yet; starting fresh", self.directory)
        return loaded

    def refuse_to_overwrite(self, step: int) -> None:
        """A fresh run never overwrites another run's checkpoints: it would replace their
        ``latest.json`` and same-numbered steps (``step`` > 0: a trainer continuing its own run
        in memory)."""

        def check() -> None:
            if not self.policy.writes or step:
                return
            existing = self.candidates()
            if existing:
                raise CheckpointError(overwrite_refusal(self.directory, existing[0]))

        self._on_main(check)

    def start_run(self) -> None:
        """The run's first step is next: find an unwritable directory now, not at the final
        save of a long run; the clock of ``every_seconds`` starts here."""

        def check() -> None:
            if not self.policy.writes:
                return
            try:
                self.check_writable(best=self.policy.keep_best)
            except OSError as exc:
                where = f": {exc.filename}" if exc.filename else ""
                raise CheckpointError(
                    f"cannot write checkpoints to {self.directory} "
                    f"({exc.strerror or exc}{where}); fix its permissions or free space (or "
                    "move that path away), or point checkpoint.directory / run.output_dir "
                    "elsewhere"
                ) from None
            if self._run_lock is None:
                self._run_lock = RunLock.acquire(self.directory)

        self._on_main(check)
        self._last_save_time = self.clock()

    def maybe_save(
        self,
        step: int,
        state: Callable[[], Any],
        *,
        force: bool = False,
        final: bool = False,
    ) -> list[SavedCheckpoint]:
        """Called at every step boundary of a run: save the checkpoint of ``step`` when the
        policy says so (``interval``, ``every_seconds``, ``final`` with ``save_final``) or when
        ``force``d, unless ``step`` is saved already. ``state()`` builds the state, only when a
        save happens. Returns the checkpoints that became durable since the last call (with
        ``async_save`` the one just started is not among them yet).

        A failed write is retried once after ``retry_pause``; a second failure raises
        :class:`CheckpointError` (for a background write, at the next call), with the previous
        checkpoints intact."""
        clock_due = self._poll()
        interval = self.policy.interval
        due = (
            force
            or (final and self.policy.save_final)
            or (bool(interval) and step % interval == 0)
            or clock_due
        )
        if due and step != self.last_saved_step:
            if self.policy.async_save:
                self._start_background(step, state())
            else:
                self._unreported.append(self.save_now(step, state))
        return self._take_unreported()

    def save_now(self, step: int, state: Any) -> SavedCheckpoint:
        """Write the checkpoint of ``step`` now and wait for it (after any background write
        in flight); ``state`` is the state or a callable building it."""
        self._join()
        tree = state() if callable(state) else state
        path = self.writer.save(self, step, tree)
        self._saved(step)
        return SavedCheckpoint(step, path)

    def wait(self) -> list[SavedCheckpoint]:
        """Block until the background write in flight (if any) is durable and return what
        became durable since the last call; a failure is raised on every rank. The run's end
        and a stop call this before they return."""
        self._join()
        return self._take_unreported()

    def close(self) -> None:
        """Wait for a background write without raising (a run failing for another reason): the
        process never exits while a checkpoint is half written."""
        job, self._in_flight = self._in_flight, None
        if job is not None:
            try:
                job.result()
            except Exception as exc:
                log.error("the background checkpoint write of step %d failed: %s", job.step, exc)
        lock, self._run_lock = self._run_lock, None
        if lock is not None:
            lock.release()

    def _join(self) -> None:
        if not self.policy.async_save:
            return  # the same on every rank: no collective below
        job, self._in_flight = self._in_flight, None
        if self.writer.per_rank:
            # Every rank has its own background write; they end together with one outcome.
            if job is not None:
                self._unreported.append(job.result())
            return

        def finish() -> None:
            if job is not None:
                self._unreported.append(job.result())

        self._on_main(finish)

    def _take_unreported(self) -> list[SavedCheckpoint]:
        done, self._unreported = self._unreported, []
        return done

    def _poll(self) -> bool:
        """Collect a finished background write (raising its failure on every rank); whether
        ``every_seconds`` is due. All ranks agree on both: one small collective per step, only
        with ``async_save`` or ``every_seconds`` under data parallel."""
        job = self._in_flight
        seconds = self.policy.every_seconds
        done = job is not None and job.done
        clock_due = bool(seconds) and self.clock() - self._last_save_time >= (seconds or 0)
        if self.parallel.enabled and (self.policy.async_save or seconds):
            done, clock_due = (bool(v) for v in self.parallel.max_each([done, clock_due]))
        if done:
            self._join()
        return clock_due

    def _start_background(self, step: int, state: Any) -> None:
        self._join()  # at most one write in flight: the next save waits for the previous one
        write = self.writer.start(self, step, state)
        if write is not None:
            self._in_flight = BackgroundWrite(step, write)
        self._saved(step)

    def write_whole(self, step: int, state: Any) -> Path:
        """The whole-state write of ``step`` (:class:`CheckpointWriter`): rank 0 writes it,
        retrying once; every rank gets the path or raises rank 0's error."""
        return self._write_on_ranks(step, lambda: self._write_with_retry(step, state))

    def snapshot_whole(self, step: int, state: Any) -> Callable[[], Path] | None:
        """Rank 0's copy of ``state`` in CPU memory (the only part the training step waits
        for) and the write to run in the background; None on the other ranks."""
        if not self.parallel.is_main:
            return None
        snapshot = self._encode(step, state, copy=True)
        return lambda: self._write_with_retry(step, snapshot)

    def _saved(self, step: int) -> None:
        self.last_saved_step = step
        self._last_save_time = self.clock()

    def _write_with_retry(self, step: int, state: Any) -> Path:
        """Encode (unless ``state`` is already an encoded snapshot) and write, retrying once."""
        text, tensors = state if isinstance(state, tuple) else self._encode(step, state)
        try:
            return self._write_encoded(step, text, tensors)
        except CheckpointError as exc:
            pause = self.policy.retry_pause
            log.warning("%s; retrying once in %.0f s", exc, pause)
            time.sleep(pause)
            return self._write_encoded(step, text, tensors)

    def _write_on_ranks(self, step: int, write: Callable[[], Path]) -> Path:
        """Rank 0 writes; every rank gets the path or raises rank 0's error."""
        paths: list[Path] = []
        self._on_main(lambda: paths.append(write()))
        return paths[0] if paths else self.directory / checkpoint_name(step)

    def _on_main(self, action: Callable[[], None]) -> None:
        """Run ``action`` on rank 0 only (other ranks would race its writes) and raise its
        :class:`CheckpointError` on every rank."""
        if not self.parallel.enabled:
            action()
            return
        problem = None
        if self.parallel.is_main:
            try:
                action()
            except CheckpointError as exc:
                problem = str(exc)
        problem = self.parallel.broadcast(problem)
        if problem:
            raise CheckpointError(problem)

    # ------------------------------------------------------------------ writing
    def save(self, step: int, state: Any) -> Path:
        """Durably write ``state`` as the checkpoint of ``step``, point ``latest.json`` at it,
        then apply retention. Raises :class:`CheckpointError`; on failure the previous
        checkpoint stays the latest one. This is the storage step alone: when to save, retries
        and ranks are :meth:`maybe_save`'s business."""
        return self._write_encoded(step, *self._encode(step, state))

    def _encode(self, step: int, state: Any, copy: bool = False) -> tuple[str, dict[str, Any]]:
        try:
            json_tree, tensors = statecodec.encode(state, copy=copy)
            text = json.dumps(json_tree, allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise CheckpointError(
                f"cannot serialise the state for checkpoint {checkpoint_name(step)}: {exc}"
            ) from exc
        return text, tensors

    def _write_encoded(self, step: int, text: str, tensors: dict[str, Any]) -> Path:
        name = checkpoint_name(step)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            final = self._write(name, step, state_json=text, tensors=tensors)
            atomic_write_text(
                self.directory / POINTER,
                json.dumps({"checkpoint": name, "step": step, "format": FORMAT_VERSION}) + "\n",
            )
        except Exception as exc:  # OSError, or safetensors' own error for a full disk
            raise CheckpointError(
                f"could not write checkpoint {name} in {self.directory}: "
                f"{type(exc).__name__}: {exc} ({free_space(self.directory)})"
            ) from None
        self.apply_retention(step)
        log.debug("checkpoint %s written", final)
        return final

    def _write(self, name: str, step: int, *, state_json: str, tensors: dict[str, Any]) -> Path:
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=self.directory))
        try:
            save_file(tensors, str(staging / TENSORS), metadata={"format": str(FORMAT_VERSION)})
            (staging / STATE).write_text(state_json, encoding="utf-8")
            # Hash (from the page cache) while the kernel flushes the same files to disk.
            with ThreadPoolExecutor(1, thread_name_prefix="fsync") as flusher:
                flushed = [flusher.submit(fsync_file, staging / f) for f in (TENSORS, STATE)]
                files = {f: _describe(staging / f) for f in (TENSORS, STATE)}
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

    # ------------------------------------------------------------------ reading
    def mark_best(self, step: int, eval_loss: float) -> None:
        """Point ``best.json`` at the (already written) checkpoint of ``step``."""
        name = checkpoint_name(step)
        if not (self.directory / name / MANIFEST).is_file():
            raise CheckpointError(f"cannot mark {name} as best: it is not a complete checkpoint")
        atomic_write_text(
            self.directory / BEST_POINTER,
            json.dumps({"checkpoint": name, "step": step, "eval_loss": eval_loss}) + "\n",
        )


def _describe(path: Path) -> dict[str, Any]:
    """The manifest entry of one file: size and per-slice sha256."""
    return {
        "size": path.stat().st_size,
        "chunk_bytes": HASH_CHUNK_BYTES,
        "sha256": sha256_chunks(path, HASH_CHUNK_BYTES),
    }
