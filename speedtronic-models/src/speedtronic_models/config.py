"""The reference transformer's shape: a core config section, so its errors read like core's.

Types, bounds and unknown keys are checked by :mod:`speedtronic.schema` exactly as for core's
own sections (``16.0`` is the integer ``16``, ``"16"`` too; ``16.5`` and ``true`` are not); the
rules that tie parameters together are :meth:`TransformerConfig.validate`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from speedtronic import ConfigError
from speedtronic.schema import Section, build_section, option, unknown_key_error

# Errors point at the config file's `model:` section, where these parameters are written.
SECTION = "model"
MODEL_NAME = "reference_transformer"
# Parameters whose default derives from others: ``None`` (or leaving them out) means "derive".
DERIVED = ("n_kv_head", "ffn_hidden")
# Parameters about loading weights rather than the shape: accepted here, used by the model.
LOADING = ("init_from",)
# SwiGLU keeps a 4x GELU MLP's parameter count at 8/3 the width; round up so matmuls tile well.
_FFN_MULTIPLE = 64


def default_ffn_hidden(d_model: int) -> int:
    """SwiGLU width for ``d_model``: 8/3 of it, rounded up to a multiple of 64."""
    return _FFN_MULTIPLE * math.ceil(8 * d_model / 3 / _FFN_MULTIPLE)


@dataclass(frozen=True)
class TransformerConfig(Section):
    """Hyper-parameters of a :class:`~speedtronic_models.ReferenceTransformer`.

    Build it with :meth:`from_params` to get defaults and unknown-key checks located at
    ``model.<param>``; constructing it directly validates every value too (errors then name
    the bare field, as for any core section built directly). After construction
    ``n_kv_head`` and ``ffn_hidden`` are always integers.
    """

    vocab_size: int = option(help="Token ids are `0 .. vocab_size - 1`.", ge=1)
    max_seq_len: int = option(help="Longest input; sizes the rotary tables.", ge=1)
    n_layer: int = option(help="Number of transformer blocks.", ge=1)
    n_head: int = option(
        help="Query heads; must divide `d_model`, and `d_model / n_head` must be even.", ge=1
    )
    n_kv_head: int | None = option(
        help="Key/value heads (grouped-query attention); must divide `n_head`. "
        "`null` means `n_head` (plain multi-head attention).",
        ge=1,
    )
    d_model: int = option(help="Residual width.", ge=1)
    ffn_hidden: int | None = option(
        help="SwiGLU width; `null` means 8/3 `d_model` rounded up to a multiple of 64.", ge=1
    )
    dropout: float = option(
        0.0, help="Embedding, attention and residual dropout; 0 runs no dropout op.", ge=0, lt=1
    )
    rope_theta: float = option(10_000.0, help="Rotary base.", gt=0)
    norm_eps: float = option(1e-5, help="RMSNorm epsilon.", gt=0)

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> TransformerConfig:
        """Validate a ``model`` section (without ``name``), filling the optional parameters.

        ``n_kv_head`` defaults to ``n_head`` and ``ffn_hidden`` to :func:`default_ffn_hidden`;
        ``None`` also means "use the default". Errors are located at ``model.<param>``.
        ``init_from`` (weights to load, not a shape) is accepted and left to the model.
        """
        if not isinstance(params, Mapping):
            raise ConfigError(f"expected a mapping, got {type(params).__name__}", SECTION)
        known = [field.name for field in dataclasses.fields(cls)] + list(LOADING)
        for key in params:
            if key not in known:
                hint = f" ({MODEL_NAME} takes: {', '.join(known)})"
                raise unknown_key_error(str(key), known, SECTION, hint)
        shape = {key: value for key, value in params.items() if key not in LOADING}
        return build_section(cls, {**dict.fromkeys(DERIVED), **shape}, SECTION)

    def validate(self) -> None:
        """Fill the derived defaults, then check the rules that tie parameters together
        (called by :class:`~speedtronic.schema.Section` once every field is typed and in
        bounds)."""
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", default_ffn_hidden(self.d_model))
        if self.d_model % self.n_head:
            raise ConfigError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})", "n_head"
            )
        if self.n_head % self.n_kv_head:
            raise ConfigError(
                f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})",
                "n_kv_head",
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"head size d_model / n_head = {self.d_model} / {self.n_head} = {self.head_dim} "
                "must be even for rotary position embeddings",
                "n_head",
            )

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.d_model // self.n_head
