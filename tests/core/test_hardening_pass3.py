"""Regression tests for the third fault-injection pass (issue 34) in core: a YAML alias bomb is
one quick error, reserved model parameters are one ConfigError, every path a save writes is
checked before training, a diverged run stops with an error, and a checkpoint directory is
locked by the run that trains into it (a dead holder's lock is taken over)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from core.plugin_fixtures import plugin_env, run_cli, user_error_line
from core.toy_runs import EventRecorder, tiny_transformer_run, train

from speedtronic import SpeedtronicConfig
from speedtronic.checkpoint.runlock import LOCK_NAME, RunLock
from speedtronic.config.files import MAX_CONFIG_NODES
from speedtronic.engine.runtime import build_runtime
from speedtronic.errors import CheckpointError, ConfigError, SpeedtronicError

# ---------------------------------------------------------------- M2: YAML alias bombs


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """The "billion laughs": each level a list of ``width`` aliases of the one before, so a
    few hundred bytes stand for ``width ** levels`` values."""
    lines = ["model:", "  name: reference_transformer", "  params:", "    a0: &a0 [lol]"]
    for level in range(1, levels + 1):
        refs = ", ".join([f"*a{level - 1}"] * width)
        lines.append(f"    a{level}: &a{level} [{refs}]")
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_one_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    assert len(path.read_bytes()) < 600
    with pytest.raises(ConfigError) as caught:
        SpeedtronicConfig.from_file(path)
    message = str(caught.value)
    assert str(path) in message and "aliases expand" in message


@pytest.mark.slow
def test_validate_config_only_refuses_a_bomb_at_once(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    # A bound that only a hang (minutes, before the fix) could reach.
    line = user_error_line(run_cli("validate", "--config-only", "--config", str(path), timeout=120))
    assert "bomb.yaml" in line and "aliases expand" in line


def test_a_bomb_in_an_override_is_one_error() -> None:
    nested = "&l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"
    for level in range(1, 7):  # each level: a list of 10 copies of the level below
        nested = f"&l{level} [" + ", ".join([f"[{nested}]"] + [f"*l{level - 1}"] * 9) + "]"
    config = SpeedtronicConfig.from_dict({})
    with pytest.raises(ConfigError, match=r"override 'model\.params\.x': its aliases expand"):
        config.with_overrides([f"model.params.x={nested}"])


def test_aliases_that_stay_small_still_work() -> None:
    text = "model: &m\n  name: reference_transformer\n  vocab_size: 64\nrun:\n  name: small\n"
    config = SpeedtronicConfig.from_string(text)
    assert config.model.params == {"vocab_size": 64}
    # Just below the bound is fine, just above is not.
    ok = "model:\n  name: x\n  params:\n    big: &b [" + ", ".join(["1"] * 1000) + "]\n"
    ok += "    copies: [" + ", ".join(["*b"] * (MAX_CONFIG_NODES // 1001 - 2)) + "]\n"
    SpeedtronicConfig.from_string(ok)
    too_many = ok.replace("copies: [", "copies: [" + ", ".join(["*b"] * 10) + ", ")
    with pytest.raises(ConfigError, match="aliases expand"):
        SpeedtronicConfig.from_string(too_many)


# ---------------------------------------------------------------- M3: reserved parameters


@pytest.mark.parametrize(
    "model",
    [
        {"name": "reference_transformer", "params": {"name": "evil"}},
        {"name": "reference_transformer", "params": {"params": {"d_model": 8}}},
    ],
)
def test_reserved_model_parameters_are_one_config_error(model: dict) -> None:
    with pytest.raises(ConfigError) as caught:
        SpeedtronicConfig.from_dict({"model": model})
    assert str(caught.value).startswith("model.params.")


def test_reserved_model_parameter_on_the_command_line_is_one_error_line(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  name: reference_transformer\n  params:\n    name: evil\n")
    line = user_error_line(run_cli("validate", "--config", str(path)))
    assert line.startswith("error: model.params.name: is a reserved key")


# ---------------------------------------------------------------- M4: every path a save writes


@pytest.mark.parametrize(
    ("blocked", "keep_best"),
    [("latest.json", False), ("best.json", True), ("step_00000004", False)],
)
def test_a_save_path_that_cannot_be_written_fails_before_training(
    tmp_path: Path, blocked: str, keep_best: bool
) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    if blocked.startswith("step_"):
        (directory / blocked).symlink_to(tmp_path / "nowhere")  # dangling
    else:
        (directory / blocked).mkdir()  # a directory where the pointer file goes
        (directory / blocked / "x").write_text("not empty")
    sections: dict = {"checkpoint": {"directory": str(directory), "keep_best": keep_best}}
    if keep_best:
        sections["eval"] = {"every": 4, "batches": 1}
    config = tiny_transformer_run(tmp_path, **sections)
    recorder = EventRecorder()
    runtime = build_runtime(config, hooks=[recorder], console=False)
    with pytest.raises(CheckpointError, match=rf"cannot write checkpoints to .*{blocked}"):
        runtime.trainer.fit()
    assert recorder.named("step") == [] and runtime.trainer.step == 0


# ---------------------------------------------------------------- run.max_nan_steps

DIVERGING = {"optimizer": {"lr": 1e30}, "checkpoint": {"interval": 0, "save_final": False}}


def test_a_run_whose_loss_stays_nan_stops_with_an_error(tmp_path: Path) -> None:
    config = tiny_transformer_run(tmp_path, run={"max_steps": 200, "max_nan_steps": 8}, **DIVERGING)
    with pytest.raises(SpeedtronicError, match=r"NaN or infinite for the last \d+ optimizer steps"):
        train(config)
    # Stopped within half the limit after the limit was reached (not at step 200).
    runtime = build_runtime(config, console=False)
    with pytest.raises(SpeedtronicError):
        runtime.trainer.fit()
    assert 8 <= runtime.trainer.step <= 8 + 4 + 2


def test_max_nan_steps_null_trains_on(tmp_path: Path) -> None:
    config = tiny_transformer_run(
        tmp_path, run={"max_steps": 30, "max_nan_steps": None}, **DIVERGING
    )
    result, recorder, _ = train(config)
    assert result.steps == 30
    assert any(loss != loss for loss in recorder.losses.values())  # NaN, and it went on


@pytest.mark.slow
def test_a_diverged_cli_run_exits_non_zero(tmp_path: Path) -> None:
    config = tiny_transformer_run(tmp_path / "out", run={"max_steps": 500}, **DIVERGING)
    config["logging"] = {"log_every": 50, "progress": False}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    done = run_cli("train", "--config", str(path), env=plugin_env(load=None), timeout=300)
    line = user_error_line(done)
    assert "run.max_nan_steps is 20" in line


# ---------------------------------------------------------------- M5: the run lock


def test_a_live_run_lock_refuses_a_second_run_naming_the_holder(tmp_path: Path) -> None:
    config = tiny_transformer_run(tmp_path)
    held = RunLock.acquire(tmp_path / "checkpoints")
    try:
        runtime = build_runtime(config, console=False)
        with pytest.raises(
            CheckpointError, match=rf"in use by another live run \(pid {os.getpid()}"
        ):
            runtime.trainer.fit()
        assert runtime.trainer.step == 0
    finally:
        held.release()
    train(config)  # released: the directory is free again
    assert not (tmp_path / "checkpoints" / LOCK_NAME).exists()  # and the run left no trace
    assert RunLock.acquire(tmp_path / "checkpoints").held


def test_the_lock_of_a_dead_run_is_taken_over(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    # A process that took the lock and was SIGKILLed: the kernel dropped its flock, its note
    # (naming a pid that no longer runs) is still in the file.
    code = (
        "import os, signal, sys\n"
        "from speedtronic.checkpoint.runlock import RunLock\n"
        "RunLock.acquire(sys.argv[1])\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(directory)], timeout=120)
    assert done.returncode == -9
    assert "pid" in (directory / LOCK_NAME).read_text()
    result, _, _ = train(tiny_transformer_run(tmp_path))
    assert result.steps == 16


# ---------------------------------------------------------------- own pass: NaN weights out


@pytest.mark.slow
def test_export_and_generate_refuse_a_checkpoint_of_nan_weights(tmp_path: Path) -> None:
    """A diverged run (max_nan_steps off) saves NaN weights; exporting or sampling them used
    to exit 0 with a model that only ever produces NaN."""
    config = tiny_transformer_run(
        tmp_path / "run", run={"max_steps": 4, "max_nan_steps": None}, **DIVERGING
    )
    config["checkpoint"] = {"interval": 0, "save_final": True}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    env = plugin_env(load=None)
    assert run_cli("train", "--config", str(path), env=env, timeout=300).returncode == 0
    exported = run_cli(
        "export", "--config", str(path), "--out", str(tmp_path / "hf"), env=env, timeout=300
    )
    assert "NaN or infinite weights" in user_error_line(exported)
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    sampled = run_cli(
        "generate", "--config", str(path), "--prompt", "hi", "--max-new-tokens", "2", env=env
    )
    assert "NaN or infinite weights" in user_error_line(sampled)
