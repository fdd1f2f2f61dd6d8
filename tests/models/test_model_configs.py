"""The shipped configs build the reference transformer they describe, through the plugin hook."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speedtronic import SpeedtronicConfig
from speedtronic.registry import build_model_from_hook
from speedtronic_models import ReferenceTransformer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize(
    ("name", "params_millions", "ffn_hidden"),
    [("smoke.yaml", 0.115, 192), ("reference-small.yaml", 40.4, 1408)],
)
def test_shipped_config_builds_the_documented_model(
    name: str, params_millions: float, ffn_hidden: int
) -> None:
    config = SpeedtronicConfig.from_file(CONFIGS / name)
    assert config.model.name == "reference_transformer"
    # Meta tensors: the 40M-parameter GPU model is sized without allocating its weights.
    with torch.device("meta"):
        model = build_model_from_hook(config.model.name, **config.model.params)
    assert isinstance(model, ReferenceTransformer)
    assert model.config.ffn_hidden == ffn_hidden
    count = sum(p.numel() for p in model.parameters()) / 1e6
    assert count == pytest.approx(params_millions, rel=0.01)
