"""The FLOP counter (speedtronic.flops) on the reference transformer against the usual
analytic count: 6 x matmul parameters + 12 x layers x d_model x seq_len per token (Kaplan et
al. 2020; PaLM appendix B), the head (the embedding matrix) counted as a matmul."""

from __future__ import annotations

import pytest
from models.hf_fixtures import TINY_GPT2, TINY_LLAMA, hf_model, run_config

from speedtronic import flops
from speedtronic.flops import count_flops_per_token, measure_flops, sample_batch
from speedtronic.runtime import build_runtime
from speedtronic_models import ReferenceTransformer


def analytic(model: ReferenceTransformer, seq_len: int) -> float:
    config = model.config
    matmul = sum(p.numel() for p in model.parameters() if p.ndim == 2)
    return 6 * matmul + 12 * config.n_layer * config.d_model * seq_len


@pytest.mark.parametrize(
    ("shape", "seq_len"),
    [
        ({"n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 64}, 64),
        ({"n_layer": 3, "n_head": 2, "n_kv_head": 1, "d_model": 32}, 256),  # attention-heavy
    ],
)
@pytest.mark.parametrize("meta_first", [False, True])
def test_counted_flops_per_token_match_the_analytic_count(
    shape: dict, seq_len: int, meta_first: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if meta_first:  # as for a model too large for a real sample on a CPU
        monkeypatch.setattr(flops, "REAL_ON_CPU_BELOW", 0)
    model = ReferenceTransformer(vocab_size=256, max_seq_len=seq_len, **shape)
    counted = count_flops_per_token(model, sample_batch(seq_len))
    assert counted == pytest.approx(analytic(model, seq_len), rel=0.1)


def test_activation_checkpointing_is_not_counted_twice() -> None:
    model = ReferenceTransformer(vocab_size=256, max_seq_len=32, n_layer=2, n_head=2, d_model=32)
    model.set_gradient_checkpointing(True)
    # What runs: the recomputed forward too; what measure_flops reports: the model's own.
    assert count_flops_per_token(model, sample_batch(32)) > 1.05 * analytic(model, 32)
    report = measure_flops(model, seq_len=32)
    assert report.flops_per_token == pytest.approx(analytic(model, 32), rel=0.1)
    assert model.gradient_checkpointing is True


@pytest.mark.parametrize("hf_config", [TINY_LLAMA, TINY_GPT2], ids=["llama", "gpt2"])
def test_a_hugging_face_run_reports_its_counted_flops(tmp_path, hf_config: dict) -> None:
    events: list = []
    runtime = build_runtime(
        run_config(tmp_path, hf_model(hf_config), run={"max_steps": 1}),
        hooks=[lambda event, payload: events.append((event, payload))],
        console=False,
    )
    runtime.trainer.fit()
    start = next(payload for event, payload in events if event == "train_start")
    model, seq_len = runtime.model, runtime.model.config.max_position_embeddings
    # Every Linear / Conv1D weight is a matmul (the head too, tied or not); lookups are not.
    weights = {
        id(m.weight): m.weight.numel()
        for m in model.modules()
        if type(m).__name__ in ("Linear", "Conv1D")
    }
    config = model.config
    layers, width = config.num_hidden_layers, config.hidden_size
    expected = 6 * sum(weights.values()) + 12 * layers * width * seq_len
    assert start["flops_per_token"] == pytest.approx(expected, rel=0.1)
    assert start["parameters"] == sum(p.numel() for p in model.parameters())
