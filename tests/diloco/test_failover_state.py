"""Fail-over at the unit level, on a real shared directory and on the Hub emulator (issue 30):
the outer state kept in the store makes a successor's first outer step bitwise the one the
dead master would have made (same deltas, same momentum, the same ledger); a master killed
between writing the global and its metadata leaves a store a successor continues from without
repeating or skipping an outer step; a store whose outer state is unusable falls back to the
global alone, loudly."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_fakes import dist_config, make_net
from hub_emulator import HubEmulator
from hub_fixtures import TOKEN, hub_fixture

from speedtronic_diloco.lease import LeaseKeeper
from speedtronic_diloco.master.loop import MasterOuterLoop
from speedtronic_diloco.master.store_state import KEEP_STATES, STATE_ENTRY
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.standby import Standby
from speedtronic_diloco.startup import prepare_master
from speedtronic_diloco.tensors import cpu_state_dict, load_tensors, save_tensors
from speedtronic_diloco.transports import Transport
from speedtronic_diloco.transports.hub import HubTransport
from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport
from speedtronic_diloco.transports.side_files import OUTER_STATE_DIR

__all__ = ["hub_fixture"]

TTL = 2.0
LATER = 60.0  # the standby's clock runs this far ahead: the dead master's lease has lapsed


@pytest.fixture(params=["shared_dir", "hub"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """``make()``: a fresh, empty store of the parameter's kind (several per test)."""
    if request.param == "shared_dir":
        count = iter(range(100))
        yield lambda: SharedDirectoryTransport(tmp_path / f"store{next(count)}")
        return
    hub: HubEmulator = request.getfixturevalue("hub")
    count = iter(range(100))

    def make() -> Transport:
        store = HubTransport(
            f"speedtronic/run-{next(count)}", token=TOKEN, endpoint=hub.endpoint, request_timeout=10
        )
        store.create_store()
        return store

    yield make


KEEPERS: list[LeaseKeeper] = []


@pytest.fixture(autouse=True)
def _no_renewals_after_the_test() -> Iterator[None]:
    """Each test's lease keepers stop renewing when it ends (their store may be gone)."""
    yield
    while KEEPERS:
        KEEPERS.pop().release(0.0)


def config(node: str) -> Any:
    return dist_config(
        role="master",
        node_id=node,
        outer_lr=0.7,
        outer_momentum=0.9,
        lease_ttl=TTL,
        keep_outer_steps=100,
        take_over=True,
    )


def weights() -> dict[str, torch.Tensor]:
    return cpu_state_dict(make_net().state_dict())


def master(
    store: Transport, tmp_path: Path, node: str, lease: LeaseKeeper | None = None
) -> MasterOuterLoop:
    """A master through the real startup path (lease, store state, adoption)."""
    where = tmp_path / f"{node}-{id(store)}"

    def fetch(metadata: Any) -> dict[str, torch.Tensor]:
        return load_tensors(store.download_global(metadata, where / "global.safetensors"))[0]

    loop = prepare_master(
        store,
        config(node),
        node_id=node,
        state_dir=where / "state",
        cache_dir=where / "cache",
        retry=RetryPolicy(2, 0.0),
        stop=threading.Event(),
        emit=lambda event, payload: None,
        fetch_global=fetch,
        current_weights=weights,
        lease=lease,
    )
    KEEPERS.append(loop.lease)
    return loop


def upload_round(store: Transport, tmp_path: Path, round_: int) -> None:
    """Deltas of nodes a and b for one round (seeded, so every scenario gets the same)."""
    for index, node in enumerate(("a", "b")):
        generator = torch.Generator().manual_seed(100 * round_ + index)
        delta = {
            k: torch.randn(v.shape, generator=generator) * 0.01
            for k, v in weights().items()
            if v.is_floating_point()
        }
        step = 10 * round_
        path = save_tensors(
            tmp_path / "up" / f"{node}_{step}_{id(store)}.safetensors",
            delta,
            {"node_id": node, "local_step": str(step)},
        )
        store.upload_delta(node, step, path)


