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

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from speedtronic.checkpoint.fileio import free_space
from speedtronic.checkpoint.names import checkpoint_name, overwrite_refusal, step_of
from speedtronic.checkpoint.policy import BackgroundWrite, SavedCheckpoint, SavePolicy
from speedtronic.checkpoint.reader import POINTER, LoadedCheckpoint
from speedtronic.checkpoint.runlock import RunLock
from speedtronic.checkpoint.storage import CheckpointStorage
from speedtronic.checkpoint.writer import CheckpointWriter
from speedtronic.errors import CheckpointError
from speedtronic.parallel.context import SINGLE_PROCESS, ParallelContext

__all__ = [
    "CheckpointManager",
    "LoadedCheckpoint",
    "checkpoint_name",
    "free_space",
    "step_of",
]

log = logging.getLogger("speedtronic.checkpoint")


class CheckpointManager:
    """Writes, verifies, retains and loads the checkpoints of one run in ``directory``, and
    decides when a run saves (:meth:`maybe_save`, after its ``policy``).

    Under data parallel (``parallel``) every rank calls the run-facing methods at the same
    points: rank 0 alone touches the directory and the others learn its outcome, so every rank
    raises the same :class:`CheckpointError`. Its ``writer`` (the run's strategy picks it: the
    whole state by rank 0, or under ``parallel.strategy: fsdp`` a
    :class:`speedtronic.checkpoint.dcp.ShardedWriter` whose ranks each write their shards)
    writes each save; the policy, retention and pointers stay the same. Its ``storage`` (a
    :class:`~speedtronic.checkpoint.storage.CheckpointStorage`) reads and writes the directory;
    the manager offers the storage's reading and writing calls as its own.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        keep_last: int = 3,
        *,
        policy: SavePolicy | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        self.storage = CheckpointStorage(directory, keep_last)
        self.directory = self.storage.directory
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
                self.storage.check_writable(best=self.policy.keep_best)
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
        snapshot = self.storage.encode(step, state, copy=True)
        return lambda: self._write_with_retry(step, snapshot)

    def _saved(self, step: int) -> None:
        self.last_saved_step = step
        self._last_save_time = self.clock()

    def _write_with_retry(self, step: int, state: Any) -> Path:
        """Encode (unless ``state`` is already an encoded snapshot) and write, retrying once."""
        text, tensors = state if isinstance(state, tuple) else self.storage.encode(step, state)
        try:
            return self.storage.write_encoded(step, text, tensors)
        except CheckpointError as exc:
            pause = self.policy.retry_pause
            log.warning("%s; retrying once in %.0f s", exc, pause)
            time.sleep(pause)
            return self.storage.write_encoded(step, text, tensors)

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

    # ------------------------------------------------------------------ the storage's calls
    def candidates(self) -> list[Path]:
        """Checkpoint directories, newest first (:meth:`CheckpointReader.candidates`)."""
        return self.storage.candidates()

    def pointer_target(self, pointer_name: str = POINTER) -> Path | None:
        """The checkpoint a pointer file names (:meth:`CheckpointReader.pointer_target`)."""
        return self.storage.pointer_target(pointer_name)

    def verify(self, path: Path) -> int:
        """Check one checkpoint against its manifest; its step (:meth:`CheckpointReader.verify`)."""
        return self.storage.verify(path)

    def read(
        self, path: Path, check: Callable[[Any], None] | None = None, *, weights: bool = True
    ) -> LoadedCheckpoint:
        """Verify and decode one checkpoint directory (:meth:`CheckpointReader.read`)."""
        return self.storage.read(path, check, weights=weights)

    def load(
        self, which: str = "latest", check: Callable[[Any], None] | None = None
    ) -> LoadedCheckpoint:
        """``latest``, ``best`` or a checkpoint directory (:meth:`CheckpointReader.load`)."""
        return self.storage.load(which, check)

    def load_latest(
        self, check: Callable[[Any], None] | None = None, *, weights: bool = True
    ) -> LoadedCheckpoint | None:
        """The newest usable checkpoint or None (:meth:`CheckpointReader.load_latest`)."""
        return self.storage.load_latest(check, weights=weights)

    def save(self, step: int, state: Any) -> Path:
        """Durably write the checkpoint of ``step`` now, on this process, without the run's
        policy or ranks (:meth:`CheckpointStorage.save`)."""
        return self.storage.save(step, state)

    def mark_best(self, step: int, eval_loss: float) -> None:
        """Point ``best.json`` at the written checkpoint of ``step``."""
        self.storage.mark_best(step, eval_loss)
