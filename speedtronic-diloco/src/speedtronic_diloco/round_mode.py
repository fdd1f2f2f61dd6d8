"""The round rules (``distributed.rounds``) as objects: one :class:`RoundMode` per rule, asked
by the master's round policy and intake, by the aggregation's screening and by a node at its
boundary. A new rule is one more subclass registered in :data:`ROUND_MODES`; nothing else
tests the rule's name.

* :class:`AsyncRounds` (``async``): nodes never wait; a round closes once ``min_deltas`` nodes
  (at most the live ones) have a delta of the newest base pending; stale deltas are averaged in
  (up to ``max_staleness``), and a node keeps its own progress on a global it installs.
* :class:`SyncRounds` (``sync``): every node waits at its boundary for the global of that round
  (as DiLoCo does); a round closes once every live node delivered a delta computed from the
  current global; a delta of an older global is refused as ``late``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any, ClassVar

__all__ = ["ROUND_MODES", "AsyncRounds", "RoundMode", "SyncRounds", "round_mode"]


class RoundMode:
    """One round rule. ``name`` is its ``distributed.rounds`` value."""

    name: ClassVar[str] = ""
    #: A node waits at its boundary, after delivering, for the global of that round.
    waits_at_boundary: ClassVar[bool] = False
    #: A worker that starts before any global exists waits for the first one.
    waits_for_first_global: ClassVar[bool] = False
    #: A node installs a global minus its own deltas the global does not contain yet.
    keeps_own_progress: ClassVar[bool] = True
    #: A delta computed from an older global than the round's is refused (``late``).
    refuses_late: ClassVar[bool] = False
    #: The nodes waiting for the last round's global are expected in the next round however
    #: long ago they were seen (an inner loop may outlast the liveness window).
    expects_last_round: ClassVar[bool] = False

    def needed(self, live: int, floor: int, arrived: bool, min_deltas: int | None) -> int:
        """How many distinct nodes a round waits for: ``live`` nodes now, ``floor`` the first
        rounds' count (``min_deltas`` or 1), ``arrived`` once that many were ever seen."""
        if not arrived:
            return floor
        if min_deltas is None:
            return max(1, live)
        return max(1, min(min_deltas, live))

    def round_inputs(
        self, intake: Any, new: list[Any], current: int, failing: Collection[str]
    ) -> tuple[Iterable[str], Iterable[str]]:
        """``(pending nodes, quorum nodes)`` for the round policy over the new deltas ``new``
        at outer step ``current`` (``intake``: the master's
        :class:`~speedtronic_diloco.master.intake.Intake`)."""
        return (info.node_id for info in new), intake.quorum(new, current, failing)


class AsyncRounds(RoundMode):
    """``rounds: async`` (see the module docstring)."""

    name = "async"


class SyncRounds(RoundMode):
    """``rounds: sync`` (see the module docstring)."""

    name = "sync"
    waits_at_boundary = True
    waits_for_first_global = True
    keeps_own_progress = False  # a node installs the global its delta went into
    refuses_late = True
    expects_last_round = True  # they all wait for this round's global, so all come back

    def needed(self, live: int, floor: int, arrived: bool, min_deltas: int | None) -> int:
        """Every live node (and the first rounds' count until that many arrived)."""
        return max(live, floor) if not arrived else max(1, live)

    def round_inputs(
        self, intake: Any, new: list[Any], current: int, failing: Collection[str]
    ) -> tuple[Iterable[str], Iterable[str]]:
        # Only deltas of the open round start its clock and count; late ones are refused
        # when it runs.
        fresh = intake.fresh(new, current, failing)
        return fresh, fresh


#: The round rules by their ``distributed.rounds`` name.
ROUND_MODES: dict[str, RoundMode] = {mode.name: mode for mode in (AsyncRounds(), SyncRounds())}


def round_mode(name: str) -> RoundMode:
    """The :class:`RoundMode` named ``name`` (ValueError naming the known ones otherwise)."""
    try:
        return ROUND_MODES[name]
    except KeyError:
        known = ", ".join(sorted(ROUND_MODES))
        raise ValueError(f"distributed.rounds: {name!r} is not one of {known}") from None
