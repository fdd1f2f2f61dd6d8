"""The torch 2.1-2.4 equivalents compute what the newer built-ins compute."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from speedtronic_models import torch_compat


def test_fallback_rmsnorm_matches_builtin() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16)
    builtin = nn.RMSNorm(16, eps=1e-5)
    fallback = torch_compat._RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        builtin.weight.uniform_(0.5, 1.5)
        fallback.weight.copy_(builtin.weight)
    torch.testing.assert_close(fallback(x), builtin(x))


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_repeated_kv_heads_match_native_gqa(monkeypatch, n_kv_head: int) -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 4, 7, 8)
    k = torch.randn(2, n_kv_head, 7, 8)
    v = torch.randn(2, n_kv_head, 7, 8)
    native = torch_compat.grouped_sdpa(q, k, v, is_causal=True)
    monkeypatch.setattr(torch_compat, "SDPA_HAS_GQA", False)
    repeated = torch_compat.grouped_sdpa(q, k, v, is_causal=True)
    torch.testing.assert_close(repeated, native)
