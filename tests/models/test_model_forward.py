"""Forward-pass contract: shapes, causality, padding, the loss and the tied head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from speedtronic import DataError


def test_logits_shape_and_loss_only_with_labels(make_model, tokens) -> None:
    model = make_model()
    out = model(tokens)
    assert set(out) == {"logits"}
    assert out["logits"].shape == (*tokens.shape, model.vocab_size)
    out = model(tokens[:, :7], labels=tokens[:, :7])
    assert out["logits"].shape == (tokens.shape[0], 7, model.vocab_size)
    assert out["loss"].shape == ()


def test_changing_future_tokens_leaves_earlier_logits_unchanged(make_model, tokens) -> None:
    model = make_model().eval()
    cut = 11
    changed = tokens.clone()
    changed[:, cut:] = (tokens[:, cut:] + 1) % model.vocab_size
    with torch.no_grad():
        before = model(tokens)["logits"]
        after = model(changed)["logits"]
    torch.testing.assert_close(after[:, :cut], before[:, :cut], rtol=0, atol=1e-6)
    # The later positions do see the change, so the check above is not vacuous.
    assert not torch.allclose(after[:, cut:], before[:, cut:])


def test_loss_is_cross_entropy_of_returned_logits_skipping_ignored(make_model, tokens) -> None:
    model = make_model()
    labels = torch.roll(tokens, shifts=-1, dims=1)
    labels[:, -1] = -100
    labels[0, :5] = -100
    out = model(tokens, labels=labels)
    logits = out["logits"].detach()
    keep = labels != -100
    picked = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    by_hand = -picked[keep].mean()
    torch.testing.assert_close(out["loss"].detach(), by_hand)
    torch.testing.assert_close(
        out["loss"].detach(),
        F.cross_entropy(logits.view(-1, model.vocab_size), labels.view(-1), ignore_index=-100),
    )


def test_head_and_embedding_are_one_tensor(make_model, tokens) -> None:
    model = make_model()
    vocab, width = model.vocab_size, model.config.d_model
    assert model.output_weight is model.tok_emb.weight
    matrices = [name for name, t in model.state_dict().items() if t.shape == (vocab, width)]
    assert matrices == ["tok_emb.weight"]
    # Rows of tokens absent from the input get gradient only through the output head.
    absent = sorted(set(range(vocab)) - set(tokens.unique().tolist()))
    assert absent
    model(tokens, labels=tokens)["loss"].backward()
    assert model.tok_emb.weight.grad[absent].abs().sum() > 0


def test_all_ones_padding_mask_matches_the_plain_causal_path(make_model, tokens) -> None:
    model = make_model().eval()
    with torch.no_grad():
        plain = model(tokens)["logits"]
        masked = model(tokens, attention_mask=torch.ones_like(tokens))["logits"]
    torch.testing.assert_close(masked, plain, rtol=0, atol=1e-5)


def test_left_padding_is_invisible_to_real_tokens(make_model, tokens) -> None:
    # Masked padding plus rotary (relative) positions: a left-padded sequence must give its
    # real tokens exactly the logits the unpadded sequence gets.
    model = make_model().eval()
    pad = 9
    real = tokens[:, : tokens.shape[1] - pad]
    padded = torch.cat([torch.zeros_like(tokens[:, :pad]), real], dim=1)
    mask = torch.ones_like(padded, dtype=torch.bool)
    mask[:, :pad] = False
    with torch.no_grad():
        alone = model(real)["logits"]
        with_padding = model(padded, attention_mask=mask)["logits"]
    assert torch.isfinite(with_padding).all()
    torch.testing.assert_close(with_padding[:, pad:], alone, rtol=0, atol=1e-5)


def test_fully_padded_rows_stay_finite_in_loss_and_gradients(make_model, tokens) -> None:
    model = make_model()
    mask = torch.ones_like(tokens)
    mask[0] = 0
    labels = tokens.clone()
    labels[0] = -100
    out = model(tokens, labels=labels, attention_mask=mask)
    assert torch.isfinite(out["logits"]).all()
    out["loss"].backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_inputs_inconsistent_with_the_model_raise_data_errors(make_model, tokens) -> None:
    model = make_model()
    too_long = torch.zeros(1, model.max_seq_len + 1, dtype=torch.long)
    with pytest.raises(DataError, match="max_seq_len"):
        model(too_long)
    with pytest.raises(DataError, match="attention_mask"):
        model(tokens, attention_mask=torch.ones(1, 3))
    with pytest.raises(DataError, match="labels"):
        model(tokens, labels=tokens[:, :-1])
    with pytest.raises(DataError, match="input_ids"):
        model(tokens[0])


def test_bf16_autocast_runs_attention_in_bf16_and_the_loss_in_fp32(make_model, tokens) -> None:
    model = make_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(tokens, labels=tokens, attention_mask=torch.ones_like(tokens))
    assert out["logits"].dtype == torch.bfloat16
    assert out["loss"].dtype == torch.float32
    out["loss"].backward()
    assert torch.isfinite(model.tok_emb.weight.grad).all()
