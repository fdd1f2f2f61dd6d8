"""Fault injection: what the next requests of a kind get instead of a normal reply."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

KINDS = ("create", "preupload", "commit", "squash", "info", "tree", "resolve", "other")
"""Request kinds that faults can target; "*" in `inject*` matches every kind."""


@dataclass
class Fault:
    """One injected fault, for the next ``remaining`` requests of ``kind`` (and ``method``)."""

    kind: str
    method: str | None
    remaining: int
    action: str  # "status" | "hang" | "drop" | "call"
    status: int = 503
    retry_after: int | None = None
    seconds: float = 0.0
    after_apply: bool = False
    callback: Callable[[], object] | None = None
    message: str | None = None


class FaultQueue:
    """Pending faults, oldest first; the first one matching a request fires."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] = []

    def add(self, fault: Fault) -> None:
        if fault.kind != "*" and fault.kind not in KINDS:
            raise ValueError(f"unknown request kind {fault.kind!r}; expected one of {KINDS}")
        if fault.remaining < 1:
            raise ValueError("count must be >= 1")
        with self._lock:
            self._faults.append(fault)

    def take(self, kind: str, method: str) -> Fault | None:
        """The fault that fires for this request (counted down), or None."""
        with self._lock:
            for fault in self._faults:
                if fault.kind in ("*", kind) and fault.method in (None, method):
                    fault.remaining -= 1
                    if fault.remaining == 0:
                        self._faults.remove(fault)
                    return fault
        return None

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def left(self) -> int:
        """How many injected failures have not fired yet."""
        with self._lock:
            return sum(f.remaining for f in self._faults)
