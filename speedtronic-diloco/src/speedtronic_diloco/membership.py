"""Membership: which nodes the master counts as live.

* A node whose run ends (its ``run.max_steps``, a stop signal, an error) writes a *left*
  record in the store, ``nodes/<node_id>/left.json`` with its last local step
  (:func:`announce_left`); a node that starts (a resume) deletes its record first
  (:func:`announce_back`). Both are best effort: a store that cannot be reached is a warning,
  and the silence rule below still applies.
* The master reads every record at each poll (:class:`Membership`). A node with a record is
  gone, unless the store holds a delta of it with a local step past the record's last step
  (it came back before its record was deleted).
* A node that sends no delta for ``lease_ttl`` seconds (or 2 x ``round_timeout`` when that is
  shorter) is gone too (:class:`~speedtronic_diloco.master.round_policy.RoundPolicy`), except
  that with ``rounds: sync`` a node waiting for the last round's global stays expected until a
  round times out without it.

``min_deltas`` (and the sync-round close rule) count live nodes only, so the master's rounds
continue with the nodes that are alive. The record format and its checks are in
:mod:`speedtronic_diloco.transports.members`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

from speedtronic.errors import TransportError
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.transports.base import DeltaInfo, Transport, UnsupportedOperation
from speedtronic_diloco.transports.members import LEFT_REASONS, LeftRecord, member_records_of

__all__ = ["Membership", "announce_back", "announce_left", "left_reason"]

log = logging.getLogger("speedtronic.diloco.members")

_WARNED_LIMIT = 1000


def left_reason(error: BaseException | None, step: int, max_steps: int) -> str:
    """Why a run ended, as a left record says it: ``error`` (it raised), ``max_steps`` (its
    last step was ``run.max_steps``) or ``stopped`` (a stop signal before that)."""
    if error is not None:
        return "error"
    return "max_steps" if step >= max_steps else "stopped"


def announce_left(
    transport: Transport,
    node_id: str,
    last_step: int,
    reason: str,
    *,
    retry: RetryPolicy,
    stop: threading.Event | None = None,
) -> bool:
    """Write ``node_id``'s left record (retried like any store write); False when the store
    keeps no records or the write failed (logged)."""
    members = member_records_of(transport)
    if members is None:
        return False
    if reason not in LEFT_REASONS:
        raise ValueError(f"left reason {reason!r} is not one of {', '.join(LEFT_REASONS)}")
    record = LeftRecord(node_id, max(0, int(last_step)), reason, time.time())
    done, _ = retry.attempt(
        f"writing the left record of {node_id} to {transport.description}",
        lambda: members.write_left(record),
        stop,
    )
    if done:
        log.info("node %r left after step %d (%s)", node_id, record.last_step, reason)
    return bool(done)


def announce_back(
    transport: Transport, node_id: str, *, retry: RetryPolicy, stop: threading.Event | None = None
) -> bool:
    """Delete ``node_id``'s left record, if any (a node starting again is live again); False
    when the store keeps no records or the deletion failed (logged)."""
    members = member_records_of(transport)
    if members is None:
        return False
    done, _ = retry.attempt(
        f"deleting the left record of {node_id} from {transport.description}",
        lambda: members.clear_left(node_id),
        stop,
    )
    return bool(done)


class Membership:
    """The master's view of the left records (see the module docstring).

    :meth:`gone` reads the records once per call, without retrying (the next poll reads
    again): a failed read keeps what the previous one found. Refused records (malformed or
    hostile files) are logged once each.
    """

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.records: dict[str, LeftRecord] = {}
        self.members = member_records_of(transport)
        self._supported = self.members is not None
        self._warned: set[str] = set()
        #: Nodes known dead without a record (the master a standby replaced): node -> the
        #: highest local step of theirs the store held then.
        self._presumed: dict[str, int] = {}

    def refresh(self) -> dict[str, LeftRecord]:
        """Read the store's left records now; returns them (the previous ones on failure)."""
        if not self._supported:
            return self.records
        assert self.members is not None
        try:
            listing = self.members.read_left()
        except UnsupportedOperation:
            self._supported = False
            return self.records
        except TransportError as exc:
            log.debug("reading left records failed (%s); trying again next poll", exc)
            return self.records
        for problem in listing.refused:
            if problem not in self._warned:
                if len(self._warned) >= _WARNED_LIMIT:
                    self._warned.clear()
                self._warned.add(problem)
                log.warning("%s; the left record is ignored", problem)
        self.records = dict(listing.records)
        return self.records

    def presume_gone(self, node_id: str, last_step: int) -> None:
        """Count ``node_id`` as gone without a record of its own (a master whose lease lapsed
        died without writing one) until the store holds a delta of it past ``last_step``."""
        self._presumed[node_id] = int(last_step)

    def gone(self, listing: Iterable[DeltaInfo]) -> set[str]:
        """The nodes that left: a record (or :meth:`presume_gone`), and no delta in
        ``listing`` (the store's) past its last step."""
        records = self.refresh()
        last = {node: record.last_step for node, record in records.items()}
        for node, step in self._presumed.items():
            last[node] = max(step, last.get(node, step))
        back = {
            info.node_id
            for info in listing
            if info.node_id in last and info.local_step > last[info.node_id]
        }
        for node in back & set(self._presumed):  # alive after all (a fenced master, say)
            del self._presumed[node]
        return set(last) - back
