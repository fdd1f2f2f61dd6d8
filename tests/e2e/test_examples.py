"""The files in examples/ work as their comments say."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from speedtronic import SpeedtronicConfig
from speedtronic.engine.runtime import train_from_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.slow


def test_train_reference_example_trains_both_models(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "train_reference.py"),
            *("--steps", "20", "--output-dir", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "reference: 20 steps" in done.stdout and "your model: 20 steps" in done.stdout
    for run in ("reference", "byo"):
        assert (tmp_path / run / "checkpoints" / "latest.json").is_file()


def test_diloco_master_example_runs_a_master(tmp_path: Path) -> None:
    config = SpeedtronicConfig.from_file(EXAMPLES / "diloco_master.yaml")
    assert config.distributed.role == "master" and config.distributed.node_id == "master"
    short = config.with_overrides(
        [
            "run.max_steps=6",
            f"run.output_dir={tmp_path / 'master'}",
            "distributed.inner_steps=3",
            "distributed.min_deltas=1",  # alone: its sync rounds close with its own delta
            f"distributed.repo_id=file://{tmp_path / 'shared'}",
            "logging.progress=false",
            "checkpoint.interval=0",
        ]
    )
    result = train_from_config(short, console=False)
    assert result.steps == 6
    assert (tmp_path / "shared" / "global").is_dir()  # the master published a global
