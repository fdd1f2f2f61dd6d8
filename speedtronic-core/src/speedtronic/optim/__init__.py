"""Optimizers and schedules: AdamW with decay groups, Muon, cautious masking, the combined
optimizer that Muon and cautious build on, and the warmup/cosine schedule."""

from __future__ import annotations

from typing import TYPE_CHECKING

from speedtronic._lazy import by_module, lazy_exports

if TYPE_CHECKING:
    from speedtronic.optim.adamw import build_adamw, decay_groups, embedding_param_ids, log_groups
    from speedtronic.optim.cautious import CautiousOptimizer
    from speedtronic.optim.combined import CombinedOptimizer, reset_optimizer_state
    from speedtronic.optim.factory import build_optimizer
    from speedtronic.optim.muon import build_muon_optimizer
    from speedtronic.optim.schedule import build_scheduler, lr_lambda

__all__ = [
    "CautiousOptimizer",
    "CombinedOptimizer",
    "build_adamw",
    "build_muon_optimizer",
    "build_optimizer",
    "build_scheduler",
    "decay_groups",
    "embedding_param_ids",
    "log_groups",
    "lr_lambda",
    "reset_optimizer_state",
]

_EXPORTS = by_module(
    {
        "cautious": ("CautiousOptimizer",),
        "combined": ("CombinedOptimizer", "reset_optimizer_state"),
        "adamw": ("build_adamw", "decay_groups", "embedding_param_ids", "log_groups"),
        "muon": ("build_muon_optimizer",),
        "factory": ("build_optimizer",),
        "schedule": ("build_scheduler", "lr_lambda"),
    }
)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
