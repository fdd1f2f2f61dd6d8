"""Shared fixtures for the reference transformer tests: small, seeded, CPU models."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from speedtronic_models import ReferenceTransformer

TINY = {
    "vocab_size": 48,
    "max_seq_len": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_kv_head": 2,
    "d_model": 32,
}


@pytest.fixture
def tiny_params() -> dict[str, int]:
    """The tiny model's parameters, a fresh copy per test."""
    return dict(TINY)


@pytest.fixture
def make_model() -> Callable[..., ReferenceTransformer]:
    """Factory for a tiny model; keyword overrides replace entries of ``TINY``.

    ``seed`` picks the initial weights, so two calls with the same seed build equal models.
    """

    def make(seed: int = 0, **overrides: Any) -> ReferenceTransformer:
        torch.manual_seed(seed)
        return ReferenceTransformer(**{**TINY, **overrides})

    return make


@pytest.fixture
def tokens() -> torch.Tensor:
    """A fixed ``[2, 32]`` batch of token ids below ``TINY["vocab_size"]``."""
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, TINY["vocab_size"], (2, TINY["max_seq_len"]), generator=generator)
