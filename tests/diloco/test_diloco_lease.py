"""The master's lease (speedtronic_diloco.lease) on a shared directory and on the Hub emulator:
taking it, refusing a second master with a clear error, taking over after expiry with
epoch + 1, renewal, loss, release."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from diloco_fakes import MemoryTransport, make_master, make_net, wait_for
from hub_emulator import HubEmulator
from hub_fixtures import hub_fixture, transport  # noqa: F401

from speedtronic_diloco import lease as lease_module
from speedtronic_diloco.lease import LeaseHeldError, LeaseKeeper, describe_lease
from speedtronic_diloco.master.loop import OuterLoopStopped
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.tensors import cpu_state_dict
from speedtronic_diloco.transports import Transport
from speedtronic_diloco.transports.base import Lease, LeaseLostError
from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport

NO_WAIT = RetryPolicy(retries=0, backoff=0.0)


@pytest.fixture(params=["shared_dir", "hub"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Transport:
    if request.param == "shared_dir":
        made: Transport = SharedDirectoryTransport(tmp_path / "store")
    else:
        made = transport(request.getfixturevalue("hub"))
    made.create_store()
    return made


def weights() -> dict:
    return cpu_state_dict(make_net().state_dict())


def keeper(store: Transport, node: str, ttl: float = 60.0, **kwargs: object) -> LeaseKeeper:
    return LeaseKeeper(store, node, ttl=ttl, retry=NO_WAIT, **kwargs)  # type: ignore[arg-type]


def test_first_master_takes_the_lease_with_epoch_1(store: Transport) -> None:
    taken = keeper(store, "m1").acquire()
    assert (taken.holder, taken.epoch) == ("m1", 1)
    assert store.read_lease() == taken


def test_second_master_refuses_naming_the_holder_and_the_expiry(store: Transport) -> None:
    keeper(store, "m1").acquire()
    with pytest.raises(LeaseHeldError) as refused:
        keeper(store, "m2").acquire()
    message = str(refused.value)
    assert "'m1'" in message and "expires in" in message and "UTC" in message
    assert "take_over" in message
    assert store.read_lease().holder == "m1"


def test_a_restarted_master_takes_its_own_lease_back_with_the_next_epoch(store: Transport) -> None:
    keeper(store, "m1").acquire()
    again = keeper(store, "m1").acquire()
    assert again.epoch == 2


def test_an_expired_lease_of_another_master_needs_take_over(store: Transport) -> None:
    keeper(store, "m1", ttl=1.0).acquire()
    wait_for(lambda: not store.read_lease().live(), what="the lease to expire")
    with pytest.raises(LeaseHeldError, match=r"expired.*take_over"):
        keeper(store, "m2").acquire()
    taken = keeper(store, "m2", take_over=True).acquire()
    assert (taken.holder, taken.epoch) == ("m2", 2)


def test_take_over_waits_for_a_live_lease_to_expire(
    store: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lease_module, "CLOCK_MARGIN", 0.1)
    first = keeper(store, "m1", ttl=1.5).acquire()  # never renewed: its master "died"
    taken = keeper(store, "m2", take_over=True).acquire()
    assert time.time() >= first.expires_at
    assert (taken.holder, taken.epoch) == ("m2", 2)


def test_take_over_refuses_a_master_that_keeps_renewing(
    store: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lease_module, "CLOCK_MARGIN", 0.1)
    alive = keeper(store, "m1", ttl=1.5)
    alive.acquire()
    alive.start()
    try:
        with pytest.raises(LeaseHeldError, match=r"renewed its lease.*alive"):
            keeper(store, "m2", take_over=True).acquire()
    finally:
        alive.release()


def test_renewal_extends_and_a_take_over_is_noticed_as_a_lost_lease(store: Transport) -> None:
    mine = keeper(store, "m1", ttl=30.0)
    first = mine.acquire()
    assert mine.renew()
    assert store.read_lease().expires_at >= first.expires_at
    store.write_lease(Lease("m2", 9, time.time() + 30), store.read_lease())  # taken behind us
    assert not mine.renew()
    with pytest.raises(LeaseLostError, match="'m2'"):
        mine.check()


def test_a_master_that_lost_its_lease_stops_at_its_next_poll(tmp_path: Path) -> None:
    """Issue 34, L6: noticed by the renewal, the loss ends the outer thread at its next poll,
    although no round is due for a day (it used to wait for its next publication)."""
    store = SharedDirectoryTransport(tmp_path / "store")
    store.create_store()
    mine = keeper(store, "m", ttl=0.6)
    mine.acquire()
    mine.start()
    loop = make_master(
        store, tmp_path, start=weights(), rules={"round_timeout": 86400.0}, lease=mine
    )
    loop.start(0.05)
    try:
        wait_for(lambda: store.read_global_metadata() is not None, what="the first publication")
        store.write_lease(Lease("m2", 9, time.time() + 30), store.read_lease())  # taken over
        wait_for(lambda: not loop.running, what="the outer thread to stop")
        assert isinstance(loop.failure, LeaseLostError) and "'m2'" in str(loop.failure)
        with pytest.raises(OuterLoopStopped, match="outer loop stopped"):
            loop.raise_if_failed()
    finally:
        loop.stop()
        mine.release()


def test_a_fenced_housekeeping_write_says_lease_lost_like_a_renewal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store may refuse any of the outer thread's writes first (under load a deletion of
    processed deltas can come before the next renewal): the run says 'master lease lost' in
    one line whichever it was, not only when the renewal or a publication saw it."""
    store = SharedDirectoryTransport(tmp_path / "store")
    store.create_store()
    mine = keeper(store, "m")
    mine.acquire()  # not started: no renewal can notice the loss here
    loop = make_master(store, tmp_path, start=weights(), lease=mine)
    refusal = LeaseLostError("delete: refused: 'm2' holds the lease with epoch 2")

    def fenced_round(abort: object = None) -> None:
        raise refusal

    monkeypatch.setattr(loop, "tick", fenced_round)
    with caplog.at_level("ERROR", logger="speedtronic.diloco.lease"):
        loop.start(0.05)
        try:
            wait_for(lambda: not loop.running, what="the outer thread to stop")
        finally:
            loop.stop()
    assert loop.failure is refusal
    assert mine.lost == str(refusal)
    lines = [r.getMessage() for r in caplog.records if "master lease lost" in r.getMessage()]
    assert lines == [f"master lease lost: {refusal}. This master stops publishing."]
    with pytest.raises(LeaseLostError):
        mine.check()


