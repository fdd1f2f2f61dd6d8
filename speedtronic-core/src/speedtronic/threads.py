"""How many CPU threads torch's intra-op work gets: ``run.threads`` and its default ``auto``.

``auto`` is the cores this process may run on (its CPU affinity and the cgroup's CPU quota),
divided by the processes of this run on this machine, and never more than the physical cores:

- the processes of a run on one machine are ``$LOCAL_WORLD_SIZE`` (set by torchrun and by
  ``speedtronic train --nproc-per-node``) or ``$SPEEDTRONIC_LOCAL_PROCESSES`` (say it when you
  start several nodes of a DiLoCo run, or any other group of training processes, on one
  machine yourself);
- an explicit ``$OMP_NUM_THREADS`` wins, as it does for torch.

This module never imports torch: the CLI calls :func:`prepare_threads` before torch is loaded,
because the OpenMP runtime reads its settings once, when it is loaded. Besides the count, for
``auto`` or a number (not for ``null``, torch's untouched default) it sets
``OMP_WAIT_POLICY=PASSIVE`` unless the environment already sets it: by default an idle OpenMP
worker spins on its core for a while before it sleeps, and on a machine whose cores are busy
with other work that spinning takes the time the working threads need; a 2-thread step then
waits for a descheduled spinner (measured 6-8x slower under load: ``benchmarks/threads.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "AUTO",
    "LOCAL_PROCESSES_ENV",
    "apply_threads",
    "auto_threads",
    "local_processes",
    "physical_cores",
    "prepare_threads",
    "resolve_threads",
    "usable_cores",
]

log = logging.getLogger("speedtronic.threads")

AUTO = "auto"
LOCAL_PROCESSES_ENV = "SPEEDTRONIC_LOCAL_PROCESSES"
# Environment for the OpenMP runtime, set only when the user has not set it.
_OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


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


def auto_threads(environ: Mapping[str, str] | None = None) -> int:
    """The thread count ``run.threads: auto`` stands for in this process."""
    env = os.environ if environ is None else environ
    explicit = env.get("OMP_NUM_THREADS", "").strip()
    if explicit.isdigit() and int(explicit) >= 1:
        return int(explicit)
    cores = usable_cores()
    physical = physical_cores()
    if physical is not None:
        cores = min(cores, physical)
    return max(1, cores // local_processes(env))


def resolve_threads(setting: Any) -> int | None:
    """The thread count for a ``run.threads`` value: ``auto`` resolved here, a number as it
    is, ``None`` for torch's own default (left alone)."""
    if setting == AUTO:
        return auto_threads()
    return None if setting is None else int(setting)


def prepare_threads(setting: Any) -> int | None:
    """Before torch is imported: give the OpenMP runtime its settings (only the ones the
    environment leaves unset) unless ``setting`` is ``None`` (torch's defaults, untouched).
    Returns the thread count to apply after import."""
    if setting is not None:
        for name, value in _OPENMP_ENV.items():
            os.environ.setdefault(name, value)
    return resolve_threads(setting)


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
