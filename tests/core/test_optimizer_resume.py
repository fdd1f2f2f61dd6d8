"""Exact resume and the weight-replacement reset with Muon and with cautious masking, through
the runtime, checkpoints on disk and gradient accumulation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from core import toy_runs

from speedtronic import hookimpl
from speedtronic.optim.cautious import CautiousOptimizer
from speedtronic.optim.combined import CombinedOptimizer
from speedtronic.plugins import register, unregister

OPTIONS = {
    "muon": {"name": "muon"},
    "cautious": {"name": "adamw", "cautious": True},
    "muon+cautious": {"name": "muon", "cautious": True},
}


def config(output: Path, max_steps: int, optimizer: dict[str, Any], **extra: Any) -> dict:
    return {
        "run": {"max_steps": max_steps, "device": "cpu", "seed": 3, "output_dir": str(output)},
        "model": {
            "name": "reference_transformer",
            "vocab_size": 64,
            "max_seq_len": 16,
            "n_layer": 1,
            "n_head": 2,
            "d_model": 32,
        },
        "data": {"micro_batch_size": 2, "target_batch_size": 4},  # 2 accumulation steps
        "optimizer": {
            "lr": 3e-3,
            "weight_decay": 0.1,
            "grad_clip": 1.0,
            "muon": {"weight_decay": 0.01},
            **optimizer,
        },
        # A fixed horizon, so the 8-step leg follows the same schedule as the 16-step run.
        "scheduler": {"warmup_steps": 3, "total_steps": 16},
        "checkpoint": {"interval": 8, "keep_last": 2, "resume": True},
        "logging": {"log_every": 1},
        **extra,
    }


def train(cfg: dict) -> tuple[dict[int, float], Any]:
    """The per-step losses and the trainer of one run of ``cfg``."""
    _, recorder, trainer = toy_runs.train(cfg)
    return recorder.losses, trainer


@pytest.mark.parametrize("option", list(OPTIONS))
def test_resume_equals_straight_run(tmp_path: Path, option: str) -> None:
    optimizer = OPTIONS[option]
    straight, straight_trainer = train(config(tmp_path / "straight", 16, optimizer))
    first, first_trainer = train(config(tmp_path / "resumed", 8, optimizer))
    wrapper = CautiousOptimizer if optimizer.get("cautious") else CombinedOptimizer
    assert isinstance(first_trainer.optimizer, wrapper)
    second, second_trainer = train(config(tmp_path / "resumed", 16, optimizer))
    assert second_trainer.resumed_from == 8
    assert sorted(first) == list(range(1, 9)) and sorted(second) == list(range(9, 17))
    for step in range(1, 17):
        resumed = first[step] if step <= 8 else second[step]
        assert resumed == pytest.approx(straight[step], abs=1e-6), step
    for a, b in zip(
        straight_trainer.model.parameters(), second_trainer.model.parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


class ReplaceWeightsAt:
    """A DiLoCo-like plugin: reports replaced weights at one step and records what it sees."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.adam_steps: dict[int, float] = {}
        self.momentum_norms: dict[int, float] = {}

    @hookimpl
    def after_optimizer_step(self, trainer: Any, model: Any, step: int) -> bool:
        optimizer = trainer.optimizer.base  # cautious around the Muon + AdamW combination
        adamw, muon = optimizer.optimizers["adamw"], optimizer.optimizers["muon"]
        self.adam_steps[step] = float(adamw.state[model.tok_emb.weight]["step"])
        self.momentum_norms[step] = float(
            muon.state[model.blocks[0].attn.qkv.weight]["momentum_buffer"].norm()
        )
        return step == self.step


def test_weight_replacement_resets_both_optimizers_through_the_wrapper(tmp_path: Path) -> None:
    plugin = ReplaceWeightsAt(step=2)
    name = register(plugin, name="test-replace-weights")
    try:
        cfg = config(tmp_path, 4, OPTIONS["muon+cautious"])
        cfg["checkpoint"] = {"interval": 0, "save_final": False}
        train(cfg)
    finally:
        unregister(name)
    # Step 3 starts from empty state: AdamW counts from 1 again; Muon's momentum restarts.
    assert plugin.adam_steps == {1: 1.0, 2: 2.0, 3: 1.0, 4: 2.0}
    assert plugin.momentum_norms[3] < plugin.momentum_norms[2]
