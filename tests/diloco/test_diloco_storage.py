"""A run you can leave alone (issue 19) and the ledger findings of issue 22, with the real outer
loop on a shared directory (and the Hub emulator): deltas identified by content, never
forgotten by absence, deleted once old, the Hub's deletion commits and history squash, bounded
metadata and caches over a long run with restarted and fresh masters, the lease refusing a
second master and fencing a replaced one, a dying outer thread stopping the run, and workers
refusing a forged outer-step jump."""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_fakes import SETTLE, dist_config, make_master, make_net, nudge, wait_for
from hub_emulator import HubEmulator
from hub_fixtures import REPO, hub_fixture, transport  # noqa: F401

from speedtronic.errors import ConfigError
from speedtronic_diloco.config import DistributedConfig
from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic_diloco.lease import LeaseHeldError
from speedtronic_diloco.master.loop import MasterOuterLoop, OuterLoopStopped
from speedtronic_diloco.master.store_state import KEEP_STATES
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.startup import prepare_master
from speedtronic_diloco.tensors import cpu_state_dict, load_tensors, save_tensors
from speedtronic_diloco.transports import GLOBAL_METADATA, GlobalMetadata, Lease, Transport
from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport
from speedtronic_diloco.transports.side_files import OUTER_STATE_DIR

NO_WAIT = RetryPolicy(retries=1, backoff=0.0)


def weights() -> dict[str, torch.Tensor]:
    return cpu_state_dict(make_net().state_dict())


def small_delta(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        k: 0.01 * torch.randn(v.shape, generator=generator)
        for k, v in weights().items()
        if v.is_floating_point()
    }


def upload(store: Transport, tmp_path: Path, node: str, step: int, base: int = 0) -> None:
    path = save_tensors(
        tmp_path / "outbox" / f"{node}_{step}.safetensors",
        small_delta(hash((node, step)) % 10_000),
        {"format": "1", "node_id": node, "local_step": step, "base_outer_step": base},
    )
    store.upload_delta(node, step, path)


def make_loop(store: Transport, state: Path, **kwargs: Any) -> MasterOuterLoop:
    return make_master(
        store,
        state,
        state_dir=state / "m",
        cache_dir=state / "m" / "cache",
        retry=NO_WAIT,
        rules={"outlier_policy": "off", "keep_history": 0},
        **kwargs,
    )


def shared(tmp_path: Path) -> SharedDirectoryTransport:
    store = SharedDirectoryTransport(tmp_path / "store")
    store.create_store()
    return store


# --------------------------------------------------------------------------- ledger by content


def test_touched_delta_is_not_aggregated_twice(tmp_path: Path) -> None:
    store = shared(tmp_path)
    loop = make_loop(store, tmp_path / "state")
    loop.keeper.bootstrap(weights())
    upload(store, tmp_path, "w", 5)
    assert loop.run_round().included == (("w", 5),)
    path = tmp_path / "store" / "nodes" / "w" / "delta_5.safetensors"
    os.utime(path)  # `touch`: new mtime, same bytes
    assert loop.run_round() is None
    assert loop.outer_step == 1
    # A restarted worker that writes *new* bytes under the same step contributes again.
    path.write_bytes(save_tensors(tmp_path / "again.safetensors", small_delta(99)).read_bytes())
    assert loop.run_round().included == (("w", 5),)


def test_delta_missing_from_one_listing_is_not_forgotten(tmp_path: Path) -> None:
    """A node's folder moved away for two rounds and back: none of its old deltas is
    aggregated again (the ledger used to forget what a listing did not show)."""
    store = shared(tmp_path)
    loop = make_loop(store, tmp_path / "state", keep_outer_steps=1000)
    loop.keeper.bootstrap(weights())
    for step in range(1, 48):
        upload(store, tmp_path, "away", step)
    upload(store, tmp_path, "stay", 1)
    first = loop.run_round()
    assert len(first.included) == 48
    folder = tmp_path / "store" / "nodes" / "away"
    shutil.move(folder, tmp_path / "elsewhere")
    for step in (2, 3):
        upload(store, tmp_path, "stay", step)
        assert loop.run_round().included == (("stay", step),)
    shutil.move(tmp_path / "elsewhere", folder)
    assert loop.run_round() is None  # nothing new
    shutil.copytree(folder, tmp_path / "copy")  # and copied back (new inodes, new mtimes)
    shutil.rmtree(folder)
    shutil.copytree(tmp_path / "copy", folder)
    assert loop.run_round() is None
    assert loop.outer_step == 3


