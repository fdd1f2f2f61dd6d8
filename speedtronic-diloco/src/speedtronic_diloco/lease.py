"""One master per store: the lease in ``global/lease.json``, taken at start, renewed in the
background, and the fence every publication carries.

* **Taking it.** A starting master reads the lease. None, a released one, or one held under its
  own node id (a restarted master) is taken at once with ``epoch + 1``. A live lease of another
  master makes it refuse to start (:class:`LeaseHeldError`, naming the holder and when the lease
  expires). With ``distributed.take_over`` it waits for that expiry instead (bounded by the
  lease's remaining time; a holder that renews meanwhile is alive, and the start is refused),
  then takes the lease with ``epoch + 1``. An expired lease of another master is only taken with
  ``take_over``: the old master may merely be cut off. A lease that cannot be waited for (an
  expiry further ahead than ``lease_ttl`` plus :data:`CLOCK_SKEW_SLACK`, or a time that is no
  time) is refused at once, naming the file and field; with ``take_over`` it is taken at once.
* **Keeping it.** A background thread renews the lease every third of ``lease_ttl``. Every write
  is a compare-and-swap (:meth:`~speedtronic_diloco.transports.base.Transport.write_lease`): if
  the store holds another lease than the one last written, another master took over; the lease
  is then *lost*, and :meth:`LeaseKeeper.check` raises :class:`LeaseLostError` from then on.
* **The fence.** Every publication carries the holder and epoch (``GlobalMetadata.master``,
  ``lease_epoch``); the store accepts it only while its lease still names them (the Hub checks
  the lease at the commit it names as ``parent_commit``; the shared directory under an exclusive
  lock right before the final rename). So even a master that does not know yet that it lost its
  lease cannot overwrite its successor's work.
* **Giving it up.** :meth:`LeaseKeeper.release` (at stop) marks the lease released, so a
  successor can start at once without ``take_over``.

Leases use wall-clock time: the clocks of the machines that may be master must agree to well
within ``lease_ttl`` (NTP does). A store without leases (an injected test store) logs one line
and runs unfenced.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from speedtronic.errors import TransportError
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.timestamps import format_utc
from speedtronic_diloco.transports.base import (
    LEASE_FILE,
    Lease,
    LeaseConflictError,
    LeaseError,
    LeaseLostError,
    MalformedLeaseError,
    PermanentTransportError,
    Transport,
    UnsupportedOperation,
)

__all__ = ["LeaseHeldError", "LeaseKeeper", "LeaseLostError", "describe_lease"]

log = logging.getLogger("speedtronic.diloco.lease")

CLOCK_MARGIN = 1.0
"""Seconds a take-over waits past the old lease's expiry, for clock skew between machines."""

CLOCK_SKEW_SLACK = 60.0
"""Seconds a lease may expire beyond ``lease_ttl`` from now (the holder's clock ahead of ours)
before it is refused as impossible rather than waited for."""


class LeaseHeldError(LeaseError):
    """Another master holds the store's lease: this one refuses to start."""


def describe_lease(lease: Lease, now: float | None = None) -> str:
    """``'m1' (epoch 3, expires in 42 s at 2025-01-01 12:00:03 UTC)`` and the like."""
    now = time.time() if now is None else now
    if lease.released:
        state = "released"
    elif lease.expires_at > now:
        state = f"expires in {lease.expires_at - now:.0f} s at {format_utc(lease.expires_at)}"
    else:
        state = f"expired {now - lease.expires_at:.0f} s ago at {format_utc(lease.expires_at)}"
    return f"{lease.holder!r} (epoch {lease.epoch}, {state})"


