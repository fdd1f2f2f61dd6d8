"""Advisory check of model dimensions against what GPU tensor cores tile well.

Matrix multiplies run fastest when every dimension is a multiple of the kernel's tile; sizes just
past a multiple waste a partial tile (a vocabulary of 50257 padded to 50304 is the well-known
example). At startup :func:`warn_shape_advice` logs one warning listing the weight dimensions of
``nn.Linear`` and ``nn.Embedding`` layers that are not multiples of :data:`TILE`, each with the
next multiple. It is advice only: the model is never changed, and padding is not guaranteed to
speed anything up (small models are bound by other costs). Dimensions below one tile are
skipped: they are too small for tiling to matter.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = [
    "SIZE_KEYS",
    "TILE",
    "ShapeAdvice",
    "layer_dims",
    "padded",
    "shape_advice",
    "warn_shape_advice",
]

log = logging.getLogger("speedtronic.shape_advice")

TILE = 64
# Config keys that name hidden sizes or the vocabulary, so advice can point at the line to edit.
SIZE_KEYS = (
    "vocab_size",
    "d_model",
    "hidden_size",
    "n_embd",
    "dim",
    "embed_dim",
    "ffn_hidden",
    "intermediate_size",
    "d_ff",
)
_SHOWN_LAYERS = 3


@dataclass(frozen=True)
class ShapeAdvice:
    """One poorly tiling size: where it appears and the padded size to consider."""

    size: int
    suggested: int
    config_key: str | None = None
    layers: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        """``model.d_model = 100 -> 128`` or ``300 (blocks.0.attn.qkv.out_features) -> 320``."""
        if self.config_key:
            return f"model.{self.config_key} = {self.size} -> {self.suggested}"
        shown = ", ".join(self.layers[:_SHOWN_LAYERS])
        more = (
            f", +{len(self.layers) - _SHOWN_LAYERS} more"
            if len(self.layers) > _SHOWN_LAYERS
            else ""
        )
        return f"{self.size} ({shown}{more}) -> {self.suggested}"


def padded(size: int, multiple: int = TILE) -> int:
    """The smallest multiple of ``multiple`` that is >= ``size``."""
    return -(-size // multiple) * multiple


def layer_dims(model: nn.Module) -> dict[int, list[str]]:
    """Each weight dimension of the model's Linear and Embedding layers -> where it occurs."""
    found: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        label = name or type(model).__name__
        if isinstance(module, nn.Linear):
            dims = (("in_features", module.in_features), ("out_features", module.out_features))
        elif isinstance(module, nn.Embedding):
            dims = (
                ("num_embeddings", module.num_embeddings),
                ("embedding_dim", module.embedding_dim),
            )
        else:
            continue
        for attribute, size in dims:
            found.setdefault(size, []).append(f"{label}.{attribute}")
    return found


def shape_advice(
    model: nn.Module, model_params: Mapping[str, Any] | None = None, tile: int = TILE
) -> list[ShapeAdvice]:
    """The model's layer dimensions (>= ``tile``) that are not multiples of ``tile``.

    A size that equals a hidden-size key of ``model_params`` (the config's ``model`` section)
    is reported under that key; any other is reported with the layers it appears in.
    """
    params = model_params or {}
    named = {
        value: key
        for key in SIZE_KEYS
        if isinstance(value := params.get(key), int) and not isinstance(value, bool)
    }
    advice = []
    for size, layers in sorted(layer_dims(model).items()):
        if size < tile or size % tile == 0:
            continue
        advice.append(ShapeAdvice(size, padded(size, tile), named.get(size), tuple(layers)))
    return advice


def warn_shape_advice(
    model: nn.Module, model_params: Mapping[str, Any] | None = None, device: Any = None
) -> list[ShapeAdvice]:
    """Log one warning listing :func:`shape_advice` for ``model`` (nothing if all is well).

    ``model_params`` is the config's ``model`` section when the model was built from it.
    ``device`` is where the model will run: tensor-core tiling is GPU advice, so for any
    device other than CUDA the list is logged at debug level only.
    """
    advice = shape_advice(model, model_params)
    if advice and device is not None and getattr(device, "type", device) != "cuda":
        log.debug(
            "model sizes that would tile poorly on GPU tensor cores (not shown on %s): %s",
            getattr(device, "type", device),
            "; ".join(item.describe() for item in advice),
        )
    elif advice:
        log.warning(
            "model sizes that tile poorly on GPU tensor cores (not multiples of %d; advisory, "
            "the model is unchanged, and padding may not speed up a small model): %s",
            TILE,
            "; ".join(item.describe() for item in advice),
        )
    return advice
