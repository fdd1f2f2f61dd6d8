"""When the master starts an outer step: :class:`RoundPolicy` counts the nodes with a delta
pending against the ones it waits for (``min_deltas``, the live nodes, ``rounds: sync``) and the
time waited against ``round_timeout`` (the rules are :mod:`speedtronic_diloco.aggregation`'s
module docstring)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from speedtronic_diloco.aggregation import AggregationRules
from speedtronic_diloco.round_mode import round_mode

__all__ = ["RoundDecision", "RoundPolicy"]


@dataclass(frozen=True)
class RoundDecision:
    """What :meth:`RoundPolicy.decide` said: ``go`` and why (``quorum``, ``timeout``,
    ``waiting``, ``idle``), how many distinct nodes were needed and pending, and how long the
    round has waited."""

    go: bool
    reason: str
    need: int
    have: int
    waited_s: float


class RoundPolicy:
    """When the master starts an outer step (see the module docstring).

    Rounds count *live* nodes: seen within ``recent_s`` seconds (default 2 x
    ``round_timeout``; with ``rounds: sync`` also the nodes waiting for the last round's
    global), not :meth:`left`, last delta not rejected. ``min_deltas`` None means
    every live node, or 1 when none is known yet; a number is what the first rounds wait for,
    then at most the live nodes. ``clock`` returns seconds (monotonic)."""

    @classmethod
    def of(cls, rules: AggregationRules, clock: Callable[[], float]) -> RoundPolicy:
        """The policy of ``rules``; silent past ``lease_ttl`` (if < ``recent_s``): gone."""
        recent = min(2 * rules.round_timeout, rules.lease_ttl or math.inf)
        return cls(
            rules.min_deltas, rules.round_timeout, clock=clock, recent_s=recent, rounds=rules.rounds
        )

    def __init__(
        self,
        min_deltas: int | None,
        round_timeout: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        recent_s: float | None = None,
        rounds: str = "async",
    ) -> None:
        self.min_deltas = min_deltas
        self.rounds = rounds
        self.mode = round_mode(rounds)
        self._ever: set[str] = set()  # every node seen since the start
        self.round_timeout = round_timeout
        self.recent_s = recent_s if recent_s is not None else 2 * round_timeout
        self.clock = clock
        self._seen: dict[str, float] = {}
        self._since: float | None = None
        self._failing: set[str] = set()  # nodes whose last delta was rejected
        self._left: set[str] = set()  # nodes that said they ended (left records)
        self._expected: set[str] = set()  # expected in the next round (the mode says when)

    def saw(self, node_id: str) -> None:
        """A delta of ``node_id`` not yet consumed by a round was listed now (the outer loop
        says so at every listing while it is pending, so a pending delta keeps its node live)."""
        self._seen[node_id] = self.clock()
        self._ever.add(node_id)

    def known(self, nodes: Iterable[str]) -> None:
        """The run had ``nodes`` before this policy saw any of them (a successor master
        adopting the store's outer state): its first rounds are over, so ``min_deltas`` no
        longer waits for nodes to arrive; only the live ones count. With ``rounds: sync`` the
        first round expects all of ``nodes`` (less those gone), as if they were the last
        round's: they wait at their boundaries for it."""
        nodes = set(nodes)
        self._ever.update(nodes)
        if self.mode.expects_last_round:
            self._expected = nodes

    def rejected(self, node_id: str) -> None:
        """``node_id``'s delta was rejected: it is not waited for, nor counted toward a
        quorum, until one of its deltas is accepted again."""
        self._failing.add(node_id)

    def accepted(self, node_id: str) -> None:
        self._failing.discard(node_id)

    def failing(self) -> set[str]:
        return set(self._failing)

    def left(self, nodes: Iterable[str]) -> None:
        """The nodes that ended (replacing the previous set): no longer live."""
        self._left = set(nodes)

    def recent_nodes(self) -> set[str]:
        """The live nodes: seen within ``recent_s`` (or expected back, when the round mode
        says so: :meth:`round_done`), not left, last delta not rejected."""
        now = self.clock()
        seen = {node for node, at in self._seen.items() if now - at <= self.recent_s}
        return (seen | self._expected) - self._failing - self._left

    def needed(self) -> int:
        """How many nodes a round waits for. ``min_deltas`` is what the first rounds wait for,
        until that many nodes were ever seen; from then on at most the live nodes (seen within
        ``recent_s``, not left, last delta not rejected), so that a node that ended or died
        stops costing a ``round_timeout`` per round. ``rounds: sync``: every live node."""
        floor = self.min_deltas or 1
        arrived = len(self._ever) >= floor
        return self.mode.needed(len(self.recent_nodes()), floor, arrived, self.min_deltas)

    def waited(self) -> float:
        return 0.0 if self._since is None else self.clock() - self._since

    def decide(
        self, pending_nodes: Iterable[str], quorum_nodes: Iterable[str] | None = None
    ) -> RoundDecision:
        """Start a round now? ``pending_nodes`` are the nodes with a delta pending;
        ``quorum_nodes`` (default: all of them) those that count toward ``min_deltas`` (the
        outer thread passes the nodes whose pending delta has the newest base)."""
        pending = set(pending_nodes)
        have = len(pending if quorum_nodes is None else set(quorum_nodes))
        need = self.needed()
        if not pending:
            self._since = None
            return RoundDecision(False, "idle", need, 0, 0.0)
        if self._since is None:
            self._since = self.clock()
        waited = self.waited()
        if have >= need:
            return RoundDecision(True, "quorum", need, have, waited)
        if waited >= self.round_timeout:
            return RoundDecision(True, "timeout", need, have, waited)
        return RoundDecision(False, "waiting", need, have, waited)

    def round_done(self, nodes: Iterable[str] = ()) -> None:
        """A round consumed the pending deltas: the next wait starts with the next delta.
        ``nodes`` are the ones waiting for its global (the loop passes those that went in and
        those refused ``late``): with ``rounds: sync`` the next round expects them back however
        long their inner loops take (a node counted only while seen within ``recent_s`` would
        drop out of the round while it trains, and the round close without it). A node it
        expected that did not come (the round timed out) is no longer expected."""
        self._since = None
        if self.mode.expects_last_round:
            self._expected = set(nodes)
