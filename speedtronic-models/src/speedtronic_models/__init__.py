"""The reference transformer for Speedtronic, registered as model ``reference_transformer``
(with ``hf_causal_lm``, any ``transformers`` causal LM, when the ``transformers`` extra is in).

Names resolve on first use so that plugin discovery (which imports
:mod:`speedtronic_models.plugin`) does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from speedtronic_models.config import TransformerConfig
    from speedtronic_models.kv_cache import KVCache
    from speedtronic_models.model import ReferenceTransformer

__version__ = "0.1.0"
__all__ = ["KVCache", "ReferenceTransformer", "TransformerConfig", "__version__"]

_LAZY = {
    "KVCache": "speedtronic_models.kv_cache",
    "ReferenceTransformer": "speedtronic_models.model",
    "TransformerConfig": "speedtronic_models.config",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'speedtronic_models' has no attribute {name!r}")
