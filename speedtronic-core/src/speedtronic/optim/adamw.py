"""AdamW and the parameter grouping shared by every configured optimizer.

Parameter grouping: weight matrices decay; 1-D parameters (norm weights, biases) and
embeddings do not, unless ``optimizer.decay_norms_and_biases`` is set. The grouping is logged at
startup and a custom model can override it by defining ``optimizer_param_groups(config)``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from speedtronic.config import OptimizerConfig
from speedtronic.errors import SpeedtronicError

__all__ = ["build_adamw", "decay_groups", "embedding_param_ids", "log_groups"]

log = logging.getLogger("speedtronic.optim")


def embedding_param_ids(model: nn.Module) -> set[int]:
    """ids of every parameter owned by an ``nn.Embedding`` (tied output heads included)."""
    return {
        id(p)
        for module in model.modules()
        if isinstance(module, nn.Embedding)
        for p in module.parameters(recurse=False)
    }


def decay_groups(model: nn.Module, config: OptimizerConfig) -> list[dict[str, Any]]:
    """Two AdamW groups, ``decay`` and ``no_decay``, each listing parameter names for logging."""
    embeddings = embedding_param_ids(model)
    decay: list[tuple[str, nn.Parameter]] = []
    no_decay: list[tuple[str, nn.Parameter]] = []
    for name, param in model.named_parameters():  # named_parameters dedups tied tensors
        if not param.requires_grad:
            continue
        is_matrix = param.ndim >= 2 and id(param) not in embeddings
        (decay if is_matrix or config.decay_norms_and_biases else no_decay).append((name, param))
    groups = []
    for label, items, wd in (("decay", decay, config.weight_decay), ("no_decay", no_decay, 0.0)):
        if items:
            groups.append(
                {
                    "params": [p for _, p in items],
                    "param_names": [n for n, _ in items],
                    "weight_decay": wd,
                    "group": label,
                }
            )
    return groups


def build_adamw(
    groups: list[dict[str, Any]], config: OptimizerConfig, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW, fused when it constructs on CUDA (unless ``fused: false``), else the default."""
    groups = list(groups)
    if not any(group["params"] if isinstance(group, dict) else True for group in groups):
        raise SpeedtronicError("the model has no trainable parameters (none requires grad)")
    kwargs = {"lr": config.lr, "betas": tuple(config.betas), "eps": config.eps}
    if config.fused and device.type != "cuda":
        log.info("optimizer.fused applies to CUDA only; using the default AdamW on %s", device.type)
    if device.type == "cuda" and config.fused is not False:
        try:
            optimizer = torch.optim.AdamW(groups, fused=True, **kwargs)
            log.info("using fused AdamW")
            return optimizer
        except (RuntimeError, TypeError, ValueError) as exc:
            level = logging.WARNING if config.fused else logging.INFO
            log.log(level, "fused AdamW unavailable (%s); using the default implementation", exc)
    return torch.optim.AdamW(groups, **kwargs)


def log_groups(optimizer: torch.optim.Optimizer) -> None:
    """Log each parameter group: optimizer, lr, weight decay and the first parameter names."""
    for group in optimizer.param_groups:
        names = group.get("param_names") or []
        log.info(
            "optimizer group %s (%s, lr %.3g, weight_decay %.3g): %d tensors%s",
            group.get("group", "?"),
            type(optimizer).__name__,
            group["lr"],
            group.get("weight_decay", 0.0),
            len(group["params"]),
            f" [{', '.join(names[:6])}{', ...' if len(names) > 6 else ''}]" if names else "",
        )
