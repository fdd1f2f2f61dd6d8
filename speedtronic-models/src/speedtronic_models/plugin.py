"""Registers the models of ``speedtronic-models`` with Speedtronic: ``reference_transformer``
and ``hf_causal_lm`` through ``build_model``, and their Hugging Face exporters through
``export_model``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from speedtronic import hookimpl
from speedtronic_models.config import MODEL_NAME

HF_MODEL_NAME = "hf_causal_lm"
MODEL_NAMES = (MODEL_NAME, HF_MODEL_NAME)
HF_FORMAT = "hf"


@hookimpl
def build_model(name: str, params: dict[str, Any]) -> Any:
    """Build :class:`~speedtronic_models.ReferenceTransformer` for ``reference_transformer``
    and a ``transformers`` model for ``hf_causal_lm``; ``None`` for any other name so the next
    plugin is asked."""
    if name not in MODEL_NAMES:
        return None
    # Imported here: discovering plugins should not import torch (or transformers).
    if name == HF_MODEL_NAME:
        from speedtronic_models.hf import build_hf_causal_lm

        return build_hf_causal_lm(params)
    from speedtronic_models.model import ReferenceTransformer

    return ReferenceTransformer.from_params(params)


@hookimpl
def export_model(model: Any, format: str, directory: Path, info: dict[str, Any]) -> str | None:
    """Export to ``hf``: the reference transformer as a Llama folder, any ``transformers``
    model with its own ``save_pretrained``; ``None`` for other models and formats."""
    if format != HF_FORMAT:
        return None
    from speedtronic_models.hf import is_hf_model

    if is_hf_model(model):
        from speedtronic_models.hf import save_hf

        save_hf(model, directory)
        return type(model).__name__
    from speedtronic_models.model import ReferenceTransformer

    if isinstance(model, ReferenceTransformer):
        from speedtronic_models.export import write_llama

        write_llama(model, directory, info.get("eos_token_id"), info.get("bos_token_id"))
        return "LlamaForCausalLM"
    return None
