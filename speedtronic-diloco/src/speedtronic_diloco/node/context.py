"""What every room of a node shares: its settings, store, retry policy, lock, live state,
fragments and event queue."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speedtronic_diloco.codecs import CodecSpec, ErrorFeedback, residual_survives
from speedtronic_diloco.config import DistributedConfig
from speedtronic_diloco.node.fragments import NodeFragments
from speedtronic_diloco.node.state import NodeState
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.transports.base import Transport

__all__ = ["NodeContext"]

log = logging.getLogger("speedtronic.diloco")


@dataclass
class NodeContext:
    """A node's shared parts. ``state`` and ``feedback`` change under ``lock`` only, in the
    applier of the rooms' decisions (:func:`~speedtronic_diloco.node.decisions.apply`)."""

    config: DistributedConfig
    node_id: str
    transport: Transport
    retry: RetryPolicy
    state: NodeState
    fragments: NodeFragments
    codec: CodecSpec
    feedback: ErrorFeedback
    state_root: Path
    cache_dir: Path
    key: bytes | None = field(default=None, repr=False)  # never logged or saved
    lock: threading.RLock = field(default_factory=threading.RLock)
    stop: threading.Event = field(default_factory=threading.Event)
    events: queue.SimpleQueue[tuple[str, dict[str, Any]]] = field(default_factory=queue.SimpleQueue)
    feedback_epoch: int = 0  # +1 at every reset: an upload encoded before does not commit

    def queue_event(self, event: str, payload: dict[str, Any]) -> None:
        """Queue a metric event; the training thread emits it (see the coordinator)."""
        self.events.put((event, {"node_id": self.node_id, **payload}))

    def reset_residual(self, previous: int, new: int, names: Any = None) -> bool:
        """The error-feedback reset rule (:func:`~speedtronic_diloco.codecs.residual_survives`)
        for installing global ``new`` after ``previous`` (caller holds the lock); True when
        the residual was dropped."""
        if not self.feedback.residual or residual_survives(
            previous, new, self.config.max_staleness
        ):
            return False
        self.feedback.reset(names)
        self.feedback_epoch += 1
        log.info(
            "error feedback: residual dropped (global outer step %d after %d does not continue it)",
            new,
            previous,
        )
        return True
