"""Parameter validation and registration through the ``speedtronic`` entry-point group."""

from __future__ import annotations

from importlib import metadata

import pluggy
import pytest

from speedtronic import ConfigError, hookspecs
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
        ({"n_layer": 0}, "model.n_layer", ["positive"]),
        ({"vocab_size": -5}, "model.vocab_size", ["positive"]),
        ({"max_seq_len": 16.0}, "model.max_seq_len", ["integer", "float"]),
        ({"n_head": True}, "model.n_head", ["integer", "bool"]),
        ({"ffn_hidden": 0}, "model.ffn_hidden", ["positive"]),
        ({"dropout": 1.0}, "model.dropout", ["[0, 1)"]),
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


def test_unknown_param_is_named_with_the_known_ones(tiny_params: dict) -> None:
    with pytest.raises(ConfigError) as caught:
        ReferenceTransformer.from_params({**tiny_params, "n_heads": 4})
    assert caught.value.path == "model.n_heads"
    assert "n_kv_head" in str(caught.value)


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
