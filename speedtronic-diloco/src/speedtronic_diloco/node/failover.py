"""A node's part in fail-over (``distributed.failover: true``): the standby watch of a worker
(:mod:`speedtronic_diloco.standby`), the take-over (the outer loop built and started in the watch's
thread from the outer state the store keeps; the training thread then emits
``master_takeover``), and a fenced master going on as a worker.

The node keeps training through all of it: its deltas go through the store to whichever
master holds the lease, its own included.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from speedtronic_diloco.lease import LeaseKeeper
from speedtronic_diloco.standby import Standby, Takeover
from speedtronic_diloco.transports.base import LeaseError

if TYPE_CHECKING:
    from speedtronic_diloco.master.loop import MasterOuterLoop
    from speedtronic_diloco.node.context import NodeContext

__all__ = ["Failover", "succeed"]

log = logging.getLogger("speedtronic.diloco")


class Failover:
    """One node's fail-over. ``build_master(lease)`` builds (does not start) the outer loop
    on a lease already held; ``ctx`` is the node's context (its events, stop, retry)."""

    def __init__(
        self, ctx: NodeContext, build_master: Callable[[LeaseKeeper], MasterOuterLoop]
    ) -> None:
        self.ctx = ctx
        self.build_master = build_master
        config = ctx.config
        self.interval = config.poll_interval
        self.standby = Standby(ctx.transport, ctx.node_id, ttl=config.lease_ttl, retry=ctx.retry)
        self._ready: tuple[MasterOuterLoop, Takeover, int] | None = None
        self._lock = threading.Lock()
        self._announced = False

    def watch(self) -> None:
        """Start (or resume) the standby watch in its own thread."""
        self.standby.rearm()
        self.standby.start(self.interval, self._won)

    def _won(self, takeover: Takeover) -> None:
        """In the watch thread: build the master on the won lease and start its rounds."""
        try:
            outer = self.build_master(takeover.keeper)
            succeed(outer, takeover.previous_master)
            at = outer.outer_step  # the step taken over (its rounds start right away)
            # Started here, not at the next training step: a node waiting at a sync
            # boundary may not take one for 2 x round_timeout, and the run's rounds are ours.
            outer.start(self.interval)
        except Exception as exc:  # the lease lapses again and another standby takes it
            log.error(
                "standby %r: taking over failed (%s); giving the lease up", self.ctx.node_id, exc
            )
            takeover.keeper.release()
            self.watch()
            return
        with self._lock:
            self._ready = (outer, takeover, at)

    def wake(self) -> None:
        """Wake the outer thread of a take-over the training thread has not picked up yet: a
        node waiting at its sync boundary calls this at every look, so the successor's first
        round closes within a look of its last delta whatever ``poll_interval`` is."""
        with self._lock:
            ready = self._ready
        if ready is not None:
            ready[0].thread.wake()

    def step(self, outer: MasterOuterLoop | None) -> MasterOuterLoop | None:
        """At each training step: the outer loop this node runs from now on (None: a worker).
        Starts the watch (first call), a take-over's loop (and emits ``master_takeover``),
        demotes a fenced master, and raises when a master's loop died of anything else."""
        if not self._announced:
            self._announced = True
            threading.Thread(target=self._announce, name="diloco-announce", daemon=True).start()
            if outer is None:  # a worker (or a master that found another holder): stand by
                self.watch()
        if outer is not None:
            if not isinstance(outer.failure, LeaseError):
                outer.raise_if_failed()
                return outer
            outer.stop(0.0)  # its thread ended; the lease keeper said so in one line
            self.watch()
            return None
        with self._lock:
            ready, self._ready = self._ready, None
        if ready is None:
            return None
        outer, takeover, at = ready
        fields: dict[str, Any] = {
            "previous_master": takeover.previous_master,
            "outer_step": at,
            "epoch": takeover.epoch,
            "lapsed_for_s": round(takeover.lapsed_for_s, 3),
        }
        log.warning(
            "DumbDiLoCo: %r took over as master from %r (lease epoch %d) at outer step %d",
            self.ctx.node_id,
            takeover.previous_master,
            takeover.epoch,
            at,
        )
        self.ctx.queue_event("master_takeover", fields)
        return outer

    def _announce(self) -> None:
        self.standby.announce(self.ctx.state_root / "standby")

    def stop(self) -> None:
        """Stop watching; a take-over the training thread never picked up stops its rounds
        and gives its lease up."""
        self.standby.stop()
        with self._lock:
            ready, self._ready = self._ready, None
        if ready is not None:
            ready[0].stop()
            ready[1].keeper.release()


def succeed(outer: MasterOuterLoop, previous_master: str | None) -> None:
    """Before a successor's loop starts: the nodes of the store's ledger are the run's (its
    first rounds are over, so ``min_deltas`` waits for no one to arrive), and the master it
    replaced is gone until it uploads a delta past those the store holds now. Without this the
    dead master counted as live and every round waited ``round_timeout`` for it."""
    known = outer.keeper.known_nodes()
    outer.policy.known(known)
    if previous_master is None or previous_master == outer.node_id:
        return
    listing = outer.intake.list_deltas() or []
    steps = [i.local_step for i in listing if i.node_id == previous_master]
    outer.membership.presume_gone(previous_master, max([*steps, known.get(previous_master, -1)]))