def die(loop: MasterOuterLoop) -> None:
    """Stop a master as SIGKILL would: no release, no more renewals."""
    loop.stop(5.0)
    assert loop.lease is not None
    loop.lease.mark_lost("simulated death")
    loop.lease.release(30.0)  # lost: writes nothing, only waits for a renewal in flight


def take_over(store: Transport, node: str) -> LeaseKeeper:
    standby = Standby(store, node, ttl=TTL, clock=lambda: time.time() + LATER)
    won = standby.check()
    assert won is not None, "the standby did not take the lapsed lease"
    KEEPERS.append(won.keeper)
    return won.keeper


def two_rounds(store: Transport, tmp_path: Path) -> MasterOuterLoop:
    """m1 bootstraps, publishes and makes outer steps 1 and 2; round 3's deltas are waiting."""
    m1 = master(store, tmp_path, "m1")
    assert m1.publish_if_behind()
    for round_ in (1, 2):
        upload_round(store, tmp_path, round_)
        assert m1.run_round() is not None
    upload_round(store, tmp_path, 3)
    return m1


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_the_successor_makes_exactly_the_dead_masters_next_outer_step(
    stores: Any, tmp_path: Path
) -> None:
    reference = two_rounds(stores(), tmp_path)
    reference.run_round()

    store = stores()
    dead = two_rounds(store, tmp_path)
    die(dead)
    successor = master(store, tmp_path, "w1", take_over(store, "w1"))
    assert successor.outer_step == 2 and same(successor.keeper.momentum, dead.keeper.momentum)
    assert successor.run_round() is not None

    assert successor.outer_step == reference.outer_step == 3
    assert same(successor.global_state, reference.global_state)
    assert same(successor.keeper.momentum, reference.keeper.momentum) and successor.keeper.momentum
    assert sorted(successor.keeper.processed) == sorted(reference.keeper.processed)
    assert len(successor.keeper.processed) == 6  # three rounds of two nodes, none counted twice
    published = store.read_global_metadata()
    assert (published.outer_step, published.master, published.lease_epoch) == (3, "w1", 2)
    assert published.extra[STATE_ENTRY]["outer_step"] == 3


def test_without_the_stored_state_the_successor_restarts_its_momentum(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The control of the test above: the same take-over with a state file that does not
    match what the metadata names is NOT the dead master's step (so the comparison can
    fail), and the successor says why."""
    reference = two_rounds(SharedDirectoryTransport(tmp_path / "reference"), tmp_path)
    reference.run_round()
    store = SharedDirectoryTransport(tmp_path / "store")
    die(two_rounds(store, tmp_path))
    named = store.read_global_metadata().extra[STATE_ENTRY]["file"]
    data = bytearray((store.root / named).read_bytes())
    data[-1] ^= 1  # one flipped bit: the sha256 the metadata names no longer matches
    (store.root / named).write_bytes(bytes(data))

    successor = master(store, tmp_path, "w1", take_over(store, "w1"))
    assert "is not usable" in caplog.text and "sha256" in caplog.text
    assert successor.outer_step == 2 and successor.keeper.momentum == {}
    successor.run_round()
    assert successor.outer_step == 3
    assert not same(successor.global_state, reference.global_state)


class Killed(BaseException):
    """The master's process dies here."""


class DiesBeforeMetadata(SharedDirectoryTransport):
    """Writes the version file and ``latest.safetensors`` of a publication, then dies before
    the metadata (under the store's lock, as a SIGKILL there would)."""

    armed = False

    def _replace_latest(self, version: Path) -> None:
        super()._replace_latest(version)
        if self.armed:
            raise Killed