# --------------------------------------------------------------------------- bounded storage


def test_processed_deltas_are_deleted_once_keep_outer_steps_old(tmp_path: Path) -> None:
    store = shared(tmp_path)
    loop = make_loop(store, tmp_path / "state", keep_outer_steps=2)
    loop.keeper.bootstrap(weights())
    for round_ in range(1, 7):
        upload(store, tmp_path, "w", round_, base=loop.outer_step)
        loop.run_round()
        kept = sorted(info.local_step for info in store.list_deltas())
        assert kept == list(range(max(1, round_ - 1), round_ + 1)), (round_, kept)
    assert loop.housekeeper.deleted == 4


def test_hub_deletes_in_one_commit_per_round_apart_from_the_publication(
    hub: HubEmulator, tmp_path: Path
) -> None:
    store = transport(hub)
    store.create_store()
    loop = make_loop(store, tmp_path / "state", keep_outer_steps=1, squash_history_every=3)
    loop.keeper.bootstrap(weights())
    summaries: list[list[str]] = []
    for round_ in range(1, 7):
        for node in ("a", "b"):
            upload(store, tmp_path, node, round_, base=loop.outer_step)
        before = len(hub.history(REPO))
        loop.run_round()
        summaries.append([r.path for r in hub.requests if r.kind in ("commit", "squash")])
        assert len(hub.history(REPO)) <= before + 2 or round_ % 3 == 0
    files = hub.files(REPO)
    assert sorted(p for p in files if p.startswith("nodes/")) == [
        "nodes/a/delta_6.safetensors",
        "nodes/b/delta_6.safetensors",
    ]
    # Squashed at outer steps 3 and 6: the history is short and the old blobs are gone.
    assert len(hub.history(REPO)) <= 3
    assert hub.stored_bytes(REPO) < 4 * sum(len(v) for v in files.values())
    kinds = [r.kind for r in hub.requests if r.kind == "squash"]
    assert len(kinds) == 2


