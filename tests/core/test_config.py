"""SpeedtronicConfig: sources, output, redaction, strictness, coercion, bounds, aliases, plugin
sections, and the error messages users see."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from speedtronic import hookimpl, plugins
from speedtronic.config import SpeedtronicConfig, plugin_sections
from speedtronic.engine.parts import accumulation_steps
from speedtronic.errors import ConfigError, PluginError
from speedtronic.schema import REDACTED, Section, option

SAMPLE = {
    "name": "sample",
    "max_steps": 7,
    "model": {"name": "some_model", "width": 16},
    "data": {"micro_batch_size": 4, "target_batch_size": 8},
    "optimizer": {"lr": 1e-3, "betas": [0.8, 0.9]},
    "checkpoint": {"interval": 2, "keep_last": 1},
    "logging": {"log_every": 1, "json_file": "metrics.jsonl"},
}


def error_of(data: Any) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        SpeedtronicConfig.from_dict(data)
    return caught.value


# ---------------------------------------------------------------- sections and sources


def test_defaults_cover_every_section_of_the_issue() -> None:
    config = SpeedtronicConfig.from_dict({})
    assert (config.run.name, config.run.seed, config.run.device) == ("speedtronic", 0, "auto")
    assert (config.run.max_steps, config.run.output_dir) == (100, "runs/speedtronic")
    assert config.model.name == "reference_transformer" and config.model.params == {}
    assert accumulation_steps(config) == 1
    assert config.optimizer.lr > 0 and config.scheduler.name == "cosine"
    assert config.precision.mode == "auto" and config.compile.enabled is False
    assert config.gradient_checkpointing is False
    checkpoint = config.checkpoint
    assert (checkpoint.directory, checkpoint.interval, checkpoint.resume) == (None, 0, False)
    assert checkpoint.keep_last >= 1
    logging = config.logging
    assert (logging.level, logging.file, logging.json_file, logging.hooks) == (
        "INFO",
        None,
        None,
        [],
    )
    assert logging.log_every >= 1
    assert config.checkpoint_dir == Path("runs/speedtronic/checkpoints")


def test_every_source_gives_the_same_config(tmp_path: Path) -> None:
    expected = SpeedtronicConfig.from_dict(SAMPLE)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(SAMPLE))
    (tmp_path / "c.yml").write_text(yaml.safe_dump(SAMPLE))
    (tmp_path / "c.json").write_text(json.dumps(SAMPLE))
    loaded = [
        SpeedtronicConfig.from_yaml(tmp_path / "c.yaml"),
        SpeedtronicConfig.from_json(tmp_path / "c.json"),
        SpeedtronicConfig.from_file(tmp_path / "c.yml"),
        SpeedtronicConfig.from_file(tmp_path / "c.json"),
        SpeedtronicConfig.from_string(yaml.safe_dump(SAMPLE)),
        SpeedtronicConfig.from_string(json.dumps(SAMPLE)),
        SpeedtronicConfig.load(SAMPLE),
        SpeedtronicConfig.load(tmp_path / "c.yaml"),
        SpeedtronicConfig.load(str(tmp_path / "c.json")),
        SpeedtronicConfig.load(json.dumps(SAMPLE)),
        SpeedtronicConfig.load(expected),
    ]
    for config in loaded:
        assert config == expected
    assert expected.run.name == "sample" and accumulation_steps(expected) == 2
    assert expected.model.params == {"width": 16}
    assert expected.optimizer.betas == (0.8, 0.9)


def test_to_dict_to_yaml_and_to_json_round_trip() -> None:
    config = SpeedtronicConfig.from_dict(SAMPLE)
    assert SpeedtronicConfig.from_dict(config.to_dict()) == config
    assert SpeedtronicConfig.from_string(config.to_yaml()) == config
    assert SpeedtronicConfig.from_string(config.to_json()) == config
    data = config.to_dict()
    assert data["run"]["max_steps"] == 7 and data["model"] == {"name": "some_model", "width": 16}
    assert data["optimizer"]["betas"] == [0.8, 0.9]  # YAML-safe: lists, not tuples
    yaml.safe_dump(data)


def test_model_params_may_be_nested_under_params() -> None:
    config = SpeedtronicConfig.from_dict({"model": {"name": "m", "params": {"width": 3}}})
    assert config.model.params == {"width": 3}
    error = error_of({"model": {"name": "m", "width": 1, "params": {"width": 2}}})
    assert error.path == "model.width"
    # A scalar model parameter that happens to be called `params` is kept, not dropped.
    assert SpeedtronicConfig.from_dict({"model": {"params": 5}}).model.params == {"params": 5}


# ---------------------------------------------------------------- strictness


def test_unknown_top_level_key_names_it_and_suggests() -> None:
    error = error_of({"optimiser": {"lr": 1.0}})
    assert str(error) == "optimiser: unknown key; did you mean 'optimizer'?"


def test_unknown_nested_key_has_its_dotted_path() -> None:
    assert str(error_of({"data": {"micro_batch": 2}})) == (
        "data.micro_batch: unknown key; did you mean 'micro_batch_size'?"
    )
    assert str(error_of({"optimizer": {"muon": {"momentun": 0.9}}})) == (
        "optimizer.muon.momentun: unknown key; did you mean 'momentum'?"
    )
    assert str(error_of({"checkpoint": {"zzz": 1}})) == "checkpoint.zzz: unknown key"


def test_section_of_a_missing_distribution_says_what_to_install(monkeypatch: Any) -> None:
    monkeypatch.setitem(plugins.KNOWN_PROVIDERS, "quantum", "speedtronic-quantum")
    error = error_of({"quantum": {"qubits": 3}})
    assert str(error) == (
        "quantum: unknown key (provided by speedtronic-quantum: pip install speedtronic-quantum)"
    )


def test_section_must_be_a_mapping() -> None:
    assert str(error_of({"data": 3})) == "data: expected a mapping, got int"
    assert str(error_of({"model": "gpt"})) == "model: expected a mapping, got str"
    with pytest.raises(ConfigError, match="root must be a mapping"):
        SpeedtronicConfig.from_string("- a\n- b\n")


# ---------------------------------------------------------------- coercion and bounds


@pytest.mark.parametrize(
    ("text", "expected"),
    [("false", False), ("False", False), ("no", False), ("0", False), ("true", True),
     ("yes", True), ("on", True), (True, True), (0, False)],
)  # fmt: skip
def test_booleans_are_parsed_from_strings(text: Any, expected: bool) -> None:
    config = SpeedtronicConfig.from_dict(
        {"compile": {"enabled": text}, "gradient_checkpointing": text}
    )
    assert config.compile.enabled is expected
    assert config.gradient_checkpointing is expected


@pytest.mark.parametrize("garbage", ["maybe", "", 2, [True]])
def test_garbage_booleans_are_errors(garbage: Any) -> None:
    error = error_of({"checkpoint": {"resume": garbage}})
    assert error.path == "checkpoint.resume"
    assert "expected a boolean" in str(error)
    assert error_of({"gradient_checkpointing": garbage}).path == "gradient_checkpointing"


def test_numbers_are_parsed_from_strings() -> None:
    config = SpeedtronicConfig.from_dict(
        {"run": {"max_steps": "12", "seed": "3"}, "optimizer": {"lr": "3e-4"}}
    )
    assert (config.run.max_steps, config.run.seed, config.optimizer.lr) == (12, 3, 3e-4)
    assert str(error_of({"run": {"max_steps": "many"}})) == (
        "run.max_steps: expected an integer, got 'many'"
    )
    assert str(error_of({"run": {"max_steps": 2.5}})) == (
        "run.max_steps: expected an integer, got 2.5"
    )
    assert error_of({"run": {"seed": True}}).path == "run.seed"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"data": {"micro_batch_size": 0}}, "data.micro_batch_size: must be >= 1 (got 0)"),
        ({"data": {"target_batch_size": 0}}, "data.target_batch_size: must be >= 1 (got 0)"),
        (
            {"data": {"micro_batch_size": 4, "target_batch_size": 10}},
            "data.target_batch_size: must be a multiple of micro_batch_size (4), got 10",
        ),
        ({"optimizer": {"lr": 0}}, "optimizer.lr: must be > 0 (got 0.0)"),
        ({"optimizer": {"lr": -1e-3}}, "optimizer.lr: must be > 0 (got -0.001)"),
        (
            {"optimizer": {"betas": [0.9, 1.0]}},
            "optimizer.betas[1]: each beta must be in [0, 1), got 1.0",
        ),
        ({"optimizer": {"betas": [0.9]}}, "optimizer.betas: expected 2 items, got 1"),
        (
            {"optimizer": {"muon": {"momentum": 1}}},
            "optimizer.muon.momentum: must be < 1 (got 1.0)",
        ),
        ({"scheduler": {"min_lr_ratio": 1.5}}, "scheduler.min_lr_ratio: must be <= 1 (got 1.5)"),
        ({"run": {"max_steps": 0}}, "run.max_steps: must be >= 1 (got 0)"),
        ({"checkpoint": {"keep_last": 0}}, "checkpoint.keep_last: must be >= 1 (got 0)"),
        ({"logging": {"log_every": 0}}, "logging.log_every: must be >= 1 (got 0)"),
    ],
)  # fmt: skip
def test_numbers_are_range_checked(data: dict[str, Any], message: str) -> None:
    assert str(error_of(data)) == message


def test_choices_are_checked_with_a_suggestion() -> None:
    assert str(error_of({"run": {"device": "cuad"}})) == (
        "run.device: must be one of 'auto', 'cpu', 'cuda', 'mps' (got 'cuad'); did you mean 'cuda'?"
    )
    assert "did you mean 'INFO'?" in str(error_of({"logging": {"level": "info"}}))
    assert error_of({"precision": {"mode": "fp8"}}).path == "precision.mode"


def test_lists_and_strings_are_type_checked() -> None:
    assert error_of({"logging": {"hooks": "pkg:hook"}}).path == "logging.hooks"
    assert error_of({"run": {"name": ["a"]}}).path == "run.name"
    config = SpeedtronicConfig.from_dict({"run": {"name": 42}})
    assert config.run.name == "42"  # a number is a fine name


# ---------------------------------------------------------------- aliases and overrides


def test_top_level_aliases_map_to_run() -> None:
    config = SpeedtronicConfig.from_dict(
        {"name": "n", "max_steps": 5, "output_dir": "o", "seed": 9, "device": "cpu"}
    )
    assert (config.run.name, config.run.max_steps, config.run.output_dir) == ("n", 5, "o")
    assert (config.run.seed, config.run.device) == (9, "cpu")
    assert "name" not in config.to_dict()  # written back in canonical form
    error = error_of({"max_steps": 5, "run": {"max_steps": 6}})
    assert str(error) == "max_steps: given both as `max_steps` and `run.max_steps`"


def test_overrides_set_dotted_keys_parsed_as_yaml() -> None:
    base = SpeedtronicConfig.from_dict(SAMPLE)
    config = base.with_overrides(
        ["data.micro_batch_size=2", "compile.enabled=true", "max_steps=3", "model.width=8",
         "logging.hooks=[a:b]", "run.name=with=equals", "checkpoint.directory="]
    )  # fmt: skip
    assert config.data.micro_batch_size == 2 and config.compile.enabled is True
    assert config.run.max_steps == 3 and config.model.params["width"] == 8
    assert config.logging.hooks == ["a:b"] and config.run.name == "with=equals"
    assert config.checkpoint.directory == ""
    assert base.data.micro_batch_size == 4  # the original is untouched
    assert base.with_overrides({"optimizer.lr": 0.5}).optimizer.lr == 0.5


def test_bad_overrides_name_the_key() -> None:
    base = SpeedtronicConfig.from_dict({})
    with pytest.raises(ConfigError, match=r"override 'oops' must look like dotted.key=value"):
        base.with_overrides(["oops"])
    with pytest.raises(ConfigError) as caught:
        base.with_overrides(["data.micro_bach_size=3"])
    assert str(caught.value) == (
        "data.micro_bach_size: unknown key; did you mean 'micro_batch_size'?"
    )
    with pytest.raises(ConfigError) as caught:
        base.with_overrides(["run.name.first=x"])
    assert caught.value.path == "run.name"
    with pytest.raises(ConfigError) as caught:
        base.with_overrides(["data.micro_batch_size=lots"])
    assert caught.value.path == "data.micro_batch_size"


# ---------------------------------------------------------------- files and parse errors


def test_missing_and_unreadable_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config file not found: .*nope\.yaml"):
        SpeedtronicConfig.from_file(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="cannot read config file"):
        SpeedtronicConfig.from_file(tmp_path)


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("run:\n  name: x\n max_steps: 3\n")
    with pytest.raises(ConfigError) as caught:
        SpeedtronicConfig.from_file(path)
    message = str(caught.value)
    assert message.startswith(f"cannot parse {path}: ")
    assert "(line 3, column 2)" in message and "\n" not in message


def test_json_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"run": {"name": "x",}}')
    with pytest.raises(ConfigError, match=r"cannot parse .*bad\.json: .*line 1 column"):
        SpeedtronicConfig.from_file(path)


def test_duplicate_yaml_keys_are_errors() -> None:
    with pytest.raises(ConfigError, match="duplicate key 'lr' at line 3, column 3"):
        SpeedtronicConfig.from_string("optimizer:\n  lr: 1.0\n  lr: 2.0\n")


def test_empty_file_is_all_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    assert SpeedtronicConfig.from_file(path) == SpeedtronicConfig.from_dict({})


# ---------------------------------------------------------------- plugin sections, secrets


@dataclass
class VaultConfig(Section):
    """A plugin section with a secret, as a plugin would contribute it."""

    url: str = option("https://vault.invalid", help="Where the vault is.")
    token: str | None = option(None, secret=True, help="Access token.")
    retries: int = option(2, ge=0, help="How often to retry.")
    verify: bool = option(True, help="Check certificates.")


@dataclass
class RequiredConfig(Section):
    """A plugin section with a field that has no default."""

    endpoint: str = option(help="Required.")


class VaultPlugin:
    @hookimpl
    def config_sections(self) -> dict[str, type]:
        return {"vault": VaultConfig, "needs": RequiredConfig}


@pytest.fixture
def vault_plugin() -> Any:
    name = plugins.register(VaultPlugin(), name="core-test-vault")
    yield name
    plugins.unregister(name)


def test_plugin_section_is_validated_like_core(vault_plugin: str) -> None:
    config = SpeedtronicConfig.from_dict(
        {
            "vault": {"token": "s3cret", "retries": "4", "verify": "false"},
            "needs": {"endpoint": "e"},
        }
    )
    assert isinstance(config.vault, VaultConfig) and config.plugins["vault"] is config.vault
    assert (config.vault.token, config.vault.retries, config.vault.verify) == ("s3cret", 4, False)
    assert str(error_of({"vault": {"tokn": "x"}, "needs": {"endpoint": "e"}})) == (
        "vault.tokn: unknown key; did you mean 'token'?"
    )
    assert str(error_of({"vault": {"retries": -1}, "needs": {"endpoint": "e"}})) == (
        "vault.retries: must be >= 0 (got -1)"
    )
    assert str(error_of({"vault": {}})) == "needs.endpoint: required key is missing"


def test_secrets_are_redacted_when_saved_and_shown(vault_plugin: str, tmp_path: Path) -> None:
    config = SpeedtronicConfig.from_dict({"vault": {"token": "s3cret"}, "needs": {"endpoint": "e"}})
    assert config.to_dict()["vault"]["token"] == "s3cret"
    assert config.to_dict(redact=True)["vault"]["token"] == REDACTED == "<redacted>"
    for name in ("saved.yaml", "saved.json"):
        path = config.save(tmp_path / name)
        text = path.read_text()
        assert "s3cret" not in text and "<redacted>" in text
        reloaded = SpeedtronicConfig.from_file(path)
        assert reloaded.vault.token == "<redacted>" and reloaded.vault.url == config.vault.url
    assert "s3cret" not in config.to_yaml(redact=True) + config.to_json(redact=True)
    # An unset secret stays null: there is nothing to hide.
    unset = SpeedtronicConfig.from_dict({"needs": {"endpoint": "e"}})
    assert unset.to_dict(redact=True)["vault"]["token"] is None


def test_overrides_keep_secrets(vault_plugin: str) -> None:
    config = SpeedtronicConfig.from_dict({"vault": {"token": "t"}, "needs": {"endpoint": "e"}})
    assert config.with_overrides(["vault.retries=1"]).vault.token == "t"


def test_missing_plugin_section_attribute_is_an_attribute_error() -> None:
    config = SpeedtronicConfig.from_dict({})
    with pytest.raises(AttributeError, match="no section 'vault'"):
        _ = config.vault


def test_configs_copy_and_pickle(vault_plugin: str) -> None:
    config = SpeedtronicConfig.from_dict({"vault": {"token": "t"}, "needs": {"endpoint": "e"}})
    assert copy.deepcopy(config) == config
    assert pickle.loads(pickle.dumps(config)).vault.token == "t"


def test_installed_plugins_declare_their_credentials_secret() -> None:
    # A safety net for every installed plugin: a credential-looking field must be redacted.
    for section, cls in plugin_sections().items():
        for field in dataclasses.fields(cls):
            if any(word in field.name for word in ("token", "password", "secret", "api_key")):
                assert field.metadata.get("secret"), f"{section}.{field.name} is not secret=True"


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"run": VaultConfig}, "would redefine a core key"),
        ({"max_steps": VaultConfig}, "would redefine a core key"),
        ({"vault": dict}, "must be a dataclass type"),
    ],
)
def test_bad_plugin_sections_are_plugin_errors(sections: dict[str, type], message: str) -> None:
    class BadSections:
        @hookimpl
        def config_sections(self) -> dict[str, type]:
            return sections

    name = plugins.register(BadSections(), name="core-test-bad-sections")
    try:
        with pytest.raises(PluginError, match=rf"plugin 'core-test-bad-sections'.*{message}"):
            SpeedtronicConfig.from_dict({})
    finally:
        plugins.unregister(name)


def test_two_plugins_cannot_contribute_the_same_section(vault_plugin: str) -> None:
    class Again:
        @hookimpl
        def config_sections(self) -> dict[str, type]:
            return {"vault": RequiredConfig}

    name = plugins.register(Again(), name="core-test-again")
    try:
        with pytest.raises(PluginError, match="'vault' is also contributed by plugin"):
            SpeedtronicConfig.from_dict({})
    finally:
        plugins.unregister(name)
