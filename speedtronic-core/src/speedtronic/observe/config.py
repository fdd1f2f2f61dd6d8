"""The config sections of what a run shows about itself: ``logging`` and ``profile``.

Gathered, with every other section, by :mod:`speedtronic.config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from speedtronic.errors import ConfigError
from speedtronic.schema import Section, option

__all__ = ["LoggingConfig", "ProfileConfig"]


@dataclass
class ProfileConfig(Section):
    """The ``profile`` section: a torch.profiler window around a few optimizer steps."""

    start: int | None = option(
        None,
        ge=1,
        help="First optimizer step profiled (as the `step` field counts); unset: no profiling. "
        "`speedtronic train --profile START:END` sets `start` and `end`.",
    )
    end: int | None = option(
        None, ge=1, help="Last optimizer step profiled (inclusive); defaults to `start`."
    )
    record_shapes: bool = option(False, help="Record operator input shapes (torch.profiler).")
    memory: bool = option(False, help="Record tensor allocations (torch.profiler profile_memory).")
    all_ranks: bool = option(
        False, help="Under DDP, profile every rank (one trace each); by default rank 0 only."
    )

    def validate(self) -> None:
        if self.end is not None and self.start is None:
            raise ConfigError("is set but profile.start is not", "end")
        if self.start is not None:
            if self.end is None:
                self.end = self.start
            if self.end < self.start:
                raise ConfigError(f"must be >= start ({self.start}), got {self.end}", "end")


@dataclass
class LoggingConfig(Section):
    """The ``logging`` section: log level, metric files and extra metric hooks."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = option(
        "INFO", help="Log level of the `speedtronic` loggers."
    )
    file: str | None = option(None, help="Append human-readable metric lines to this file.")
    json_file: str | None = option(
        None,
        help="Append one JSON object per metric event here (what `speedtronic plot` reads); "
        'unset: `<run.output_dir>/metrics.jsonl`; `""`: no JSONL file.',
    )
    log_every: int = option(10, ge=1, help="Read the loss and emit a `step` event every N steps.")
    hooks: list[str] = option(
        default_factory=list,
        help="Extra metric hooks as `module:attribute` import paths: callables "
        "`(event, payload)` or objects with `on_event`.",
    )
    progress: bool = option(True, help="Show a rich progress bar when stdout is a terminal.")
