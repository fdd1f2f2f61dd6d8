"""The one place that decides which optimizer a run gets: configured, or the caller's own."""

from __future__ import annotations

import logging

import torch
from torch import nn

from speedtronic.config import OptimizerConfig
from speedtronic.optim.adamw import build_adamw, decay_groups, log_groups

__all__ = ["build_optimizer"]

log = logging.getLogger("speedtronic.optim")


def build_optimizer(
    model: nn.Module,
    config: OptimizerConfig,
    device: torch.device,
    optimizer: torch.optim.Optimizer | None = None,
) -> torch.optim.Optimizer:
    """The configured optimizer over ``model``'s trainable parameters, or ``optimizer`` when
    the caller brings one. Either way ``optimizer.cautious`` wraps it in cautious masking (one
    the caller already wrapped is kept as it is)."""
    from speedtronic.optim.cautious import CautiousOptimizer

    if optimizer is None:
        if config.name == "muon":
            from speedtronic.optim.muon import build_muon_optimizer

            optimizer = build_muon_optimizer(model, config, device)
        else:
            custom = getattr(model, "optimizer_param_groups", None)
            groups = custom(config) if callable(custom) else decay_groups(model, config)
            optimizer = build_adamw(groups, config, device)
            log_groups(optimizer)
    if config.cautious and not isinstance(optimizer, CautiousOptimizer):
        log.info("cautious masking on around %s", type(optimizer).__name__)
        optimizer = CautiousOptimizer(optimizer)
    return optimizer
