"""When a run saves, and the one save that may be written in the background.

:class:`SavePolicy` is the ``checkpoint`` section's say on saving, read by
:meth:`~speedtronic.checkpoint.CheckpointManager.maybe_save`; :class:`BackgroundWrite` is a
save whose state was copied to CPU memory at its step and is written by a thread while
training goes on (``checkpoint.async_save``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["BackgroundWrite", "SavePolicy", "SavedCheckpoint"]


@dataclass(frozen=True)
class SavePolicy:
    """How a run saves: every ``interval`` steps, every ``every_seconds`` seconds (checked at
    step boundaries), at the end (``save_final``), in the background (``async_save``); a failed
    write is retried once after ``retry_pause`` seconds. A manager built without a policy (a
    tool reading or writing checkpoints) saves only when asked and retries at once."""

    interval: int = 0
    every_seconds: float | None = None
    save_final: bool = True
    retry_pause: float = 0.0
    allow_fresh_start: bool = False
    async_save: bool = False
    keep_best: bool = False  # best.json is written too: its path is checked before training

    @classmethod
    def from_config(cls, section: Any) -> SavePolicy:
        """The policy of a ``checkpoint`` config section."""
        return cls(
            interval=section.interval,
            every_seconds=section.every_seconds,
            save_final=section.save_final,
            retry_pause=section.save_retry_pause,
            allow_fresh_start=section.allow_fresh_start,
            async_save=section.async_save,
            keep_best=bool(section.keep_best),
        )

    @property
    def writes(self) -> bool:
        """Whether the run writes checkpoints on its own at all."""
        return bool(self.interval or self.every_seconds or self.save_final)


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint that became durable: its step and directory."""

    step: int
    path: Path


class BackgroundWrite:
    """One save written by a daemon thread: ``write()`` runs there, its result or error is
    kept for the main thread, which collects it with :meth:`result`."""

    def __init__(self, step: int, write: Callable[[], Path]) -> None:
        self.step = step
        self._write = write
        self._path: Path | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._path = self._write()
        except BaseException as exc:  # handed to the main thread by result()
            self._error = exc

    @property
    def done(self) -> bool:
        """True once the thread finished, successfully or not."""
        return not self._thread.is_alive()

    @property
    def failed(self) -> bool:
        """True once the thread finished with an error."""
        return self.done and self._error is not None

    def result(self) -> SavedCheckpoint:
        """Wait for the write; the checkpoint, or the write's error raised here."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._path is not None
        return SavedCheckpoint(self.step, self._path)
