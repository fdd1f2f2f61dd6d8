"""FLOPs per token counted at train start, and ``tflops`` / ``mfu`` on every step record."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from core.toy_runs import EventRecorder, tiny_transformer_run, toy_trainer, train
from torch import nn

from speedtronic import SpeedtronicConfig, flops
from speedtronic.observe.flops import (
    FlopsReport,
    count_flops_per_token,
    device_peak_tflops,
    measure_flops,
    sample_batch,
)

VOCAB, WIDTH, SEQ = 64, 16, 8


class HeadModel(nn.Module):
    """Embedding, norm and a linear head: the head is its only matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.vocab_size, self.max_seq_len = VOCAB, SEQ
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        logits = self.head(self.norm(self.embed(input_ids)))
        return F.cross_entropy(logits.view(-1, VOCAB), labels.reshape(-1))


def config(tmp_path: Path, **run: object) -> SpeedtronicConfig:
    return SpeedtronicConfig.from_dict(
        {
            "run": {"device": "cpu", "max_steps": 6, "output_dir": str(tmp_path), **run},
            "data": {"micro_batch_size": 4},
            "checkpoint": {"save_final": False},
            "logging": {"log_every": 2, "progress": False},
        }
    )


@pytest.mark.parametrize("meta_first", [False, True])
def test_a_user_models_head_matmul_is_what_is_counted(
    meta_first: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if meta_first:
        monkeypatch.setattr(flops, "REAL_ON_CPU_BELOW", 0)
    # Forward 2 x d x V per token, backward twice that (input and weight gradients).
    counted = count_flops_per_token(HeadModel(), sample_batch(SEQ))
    assert counted == pytest.approx(6 * WIDTH * VOCAB, rel=0.1)


def test_counting_leaves_the_model_its_gradients_and_generators_as_they_were() -> None:
    model = HeadModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    count_flops_per_token(model, {"input_ids": torch.ones(2, SEQ, dtype=torch.long)} | {
        "labels": torch.ones(2, SEQ, dtype=torch.long)
    })  # fmt: skip
    assert all(p.grad is None for p in model.parameters())
    assert not hasattr(model, "calls")  # the count ran on a shadow of the model
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())


class DataDependent(HeadModel):
    """A branch on a value: the meta device cannot run it, one real sample can."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(self.embed(input_ids))
        if hidden.abs().sum() > 0:  # data-dependent: no meta kernel answers it
            hidden = F.dropout(hidden, 0.5)
        return F.cross_entropy(self.head(hidden).view(-1, VOCAB), labels.reshape(-1))


def test_a_model_the_meta_device_cannot_run_is_counted_on_one_real_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(flops, "REAL_ON_CPU_BELOW", 0)  # as for a large CPU model: meta first
    model = DataDependent()
    rng = torch.get_rng_state()
    counted = count_flops_per_token(model, sample_batch(SEQ))
    assert counted == pytest.approx(6 * WIDTH * VOCAB, rel=0.1)
    assert torch.equal(rng, torch.get_rng_state())  # its dropout drew from a forked generator
    assert all(p.grad is None for p in model.parameters())


class Declared(HeadModel):
    def flops_per_token(self, seq_len: int) -> float:
        return 1000.0 + seq_len


def test_a_models_own_flops_per_token_wins() -> None:
    report = measure_flops(Declared(), seq_len=SEQ)
    assert report.flops_per_token == 1000.0 + SEQ


def test_step_records_carry_tflops_and_mfu_against_the_configured_peak(tmp_path: Path) -> None:
    recorder = EventRecorder()
    toy_trainer(HeadModel(), config(tmp_path, peak_tflops=0.5), hooks=[recorder]).fit()
    start = recorder.named("train_start")[0]
    assert start["parameters"] == sum(p.numel() for p in HeadModel().parameters())
    assert start["flops_per_token"] == pytest.approx(6 * WIDTH * VOCAB, rel=0.1)
    assert start["peak_tflops"] == 0.5
    steps = recorder.named("step")
    assert [s["step"] for s in steps] == [2, 4, 6]
    for record in steps:
        expected = start["flops_per_token"] * record["tokens_per_sec"] / 1e12
        assert record["tflops"] == pytest.approx(expected, rel=1e-9)
        assert record["mfu"] == record["tflops"] / 0.5


def test_the_reference_transformer_run_reports_its_count(tmp_path: Path) -> None:
    _, recorder, _ = train(tiny_transformer_run(tmp_path, run={"max_steps": 2}))
    start = recorder.named("train_start")[0]
    assert start["flops_per_token"] > 0
    # On a CPU no peak is known: tflops but no mfu.
    assert all("tflops" in s and "mfu" not in s for s in recorder.named("step"))


class Features(nn.Module):
    """A regression model on float features: no token sample fits it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)

    def forward(self, features: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.layer(features).squeeze(-1), target)


def test_a_model_the_counter_cannot_trace_trains_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dataset = torch.utils.data.TensorDataset(torch.randn(32, 3), torch.randn(32))
    loader = torch.utils.data.DataLoader(dataset, batch_size=4)
    recorder = EventRecorder()
    with caplog.at_level(logging.WARNING, logger="speedtronic"):
        result = toy_trainer(
            Features(), config(tmp_path, peak_tflops=1.0), hooks=[recorder], data=loader
        ).fit()
    assert result.steps == 6 and math.isfinite(result.final_loss)
    warnings = [r for r in caplog.records if r.name == "speedtronic.flops"]
    assert len(warnings) == 1 and "cannot count the FLOPs of Features" in warnings[0].message
    assert recorder.named("train_start")[0]["flops_per_token"] is None
    assert all("tflops" not in s and "mfu" not in s for s in recorder.named("step"))


def test_rates_divide_by_the_world_size_and_leave_mfu_out_without_a_peak() -> None:
    # 1e6 FLOPs per token x 4e6 tokens/s over 4 devices: 1e12 FLOP/s each.
    assert FlopsReport(10, 1e6, world_size=4).rates(4e6) == {"tflops": 1.0}
    report = FlopsReport(10, 1e6, peak_tflops=4.0, world_size=2)
    assert report.rates(4e6) == {"tflops": 2.0, "mfu": 0.5}
    assert FlopsReport(10).rates(1e6) == {}


def test_no_peak_is_guessed_off_cuda() -> None:
    assert device_peak_tflops("cpu") is None


def test_the_progress_bars_line_shows_tflops_and_mfu() -> None:
    from speedtronic.observe.metrics import live_line

    line = live_line({"loss": 2.0, "tokens_per_sec": 1000.0, "tflops": 312.5, "mfu": 0.4567})
    assert line == "loss 2.0000  tok/s 1,000  TFLOP/s 312  MFU 45.7%"
    assert "MFU" not in live_line({"loss": 2.0, "tflops": 1.0})
