"""Precision resolution (auto and explicit modes, fallbacks) and its use in the training loop."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from core.toy_runs import toy_trainer
from torch import nn

from speedtronic import SpeedtronicConfig, precision
from speedtronic.engine.precision import BF16, FP16, FP32, resolve_device, resolve_precision
from speedtronic.engine.trainer import Trainer
from speedtronic.errors import ConfigError

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # constructing a device object needs no GPU
MPS = torch.device("mps")


@pytest.fixture
def cuda_bf16(monkeypatch):
    """Pretend CUDA with or without bf16 support."""

    def set_support(supported: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: supported)

    return set_support


@pytest.fixture
def cpu_native(monkeypatch):
    """Pretend this CPU has (or lacks) native bf16/fp16 kernels."""

    def set_support(supported: bool) -> None:
        monkeypatch.setattr(precision, "_cpu_supports", lambda dtype: supported)

    return set_support


def test_auto_is_fp32_on_cpu_and_mps():
    assert resolve_precision("auto", CPU) == FP32
    assert resolve_precision("auto", MPS) == FP32
    assert not FP32.use_grad_scaler and FP32.dtype is None


def test_auto_on_cuda_is_bf16_when_capable_else_fp16_with_scaler(cuda_bf16):
    cuda_bf16(True)
    assert resolve_precision("auto", CUDA) == BF16
    cuda_bf16(False)
    chosen = resolve_precision("auto", CUDA)
    assert chosen == FP16 and chosen.use_grad_scaler and chosen.dtype == torch.float16


def test_explicit_modes_are_honoured_where_supported(cuda_bf16, cpu_native):
    cuda_bf16(True)
    assert resolve_precision("bf16", CUDA) == BF16
    assert resolve_precision("fp16", CUDA) == FP16
    assert resolve_precision("fp32", CUDA) == FP32
    cpu_native(True)
    assert resolve_precision("bf16", CPU) == BF16
    assert resolve_precision("fp16", CPU) == FP16


@pytest.mark.parametrize(
    ("mode", "device", "cuda_bf16_ok"),
    [
        ("bf16", CUDA, False),
        ("bf16", CPU, None),
        ("fp16", CPU, None),
        ("bf16", MPS, None),
        ("fp16", MPS, None),
    ],
)
def test_unsupported_explicit_mode_falls_back_to_fp32_with_a_warning(
    mode, device, cuda_bf16_ok, cuda_bf16, cpu_native, caplog
):
    cuda_bf16(bool(cuda_bf16_ok))
    cpu_native(False)
    with caplog.at_level(logging.WARNING, logger="speedtronic.precision"):
        assert resolve_precision(mode, device) == FP32
    assert len(caplog.records) == 1
    assert mode in caplog.records[0].getMessage()


def test_an_explicit_absent_device_is_an_error_naming_what_was_found(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision, "mps_available", lambda: False)
    assert resolve_device("auto") == CPU  # auto keeps choosing
    for device in ("cuda", "mps"):
        with pytest.raises(ConfigError, match=rf"^run\.device: is {device}, but .*found: cpu"):
            resolve_device(device)


class DtypeProbe(nn.Module):
    """Records the dtype its matmul runs in."""

    vocab_size = 16
    max_seq_len = 8

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)
        self.dtypes: list[torch.dtype] = []

    def forward(self, input_ids, labels):
        logits = self.head(self.table(input_ids))
        self.dtypes.append(logits.dtype)
        return F.cross_entropy(logits.float().view(-1, 16), labels.reshape(-1))


def run_with_mode(tmp_path, mode: str) -> tuple[DtypeProbe, Trainer]:
    config = SpeedtronicConfig.from_dict(
        {
            "run": {"device": "cpu", "max_steps": 3, "output_dir": str(tmp_path)},
            "data": {"micro_batch_size": 2},
            "precision": {"mode": mode},
            "checkpoint": {"save_final": False},
        }
    )
    model = DtypeProbe()
    trainer = toy_trainer(model, config)
    trainer.fit()
    return model, trainer


def test_training_runs_under_the_resolved_autocast(tmp_path, cpu_native):
    cpu_native(True)
    model, trainer = run_with_mode(tmp_path, "bf16")
    assert model.dtypes == [torch.bfloat16] * 3
    assert not trainer.scaler.is_enabled()
    model, trainer = run_with_mode(tmp_path, "fp16")
    assert model.dtypes == [torch.float16] * 3
    assert trainer.scaler.is_enabled()  # fp16 always trains with a GradScaler
    assert trainer.step == 3
    cpu_native(False)
    model, trainer = run_with_mode(tmp_path, "bf16")
    assert model.dtypes == [torch.float32] * 3
