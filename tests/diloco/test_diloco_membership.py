"""Membership the master can see (issue 30, item 4): ``left`` records on both stores (checked
like every untrusted file), the silence rule, ``min_deltas`` counting live nodes only, the
store holding at most one processed delta per node and round, and ``status`` listing the
nodes that left apart from the live ones."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_fakes import MemoryTransport, make_master, make_net
from hub_emulator import HubEmulator
from hub_fixtures import hub_fixture, transport  # noqa: F401

from speedtronic_diloco.aggregation import AggregationRules
from speedtronic_diloco.master.loop import MasterOuterLoop
from speedtronic_diloco.master.round_policy import RoundPolicy
from speedtronic_diloco.membership import Membership, announce_back, announce_left, left_reason
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.status import collect_status
from speedtronic_diloco.tensors import cpu_state_dict, save_tensors
from speedtronic_diloco.transports import PermanentTransportError, Transport
from speedtronic_diloco.transports.members import LEFT_LIMIT, LeftRecord, left_path
from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport

NO_WAIT = RetryPolicy(retries=1, backoff=0.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def weights() -> dict[str, torch.Tensor]:
    return cpu_state_dict(make_net().state_dict())


def upload(
    store: Transport, tmp_path: Path, node: str, step: int, base: int = 0, final: bool = False
) -> None:
    generator = torch.Generator().manual_seed(hash((node, step)) % 10_000)
    delta = {
        k: 0.01 * torch.randn(v.shape, generator=generator)
        for k, v in weights().items()
        if v.is_floating_point()
    }
    meta = {"format": "1", "node_id": node, "local_step": step, "base_outer_step": base}
    if final:
        meta["final"] = "1"
    path = save_tensors(tmp_path / "outbox" / f"{node}_{step}.safetensors", delta, meta)
    store.upload_delta(node, step, path)


def shared(tmp_path: Path) -> SharedDirectoryTransport:
    store = SharedDirectoryTransport(tmp_path / "store")
    store.create_store()
    return store


def master(store: Transport, tmp_path: Path, **kwargs: Any) -> MasterOuterLoop:
    rules = {"outlier_policy": "off", "keep_history": 0, **kwargs.pop("rules", {})}
    loop = make_master(store, tmp_path, retry=NO_WAIT, rules=rules, **kwargs)
    loop.keeper.bootstrap(weights())
    return loop


# --------------------------------------------------------------------------- the record


def record_bytes(**fields: Any) -> bytes:
    document = {"format": 1, "node_id": "w1", "last_step": 120, "reason": "max_steps"}
    document.update(fields)
    return json.dumps(document).encode()


def test_a_left_record_round_trips() -> None:
    record = LeftRecord("w1", 120, "stopped", 1_700_000_000.0)
    assert LeftRecord.loads(record.dumps(), "x", "w1") == record


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (record_bytes(node_id="w2"), "node_id"),
        (record_bytes(last_step=True), "last_step"),
        (record_bytes(last_step=-1), "last_step"),
        (record_bytes(last_step="120"), "last_step"),
        (record_bytes(last_step=1 << 70), "last_step"),
        (record_bytes(reason="bored"), "reason"),
        (record_bytes(reason=["max_steps"]), "reason"),
        (record_bytes(left_at=1e18), "left_at"),
        (record_bytes(left_at="yesterday"), "left_at"),
        (b" " * (LEFT_LIMIT + 1), "larger than"),
    ],
)
def test_a_hostile_left_record_is_refused_naming_file_and_field(raw: bytes, field: str) -> None:
    with pytest.raises(PermanentTransportError, match=field) as caught:
        LeftRecord.loads(raw, "nodes/w1/left.json", "w1")
    assert "nodes/w1/left.json" in str(caught.value)


def test_the_reason_a_run_ended() -> None:
    assert left_reason(None, 120, 120) == "max_steps"
    assert left_reason(None, 60, 120) == "stopped"
    assert left_reason(RuntimeError("boom"), 60, 120) == "error"


# --------------------------------------------------------------------------- both stores


def check_store_records(store: Any) -> None:
    assert store.members.read_left().records == {}
    assert announce_left(store, "w1", 120, "max_steps", retry=NO_WAIT)
    assert announce_left(store, "w2", 7, "error", retry=NO_WAIT)
    found = store.members.read_left()
    assert {n: (r.last_step, r.reason) for n, r in found.records.items()} == {
        "w1": (120, "max_steps"),
        "w2": (7, "error"),
    }
    assert found.refused == ()
    assert announce_back(store, "w1", retry=NO_WAIT)
    assert announce_back(store, "w3", retry=NO_WAIT)  # no record: nothing to do
    assert set(store.members.read_left().records) == {"w2"}
    assert store.list_deltas() == []  # a record is no delta


def test_shared_dir_left_records(tmp_path: Path) -> None:
    check_store_records(shared(tmp_path))


def test_hub_left_records(hub: HubEmulator) -> None:
    store = transport(hub)
    store.create_store()
    check_store_records(store)


def test_hub_refuses_a_hostile_left_record(hub: HubEmulator, tmp_path: Path) -> None:
    store = transport(hub)
    store.create_store()
    announce_left(store, "w1", 5, "max_steps", retry=NO_WAIT)
    forged = tmp_path / "forged.json"
    forged.write_bytes(record_bytes(node_id="w1", last_step=True))
    store.repo.api.upload_file(  # another writer of the store, forging w2's record
        path_or_fileobj=str(forged), path_in_repo=left_path("w2"), repo_id=store.repo_id
    )
    found = store.members.read_left()
    assert set(found.records) == {"w1"}
    assert len(found.refused) == 1 and "nodes/w2/left.json" in found.refused[0]
    assert "node_id" in found.refused[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
def test_shared_dir_refuses_special_and_escaping_left_records(tmp_path: Path) -> None:
    store = shared(tmp_path)
    announce_left(store, "good", 3, "stopped", retry=NO_WAIT)
    (store.root / "nodes" / "fifo").mkdir()
    os.mkfifo(store.root / left_path("fifo"))  # a reader blocking on it would hang
    outside = tmp_path / "outside.json"
    outside.write_bytes(record_bytes(node_id="link"))
    (store.root / "nodes" / "link").mkdir()
    os.symlink(outside, store.root / left_path("link"))
    (store.root / "nodes" / "big").mkdir()
    (store.root / left_path("big")).write_bytes(b"{" * (LEFT_LIMIT + 1))
    found = store.members.read_left()
    assert set(found.records) == {"good"}
    assert len(found.refused) == 3
    assert any("FIFO" in problem for problem in found.refused)
    assert any("outside the store" in problem for problem in found.refused)


# --------------------------------------------------------------------------- who is live


def test_min_deltas_counts_live_nodes_only() -> None:
    clock = FakeClock()
    policy = RoundPolicy.of(
        AggregationRules(min_deltas=2, round_timeout=100.0, lease_ttl=30.0), clock
    )
    assert policy.recent_s == 30.0  # silence of lease_ttl (< 2 x round_timeout): gone
    assert policy.needed() == 2  # nobody seen yet: the first rounds wait for min_deltas
    policy.saw("m")
    assert policy.needed() == 2
    policy.saw("w")
    assert policy.needed() == 2
    policy.left({"w"})
    assert policy.needed() == 1 and policy.decide(["m"]).go
    policy.left(set())  # w came back
    assert policy.needed() == 2 and not policy.decide(["m"]).go
    clock.now += 20.0
    policy.saw("m")
    clock.now += 15.0  # w silent for 35 s > lease_ttl: gone
    assert policy.recent_nodes() == {"m"} and policy.needed() == 1
    sync = RoundPolicy.of(AggregationRules(min_deltas=2, rounds="sync", lease_ttl=30.0), clock)
    sync.saw("m")
    sync.saw("w")
    sync.left({"w"})
    assert sync.needed() == 1  # the sync close rule counts live nodes only too
    longer = RoundPolicy.of(AggregationRules(round_timeout=5.0, lease_ttl=30.0), clock)
    assert longer.recent_s == 10.0


def test_a_delta_past_the_records_last_step_means_the_node_is_back(tmp_path: Path) -> None:
    store = shared(tmp_path)
    members = Membership(store)
    announce_left(store, "w", 10, "stopped", retry=NO_WAIT)
    upload(store, tmp_path, "w", 10)  # its final delta: still gone
    assert members.gone(store.list_deltas()) == {"w"}
    upload(store, tmp_path, "w", 15)  # resumed, its record not deleted (yet)
    assert members.gone(store.list_deltas()) == set()
    assert Membership(MemoryTransport()).gone([]) == set()  # a store without records


def test_master_rounds_continue_with_the_live_nodes(tmp_path: Path) -> None:
    """The measured failure of issue 30: with min_deltas 2, once the worker finished the
    master's own deltas piled up and the global stood still until the final round. With its
    left record, every delta of the master makes a round of its own."""
    store = shared(tmp_path)
    loop = master(store, tmp_path, rules={"min_deltas": 2, "round_timeout": 3600.0})
    for step in (5, 10):
        upload(store, tmp_path, "m", step, base=loop.outer_step)
        upload(store, tmp_path, "w", step, base=loop.outer_step)
        result = loop.tick()
        assert result is not None and result.reason == "quorum"
        assert set(result.nodes) == {"m", "w"}
    upload(store, tmp_path, "m", 15, base=loop.outer_step)
    assert loop.tick() is None  # w is live: the round waits for it (as before)
    announce_left(store, "w", 10, "max_steps", retry=NO_WAIT)
    rounds = []
    result = loop.tick()
    assert result is not None and result.nodes == ("m",) and result.reason == "quorum"
    rounds.append(result.outer_step)
    for step in (20, 25, 30):
        upload(store, tmp_path, "m", step, base=loop.outer_step)
        result = loop.tick()
        assert result is not None and result.included == (("m", step),)
        rounds.append(result.outer_step)
    assert rounds == [3, 4, 5, 6]  # one outer step per boundary of the master
    announce_back(store, "w", retry=NO_WAIT)  # w resumes: waited for again
    upload(store, tmp_path, "m", 35, base=loop.outer_step)
    assert loop.tick() is None


def test_sync_rounds_wait_for_the_last_rounds_nodes_however_long_an_inner_loop_takes(
    tmp_path: Path,
) -> None:
    """An inner loop longer than the liveness window (2 x round_timeout) must not let a sync
    round close with the first node back: the others' deltas would all be refused ``late``.
    The nodes of the last round are expected back; an async round goes on with the live ones."""
    clock = FakeClock()
    store = shared(tmp_path)
    rules = {"rounds": "sync", "round_timeout": 60.0}
    loop = master(store, tmp_path, rules=rules, clock=clock)
    assert loop.policy.recent_s == 120.0
    for node in ("m", "w1", "w2"):
        upload(store, tmp_path, node, 5, base=0)
    first = loop.tick()
    assert first is not None and set(first.nodes) == {"m", "w1", "w2"}
    clock.now += 300.0  # a five-minute inner loop
    upload(store, tmp_path, "m", 10, base=1)
    assert loop.tick() is None  # w1 and w2 are training: waited for
    assert loop.policy.needed() == 3
    upload(store, tmp_path, "w1", 10, base=1)
    upload(store, tmp_path, "w2", 10, base=1)
    second = loop.tick()
    assert second is not None and second.reason == "quorum"
    assert set(second.nodes) == {"m", "w1", "w2"} and not second.rejected
    clock.now += 300.0
    upload(store, tmp_path, "m", 15, base=2)
    upload(store, tmp_path, "w1", 15, base=2)
    assert loop.tick() is None  # w2 died: one round_timeout, then the round goes on without it
    clock.now += 61.0
    third = loop.tick()
    assert third is not None and third.reason == "timeout" and set(third.nodes) == {"m", "w1"}
    clock.now += 300.0
    upload(store, tmp_path, "m", 20, base=3)
    upload(store, tmp_path, "w1", 20, base=3)
    fourth = loop.tick()
    assert fourth is not None and fourth.reason == "quorum"  # w2 no longer waited for
    asynchronous = RoundPolicy.of(AggregationRules(round_timeout=60.0), clock)
    for node in ("m", "w1"):
        asynchronous.saw(node)
    asynchronous.round_done(["m", "w1"])
    clock.now += 300.0
    asynchronous.saw("m")
    assert asynchronous.needed() == 1  # async: the live nodes only, as before


def test_a_node_refused_late_is_expected_in_the_next_sync_round_however_long_it_trains(
    tmp_path: Path,
) -> None:
    """w2 joins after the first round closed, and the second round times out without its
    fresh delta, refusing its first one ``late``. w2 installs that round's global like the
    others, so five minutes later (past the liveness window) the third round waits for it too
    instead of closing without it (and refusing it ``late`` again)."""
    clock = FakeClock()
    store = shared(tmp_path)
    loop = master(store, tmp_path, rules={"rounds": "sync", "round_timeout": 60.0}, clock=clock)
    upload(store, tmp_path, "m", 5, base=0)
    upload(store, tmp_path, "w1", 5, base=0)
    first = loop.tick()
    assert first is not None and set(first.nodes) == {"m", "w1"}
    clock.now += 30.0
    upload(store, tmp_path, "w2", 5, base=0)  # joined late: computed from global 0
    assert loop.tick() is None  # nothing of the open round yet
    clock.now += 270.0
    upload(store, tmp_path, "m", 10, base=1)
    upload(store, tmp_path, "w1", 10, base=1)
    assert loop.tick() is None  # w2 (its delta pending) is live: waited for
    clock.now += 61.0
    second = loop.tick()
    assert second is not None and second.reason == "timeout"
    assert set(second.nodes) == {"m", "w1"} and second.reasons == ("late",)
    clock.now += 300.0  # everyone's next inner loop
    upload(store, tmp_path, "m", 15, base=2)
    upload(store, tmp_path, "w1", 15, base=2)
    assert loop.tick() is None  # w2 installed global 2 too: waited for
    upload(store, tmp_path, "w2", 10, base=2)
    third = loop.tick()
    assert third is not None and third.reason == "quorum"
    assert set(third.nodes) == {"m", "w1", "w2"} and not third.rejected


def test_a_node_whose_final_delta_went_in_is_not_expected_back(tmp_path: Path) -> None:
    """w2 ended (its final delta went into the round) but its left record never arrived: the
    next sync round does not wait a round_timeout for it."""
    clock = FakeClock()
    store = shared(tmp_path)
    loop = master(store, tmp_path, rules={"rounds": "sync", "round_timeout": 60.0}, clock=clock)
    upload(store, tmp_path, "m", 5, base=0)
    upload(store, tmp_path, "w1", 5, base=0)
    upload(store, tmp_path, "w2", 5, base=0, final=True)
    first = loop.tick()
    assert first is not None and set(first.nodes) == {"m", "w1", "w2"}
    clock.now += 300.0
    upload(store, tmp_path, "m", 10, base=1)
    upload(store, tmp_path, "w1", 10, base=1)
    second = loop.tick()
    assert second is not None and second.reason == "quorum"


def test_a_successors_first_sync_round_expects_the_runs_known_nodes() -> None:
    """A successor has seen nobody yet: told the run's nodes, its first sync round waits for
    all of them but the master it replaced (presumed gone), not for the first one back."""
    clock = FakeClock()
    successor = RoundPolicy.of(AggregationRules(rounds="sync", round_timeout=60.0), clock)
    successor.known({"m", "w1", "w2"})
    successor.left({"m"})  # the dead master (failover.succeed presumes it gone)
    successor.saw("w1")
    assert successor.needed() == 2 and not successor.decide(["w1"]).go
    successor.saw("w2")
    assert successor.decide(["w1", "w2"]).go


def test_the_master_ignores_a_hostile_left_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = shared(tmp_path)
    loop = master(store, tmp_path, rules={"min_deltas": 2, "round_timeout": 3600.0})
    upload(store, tmp_path, "m", 5)
    upload(store, tmp_path, "w", 5)
    assert loop.tick() is not None
    (store.root / left_path("w")).write_bytes(record_bytes(node_id="w", last_step="x"))
    upload(store, tmp_path, "m", 10, base=1)
    with caplog.at_level("WARNING", logger="speedtronic.diloco.members"):
        assert loop.tick() is None  # not a record: w is still waited for
        assert loop.tick() is None
    warnings = [r for r in caplog.records if "left.json" in r.getMessage()]
    assert len(warnings) == 1 and "last_step" in warnings[0].getMessage()  # logged once


# --------------------------------------------------------------------------- bounded store


def test_the_store_keeps_one_processed_delta_per_node_and_round(tmp_path: Path) -> None:
    store = shared(tmp_path)
    loop = master(store, tmp_path, keep_outer_steps=2, rules={"min_deltas": 1})
    for step in (5, 10, 15):  # three deltas of a node before the round: summed by it
        upload(store, tmp_path, "a", step)
    upload(store, tmp_path, "b", 5)
    result = loop.tick()
    assert result is not None and len(result.included) == 4
    assert sorted(i.key for i in store.list_deltas()) == [("a", 15), ("b", 5)]
    ledger = loop.keeper.state.processed
    assert all(ledger.verdict(i).name != "NEW" for i in store.list_deltas())
    for round_ in range(4):
        for step in (20 + 10 * round_, 25 + 10 * round_):
            upload(store, tmp_path, "a", step, base=loop.outer_step)
        assert loop.tick() is not None
        per_node: dict[str, int] = {}
        for info in store.list_deltas():
            per_node[info.node_id] = per_node.get(info.node_id, 0) + 1
        assert per_node["a"] <= 2  # keep_outer_steps rounds of one delta each
    # The same bytes again (a folded file, deleted above, copied back): never counted twice.
    store.upload_delta("a", 10, tmp_path / "outbox" / "a_10.safetensors")
    assert loop.tick() is None


# --------------------------------------------------------------------------- status


def test_status_lists_the_nodes_that_left_apart(tmp_path: Path) -> None:
    store = shared(tmp_path)
    loop = master(store, tmp_path)
    upload(store, tmp_path, "m", 5)
    upload(store, tmp_path, "w", 5)
    assert loop.tick() is not None
    announce_left(store, "w", 5, "max_steps", retry=NO_WAIT)
    (store.root / "nodes" / "x").mkdir()
    (store.root / left_path("x")).write_bytes(b"nonsense")
    status = collect_status(store)
    assert [row["node_id"] for row in status.nodes] == ["m"]
    assert [(r["node_id"], r["last_step"], r["reason"]) for r in status.left] == [
        ("w", 5, "max_steps")
    ]
    assert status.left[0]["accepted"] == 1  # its row, kept
    assert any("nodes/x/left.json" in problem for problem in status.problems)
    assert status.to_json()["left"] == status.left


def test_a_master_on_the_hub_goes_on_once_a_node_left(hub: HubEmulator, tmp_path: Path) -> None:
    store = transport(hub)
    store.create_store()
    loop = master(store, tmp_path, rules={"min_deltas": 2, "round_timeout": 3600.0})
    upload(store, tmp_path, "m", 5)
    upload(store, tmp_path, "w", 5)
    assert loop.tick() is not None
    upload(store, tmp_path, "m", 10, base=1)
    assert loop.tick() is None  # w is live: waited for
    announce_left(store, "w", 5, "error", retry=NO_WAIT)
    result = loop.tick()
    assert result is not None and result.included == (("m", 10),)
    assert [r["node_id"] for r in collect_status(store).left] == ["w"]


# --------------------------------------------------------------------------- through the trainer


def test_a_run_leaves_with_its_last_step_and_why(tmp_path: Path) -> None:
    from diloco_runs import tiny_run

    from speedtronic.runtime import build_runtime

    store = SharedDirectoryTransport(tmp_path / "store")
    build_runtime(tiny_run(tmp_path), console=False).trainer.fit()  # the master, 12 steps
    record = store.members.read_left().records["m"]
    assert (record.last_step, record.reason) == (12, "max_steps")

    stopper: list[Any] = []

    def stop_at_6(event: str, payload: dict[str, Any]) -> None:
        if event == "step" and payload.get("step", 0) >= 6 and stopper:
            stopper[0].request_stop()

    worker = tiny_run(
        tmp_path / "w",
        distributed={
            "role": "worker",
            "node_id": "w",
            "repo_id": f"file://{tmp_path}/store",
            "finished_run": "train_alone",  # the master ended first: this worker trains alone
        },
        logging={"log_every": 1},
    )
    runtime = build_runtime(worker, console=False, hooks=[stop_at_6])
    stopper.append(runtime.trainer)
    result = runtime.trainer.fit()
    assert result.stopped
    record = store.members.read_left().records["w"]
    assert record.reason == "stopped" and record.last_step == result.steps < 12
    # Resumed, the node deletes its record before it trains: it is live again.
    seen: list[bool] = []

    def look(event: str, payload: dict[str, Any]) -> None:
        if event == "step" and not seen:
            seen.append("w" in store.members.read_left().records)

    resumed = {**worker, "checkpoint": {**worker.get("checkpoint", {}), "resume": True}}
    build_runtime(resumed, console=False, hooks=[look]).trainer.fit()
    assert seen == [False]
    record = store.members.read_left().records["w"]
    assert (record.last_step, record.reason) == (12, "max_steps")
