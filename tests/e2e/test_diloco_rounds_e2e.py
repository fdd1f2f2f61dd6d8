"""Rounds that really average, with real processes (issue 23): ``speedtronic train`` as a master
and two workers through a shared directory.

* With ``min_deltas: 2``, every outer step after the first includes deltas of at least two
  nodes computed from the same global; globals are installed (and the optimizer reset) only at
  inner-loop boundaries; the last delta of every node is aggregated before the master exits,
  which names the final global.
* With ``min_deltas: 3`` and one worker killed, the master goes on after ``round_timeout``
  with the others.

Every wait is a bounded poll on a condition; nothing asserts a duration.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_diloco_multiprocess import MODEL, WAIT, Node, wait_until

pytestmark = pytest.mark.slow

INNER = 5
HERE = Path(__file__).parent


def with_plugin(node: Node, **env: str) -> Node:
    """``node`` with the test-only plugin (``diloco_e2e_plugin``) and its settings."""
    node.extra_args = ["--plugin", "diloco_e2e_plugin"]
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")]))
    node.extra_env = {**node.extra_env, "PYTHONPATH": path, **env}
    return node


def start_together(nodes: list[Node], barrier: Path) -> None:
    """Start the processes, wait (bounded) until each is at train start, then let them all
    train at once (``DILOCO_E2E_BARRIER`` of the test plugin)."""
    barrier.mkdir(parents=True, exist_ok=True)
    for node in nodes:
        with_plugin(node, DILOCO_E2E_BARRIER=str(barrier))
        node.start()
    wait_until(
        lambda: all((barrier / f"{n.node_id}.ready").exists() for n in nodes),
        nodes,
        "every node at train start",
    )
    (barrier / "go").write_text("go")


def config(tmp_path: Path, max_steps: int, **distributed: Any) -> Path:
    data = {
        "run": {"name": "rounds-e2e", "seed": 0, "device": "cpu", "max_steps": max_steps},
        "model": {"name": "reference_transformer", **MODEL},
        "data": {"micro_batch_size": 8},
        "optimizer": {"lr": 3.0e-3, "weight_decay": 0.0},
        "scheduler": {"name": "constant"},
        "precision": {"mode": "fp32"},
        "checkpoint": {"interval": 1000},
        "logging": {"log_every": 10, "progress": False},
        "distributed": {
            "enabled": True,
            "repo_id": f"file://{tmp_path / 'shared'}",
            "inner_steps": INNER,
            "poll_interval": 0.2,
            "outer_lr": 0.7,
            "outer_momentum": 0.5,
            "retry_backoff": 0.1,
            **distributed,
        },
    }
    path = tmp_path / "rounds.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def included(event: dict[str, Any]) -> list[tuple[str, int]]:
    return [(n, int(s)) for n, s in (item.split("@") for item in event["included"].split(","))]


def kill_all(nodes: list[Node]) -> None:
    for node in nodes:
        if node.alive():
            node.process.kill()
            node.process.wait(30)


def test_rounds_average_nodes_at_one_base_and_lose_no_last_delta(tmp_path: Path) -> None:
    steps = 60
    path = config(tmp_path, steps, min_deltas=2, round_timeout=WAIT / 4)
    master = Node(tmp_path, path, "master", "master")
    workers = [Node(tmp_path, path, "worker", f"w{i}") for i in (1, 2)]
    nodes = [with_plugin(node, DILOCO_E2E_STEP_SLEEP="0.05") for node in [master, *workers]]
    try:
        start_together(nodes, tmp_path / "barrier")
        for node in nodes:
            assert node.wait(WAIT) == 0, node.tail()
    finally:
        kill_all(nodes)

    rounds = master.events("outer_step")
    assert len(rounds) >= 2, master.tail()
    for event in rounds[1:]:  # the first may start before every node is up
        if event["reason"] == "final":  # the master's last round takes whatever is left
            continue
        bases: dict[str, set[str]] = {}
        for (node, _), base in zip(included(event), event["base_outer_steps"].split(",")):
            bases.setdefault(base, set()).add(node)
        assert max(len(v) for v in bases.values()) >= 2, event
    # The last delta of every node is in some outer step, and the master names the result.
    aggregated = {key for event in rounds for key in included(event)}
    assert {("master", steps), ("w1", steps), ("w2", steps)} <= aggregated
    final = master.events("final_global")
    assert final and final[0]["outer_step"] == rounds[-1]["outer_step"]
    assert f"final global: outer step {rounds[-1]['outer_step']}, path file://" in master.tail()
    # Globals were installed, and the optimizer reset, only at inner-loop boundaries.
    for node in nodes:
        loads = node.events("global_loaded")
        assert loads and all(event["step"] % INNER == 0 for event in loads), loads
        (end,) = node.events("train_end")
        assert 0 < end["weights_replaced"] <= steps // INNER, end


def test_master_goes_on_after_round_timeout_without_a_stopped_worker(tmp_path: Path) -> None:
    path = config(tmp_path, 1_000_000, min_deltas=3, round_timeout=3.0)
    master = Node(tmp_path, path, "master", "master")
    workers = [Node(tmp_path, path, "worker", f"w{i}") for i in (1, 2)]
    nodes = [master, *workers]
    try:
        for node in nodes:
            node.start()

        def full_rounds() -> list[dict[str, Any]]:
            return [e for e in master.events("outer_step") if e["nodes_included"] == 3]

        wait_until(full_rounds, nodes, "an outer step averaging all three nodes")
        workers[1].signal(signal.SIGKILL)
        workers[1].wait()

        def timed_out() -> list[dict[str, Any]]:
            return [
                e
                for e in master.events("outer_step")
                if e["reason"] == "timeout" and set(e["nodes"].split(",")) == {"master", "w1"}
            ]

        late = wait_until(timed_out, nodes[:2], "an outer step after round_timeout without w2")
        assert late[0]["waited_s"] >= 3.0
        for node in nodes[:2]:
            node.signal(signal.SIGINT)
        for node in nodes[:2]:
            node.wait()
    finally:
        kill_all(nodes)
