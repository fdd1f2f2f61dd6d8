"""The plugin through the ``speedtronic`` command: both sinks on the smoke config, the plugin
listing, and the install hint when the plugin is not loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from run_outputs import files_containing, read_jsonl, tensorboard_events, tensorboard_hparams
from wandb_run_file import finished_runs

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"
FAKE_API_KEY = "local-fake-wandb-key-0123456789abcdef0123"


def speedtronic(
    *args: str, env: dict[str, str] | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "speedtronic", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


@pytest.mark.slow
def test_train_logs_to_wandb_and_tensorboard(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = speedtronic(
        "train",
        "--config",
        str(SMOKE),
        "--max-steps",
        "4",
        "--output-dir",
        str(out),
        "--set",
        "logging.log_every=2",
        "--set",
        f"logging.json_file={out / 'metrics.jsonl'}",
        "--set",
        "wandb.enabled=true",
        "--set",
        "wandb.mode=offline",
        "--set",
        "wandb.project=speedtronic-tests",
        "--set",
        "wandb.group=cli",
        "--set",
        "wandb.tags=[smoke, cpu]",
        "--set",
        "tensorboard.enabled=true",
        env={"WANDB_API_KEY": FAKE_API_KEY},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [e for e in read_jsonl(out / "metrics.jsonl") if e["event"] == "step"]
    assert [e["step"] for e in steps] == [2, 4]

    # TensorBoard: every step event's scalars at its step, equal to what the JSONL sink saw.
    events = tensorboard_events(out / "tensorboard")
    for key in ("loss", "lr", "grad_norm", "tokens_per_sec", "memory_mb"):
        scalars = events.Scalars(f"train/{key}")
        assert [s.step for s in scalars] == [2, 4], key
        assert [s.value for s in scalars] == pytest.approx([e[key] for e in steps], rel=1e-6)
    hparams, status = tensorboard_hparams(events)
    assert hparams["run.name"] == "smoke" and hparams["optimizer.lr"] == pytest.approx(3e-3)
    assert status == 1  # STATUS_SUCCESS

    # W&B: one offline run; history rows carry the loss at its trainer step.
    (run,) = finished_runs(out)
    assert (run.name, run.group, run.tags) == ("smoke", "cli", ["smoke", "cpu"])
    assert run.config["run"]["max_steps"] == 4 and run.config["model"]["d_model"] == 64
    rows = [row for row in run.history if "train/loss" in row]
    assert [row["trainer/step"] for row in rows] == [2, 4]
    assert [row["train/loss"] for row in rows] == pytest.approx([e["loss"] for e in steps])
    assert run.summary["status"] == "ok" and run.summary["steps"] == 4
    assert run.summary["final_loss"] == pytest.approx(steps[-1]["loss"])
    assert run.exit_code == 0

    # The API key reaches none of the files of the run: W&B's, TensorBoard's, checkpoints.
    assert (out / "checkpoints").is_dir()
    assert files_containing(out, FAKE_API_KEY) == []


def test_plugin_is_listed_with_its_hooks() -> None:
    result = speedtronic("plugins", "--format", "json")
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    row = rows["logging"]
    assert row["distribution"] == "speedtronic-logging"
    assert {"config_sections", "on_metric", "on_train_start", "on_train_end"} <= set(row["hooks"])


def test_a_section_without_the_plugin_names_the_distribution(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(SMOKE.read_text() + "wandb:\n  enabled: true\n")
    result = speedtronic(
        "validate",
        "--config",
        str(config),
        env={"SPEEDTRONIC_LOAD_PLUGINS": "reference_transformer"},
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: wandb") and "speedtronic-logging" in result.stderr
