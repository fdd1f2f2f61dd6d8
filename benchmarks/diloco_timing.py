"""Wall-clock figures of a DiLoCo run, read from its events files (``logging.json_file``: one
JSON object per event, ``{"event", "time", ...}``, ``time`` being the writer's ``time.time()``).

- :func:`time_to_loss`: seconds from the run's start until the global's held-out loss (the
  master's ``outer_eval`` events) first reached a target, e.g. one node's final loss;
  :func:`steps_to_loss`: the same in node steps, from the benchmark's per-round rows.
- :func:`wait_totals` / :func:`timeout_share`: the time a node spent waiting at its round
  boundaries (``rounds: sync``). ``round_waited`` events are waits that ended with a global,
  ``round_wait_timeout`` events waits the node itself gave up (2 x ``round_timeout``); both
  carry ``waited_s``. A ``round_waited`` whose global (its ``outer_step``) is of a round the
  master closed by its own ``round_timeout`` (``outer_step`` events with ``reason: timeout``,
  :func:`timeout_rounds`) also ended by a timeout: the master's. A node's events are written
  by its training thread after the wait, so their ``time`` is that of the wait's end; only
  ``waited_s`` is used here.

Pure functions of lists of events, so they are tested without running anything.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

__all__ = [
    "loss_points",
    "steps_to_loss",
    "time_to_loss",
    "timeout_rounds",
    "timeout_share",
    "wait_totals",
]


def loss_points(master_events: Iterable[dict[str, Any]]) -> list[tuple[float, float]]:
    """``(time, loss)`` of every global the master scored, in the order it wrote them."""
    return [
        (float(e["time"]), float(e["loss"]))
        for e in master_events
        if e.get("event") == "outer_eval" and "time" in e and e.get("loss") is not None
    ]


def time_to_loss(
    points: Iterable[tuple[float, float]], target: float, start: float
) -> float | None:
    """Seconds from ``start`` to the first ``(time, loss)`` point whose loss is at most
    ``target``; None when no point reaches it. Points need not be sorted by time."""
    reached = [when for when, loss in points if loss <= target]
    return max(0.0, min(reached) - start) if reached else None


def steps_to_loss(rows: list[dict[str, Any]], one: float | None, steps: int) -> dict[str, Any]:
    """The node step of the first global that scored at most one node's final loss ``one``,
    and that step over ``steps``: the time ratio where every node has a machine of its own
    (on one shared machine the nodes also share its cores, which the wall ratio includes)."""
    step = next((r["node_step"] for r in rows if one is not None and r["global_loss"] <= one), None)
    return {
        "steps_to_one_node": step,
        "steps_to_one_node_ratio": step / steps if step is not None and steps else None,
    }


def timeout_rounds(master_events: Iterable[dict[str, Any]]) -> set[int]:
    """The outer steps whose round the master closed by ``round_timeout``."""
    return {
        int(e["outer_step"])
        for e in master_events
        if e.get("event") == "outer_step" and e.get("reason") == "timeout"
    }


def wait_totals(
    events: Iterable[dict[str, Any]], closed_by_timeout: Collection[int] = ()
) -> dict[str, float | int]:
    """One node's boundary waits: count and seconds of those that got a global
    (``round_waited``), of those among them whose round the master closed by timeout (outer
    steps ``closed_by_timeout``), and of those the node gave up (``round_wait_timeout``)."""
    totals: dict[str, float | int] = {
        "waits": 0,
        "waited_s": 0.0,
        "round_timeouts": 0,
        "round_timeout_s": 0.0,
        "timeouts": 0,
        "timeout_s": 0.0,
    }
    for event in events:
        kind = event.get("event")
        seconds = float(event.get("waited_s") or 0.0)
        if kind == "round_waited":
            totals["waits"] += 1
            totals["waited_s"] += seconds
            if event.get("outer_step") in closed_by_timeout:
                totals["round_timeouts"] += 1
                totals["round_timeout_s"] += seconds
        elif kind == "round_wait_timeout":
            totals["timeouts"] += 1
            totals["timeout_s"] += seconds
    return totals


def timeout_share(
    events: Iterable[dict[str, Any]], wall_s: float | None, closed_by_timeout: Collection[int] = ()
) -> float | None:
    """The share of ``wall_s`` one node spent in boundary waits that ended by a timeout, its
    own or the master's (0 for a node that never waited, as in async rounds); None without a
    wall time."""
    if not wall_s or wall_s <= 0:
        return None
    totals = wait_totals(events, closed_by_timeout)
    return (float(totals["timeout_s"]) + float(totals["round_timeout_s"])) / wall_s
