"""Issue 29's end-to-end check: three real `speedtronic train` nodes (a master and two workers
on a shared directory, `rounds: sync`) trained on real English text end with a global whose
held-out loss is below that of one node alone with the same batch and steps. The text is
Pride and Prejudice as committed in `benchmarks/data/` (it never changes; an earlier version of
this test read the repository's docs, and every docs edit moved its result); the run is
`benchmarks/diloco_quality.py` at a small size, references included. The size is where the
claim holds by a margin: with H 25 the global leads one node from about step 75 on; with H 10,
or on a 200 KB excerpt of the novel, it trailed one node for hundreds of steps (docs/diloco.md,
"The e2e tests' size"). (Async rounds have no such test: at sizes a test can afford their
margin over one node did not hold in every run; see docs/diloco.md, "An async e2e test: not
robust at test size".)"""

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
    return json.loads(summary.read_text())["summary"], done.stdout


def test_three_nodes_on_real_text_end_below_one_node_alone(tmp_path: Path) -> None:
    totals, output = quality_run(
        tmp_path,
        *("--inner-steps", "25", "--steps", "200", "--rounds", "sync"),
        *("--set", "distributed.poll_interval=0.2", "--set", "distributed.min_deltas=3"),
        *("--set", "distributed.round_timeout=120"),
    )
    assert math.isfinite(totals["final_global"]), totals
    # Every round averaged all three nodes, each from the global of the round before.
    assert totals["short_rounds"] == 0 and totals["staleness_max"] == 0, totals
    assert totals["final_global"] < totals["one_node"], output
