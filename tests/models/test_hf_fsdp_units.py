"""``parallel.fsdp.units: auto`` on a Hugging Face causal LM: its decoder layers, found through
the model's own ``_no_split_modules`` (no list of known architectures in Speedtronic)."""

from __future__ import annotations

import pytest
from models.hf_fixtures import TINY_GPT2, TINY_LLAMA

pytest.importorskip("transformers")

from speedtronic.fsdp import find_units, state_bytes_per_rank
from speedtronic.registry import build_model_from_hook


@pytest.mark.parametrize(
    ("config", "layer"), [(TINY_LLAMA, "LlamaDecoderLayer"), (TINY_GPT2, "GPT2Block")]
)
def test_auto_units_are_the_decoder_layers(config: dict[str, object], layer: str) -> None:
    model = build_model_from_hook("hf_causal_lm", config=dict(config))
    units = find_units(model, "auto")
    assert len(units) == 2 and {type(u).__name__ for u in units} == {layer}
    estimate = state_bytes_per_rank(model, 2, "fsdp", units=units)
    full = state_bytes_per_rank(model, 2, "ddp")
    assert estimate.total < 0.55 * full.total
