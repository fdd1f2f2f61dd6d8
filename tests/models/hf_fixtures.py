"""Tiny Hugging Face and reference-model runs shared by the transformers tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from speedtronic import SpeedtronicConfig

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 64,
    "max_position_embeddings": 16,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
TINY_GPT2 = {
    "model_type": "gpt2",
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "vocab_size": 64,
    "n_positions": 16,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "resid_pdrop": 0.0,
}
# A reference model with grouped-query attention, a byte-sized vocabulary and non-default
# rotary base and norm epsilon, so an export that dropped any of them would show.
TINY_REFERENCE = {
    "name": "reference_transformer",
    "vocab_size": 260,
    "max_seq_len": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_kv_head": 2,
    "d_model": 32,
    "rope_theta": 500_000.0,
    "norm_eps": 1e-6,
}


def run_config(output_dir: Path, model: dict[str, Any], **sections: Any) -> SpeedtronicConfig:
    """A short CPU run of ``model`` on the synthetic stream, checkpointing every 2 steps."""
    return SpeedtronicConfig.from_dict(run_dict(output_dir, model, **sections))


def run_dict(output_dir: Path, model: dict[str, Any], **sections: Any) -> dict[str, Any]:
    """The mapping :func:`run_config` validates (what a config file of it holds)."""
    data: dict[str, Any] = {
        "run": {"device": "cpu", "max_steps": 4, "output_dir": str(output_dir), "seed": 3},
        "model": model,
        "data": {"micro_batch_size": 4},
        "precision": {"mode": "fp32"},
        "optimizer": {"lr": 1e-2},
        "checkpoint": {"interval": 2, "keep_last": 5},
        "logging": {"log_every": 1, "progress": False},
    }
    for name, values in sections.items():
        if isinstance(values, dict):
            data.setdefault(name, {}).update(values)
        else:
            data[name] = values
    return data


def hf_model(config: dict[str, Any]) -> dict[str, Any]:
    """The ``model`` section of an ``hf_causal_lm`` built from ``config``."""
    return {"name": "hf_causal_lm", "config": dict(config)}
