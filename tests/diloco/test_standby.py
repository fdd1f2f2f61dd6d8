"""Standby masters (``distributed.failover``, issue 30) on real stores: of standbys racing for
a lapsed lease exactly one wins; live and released leases are left alone; hostile lease files
(far-future expiry, a forged holder, another run's lease, garbage) are counted invalid with one
line and never hold a standby longer than ``lease_ttl`` plus the margin; a worker coordinator
takes over (``master_takeover``) and runs the outer loop while it trains; a fenced master with
``failover`` goes on as a worker."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_fakes import SETTLE, dist_config, make_net, nudge, wait_for
from hub_emulator import HubEmulator
from hub_fixtures import TOKEN, hub_fixture

from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic_diloco.lease import CLOCK_MARGIN
from speedtronic_diloco.standby import Standby
from speedtronic_diloco.status import collect_status, summary_lines
from speedtronic_diloco.transports import GlobalMetadata, Lease, Transport
from speedtronic_diloco.transports.base import LEASE_FILE
from speedtronic_diloco.transports.hub import HubTransport
from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport

__all__ = ["hub_fixture"]

TTL = 2.0


@pytest.fixture(params=["shared_dir", "hub"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Transport:
    if request.param == "shared_dir":
        made: Transport = SharedDirectoryTransport(tmp_path / "store")
    else:
        hub: HubEmulator = request.getfixturevalue("hub")
        made = HubTransport("speedtronic/standby", token=TOKEN, endpoint=hub.endpoint)
    made.create_store()
    return made


def put_lease(store: Transport, lease: Lease | bytes) -> None:
    """Write ``global/lease.json`` as a hostile collaborator would: whatever is there."""
    try:
        current = store.read_lease()
    except Exception:  # a garbage file is replaced all the same
        current = None
    if isinstance(lease, Lease):
        store.write_lease(lease, current)
        return
    assert isinstance(store, SharedDirectoryTransport)
    path = store.root / LEASE_FILE
    path.with_suffix(".tmp").write_bytes(lease)
    os.replace(path.with_suffix(".tmp"), path)


def lapsed(holder: str = "m1", epoch: int = 1) -> Lease:
    now = time.time()
    return Lease(holder, epoch, now - TTL - CLOCK_MARGIN - 1, now - TTL - CLOCK_MARGIN - 1, "x")


def race(standby: Standby, barrier: threading.Barrier, won: list[Any]) -> None:
    barrier.wait(SETTLE)
    won.append(standby.check())


def test_of_standbys_racing_for_a_lapsed_lease_exactly_one_wins(store: Transport) -> None:
    for round_ in range(3):
        put_lease(store, lapsed(epoch=10 * round_ + 1))
        standbys = [Standby(store, f"w{i}", ttl=TTL) for i in range(3)]
        barrier = threading.Barrier(len(standbys))
        won: list[Any] = []

        threads = [threading.Thread(target=race, args=(s, barrier, won)) for s in standbys]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(SETTLE)
        winners = [w for w in won if w is not None]
        assert len(won) == 3 and len(winners) == 1, won
        lease = store.read_lease()
        assert lease.holder == winners[0].keeper.node_id and lease.epoch == 10 * round_ + 2
        assert winners[0].previous_master == "m1"
        winners[0].keeper.mark_lost("the test is done with it")


def test_live_released_and_missing_leases_are_left_alone(store: Transport) -> None:
    standby = Standby(store, "w1", ttl=TTL)
    assert standby.check() is None  # no master yet
    now = time.time()
    put_lease(store, Lease("m1", 1, now + TTL, now, "x"))
    assert standby.check() is None
    put_lease(store, Lease("m1", 1, now, now, "x", released=True))
    assert standby.check() is None
    assert store.read_lease().holder == "m1" and standby.invalid == 0


HOSTILE = {
    "far_future": lambda now: Lease("m1", 3, now + 10**9, now, "x"),
    "forged_holder": lambda now: Lease("../../etc/passwd", 3, now + TTL, now, "x"),
    "another_run": lambda now: Lease("m9", 1, now + TTL, now, "x"),
}


@pytest.mark.parametrize("kind", [*HOSTILE, "garbage"])
def test_hostile_leases_are_invalid_and_never_hang_a_standby(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = SharedDirectoryTransport(tmp_path / "store")
    store.create_store()
    published = tmp_path / "g.safetensors"
    published.write_bytes(b"weights")
    meta = GlobalMetadata.for_file(published, 4, master="m1", lease_epoch=2)
    put_lease(store, Lease("m1", 2, time.time() + TTL, time.time(), "x"))
    store.publish_global(published, meta)  # the run's global: published under epoch 2
    put_lease(store, b"{not json" if kind == "garbage" else HOSTILE[kind](time.time()))
    clock = [0.0]
    standby = Standby(store, "w1", ttl=TTL, monotonic=lambda: clock[0])
    with caplog.at_level(logging.WARNING, "speedtronic.diloco.standby"):
        assert standby.check() is None
        clock[0] += TTL  # not long enough yet; the same file is not counted again
        assert standby.check() is None
    assert standby.invalid == 1
    lines = [r.getMessage() for r in caplog.records if "invalid lease" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    expected = {
        "far_future": "ahead",
        "forged_holder": "is not a node id",
        "another_run": "not this run's lease",
        "garbage": "malformed",
    }[kind]
    assert expected in lines[0]
    clock[0] += CLOCK_MARGIN
    won = standby.check()
    assert won is not None and store.read_lease().holder == "w1"
    assert won.epoch >= 3  # above the epoch the global was published under
    won.keeper.mark_lost("the test is done with it")


def worker(store: Transport, tmp_path: Path, node: str, **options: Any) -> DumbDiLoCoCoordinator:
    config = dist_config(node_id=node, failover=True, lease_ttl=TTL, poll_interval=0.05, **options)
    return DumbDiLoCoCoordinator(config, make_net(), hub=store, state_dir=tmp_path / node)


def test_a_worker_takes_over_and_runs_the_outer_loop_while_it_trains(tmp_path: Path) -> None:
    store = SharedDirectoryTransport(tmp_path / "store")
    events: list[tuple[str, dict[str, Any]]] = []
    m1 = DumbDiLoCoCoordinator(
        dist_config(role="master", node_id="m1", lease_ttl=TTL),
        make_net(),
        hub=store,
        state_dir=tmp_path / "m1",
    )
    m1.start()
    wait_for(lambda: store.read_global_metadata() is not None, what="m1's first global")
    m1.outer.stop()
    m1.outer.lease.mark_lost("simulated death")  # no release: the lease lapses
    w1 = DumbDiLoCoCoordinator(
        dist_config(node_id="w1", failover=True, lease_ttl=TTL, poll_interval=0.05),
        make_net(),
        hub=store,
        state_dir=tmp_path / "w1",
        logger=lambda event, payload: events.append((event, payload)),
    )
    w1.start()
    step = 0
    deadline = time.monotonic() + SETTLE
    while w1.outer is None:
        assert time.monotonic() < deadline, "no take-over"
        step += 1
        nudge(w1.model)
        w1.after_optimizer_step(w1.model, step)
        time.sleep(0.05)
    taken = [p for e, p in events if e == "master_takeover"]
    assert len(taken) == 1
    assert taken[0]["previous_master"] == "m1" and taken[0]["epoch"] == 2
    assert taken[0]["outer_step"] == 0
    for _ in range(4):  # its own deltas reach the store and its outer loop aggregates them
        step += 1
        nudge(w1.model)
        w1.after_optimizer_step(w1.model, step)
    wait_for(
        lambda: (store.read_global_metadata() or GlobalMetadata(0, "0" * 64, 0)).outer_step >= 1,
        what="the successor's first outer step",
    )
    meta = store.read_global_metadata()
    assert meta.master == "w1" and meta.lease_epoch == 2
    w1.stop()
    m1.stop()
    assert store.read_lease().released  # the successor gave it up cleanly at the end


def test_a_fenced_master_with_failover_goes_on_as_a_worker(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = SharedDirectoryTransport(tmp_path / "store")
    m1 = DumbDiLoCoCoordinator(
        dist_config(role="master", node_id="m1", lease_ttl=TTL, failover=True, poll_interval=0.05),
        make_net(),
        hub=store,
        state_dir=tmp_path / "m1",
    )
    m1.start()
    wait_for(lambda: store.read_global_metadata() is not None, what="m1's first global")
    keeper = m1.outer.lease
    now = time.time()
    put_lease(store, Lease("w2", keeper.epoch + 1, now + 60, now, "y"))  # another took it
    wait_for(lambda: not m1.outer.running, what="m1's outer loop to notice")
    nudge(m1.model)
    m1.after_optimizer_step(m1.model, 1)  # no OuterLoopStopped: it is a worker now
    assert m1.outer is None
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("continues as a worker" in line and "'w2'" in line for line in lines), lines
    assert not any("the run stops" in line for line in lines), lines
    for step in range(2, 6):
        nudge(m1.model)
        m1.after_optimizer_step(m1.model, step)
    assert store.read_lease().holder == "w2"  # it never wrote over its successor
    assert torch.isfinite(next(m1.model.parameters())).all()
    m1.stop()


def sync_failover_master(
    store: Transport, tmp_path: Path, min_deltas: int
) -> DumbDiLoCoCoordinator:
    """A started sync master ``m1`` with failover whose rounds never time out (quick polls),
    once its first global is in ``store``."""
    m1 = DumbDiLoCoCoordinator(
        dist_config(
            role="master",
            node_id="m1",
            lease_ttl=TTL,
            failover=True,
            poll_interval=0.05,
            rounds="sync",
            min_deltas=min_deltas,
            round_timeout=3600.0,
        ),
        make_net(),
        hub=store,
        state_dir=tmp_path / "m1",
    )
    m1.start()
    wait_for(lambda: store.read_global_metadata() is not None, what="m1's first global")
    return m1


def at_boundary(node: DumbDiLoCoCoordinator, failures: list[BaseException]) -> threading.Thread:
    """Steps 1 and 2 of ``node`` in a started thread (inner_steps 2: step 2 delivers, then
    waits for its round); what they raise goes to ``failures``."""

    def boundary() -> None:
        try:
            for step in (1, 2):
                nudge(node.model)
                node.after_optimizer_step(node.model, step)
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=boundary, daemon=True)
    thread.start()
    return thread


def test_a_master_fenced_while_it_waits_for_its_sync_round_goes_on_as_a_worker(
    tmp_path: Path,
) -> None:
    """A sync master waits at its boundary for a round that needs a second node; another
    master takes the lease meanwhile. The wait ends (no OuterLoopStopped) and the node trains
    on as a worker."""
    store = SharedDirectoryTransport(tmp_path / "store")
    m1 = sync_failover_master(store, tmp_path, min_deltas=2)
    failures: list[BaseException] = []
    trainer = at_boundary(m1, failures)
    wait_for(lambda: bool(store.list_deltas()), what="m1's delta")
    now = time.time()
    put_lease(store, Lease("w2", m1.outer.lease.epoch + 1, now + 60, now, "y"))
    trainer.join(SETTLE)
    assert not trainer.is_alive(), "the fenced master still waits for its round"
    assert not failures, failures
    assert m1.outer is None  # a worker at once: nothing of its own unpublished state installed
    nudge(m1.model)
    m1.after_optimizer_step(m1.model, 3)
    assert m1.outer is None
    assert store.read_lease().holder == "w2"
    m1.stop()


def test_a_fenced_master_never_installs_the_global_it_could_not_publish(tmp_path: Path) -> None:
    """A failover master's round is adopted, then its publication is fenced (another master
    took the lease meanwhile). The master, waiting at its sync boundary, must not install
    that global: nobody else has it, and its next delta would claim it as its base."""
    store = SharedDirectoryTransport(tmp_path / "store")
    m1 = sync_failover_master(store, tmp_path, min_deltas=1)
    publishing, gate = threading.Event(), threading.Event()
    publish = store.publish_global

    def held(weights: Any, metadata: Any) -> Any:  # the round is adopted; its publication waits
        publishing.set()
        gate.wait(SETTLE)
        return publish(weights, metadata)

    store.publish_global = held  # type: ignore[method-assign]
    failures: list[BaseException] = []
    trainer = at_boundary(m1, failures)  # step 2's round closes with m1 alone
    assert publishing.wait(SETTLE), "the round never reached its publication"
    time.sleep(0.5)  # the waiting master looks meanwhile (every 0.05 s)
    now = time.time()
    put_lease(store, Lease("w2", m1.outer.lease.epoch + 1, now + 60, now, "y"))
    gate.set()  # the publication meets the new holder: fenced
    trainer.join(SETTLE)
    assert not trainer.is_alive() and not failures, failures
    assert m1.outer is None  # a worker now
    assert m1.ctx.state.last_global_step == 0  # the unpublished outer step 1 never installed
    assert store.read_global_metadata().outer_step == 0
    m1.stop()


def test_a_take_over_while_nodes_wait_at_their_sync_boundary_closes_their_round(
    tmp_path: Path,
) -> None:
    """The master died before the round of w1 and w2 closed; w1 takes over while both wait at
    their boundaries. Its outer thread looks only every ``poll_interval`` (an hour here, so its
    standby check runs by hand), but the waiting w1 wakes it at every look: the round of both
    closes and both go on."""
    store = SharedDirectoryTransport(tmp_path / "store")
    m1 = DumbDiLoCoCoordinator(
        dist_config(role="master", node_id="m1", lease_ttl=TTL, rounds="sync"),
        make_net(),
        hub=store,
        state_dir=tmp_path / "m1",
    )
    m1.start()
    wait_for(lambda: store.read_global_metadata() is not None, what="m1's first global")
    m1.outer.stop()
    m1.outer.lease.mark_lost("simulated death")  # no release: the lease lapses
    slow = {"poll_interval": 3600.0, "round_timeout": 3600.0, "rounds": "sync", "min_deltas": 2}
    w1 = DumbDiLoCoCoordinator(
        dist_config(node_id="w1", failover=True, lease_ttl=TTL, **slow),
        make_net(),
        hub=store,
        state_dir=tmp_path / "w1",
    )
    w2 = DumbDiLoCoCoordinator(
        dist_config(node_id="w2", **slow), make_net(), hub=store, state_dir=tmp_path / "w2"
    )
    failures: list[BaseException] = []
    w1.start()
    w2.start()
    first = at_boundary(w1, failures)
    wait_for(lambda: any(i.node_id == "w1" for i in store.list_deltas()), what="w1's delta")
    assert w1.failover is not None
    won = None
    deadline = time.monotonic() + SETTLE
    while won is None:  # the lease lapses TTL after m1's last renewal
        assert time.monotonic() < deadline, "the lease never lapsed"
        won = w1.failover.standby.check()
        time.sleep(0.05)
    w1.failover._won(won)  # what the watch thread does at the poll that wins
    second = at_boundary(w2, failures)
    first.join(SETTLE)
    second.join(SETTLE)
    assert not first.is_alive() and not second.is_alive(), "the round never closed"
    assert not failures, failures
    meta = store.read_global_metadata()
    assert meta is not None and meta.master == "w1" and meta.outer_step == 1
    assert meta.deltas_included == 2
    w1.stop()
    w2.stop()
    m1.stop()


def test_status_shows_the_holder_the_standbys_and_when_the_lease_lapses(
    store: Transport, tmp_path: Path
) -> None:
    now = time.time()
    put_lease(store, Lease("m1", 4, now + 30, now, "x"))
    for node in ("w1", "w2", "m1"):  # the holder itself is not listed as a standby
        assert Standby(store, node, ttl=TTL).announce(tmp_path / node)
    if isinstance(store, SharedDirectoryTransport):  # a record that is not ours is skipped
        (store.root / "standbys" / "w3.json").write_bytes(b"\x00not json")
    status = collect_status(store)
    assert (status.lease["holder"], status.lease["epoch"]) == ("m1", 4)
    assert status.lease["lapses_at"] == pytest.approx(now + 30 + CLOCK_MARGIN)
    assert sorted(r["node_id"] for r in status.standbys) == ["w1", "w2"]
    assert status.to_json()["standbys"] == status.standbys
    lines = summary_lines(status)
    assert any(line.startswith("lease") and "lapses in" in line for line in lines), lines
    assert any(line.startswith("standbys") and "w1" in line and "w2" in line for line in lines)


def test_an_invalid_lease_that_its_holder_renews_is_reported_once_and_never_taken(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A holder whose lease looks like another run's (its epoch below the published one) but
    who renews it is alive: the standby says so once and leaves it alone."""
    store = SharedDirectoryTransport(tmp_path / "store")
    store.create_store()
    published = tmp_path / "g.safetensors"
    published.write_bytes(b"weights")
    put_lease(store, Lease("m1", 2, time.time() + TTL, time.time(), "x"))
    store.publish_global(
        published, GlobalMetadata.for_file(published, 4, master="m1", lease_epoch=2)
    )
    clock = [0.0]
    standby = Standby(store, "w1", ttl=TTL, monotonic=lambda: clock[0])
    for _ in range(6):
        now = time.time()
        put_lease(store, Lease("m9", 1, now + TTL, now, "same-instance"))  # a renewal
        assert standby.check() is None
        clock[0] += TTL  # past lease_ttl + the margin since the first look, in all
    assert standby.invalid == 1 and store.read_lease().holder == "m9"
    assert sum("invalid lease" in r.getMessage() for r in caplog.records) == 1


def test_a_store_without_leases_leaves_a_standby_a_worker(tmp_path: Path) -> None:
    from diloco_fakes import MemoryTransport

    store = MemoryTransport()
    standby = Standby(store, "w1", ttl=TTL, monotonic=lambda: 1e9)
    assert standby.check() is None and standby.check() is None
    assert standby.unsupported and standby.invalid == 0
