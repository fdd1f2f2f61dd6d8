"""How many CPU threads torch's intra-op work gets: ``run.threads`` and its default ``auto``.

``auto`` starts from the cores this process may run on (its CPU affinity and the cgroup's CPU
quota), divided by the processes of this run on this machine, and never more than the physical
cores:

- the processes of a run on one machine are ``$LOCAL_WORLD_SIZE`` (set by torchrun and by
  ``speedtronic train --nproc-per-node``) or ``$SPEEDTRONIC_LOCAL_PROCESSES`` (say it when you
  start several nodes of a DiLoCo run, or any other group of training processes, on one
  machine yourself);
- an explicit ``$OMP_NUM_THREADS`` wins, as it does for torch (and the count stays fixed).

Then it leaves other work its cores (:mod:`speedtronic.observe.cpu_load`): the runnable tasks
that are not this process's, less the ones the run's other local processes account for, are
taken off the cores, and the rest is shared between this run's local processes (at least one thread
each). On an idle machine that is every core with the OpenMP runtime's defaults (its worker
threads spin-wait between parallel regions, the fastest way there); with other work on the
cores it is fewer threads, down to one, because a step whose threads wait for a descheduled
spinner runs several times slower (``benchmarks/threads.py``). While a run trains,
:class:`ThreadGovernor` looks again every :data:`RECHECK_S` seconds and follows the load: it
cuts threads at the first reading that calls for fewer (too many threads on busy cores is the
costly mistake) and adds them back only when two readings in a row agree (a short lull is not
worth a change). Where the load cannot be seen (not
Linux, a process pinned to some of the machine's CPUs) ``auto`` is the static count.

This module never imports torch.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from speedtronic.observe.cpu_load import busy_elsewhere

__all__ = [
    "AUTO",
    "LOCAL_PROCESSES_ENV",
    "RECHECK_S",
    "ThreadGovernor",
    "apply_threads",
    "auto_threads",
    "local_processes",
    "physical_cores",
    "resolve_threads",
    "usable_cores",
]

log = logging.getLogger("speedtronic.threads")

AUTO = "auto"
LOCAL_PROCESSES_ENV = "SPEEDTRONIC_LOCAL_PROCESSES"
RECHECK_S = 5.0
"""Seconds between two looks at the load while a run trains (:class:`ThreadGovernor`)."""
_MEASURE: Any = object()  # auto_threads(busy=...): read the load now


def usable_cores() -> int:
    """The logical CPUs this process may run on: its affinity mask, bounded by the cgroup
    CPU quota (a container limited to 2 CPUs on a 64-core host counts 2)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        cores = min(cores, quota)
    return max(1, cores)