class LeaseKeeper:
    """This master's lease on ``transport`` (see the module docstring).

    ``clock`` and ``sleep`` are injectable for tests. :attr:`lease` is the lease as last
    written; :attr:`supported` is False when the store has no leases (then nothing is fenced).
    """

    def __init__(
        self,
        transport: Transport,
        node_id: str,
        *,
        ttl: float,
        take_over: bool = False,
        retry: RetryPolicy | None = None,
        clock: Callable[[], float] = time.time,
        failover: bool = False,
    ) -> None:
        self.transport = transport
        self.failover = failover  # a lost lease makes this master a worker, not a stop
        self.node_id = node_id
        self.ttl = float(ttl)
        self.take_over = take_over
        self.retry = retry or RetryPolicy()
        self.clock = clock
        self.instance = uuid.uuid4().hex[:12]
        self.lease: Lease | None = None
        self.supported = True
        self.lost: str | None = None
        self.released = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ taking it
    def acquire(self, stop: threading.Event | None = None) -> Lease | None:
        """Take the lease, or raise :class:`LeaseHeldError`. Returns None (and logs) when the
        store has no leases; transient store failures are retried, then raised."""
        stop = stop or threading.Event()
        for _ in range(5):  # a lost compare-and-swap race is looked at again
            floor = 0  # the epoch of a malformed lease, when it could be read
            try:
                current = self.retry.call(
                    f"reading the lease of {self.transport.description}",
                    self.transport.read_lease,
                    stop,
                )
            except UnsupportedOperation:
                self.supported = False
                log.info(
                    "%s has no lease: running unfenced (one master per store is not enforced)",
                    self.transport.description,
                )
                return None
            except LeaseError:
                raise
            except PermanentTransportError as exc:  # a malformed lease.json
                if not self.take_over:
                    raise LeaseHeldError(
                        f"{exc}; refusing to start a master without knowing who holds the "
                        "lease (delete the file, or start with --take-over)"
                    ) from None
                log.warning("%s; taking the lease over", exc)
                current = None
                if isinstance(exc, MalformedLeaseError) and exc.epoch is not None:
                    floor = exc.epoch
            if not self._mine_to_take(current):
                problem = self._lease_problem(current)
                if problem is None:
                    current = self._wait_for_expiry(current, stop)
                elif not self.take_over:
                    raise LeaseHeldError(
                        f"{problem}; refusing to start a master on a lease that cannot be "
                        "trusted (check the holder's clock, or delete the file, or start with "
                        "--take-over)"
                    )
                else:
                    log.warning("%s; taking the lease over now", problem)
            fresh = Lease(
                holder=self.node_id,
                epoch=(current.epoch if current is not None else floor) + 1,
                expires_at=self.clock() + self.ttl,
                renewed_at=self.clock(),
                instance=self.instance,
            )
            try:
                self.retry.call(
                    f"taking the lease of {self.transport.description}",
                    lambda fresh=fresh, current=current: self.transport.write_lease(fresh, current),
                    stop,
                )
            except LeaseConflictError as exc:
                log.info("the lease changed while taking it (%s); reading it again", exc)
                continue
            with self._lock:
                self.lease, self.lost = fresh, None
            taken = f" from {describe_lease(current, self.clock())}" if current else ""
            log.info(
                "master lease of %s taken: epoch %d%s",
                self.transport.description,
                fresh.epoch,
                taken,
            )
            return fresh
        raise LeaseHeldError(
            f"{self.transport.description}: the lease kept changing while this master tried to "
            "take it: another master is starting at the same time. Run one master per store."
        )

    def _lease_problem(self, lease: Lease) -> str | None:
        """Why another master's lease cannot be waited for (None when it can): an expiry
        further ahead than a lease of ``ttl`` (plus clock skew) can reach; waiting for it would
        take a year. (A time that is no time is refused when the lease is read:
        :meth:`Lease.loads <speedtronic_diloco.transports.base.Lease.loads>`.)"""
        where = f"{self.transport.description}: {LEASE_FILE}"
        ahead = lease.expires_at - self.clock()
        if ahead > self.ttl + CLOCK_SKEW_SLACK:
            return (
                f"{where}: expires_at is {ahead:.0f} s ahead, more than lease_ttl "
                f"({self.ttl:g} s) plus {CLOCK_SKEW_SLACK:g} s of clock skew: the holder's "
                f"clock is far ahead or the file was forged (holder {lease.holder!r}, epoch "
                f"{lease.epoch})"
            )
        return None

    def _mine_to_take(self, current: Lease | None) -> bool:
        return current is None or current.released or current.holder == self.node_id

    def _wait_for_expiry(self, current: Lease, stop: threading.Event) -> Lease:
        """The lease to replace once another master's lease expired (take_over), else raise."""
        now = self.clock()
        held = describe_lease(current, now)
        if not self.take_over:
            hint = (
                "it may have died; to take over, start this master with --take-over "
                "(distributed.take_over: true)"
                if not current.live(now)
                else "run one master per store; to replace it once its lease expires, start "
                "this one with --take-over (distributed.take_over: true)"
            )
            raise LeaseHeldError(
                f"{self.transport.description}: master {held} holds the lease of this store; "
                f"refusing to start a second master ({hint})"
            )
        if not current.live(now):
            return current
        log.warning(
            "master %s holds the lease of %s; taking over once it expires",
            held,
            self.transport.description,
        )
        deadline = current.expires_at + CLOCK_MARGIN
        while self.clock() < deadline:
            if stop.wait(min(1.0, max(0.05, self.ttl / 10, deadline - self.clock()))):
                raise LeaseHeldError(f"{self.transport.description}: stopped while waiting")
            now_lease = self.retry.call(
                f"reading the lease of {self.transport.description}",
                self.transport.read_lease,
                stop,
            )
            if now_lease != current:
                if now_lease is None or now_lease.released:
                    return now_lease  # given up meanwhile: take it
                raise LeaseHeldError(
                    f"{self.transport.description}: master {describe_lease(now_lease)} renewed "
                    "its lease while this one waited to take over: it is alive. Run one master "
                    "per store."
                )
        return current

    # ------------------------------------------------------------------ keeping it
    @property
    def epoch(self) -> int | None:
        """The epoch of the lease held (None without a lease)."""
        with self._lock:
            return self.lease.epoch if self.lease is not None else None

    def check(self) -> Lease | None:
        """The lease to fence a write with; raises :class:`LeaseLostError` once it was lost
        (None when the store has no leases)."""
        with self._lock:
            if self.lost is not None:
                raise LeaseLostError(self.lost)
            return self.lease

    def ensure(self, stop: threading.Event | None = None) -> Lease | None:
        """:meth:`check`, taking the lease first if that could not be done at start (the store
        was unreachable then); raises :class:`LeaseHeldError` / :class:`LeaseLostError`, or a
        transport error when the store is still unreachable."""
        with self._lock:
            pending = (
                self.lease is None and self.lost is None and self.supported and not self.released
            )
        if pending:
            self.acquire(stop)
            self.start()
        return self.check()

    def hold(self, lease: Lease) -> None:
        """Keep ``lease``, written by someone else for this node (a standby's take-over:
        :mod:`speedtronic_diloco.standby`); :meth:`start` renews it from then on."""
        with self._lock:
            self.lease, self.lost, self.instance = lease, None, lease.instance

    def mark_lost(self, reason: str) -> None:
        """Record that the lease is gone (a renewal or a fenced write found another holder)."""
        with self._lock:
            first = self.lost is None
            self.lost = reason
        if first:
            then = "continues as a worker" if self.failover else "stops publishing"
            log.error("master lease lost: %s. This master %s.", reason, then)

    def renew(self) -> bool:
        """Extend the lease by ``ttl`` (compare-and-swap on the lease last written); True when
        renewed. A conflict marks the lease lost; other failures are retried next time."""
        with self._lock:
            current, lost = self.lease, self.lost
        if current is None or lost is not None:
            return False
        now = self.clock()
        renewed = Lease(
            holder=current.holder,
            epoch=current.epoch,
            expires_at=now + self.ttl,
            renewed_at=now,
            instance=current.instance,
        )
        try:
            self.transport.write_lease(renewed, current)
        except LeaseConflictError as exc:
            holder = describe_lease(exc.current) if exc.current else "nobody"
            self.mark_lost(
                f"{self.transport.description}: the lease is now held by {holder}, not by "
                f"{self.node_id!r} epoch {current.epoch}"
            )
            return False
        except TransportError as exc:
            level = logging.WARNING if now > current.expires_at - self.ttl / 3 else logging.INFO
            log.log(level, "renewing the master lease failed (%s); trying again", exc)
            return False
        with self._lock:
            if self.lease == current:
                self.lease = renewed
        return True

    def start(self) -> None:
        """Renew every ``ttl / 3`` seconds in a daemon thread (idempotent)."""
        if self.lease is None or (self._thread is not None and self._thread.is_alive()):
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="diloco-lease", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        interval = max(0.05, self.ttl / 3)
        while not self._stop.wait(interval):
            if self.lost is not None:
                return
            try:
                self.renew()
            except Exception:  # the renewal thread must outlive one bad attempt
                log.exception("renewing the master lease failed")

    def release(self, timeout: float = 5.0) -> None:
        """Stop renewing and mark the lease released (best effort, never raises)."""
        self.released = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(max(0.0, timeout))
        with self._lock:
            current, lost = self.lease, self.lost
        if current is None or lost is not None:
            return
        released = Lease(
            holder=current.holder,
            epoch=current.epoch,
            expires_at=self.clock(),
            renewed_at=self.clock(),
            instance=current.instance,
            released=True,
        )
        try:
            self.transport.write_lease(released, current)
        except TransportError as exc:
            log.info("releasing the master lease failed (%s); it expires by itself", exc)
            return
        with self._lock:
            self.lease = None
        log.info("master lease of %s released", self.transport.description)