def test_a_master_killed_between_the_global_and_its_metadata(tmp_path: Path) -> None:
    reference = two_rounds(SharedDirectoryTransport(tmp_path / "reference"), tmp_path)
    reference.run_round()

    store = DiesBeforeMetadata(tmp_path / "store")
    dead = two_rounds(store, tmp_path)
    store.armed = True
    with pytest.raises(Killed):
        dead.run_round()  # outer step 3: its state and global are written, not its metadata
    store.armed = False
    assert store.read_global_metadata().outer_step == 2
    names = [path for path, _ in store.side_files.list_side_files(OUTER_STATE_DIR)]
    assert any("/s00000003-" in name for name in names)  # an orphan nobody names
    die(dead)

    successor = master(store, tmp_path, "w1", take_over(store, "w1"))
    assert successor.outer_step == 2  # the metadata's step, with its own state
    successor.run_round()
    assert successor.outer_step == 3  # not repeated, not skipped
    assert same(successor.global_state, reference.global_state)
    assert same(successor.keeper.momentum, reference.keeper.momentum)
    assert store.read_global_metadata().outer_step == 3


class HubDiesBeforeItsCommit(HubTransport):
    """Dies right before the commit of a publication (its global, metadata and outer state:
    one commit on the Hub)."""

    armed = False

    def _commit_global(self, files: Any, published: Any) -> Any:
        if self.armed:
            raise Killed
        return super()._commit_global(files, published)


def test_a_hub_master_killed_before_its_publication_commit_leaves_no_orphan(
    hub: HubEmulator, tmp_path: Path
) -> None:
    def store(name: str, kind: type[HubTransport] = HubTransport) -> HubTransport:
        made = kind(f"speedtronic/{name}", token=TOKEN, endpoint=hub.endpoint, request_timeout=10)
        made.create_store()
        return made

    reference = two_rounds(store("reference"), tmp_path)
    reference.run_round()
    dying = store("dying", HubDiesBeforeItsCommit)
    dead = two_rounds(dying, tmp_path)
    dying.armed = True
    with pytest.raises(Killed):
        dead.run_round()
    dying.armed = False
    assert dying.read_global_metadata().outer_step == 2
    assert not any("/s00000003-" in p for p, _ in dying.side_files.list_side_files(OUTER_STATE_DIR))
    die(dead)
    successor = master(dying, tmp_path, "w1", take_over(dying, "w1"))
    assert successor.outer_step == 2
    successor.run_round()
    assert successor.outer_step == 3
    assert same(successor.global_state, reference.global_state)
    assert same(successor.keeper.momentum, reference.keeper.momentum)


def test_a_standby_that_dies_mid_takeover_leaves_a_usable_store(
    stores: Any, tmp_path: Path
) -> None:
    """w1 wins the lease and dies before it publishes anything; w2 takes the lease when w1's
    lapses and continues exactly where m1 stopped."""
    reference = two_rounds(stores(), tmp_path)
    reference.run_round()
    store = stores()
    die(two_rounds(store, tmp_path))
    first = take_over(store, "w1")
    first.mark_lost("simulated death")  # no renewal, no release: w1 is gone
    first.release(30.0)  # lost: writes nothing, only waits for a renewal in flight
    standby = Standby(store, "w2", ttl=TTL, clock=lambda: time.time() + 2 * LATER)
    won = standby.check()
    assert won is not None and won.previous_master == "w1" and won.epoch == 3
    successor = master(store, tmp_path, "w2", won.keeper)
    successor.run_round()
    assert successor.outer_step == 3
    assert same(successor.global_state, reference.global_state)
    assert same(successor.keeper.momentum, reference.keeper.momentum)


def test_the_store_keeps_a_bounded_number_of_outer_states(tmp_path: Path) -> None:
    store = SharedDirectoryTransport(tmp_path / "store")
    m1 = master(store, tmp_path, "m1")
    m1.publish_if_behind()
    for round_ in range(1, 7):
        upload_round(store, tmp_path, round_)
        m1.run_round()
    names = [path for path, _ in store.side_files.list_side_files(OUTER_STATE_DIR)]
    assert 1 <= len(names) <= KEEP_STATES, names
    named = store.read_global_metadata().extra[STATE_ENTRY]["file"]
    assert named in names and "/s00000006-" in named
