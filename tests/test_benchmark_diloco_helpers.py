"""The pure helpers of ``benchmarks/diloco_quality.py``'s conditions and figures: time to a loss
and the share of waits that ended by timeout (``diloco_timing``), the workers' start delays
(``diloco_processes``), the slowed node's sleep (``slow_node``) and the matrix's cells and
``RESULT`` lines (``diloco_matrix``). The real processes are exercised by
``tests/e2e/test_diloco_quality_benchmark.py``."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

from speedtronic_diloco.config import DistributedConfig

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_module(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


timing = benchmark_module("diloco_timing")


def test_time_to_loss_is_the_first_point_at_or_below_the_target() -> None:
    points = [(105.0, 3.1), (110.0, 2.5), (108.0, 2.6), (120.0, 2.4)]  # not sorted by time
    assert timing.time_to_loss(points, 2.6, start=100.0) == pytest.approx(8.0)
    assert timing.time_to_loss(points, 2.5, start=100.0) == pytest.approx(10.0)
    assert timing.time_to_loss(points, 2.45, start=100.0) == pytest.approx(20.0)
    assert timing.time_to_loss(points, 2.0, start=100.0) is None  # never reached
    assert timing.time_to_loss([], 2.0, start=0.0) is None
    assert timing.time_to_loss([(99.0, 1.0)], 2.0, start=100.0) == 0.0  # never negative


def test_loss_points_read_the_masters_outer_eval_events_only() -> None:
    events = [
        {"event": "outer_step", "time": 1.0, "outer_step": 1},
        {"event": "outer_eval", "time": 2.0, "outer_step": 1, "loss": 3.0},
        {"event": "eval", "time": 3.0, "loss": 1.0},  # a node's own weights: not the global
        {"event": "outer_eval", "time": 4.0, "outer_step": 2, "loss": 2.5},
    ]
    assert timing.loss_points(events) == [(2.0, 3.0), (4.0, 2.5)]


def test_wait_totals_and_the_timeout_share_of_a_nodes_wall_time() -> None:
    master = [
        {"event": "outer_step", "outer_step": 1, "reason": "quorum"},
        {"event": "outer_step", "outer_step": 2, "reason": "timeout"},
        {"event": "outer_step", "outer_step": 3, "reason": "final"},
    ]
    closed = timing.timeout_rounds(master)
    assert closed == {2}
    events = [
        {"event": "round_waited", "outer_step": 1, "waited_s": 2.0},
        {"event": "round_waited", "outer_step": 2, "waited_s": 30.0},  # the master's timeout
        {"event": "round_wait_timeout", "base_outer_step": 2, "waited_s": 60.0},  # its own
        {"event": "round_waited", "outer_step": 3, "waited_s": 1.0},
        {"event": "round_wait_timeout", "base_outer_step": 3, "waited_s": 10.0},
        {"event": "step", "loss": 3.0},
    ]
    assert timing.wait_totals(events, closed) == {
        "waits": 3,
        "waited_s": 33.0,
        "round_timeouts": 1,
        "round_timeout_s": 30.0,
        "timeouts": 2,
        "timeout_s": 70.0,
    }
    assert timing.timeout_share(events, 400.0, closed) == pytest.approx(0.25)
    assert timing.timeout_share(events, 400.0) == pytest.approx(70.0 / 400.0)  # its own only
    assert timing.timeout_share([{"event": "step"}], 10.0) == 0.0  # async: nodes never wait
    assert timing.timeout_share(events, None) is None and timing.timeout_share(events, 0) is None


def test_start_delays_of_each_condition() -> None:
    delays = benchmark_module("diloco_processes").start_delays
    assert delays(3, None, None) == [1.0, 0.0]  # together: 1 s after the master
    assert delays(3, 10.0, None) == [10.0, 10.0]  # each worker 10 s after the previous node
    assert delays(3, None, 0) == [0.0, 0.0]  # all at once when the first global exists
    assert delays(4, 5.0, 2) == [0.0, 5.0, 5.0]  # after outer step 2, then 5 s apart
    assert delays(2, 3.0, None) == [3.0]


def test_the_slow_node_sleeps_factor_minus_one_times_its_median_step() -> None:
    slow = benchmark_module("slow_node").SlowDown(2.0, window=5)
    assert slow.pause_s(0.0) == 0.0  # the first step: no interval yet
    slow.last = 0.0
    assert slow.pause_s(0.1) == pytest.approx(0.1)
    for now, last in ((0.3, 0.2), (0.4, 0.3), (5.4, 0.4)):  # 0.1, 0.1, then a 5 s boundary
        slow.last = last
        pause = slow.pause_s(now)
    assert pause == pytest.approx(0.1)  # the median leaves the long boundary out
    three = benchmark_module("slow_node").SlowDown(3.0)
    three.pause_s(0.0)
    three.last = 0.0
    assert three.pause_s(0.02) == pytest.approx(0.04)
    assert benchmark_module("slow_node").SlowDown(1.0).pause_s(1.0) == 0.0


def test_matrix_cells_and_their_result_lines(capsys: pytest.CaptureFixture[str]) -> None:
    matrix = benchmark_module("diloco_matrix")
    args = argparse.Namespace(matrix_stagger=10.0, corpus=[], rounds=None, stagger=None)
    cell = matrix.cell_args(args, Path("c.txt"), "staggered", "sync", Path("w"))
    assert (cell.stagger, cell.slow_node, cell.rounds, cell.corpus) == (
        10.0,
        None,
        "sync",
        [Path("c.txt")],
    )
    slow = matrix.cell_args(args, Path("c.txt"), "slow_node", "async", Path("w"))
    assert (slow.stagger, slow.slow_node, slow.matrix) == (None, 2.0, False)
    summary = {"final_global": 2.0, "one_node": 2.2, "gap_closed": None, "diloco_wall_s": 30.0}
    matrix.emit_cell("kjv", "together", "async", True, summary, "how")
    records = [json.loads(line[len("RESULT ") :]) for line in capsys.readouterr().out.splitlines()]
    ids = {r["id"]: r for r in records}
    assert ids["diloco_quality.kjv.together.async.final_global"]["median"] == 2.0
    assert ids["diloco_quality.kjv.together.async.wall_s"]["unit"] == "s"
    # Never reaching one node's loss is a figure (inf); an absent gap closed is no row.
    assert math.isinf(ids["diloco_quality.kjv.together.async.time_to_one_node_ratio"]["median"])
    assert "diloco_quality.kjv.together.async.gap_closed" not in ids
    assert "(config default)" in ids["diloco_quality.kjv.together.async.final_global"]["label"]


def test_steps_to_one_node_is_the_first_global_at_or_below_its_loss() -> None:
    steps_to_loss = benchmark_module("diloco_timing").steps_to_loss
    rows = [
        {"node_step": 25, "global_loss": 3.0},
        {"node_step": 50, "global_loss": 1.9},
        {"node_step": 75, "global_loss": 2.1},  # back above: the first one counts
        {"node_step": 100, "global_loss": 1.5},
    ]
    assert steps_to_loss(rows, 2.0, 200) == {
        "steps_to_one_node": 50,
        "steps_to_one_node_ratio": 0.25,
    }
    assert steps_to_loss(rows, 1.0, 200)["steps_to_one_node"] is None
    assert steps_to_loss(rows, None, 200)["steps_to_one_node_ratio"] is None


def test_round_modes_read_the_config(tmp_path: Path) -> None:
    modes = benchmark_module("diloco_matrix").round_modes
    (tmp_path / "sync.yaml").write_text("distributed:\n  rounds: sync\n")
    (tmp_path / "unset.yaml").write_text("distributed:\n  inner_steps: 5\n")
    assert modes(tmp_path / "sync.yaml") == ("sync", "async")
    default = DistributedConfig().rounds  # unset: this version's default, then the other
    assert modes(tmp_path / "unset.yaml") == (default, {"async": "sync", "sync": "async"}[default])
