"""Parameter validation and registration through the ``speedtronic`` entry-point group."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields
from importlib import metadata
from pathlib import Path

import pluggy
import pytest

from speedtronic import ConfigError, hookspecs
from speedtronic.schema import Section, section_to_dict
from speedtronic_models import ReferenceTransformer, TransformerConfig
from speedtronic_models.config import default_ffn_hidden


def test_optional_params_get_documented_defaults(tiny_params: dict) -> None:
    config = TransformerConfig.from_params({**tiny_params, "n_kv_head": None})
    assert config.n_kv_head == tiny_params["n_head"]
    assert config.ffn_hidden == default_ffn_hidden(tiny_params["d_model"])
    assert config.dropout == 0.0
    assert config.rope_theta == 10_000.0


@pytest.mark.parametrize(
    ("d_model", "expected"),
    [(64, 192), (256, 704), (512, 1408), (768, 2048)],
)
def test_default_ffn_hidden_is_eight_thirds_rounded_to_64(d_model: int, expected: int) -> None:
    assert default_ffn_hidden(d_model) == expected


@pytest.mark.parametrize(
    ("overrides", "path", "words"),
    [
        ({"d_model": 30, "n_head": 4}, "model.n_head", ["d_model (30)", "n_head (4)"]),
        ({"n_head": 4, "n_kv_head": 3}, "model.n_kv_head", ["n_head (4)", "n_kv_head (3)"]),
        ({"d_model": 12, "n_head": 4, "n_kv_head": 1}, "model.n_head", ["even", "rotary"]),
        ({"n_layer": 0}, "model.n_layer", [">= 1", "got 0"]),
        ({"vocab_size": -5}, "model.vocab_size", [">= 1", "got -5"]),
        ({"n_kv_head": 0}, "model.n_kv_head", [">= 1"]),
        ({"max_seq_len": 16.5}, "model.max_seq_len", ["expected an integer", "16.5"]),
        ({"n_layer": "two"}, "model.n_layer", ["expected an integer", "'two'"]),
        ({"n_head": True}, "model.n_head", ["expected an integer", "True"]),
        ({"ffn_hidden": 0}, "model.ffn_hidden", [">= 1"]),
        ({"dropout": 1.0}, "model.dropout", ["< 1"]),
        ({"dropout": -0.1}, "model.dropout", [">= 0"]),
        ({"rope_theta": 0}, "model.rope_theta", ["> 0"]),
        ({"norm_eps": "tiny"}, "model.norm_eps", ["number"]),
    ],
)
def test_bad_params_raise_one_error_naming_them(
    overrides: dict, path: str, words: list[str], tiny_params: dict
) -> None:
    with pytest.raises(ConfigError) as caught:
        ReferenceTransformer.from_params({**tiny_params, **overrides})
    assert caught.value.path == path
    message = str(caught.value)
    assert message.startswith(path)
    for word in words:
        assert word in message


def test_values_are_coerced_as_core_coerces_them(tiny_params: dict) -> None:
    # The same rules as every core section: an integral float or a numeric string is an int.
    config = TransformerConfig.from_params(
        {**tiny_params, "max_seq_len": 16.0, "n_layer": "3", "dropout": "0.1", "rope_theta": 500}
    )
    assert (config.max_seq_len, config.n_layer) == (16, 3)
    assert type(config.max_seq_len) is int and type(config.n_layer) is int
    assert config.dropout == 0.1 and type(config.rope_theta) is float
    model = ReferenceTransformer.from_params({**tiny_params, "max_seq_len": 16.0})
    assert model.max_seq_len == 16 and type(model.max_seq_len) is int


def test_unknown_param_suggests_the_close_one_and_lists_the_known_ones(tiny_params: dict) -> None:
    with pytest.raises(ConfigError) as caught:
        ReferenceTransformer.from_params({**tiny_params, "n_heads": 4})
    assert caught.value.path == "model.n_heads"
    message = str(caught.value)
    assert "did you mean 'n_head'?" in message
    assert "n_kv_head" in message and "rope_theta" in message
    with pytest.raises(ConfigError) as caught:
        ReferenceTransformer.from_params({**tiny_params, "bias": True})
    assert caught.value.path == "model.bias" and "did you mean" not in str(caught.value)


def test_params_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError) as caught:
        TransformerConfig.from_params([("d_model", 32)])  # type: ignore[arg-type]
    assert caught.value.path == "model" and "mapping" in str(caught.value)


def test_the_params_are_a_core_section(tiny_params: dict) -> None:
    config = TransformerConfig.from_params(tiny_params)
    assert isinstance(config, Section)
    assert section_to_dict(config) == {
        **tiny_params,
        "ffn_hidden": default_ffn_hidden(tiny_params["d_model"]),
        "dropout": 0.0,
        "rope_theta": 10_000.0,
        "norm_eps": 1e-5,
    }
    for field in fields(TransformerConfig):
        assert field.metadata["help"], f"{field.name} has no help text"
    # Frozen: a built config cannot drift from the model it describes.
    with pytest.raises(FrozenInstanceError):
        config.n_layer = 3  # type: ignore[misc]


def test_missing_required_param_is_named(tiny_params: dict) -> None:
    params = tiny_params
    del params["d_model"]
    with pytest.raises(ConfigError) as caught:
        ReferenceTransformer.from_params(params)
    assert caught.value.path == "model.d_model"
    assert "missing" in str(caught.value)


def test_direct_construction_validates_too(tiny_params: dict) -> None:
    with pytest.raises(ConfigError, match="n_kv_head"):
        ReferenceTransformer(**{**tiny_params, "n_kv_head": 3})


def _plugin_manager_with_entry_point() -> pluggy.PluginManager:
    # A private manager: the test sees exactly this entry point, whatever else is installed.
    (entry_point,) = [
        ep
        for ep in metadata.entry_points(group="speedtronic")
        if ep.name == "reference_transformer"
    ]
    assert entry_point.dist is not None
    assert entry_point.dist.name == "speedtronic-models"
    manager = pluggy.PluginManager("speedtronic")
    manager.add_hookspecs(hookspecs)
    plugin = entry_point.load()
    manager.register(plugin, name=entry_point.name)
    assert "reference_transformer" in plugin.MODEL_NAMES
    return manager


def test_entry_point_builds_the_model_through_the_hook(tiny_params: dict) -> None:
    manager = _plugin_manager_with_entry_point()
    model = manager.hook.build_model(name="reference_transformer", params=dict(tiny_params))
    assert isinstance(model, ReferenceTransformer)
    assert model.vocab_size == tiny_params["vocab_size"]
    assert manager.hook.build_model(name="someone_elses_model", params={}) is None


def test_hook_reports_bad_params_as_config_errors(tiny_params: dict) -> None:
    manager = _plugin_manager_with_entry_point()
    with pytest.raises(ConfigError) as caught:
        manager.hook.build_model(
            name="reference_transformer", params={**tiny_params, "n_head": 3, "n_kv_head": 3}
        )
    assert caught.value.path == "model.n_head"


def test_the_docs_table_lists_every_param() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    table = page.split("## Parameters", 1)[1].split("\n## ", 1)[0]
    for field in fields(TransformerConfig):
        assert f"| `{field.name}` |" in table, f"model.{field.name} is not documented"
