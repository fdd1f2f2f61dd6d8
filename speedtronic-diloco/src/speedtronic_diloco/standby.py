"""Standby masters (``distributed.failover: true``): a worker that watches the master's lease
and takes it when it lapses, so a run survives its master's machine dying.

* **Announcing.** A standby writes ``standbys/<node_id>.json`` once (best effort), so
  ``speedtronic diloco status`` lists the standbys seen.
* **Watching.** At every poll (``poll_interval``) it reads ``global/lease.json``. A live lease
  is left alone; a released one too (its master ended on purpose; a new master starts without
  ``--take-over``), and so is a store without a lease (its master has not started yet).
* **Lapsed.** A lease that expired more than :data:`~speedtronic_diloco.lease.CLOCK_MARGIN` ago
  (not renewed) is replaced by this node's lease with ``epoch + 1`` by the store's
  compare-and-swap (:meth:`~speedtronic_diloco.transports.base.Transport.write_lease`: a
  rename under the lock on a shared directory, a commit on the read head on the Hub). Of
  standbys racing, exactly one write succeeds; the others get a conflict and go on as workers.
* **Hostile.** A lease that cannot be the run's (an expiry further ahead than ``lease_ttl`` plus
  :data:`~speedtronic_diloco.lease.CLOCK_SKEW_SLACK`, a holder that is no node id, an epoch
  below the one the current global was published under, or a file that does not parse) is
  counted invalid (:attr:`Standby.invalid`) with one warning line, and treated as expired once
  it stayed unchanged for ``lease_ttl`` plus the margin: no lease file makes a standby wait
  longer than a real master's would.

The winner's :class:`~speedtronic_diloco.lease.LeaseKeeper` (renewing from then on) is what
:meth:`Standby.check` returns; the coordinator then runs the master's outer loop in this
process (:meth:`~speedtronic_diloco.coordinator.DumbDiLoCoCoordinator.after_optimizer_step`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from speedtronic.errors import TransportError
from speedtronic_diloco.identity import is_valid_node_id
from speedtronic_diloco.lease import CLOCK_MARGIN, CLOCK_SKEW_SLACK, LeaseKeeper, describe_lease
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.transports.base import (
    LEASE_FILE,
    Lease,
    LeaseConflictError,
    MalformedLeaseError,
    PermanentTransportError,
    Transport,
    UnsupportedOperation,
)
from speedtronic_diloco.transports.side_files import (
    STANDBY_DIR,
    STANDBY_LIMIT,
    side_files_of,
    standby_path,
)

__all__ = ["MAX_LISTED", "Standby", "Takeover", "read_standbys"]

MAX_LISTED = 50
"""Standby records ``speedtronic diloco status`` reads at most."""

log = logging.getLogger("speedtronic.diloco.standby")


class Takeover:
    """What a won take-over replaced: the previous holder and epoch, and the new keeper."""

    def __init__(self, keeper: LeaseKeeper, previous: Lease | None, lapsed_for_s: float) -> None:
        self.keeper = keeper
        self.previous = previous
        self.lapsed_for_s = lapsed_for_s  # seconds from the old lease's expiry to the take-over

    @property
    def previous_master(self) -> str | None:
        return self.previous.holder if self.previous is not None else None

    @property
    def epoch(self) -> int:
        lease = self.keeper.lease
        assert lease is not None
        return lease.epoch


class Standby:
    """This node's watch on the master's lease (see the module docstring). ``clock`` (wall
    time, as leases use) and ``monotonic`` are injectable for tests."""

    def __init__(
        self,
        transport: Transport,
        node_id: str,
        *,
        ttl: float,
        retry: RetryPolicy | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        published_epoch: Callable[[], int | None] | None = None,
    ) -> None:
        self.transport = transport
        self.node_id = node_id
        self.ttl = float(ttl)
        self.retry = retry or RetryPolicy()
        self.clock = clock
        self.monotonic = monotonic
        #: ``() -> lease_epoch`` of the store's current global (None: none published).
        self.published_epoch = published_epoch or self._published_epoch
        #: Lease files counted invalid (each distinct one once).
        self.invalid = 0
        self.won: Takeover | None = None
        #: True once the store turned out to have no lease (nothing to take over).
        self.unsupported = False
        self._reported: set[str] = set()  # invalid leases already counted and reported
        self._suspect: tuple[bytes, float] | None = None  # an invalid lease, first seen at
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ announcing
    def announce(self, directory: Path) -> bool:
        """Write this node's standby record (best effort); True when written."""
        files = side_files_of(self.transport)
        if files is None:
            return False
        record = {"node_id": self.node_id, "announced_at": self.clock(), "lease_ttl": self.ttl}
        directory.mkdir(parents=True, exist_ok=True)
        local = directory / "standby.json"
        local.write_text(json.dumps(record))
        try:
            files.write_side_file(standby_path(self.node_id), local)
        except TransportError as exc:
            log.info(
                "announcing standby %r failed (%s); status will not list it", self.node_id, exc
            )
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                local.unlink()
        return True

    # ------------------------------------------------------------------ watching
    def check(self, stop: threading.Event | None = None) -> Takeover | None:
        """One look at the lease; the :class:`Takeover` when this node won it now or before."""
        if self.won is not None:
            return self.won
        stop = stop or self._stop
        floor = 0
        try:
            current = self.retry.call(
                f"reading the lease of {self.transport.description}",
                self.transport.read_lease,
                stop,
            )
        except UnsupportedOperation:
            if not self.unsupported:
                self.unsupported = True
                log.info(
                    "%s has no lease: standby %r cannot take over",
                    self.transport.description,
                    self.node_id,
                )
            return None
        except PermanentTransportError as exc:  # malformed: hostile or broken
            if isinstance(exc, MalformedLeaseError) and exc.epoch is not None:
                floor = exc.epoch
            if not self._invalid_long_enough(str(exc).encode(), str(exc), str(exc)):
                return None
            current = None
        except TransportError as exc:
            log.info("standby %r: reading the lease failed (%s)", self.node_id, exc)
            return None
        else:
            if current is None or current.released:
                self._suspect = None
                return None
            problem = self._problem(current)
            if problem is not None:
                key = f"{current.holder}/{current.epoch}/{current.instance}"
                if not self._invalid_long_enough(current.dumps(), key, problem):
                    return None
            elif self.clock() < current.expires_at + CLOCK_MARGIN:
                self._suspect = None
                return None
        return self._take(current, floor, stop)

    def _problem(self, lease: Lease) -> str | None:
        """Why ``lease`` cannot be this run's master's (None when it can)."""
        where = f"{self.transport.description}: {LEASE_FILE}"
        ahead = lease.expires_at - self.clock()
        if ahead > self.ttl + CLOCK_SKEW_SLACK:
            return (
                f"{where}: expires_at is {ahead:.0f} s ahead, more than lease_ttl "
                f"({self.ttl:g} s) plus {CLOCK_SKEW_SLACK:g} s of clock skew (holder "
                f"{lease.holder!r}, epoch {lease.epoch})"
            )
        if not is_valid_node_id(lease.holder):
            return f"{where}: holder {lease.holder[:100]!r} is not a node id"
        published = self.published_epoch()
        if published is not None and lease.epoch < published:
            return (
                f"{where}: epoch {lease.epoch} of {lease.holder!r} is below the epoch "
                f"{published} the current global was published under: not this run's lease"
            )
        return None

    def _invalid_long_enough(self, content: bytes, key: str, problem: str) -> bool:
        """Count and report an invalid lease once (per holder, epoch and instance: a holder
        that renews it is reported once); True once it stayed unchanged for ``lease_ttl``
        plus the margin (then it is taken like an expired one; a renewed one is alive)."""
        now = self.monotonic()
        if self._suspect is None or self._suspect[0] != content:
            self._suspect = (content, now)
        if key not in self._reported:
            if len(self._reported) > 1000:
                self._reported.clear()
            self._reported.add(key)
            self.invalid += 1
            log.warning(
                "standby %r: invalid lease (%s); taking it over if it stays unchanged for %g s",
                self.node_id,
                problem,
                self.ttl + CLOCK_MARGIN,
            )
        return now - self._suspect[1] >= self.ttl + CLOCK_MARGIN

    def _published_epoch(self) -> int | None:
        try:
            metadata = self.transport.read_global_metadata()
        except TransportError:
            return None
        return metadata.lease_epoch if metadata is not None else None

    def _take(self, current: Lease | None, floor: int, stop: threading.Event) -> Takeover | None:
        """Compare-and-swap this node's lease over ``current``; None when another won."""
        now = self.clock()
        epoch = max(current.epoch if current is not None else floor, self.published_epoch() or 0)
        fresh = Lease(self.node_id, epoch + 1, now + self.ttl, now, uuid.uuid4().hex[:12])
        try:
            self.retry.call(
                f"taking the lease of {self.transport.description}",
                lambda: self.transport.write_lease(fresh, current),
                stop,
            )
        except LeaseConflictError as exc:
            holder = describe_lease(exc.current) if exc.current is not None else "nobody"
            log.info("standby %r: another node took the lease first (%s)", self.node_id, holder)
            self._suspect = None
            return None
        except TransportError as exc:
            log.info("standby %r: taking the lease failed (%s)", self.node_id, exc)
            return None
        keeper = LeaseKeeper(
            self.transport, self.node_id, ttl=self.ttl, retry=self.retry, failover=True
        )
        keeper.hold(fresh)
        keeper.start()
        lapsed = now - current.expires_at if current is not None else 0.0
        self.won = Takeover(keeper, current, lapsed)
        return self.won

    # ------------------------------------------------------------------ thread
    def start(self, interval: float, on_win: Callable[[Takeover], None]) -> None:
        """Check every ``interval`` seconds in a daemon thread until won (then ``on_win``) or
        :meth:`stop` (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, args=(interval, on_win), name="diloco-standby", daemon=True
        )
        self._thread.start()

    def _loop(self, interval: float, on_win: Callable[[Takeover], None]) -> None:
        while not self._stop.wait(max(interval, 0.05)):
            try:
                won = self.check(self._stop)
            except Exception:  # the watch must outlive one bad look
                log.exception("standby %r: watching the lease failed", self.node_id)
                continue
            if won is not None:
                on_win(won)
                if self.won is not None:  # not re-armed by a failed take-over
                    return

    def stop(self, timeout: float = 5.0) -> None:
        """Stop watching (a won lease keeps renewing: it belongs to the master now)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(max(0.0, timeout))

    def rearm(self) -> None:
        """Watch again after this node's master was fenced (its own take-over is history)."""
        self.won = None
        self._suspect = None


def read_standbys(transport: Transport, directory: Path) -> list[dict[str, Any]]:
    """The standby records of the store (``node_id``, ``announced_at``), newest first, at
    most :data:`MAX_LISTED`; records that are not ours (too large, not JSON, a node id that
    does not match the file) are skipped."""
    files = side_files_of(transport)
    if files is None:
        return []
    records = []
    listed = files.list_side_files(STANDBY_DIR)[:MAX_LISTED]
    directory.mkdir(parents=True, exist_ok=True)
    for index, (path, size) in enumerate(listed):
        if size > STANDBY_LIMIT:
            continue
        local = directory / f"standby{index}.json"
        try:
            files.read_side_file(path, local, size=size)
            data = json.loads(local.read_text(encoding="utf-8"))
            node, when = str(data["node_id"]), float(data["announced_at"])
        except (TransportError, ValueError, KeyError, TypeError, UnicodeDecodeError):
            continue
        finally:
            with contextlib.suppress(FileNotFoundError):
                local.unlink()
        if path == standby_path(node) and math.isfinite(when):
            records.append({"node_id": node, "announced_at": when})
    return sorted(records, key=lambda r: -r["announced_at"])
