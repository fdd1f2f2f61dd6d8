"""The round rules as objects (issue 42): each :class:`RoundMode` answers what the master's
policy, the aggregation and a node ask, and the names are the config's."""

from __future__ import annotations

import typing

import pytest

from speedtronic_diloco.config import DistributedConfig
from speedtronic_diloco.round_mode import ROUND_MODES, AsyncRounds, SyncRounds, round_mode


def test_every_configurable_rule_has_a_mode_and_nothing_else_does() -> None:
    allowed = set(typing.get_args(typing.get_type_hints(DistributedConfig)["rounds"]))
    assert set(ROUND_MODES) == allowed
    with pytest.raises(
        ValueError, match=r"distributed\.rounds: 'lockstep' is not one of async, sync"
    ):
        round_mode("lockstep")


@pytest.mark.parametrize(
    ("live", "floor", "arrived", "min_deltas", "expected_async", "expected_sync"),
    [
        (1, 3, False, 3, 3, 3),  # the first rounds wait for min_deltas nodes to arrive
        (4, 3, False, 3, 3, 4),  # sync: every live node, at least the first rounds' count
        (2, 3, True, 3, 2, 2),  # a node left: at most the live ones
        (5, 3, True, 3, 3, 5),  # async: min_deltas of them; sync: all of them
        (4, 1, True, None, 4, 4),  # default: every live node
        (0, 1, True, None, 1, 1),  # never fewer than one
    ],
)
def test_how_many_nodes_a_round_waits_for(
    live: int,
    floor: int,
    arrived: bool,
    min_deltas: int | None,
    expected_async: int,
    expected_sync: int,
) -> None:
    assert AsyncRounds().needed(live, floor, arrived, min_deltas) == expected_async
    assert SyncRounds().needed(live, floor, arrived, min_deltas) == expected_sync


def test_what_a_node_and_the_aggregation_ask() -> None:
    sync, asynchronous = round_mode("sync"), round_mode("async")
    assert sync.waits_at_boundary and sync.waits_for_first_global and sync.refuses_late
    assert not sync.keeps_own_progress
    assert not (asynchronous.waits_at_boundary or asynchronous.refuses_late)
    assert asynchronous.keeps_own_progress
