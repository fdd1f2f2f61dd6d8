"""The master's outer thread: :class:`OuterThread` runs one turn of the outer loop every
``interval`` seconds (at once when woken) in a daemon thread, outlives a bad turn, and ends
(recording why in :attr:`OuterThread.failure`) on a lost lease or anything that is not an
``Exception``."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from speedtronic_diloco.transports.base import LeaseError, LeaseLostError

__all__ = ["OuterThread"]

log = logging.getLogger("speedtronic.diloco.outer")


class OuterThread:
    """Calls ``turn(stop)`` every ``interval`` seconds until stopped; ``lease()`` is the
    master's lease keeper (or None), checked before every turn so that a lost lease stops the
    thread within one interval of being noticed."""

    def __init__(self, turn: Callable[[threading.Event], None], lease: Callable[[], Any]) -> None:
        self._turn = turn
        self._lease = lease
        #: Set to end the thread; long waits inside a turn watch it too.
        self.stop_event = threading.Event()
        #: Set to run the next turn now instead of after the rest of the interval.
        self._wake = threading.Event()
        #: What ended the thread (a lost lease, an unexpected error), or None.
        self.failure: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self, interval: float) -> None:
        """Start the thread (nothing when it is running already)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self.stop_event = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(interval,), name="diloco-outer", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> bool:
        """Ask the thread to stop after its current turn; True when it ended in time."""
        self.stop_event.set()
        self._wake.set()
        if self._thread is None:
            return True
        self._thread.join(max(0.0, timeout))
        return not self._thread.is_alive()

    def wake(self) -> None:
        """Run the next turn as soon as the current one (if any) ends. A sync-round master
        waiting at its boundary wakes its outer thread at every look, so the round closes
        within a look of its last delta whatever ``poll_interval`` is."""
        self._wake.set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self, interval: float) -> None:
        stop, wake = self.stop_event, self._wake
        try:
            while not stop.is_set():
                lease = self._lease()
                try:
                    if lease is not None:  # lost: stop now, not at the next publication
                        lease.check()
                    self._turn(stop)
                except LeaseError as exc:  # another master took over: this one must stop
                    if isinstance(exc, LeaseLostError) and lease is not None:
                        # Whichever fenced write met the new holder first (a publication, a
                        # deletion, a renewal), the lease keeper says so in its one line.
                        lease.mark_lost(str(exc))
                    raise
                except Exception:  # the outer thread must outlive one bad round
                    log.exception("outer round failed")
                wake.wait(max(interval, 0.05))
                wake.clear()
        except BaseException as exc:  # never end silently: the coordinator stops the run
            self.failure = exc
            if isinstance(exc, LeaseError) and getattr(self._lease(), "failover", False):
                return  # fenced: the lease keeper said so; the node goes on as a worker
            log.critical(
                "!!! DumbDiLoCo master: the outer loop stopped (%s: %s); nothing more is "
                "aggregated or published, and the run stops",
                type(exc).__name__,
                exc,
            )
