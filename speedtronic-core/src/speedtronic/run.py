"""The run as a plugin sees it: :class:`TrainerLike`, the type of every hook's ``trainer``.

A structural protocol rather than the :class:`~speedtronic.trainer.Trainer` class, so the hook
contract names exactly what a plugin may rely on, a test can hand a hook a small object of its
own, and importing the contract stays as light as ``hookspecs`` (no torch at import time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: this module is imported by the hook contract
    from torch import nn

    from speedtronic.config import SpeedtronicConfig
    from speedtronic.parallel.context import ParallelContext

__all__ = ["TrainerLike"]


@runtime_checkable
class TrainerLike(Protocol):
    """What a hook may use of the run it is called for.

    ``plugin_state`` is the per-run home of plugins (``plugin_state["my_plugin"]``), empty when
    a run begins and emptied after ``on_train_end``. ``reset_optimizer_on_weight_replace`` may
    be set by a plugin that replaces weights (``after_optimizer_step`` returning True) and keeps
    the optimizer state. ``evaluator`` is the run's held-out evaluator, ``None`` without an
    ``eval`` section.
    """

    config: SpeedtronicConfig
    model: nn.Module
    optimizer: Any
    step: int
    plugin_state: dict[str, Any]
    parallel: ParallelContext
    evaluator: Any
    reset_optimizer_on_weight_replace: bool

    def emit(self, event: str, payload: dict[str, Any]) -> None:
        """Send a metric event of this run to its sinks and to every ``on_metric`` hook."""

    def request_stop(self) -> None:
        """Stop the run after the step in progress, with a checkpoint at that step."""
