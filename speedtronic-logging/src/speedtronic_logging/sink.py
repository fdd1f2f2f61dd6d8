"""One metric backend behind a guard: a failing backend warns once and is switched off.

A sink must never stop training: a full disk, a dropped network or a backend bug turns into a
single warning, after which that backend receives nothing more while the other one and the
training loop carry on.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

log = logging.getLogger("speedtronic.logging")


class Backend(Protocol):
    """What the W&B and TensorBoard adapters implement; any call may raise."""

    label: str

    def log_run_info(self, step: int, info: dict[str, Any]) -> None:
        """Record the facts of the ``train_start`` event (device, precision, ...)."""

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """Record named scalars at ``step``."""

    def log_summary(self, step: int, summary: dict[str, Any]) -> None:
        """Record the final summary of the ``train_end`` event."""

    def finish(self, error: BaseException | None) -> None:
        """Flush and close; ``error`` is the exception that ended training, if any."""


class GuardedSink:
    """Calls a :class:`Backend` and turns its first failure into a warning and a shutdown."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.label = backend.label
        self.active = True
        self._finished = False

    def call(self, method: str, *args: Any) -> None:
        """Call ``backend.method(*args)`` unless the backend has already failed."""
        if not self.active:
            return
        try:
            getattr(self.backend, method)(*args)
        except Exception as exc:
            self.active = False
            log.warning(
                "%s logging failed (%s: %s); training continues without %s",
                self.label,
                type(exc).__name__,
                exc,
                self.label,
            )

    def finish(self, error: BaseException | None) -> None:
        """Finish the backend once. Also after a failure, so files and processes are released."""
        if self._finished:
            return
        self._finished = True
        try:
            self.backend.finish(error)
        except Exception as exc:
            if self.active:
                log.warning(
                    "%s could not finish its run cleanly (%s: %s)",
                    self.label,
                    type(exc).__name__,
                    exc,
                )
            else:  # already warned about this backend; a second line says nothing new
                log.debug("%s finish after an earlier failure: %s", self.label, exc)
        self.active = False
