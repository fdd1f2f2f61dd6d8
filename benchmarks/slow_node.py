"""A benchmark plugin that makes one real ``speedtronic train`` process FACTOR x slower, loaded
with ``--plugin slow_node`` (``benchmarks/`` on ``PYTHONPATH``) and
``SPEEDTRONIC_BENCH_SLOW_FACTOR=FACTOR`` in its environment; nothing in the library changes.

After every optimizer step (``after_optimizer_step``, called first) the process sleeps
``(FACTOR - 1)`` x the median of its last ``WINDOW`` step intervals, each interval measured
from the end of the previous sleep: its own step time on this machine, at this load, however
fast the machine is. The median leaves out the rare long interval (a round boundary's upload
or wait, a checkpoint), which is not made longer. The first step is not slowed (no interval
yet). At the end the process emits one ``slow_node`` event: the factor, the steps, the median
step and the seconds slept, so a benchmark can state what it measured.

A sleeping process gives its core away: on a machine shared by all the nodes the others run a
little faster meanwhile, as they would beside a genuinely slower machine.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from typing import Any

from speedtronic import hookimpl

FACTOR_ENV = "SPEEDTRONIC_BENCH_SLOW_FACTOR"
WINDOW = 50  # step intervals in the median: two rounds at H 25


class SlowDown:
    """The sleep of one process: sized from its recent step intervals."""

    def __init__(self, factor: float, window: int = WINDOW) -> None:
        self.factor = factor
        self.intervals: deque[float] = deque(maxlen=window)
        self.last: float | None = None
        self.steps = 0
        self.slept_s = 0.0

    def pause_s(self, now: float) -> float:
        """Record the interval ending ``now``; the sleep that makes it FACTOR x as long."""
        if self.last is not None:
            self.intervals.append(now - self.last)
        self.steps += 1
        if not self.intervals or self.factor <= 1.0:
            return 0.0
        return (self.factor - 1.0) * statistics.median(self.intervals)

    def after_step(self) -> None:
        pause = self.pause_s(time.monotonic())
        if pause > 0:
            time.sleep(pause)  # the slowness itself, not a wait for a condition
            self.slept_s += pause
        self.last = time.monotonic()

    def summary(self) -> dict[str, Any]:
        median = statistics.median(self.intervals) if self.intervals else None
        return {
            "factor": self.factor,
            "steps": self.steps,
            "median_step_s": median,
            "slept_s": round(self.slept_s, 3),
        }


SLOW = SlowDown(float(os.environ.get(FACTOR_ENV, "1") or 1))


@hookimpl(tryfirst=True)
def after_optimizer_step(trainer: Any, step: int) -> None:
    SLOW.after_step()


@hookimpl
def on_train_end(trainer: Any, error: BaseException | None) -> None:
    trainer.emit("slow_node", SLOW.summary())
