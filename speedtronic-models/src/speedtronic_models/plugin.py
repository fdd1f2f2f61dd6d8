"""Registers the reference transformer with Speedtronic through the ``build_model`` hook."""

from __future__ import annotations

from typing import Any

from speedtronic import hookimpl
from speedtronic_models.config import MODEL_NAME

MODEL_NAMES = (MODEL_NAME,)


@hookimpl
def build_model(name: str, params: dict[str, Any]) -> Any:
    """Build :class:`~speedtronic_models.ReferenceTransformer` for ``reference_transformer``;
    ``None`` for any other name so the next plugin is asked."""
    if name not in MODEL_NAMES:
        return None
    # Imported here: discovering plugins should not import torch.
    from speedtronic_models.model import ReferenceTransformer

    return ReferenceTransformer.from_params(params)
