"""AdamW construction (decay groups, fused), gradient clipping and the lr schedule."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from core.toy_runs import merge_sections, toy_trainer
from torch import nn

from speedtronic import SpeedtronicConfig, SpeedtronicError
from speedtronic.config import OptimizerConfig, SchedulerConfig
from speedtronic.optim import build_adamw, build_optimizer, decay_groups, lr_lambda

CPU = torch.device("cpu")


class Small(nn.Module):
    """Every kind of parameter: embedding (tied to the head), linear with bias, norm."""

    vocab_size = 16
    max_seq_len = 8

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, input_ids, labels):
        hidden = self.norm(self.proj(self.embed(input_ids)))
        return F.cross_entropy((hidden @ self.embed.weight.T).view(-1, 16), labels.reshape(-1))


def names_by_group(groups) -> dict[str, set[str]]:
    return {group["group"]: set(group["param_names"]) for group in groups}


def test_only_matrices_decay_by_default():
    groups = names_by_group(decay_groups(Small(), OptimizerConfig()))
    assert groups == {
        "decay": {"proj.weight"},
        "no_decay": {"embed.weight", "proj.bias", "norm.weight", "norm.bias"},
    }


def test_decaying_norms_biases_and_embeddings_is_configurable():
    groups = names_by_group(decay_groups(Small(), OptimizerConfig(decay_norms_and_biases=True)))
    assert groups == {
        "decay": {"proj.weight", "embed.weight", "proj.bias", "norm.weight", "norm.bias"}
    }


def test_adamw_honours_the_config_and_is_plain_on_cpu():
    config = OptimizerConfig(lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.2, fused=True)
    optimizer = build_optimizer(Small(), config, CPU)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert not optimizer.defaults.get("fused")
    by_group = {g["group"]: g for g in optimizer.param_groups}
    assert by_group["decay"]["weight_decay"] == 0.2
    assert by_group["no_decay"]["weight_decay"] == 0.0
    for group in optimizer.param_groups:
        assert group["lr"] == 0.01 and group["betas"] == (0.8, 0.9) and group["eps"] == 1e-6


def test_adamw_is_fused_when_it_constructs_on_cuda(monkeypatch):
    groups = decay_groups(Small(), OptimizerConfig())
    assert build_adamw(groups, OptimizerConfig(), torch.device("cuda")).defaults["fused"]
    assert not build_adamw(groups, OptimizerConfig(fused=False), torch.device("cuda")).defaults.get(
        "fused"
    )

    class NoFused(torch.optim.AdamW):
        def __init__(self, params, fused=None, **kwargs):
            if fused:
                raise RuntimeError("fused AdamW needs CUDA tensors")
            super().__init__(params, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", NoFused)
    optimizer = build_adamw(groups, OptimizerConfig(), torch.device("cuda"))
    assert isinstance(optimizer, NoFused) and not optimizer.defaults.get("fused")


def test_a_model_without_trainable_parameters_is_an_error():
    model = Small().requires_grad_(False)
    with pytest.raises(SpeedtronicError, match="no trainable parameters"):
        build_optimizer(model, OptimizerConfig(), CPU)


def make_config(tmp_path, **sections) -> SpeedtronicConfig:
    data = {
        "run": {"device": "cpu", "max_steps": 6, "output_dir": str(tmp_path)},
        "data": {"micro_batch_size": 2},
        "precision": {"mode": "fp32"},
        "checkpoint": {"save_final": False},
        "logging": {"log_every": 1},
    }
    return SpeedtronicConfig.from_dict(merge_sections(data, sections))


def fit(tmp_path, make_optimizer=None, **sections) -> tuple[Small, list[dict]]:
    torch.manual_seed(0)
    model = Small()
    config = make_config(tmp_path, **sections)
    steps: list[dict] = []
    trainer = toy_trainer(
        model,
        config,
        [lambda e, p: steps.append(p) if e == "step" else None],
        optimizer=make_optimizer(model) if make_optimizer else None,
    )
    trainer.fit()
    return model, steps


def test_gradients_are_clipped_to_the_configured_norm(tmp_path):
    """With SGD(lr=1) the update is the clipped gradient itself."""
    torch.manual_seed(0)
    before = [p.detach().clone() for p in Small().parameters() if p.requires_grad]
    model, steps = fit(
        tmp_path,
        make_optimizer=lambda m: torch.optim.SGD(
            [p for p in m.parameters() if p.requires_grad], lr=1.0
        ),
        run={"max_steps": 1},
        optimizer={"grad_clip": 0.01},
    )
    after = [p.detach() for p in model.parameters() if p.requires_grad]
    update = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(after, before)))
    assert steps[0]["grad_norm"] > 0.1  # the logged norm is the one before clipping
    assert update == pytest.approx(0.01, rel=1e-3)


def test_unclipped_runs_still_report_the_grad_norm(tmp_path):
    _, steps = fit(tmp_path, optimizer={"grad_clip": None}, logging={"log_every": 2})
    assert [s["step"] for s in steps] == [2, 4, 6]
    assert all(s["grad_norm"] > 0 for s in steps)


def test_cosine_schedule_with_warmup_and_floor():
    factor = lr_lambda(SchedulerConfig(name="cosine", warmup_steps=2, min_lr_ratio=0.1), 10)
    assert [factor(0), factor(1)] == [0.5, 1.0]
    assert factor(2) == pytest.approx(1.0)
    assert factor(6) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factor(10) == pytest.approx(0.1)
    assert factor(50) == pytest.approx(0.1)


def test_constant_schedule_with_warmup():
    factor = lr_lambda(SchedulerConfig(name="constant", warmup_steps=4, min_lr_ratio=0.1), 10)
    assert [factor(i) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_schedule_horizon_is_max_steps_unless_total_steps_is_set(tmp_path):
    _, steps = fit(
        tmp_path,
        optimizer={"lr": 0.1},
        scheduler={"name": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1},
    )
    lrs = [s["lr"] for s in steps]
    expected = lr_lambda(SchedulerConfig(warmup_steps=2, min_lr_ratio=0.1), 6)
    assert lrs == pytest.approx([0.1 * expected(step) for step in range(1, 7)])
    assert lrs[-1] == pytest.approx(0.01)  # reaches the floor exactly at run.max_steps

    _, steps = fit(
        tmp_path,
        optimizer={"lr": 0.1},
        scheduler={"warmup_steps": 2, "min_lr_ratio": 0.1, "total_steps": 12},
    )
    assert steps[-1]["lr"] > 0.05  # only halfway through a 12-step horizon
