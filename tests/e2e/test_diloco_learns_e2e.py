"""Issues 29 and 40's end-to-end check: three real `speedtronic train` nodes (a master and two
workers on a shared directory, configs/diloco.yaml as shipped: `rounds: sync`, `outer_warmup`),
the workers started once the master's first global exists, trained on real English text, end
with a global whose held-out loss is below that of one node alone with the same batch and
steps. The text is Pride and Prejudice as committed in `benchmarks/data/` (it never changes);
the run is `benchmarks/diloco_quality.py` at a small size, references included. Sync rounds are
deterministic (every round holds the same three deltas whatever the machine's speed), so the
margin does not depend on load; it does depend on the CPU's floating-point kernels: without the
outer warm-up this size ended 2.326 against one node's 2.320 on one machine and 2.158 against
2.322 on another (docs/diloco.md, "The outer warm-up"). (Async rounds have no such test: see
docs/diloco.md, "An async e2e test: not robust at test size".)"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "diloco_quality.py"
CORPUS = REPO / "benchmarks" / "data" / "pride_and_prejudice.txt"


def quality_run(tmp_path: Path, *options: str) -> tuple[dict[str, Any], str]:
    """The quality benchmark's summary and output for 3 nodes with ``options``."""
    summary = tmp_path / "summary.json"
    command = [
        *(sys.executable, str(SCRIPT), "--nodes", "3", "--eval-batches", "4"),
        *("--workdir", str(tmp_path / "work"), *options),
        *("--corpus", str(CORPUS), "--json", str(summary)),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(summary.read_text())
    return {**result["summary"], "rows": result["outer"]}, done.stdout


def test_three_nodes_started_as_a_user_starts_them_end_below_one_node_alone(
    tmp_path: Path,
) -> None:
    """configs/diloco.yaml as shipped (sync rounds, min_deltas 3, the outer warm-up), the master
    first and the workers once its first global exists (issue 40's user start). The
    round_timeout override only keeps a loaded machine from closing a round early: every
    round must hold all three nodes."""
    totals, output = quality_run(
        tmp_path,
        *("--inner-steps", "25", "--steps", "200", "--stagger-after-outer", "0"),
        *("--set", "distributed.poll_interval=0.2", "--set", "distributed.round_timeout=120"),
    )
    assert math.isfinite(totals["final_global"]), totals
    # Every round averaged all three nodes, each from the global of the round before. The
    # final round may miss a worker whose last delta came after the master's end-of-run wait
    # (twice in CI under two CPU hogs: one short final round); its global still counts below.
    rounds = [(r["outer_step"], r["nodes"], r["reason"]) for r in totals["rows"]]
    assert all(nodes == 3 for _, nodes, reason in rounds if reason != "final"), rounds
    assert totals["staleness_max"] == 0, totals
    assert totals["final_global"] < totals["one_node"], output
