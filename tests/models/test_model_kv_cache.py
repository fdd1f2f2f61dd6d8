"""Incremental decoding: the KV-cache path computes what the plain forward computes, and
``speedtronic.generation`` samples the same tokens with and without it."""

from __future__ import annotations

import logging

import pytest
import torch

from speedtronic import ConfigError, DataError
from speedtronic.generation import (
    ByteCodec,
    SamplingOptions,
    generate_text,
    generate_tokens,
    sample_next,
)

GREEDY = SamplingOptions(max_new_tokens=20, temperature=0)


def sharpen(model) -> None:
    """Larger weights than the 0.02 init: a random model whose greedy choices vary."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.3)


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_cached_logits_equal_the_full_forward(make_model, tokens, n_kv_head: int) -> None:
    model = make_model(n_kv_head=n_kv_head).eval()
    with torch.no_grad():
        full = model(tokens)["logits"]
        cache = model.new_kv_cache()
        # A prefill of 9 positions, a chunk of 5 (needs the offset causal mask), then one at a
        # time (no mask at all).
        pieces = [model(tokens[:, :9], kv_cache=cache)["logits"]]
        pieces.append(model(tokens[:, 9:14], kv_cache=cache)["logits"])
        for position in range(14, tokens.shape[1]):
            pieces.append(model(tokens[:, position : position + 1], kv_cache=cache)["logits"])
    assert cache.length == tokens.shape[1]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5)


def test_the_training_forward_is_untouched_by_the_cache_path(make_model, tokens) -> None:
    model = make_model()
    out = model(tokens, labels=torch.roll(tokens, -1, dims=1))
    assert set(out) == {"logits", "loss"}  # no cache is built or returned while training
    out["loss"].backward()
    assert all(p.grad is not None for p in model.parameters())


def test_the_cache_refuses_more_than_max_seq_len(make_model, tokens) -> None:
    model = make_model().eval()
    cache = model.new_kv_cache()
    with torch.no_grad():
        model(tokens, kv_cache=cache)
        with pytest.raises(DataError, match="KV cache holds 32 positions"):
            model(tokens[:, :1], kv_cache=cache)
        with pytest.raises(DataError, match="neither attention_mask nor labels"):
            model(tokens, kv_cache=model.new_kv_cache(), labels=tokens)


@pytest.mark.parametrize("n_kv_head", [2, 4])
def test_kv_cache_generation_equals_full_recomputation(make_model, n_kv_head: int) -> None:
    model = make_model(seed=3, n_kv_head=n_kv_head)
    sharpen(model)
    prompt = [5, 17, 3, 40, 22]
    cached = list(generate_tokens(model, prompt, GREEDY))
    recomputed = list(generate_tokens(model, prompt, GREEDY, use_cache=False))
    assert cached == recomputed and len(cached) == 20
    assert len(set(cached)) > 3  # a real sequence, not one token repeated


def test_sampling_is_deterministic_for_a_seed(make_model) -> None:
    model = make_model(seed=4)
    sharpen(model)
    options = SamplingOptions(max_new_tokens=16, temperature=1.0, top_k=20, top_p=0.9, seed=7)
    first = list(generate_tokens(model, [1, 2, 3], options))
    assert first == list(generate_tokens(model, [1, 2, 3], options))
    assert first == list(generate_tokens(model, [1, 2, 3], options, use_cache=False))
    other = SamplingOptions(max_new_tokens=16, temperature=1.0, top_k=20, top_p=0.9, seed=8)
    assert first != list(generate_tokens(model, [1, 2, 3], other))


def test_generation_stops_at_eos_and_at_the_context(make_model, caplog) -> None:
    model = make_model(seed=3)
    sharpen(model)
    greedy = list(generate_tokens(model, [5, 17], GREEDY))
    eos = greedy[4]
    stopped = list(generate_tokens(model, [5, 17], GREEDY, eos_id=eos))
    assert stopped == greedy[: greedy.index(eos) + 1]
    with pytest.raises(DataError, match="prompt is empty"):
        list(generate_tokens(model, [], GREEDY))


def test_generation_slides_past_the_context(make_model, caplog) -> None:
    """A context-32 model writes all 100 tokens after a 28-token prompt: the window slides,
    the KV cache is rebuilt from the cropped context, and the cached and recomputed paths
    see the same windows, so they pick the same tokens."""
    model = make_model(seed=3)
    sharpen(model)
    assert model.max_seq_len == 32
    prompt = [(7 * i) % 40 for i in range(28)]
    options = SamplingOptions(100, temperature=0)
    with caplog.at_level(logging.WARNING, logger="speedtronic"):
        tokens = generate_tokens(model, prompt, options)  # warns here, before any token
        assert "outgrow the model's context of 32" in caplog.text
        cached = list(tokens)
    recomputed = list(generate_tokens(model, prompt, options, use_cache=False))
    assert len(cached) == 100 and cached == recomputed
    assert len(set(cached[50:])) > 3  # still a real sequence far past the context
    # A prompt longer than the context: the model reads its last 32 tokens.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="speedtronic"):
        long = list(generate_tokens(model, [1] * 40 + prompt, GREEDY))
    assert "the model sees its last 32" in caplog.text
    assert long == list(generate_tokens(model, ([1] * 40 + prompt)[-32:], GREEDY))


def test_sample_next_filters() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    generator = torch.Generator().manual_seed(0)
    assert sample_next(logits, SamplingOptions(temperature=0), generator) == 1
    for _ in range(20):
        assert sample_next(logits, SamplingOptions(top_k=1), generator) == 1
        assert sample_next(logits, SamplingOptions(top_p=0.05), generator) == 1
        assert sample_next(logits, SamplingOptions(top_k=2), generator) in (1, 2)
    # top_p 0.9: tokens 1 and 2 hold 0.85 of the mass, so token 0 (0.11) completes it.
    seen = {sample_next(logits, SamplingOptions(top_p=0.9), generator) for _ in range(300)}
    assert seen == {0, 1, 2}


@pytest.mark.parametrize(
    ("options", "flag"),
    [
        (SamplingOptions(max_new_tokens=0), "--max-new-tokens"),
        (SamplingOptions(temperature=-1), "--temperature"),
        (SamplingOptions(temperature=float("nan")), "--temperature"),
        (SamplingOptions(top_k=0), "--top-k"),
        (SamplingOptions(top_p=0.0), "--top-p"),
        (SamplingOptions(top_p=1.5), "--top-p"),
    ],
)
def test_bad_sampling_options_name_the_flag(options: SamplingOptions, flag: str) -> None:
    with pytest.raises(ConfigError) as caught:
        options.validate()
    assert caught.value.path == flag


def test_byte_codec_streams_multibyte_characters() -> None:
    codec = ByteCodec(vocab_size=300, eos_id=256)
    text = "héllo €"
    decode = codec.decoder()
    pieces = [decode(token) for token in codec.encode(text)]
    assert "".join(pieces) + decode(None) == text
    assert pieces[1] == "" and pieces[2] == "é"  # held back until the character is complete
    assert decode(256) == ""  # ids beyond bytes decode to nothing
    with pytest.raises(DataError, match="outside the model's vocabulary of 48"):
        ByteCodec(vocab_size=48).encode("h")


def test_generate_text_decodes_bytes(make_model) -> None:
    model = make_model(seed=3, vocab_size=256)
    sharpen(model)
    codec = ByteCodec(vocab_size=256)
    text = "".join(generate_text(model, codec, "ab", GREEDY))
    ids = list(generate_tokens(model, list(b"ab"), GREEDY))
    assert text == bytes(ids).decode("utf-8", errors="replace")
