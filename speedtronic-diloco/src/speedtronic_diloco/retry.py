"""The retry policy for store calls: transient failures back off and retry, permanent ones
fail at once, and a stop request cuts every wait short.

:meth:`RetryPolicy.call` raises what is left after the retries; :meth:`RetryPolicy.attempt` is
the form the coordinator and the outer loop use: a failure is logged as one warning and
reported as ``(False, None)``, because a store failure never stops training.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from speedtronic.errors import TransportError
from speedtronic_diloco.transports.base import TransientTransportError

log = logging.getLogger("speedtronic.diloco")

T = TypeVar("T")
MAX_DELAY = 30.0


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` extra attempts after the first, waiting ``backoff * 2**i`` (capped) times a
    random factor in [0.5, 1] (nodes that failed together do not retry in lockstep), or as long
    as the store asked (``retry_after``, from ``Retry-After``); gives up rather than wait past
    ``max_total`` seconds after the first attempt."""

    retries: int = 4
    backoff: float = 1.0
    max_total: float = 300.0

    def call(self, what: str, fn: Callable[[], T], stop: threading.Event | None = None) -> T:
        """Run ``fn``; retry TransientTransportError, re-raise the last one when out of tries
        or when ``stop`` is set. Other exceptions propagate immediately."""
        stop = stop if stop is not None else threading.Event()  # never set: plain waits
        attempt = 0
        deadline = time.monotonic() + self.max_total
        while True:
            try:
                return fn()
            except TransientTransportError as exc:
                if attempt >= self.retries or stop.is_set():
                    raise
                delay = min(self.backoff * 2**attempt, MAX_DELAY) * random.uniform(0.5, 1.0)
                if exc.retry_after is not None:
                    delay = max(delay, exc.retry_after)
                if time.monotonic() + delay > deadline:
                    raise
                attempt += 1
                log.info(
                    "%s failed (%s); retry %d/%d in %.1fs", what, exc, attempt, self.retries, delay
                )
                if stop.wait(delay):
                    raise

    def attempt(
        self,
        what: str,
        fn: Callable[[], T],
        stop: threading.Event | None = None,
        *,
        then: str = "",
        on_failure: Callable[[TransportError], None] | None = None,
    ) -> tuple[bool, T | None]:
        """:meth:`call`, for callers that carry on without the result: ``(True, result)``, or
        ``(False, None)`` after logging ``"<what> failed (<error>); <then>"`` as a warning and
        calling ``on_failure(error)``. Only TransportError is caught."""
        try:
            return True, self.call(what, fn, stop)
        except TransportError as exc:
            log.warning("%s failed (%s)%s", what, exc, f"; {then}" if then else "")
            if on_failure is not None:
                on_failure(exc)
            return False, None
