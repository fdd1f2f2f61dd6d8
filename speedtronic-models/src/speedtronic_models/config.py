"""The reference transformer's shape, validated once, with errors that name the parameter."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from speedtronic import ConfigError

# Errors point at the config file's `model:` section, where these parameters are written.
_SECTION = "model"
_REQUIRED = ("vocab_size", "max_seq_len", "n_layer", "n_head", "d_model")
_POSITIVE_INTS = (*_REQUIRED, "n_kv_head", "ffn_hidden")
# SwiGLU keeps a 4x GELU MLP's parameter count at 8/3 the width; round up so matmuls tile well.
_FFN_MULTIPLE = 64


def default_ffn_hidden(d_model: int) -> int:
    """SwiGLU width for ``d_model``: 8/3 of it, rounded up to a multiple of 64."""
    return _FFN_MULTIPLE * math.ceil(8 * d_model / 3 / _FFN_MULTIPLE)


@dataclass(frozen=True)
class TransformerConfig:
    """Hyper-parameters of a :class:`~speedtronic_models.ReferenceTransformer`.

    Build it with :meth:`from_params` to get defaults and unknown-key checks; constructing it
    directly still validates every value. Invalid values raise :class:`speedtronic.ConfigError`
    located at ``model.<param>``.
    """

    vocab_size: int
    max_seq_len: int
    n_layer: int
    n_head: int
    n_kv_head: int
    d_model: int
    ffn_hidden: int
    dropout: float = 0.0
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> TransformerConfig:
        """Validate a ``model`` section (without ``name``), filling the optional parameters.

        ``n_kv_head`` defaults to ``n_head`` (plain multi-head attention) and ``ffn_hidden`` to
        :func:`default_ffn_hidden`; ``None`` also means "use the default".
        """
        known = [f.name for f in dataclasses.fields(cls)]
        for key in params:
            if key not in known:
                raise ConfigError(
                    f"unknown parameter of reference_transformer; known: {', '.join(known)}",
                    f"{_SECTION}.{key}",
                )
        values = {key: value for key, value in params.items() if value is not None}
        for key in _REQUIRED:
            if key not in values:
                raise ConfigError("required parameter is missing", f"{_SECTION}.{key}")
        # Defaults derive from other fields, so those must be sound before they are used.
        for key in ("n_head", "d_model"):
            _check_positive_int(key, values[key])
        values.setdefault("n_kv_head", values["n_head"])
        values.setdefault("ffn_hidden", default_ffn_hidden(values["d_model"]))
        return cls(**values)

    def __post_init__(self) -> None:
        for key in _POSITIVE_INTS:
            _check_positive_int(key, getattr(self, key))
        _check_number("dropout", self.dropout)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"must be in [0, 1), got {self.dropout}", f"{_SECTION}.dropout")
        for key in ("rope_theta", "norm_eps"):
            value = getattr(self, key)
            _check_number(key, value)
            if not value > 0:
                raise ConfigError(f"must be > 0, got {value}", f"{_SECTION}.{key}")
        if self.d_model % self.n_head:
            raise ConfigError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})",
                f"{_SECTION}.n_head",
            )
        if self.n_head % self.n_kv_head:
            raise ConfigError(
                f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})",
                f"{_SECTION}.n_kv_head",
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"head size d_model / n_head = {self.d_model} / {self.n_head} = {self.head_dim} "
                "must be even for rotary position embeddings",
                f"{_SECTION}.n_head",
            )

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.d_model // self.n_head


def _check_positive_int(key: str, value: Any) -> None:
    # bool is an int subclass, but `n_layer: true` is a typo, not a layer count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"must be a positive integer, got {type(value).__name__} {value!r}",
            f"{_SECTION}.{key}",
        )
    if value <= 0:
        raise ConfigError(f"must be a positive integer, got {value}", f"{_SECTION}.{key}")


def _check_number(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(
            f"must be a number, got {type(value).__name__} {value!r}", f"{_SECTION}.{key}"
        )
