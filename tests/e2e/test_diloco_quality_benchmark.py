"""benchmarks/diloco_quality.py at its smallest: real `speedtronic train` processes (a master, a
worker, the two references) on the shared corpus, and a JSON summary with the global's held-out
loss per outer step beside the references'."""

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
    command = [
        *(sys.executable, str(SCRIPT), "--quick", "--nodes", "2", "--inner-steps", "5"),
        *("--steps", "10", "--eval-batches", "2", "--workdir", str(tmp_path / "work")),
        *("--corpus", str(small_corpus(tmp_path / "corpus.txt")), "--json", str(summary)),
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
