"""``rounds: sync`` on a node: after delivering its delta at a boundary the node waits for the
global of that round (as DiLoCo and torchft do) and installs it before its next inner loop.

Every wait is a bounded poll on a condition, so a dead master or store never blocks a node for
good: past 2 x ``round_timeout`` (the master closes a round within ``round_timeout`` of its first
delta) the node trains on, warned, and its next boundary waits again. A node whose round closed
without it (it was late) finds a newer global at once and installs it: it is back in the next
round, and the master refuses its late delta (``late``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from torch import nn

from speedtronic_diloco.node.context import NodeContext
from speedtronic_diloco.node.install import Installer
from speedtronic_diloco.node.lanes import Lane
from speedtronic_diloco.round_mode import round_mode
from speedtronic_diloco.transports.base import LeaseError, Transport

__all__ = ["SYNC_POLL_S", "await_first_global", "await_round", "join_run", "wait_look_interval"]

log = logging.getLogger("speedtronic.diloco")

#: The longest pause between two looks for the round's global (``poll_interval`` when that is
#: shorter): a waiting node notices its round's global within a second even when it polls the
#: store rarely between boundaries, without reading a Hub's metadata many times a second.
SYNC_POLL_S = 1.0
#: The shortest pause (``poll_interval: 0`` would spin).
SYNC_POLL_MIN_S = 0.05


def wait_look_interval(poll_interval: float, transport: Transport) -> float:
    """Seconds between two looks of a waiting node: ``poll_interval`` capped at
    :data:`SYNC_POLL_S`, at least :data:`SYNC_POLL_MIN_S` and the store's
    ``min_wait_look_s`` (the Hub's is 2 s)."""
    shortest = max(SYNC_POLL_MIN_S, transport.min_wait_look_s)
    return max(shortest, min(poll_interval, SYNC_POLL_S))


def _interval(ctx: NodeContext) -> float:
    return wait_look_interval(ctx.config.poll_interval, ctx.transport)


def await_first_global(ctx: NodeContext) -> Any:
    """A worker that starts before the master published waits for the first global (at most
    2 x ``round_timeout``), or its first delta would belong to no round. The global's
    metadata, or None."""
    deadline = time.monotonic() + 2 * ctx.config.round_timeout
    log.info("rounds: sync: waiting for the master's first global")
    while not ctx.stop.wait(_interval(ctx)):
        _, metadata = ctx.retry.attempt(
            f"reading global metadata from {ctx.transport.description}",
            ctx.transport.read_global_metadata,
            ctx.stop,
        )
        if metadata is not None or time.monotonic() >= deadline:
            return metadata
    return None


def await_round(
    ctx: NodeContext,
    installer: Installer,
    model: nn.Module,
    base: int,
    due: tuple[int, ...],
    outer: Any,
    poll_lane: Lane | None,
    finished: Callable[[], bool] | None = None,
    wake: Callable[[], None] | None = None,
) -> bool:
    """Right after this node delivered its delta computed from global ``base``: wait for a
    newer global (the round's, or a later one when the round closed without this node) and
    install it; True when one was installed. ``outer`` is the master's outer loop (None on a
    worker, which fetches through ``poll_lane`` when it has one). ``finished()`` True (the run
    finished: :mod:`~speedtronic_diloco.node.finished`) ends the wait at once: no global will
    come. A worker calls ``wake()`` at every look (a standby's take-over, whose outer thread
    may close this round: :meth:`~speedtronic_diloco.node.failover.Failover.wake`)."""
    started = time.monotonic()
    deadline = started + 2 * ctx.config.round_timeout
    while True:
        installed = None
        if outer is not None:
            if ctx.config.failover and isinstance(outer.failure, LeaseError):
                return False  # fenced: the next step goes on as a worker (node.failover)
            outer.raise_if_failed()  # a dead outer thread stops the run, loudly
            outer.thread.wake()  # the round may be complete now: look at once, not in poll_interval
            snapshot = outer.snapshot(published=ctx.config.failover)  # never a fenced global
            if snapshot is not None and snapshot[0] > base:
                installed = installer.install(model, *snapshot, due=due)
        else:
            if wake is not None:
                wake()
            if poll_lane is not None:
                poll_lane.submit(installer.fetch_newer)  # refused while a fetch runs: fine
            else:
                installer.fetch_newer(stash=True)
            with ctx.lock:
                ready = installer.ready
            if ready is not None and ready[0] > base:
                installed = installer.install_ready(model, due)
        if installed is not None:
            waited = round(time.monotonic() - started, 3)
            with ctx.lock:
                step = ctx.state.last_global_step
            ctx.queue_event("round_waited", {"outer_step": step, "waited_s": waited})
            return installed
        if finished is not None and finished():
            return False
        if time.monotonic() >= deadline or ctx.stop.wait(_interval(ctx)):
            break
    waited = time.monotonic() - started
    log.warning(
        "rounds: sync: no global newer than outer step %d after %.0f s; training on (the next "
        "boundary waits again)",
        base,
        waited,
    )
    ctx.queue_event("round_wait_timeout", {"base_outer_step": base, "waited_s": round(waited, 3)})
    return False


def join_run(ctx: NodeContext, installer: Installer, model: nn.Module) -> None:
    """A worker's start: install the store's current global, if there is one (with sync
    rounds, wait for the first one); a store that cannot be read now leaves the local weights
    (polling finds the global later)."""
    read, metadata = ctx.retry.attempt(
        f"reading global metadata from {ctx.transport.description}",
        ctx.transport.read_global_metadata,
        ctx.stop,
        then="training on local weights",
    )
    if read and metadata is None and round_mode(ctx.config.rounds).waits_for_first_global:
        metadata = await_first_global(ctx)
    if read and metadata is None:
        log.info("no global weights published yet; training on local weights")
    if metadata is None:
        return
    tensors = installer.fetch(metadata)
    if tensors is not None:
        installer.install(model, metadata.outer_step, tensors)
