"""The torch 2.1-2.4 equivalents and the hand-differentiated CPU paths compute what the
built-ins compute; the model compiles into one graph."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from speedtronic_models import norm, torch_compat
from speedtronic_models.feedforward import SwiGLU
from speedtronic_models.norm import RMSNorm
from speedtronic_models.rotary import RotaryEmbedding


def _forward_backward(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_(True)
    out = module(x)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return [out.detach(), x.grad, *(p.grad for p in module.parameters())]


def test_hand_differentiated_rmsnorm_matches_the_builtin(monkeypatch) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16)
    builtin = nn.RMSNorm(16, eps=1e-5)
    ours = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        builtin.weight.uniform_(0.5, 1.5)
        ours.weight.copy_(builtin.weight)
    assert torch_compat.eager_cpu_training(x)  # the hand-written backward is the one tested
    expected = _forward_backward(builtin, x)
    for got, want in zip(_forward_backward(ours, x), expected, strict=True):
        torch.testing.assert_close(got, want)
    with torch.no_grad():  # inference: F.rms_norm as is
        torch.testing.assert_close(ours(x), builtin(x))
    monkeypatch.setattr(norm, "HAS_RMS_NORM", False)  # torch < 2.4
    with torch.no_grad():
        torch.testing.assert_close(ours(x), builtin(x))


def test_hand_differentiated_swiglu_matches_autograd() -> None:
    torch.manual_seed(0)
    layer = SwiGLU(16, 24)
    x = torch.randn(3, 5, 16)

    class Plain(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            return layer.down(nn.functional.silu(gate) * up)

    ours = _forward_backward(layer, x)
    layer.zero_grad(set_to_none=True)
    x2 = x.detach().requires_grad_(True)
    out = Plain()(x2)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    expected = [out.detach(), x2.grad, *(p.grad for p in layer.parameters())]
    for got, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_rotary_tables_are_cast_once_per_dtype_and_follow_the_device() -> None:
    rotary = RotaryEmbedding(8, max_seq_len=16, theta=10_000.0)
    cos, sin = rotary(16, dtype=torch.bfloat16)
    again, _ = rotary(4, start=2, dtype=torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16
    assert again.data_ptr() == cos[2:].data_ptr()  # kept, not cast again
    torch.testing.assert_close(cos.float(), rotary.cos, atol=1e-2, rtol=0)
    rotary.double()  # a re-cast buffer: its old copies are not used
    cos, _ = rotary(16, dtype=torch.bfloat16)
    torch.testing.assert_close(cos.double(), rotary.cos, atol=1e-2, rtol=0)


def test_the_model_compiles_into_one_graph(make_model, tokens) -> None:
    model = make_model()
    labels = torch.roll(tokens, -1, dims=1)
    eager = model(tokens, labels=labels)["loss"]
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    loss = compiled(tokens, labels=labels)["loss"]
    loss.backward()
    torch.testing.assert_close(loss, eager)
    assert all(p.grad is not None for p in model.parameters())


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
