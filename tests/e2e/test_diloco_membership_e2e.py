"""Membership the master can see, with real processes on a shared directory (issue 30, item 4).

* The measured failure of issue 30: a master (250 steps) and a worker (120 steps) with
  ``min_deltas: 2``. Before, once the worker had finished, the master's own deltas piled up
  (13 of them) and the global stood still until the final round summed them, and 15 delta files
  stayed in the store with ``keep_outer_steps: 2``. Now the worker's ``left`` record lets the
  master's rounds go on with the node that is alive, one round per boundary or so, and the
  store ends with at most ``keep_outer_steps`` processed files per node.
* A worker stopped by a signal says so (``stopped``); resumed, it deletes its record and the
  master waits for it again (rounds of both nodes).

Every wait is a bounded poll on a condition; nothing asserts a duration.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
from diloco_nodes import (
    WAIT,
    Node,
    included,
    kill_all,
    speedtronic,
    start_together,
    stop_all,
    wait_until,
    with_plugin,
    write_config,
)

pytestmark = pytest.mark.slow

SLOW_STEP = "0.03"  # seconds per step: a few polls of the master per inner loop of 5 steps


def left_record(shared: Path, node: str) -> dict[str, Any] | None:
    try:
        return json.loads((shared / "nodes" / node / "left.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def test_the_master_goes_on_with_the_live_nodes_after_a_worker_finished(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    path = write_config(
        tmp_path,
        run={"max_steps": 250},
        distributed={"min_deltas": 2, "round_timeout": WAIT, "keep_outer_steps": 2},
    )
    master = with_plugin(Node(tmp_path, path, "master", "master"), DILOCO_E2E_STEP_SLEEP=SLOW_STEP)
    worker = with_plugin(Node(tmp_path, path, "worker", "w1"), DILOCO_E2E_STEP_SLEEP=SLOW_STEP)
    worker.extra_args += ["--set", "run.max_steps=120"]
    try:
        start_together([master, worker], tmp_path / "barrier")
        assert worker.wait() == 0, worker.tail()
        record = left_record(shared, "w1")
        assert record is not None and record["last_step"] == 120, record
        assert record["reason"] == "max_steps"
        assert master.wait() == 0, master.tail()
    finally:
        kill_all([master, worker])

    rounds = master.events("outer_step")
    worker_steps = {s for e in rounds for n, s in included(e) if n == "w1"}
    assert 120 in worker_steps  # the worker's last delta went in
    after = [e for e in rounds if all(n == "master" for n, _ in included(e))]
    after = [e for e in after if min(s for _, s in included(e)) > 120]
    # The master's last 130 steps are 26 boundaries: before, they made ONE round (13 deltas
    # summed at the end); now they make rounds of their own as they come.
    assert len(after) >= 8, [e["included"] for e in rounds]
    assert max(len(included(e)) for e in after) <= 6, [e["included"] for e in after]
    assert ("master", 250) in {key for e in rounds for key in included(e)}
    # Bounded store: at most keep_outer_steps rounds of one processed delta per node.
    files = sorted(p.relative_to(shared).as_posix() for p in shared.glob("nodes/*/delta_*"))
    assert len([f for f in files if f.startswith("nodes/master/")]) <= 2, files
    assert len([f for f in files if f.startswith("nodes/w1/")]) <= 2, files
    # status lists both nodes as left (the master too, once it ended), with their last step.
    shown = json.loads(speedtronic("diloco", "status", "-c", str(path), "--json").stdout)
    assert {row["node_id"]: row["last_step"] for row in shown["left"]} == {
        "master": 250,
        "w1": 120,
    }, shown
    assert shown["nodes"] == []
    table = speedtronic("diloco", "status", "-c", str(path)).stdout
    assert "w1 after step 120 (max_steps" in table, table


def test_a_stopped_worker_leaves_and_is_live_again_when_resumed(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    path = write_config(
        tmp_path, distributed={"min_deltas": 2, "round_timeout": WAIT, "keep_outer_steps": 2}
    )
    master = with_plugin(Node(tmp_path, path, "master", "master"), DILOCO_E2E_STEP_SLEEP=SLOW_STEP)
    worker = with_plugin(Node(tmp_path, path, "worker", "w1"), DILOCO_E2E_STEP_SLEEP=SLOW_STEP)
    nodes = [master, worker]

    def both_rounds(since: int) -> list[dict[str, Any]]:
        return [
            e
            for e in master.events("outer_step")
            if e["outer_step"] > since and {n for n, _ in included(e)} == {"master", "w1"}
        ]

    try:
        start_together(nodes, tmp_path / "barrier")
        wait_until(lambda: both_rounds(0), nodes, "a round of both nodes")
        worker.signal(signal.SIGINT)
        assert worker.wait() == 128 + signal.SIGINT, worker.tail()  # stopped, checkpointed
        record = left_record(shared, "w1")
        assert record is not None and record["reason"] == "stopped", record
        stopped_at = record["last_step"]

        def master_alone() -> list[dict[str, Any]]:
            return [
                e
                for e in master.events("outer_step")
                if all(n == "master" for n, _ in included(e))
                and min(s for _, s in included(e)) > stopped_at + 10
            ]

        wait_until(lambda: len(master_alone()) >= 3, [master], "rounds of the master alone")
        worker.start(resume=True)
        wait_until(lambda: left_record(shared, "w1") is None, nodes, "the record deleted")
        since = master.events("outer_step")[-1]["outer_step"]
        wait_until(lambda: both_rounds(since), nodes, "a round of both nodes again")
        stop_all(nodes)
    finally:
        kill_all(nodes)
