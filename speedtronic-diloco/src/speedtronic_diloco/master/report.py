"""What the master tells people: log lines and metric events for rounds (``outer_step``,
``outer_eval``), rejected deltas (``delta_rejected``, told once, as the intake refuses the
delta or the round rejects it; loud after a node's repeated rejections), a halt
(``outer_halted``, with a reminder while it lasts) and the final global (``final_global``)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from speedtronic_diloco.master.history import history_steps
from speedtronic_diloco.master.intake import Rejection
from speedtronic_diloco.master.round import RoundResult
from speedtronic_diloco.transports.base import DeltaInfo

__all__ = ["Emit", "Reporter"]

log = logging.getLogger("speedtronic.diloco.outer")

Emit = Callable[[str, dict[str, Any]], None]
LOUD_AFTER = 3  # consecutive rejections of one node before it is logged as a problem
MAX_TOLD = 4096  # rejections told ahead of their round, remembered so as not to tell twice
HALT_REMINDER_S = 60.0


def _finite(norm: float | None) -> float | None:
    return norm if norm is None or math.isfinite(norm) else None


class Reporter:
    """Log lines and events of one master; remembers each node's rejection streak."""

    def __init__(self, emit: Emit | None, state_dir: Path) -> None:
        self.emit: Emit = emit or (lambda event, payload: None)
        self.state_dir = state_dir
        self._streaks: dict[str, int] = {}
        self._told: dict[tuple[str, int, str | None], None] = {}  # refused, round not yet run
        self._reminded = -math.inf

    def accepted(self, node_id: str) -> None:
        self._streaks[node_id] = 0

    def refused(self, info: DeltaInfo, why: Rejection) -> None:
        """Log and emit one rejection now, as the intake refuses the delta (its round, which
        records it, may be a ``round_timeout`` away); :meth:`rejected` does not tell it again."""
        key = (info.node_id, info.local_step, info.etag)
        if key in self._told:
            return
        if len(self._told) >= MAX_TOLD:  # deltas that left the store before their round
            self._told.pop(next(iter(self._told)))
        self._told[key] = None
        self._tell(info, why)

    def rejected(self, info: DeltaInfo, why: Rejection, outer_step: int) -> dict[str, Any]:
        """A rejection of a round: logged and emitted unless :meth:`refused` told it already;
        returns its record for the state's ``rejections``."""
        if self._told.pop((info.node_id, info.local_step, info.etag), "new") == "new":
            self._tell(info, why)
        return {
            "node": info.node_id,
            "step": info.local_step,
            "reason": why.reason,
            "message": why.message,
            "norm": _finite(why.norm),
            "outer_step": outer_step,
            "at": time.time(),
        }

    def _tell(self, info: DeltaInfo, why: Rejection) -> None:
        log.error("rejected delta %s (%s): %s", info.path, why.reason, why)
        streak = self._streaks.get(info.node_id, 0) + 1
        self._streaks[info.node_id] = streak
        if streak >= LOUD_AFTER and (streak == LOUD_AFTER or streak % 10 == 0):
            log.error(
                "!!! node %r: its last %d deltas were all rejected (latest: %s). It is not "
                "contributing; check that node (a bug, a wrong key, diverged weights, or a "
                "hostile writer).",
                info.node_id,
                streak,
                why.reason,
            )
        self.emit(
            "delta_rejected",
            {
                "node": info.node_id,
                "delta_step": info.local_step,
                "reason": why.reason,
                "norm": _finite(why.norm),
                "consecutive": streak,
                "message": why.message,
            },
        )

    def round(self, result: RoundResult, fields: dict[str, Any]) -> None:
        """The ``outer step N: ...`` line and the ``outer_step`` / ``outer_eval`` events;
        ``fields`` adds to the event (bytes received, fragments)."""
        contributions = result.contributions
        parts = [
            f"{n}@{s} base {b if b is not None else '?'}"
            for (n, s), b in zip(result.included, result.base_outer_steps)
        ]
        clipped = [c.node_id for c in contributions if c.scale < 1.0 or min(c.delta_scales) < 1.0]
        log.info(
            "outer step %d (%s%s): %d node%s (%s), waited %.1f s (%s)%s%s",
            result.outer_step,
            result.mode,
            "" if result.momentum_applied else ", no momentum",
            len(result.nodes),
            "" if len(result.nodes) == 1 else "s",
            ", ".join(parts),
            result.waited_s,
            result.reason,
            f", {len(result.rejected)} rejected" if result.rejected else "",
            f", clipped {','.join(clipped)}" if clipped else "",
        )
        self.emit(
            "outer_step",
            {
                "outer_step": result.outer_step,
                "deltas_found": result.deltas_found,
                "deltas_included": result.deltas_included,
                "deltas_rejected": len(result.rejected),
                "included": ",".join(f"{n}@{s}" for n, s in result.included),
                "nodes": ",".join(result.nodes),
                "nodes_included": len(result.nodes),
                "base_outer_steps": ",".join(
                    "?" if b is None else str(b) for b in result.base_outer_steps
                ),
                "staleness": ",".join(str(s) for s in result.staleness),
                "waited_s": round(result.waited_s, 3),
                "reason": result.reason,
                "mode": result.mode,
                "momentum": result.momentum if result.momentum_applied else 0.0,
                "norms": ",".join(f"{c.norm:.4g}" for c in contributions),
                "norm_threshold": result.threshold,
                "clipped": ",".join(clipped),
                **fields,
            },
        )
        if result.eval_loss is not None:
            loss = result.eval_loss
            self.emit(
                "outer_eval",
                {
                    "outer_step": result.outer_step,
                    "loss": loss,
                    "ppl": math.exp(loss) if loss < 700 else math.inf,
                },
            )

    def halted(self, reason: str, outer_step: int) -> None:
        log.critical(
            "!!! DumbDiLoCo master HALTED: %s. Nothing more is published; the global stays at "
            "outer step %d (the last good one, with its momentum). Inspect the rejected "
            "deltas, then roll back with `speedtronic diloco rollback --state-dir %s --to N` "
            "(N: %s) and restart the master.",
            reason,
            outer_step,
            self.state_dir,
            ", ".join(str(s) for s in history_steps(self.state_dir)) or outer_step,
        )
        self._reminded = time.monotonic()
        self.emit("outer_halted", {"outer_step": outer_step, "reason": reason})

    def still_halted(self, reason: str | None) -> None:
        now = time.monotonic()
        if now - self._reminded >= HALT_REMINDER_S:
            self._reminded = now
            log.error(
                "DumbDiLoCo master is HALTED (%s): not aggregating or publishing; see "
                "`speedtronic diloco rollback --help`",
                reason,
            )

    def final(self, outer_step: int, where: str) -> None:
        log.info("final global: outer step %d, path %s", outer_step, where)
        self.emit("final_global", {"outer_step": outer_step, "path": where})
