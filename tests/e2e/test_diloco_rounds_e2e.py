"""Rounds that really average, with real processes (issue 23): ``speedtronic train`` as a master
and two workers through a shared directory.

* With ``min_deltas: 2``, every outer step after the first includes deltas of at least two
  nodes computed from the same global; globals are installed (and the optimizer reset) only at
  inner-loop boundaries; the last delta of every node is aggregated before the master exits,
  which names the final global. The run has an ``eval`` section, so the master scores every
  global it publishes (issue 14): an ``outer_eval`` event per outer step, whose loss falls, and
  the last one's loss in the store's metadata and in ``speedtronic diloco status --json``.
* With ``min_deltas: 3`` and one worker killed, the master goes on after ``round_timeout``
  with the others.

Every wait is a bounded poll on a condition; nothing asserts a duration.
"""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path
from typing import Any

import pytest
from diloco_nodes import (
    WAIT,
    included,
    kill_all,
    master_and_workers,
    run_together,
    speedtronic,
    stop_all,
    store_metadata,
    wait_until,
    with_plugin,
    write_config,
)

pytestmark = pytest.mark.slow

INNER = 5
# How far the held-out loss of the last global scored must be below the first one's (issue 14).
# Measured: 3.80 at outer step 1 -> 1.70 at the last (11), 60 steps a node, 2 eval batches;
# scoring the same (or the initial) weights every time shows no fall at all.
EVAL_FALL = 1.0


def config(tmp_path: Path, max_steps: int, **sections: Any) -> Path:
    return write_config(
        tmp_path, "rounds.yaml", run={"name": "rounds-e2e", "max_steps": max_steps}, **sections
    )


def test_rounds_average_nodes_at_one_base_and_lose_no_last_delta(tmp_path: Path) -> None:
    steps = 60
    path = config(
        tmp_path,
        steps,
        eval={"at_end": True, "batches": 2},  # the master scores every global (issue 14)
        distributed={"min_deltas": 2, "round_timeout": WAIT / 4},
    )
    nodes = [
        with_plugin(n, DILOCO_E2E_STEP_SLEEP="0.05") for n in master_and_workers(tmp_path, path)
    ]
    master = nodes[0]
    run_together(nodes, tmp_path / "barrier")

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

    # Issue 14: every published global was scored, and the score fell over the outer steps.
    evals = master.events("outer_eval")
    assert [e["outer_step"] for e in evals] == [r["outer_step"] for r in rounds], evals
    first, last = evals[0], evals[-1]
    assert last["loss"] < first["loss"] - EVAL_FALL, (first, last)
    assert all(e["ppl"] == pytest.approx(math.exp(e["loss"])) for e in evals), evals
    meta = store_metadata(tmp_path / "shared")
    assert meta is not None and meta["outer_step"] == last["outer_step"]
    assert meta["extra"]["eval_loss"] == last["loss"], meta
    shown = json.loads(speedtronic("diloco", "status", "-c", str(path), "--json").stdout)
    assert shown["outer_step"] == last["outer_step"] and shown["eval_loss"] == last["loss"], shown


def test_master_goes_on_after_round_timeout_without_a_stopped_worker(tmp_path: Path) -> None:
    # A dead node counts as live for 2 x round_timeout after its last delta (recent_s), so the
    # timed-out round must begin its wait within one round_timeout of w2's death; the master's
    # rounds under load (tens of backlogged deltas each) took seconds, which ate a 3 s margin.
    path = config(tmp_path, 1_000_000, distributed={"min_deltas": 3, "round_timeout": 10.0})
    master, *workers = nodes = master_and_workers(tmp_path, path)
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
        assert late[0]["waited_s"] >= 10.0
        stop_all(nodes[:2])
    finally:
        kill_all(nodes)