@pytest.mark.slow
def test_long_run_with_restarts_never_reaggregates_and_stays_bounded(tmp_path: Path) -> None:
    """160 outer rounds; every 40 the master is replaced, alternately by a restart from its
    state directory and by a fresh master that only has the store. No delta is aggregated
    twice; the published metadata and the store stay the same size, and the master's state
    file stops growing once its ledger window is full (64 deltas per node)."""
    store = shared(tmp_path)
    config = dist_config(
        role="master", node_id="m", keep_outer_steps=3, outer_momentum=0.0, keep_history=0
    )
    included: list[tuple[str, int]] = []
    sizes: dict[int, tuple[int, int, int]] = {}

    def start(state: Path) -> MasterOuterLoop:
        def fetch(metadata: GlobalMetadata) -> dict[str, torch.Tensor]:
            dest = store.download_global(metadata, state / "g.safetensors")
            return load_tensors(dest)[0]

        return prepare_master(
            store,
            config,
            node_id="m",
            state_dir=state,
            cache_dir=state / "cache",
            retry=NO_WAIT,
            stop=threading.Event(),
            emit=lambda event, payload: None,
            fetch_global=fetch,
            current_weights=weights,
        )

    state = tmp_path / "state-0"
    loop = start(state)
    for round_ in range(1, 161):
        if round_ % 40 == 0:
            loop.lease.release()
            fresh = round_ % 80 == 0
            state = tmp_path / f"state-{round_}" if fresh else state
            loop = start(state)
            assert loop.outer_step == round_ - 1
            assert loop.keeper.has_local_state
        for node in ("a", "b", "c"):
            upload(store, tmp_path, node, round_, base=loop.outer_step)
        result = loop.run_round()
        assert result is not None, round_
        included += list(result.included)
        if round_ in (10, 50, 100, 160):
            # The outer states kept in the store (fail-over) are the state file's size each,
            # counted apart: they grow with the ledger window as the state file does.
            outer = store.side_files.list_side_files(OUTER_STATE_DIR)
            kept = sum(size for _, size in outer)
            sizes[round_] = (
                (tmp_path / "store" / GLOBAL_METADATA).stat().st_size,
                loop.keeper.state_path.stat().st_size,
                (store.store_bytes() or 0) - kept,
                kept,
                len(outer),
            )
    assert len(included) == len(set(included)) == 480
    assert loop.outer_step == 160
    meta10, _, store10, _, _ = sizes[10]
    for meta, state_size, store_size, kept, count in (sizes[50], sizes[100], sizes[160]):
        assert meta <= meta10 * 1.1 and store_size <= store10 * 1.2, sizes
        assert count <= KEEP_STATES and kept <= count * state_size * 1.1, sizes
    assert sizes[160][1] <= sizes[100][1] * 1.05, sizes
    assert sizes[160][3] <= sizes[100][3] * 1.1, sizes
    assert len(store.list_deltas()) <= 3 * 4  # keep_outer_steps + the current round


def test_master_caches_stay_bounded(tmp_path: Path) -> None:
    store = shared(tmp_path)
    loop = make_loop(store, tmp_path / "state", cache_keep=2)
    loop.keeper.bootstrap(weights())
    leftovers = tmp_path / "state" / "m" / "cache" / "deltas" / "old"
    leftovers.mkdir(parents=True)
    for i in range(5):  # what a crash mid-round can leave behind
        (leftovers / f"delta_{i}.safetensors").write_bytes(b"x")
    upload(store, tmp_path, "w", 1)
    loop.run_round()
    assert len(list((tmp_path / "state" / "m" / "cache").rglob("*.safetensors"))) <= 2


def test_worker_global_cache_keeps_cache_keep_versions(tmp_path: Path) -> None:
    store = shared(tmp_path)
    loop = make_loop(store, tmp_path / "state")
    loop.keeper.bootstrap(weights())
    loop.publish()
    worker = DumbDiLoCoCoordinator(
        dist_config(repo_id=str(tmp_path / "store"), cache_keep=3, poll_interval=0.0),
        make_net(),
        hub=store,
        state_dir=tmp_path / "w",
    )
    worker.start()
    for step in range(1, 8):
        upload(store, tmp_path, "x", step, base=loop.outer_step)
        loop.run_round()
        worker.after_optimizer_step(worker.model, step)
    worker.stop()
    cached = list((worker.cache_dir / "global").glob("outer_*.safetensors"))
    assert len(cached) == 3


# --------------------------------------------------------------------------- the lease


def master(tmp_path: Path, node: str, store: Transport, **config: Any) -> DumbDiLoCoCoordinator:
    values = dict(role="master", node_id=node, poll_interval=0.05, lease_ttl=30.0)
    values.update(config)
    return DumbDiLoCoCoordinator(
        dist_config(**values), make_net(), hub=store, state_dir=tmp_path / node
    )


def test_a_second_master_refuses_to_start_naming_the_holder(tmp_path: Path) -> None:
    store = shared(tmp_path)
    first = master(tmp_path, "m1", store)
    first.start()
    second = master(tmp_path, "m2", store)
    with pytest.raises(LeaseHeldError, match=r"'m1' \(epoch 1, expires in \d+ s at .* UTC\)"):
        second.start()
    second.stop()
    first.stop()
    assert store.read_lease().released  # a clean stop gives the lease up
    third = master(tmp_path, "m3", store)
    third.start()  # so the next master starts at once
    assert store.read_lease().holder == "m3" and store.read_lease().epoch == 2
    third.stop()


