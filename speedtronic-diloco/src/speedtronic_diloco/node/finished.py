"""A worker that joins (or outlives) a finished run: nothing will ever read its deltas.

A run is *finished* when its master ended on purpose after its last step: the lease it held is
released (``global/lease.json``, ``released: true``) and the holder's left record says
``max_steps`` (``nodes/<master>/left.json``). A master that stopped on a signal (``stopped``),
crashed, or lost its lease is not finished: it may come back, and standbys may take over. A
master that is started again (a resume with more steps) deletes its left record and takes a
fresh lease, so the run is live again.

What a worker does then is ``distributed.finished_run``:

* ``stop`` (default): one line naming the store, the master and the final outer step, and the
  run ends with exit status :data:`EXIT_RUN_FINISHED` (3), before its first step when it
  joined a finished run, at its next look when the master finished first;
* ``train_alone``: the same line, then the node trains on with no uploads and no polls.

A worker looks at start, then at its inner-loop boundaries and while a sync boundary waits for
its round's global, at most once per :func:`finished_interval` (one lease read; the left
records only once the lease is released).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from speedtronic.errors import SpeedtronicError, TransportError
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.transports.base import Transport, UnsupportedOperation
from speedtronic_diloco.transports.members import member_records_of

if TYPE_CHECKING:
    from speedtronic_diloco.node.context import NodeContext

__all__ = [
    "EXIT_RUN_FINISHED",
    "FinishedRun",
    "FinishedWatch",
    "RunFinishedError",
    "finished_interval",
    "run_finished",
]

log = logging.getLogger("speedtronic.diloco")

EXIT_RUN_FINISHED = 3
"""The exit status of ``speedtronic train`` on a worker that found its run finished."""


def finished_interval(config: Any) -> float:
    """Seconds between a worker's looks: 10 (at least ``poll_interval``, at most
    ``lease_ttl``), so a sync worker whose master finished waits about that long, not
    2 x ``round_timeout`` at each remaining boundary."""
    return max(config.poll_interval, min(config.lease_ttl, 10.0))


@dataclass(frozen=True)
class FinishedRun:
    """A finished run: its master, the master's last local step, the final outer step."""

    store: str
    master: str
    last_step: int
    outer_step: int | None

    def describe(self) -> str:
        step = "?" if self.outer_step is None else str(self.outer_step)
        return (
            f"the DumbDiLoCo run on {self.store} is finished: master {self.master!r} ended "
            f"after its step {self.last_step} and published its final global (outer step {step})"
        )


class RunFinishedError(SpeedtronicError):
    """This worker's run is finished (``distributed.finished_run: stop``)."""

    exit_code = EXIT_RUN_FINISHED

    def __init__(self, finished: FinishedRun) -> None:
        super().__init__(
            f"{finished.describe()}; this worker's deltas would never be read, so it stops "
            f"(exit {EXIT_RUN_FINISHED}; set distributed.finished_run=train_alone to train on "
            "without uploading)"
        )
        self.finished = finished


def run_finished(
    transport: Transport, retry: RetryPolicy, stop: threading.Event | None = None
) -> FinishedRun | None:
    """The store's run as a :class:`FinishedRun` when its master finished (see the module
    docstring), else None (also when the store cannot be read now, or keeps no lease or left
    records)."""
    try:
        lease = transport.read_lease()
    except (UnsupportedOperation, TransportError):
        return None
    members = member_records_of(transport)
    if lease is None or not lease.released or members is None:
        return None
    try:
        record = members.read_left().records.get(lease.holder)
    except (UnsupportedOperation, TransportError):
        return None
    if record is None or record.reason != "max_steps":
        return None
    _, metadata = retry.attempt(
        f"reading global metadata from {transport.description}",
        transport.read_global_metadata,
        stop,
    )
    outer_step = metadata.outer_step if metadata is not None else None
    return FinishedRun(transport.description, lease.holder, record.last_step, outer_step)


class FinishedWatch:
    """A worker's looks at whether its run finished, at most once per ``interval`` seconds,
    and what follows (``distributed.finished_run``). ``monotonic`` is injectable for tests."""

    def __init__(
        self,
        ctx: NodeContext,
        *,
        interval: float,
        monotonic: Callable[[], float] | None = None,
    ) -> None:
        self.ctx = ctx
        self.interval = float(interval)
        self.clock = monotonic or time.monotonic
        self.found: FinishedRun | None = None
        #: True once the run was found finished with ``finished_run: train_alone``.
        self.alone = False
        self._next = -float("inf")

    def look(self, *, now: bool = False) -> FinishedRun | None:
        """The finished run, when one is found now or was before; ``now`` looks whatever the
        interval says."""
        if self.found is not None:
            return self.found
        at = self.clock()
        if not now and at < self._next:
            return None
        self._next = at + self.interval
        ctx = self.ctx
        self.found = run_finished(ctx.transport, ctx.retry, ctx.stop)
        if self.found is not None:
            log.warning("DumbDiLoCo: %s", self.found.describe())
        return self.found

    def alone_now(self, *, now: bool = False) -> bool:
        """After a :meth:`look`: raise :class:`RunFinishedError` (``finished_run: stop``), or
        return True once this node trains alone (``train_alone``); False while the run goes
        on."""
        found = self.look(now=now)
        if found is None:
            return False
        if self.ctx.config.finished_run == "stop":
            raise RunFinishedError(found)
        if not self.alone:
            self.alone = True
            log.warning("DumbDiLoCo %r: training on alone, uploading nothing", self.ctx.node_id)
            self.ctx.queue_event("run_finished", {"master": found.master, "alone": True})
        return True
