"""The per-run object of the plugin: the sinks one training run logs to.

It lives in ``trainer.plugin_state["logging"]`` (which core empties when ``fit`` starts and after
``on_train_end``), so it belongs to its run alone: two runs in one process, one after another or
at the same time, never see each other's events. Its sinks are the public
:class:`~speedtronic_logging.WandbSink` and :class:`~speedtronic_logging.TensorBoardSink`, built
from the config's sections.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from speedtronic.config import SpeedtronicConfig
from speedtronic_logging.config import SECTIONS, is_customised
from speedtronic_logging.sink import BackendSink
from speedtronic_logging.tensorboard_sink import TensorBoardSink
from speedtronic_logging.wandb_sink import WandbSink, secret_values

log = logging.getLogger("speedtronic.logging")


@dataclass
class RunLogging:
    """What the logging plugin keeps about one run: the W&B run id it resumes (restored from a
    checkpoint before the run starts) and, once started, the sinks its config enables."""

    resume_wandb_id: str | None = None
    sinks: list[BackendSink] = field(default_factory=list)

    def start(self, config: SpeedtronicConfig) -> None:
        """Build the sinks that ``config`` enables; they open at the ``train_start`` event.

        Building a sink imports its backend, so a missing package fails the run with one
        PluginError naming the extra, before any W&B run or event file exists.
        """
        for name in SECTIONS:
            section = config.plugins.get(name)
            if section is not None and not section.enabled and is_customised(section):
                log.info(
                    "the %s section is configured but %s.enabled is false; not logging to it",
                    name,
                    name,
                )
        sinks: list[BackendSink] = []
        wandb_settings = config.plugins.get("wandb")
        if wandb_settings is not None and wandb_settings.enabled:
            sinks.append(
                WandbSink.from_section(
                    wandb_settings, resume_id=self.resume_wandb_id, secrets=secret_values(config)
                )
            )
        tensorboard_settings = config.plugins.get("tensorboard")
        if tensorboard_settings is not None and tensorboard_settings.enabled:
            sinks.append(TensorBoardSink.from_section(tensorboard_settings))
        self.sinks = sinks

    def on_event(self, event: str, payload: dict[str, Any]) -> None:
        """Send one metric event of this run to its sinks."""
        for sink in self.sinks:
            sink.on_event(event, payload)

    def close(self, error: BaseException | None) -> None:
        """Finish every sink; ``error`` (the exception that ended training) marks them failed."""
        for sink in self.sinks:
            sink.close(error)

    @property
    def wandb_run_id(self) -> str | None:
        """The W&B run this run logs to, else the one it was resumed with."""
        for sink in self.sinks:
            if isinstance(sink, WandbSink) and sink.run_id:
                return sink.run_id
        return self.resume_wandb_id
