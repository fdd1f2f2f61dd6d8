"""The ``checkpoint`` section of a run's config.

Gathered, with every other section, by :mod:`speedtronic.config`."""

from __future__ import annotations

from dataclasses import dataclass

from speedtronic.schema import Section, option

__all__ = ["CheckpointConfig"]


@dataclass
class CheckpointConfig(Section):
    """The ``checkpoint`` section: where, how often, how many, and resuming."""

    directory: str | None = option(
        None, help="Checkpoint directory; defaults to `<run.output_dir>/checkpoints`."
    )
    interval: int = option(0, ge=0, help="Save every N optimizer steps; 0 = only the final one.")
    keep_last: int = option(3, ge=1, help="How many complete checkpoints to keep.")
    resume: bool = option(
        False, help="Resume from the newest usable checkpoint; start fresh if there is none."
    )
    allow_fresh_start: bool = option(
        False,
        help="With resume: start from scratch even if checkpoints exist but none is usable "
        "(otherwise that is an error).",
    )
    every_seconds: float | None = option(
        None,
        gt=0,
        help="Also save when this many seconds passed since the last save (checked at step "
        "boundaries; the ranks of a data-parallel run agree); unset: steps only.",
    )
    async_save: bool = option(
        False,
        help="Copy the state to CPU memory at the save step and write it in a background "
        "thread while training goes on (one write in flight; a failure is raised at the next "
        "step). The run's end and a stop signal wait for it. With `parallel.strategy: fsdp` "
        "every rank copies its shards and writes them in the background.",
    )
    save_final: bool = option(True, help="Save at the end of a successful fit.")
    save_retry_pause: float = option(
        10.0,
        ge=0,
        le=3600,
        help="Seconds to wait before retrying a save that failed (disk full, I/O error) once; "
        "a second failure stops the run cleanly with the previous checkpoints intact.",
    )
    keep_best: bool = option(
        False,
        help="Keep the checkpoint with the lowest eval loss (`best.json` names it) besides "
        "the last `keep_last`; retention never deletes it. Needs the `eval` section.",
    )