def test_release_lets_a_successor_start_without_take_over(store: Transport) -> None:
    first = keeper(store, "m1")
    first.acquire()
    first.release()
    assert store.read_lease().released
    assert keeper(store, "m2").acquire().epoch == 2


def test_background_renewal_keeps_the_lease_live(store: Transport) -> None:
    mine = keeper(store, "m1", ttl=1.0)
    taken = mine.acquire()
    mine.start()
    try:
        wait_for(lambda: store.read_lease().expires_at > taken.expires_at, what="a renewal")
    finally:
        mine.release()


def test_a_malformed_lease_refuses_unless_take_over(tmp_path: Path) -> None:
    store = SharedDirectoryTransport(tmp_path / "store")
    store.create_store()
    (tmp_path / "store" / "global" / "lease.json").write_text("{broken")
    with pytest.raises(LeaseHeldError, match="malformed"):
        keeper(store, "m1").acquire()
    assert keeper(store, "m1", take_over=True).acquire().holder == "m1"


def test_a_store_without_leases_runs_unfenced() -> None:
    mine = keeper(MemoryTransport(), "m1")
    assert mine.acquire() is None
    assert not mine.supported and mine.check() is None


def test_describe_lease() -> None:
    now = 1_700_000_000.0
    assert "expires in 42 s" in describe_lease(Lease("m", 3, now + 42), now)
    assert "expired 5 s ago" in describe_lease(Lease("m", 3, now - 5), now)
    assert "released" in describe_lease(Lease("m", 3, now, released=True), now)


def test_hub_lease_survives_deltas_moving_the_branch(hub: HubEmulator, tmp_path: Path) -> None:
    store = transport(hub)
    store.create_store()
    mine = keeper(store, "m1")
    mine.acquire()
    from hub_fixtures import delta_file

    for step in range(3):
        transport(hub).upload_delta("w", step, delta_file(tmp_path, f"d{step}", b"%d" % step))
        assert mine.renew()
    assert store.read_lease().holder == "m1"


def test_train_take_over_flag_sets_the_config_key(tmp_path: Path) -> None:
    """``speedtronic train --take-over`` (added by the plugin) is ``distributed.take_over``,
    applied in command-line order with the ``--set`` options."""
    from speedtronic.cli import build_parser, load_config

    path = tmp_path / "c.yaml"
    path.write_text("distributed: {enabled: true, role: master, repo_id: 'file://s'}\n")
    parser = build_parser()
    for argv, expected in [
        ([], False),
        (["--take-over"], True),
        (["--set", "distributed.take_over=false", "--take-over"], True),
        (["--take-over", "--set", "distributed.take_over=false"], False),
    ]:
        args = parser.parse_args(["train", "-c", str(path), *argv])
        assert load_config(args).plugins["distributed"].take_over is expected, argv
    assert "--take-over" in parser._subparsers._group_actions[0].choices["train"].format_help()
