"""A background lane: one daemon thread that runs at most one job at a time and refuses a new
job while busy, so the training thread never waits behind slow store I/O."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("speedtronic.diloco")


class Lane:
    """One worker thread with a single job slot. ``submit`` never blocks."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._cond = threading.Condition()
        self._job: Callable[[], object] | None = None
        self._busy = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """True from a successful :meth:`submit` until that job has returned."""
        with self._cond:
            return self._busy

    def submit(self, job: Callable[[], object]) -> bool:
        """Queue ``job`` unless the lane is busy or closing; True when it was accepted."""
        with self._cond:
            if self._busy or self._closing:
                return False
            self._busy = True
            self._job = job
            self._cond.notify_all()
            return True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no job is queued or running; True when idle."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._busy, timeout)

    def close(self, timeout: float) -> bool:
        """Let a running job finish, stop the thread; True when it ended within ``timeout``."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(max(0.0, timeout))
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._job is not None or self._closing)
                job = self._job
                if job is None:
                    return
                self._job = None
            try:
                job()
            except Exception:  # a lane must survive a failing job; the job logs its own errors
                log.exception("%s: background job failed", self.name)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
