"""The run as a plugin sees it: :class:`TrainerLike`, the type of every hook's ``trainer``,
and :class:`ConfigLike`, the type of its ``config``.

Structural protocols rather than the :class:`~speedtronic.engine.trainer.Trainer` and
:class:`~speedtronic.config.SpeedtronicConfig` classes, so the hook contract names exactly what
a plugin may rely on, a test can hand a hook a small object of its own, and importing the
contract stays as light as ``hookspecs`` (no torch at import time). ``ConfigLike`` also keeps
the contract below the config loader, which asks the plugins for their sections: the hook
contract needs the section types, not the loader.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: this module is imported by the hook contract
    from torch import nn

    from speedtronic.config import sections
    from speedtronic.parallel.context import ParallelContext

__all__ = ["ConfigLike", "TrainerLike"]


class ConfigLike(Protocol):
    """The validated config of a run as a hook sees it: the core sections, typed, and each
    plugin's section as an attribute (``config.distributed``) and in ``plugins``.
    :class:`~speedtronic.config.SpeedtronicConfig` is one (a test keeps the two in step)."""

    run: sections.RunConfig
    model: sections.ModelConfig
    data: sections.DataConfig
    optimizer: sections.OptimizerConfig
    scheduler: sections.SchedulerConfig
    precision: sections.PrecisionConfig
    compile: sections.CompileConfig
    ooo_backprop: sections.OOOBackpropConfig
    gradient_checkpointing: bool
    checkpoint: sections.CheckpointConfig
    eval: sections.EvalConfig
    parallel: sections.ParallelConfig
    logging: sections.LoggingConfig
    profile: sections.ProfileConfig
    plugins: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        """A plugin's section by name."""


@runtime_checkable
class TrainerLike(Protocol):
    """What a hook may use of the run it is called for.

    ``plugin_state`` is the per-run home of plugins (``plugin_state["my_plugin"]``), empty when
    a run begins and emptied after ``on_train_end``. ``reset_optimizer_on_weight_replace`` may
    be set by a plugin that replaces weights (``after_optimizer_step`` returning True) and keeps
    the optimizer state. ``evaluator`` is the run's held-out evaluator, ``None`` without an
    ``eval`` section.
    """

    config: ConfigLike
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
