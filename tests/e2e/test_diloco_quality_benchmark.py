"""benchmarks/diloco_quality.py at its smallest: real `speedtronic train` processes (a master, a
worker, the two references) on a small corpus, and a JSON summary with the global's held-out
loss per outer step beside the references'. The run uses the real-conditions flags: the corpus
as a directory of prepared shards, the worker started once the master's first global exists
(`--stagger-after-outer 0`), and the worker 2x slower (`--slow-node 2`, the slow_node plugin
in the worker's process); the summary then carries the time to one node's final loss and each
node's waits. No wall-clock figure is asserted, only that each is measured."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "diloco_quality.py"


def small_corpus(path: Path) -> Path:
    line = "It is a truth number {} universally acknowledged, that a walk\nin the rain"
    paragraphs = [line.format(i) for i in range(300)]
    path.write_text("\n\n".join(paragraphs) + "\n")
    return path


def test_the_smallest_quality_run_reports_the_global_beside_both_references(
    tmp_path: Path,
) -> None:
    summary = tmp_path / "summary.json"
    shards = tmp_path / "shards"
    prepare = [
        *(sys.executable, "-m", "speedtronic", "data", "prepare"),
        *(str(small_corpus(tmp_path / "corpus.txt")), "--out", str(shards)),
        *("--tokenizer", "bytes", "--blank-line-documents", "--eval-fraction", "0.1"),
        *("--workers", "1", "--no-progress"),
    ]
    prepared = subprocess.run(prepare, capture_output=True, text=True, timeout=300)
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    command = [
        *(sys.executable, str(SCRIPT), "--quick", "--nodes", "2", "--inner-steps", "5"),
        *("--steps", "10", "--eval-batches", "2", "--workdir", str(tmp_path / "work")),
        *("--corpus", str(shards), "--json", str(summary)),
        *("--stagger-after-outer", "0", "--slow-node", "2"),
        # Two nodes: a round need not wait round_timeout for the demo config's third.
        *("--set", "distributed.min_deltas=2"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(summary.read_text())
    totals = result["summary"]
    for key in ("final_global", "one_node", "n_x_batch", "gap_closed"):
        assert math.isfinite(totals[key]), (key, totals)
    assert set(totals["nodes_own"]) == {"master", "worker-1"}
    rows = result["outer"]
    assert rows and rows[-1]["node_step"] == 10  # the last round holds the last steps
    assert all(row["one_node"] is not None for row in rows if row["node_step"] >= 5)
    assert "gap closed" in done.stdout
    assert result["settings"]["corpus_name"] == "shards"
    # The worker started once the master's first global existed, so after some outer step.
    assert totals["starts"]["worker-1"]["global_outer_step"] is not None, totals["starts"]
    slow = totals["slow_node"]
    assert slow["node"] == "worker-1" and slow["factor"] == 2.0 and slow["steps"] == 10, slow
    assert slow["slept_s"] > 0 and slow["median_step_s"] > 0, slow
    assert "slow_node.py" in done.stdout
    # Time to one node's final loss: measured, or None when the global never got there.
    assert totals["one_node_wall_s"] > 0
    reached, ratio = totals["time_to_one_node_s"], totals["time_to_one_node_ratio"]
    assert (reached is None) == (ratio is None), totals
    assert reached is None or (reached >= 0 and math.isfinite(ratio)), totals
    steps = totals["steps_to_one_node"]  # the same global, counted in node steps
    assert (steps is None) == (reached is None), totals
    assert steps is None or totals["steps_to_one_node_ratio"] == steps / 10, totals
    assert set(totals["waits"]) == {"master", "worker-1"}
    assert 0.0 <= totals["timeout_wait_share"] <= 1.0, totals["waits"]
    assert "time to one node's final loss" in done.stdout
