"""What a new user meets in the first hour: errors that name the thing, a CLI that says what it
takes, plugins that say what they provide, and a model of your own without packaging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from speedtronic import SpeedtronicConfig, cli, hookimpl, plugins
from speedtronic.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_an_unknown_top_level_key_lists_the_sections() -> None:
    with pytest.raises(ConfigError) as caught:
        SpeedtronicConfig.from_dict({"nosuch": 1})
    message = str(caught.value)
    assert message.startswith("nosuch: unknown key; the top-level keys are model, run, data,")
    assert "distributed" in message and "optimizer" in message


def test_an_unknown_top_level_key_says_which_distribution_provides_a_missing_section(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(plugins.PROVIDED_SECTIONS, "quantum", "speedtronic-quantum")
    with pytest.raises(ConfigError, match=r"installable: quantum \(speedtronic-quantum\)"):
        SpeedtronicConfig.from_dict({"nosuch": 1})


def test_every_flag_of_every_command_has_help_text() -> None:
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices  # argparse keeps them here
    for name, command in commands.items():
        for action in command._actions:
            if action.dest == "help" or not action.option_strings:
                continue  # positionals and nested sub-command groups describe themselves
            assert action.help, f"speedtronic {name} {action.option_strings} has no help text"
    train_help = commands["train"].format_help()
    assert "--debug" in train_help and "--plugin MODULE" in train_help


def test_plugins_say_what_they_provide(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plugins", "--format", "json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert "model reference_transformer" in rows["reference_transformer"]["provides"]
    assert "section distributed" in rows["diloco"]["provides"]
    assert {"section wandb", "section tensorboard"} <= set(rows["logging"]["provides"])


def test_a_plugin_command_is_listed_as_provided() -> None:
    class Commands:
        @hookimpl
        def register_commands(self, subparsers: Any) -> None:
            subparsers.add_parser("hello-world", help="says hello")

    name = plugins.register(Commands(), name="core-test-commands")
    try:
        row = next(r for r in plugins.list_plugins() if r.name == name)
    finally:
        plugins.unregister(name)
    assert row.provides == ("command hello-world",)


@pytest.mark.slow
def test_a_register_model_module_is_usable_from_the_cli_with_plugin(tmp_path: Path) -> None:
    (tmp_path / "my_models.py").write_text(
        textwrap.dedent(
            """
            from torch import nn
            from torch.nn import functional as F
            from speedtronic import register_model

            @register_model("first_hour_mlp")
            class TinyMLP(nn.Module):
                # No max_seq_len/vocab_size attributes: the model section supplies them.
                def __init__(self, vocab_size=64, max_seq_len=16, width=16):
                    super().__init__()
                    self.emb = nn.Embedding(vocab_size, width)
                    self.head = nn.Linear(width, vocab_size)

                def forward(self, input_ids, labels):
                    logits = self.head(self.emb(input_ids))
                    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            """
        )
    )
    config = tmp_path / "run.yaml"
    config.write_text(
        "run: {device: cpu, max_steps: 1, output_dir: out}\n"
        "model: {name: first_hour_mlp, vocab_size: 64, max_seq_len: 16}\n"
        "checkpoint: {save_final: false}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "speedtronic", "train", "-c", str(config), "--plugin", "my_models"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    assert "done: 1 step, final loss" in done.stdout  # singular, and the loss is known
    missing = subprocess.run(
        [sys.executable, "-m", "speedtronic", "validate", "-c", str(config), "--plugin", "nope_x"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert missing.returncode == 2
    assert missing.stderr.strip().startswith("error: --plugin nope_x: cannot import it")


def test_an_unknown_model_says_how_to_register_one() -> None:
    from speedtronic.registry import build_model_from_hook

    with pytest.raises(ConfigError) as caught:
        build_model_from_hook("refrence_transformer")
    message = str(caught.value)
    assert "(did you mean 'reference_transformer'?)" in message and "?;" not in message
    assert "reference_transformer" in message.split("Known models: ")[1]
    assert "--plugin MODULE" in message and "package.module:function" in message


def test_a_model_named_by_import_path_needs_no_plugin(tmp_path: Path) -> None:
    from speedtronic.engine.runtime import train_from_config

    config = {
        "run": {"device": "cpu", "max_steps": 2, "output_dir": str(tmp_path)},
        "model": {"name": "core.toy_runs:Bigram", "vocab_size": 16, "max_seq_len": 8},
        "checkpoint": {"save_final": False},
    }
    assert train_from_config(config, console=False).steps == 2
    config["model"]["name"] = "core.toy_runs:NoSuchThing"
    with pytest.raises(ConfigError, match=r"^model\.name: 'core\.toy_runs' has no attribute"):
        train_from_config(config, console=False)


def test_the_missing_plugin_hint_works_from_a_source_checkout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(ROOT)
    hint = plugins.install_command("speedtronic-diloco")
    assert hint.startswith("pip install ./speedtronic-diloco ")  # pip can find this one
    assert "pip install speedtronic-diloco once published" in hint
    assert plugins.install_command("speedtronic-quantum") == "pip install speedtronic-quantum"


def test_a_failed_run_still_reports_its_last_loss(tmp_path: Path) -> None:
    from core.toy_runs import tiny_transformer_run

    from speedtronic.engine.runtime import build_runtime
    from speedtronic.errors import SpeedtronicError

    class FailsAtThree:
        @hookimpl
        def after_optimizer_step(self, step: int) -> None:
            if step == 3:
                raise SpeedtronicError("stop at 3")

    summaries: list[dict[str, Any]] = []
    name = plugins.register(FailsAtThree(), name="core-test-fails-at-three")
    try:
        with pytest.raises(SpeedtronicError):
            build_runtime(
                tiny_transformer_run(tmp_path),
                hooks=[lambda e, p: summaries.append(p) if e == "train_end" else None],
                console=False,
            ).trainer.fit()
    finally:
        plugins.unregister(name)
    assert summaries[0]["status"].startswith("error") and summaries[0]["final_loss"] is not None


@pytest.mark.parametrize(
    ("section", "key", "meant"),
    [
        ("optimizer", "learning_rate", "lr"),
        ("optimizer", "wd", "weight_decay"),
        ("data", "batch_size", "micro_batch_size"),
        ("run", "max_iters", "max_steps"),
        ("scheduler", "warmup", "warmup_steps"),
        ("eval", "interval", "every"),
        ("checkpoint", "intervall", "interval"),
    ],
)
def test_an_unknown_key_in_any_section_gets_a_suggestion(
    section: str, key: str, meant: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        SpeedtronicConfig.from_dict({section: {key: 1}})
    assert str(caught.value) == f"{section}.{key}: unknown key; did you mean {meant!r}?"


def test_model_parameters_use_the_same_suggestions(tmp_path: Path) -> None:
    from speedtronic.engine.runtime import check_runtime

    run = {"device": "cpu", "output_dir": str(tmp_path)}
    with pytest.raises(ConfigError, match=r"^model\.n_layers: unknown key; did you mean 'n_layer'"):
        check_runtime({"run": run, "model": {"n_layers": 2}})
    # A model factory of your own: its signature is checked with the same suggestions.
    bigram = {"name": "core.toy_runs:Bigram", "vocab": 16, "max_seq_len": 8}
    with pytest.raises(ConfigError, match=r"no parameter 'vocab'; did you mean 'vocab_size'"):
        check_runtime({"run": run, "model": bigram})


def test_a_missing_section_names_the_extra_it_needs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(plugins.KNOWN_PROVIDERS, "quantum_tb", "speedtronic-quantum")
    monkeypatch.setitem(plugins.PROVIDED_EXTRAS, "quantum_tb", "tb")
    monkeypatch.chdir(tmp_path)  # outside any checkout: by name, with the extra
    hint = plugins.missing_provider_hint("quantum_tb")
    assert hint == " (provided by speedtronic-quantum: pip install 'speedtronic-quantum[tb]')"


def test_install_hints_follow_the_checkout_the_user_is_in(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Core installed from a checkout without -e runs from site-packages: the checkout to
    point at is the one the working directory is in."""
    for name in ("speedtronic-core", "speedtronic-logging"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "pyproject.toml").write_text(f'[project]\nname = "{name}"\n')
    (tmp_path / "docs").mkdir()
    monkeypatch.chdir(tmp_path)
    hint = plugins.install_command("speedtronic-logging", "tensorboard")
    assert hint.startswith("pip install './speedtronic-logging[tensorboard]' (this source checkout")
    assert "pip install 'speedtronic-logging[tensorboard]' once published" in hint
    monkeypatch.chdir(tmp_path / "docs")  # below the checkout's root: the absolute path
    hint = plugins.install_command("speedtronic-logging", "tensorboard")
    assert hint.startswith(f"pip install '{tmp_path}/speedtronic-logging[tensorboard]'")


@pytest.mark.slow
def test_ctrl_c_names_the_checkpoint_to_resume_from(tmp_path: Path) -> None:
    import signal
    import time

    config = tmp_path / "run.yaml"
    config.write_text(
        json.dumps(
            {
                "run": {"device": "cpu", "max_steps": 100000, "output_dir": str(tmp_path)},
                "model": {"name": "core.toy_runs:Bigram", "vocab_size": 16, "max_seq_len": 8},
                "checkpoint": {"interval": 2, "keep_last": 1},
                "logging": {"progress": False},
            }
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), *sys.path])}
    process = subprocess.Popen(
        [sys.executable, "-m", "speedtronic", "train", "--config", str(config)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    checkpoints = tmp_path / "checkpoints"
    deadline = time.monotonic() + 600
    while not (checkpoints / "latest.json").exists():  # a bounded poll, not a sleep
        assert process.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 130
    line = stderr.strip().splitlines()[-1]
    assert line.startswith(f"interrupted; the newest checkpoint is {checkpoints}/step_"), line
    assert line.endswith("continue from it with the same command and --resume")
