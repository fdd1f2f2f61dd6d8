"""Attention against written-out reference computations, and rotary relativity."""

from __future__ import annotations

import math

import pytest
import torch

from speedtronic_models.rotary import RotaryEmbedding, apply_rotary


def _rotate_as_complex(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE written independently: channel pairs (i, i + D/2) as complex numbers times
    e^{i * pos * theta^(-2i/D)}; ``x`` is ``[B, T, H, D]``."""
    seq_len, dim = x.shape[1], x.shape[-1]
    freqs = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
    rotation = torch.polar(torch.ones_like(angles), angles)[:, None, :]
    half = dim // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * rotation
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def _reference_attention(attn, x: torch.Tensor, theta: float) -> torch.Tensor:
    """Plain multi-head causal attention with an explicit softmax, using ``attn``'s weights;
    key/value heads are repeated so query head h reads key/value head h // group."""
    batch, seq_len, _ = x.shape
    heads, kv_heads, dim = attn.n_head, attn.n_kv_head, attn.head_dim
    w_q, w_k, w_v = attn.qkv.weight.split((heads * dim, kv_heads * dim, kv_heads * dim))
    q = (x @ w_q.T).view(batch, seq_len, heads, dim)
    k = (x @ w_k.T).view(batch, seq_len, kv_heads, dim)
    v = (x @ w_v.T).view(batch, seq_len, kv_heads, dim)
    q, k = _rotate_as_complex(q, theta), _rotate_as_complex(k, theta)
    group = heads // kv_heads
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dim)
    future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    y = torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq_len, heads * dim)
    return y @ attn.out.weight.T


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_attention_matches_a_plain_multi_head_reference(make_model, n_kv_head: int) -> None:
    model = make_model(n_head=4, n_kv_head=n_kv_head).eval()
    attn = model.blocks[0].attn
    x = torch.randn(2, 20, model.config.d_model, generator=torch.Generator().manual_seed(7))
    cos, sin = model.rotary(x.shape[1])
    with torch.no_grad():
        got = attn(x, cos, sin)
        expected = _reference_attention(attn, x, model.config.rope_theta)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_gqa_shrinks_only_the_key_value_projection(make_model) -> None:
    full = make_model(n_head=4, n_kv_head=4).blocks[0].attn
    grouped = make_model(n_head=4, n_kv_head=1).blocks[0].attn
    dim = full.head_dim
    assert full.qkv.weight.shape[0] == (4 + 2 * 4) * dim
    assert grouped.qkv.weight.shape[0] == (4 + 2 * 1) * dim
    assert grouped.out.weight.shape == full.out.weight.shape


def test_rotary_scores_depend_only_on_relative_position() -> None:
    dim, theta = 16, 10_000.0
    rotary = RotaryEmbedding(dim, max_seq_len=64, theta=theta)
    generator = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, dim, generator=generator, dtype=torch.float32)
    cos, sin = rotary(64)

    def score(q_pos: int, k_pos: int) -> torch.Tensor:
        rq = apply_rotary(q.view(1, 1, 1, dim), cos[q_pos], sin[q_pos])
        rk = apply_rotary(k.view(1, 1, 1, dim), cos[k_pos], sin[k_pos])
        return (rq * rk).sum()

    for q_pos, k_pos in [(5, 2), (9, 9), (30, 1), (3, 40)]:
        for shift in (1, 7, 20):
            torch.testing.assert_close(
                score(q_pos + shift, k_pos + shift), score(q_pos, k_pos), rtol=1e-4, atol=1e-5
            )
    # Different distances give different scores: positions are actually encoded.
    assert not torch.isclose(score(5, 2), score(5, 4))


def test_rotary_tables_stay_out_of_the_state_dict(make_model) -> None:
    model = make_model()
    assert not any("rotary" in name for name in model.state_dict())
    assert model.rotary.cos.shape[0] == model.max_seq_len


def test_unpadded_batches_use_the_causal_kernel_without_a_mask(
    make_model, tokens, monkeypatch
) -> None:
    from speedtronic_models import torch_compat

    seen: list[tuple[object, object]] = []
    sdpa = torch_compat.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch_compat.F, "scaled_dot_product_attention", spy)
    model = make_model()
    model(tokens)
    assert seen == [(None, True)] * model.config.n_layer  # no [T, T] tensor is built
    seen.clear()
    model(tokens, attention_mask=torch.ones_like(tokens))
    assert len(seen) == model.config.n_layer
    assert all(mask is not None and causal is False for mask, causal in seen)