def _cgroup_quota() -> int | None:
    """Whole CPUs of the cgroup v2 quota (``cpu.max``), rounded up; None when unlimited."""
    try:
        text = Path("/sys/fs/cgroup/cpu.max").read_text()
    except OSError:
        return None
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return max(1, -(-quota // period))


def physical_cores(cpuinfo: str | None = None) -> int | None:
    """Distinct physical cores among the CPUs this process may use (hyperthread siblings count
    once), from ``/proc/cpuinfo``; None where that cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    try:
        allowed: set[int] | None = set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = None
    cores: set[tuple[str, str]] = set()
    for block in cpuinfo.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
        if "processor" not in fields or "core id" not in fields:
            continue
        try:
            processor = int(fields["processor"])
        except ValueError:
            continue
        if allowed is not None and processor not in allowed:
            continue
        cores.add((fields.get("physical id", "0"), fields["core id"]))
    return len(cores) or None


def local_processes(environ: Mapping[str, str] | None = None) -> int:
    """How many processes of this run share this machine (see the module docstring)."""
    env = os.environ if environ is None else environ
    for name in ("LOCAL_WORLD_SIZE", LOCAL_PROCESSES_ENV):
        value = env.get(name, "").strip()
        if value:
            try:
                count = int(value)
            except ValueError:
                log.warning("ignoring $%s=%r: not a whole number", name, value)
                continue
            if count >= 1:
                return count
    return 1


def auto_threads(environ: Mapping[str, str] | None = None, *, busy: int | None = _MEASURE) -> int:
    """The thread count ``run.threads: auto`` stands for in this process now. ``busy`` is
    the runnable tasks on the machine that are not this process's (default: read now; None:
    not known, the static count)."""
    env = os.environ if environ is None else environ
    explicit = env.get("OMP_NUM_THREADS", "").strip()
    if explicit.isdigit() and int(explicit) >= 1:
        return int(explicit)
    cores = usable_cores()
    if busy is _MEASURE:
        busy = busy_elsewhere(cores)
    processes = local_processes(env)
    return _fit(cores, processes, _cap(cores, processes), busy, siblings=None)


def _cap(cores: int, processes: int) -> int:
    """The static count: the physical cores among ``cores``, shared by ``processes``."""
    return max(1, min(cores, physical_cores() or cores) // processes)


def _fit(cores: int, processes: int, cap: int, busy: int | None, siblings: int | None) -> int:
    """Threads (at most ``cap``) for one of ``processes`` local processes of a run on
    ``cores`` CPUs, with ``busy`` runnable tasks that are not this process's, of which each
    other local process of the run accounts for ``siblings`` (None: ``cap``)."""
    if busy is None:
        return cap
    others = busy - (processes - 1) * (cap if siblings is None else siblings)
    free = cores - max(0, others)
    return max(1, min(cap, free // processes))


class ThreadGovernor:
    """``run.threads: auto`` while a run trains: every ``interval`` seconds (at a step's end,
    :meth:`tick`) it reads the load again and changes the threads through ``set_threads``:
    down at once when a reading calls for fewer, up when two readings in a row call for the
    same higher count. ``busy`` and ``clock`` are
    injectable for tests."""

    def __init__(
        self,
        threads: int,
        set_threads: Callable[[int], None],
        *,
        environ: Mapping[str, str] | None = None,
        interval: float | None = None,
        busy: Callable[[], int | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threads = threads
        self.set_threads = set_threads
        self.processes = local_processes(environ)
        self.cores = usable_cores()
        self.cap = _cap(self.cores, self.processes)
        self.interval = float(RECHECK_S if interval is None else interval)
        self.busy = busy or (lambda: busy_elsewhere(self.cores))
        self.clock = clock
        self._next = clock() + self.interval
        self._proposed: int | None = None

    @classmethod
    def for_setting(
        cls, setting: Any, threads: int, set_threads: Callable[[int], None]
    ) -> ThreadGovernor | None:
        """The governor of a run whose ``run.threads`` is ``setting`` and that runs on
        ``threads`` threads now; None when the count stays fixed (a number, ``null``, an
        explicit ``$OMP_NUM_THREADS``, or a load this process cannot see)."""
        if setting != AUTO or os.environ.get("OMP_NUM_THREADS", "").strip():
            return None
        if busy_elsewhere(usable_cores(), samples=1) is None:
            return None
        return cls(threads, set_threads)

    def tick(self) -> dict[str, int] | None:
        """At a step's end: ``{"threads", "previous", "busy"}`` when the count changed now,
        else None (almost always: one clock read)."""
        now = self.clock()
        if now < self._next:
            return None
        self._next = now + self.interval
        busy = self.busy()
        if busy is None:
            return None
        wanted = _fit(self.cores, self.processes, self.cap, busy, siblings=self.threads)
        if wanted == self.threads:
            self._proposed = None
            return None
        if wanted > self.threads and self._proposed != wanted:
            self._proposed = wanted  # more threads: the next reading must agree
            return None
        previous, self.threads, self._proposed = self.threads, wanted, None
        self.set_threads(wanted)
        log.info(
            "threads: %d -> %d (run.threads: auto; %d runnable tasks of other work on %d cores)",
            previous,
            wanted,
            busy,
            self.cores,
        )
        return {"threads": wanted, "previous": previous, "busy": busy}


def resolve_threads(setting: Any) -> int | None:
    """The thread count for a ``run.threads`` value: ``auto`` resolved here, a number as it
    is, ``None`` for torch's own default (left alone)."""
    if setting == AUTO:
        return auto_threads()
    return None if setting is None else int(setting)


def apply_threads(setting: Any) -> int:
    """Set torch's intra-op threads for ``run.threads`` (``auto``, a number, or ``None`` for
    torch's default), log the number (``threads: N``) and return it."""
    import torch

    count = resolve_threads(setting)
    if count is not None and torch.get_num_threads() != count:
        torch.set_num_threads(count)
    threads = torch.get_num_threads()
    shown = "null" if setting is None else setting
    log.info("threads: %d (run.threads: %s)", threads, shown)
    return threads
