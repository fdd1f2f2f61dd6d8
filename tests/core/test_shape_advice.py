"""The advisory startup warning about model sizes that tile poorly on tensor cores."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from speedtronic.engine.runtime import build_runtime
from speedtronic.engine.shape_advice import padded, shape_advice, warn_shape_advice
from speedtronic_models import ReferenceTransformer


def config(tmp_path: Path, d_model: int) -> dict[str, Any]:
    return {
        "run": {"max_steps": 1, "device": "cpu", "output_dir": str(tmp_path)},
        "model": {
            "name": "reference_transformer",
            "vocab_size": 256,
            "max_seq_len": 16,
            "n_layer": 1,
            "n_head": 2,
            "d_model": d_model,
        },
    }


def advice_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "speedtronic.shape_advice" and r.levelno == logging.WARNING
    ]


def test_d_model_100_warns_once_with_the_padded_size(caplog: pytest.LogCaptureFixture) -> None:
    model = ReferenceTransformer(vocab_size=256, max_seq_len=16, n_layer=1, n_head=2, d_model=100)
    with caplog.at_level(logging.WARNING, logger="speedtronic"):
        warn_shape_advice(model, {"d_model": 100}, device="cuda")
    (message,) = advice_warnings(caplog)  # one warning listing everything
    assert "model.d_model = 100 -> 128" in message
    # The fused QKV projection: (2 + 2 * 2 heads) * 50 channels = 300, not a multiple of 64.
    assert "300 (blocks.0.attn.qkv.out_features) -> 320" in message
    assert model.config.d_model == 100  # advisory only
    assert model.tok_emb.weight.shape == (256, 100)


def test_a_cpu_run_keeps_the_gpu_advice_to_debug(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Tensor-core tiling is GPU advice: a CPU run of the same d_model 100 stays quiet."""
    with caplog.at_level(logging.WARNING, logger="speedtronic"):
        runtime = build_runtime(config(tmp_path, 100), console=False)
    runtime.metrics.close()
    assert advice_warnings(caplog) == []


def test_d_model_128_is_quiet(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="speedtronic"):
        runtime = build_runtime(config(tmp_path, 128), console=False)
    runtime.metrics.close()
    assert advice_warnings(caplog) == []


def test_vocab_and_unnamed_layers_of_any_model() -> None:
    # GPT-2's shapes, on the meta device: the check reads shapes only, never weights.
    model = nn.Sequential(
        nn.Embedding(50257, 768, device="meta"),
        nn.Linear(768, 3000, device="meta"),
        nn.Linear(3000, 10, device="meta"),
    )
    advice = shape_advice(model, {"vocab_size": 50257})
    assert [(a.size, a.suggested, a.config_key) for a in advice] == [
        (3000, 3008, None),
        (50257, 50304, "vocab_size"),
    ]
    assert advice[0].layers == ("1.out_features", "2.in_features")
    # 10 is below one tile: too small for padding to matter, so not reported; 768 is fine.


def test_reference_smoke_shape_is_clean() -> None:
    model = ReferenceTransformer(
        vocab_size=256, max_seq_len=64, n_layer=2, n_head=4, n_kv_head=2, d_model=64
    )
    assert shape_advice(model) == []


def test_padded() -> None:
    assert [padded(n) for n in (1, 64, 65, 100, 128)] == [64, 64, 128, 128, 128]
