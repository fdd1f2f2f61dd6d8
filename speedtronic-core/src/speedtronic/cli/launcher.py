"""Ranks die with their launcher.

``speedtronic train --nproc-per-node N`` runs torch's elastic agent in its own process, and the
agent starts each rank as a child in a session of its own (so a terminal's Ctrl-C reaches only
the launcher, which stops them). A launcher killed with SIGKILL cannot stop anything: its ranks
would train on as orphans, writing checkpoints into a directory a new run may be using.

So the launcher puts its pid in ``$SPEEDTRONIC_LAUNCHER_PID`` and each rank calls
:func:`die_with_launcher` first thing: on Linux the kernel is asked to SIGKILL the rank when
its parent dies (``prctl(PR_SET_PDEATHSIG)``); elsewhere a daemon thread watches the parent
pid and kills the rank when it changes. Either way, a launcher that died before the rank got
there is noticed at once.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

__all__ = ["LAUNCHER_PID_ENV", "die_with_launcher", "watch_parent"]

log = logging.getLogger("speedtronic.launcher")

#: Set by the launcher for its ranks: the pid every rank's parent must be.
LAUNCHER_PID_ENV = "SPEEDTRONIC_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1
# How often the fallback watchdog looks at the parent pid.
_WATCH_INTERVAL_S = 0.5


def die_with_launcher() -> bool:
    """In a rank started by the launcher (``$SPEEDTRONIC_LAUNCHER_PID`` set): arrange to be
    killed when the launcher dies, and die now if it already has. Returns True when a guard
    was installed, False outside a launched rank. The variable is consumed, so processes this
    rank starts are not mistaken for ranks."""
    value = os.environ.pop(LAUNCHER_PID_ENV, None)
    if not value:
        return False
    try:
        launcher = int(value)
    except ValueError:
        log.warning("ignoring $%s=%r: not a pid", LAUNCHER_PID_ENV, value)
        return False
    if not _parent_death_signal(signal.SIGKILL):
        watch_parent(launcher)
    # After the request: a launcher that died just before is seen here (we were reparented).
    if os.getppid() != launcher:
        _die(f"the launcher (pid {launcher}) is gone")
    return True


def watch_parent(parent: int, interval: float = _WATCH_INTERVAL_S) -> threading.Thread:
    """A daemon thread that kills this process as soon as its parent is no longer ``parent``."""

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(interval):
            if os.getppid() != parent:
                _die(f"the launcher (pid {parent}) is gone")

    thread = threading.Thread(target=watch, name="speedtronic-parent-watch", daemon=True)
    thread.start()
    return thread


def _parent_death_signal(signum: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, signum)`` through libc; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            log.debug("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
            return False
    except (OSError, AttributeError):
        return False
    return True


def _die(reason: str) -> None:
    # SIGKILL, as the kernel would deliver: no handler may save a checkpoint from an orphan.
    log.error("%s: this rank stops", reason)
    os.kill(os.getpid(), signal.SIGKILL)
