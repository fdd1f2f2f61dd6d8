"""Wall-clock times read from the store (``lease.json`` ``expires_at`` and ``renewed_at``,
``step_count.json`` ``published_at``): checked to be a time at all, and shown without ever
raising.

Anyone with write access to the store can put any number there. ``1e18`` or ``-1e18`` is a
valid float, but no calendar date: ``datetime.fromtimestamp`` fails on it with ``OSError:
[Errno 75] Value too large`` (or ``OverflowError``) far from the file that held it. Reading a
time through :func:`parse_timestamp` names the file and field instead; :func:`format_utc`
shows whatever was accepted.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any

__all__ = ["MAX_TIMESTAMP", "MIN_TIMESTAMP", "format_utc", "parse_timestamp", "timestamp_problem"]

#: 1970-01-01 00:00:00 UTC: no store was written before the epoch.
MIN_TIMESTAMP = 0.0
#: 9999-12-31 23:59:59 UTC, the last second a ``datetime`` can show.
MAX_TIMESTAMP = 253_402_300_799.0


def timestamp_problem(value: Any) -> str | None:
    """Why ``value`` is not a wall-clock time in seconds since the epoch (None when it is)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"is not a number ({type(value).__name__})"
    try:
        number = float(value)
    except OverflowError:
        return "is not a finite number"
    if not math.isfinite(number):
        return "is not a finite number"
    if not MIN_TIMESTAMP <= number <= MAX_TIMESTAMP:
        return f"{number:.6g} is not a time between 1970 and 9999"
    return None


def parse_timestamp(value: Any, where: str, field: str) -> float | None:
    """``value`` (a JSON number, or None for an absent field) as seconds since the epoch.
    Raises ``ValueError`` naming ``where`` (the file) and ``field`` when it is no time."""
    if value is None:
        return None
    problem = timestamp_problem(value)
    if problem is not None:
        raise ValueError(f"{where}: {field} {problem}")
    return float(value)


def format_utc(moment: float) -> str:
    """``2025-01-01 12:00:03 UTC``; a value that is no time is shown as the number it is."""
    if timestamp_problem(moment) is not None:
        return f"t={moment!r} (not a time)"
    return datetime.fromtimestamp(moment, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
