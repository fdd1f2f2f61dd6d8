"""Plugin discovery: entry points of really installed distributions, built-ins, failures, the
``SPEEDTRONIC_LOAD_PLUGINS`` switch, and ``build_model`` through the hook."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pluggy
import pytest
import torch
from core.plugin_fixtures import (
    ALL_INSTALLED,
    install_fixture_plugins,
    plugin_env,
    run_cli,
    run_python,
)
from core.plugin_fixtures import user_error_line as error_line
from torch import nn

import speedtronic
from speedtronic import plugins
from speedtronic.errors import ConfigError
from speedtronic.registry import register_model, registered_models, unregister_model

THROWAWAY_HOOKS = [
    "build_model",
    "config_sections",
    "on_metric",
    "on_train_start",
    "register_commands",
]


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """speedtronic-throwaway and speedtronic-throwaway-broken, pip-installed (subprocesses only)."""
    return install_fixture_plugins(tmp_path_factory)


def listed(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    result = run_cli("plugins", "--format", "json", env=env)
    assert result.returncode == 0, result.stderr
    return {row["name"]: row for row in json.loads(result.stdout)}


def warnings_of(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("WARNING")]


# ---------------------------------------------------------------- entry-point discovery


def test_installed_plugin_is_listed_with_distribution_version_and_hooks(site: Path) -> None:
    # Everything installed, as a user would run it: the fixture plugins among the rest.
    rows = listed(plugin_env(site, load=ALL_INSTALLED))
    assert rows["throwaway"]["distribution"] == "speedtronic-throwaway"
    assert rows["throwaway"]["version"] == "0.3.1"
    assert rows["throwaway"]["hooks"] == THROWAWAY_HOOKS
    assert rows["throwaway"]["error"] == ""
    # Core's built-in plugin is registered exactly like a third-party one.
    assert rows["speedtronic.registry"]["distribution"] == "speedtronic-core"
    assert rows["speedtronic.registry"]["version"] == speedtronic.__version__
    assert rows["speedtronic.registry"]["hooks"] == ["build_model"]


def test_entry_point_plugin_builds_its_model_through_the_hook(site: Path) -> None:
    code = (
        "import speedtronic\n"
        "model = speedtronic.build_model('throwaway_mlp', vocab_size=8, max_seq_len=4, hidden=6)\n"
        "print(type(model).__module__, type(model).__name__, model.vocab_size, "
        "model.embed.embedding_dim)\n"
        "try:\n"
        "    speedtronic.build_model('throwaway_mpl')\n"
        "except speedtronic.ConfigError as exc:\n"
        "    print(exc)\n"
    )
    result = run_python(code, env=plugin_env(site))
    assert result.returncode == 0, result.stderr
    # The broken plugins of the other fixture distribution did not stop anything. Outside the
    # CLI nobody configured logging: Python's last-resort handler still shows both warnings.
    assert result.stderr.count("failed to load") == 2, result.stderr
    built, error = result.stdout.splitlines()
    assert built == "speedtronic_throwaway.model ThrowawayMLP 8 6"
    # The unknown name is named, a close one suggested, and the known names listed.
    assert error.startswith("model.name: no plugin builds a model named 'throwaway_mpl'")
    assert "did you mean 'throwaway_mlp'?" in error
    assert "Known models:" in error and "throwaway_mlp" in error.split("Known models:")[1]


@pytest.mark.slow
def test_entry_point_metric_sink_receives_a_real_training_run(site: Path, tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    config = tmp_path / "run.yaml"
    config.write_text(
        f"run: {{device: cpu, max_steps: 3, output_dir: {json.dumps(str(tmp_path / 'out'))}}}\n"
        "model: {name: throwaway_mlp, vocab_size: 16, max_seq_len: 8, hidden: 8}\n"
        "data: {micro_batch_size: 2}\n"
        "precision: {mode: fp32}\n"
        "logging: {log_every: 1, progress: false}\n"
        f"throwaway: {{metrics_file: {json.dumps(str(metrics))}}}\n"
    )
    result = run_cli("train", "--config", str(config), env=plugin_env(site))
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    names = [event["event"] for event in events]
    assert names[0] == "train_start" and names[-1] == "train_end"
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3]
    assert events[-1]["steps"] == 3


def test_plugin_command_from_an_entry_point_runs(site: Path) -> None:
    result = run_cli("throwaway-hello", "--name", "tests", env=plugin_env(site))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "hello, tests, from speedtronic-throwaway"


# ---------------------------------------------------------------- failures


def test_broken_plugins_each_give_one_warning_and_the_run_continues(site: Path) -> None:
    result = run_cli("plugins", "--format", "json", env=plugin_env(site))
    assert result.returncode == 0, result.stderr
    warnings = warnings_of(result.stderr)
    assert len(warnings) == 2, result.stderr
    boom, typo = sorted(warnings)
    assert "'broken' from distribution speedtronic-throwaway-broken failed to load" in boom
    assert "RuntimeError: speedtronic_throwaway_broken.boom is broken on purpose" in boom
    assert "'typo' from distribution speedtronic-throwaway-broken failed to load" in typo
    assert "unknown hook 'on_metrics' (did you mean 'on_metric'?)" in typo
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows["broken"]["hooks"] == [] and "broken on purpose" in rows["broken"]["error"]
    # The rejected plugin left nothing behind, and the healthy ones still loaded.
    assert "on_metrics" not in json.dumps(rows["throwaway"])
    assert rows["throwaway"]["hooks"] == THROWAWAY_HOOKS


def test_a_config_that_needs_a_broken_plugin_names_its_distribution(
    site: Path, tmp_path: Path
) -> None:
    config = tmp_path / "needs-broken.yaml"
    config.write_text("broken: {level: 3}\n")
    line = error_line(run_cli("validate", "--config", str(config), env=plugin_env(site)))
    assert line.startswith("error: broken: unknown key")
    assert "failed to load" in line and "speedtronic-throwaway-broken" in line


# ---------------------------------------------------------------- SPEEDTRONIC_LOAD_PLUGINS


def test_empty_load_plugins_variable_disables_every_entry_point(site: Path) -> None:
    result = run_cli("plugins", "--format", "json", env=plugin_env(site, load=""))
    assert result.returncode == 0, result.stderr
    assert [row["name"] for row in json.loads(result.stdout)] == ["speedtronic.registry"]
    assert warnings_of(result.stderr) == []  # the broken plugins were not even imported


@pytest.mark.parametrize(
    "selector", ["speedtronic-throwaway", "throwaway", "Speedtronic_Throwaway"]
)
def test_load_plugins_variable_selects_by_distribution_or_entry_point(
    site: Path, selector: str
) -> None:
    rows = listed(plugin_env(site, load=selector))
    assert sorted(rows) == ["speedtronic.registry", "throwaway"]


def test_load_plugins_variable_warns_about_names_that_match_nothing(site: Path) -> None:
    env = plugin_env(site, load="throwaway, no-such-plugin")
    result = run_cli("plugins", "--format", "json", env=env)
    assert result.returncode == 0, result.stderr
    assert warnings_of(result.stderr) == [
        "WARNING speedtronic.plugins: SPEEDTRONIC_LOAD_PLUGINS names 'no-such-plugin', "
        "which is not an installed plugin"
    ]


def test_a_known_plugin_held_back_by_the_variable_is_named_in_errors(site: Path) -> None:
    code = (
        "import speedtronic\n"
        "try:\n"
        "    speedtronic.build_model('reference_transformer')\n"
        "except speedtronic.ConfigError as exc:\n"
        "    print(exc)\n"
    )
    result = run_python(code, env=plugin_env(site, load="throwaway"))
    assert result.returncode == 0, result.stderr
    message = result.stdout.strip()
    assert "provided by speedtronic-models, which is installed but not loaded" in message
    assert "SPEEDTRONIC_LOAD_PLUGINS='throwaway'" in message


# ---------------------------------------------------------------- in-process registry


class Linear(nn.Module):
    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.layer = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).mean()


@pytest.fixture
def in_process_model() -> Any:
    register_model("core_test_linear", Linear)
    yield "core_test_linear"
    unregister_model("core_test_linear")


def test_register_model_builds_in_process(in_process_model: str) -> None:
    model = speedtronic.build_model(in_process_model, width=5)
    assert isinstance(model, Linear) and model.layer.in_features == 5
    assert in_process_model in registered_models()


def test_register_model_as_a_decorator_replaces_an_earlier_factory() -> None:
    @register_model("core_test_decorated")
    def first(**params: Any) -> nn.Module:
        return nn.Linear(2, 2)

    @register_model("core_test_decorated")
    def second(**params: Any) -> nn.Module:
        return nn.Linear(4, 4)

    try:
        assert first is not second  # the decorator hands the function back unchanged
        assert speedtronic.build_model("core_test_decorated").in_features == 4
    finally:
        unregister_model("core_test_decorated")


def test_unknown_model_lists_known_names_and_suggests_one(in_process_model: str) -> None:
    with pytest.raises(ConfigError) as caught:
        speedtronic.build_model("core_test_lineer")
    assert caught.value.path == "model.name"
    assert "did you mean 'core_test_linear'?" in str(caught.value)
    assert in_process_model in str(caught.value).split("Known models:")[1]


def test_a_parameter_the_factory_does_not_take_is_a_config_error(in_process_model: str) -> None:
    with pytest.raises(ConfigError) as caught:
        speedtronic.build_model(in_process_model, widht=4)
    assert caught.value.path == "model.widht"
    assert "did you mean 'width'?" in str(caught.value)


def test_plugin_with_its_own_hookimpl_marker_is_called() -> None:
    marker = pluggy.HookimplMarker("speedtronic")

    class OwnMarker:
        @marker
        def build_model(self, name: str) -> Any:  # a subset of the arguments
            return nn.Identity() if name == "core_test_own_marker" else None

    name = plugins.register(OwnMarker(), name="core-test-own-marker")
    try:
        assert isinstance(speedtronic.build_model("core_test_own_marker"), nn.Identity)
        row = next(r for r in plugins.list_plugins() if r.name == name)
        assert (row.distribution, row.hooks) == ("in-process", ("build_model",))
    finally:
        plugins.unregister(name)
    assert all(r.name != name for r in plugins.list_plugins())


def test_the_plugin_manager_knows_every_hook_the_issue_names() -> None:
    manager = plugins.get_plugin_manager()
    names = plugins.hook_names()
    assert all(getattr(manager.hook, name).has_spec() for name in names)
    required = {
        "build_model",
        "after_optimizer_step",
        "on_checkpoint",
        "on_metric",
        "config_sections",
        "on_train_start",
        "on_train_end",
        "register_commands",
    }
    assert required <= set(names)
    assert manager.project_name == "speedtronic" == plugins.ENTRY_POINT_GROUP


# ---------------------------------------------------------------- provider hints


def test_hint_for_a_known_distribution_that_is_not_installed(monkeypatch: Any) -> None:
    monkeypatch.setitem(plugins.KNOWN_PROVIDERS, "quantum", "speedtronic-quantum")
    hint = plugins.missing_provider_hint("quantum")
    assert hint == " (provided by speedtronic-quantum: pip install speedtronic-quantum)"


def test_hint_for_an_installed_distribution_that_does_not_provide_it(monkeypatch: Any) -> None:
    monkeypatch.setitem(plugins.KNOWN_PROVIDERS, "quantum", "pluggy")
    hint = plugins.missing_provider_hint("quantum")
    assert f"the installed version {pluggy.__version__} does not provide it" in hint
    assert "pip install --upgrade pluggy" in hint


def test_no_hint_for_names_nobody_provides() -> None:
    assert plugins.missing_provider_hint("definitely_not_a_section") == ""


def test_provider_tables_match_what_the_first_party_plugins_provide() -> None:
    """PROVIDED_SECTIONS / PROVIDED_MODELS say which distribution to install; they must list
    exactly what those distributions contribute, and the config reference page every section."""
    from speedtronic.config import plugin_sections

    manager = plugins.get_plugin_manager()
    by_distribution = {row.name: row.distribution for row in plugins.list_plugins()}
    sections: dict[str, str] = {}
    for name in plugin_sections():
        owner = next(
            plugin_name
            for plugin_name, contributed in plugins.call_each(manager.hook.config_sections, {})
            if contributed and name in contributed
        )
        sections[name] = by_distribution[owner]
    assert sections == plugins.PROVIDED_SECTIONS
    models = {
        model: by_distribution[name]
        for name, plugin in manager.list_name_plugin()
        for model in getattr(plugin, "MODEL_NAMES", ())
        if by_distribution.get(name, "").startswith("speedtronic-")
    }
    assert models == plugins.PROVIDED_MODELS
    assert not set(plugins.PROVIDED_SECTIONS) & set(plugins.PROVIDED_MODELS)
    page = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    for section, distribution in plugins.PROVIDED_SECTIONS.items():
        assert f"- `{section}`: from {distribution}" in page
