"""Weights round-trip through safetensors with the tied embedding/head intact."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, load_model, save_file, save_model


def _assert_same_model(loaded, original, tokens: torch.Tensor) -> None:
    assert loaded.output_weight is loaded.tok_emb.weight
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.eval()(tokens)["logits"], original.eval()(tokens)["logits"], rtol=0, atol=0
        )


def test_save_model_and_load_model_round_trip(make_model, tokens, tmp_path) -> None:
    original = make_model(seed=1)
    save_model(original, str(tmp_path / "model.safetensors"))
    fresh = make_model(seed=2)
    missing, unexpected = load_model(fresh, str(tmp_path / "model.safetensors"))
    assert not missing
    assert not unexpected
    _assert_same_model(fresh, original, tokens)


def test_state_dict_saves_with_save_file_and_loads_strictly(make_model, tokens, tmp_path) -> None:
    original = make_model(seed=1)
    save_file(original.state_dict(), str(tmp_path / "weights.safetensors"))
    stored = load_file(str(tmp_path / "weights.safetensors"))
    assert stored.keys() == original.state_dict().keys()
    fresh = make_model(seed=2)
    fresh.load_state_dict(stored, strict=True)
    _assert_same_model(fresh, original, tokens)


def test_file_written_by_save_model_loads_as_a_state_dict(make_model, tokens, tmp_path) -> None:
    original = make_model(seed=1)
    save_model(original, str(tmp_path / "model.safetensors"))
    fresh = make_model(seed=2)
    fresh.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)
    _assert_same_model(fresh, original, tokens)
