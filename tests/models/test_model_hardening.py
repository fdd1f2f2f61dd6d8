"""Regression tests for the third fault-injection pass (issue 34) on ``init_from``: NaN and
infinite config values never pass a comparison, non-finite weights (also after the cast to
the model's dtype) are refused, and each JSON file of a model folder is bounded by what a real
one needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from models.hf_fixtures import TINY_REFERENCE
from safetensors.torch import load_file, save_file

import speedtronic
from speedtronic import ConfigError
from speedtronic_models.export import write_llama


def folder_of(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    write_llama(speedtronic.build_model(**TINY_REFERENCE), tmp_path)
    return tmp_path


def edit_config(folder: Path, text: str) -> None:
    (folder / "config.json").write_text(text)


def init_from(folder: Path) -> pytest.ExceptionInfo[ConfigError]:
    with pytest.raises(ConfigError) as caught:
        speedtronic.build_model(**TINY_REFERENCE, init_from=str(folder))
    assert caught.value.path == "model.init_from"
    return caught


def test_the_folder_loads_as_written(tmp_path: Path) -> None:
    speedtronic.build_model(**TINY_REFERENCE, init_from=str(folder_of(tmp_path)))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("rope_theta", "NaN"),
        ("rope_theta", "Infinity"),
        ("rms_norm_eps", "NaN"),
        ("rms_norm_eps", "-Infinity"),
    ],
)
def test_nan_and_infinite_config_values_are_refused(tmp_path: Path, key: str, value: str) -> None:
    folder = folder_of(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters")  # so rope_theta itself is what is read
    config[key] = "PLACEHOLDER"
    edit_config(folder, json.dumps(config).replace('"PLACEHOLDER"', value))
    message = str(init_from(folder).value)
    assert value in message and "config.json" in message


def test_a_nan_rope_theta_that_json_cannot_spell_still_mismatches() -> None:
    from speedtronic_models.export import _mismatches, llama_config

    ours = speedtronic.build_model(**TINY_REFERENCE).config
    theirs = llama_config(ours)
    theirs["rope_parameters"]["rope_theta"] = float("nan")
    theirs["rms_norm_eps"] = float("nan")
    found = " ".join(_mismatches(theirs, ours))
    assert "rope_theta nan" in found and "rms_norm_eps nan" in found


@pytest.mark.parametrize("poison", ["nan", "inf", "float64 1e300"])
def test_non_finite_weights_are_refused(tmp_path: Path, poison: str) -> None:
    folder = folder_of(tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    if poison == "float64 1e300":  # finite in the file, infinite in a float32 model
        tensors[name] = torch.full_like(tensors[name], 1e300, dtype=torch.float64)
    else:
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[3] = float(poison)
    save_file(tensors, str(folder / "model.safetensors"))
    message = str(init_from(folder).value)
    assert "non-finite" in message and name in message


@pytest.mark.parametrize(
    ("file", "size_mib"), [("config.json", 2), ("model.safetensors.index.json", 20)]
)
def test_json_files_are_bounded_by_what_a_real_one_needs(
    tmp_path: Path, file: str, size_mib: int
) -> None:
    folder = folder_of(tmp_path)
    if file != "config.json":
        (folder / "model.safetensors").rename(folder / "shard-1.safetensors")
    padding = " " * (size_mib << 20)
    document = {"weight_map": {"model.norm.weight": "shard-1.safetensors"}}
    if file == "config.json":
        document = json.loads((folder / "config.json").read_text())
    (folder / file).write_text(json.dumps(document) + padding)
    message = str(init_from(folder).value)
    assert file in message and "larger than" in message
