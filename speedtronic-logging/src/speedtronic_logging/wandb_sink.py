"""The Weights & Biases backend: one W&B run per training run.

The redacted config becomes the run's config; metrics are charted against ``trainer/step`` (a
metric of its own, so events logged at the same or an earlier step, such as DiLoCo outer
steps, are never dropped by W&B's monotonic ``_step``). The API key is W&B's business: it is
read by W&B from its usual places and never passed through or written by Speedtronic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from speedtronic.config import SpeedtronicConfig
from speedtronic.schema import REDACTED
from speedtronic_logging.config import WandbConfig
from speedtronic_logging.extras import require

log = logging.getLogger("speedtronic.logging")

FEATURE = "W&B logging (wandb.enabled)"
STEP_METRIC = "trainer/step"


def load() -> Any:
    """Import ``wandb``, or raise the PluginError naming the ``[wandb]`` extra."""
    return require("wandb", "wandb", FEATURE)


def secret_values(config: Any) -> set[str]:
    """The values of every ``secret`` config field, found by walking the config's sections."""
    found: set[str] = set()
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        for field in dataclasses.fields(config):
            value = getattr(config, field.name)
            if field.metadata.get("secret"):
                if isinstance(value, str) and value:
                    found.add(value)
            else:
                found |= secret_values(value)
    elif isinstance(config, dict):
        for value in config.values():
            found |= secret_values(value)
    return found


@contextlib.contextmanager
def scrubbed_argv(secrets: set[str]) -> Iterator[None]:
    """Hide secrets given on the command line (``--set x.token=...``) while W&B records argv.

    W&B stores the process arguments in the run's metadata when the run starts; a secret
    passed as an override would otherwise reach W&B even though the config is redacted.
    """
    original = sys.argv
    cleaned = []
    for arg in original:
        for secret in sorted(secrets, key=len, reverse=True):
            arg = arg.replace(secret, REDACTED)
        cleaned.append(arg)
    sys.argv = cleaned
    try:
        yield
    finally:
        sys.argv = original


class WandbBackend:
    """Logs one training run to W&B (or into the W&B run the caller already started)."""

    label = "W&B"

    def __init__(
        self, settings: WandbConfig, config: SpeedtronicConfig, resume_id: str | None = None
    ) -> None:
        wandb = load()
        hyperparameters = config.to_dict(redact=True)
        self._prefixes: set[str] = set()
        # A run the user started before calling Speedtronic is theirs: log into it and leave
        # finishing it to them.
        self.owns_run = wandb.run is None
        if self.owns_run:
            directory = Path(settings.dir) if settings.dir else config.output_dir
            directory.mkdir(parents=True, exist_ok=True)
            secrets = secret_values(config)
            api_key = os.environ.get("WANDB_API_KEY")
            if api_key:
                secrets.add(api_key)
            with scrubbed_argv(secrets):
                self.run = wandb.init(
                    project=settings.project,
                    entity=settings.entity,
                    name=settings.name or config.run.name,
                    group=settings.group,
                    tags=list(settings.tags) or None,
                    mode=settings.mode,
                    dir=str(directory),
                    # A resumed run already has a config: overwrite it explicitly below.
                    config=None if resume_id else hyperparameters,
                    id=resume_id,
                    resume="allow" if resume_id else None,
                )
            if resume_id:
                self.run.config.update(hyperparameters, allow_val_change=True)
        else:
            self.run = wandb.run
            self.run.config.update(hyperparameters, allow_val_change=True)
        self.run.define_metric(STEP_METRIC, hidden=True)
        log.info("W&B run %s (%s mode)", self.run_id, settings.mode)

    @property
    def run_id(self) -> str | None:
        """The W&B run id, kept in checkpoints so a resumed training continues the same run."""
        return getattr(self.run, "id", None)

    def log_run_info(self, step: int, info: dict[str, Any]) -> None:
        """The ``train_start`` facts go into the run config under ``run_info``."""
        self.run.config.update({"run_info": info}, allow_val_change=True)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """One W&B history row: the scalars plus ``trainer/step`` as their x-axis."""
        for name in scalars:
            prefix = name.split("/", 1)[0]
            if prefix not in self._prefixes:
                self._prefixes.add(prefix)
                self.run.define_metric(f"{prefix}/*", step_metric=STEP_METRIC)
        self.run.log({STEP_METRIC: step, **scalars})

    def log_summary(self, step: int, summary: dict[str, Any]) -> None:
        """The final summary into the run summary."""
        self.run.summary.update(summary)

    def finish(self, error: BaseException | None) -> None:
        """Finish a run this backend started (exit code 1 after a training error)."""
        if self.owns_run:
            self.run.finish(exit_code=0 if error is None else 1)
