"""The ``wandb:`` and ``tensorboard:`` config sections this plugin contributes.

Both sinks are off unless ``enabled: true``: installing the plugin never starts a W&B run or
writes event files on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from speedtronic.schema import Section, option


@dataclass
class WandbConfig(Section):
    """The ``wandb`` section: where and how metrics go to Weights & Biases."""

    enabled: bool = option(
        False, help="Send metrics to Weights & Biases (needs `speedtronic-logging[wandb]`)."
    )
    project: str | None = option(None, help="W&B project; W&B's default project when unset.")
    entity: str | None = option(
        None, help="W&B entity (user or team); your default entity when unset."
    )
    name: str | None = option(None, help="Run name shown in W&B; defaults to `run.name`.")
    group: str | None = option(
        None, help="Groups runs in the W&B UI, e.g. the master and workers of one DiLoCo job."
    )
    tags: list[str] = option(default_factory=list, help="Tags attached to the W&B run.")
    mode: Literal["online", "offline", "disabled"] = option(
        "online",
        help="`online` streams to the W&B server, `offline` only writes local files (upload "
        "later with `wandb sync`), `disabled` makes every W&B call a no-op.",
    )
    dir: str | None = option(
        None,
        help="Folder under which W&B writes its `wandb/` directory; defaults to `run.output_dir`.",
    )


@dataclass
class TensorBoardConfig(Section):
    """The ``tensorboard`` section: event files for TensorBoard."""

    enabled: bool = option(
        False, help="Write TensorBoard event files (needs `speedtronic-logging[tensorboard]`)."
    )
    log_dir: str | None = option(
        None, help="Event-file directory; defaults to `<run.output_dir>/tensorboard`."
    )
    flush_secs: int = option(
        30, ge=1, help="Seconds between flushes of pending events to disk (and at the end)."
    )


SECTIONS: dict[str, type] = {"wandb": WandbConfig, "tensorboard": TensorBoardConfig}


def is_customised(section: object) -> bool:
    """True when any field other than ``enabled`` differs from its default."""
    default = type(section)()
    return any(
        getattr(section, f.name) != getattr(default, f.name)
        for f in fields(section)  # type: ignore[arg-type]
        if f.name != "enabled"
    )
