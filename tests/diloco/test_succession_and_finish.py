"""Unit tests of issue 41's pieces, without processes: a successor's round policy (the run's
nodes known, the dead master presumed gone until it uploads again), the outer warm-up of
issue 40, and how a worker finds its run finished (lease released + the master's
``max_steps`` left record), on a real shared directory."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from test_diloco_membership import NO_WAIT, FakeClock, shared, upload

from speedtronic_diloco.aggregation import AggregationRules
from speedtronic_diloco.config import DistributedConfig
from speedtronic_diloco.lease import LeaseKeeper
from speedtronic_diloco.master.round import warmed
from speedtronic_diloco.master.round_policy import RoundPolicy
from speedtronic_diloco.membership import Membership, announce_back, announce_left
from speedtronic_diloco.node.finished import (
    EXIT_RUN_FINISHED,
    FinishedWatch,
    RunFinishedError,
    finished_interval,
    run_finished,
)
from speedtronic_diloco.status import collect_status, summary_lines


def test_a_successor_does_not_wait_for_nodes_to_arrive() -> None:
    """A fresh policy waits for min_deltas nodes to have been seen (the run's first rounds);
    a successor's, told the run's nodes, waits for the live ones only."""
    clock = FakeClock()
    rules = AggregationRules(min_deltas=3, rounds="sync", round_timeout=60.0, lease_ttl=6.0)
    fresh = RoundPolicy.of(rules, clock)
    fresh.saw("w1")
    fresh.saw("w2")
    assert fresh.needed() == 3 and not fresh.decide(["w1", "w2"]).go
    successor = RoundPolicy.of(rules, clock)
    successor.known({"m", "w1", "w2"})
    successor.left({"m"})  # the master it replaced, presumed gone (failover.succeed)
    successor.saw("w1")
    successor.saw("w2")
    assert successor.needed() == 2 and successor.decide(["w1", "w2"]).go
    asynchronous = RoundPolicy.of(AggregationRules(min_deltas=3, lease_ttl=6.0), clock)
    asynchronous.known({"m", "w1", "w2"})
    asynchronous.saw("w1")
    asynchronous.saw("w2")
    assert asynchronous.needed() == 2


def test_a_dead_master_is_gone_until_it_uploads_a_newer_delta(tmp_path: Path) -> None:
    store = shared(tmp_path)
    members = Membership(store)
    upload(store, tmp_path, "m", 30)  # its last delta before it died
    members.presume_gone("m", 30)
    assert members.gone(store.list_deltas()) == {"m"}
    upload(store, tmp_path, "m", 40)  # alive after all (a fenced master going on)
    assert members.gone(store.list_deltas()) == set()
    assert members.gone([]) == set()  # the presumption is gone for good


@pytest.mark.parametrize(
    ("completed", "expected"),
    [(0, (1.0, 0.0)), (2, (0.85, 0.25)), (4, (0.7, 0.5)), (9, (0.7, 0.5))],
)
def test_the_outer_warmup_ramps_from_plain_averaging(
    completed: int, expected: tuple[float, float]
) -> None:
    lr, momentum = warmed(0.7, 0.5, completed, 4)
    assert lr == pytest.approx(expected[0]) and momentum == pytest.approx(expected[1])
    assert warmed(0.7, 0.5, 0, 0) == (0.7, 0.5)  # no warm-up


def finished_store(tmp_path: Path, reason: str = "max_steps") -> object:
    store = shared(tmp_path)
    keeper = LeaseKeeper(store, "m", ttl=30.0)
    keeper.acquire()
    announce_left(store, "m", 120, reason, retry=NO_WAIT)
    keeper.release()
    return store


def test_a_run_is_finished_when_its_master_released_the_lease_after_its_last_step(
    tmp_path: Path,
) -> None:
    store = finished_store(tmp_path)
    found = run_finished(store, NO_WAIT)
    assert found is not None and (found.master, found.last_step) == ("m", 120)
    assert "is finished" in found.describe() and "'m'" in found.describe()
    status = collect_status(store)
    assert status.finished and any("finished" in line for line in summary_lines(status))
    announce_back(store, "m", retry=NO_WAIT)  # the master resumed: live again
    assert run_finished(store, NO_WAIT) is None
    assert not collect_status(store).finished


def test_a_stopped_or_live_master_is_not_a_finished_run(tmp_path: Path) -> None:
    assert run_finished(finished_store(tmp_path / "a", "stopped"), NO_WAIT) is None
    store = shared(tmp_path / "b")
    LeaseKeeper(store, "m", ttl=30.0).acquire()
    announce_left(store, "m", 120, "max_steps", retry=NO_WAIT)  # lease still held
    assert run_finished(store, NO_WAIT) is None
    assert run_finished(shared(tmp_path / "c"), NO_WAIT) is None  # no lease at all


class Ctx:
    """The parts of a NodeContext the watch reads."""

    def __init__(self, store: object, finished_run: str) -> None:
        self.transport, self.retry, self.stop = store, NO_WAIT, threading.Event()
        self.node_id = "w"
        self.config = type("Config", (), {"finished_run": finished_run})()
        self.events: list[tuple[str, dict]] = []

    def queue_event(self, name: str, payload: dict) -> None:
        self.events.append((name, payload))


def test_the_watch_looks_once_per_interval_and_stops_or_trains_alone(tmp_path: Path) -> None:
    store = shared(tmp_path)
    clock = FakeClock()
    watch = FinishedWatch(Ctx(store, "stop"), interval=30.0, monotonic=clock)  # type: ignore[arg-type]
    assert not watch.alone_now()  # a look: not finished
    keeper = LeaseKeeper(store, "m", ttl=30.0)
    keeper.acquire()
    announce_left(store, "m", 5, "max_steps", retry=NO_WAIT)
    keeper.release()
    assert not watch.alone_now()  # within the interval: no look
    with pytest.raises(RunFinishedError, match="exit 3") as raised:
        watch.alone_now(now=True)
    assert raised.value.exit_code == EXIT_RUN_FINISHED == 3
    ctx = Ctx(store, "train_alone")
    alone = FinishedWatch(ctx, interval=30.0, monotonic=clock)  # type: ignore[arg-type]
    assert alone.alone_now() and alone.alone and alone.alone_now()
    assert [name for name, _ in ctx.events] == ["run_finished"]  # told once


def test_a_worker_looks_whether_its_run_finished_every_ten_seconds_or_poll_interval() -> None:
    """What docs/diloco.md says: every 10 s or ``lease_ttl``, whichever is shorter, never more
    often than ``poll_interval`` (the default 60 s: once a minute)."""
    assert finished_interval(DistributedConfig()) == 60.0
    assert finished_interval(DistributedConfig(poll_interval=1.0)) == 10.0
    assert finished_interval(DistributedConfig(poll_interval=1.0, lease_ttl=4.0)) == 4.0
