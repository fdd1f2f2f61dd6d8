"""The round rules as objects (issue 42): each :class:`RoundMode` answers what the master's
policy, the aggregation and a node ask, and the names are the config's."""

from __future__ import annotations

import typing

import pytest

from speedtronic.errors import ConfigError
from speedtronic_diloco.aggregation import AggregationRules
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


def test_the_defaults_are_the_outer_step_that_won_the_matrix() -> None:
    # Issue 40: sync rounds, momentum 0.7 after an 8-round warm-up, and no momentum on a round
    # of one node won every cell of the matrix (docs/diloco.md, "Real conditions").
    section = DistributedConfig()
    assert section.rounds == "sync" and round_mode(section.rounds).waits_at_boundary
    assert (section.outer_lr, section.outer_momentum) == (0.7, 0.7)
    assert (section.outer_warmup, section.momentum_min_nodes) == (8, 2)


def test_streaming_fragments_without_a_rounds_key_name_the_fix() -> None:
    with pytest.raises(
        ConfigError, match=r"sync \(the default when unset\).*set rounds: async"
    ) as caught:
        DistributedConfig(fragments=2, inner_steps=4)
    assert caught.value.path == "rounds"
    assert DistributedConfig(fragments=2, inner_steps=4, rounds="async").fragments == 2


@pytest.mark.parametrize(
    ("num_nodes", "min_deltas", "expected"),
    [(None, None, None), (3, None, 3), (3, 2, 2), (None, 4, 4)],
)
def test_the_first_rounds_wait_for_num_nodes_unless_min_deltas_says_otherwise(
    num_nodes: int | None, min_deltas: int | None, expected: int | None
) -> None:
    ranked = {"num_nodes": num_nodes, "node_rank": 0} if num_nodes else {}
    section = DistributedConfig(min_deltas=min_deltas, **ranked)
    assert AggregationRules.from_config(section).min_deltas == expected
