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
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from speedtronic.schema import REDACTED
from speedtronic_logging.config import WandbConfig
from speedtronic_logging.extras import require
from speedtronic_logging.sink import BackendSink, RunStart, section_settings, settings_of

log = logging.getLogger("speedtronic.logging")

FEATURE = "W&B logging (wandb.enabled, WandbSink)"
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


# sys.argv belongs to the process: two runs starting at once in two threads must not interleave
# their scrubbing (one would restore the other's scrubbed copy for good).
_ARGV_LOCK = threading.Lock()


@contextlib.contextmanager
def scrubbed_argv(secrets: set[str]) -> Iterator[None]:
    """Hide secrets given on the command line (``--set x.token=...``) while W&B records argv.

    W&B stores the process arguments in the run's metadata when the run starts; a secret
    passed as an override would otherwise reach W&B even though the config is redacted.
    """
    with _ARGV_LOCK:
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

    def __init__(
        self,
        settings: WandbConfig,
        run: RunStart,
        resume_id: str | None = None,
        secrets: Iterable[str] = (),
    ) -> None:
        wandb = load()
        hyperparameters = run.hyperparameters
        self._prefixes: set[str] = set()
        # A run the user started (the global ``wandb.run``) before calling Speedtronic is
        # theirs: log into it and leave finishing it to them. Runs started here never become
        # the global run (``reinit="create_new"``), so two trainings at once in one process
        # each get their own.
        self.owns_run = wandb.run is None
        if self.owns_run:
            directory = Path(settings.dir) if settings.dir else run.output_dir
            directory.mkdir(parents=True, exist_ok=True)
            hidden = set(secrets)
            api_key = os.environ.get("WANDB_API_KEY")
            if api_key:
                hidden.add(api_key)
            with scrubbed_argv(hidden):
                self.run = wandb.init(
                    project=settings.project,
                    entity=settings.entity,
                    name=settings.name or run.run_name,
                    group=settings.group,
                    tags=list(settings.tags) or None,
                    mode=settings.mode,
                    dir=str(directory),
                    # A resumed run already has a config: overwrite it explicitly below.
                    config=None if resume_id else hyperparameters,
                    id=resume_id,
                    resume="allow" if resume_id else None,
                    reinit="create_new",
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

    def finish(self, failed: bool) -> None:
        """Finish a run this backend started (exit code 1 after a training error)."""
        if self.owns_run:
            self.run.finish(exit_code=1 if failed else 0)


class WandbSink(BackendSink):
    """Weights & Biases as a metric sink: ``MetricLogger(hooks=[WandbSink(project="p")])``.

    Takes the settings of the ``wandb:`` section (``project``, ``entity``, ``name``, ``group``,
    ``tags``, ``mode``, ``dir``), checked the same way. Each ``train_start`` event starts a W&B
    run (or logs into the one your code started with ``wandb.init()``) and ``close()`` finishes
    it, with exit code 1 when the ``train_end`` summary reports an error. ``resume_id``
    continues an existing W&B run; ``secrets`` are strings hidden from the command line W&B
    records (``WANDB_API_KEY`` always is). Raises :class:`~speedtronic.PluginError` naming the
    ``[wandb]`` extra when ``wandb`` is missing.
    """

    label = "W&B"

    def __init__(
        self, *, resume_id: str | None = None, secrets: Iterable[str] = (), **settings: Any
    ) -> None:
        self.settings: WandbConfig = section_settings(WandbConfig, "wandb", settings)
        load()
        super().__init__()
        self.resume_id = resume_id
        self.secrets = set(secrets)
        self.run_id: str | None = None

    @classmethod
    def from_section(
        cls, section: WandbConfig, *, resume_id: str | None = None, secrets: Iterable[str] = ()
    ) -> WandbSink:
        """The sink a config's ``wandb:`` section describes."""
        return cls(resume_id=resume_id, secrets=secrets, **settings_of(section))

    def open_backend(self, run: RunStart) -> WandbBackend:
        """A W&B run for the training run that ``train_start`` announced."""
        backend = WandbBackend(self.settings, run, self.resume_id, self.secrets)
        self.run_id = backend.run_id
        return backend
