"""Stopping a run cleanly: stop signals (``run.stop_signals``) and ``Trainer.request_stop()``.

A scheduler that is about to take the machine (SLURM, Kubernetes, a spot instance) sends
SIGTERM; a person presses Ctrl-C. The first such signal only raises a flag: the trainer finishes
the optimizer step in progress, the ranks of a data-parallel run agree on the step to stop at,
a checkpoint of that step is written, and the process exits with 128 + the signal number, so the
scheduler sees "did not finish" and may requeue. A second signal means "now": the handler puts
the signal's default action back and delivers it again, so the process dies at once; the
checkpoints already on disk stay usable because every write is atomic.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

__all__ = ["StopRequest", "StopSignals"]

log = logging.getLogger("speedtronic.stopping")

# How a stop is encoded for the ranks' agreement (a maximum over ranks): a signal outranks a
# plain request, so every rank reports the signal that some rank received.
_REQUESTED = 1
_SIGNALLED = 1000


class StopRequest:
    """Whether the run should stop after the current step, and why."""

    def __init__(self) -> None:
        self._code = 0
        self.agreed = False
        """True once the ranks agreed to stop (the run is stopping or stopped)."""
        self.signal: int | None = None
        """The number of the signal that stopped the run (None for ``request_stop()``)."""

    def request(self) -> None:
        """Stop after the current step (``Trainer.request_stop()``)."""
        self._code = max(self._code, _REQUESTED)

    def signalled(self, signum: int) -> None:
        """A stop signal arrived (called from its handler: only sets a number)."""
        self._code = max(self._code, _SIGNALLED + signum)

    def agree(self, parallel: Any) -> bool:
        """At a step boundary: whether to stop now. Under data parallel every rank calls this
        at every step and the answer is the same on all of them (one collective of one
        integer per step)."""
        code = self._code
        if parallel.enabled:
            code = parallel.max_each([code])[0]
        if not code:
            return False
        self.agreed = True
        self.signal = code - _SIGNALLED if code >= _SIGNALLED else None
        return True

    @property
    def signal_name(self) -> str | None:
        """``"SIGTERM"`` and so on; None for ``request_stop()``."""
        return signal.Signals(self.signal).name if self.signal is not None else None

    @property
    def reason(self) -> str:
        """What stopped the run, for the log line."""
        return self.signal_name or "request_stop()"


class StopSignals:
    """While active (a ``with`` block on the main thread), the first of the named signals
    tells ``request`` to stop and a second one aborts the process with that signal's default
    action. Elsewhere (a run on a worker thread) it does nothing: Python handles signals on the
    main thread only, and ``request_stop()`` is the way to stop such a run."""

    def __init__(self, names: list[str], request: StopRequest) -> None:
        self._signals = [signal.Signals[name] for name in names]
        self._request = request
        self._previous: dict[signal.Signals, Any] = {}
        self._received: int | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            if self._signals:
                log.debug("not on the main thread: stop signals are left alone")
            return self
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._received is not None:
            # The second signal: no more waiting for the step or the save to finish.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            os._exit(128 + signum)  # only if the default action does not end the process
        self._received = signum
        self._request.signalled(signum)
