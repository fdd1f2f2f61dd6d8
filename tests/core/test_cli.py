"""The ``speedtronic`` command, driven as a subprocess: train, validate, plugins, user errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from core.plugin_fixtures import install_fixture_plugins, plugin_env, run_cli
from core.plugin_fixtures import user_error_line as error_line

from speedtronic import __version__

CONSOLE_SCRIPT = Path(sys.executable).with_name("speedtronic")


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_fixture_plugins(tmp_path_factory)


def write_config(directory: Path, **extra: object) -> Path:
    """A tiny run of the fixture plugin's model, with a secret in its config section."""
    data: dict[str, object] = {
        "run": {"name": "cli", "device": "cpu", "max_steps": 2, "output_dir": str(directory)},
        "model": {"name": "throwaway_mlp", "vocab_size": 16, "max_seq_len": 8, "hidden": 8},
        "data": {"micro_batch_size": 2},
        "precision": {"mode": "fp32"},
        "logging": {"log_every": 1, "progress": False},
        "throwaway": {"token": "hunter2"},
        **extra,
    }
    path = directory / "config.yaml"
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


# ---------------------------------------------------------------- entry points


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["validate", "--config", "nope.yml"]])
def test_console_script_and_python_m_behave_the_same(args: list[str]) -> None:
    assert CONSOLE_SCRIPT.exists(), "the speedtronic console script is not installed"
    env = plugin_env()
    script = subprocess.run([str(CONSOLE_SCRIPT), *args], env=env, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    module = run_cli(*args, env=env)
    assert (script.returncode, script.stdout, script.stderr) == (
        module.returncode, module.stdout, module.stderr,
    )  # fmt: skip
    if args == ["--version"]:
        assert module.stdout.strip() == f"speedtronic {__version__}"


def test_no_command_prints_help_and_fails() -> None:
    result = run_cli()
    assert result.returncode == 2
    assert "train" in result.stdout and "validate" in result.stdout and "plugins" in result.stdout


# ---------------------------------------------------------------- validate


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_validate_prints_the_resolved_config_with_secrets_redacted(
    site: Path, tmp_path: Path, fmt: str
) -> None:
    config = write_config(tmp_path)
    result = run_cli("validate", "--config", str(config), "--format", fmt, env=plugin_env(site))
    assert result.returncode == 0, result.stderr
    assert "hunter2" not in result.stdout
    shown = json.loads(result.stdout) if fmt == "json" else yaml.safe_load(result.stdout)
    assert shown["throwaway"] == {"metrics_file": None, "token": "<redacted>"}
    # Resolved: every section with its defaults, aliases in canonical form.
    assert shown["run"]["max_steps"] == 2 and shown["checkpoint"]["keep_last"] >= 1
    assert shown["model"] == {"name": "throwaway_mlp", "vocab_size": 16, "max_seq_len": 8,
                              "hidden": 8}  # fmt: skip
    assert {"data", "optimizer", "scheduler", "precision", "compile", "logging"} <= set(shown)


def test_validate_applies_overrides(site: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path)
    result = run_cli(
        "validate", "-c", str(config), "--format", "json", "--set", "data.micro_batch_size=4",
        "--set", "max_steps=9", "--set", "compile.enabled=yes", env=plugin_env(site),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["data"]["micro_batch_size"] == 4 and shown["run"]["max_steps"] == 9
    assert shown["compile"]["enabled"] is True


def test_validate_prints_the_time_per_step_estimate(site: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path)
    result = run_cli("validate", "-c", str(config), env=plugin_env(site))
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("time per step")]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("time per step (estimate): about ")
    assert " per step on this CPU (" in lines[0] and "matmul FLOPs at a measured" in lines[0]


# ---------------------------------------------------------------- train


@pytest.mark.slow
def test_train_then_resume(site: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "cfg")
    output = tmp_path / "out"
    env = plugin_env(site)
    first = run_cli("train", "--config", str(config), "--output-dir", str(output), env=env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[-1].startswith("done: 2 steps, final loss ")
    assert (output / "checkpoints" / "latest.json").exists()
    second = run_cli("train", "--config", str(config), "--output-dir", str(output),
                     "--resume", "--max-steps", "4", env=env)  # fmt: skip
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines()[-1].startswith("done: 4 steps (resumed from step 2)")
    steps = [line for line in second.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["step=3", "step=4"]


# ---------------------------------------------------------------- plugins


def test_plugins_prints_a_table(site: Path) -> None:
    result = run_cli("plugins", env=plugin_env(site))
    assert result.returncode == 0, result.stderr
    header = next(line for line in result.stdout.splitlines() if "distribution" in line)
    for column in ("plugin", "distribution", "version", "hooks"):
        assert column in header
    row = next(line for line in result.stdout.splitlines() if " throwaway " in line)
    assert "speedtronic-throwaway" in row and "0.3.1" in row and "build_model" in row
    assert "failed to load" in result.stdout  # the broken fixture plugins are listed as such


# ---------------------------------------------------------------- user errors


def test_missing_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    line = error_line(run_cli("train", "--config", str(missing)))
    assert line == f"error: config file not found: {missing}"


def test_yaml_syntax_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("run:\n  max_steps: 3\n  name: [unclosed\n")
    line = error_line(run_cli("validate", "--config", str(path)))
    assert line.startswith(f"error: cannot parse {path}: ") and "line 4" in line


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("data.micro_batch_size", "error: override 'data.micro_batch_size' must look like "
                                  "dotted.key=value"),
        ("data.micro_bach_size=2", "error: data.micro_bach_size: unknown key; did you mean "
                                   "'micro_batch_size'?"),
        ("data.micro_batch_size=0", "error: data.micro_batch_size: must be >= 1 (got 0)"),
        ("checkpoint.resume=perhaps", "error: checkpoint.resume: expected a boolean "
                                      "(true/false), got 'perhaps'"),
    ],
)  # fmt: skip
def test_bad_override(tmp_path: Path, override: str, expected: str) -> None:
    config = tmp_path / "ok.yaml"
    config.write_text("run: {max_steps: 2}\n")
    assert error_line(run_cli("validate", "-c", str(config), "--set", override)) == expected


def test_unknown_key_in_the_file(tmp_path: Path) -> None:
    config = tmp_path / "typo.yaml"
    config.write_text("run:\n  max_step: 2\n")
    line = error_line(run_cli("train", "-c", str(config)))
    assert line == "error: run.max_step: unknown key; did you mean 'max_steps'?"


def test_unknown_model_name(site: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path, model={"name": "throwaway_mpl"})
    line = error_line(run_cli("train", "-c", str(config), env=plugin_env(site)))
    assert line.startswith("error: model.name: no plugin builds a model named 'throwaway_mpl'")
    assert "did you mean 'throwaway_mlp'?" in line and "Known models:" in line


def test_missing_data_file(site: Path, tmp_path: Path) -> None:
    missing = tmp_path / "corpus.txt"
    config = write_config(
        tmp_path,
        model={"name": "throwaway_mlp", "vocab_size": 256, "max_seq_len": 8},  # bytes: 256
        data={"micro_batch_size": 2, "text_path": str(missing)},
    )
    line = error_line(run_cli("train", "-c", str(config), env=plugin_env(site)))
    assert line == f"error: data.text_path: file not found: {missing}"


@pytest.mark.parametrize("position", ["before", "after"])
def test_debug_shows_the_traceback(tmp_path: Path, position: str) -> None:
    missing = str(tmp_path / "missing.yaml")
    args = ["validate", "--config", missing]
    args = ["--debug", *args] if position == "before" else [*args, "--debug"]
    result = run_cli(*args)
    assert result.returncode != 0
    assert "Traceback (most recent call last)" in result.stderr
    assert "ConfigError: config file not found" in result.stderr


def test_a_config_flag_stands_for_its_override(tmp_path: Path) -> None:
    import argparse

    from speedtronic.cli import add_config_flag, add_set_option, load_config

    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_set_option(parser)
    add_config_flag(parser, "--long", "run.max_steps=7", help="seven steps")
    config = tmp_path / "config.yaml"
    config.write_text("run: {max_steps: 2}\n")
    args = parser.parse_args(["--config", str(config), "--set", "run.max_steps=3", "--long"])
    assert args.set == ["run.max_steps=3", "run.max_steps=7"]
    assert load_config(args).run.max_steps == 7
    assert load_config(parser.parse_args(["--config", str(config)])).run.max_steps == 2
    with pytest.raises(ValueError, match="KEY=VALUE"):
        add_config_flag(parser, "--bad", "run.max_steps", help="no value")
