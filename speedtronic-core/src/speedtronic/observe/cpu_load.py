"""How many of this machine's CPUs other work keeps busy right now: what ``run.threads: auto``
leaves to that work (:mod:`speedtronic.observe.threads`).

The figure is the kernel's count of runnable tasks (the fourth field of ``/proc/loadavg``,
every thread on the machine that is running or waiting for a CPU) minus this process's own
runnable threads (``/proc/self/task/*/stat``), the median of a few samples a few
milliseconds apart, so a task that wakes for an instant does not count. It is read only where
it describes the CPUs this process runs on: when the process may use every CPU of the machine
(no narrower affinity mask, no cgroup quota below the CPU count). Elsewhere (not Linux, a
container pinned to some CPUs, ``/proc`` unreadable) there is no figure and ``auto`` does not
look at the load.

Everything here is torch-free and cheap (a few small ``/proc`` reads), so the trainer can look
again every few seconds.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["busy_elsewhere", "own_runnable_threads", "runnable_tasks"]

SAMPLES = 5
"""Samples per reading; their median is the figure."""
PAUSE = 0.002
"""Seconds between two samples."""


def runnable_tasks(loadavg: str | None = None) -> int | None:
    """Tasks running or runnable on the whole machine now (``/proc/loadavg``), this
    process's included; None where it cannot be read."""
    if loadavg is None:
        try:
            loadavg = Path("/proc/loadavg").read_text()
        except OSError:
            return None
    fields = loadavg.split()
    if len(fields) < 4 or "/" not in fields[3]:
        return None
    running = fields[3].split("/", 1)[0]
    return int(running) if running.isdigit() else None


def own_runnable_threads(task_dir: Path = Path("/proc/self/task")) -> int | None:
    """This process's threads in state R (running or runnable); None where ``/proc`` is
    not there."""
    try:
        tasks = os.listdir(task_dir)
    except OSError:
        return None
    count = 0
    for task in tasks:
        try:
            stat = (task_dir / task / "stat").read_text()
        except OSError:  # the thread ended since the listing
            continue
        # "pid (comm) S ...": comm may hold spaces and parentheses; the state follows the
        # last closing parenthesis.
        state = stat[stat.rfind(")") + 1 :].split(None, 1)
        if state and state[0] == "R":
            count += 1
    return count


def busy_elsewhere(
    usable: int,
    *,
    samples: int = SAMPLES,
    pause: float = PAUSE,
    total: Callable[[], int | None] = runnable_tasks,
    own: Callable[[], int | None] = own_runnable_threads,
    sleep: Callable[[float], None] = time.sleep,
) -> int | None:
    """Runnable tasks on this machine that are not this process's (the median of
    ``samples`` readings), or None when the machine's load cannot be seen from here: the
    process may use only ``usable`` of the machine's CPUs (see the module docstring), or
    ``/proc`` does not tell. ``total``, ``own`` and ``sleep`` are injectable for tests."""
    if usable < (os.cpu_count() or 1):
        return None
    readings = []
    for index in range(max(1, samples)):
        everyone, mine = total(), own()
        if everyone is None or mine is None:
            return None
        readings.append(max(0, everyone - mine))
        if index + 1 < samples:
            sleep(pause)
    return int(statistics.median_low(readings))
