"""The learning-rate schedule: linear warmup, then cosine decay to a floor, or constant."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from speedtronic.config import SchedulerConfig

__all__ = ["build_scheduler", "lr_lambda"]


def lr_lambda(config: SchedulerConfig, max_steps: int) -> Callable[[int], float]:
    """The multiplier of the peak lr at optimizer step ``step`` (0-based)."""
    horizon = config.total_steps or max_steps
    warmup = config.warmup_steps
    floor = config.min_lr_ratio

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if config.name == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, horizon - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: SchedulerConfig, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup then cosine (to ``min_lr_ratio``) or constant, over ``total_steps`` or max_steps."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config, max_steps))
