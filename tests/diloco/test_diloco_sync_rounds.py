"""``distributed.rounds: sync`` (issue 29): real coordinators (a master and two workers, each in
a thread of its own) over a real shared directory. Every live node is in every round and
installs that round's global before its next inner loop; a node that stops delivering is
dropped after ``round_timeout`` (the others go on), and when it comes back it installs the
newest global at once, its late delta is refused (``late``) and its next delta is in the next
round."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_fakes import SETTLE, dist_config, make_net, nudge, wait_for
from hub_emulator import HubEmulator
from hub_fixtures import hub_fixture, transport  # noqa: F401

from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic_diloco.node.rounds import wait_look_interval
from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport

H = 2  # inner steps per round


class Node:
    """One coordinator and its model, trained by :meth:`run` in a thread."""

    def __init__(self, tmp_path: Path, node_id: str, role: str, **config: Any) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.model = make_net()
        self.coordinator = DumbDiLoCoCoordinator(
            dist_config(
                **{
                    "role": role,
                    "node_id": node_id,
                    "repo_id": str(tmp_path / "store"),
                    "inner_steps": H,
                    "rounds": "sync",
                    "poll_interval": 0.05,
                    "async_delta_upload": True,
                    "async_global_poll": True,
                    **config,
                }
            ),
            self.model,
            state_dir=tmp_path / "state",
            logger=lambda e, p: self.events.append((e, dict(p))),
        )
        #: ``(step, installed outer step)`` after every boundary.
        self.installed: list[tuple[int, int]] = []
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def run(self, steps: int, pause: Callable[[int], None] | None = None) -> None:
        def train() -> None:
            try:
                for step in range(1, steps + 1):
                    if pause is not None:
                        pause(step)
                    nudge(self.model)
                    self.coordinator.after_optimizer_step(self.model, step)
                    if step % H == 0:
                        self.installed.append((step, self.coordinator.last_global_step))
            except BaseException as exc:  # the test reports it
                self.error = exc

        self.thread = threading.Thread(target=train, daemon=True)
        self.thread.start()

    def join(self) -> None:
        assert self.thread is not None
        self.thread.join(SETTLE)
        assert not self.thread.is_alive(), "a node never finished its steps"
        assert self.error is None, self.error


def rounds(master: Node) -> list[dict[str, Any]]:
    return [p for e, p in master.events if e == "outer_step"]


def start(nodes: list[Node]) -> None:
    nodes[0].coordinator.start()  # publishes the first global
    for node in nodes[1:]:
        node.coordinator.start()


def stop(nodes: list[Node]) -> None:
    for node in nodes:
        node.coordinator.stop()


def test_every_live_node_is_in_every_sync_round(tmp_path: Path) -> None:
    nodes = [
        Node(tmp_path, "m", "master", min_deltas=3, round_timeout=SETTLE),
        Node(tmp_path, "w1", "worker", round_timeout=SETTLE),
        Node(tmp_path, "w2", "worker", round_timeout=SETTLE),
    ]
    start(nodes)
    try:
        for node in nodes:
            node.run(3 * H)
        for node in nodes:
            node.join()
    finally:
        stop(nodes)
    done = rounds(nodes[0])
    assert [r["outer_step"] for r in done] == [1, 2, 3]
    for r in done:
        assert sorted(r["nodes"].split(",")) == ["m", "w1", "w2"]
        assert r["staleness"] == "0,0,0" and r["mode"] == "sync" and r["reason"] == "quorum"
    # Each node trained its next inner loop from the global of the round it delivered to.
    for node in nodes:
        assert node.installed == [(2, 1), (4, 2), (6, 3)], node.coordinator.node_id
    # The global of round r is the mean of the nodes' round-r progress (lr 1, no momentum):
    # every node nudged every parameter by H x 0.01 per round.
    final = nodes[0].coordinator.outer.snapshot()
    assert final is not None
    start_weights = make_net().state_dict()
    for name, value in final[1].items():
        if value.is_floating_point():
            torch.testing.assert_close(value, start_weights[name] + 3 * H * 0.01)


def test_a_master_waiting_at_its_boundary_closes_the_round_whatever_poll_interval_is(
    tmp_path: Path,
) -> None:
    # An hour between the master's regular looks (and the workers' polls between boundaries):
    # the rounds still close, because a master waiting for its round wakes its outer thread
    # at every look of its wait (at most a second apart).
    hour = {"poll_interval": 3600.0, "round_timeout": SETTLE}
    nodes = [
        Node(tmp_path, "m", "master", min_deltas=3, **hour),
        Node(tmp_path, "w1", "worker", **hour),
        Node(tmp_path, "w2", "worker", **hour),
    ]
    start(nodes)
    try:
        for node in nodes:
            node.run(3 * H)
        for node in nodes:
            node.join()  # within SETTLE: three rounds that each waited for an hourly look fail
    finally:
        stop(nodes)
    assert [(r["outer_step"], r["reason"]) for r in rounds(nodes[0])] == [
        (1, "quorum"),
        (2, "quorum"),
        (3, "quorum"),
    ]
    for node in nodes:
        assert node.installed == [(2, 1), (4, 2), (6, 3)], node.coordinator.node_id
        assert not [p for e, p in node.events if e == "round_wait_timeout"]


def test_a_dead_node_is_dropped_after_round_timeout_and_rejoins(tmp_path: Path) -> None:
    timeout = 1.0  # seconds a round waits for a missing node; 2 x that it counts as live
    nodes = [
        Node(tmp_path, "m", "master", min_deltas=3, round_timeout=timeout),
        Node(tmp_path, "w1", "worker", round_timeout=timeout),
        Node(tmp_path, "w2", "worker", round_timeout=timeout),
    ]
    master = nodes[0]
    back = threading.Event()
    rejoined = threading.Event()

    def dead_after_first_round(step: int) -> None:
        if step == H + 1:  # w2 stops after round 1 ...
            wait_for(back.is_set, what="the test to wake w2")

    def until_w2_rejoined(step: int) -> None:
        if rejoined.is_set() and step % H == 1:
            raise StopIteration  # the survivors stop at a boundary once w2 is back

    def survivor(node: Node) -> None:
        def train() -> None:
            step = 0
            deadline = time.monotonic() + SETTLE
            try:
                while time.monotonic() < deadline:
                    step += 1
                    until_w2_rejoined(step)
                    nudge(node.model)
                    node.coordinator.after_optimizer_step(node.model, step)
            except StopIteration:
                return
            except BaseException as exc:
                node.error = exc

        node.thread = threading.Thread(target=train, daemon=True)
        node.thread.start()

    start(nodes)
    try:
        survivor(master)
        survivor(nodes[1])
        nodes[2].run(4 * H, pause=dead_after_first_round)

        # ... the others go on without it: rounds close on the timeout, then (once w2 is no
        # longer live) on the quorum of the two survivors.
        def published() -> int:
            last = master.coordinator.outer.last_published
            return -1 if last is None else last.outer_step

        wait_for(lambda: published() >= 5, what="rounds without w2 in the store")
        back.set()
        wait_for(
            lambda: any("w2" in r["nodes"].split(",") for r in rounds(master)[1:]),
            what="a round with w2 again",
        )
        rejoined.set()
        for node in nodes:
            node.join()
    finally:
        back.set()
        rejoined.set()
        stop(nodes)
    done = rounds(master)
    assert sorted(done[0]["nodes"].split(",")) == ["m", "w1", "w2"]
    without = [r for r in done[1:] if "w2" not in r["nodes"].split(",")]
    assert without and without[0]["reason"] == "timeout"  # round 2 waited, then closed
    assert all(sorted(r["nodes"].split(",")) == ["m", "w1"] for r in without[:4])
    assert all(set(r["staleness"].split(",")) == {"0"} for r in done), [
        (r["outer_step"], r["included"], r["staleness"], r["reason"]) for r in done
    ]
    late = [p for e, p in master.events if e == "delta_rejected" and p["reason"] == "late"]
    assert late and {p["node"] for p in late} == {"w2"}  # first: its delta of round 2
    assert late[0]["delta_step"] == 2 * H
    # Back, w2 installed the newest global at its next boundary, at once, and was in the
    # following round.
    w2 = nodes[2].installed
    assert w2[0] == (H, 1)
    assert w2[1][1] >= 5
    back_in = next(r for r in done[1:] if "w2" in r["nodes"].split(","))
    assert back_in["outer_step"] > w2[1][1]


@pytest.mark.parametrize("rounds_mode", ["sync", "async"])
def test_rounds_key_is_validated(rounds_mode: str) -> None:
    assert dist_config(rounds=rounds_mode).rounds == rounds_mode
    from speedtronic.errors import ConfigError

    with pytest.raises(ConfigError, match="rounds"):
        from speedtronic_diloco.config import distributed_config

        distributed_config({"distributed": {"rounds": "lockstep"}})
    if rounds_mode == "sync":
        with pytest.raises(ConfigError, match="rounds"):
            dist_config(rounds="sync", inner_steps=4, fragments=2)
    else:
        assert dist_config(rounds="async", inner_steps=4, fragments=2).fragments == 2


def test_a_waiting_node_looks_once_a_second_and_on_the_hub_every_two(
    tmp_path: Path, hub: HubEmulator
) -> None:
    """A wait's looks: ``poll_interval`` capped at 1 s, never a spin, and on the Hub (which
    rate-limits API calls) at least 2 s apart, since a waiting master's look lists the repo."""
    shared = SharedDirectoryTransport(tmp_path / "store")
    assert wait_look_interval(60.0, shared) == 1.0
    assert wait_look_interval(0.2, shared) == 0.2
    assert wait_look_interval(0.0, shared) == 0.05
    on_hub = transport(hub)
    assert wait_look_interval(60.0, on_hub) == 2.0
    assert wait_look_interval(0.0, on_hub) == 2.0