def test_a_master_that_lost_its_lease_stops_publishing_and_the_run(tmp_path: Path) -> None:
    store = shared(tmp_path)
    first = master(tmp_path, "m1", store)
    first.start()
    wait_for(lambda: store.read_global_metadata() is not None, what="the bootstrap publication")
    # Another master takes over (as after an expiry) while m1 still runs.
    current = store.read_lease()
    store.write_lease(Lease("m2", current.epoch + 1, time.time() + 30), current)
    upload(store, tmp_path, "w", 5)
    wait_for(lambda: first.outer.failure is not None, what="the outer thread to stop")
    with pytest.raises(OuterLoopStopped, match="m2"):
        nudge(first.model)
        first.after_optimizer_step(first.model, 1)
    metadata = store.read_global_metadata()
    assert metadata.outer_step == 0  # the round m1 aggregated was never published
    first.stop()
    assert not store.read_lease().released  # m1 does not touch m2's lease


def test_dying_master_outer_thread_stops_the_run_loudly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``poll_interval: .inf`` used to kill the outer thread with an OverflowError: zero outer
    rounds and exit 0. Whatever ends the thread now stops the run with an error."""
    store = shared(tmp_path)
    coordinator = master(tmp_path, "m", store)
    coordinator.start()
    coordinator.outer.stop(SETTLE)
    coordinator.outer.start(float("inf"))  # past the config's bound: the wait overflows
    wait_for(lambda: coordinator.outer.failure is not None, what="the outer thread to die")
    assert "outer loop stopped" in caplog.text
    with pytest.raises(OuterLoopStopped, match="OverflowError"):
        coordinator.after_optimizer_step(coordinator.model, 1)
    coordinator.stop()


def test_every_float_option_has_a_finite_upper_bound() -> None:
    for field in fields(DistributedConfig):
        if "float" in str(field.type):
            bounded = field.metadata.get("le") is not None or field.metadata.get("lt") is not None
            assert bounded, f"distributed.{field.name} has no upper bound"
    for key, value in (
        ("poll_interval", math.inf),
        ("poll_interval", 1e300),
        ("outer_lr", 1e300),
        ("lease_ttl", 1e9),
        ("request_timeout", math.nan),
        ("retry_backoff", 1e6),
    ):
        with pytest.raises(ConfigError, match=key):
            DistributedConfig(**{key: value})


# --------------------------------------------------------------------------- forged metadata


def test_forged_outer_step_jump_is_not_adopted_by_workers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = shared(tmp_path)
    loop = make_loop(store, tmp_path / "state")
    loop.keeper.bootstrap(weights())
    upload(store, tmp_path, "x", 1)
    loop.run_round()  # publishes outer step 1
    worker = DumbDiLoCoCoordinator(
        dist_config(
            repo_id=str(tmp_path / "store"), poll_interval=0.0, inner_steps=1000, install_at="any"
        ),
        make_net(seed=3),
        hub=store,
        state_dir=tmp_path / "w",
    )
    worker.start()
    assert worker.last_global_step == 1
    # Someone rewrites step_count.json: outer step 10**9, the same (real) weights.
    path = tmp_path / "store" / GLOBAL_METADATA
    document = json.loads(path.read_text())
    document["outer_step"] = 10**9
    path.write_text(json.dumps(document))
    assert worker.after_optimizer_step(worker.model, 1) is False
    assert worker.last_global_step == 1  # not adopted as the new floor
    assert "claims outer step 1000000000" in caplog.text
    upload(store, tmp_path, "x", 2, base=1)
    loop.keeper.mark_unpublished()
    loop.run_round()  # the real master publishes outer step 2 over the forgery
    assert store.read_global_metadata().outer_step == 2
    assert worker.after_optimizer_step(worker.model, 2) is True
    assert worker.last_global_step == 2
    worker.stop()
