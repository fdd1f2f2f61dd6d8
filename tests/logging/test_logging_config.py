"""The ``wandb:`` and ``tensorboard:`` sections: defaults, validation, and the install hint."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import fields
from importlib import metadata
from pathlib import Path

import pytest

from speedtronic import ConfigError, SpeedtronicConfig
from speedtronic.plugins import get_plugin_manager
from speedtronic_logging.config import SECTIONS, TensorBoardConfig, WandbConfig


def test_sections_are_off_by_default() -> None:
    config = SpeedtronicConfig.from_dict({})
    assert config.wandb == WandbConfig() and config.tensorboard == TensorBoardConfig()
    assert config.wandb.enabled is False and config.tensorboard.enabled is False
    assert config.wandb.mode == "online" and config.tensorboard.flush_secs == 30


def test_values_are_coerced_and_round_trip() -> None:
    config = SpeedtronicConfig.from_dict(
        {
            "wandb": {"enabled": "true", "project": "p", "tags": ["a", 1], "mode": "offline"},
            "tensorboard": {"enabled": "yes", "log_dir": "tb", "flush_secs": "5"},
        }
    )
    assert config.wandb.enabled is True and config.wandb.tags == ["a", "1"]
    assert config.tensorboard.enabled is True and config.tensorboard.flush_secs == 5
    again = SpeedtronicConfig.from_dict(config.to_dict())
    assert again.wandb == config.wandb and again.tensorboard == config.tensorboard


@pytest.mark.parametrize(
    ("sections", "path", "words"),
    [
        ({"wandb": {"mode": "cloud"}}, "wandb.mode", "'online', 'offline', 'disabled'"),
        ({"wandb": {"projct": "p"}}, "wandb.projct", "did you mean 'project'"),
        ({"wandb": {"tags": "a,b"}}, "wandb.tags", "expected a list"),
        ({"tensorboard": {"flush_secs": 0}}, "tensorboard.flush_secs", ">= 1"),
        ({"tensorboard": {"enabled": "maybe"}}, "tensorboard.enabled", "boolean"),
    ],
)
def test_bad_values_name_their_field(sections: dict, path: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        SpeedtronicConfig.from_dict(sections)
    assert caught.value.path == path
    assert words in str(caught.value)


@pytest.fixture
def logging_plugin_unloaded() -> Iterator[None]:
    """The logging plugin taken out of the plugin manager for one test, then put back."""
    manager = get_plugin_manager()
    plugin = manager.unregister(name="logging")
    assert plugin is not None
    try:
        yield
    finally:
        manager.register(plugin, name="logging")


@pytest.mark.usefixtures("logging_plugin_unloaded")
@pytest.mark.parametrize("section", ["wandb", "tensorboard"])
def test_without_the_plugin_a_section_says_what_to_install(section: str) -> None:
    with pytest.raises(ConfigError) as caught:
        SpeedtronicConfig.from_dict({section: {"enabled": True}})
    assert caught.value.path == section
    message = str(caught.value)
    assert "speedtronic-logging" in message and "pip install" in message


def test_the_docs_page_lists_every_option() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "logging.md").read_text()
    for name, section in SECTIONS.items():
        table = page.split(f"### `{name}:`", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
        for field in fields(section):
            assert f"| `{field.name}` |" in table, f"{name}.{field.name} is not documented"
            assert field.metadata["help"], f"{name}.{field.name} has no help text"


def test_section_and_option_names_are_the_documented_contract() -> None:
    assert list(SECTIONS) == ["wandb", "tensorboard"]
    assert [f.name for f in fields(WandbConfig)] == [
        "enabled",
        "project",
        "entity",
        "name",
        "group",
        "tags",
        "mode",
        "dir",
    ]
    assert [f.name for f in fields(TensorBoardConfig)] == ["enabled", "log_dir", "flush_secs"]


def test_extras_install_each_backend() -> None:
    requires = metadata.requires("speedtronic-logging") or []
    extras: dict[str, set[str]] = {}
    for line in requires:
        if "extra ==" in line:
            requirement, marker = line.split(";", 1)
            extra = marker.split("extra ==", 1)[1].strip().strip("\"'")
            name = requirement.strip().split(">", 1)[0].split("=", 1)[0].split("[", 1)[0]
            extras.setdefault(extra, set()).add(name)
    assert extras == {
        "wandb": {"wandb"},
        "tensorboard": {"tensorboard"},
        "all": {"wandb", "tensorboard"},
    }


def test_loading_the_plugin_imports_neither_backend() -> None:
    code = (
        "import sys\n"
        "import speedtronic_logging.plugin\n"
        "from speedtronic import SpeedtronicConfig\n"
        "SpeedtronicConfig.from_dict({'wandb': {'project': 'p'}, 'tensorboard': {}})\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('wandb', 'tensorboard')"
        " or m.startswith('torch.utils.tensorboard')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
