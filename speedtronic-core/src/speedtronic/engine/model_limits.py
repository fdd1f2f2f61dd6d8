"""A model's sequence length and vocabulary size, wherever the model keeps them."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["model_limits"]


def model_limits(model: nn.Module, params: dict[str, Any]) -> dict[str, int | None]:
    """The model's sequence length and vocabulary, for the data defaults: its own
    ``max_seq_len``/``vocab_size`` attributes, a Hugging Face ``config.max_position_embeddings``
    / ``config.vocab_size``, then the ``model`` section's ``max_seq_len``/``vocab_size``."""
    hf_config = getattr(model, "config", None)
    found: dict[str, int | None] = {}
    for key, attribute, hf_attribute in (
        ("seq_len", "max_seq_len", "max_position_embeddings"),
        ("vocab_size", "vocab_size", "vocab_size"),
    ):
        for value in (
            getattr(model, attribute, None),
            getattr(hf_config, hf_attribute, None),
            params.get(attribute),
        ):
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found[key] = value
                break
        else:
            found[key] = None
    return found
