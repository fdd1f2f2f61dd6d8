"""The profiler window (``profile`` section, ``speedtronic train --profile START:END``).

:class:`StepProfiler` wraps optimizer steps ``start`` to ``end`` (inclusive, counted as the
``step`` field counts them) in :class:`torch.profiler.profile`, then writes a Chrome / Perfetto
trace (TensorBoard's profiler plugin reads it too) to
``<output_dir>/profile/trace_rank<R>_step<START>-<END>.json`` and logs the ten operators with
the most self time. Outside the window the loop pays one integer comparison per step; no
profiler object exists before ``start`` or after ``end``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from speedtronic.config import ProfileConfig

__all__ = ["StepProfiler", "build_profiler", "trace_path"]

log = logging.getLogger("speedtronic.profile")

TOP_OPERATORS = 10


def trace_path(output_dir: str | Path, rank: int, start: int, end: int) -> Path:
    """Where the trace of steps ``start``..``end`` on ``rank`` goes."""
    return Path(output_dir) / "profile" / f"trace_rank{rank}_step{start}-{end}.json"


class StepProfiler:
    """Profiles the optimizer steps ``config.start``..``config.end`` of one run on one rank."""

    def __init__(
        self, config: ProfileConfig, output_dir: str | Path, device: torch.device, rank: int = 0
    ) -> None:
        assert config.start is not None and config.end is not None
        self.config = config
        self.start, self.end = config.start, config.end
        self.path = trace_path(output_dir, rank, self.start, self.end)
        self.device = device
        self._profiler: Any = None
        self.top_table = ""

    def step_begins(self, step: int) -> None:
        """Called before optimizer step ``step`` (1-based) runs; opens the window at ``start``."""
        if step == self.start and self._profiler is None:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._profiler = profile(
                activities=activities,
                record_shapes=self.config.record_shapes,
                profile_memory=self.config.memory,
            )
            self._profiler.__enter__()
            log.info("profiling steps %d to %d", self.start, self.end)

    def step_ended(self, step: int) -> Path | None:
        """Called after optimizer step ``step``; closes the window after ``end`` and returns
        the trace's path then (None otherwise)."""
        if self._profiler is None or step < self.end:
            return None
        return self._finish()

    def _finish(self) -> Path:
        profiler, self._profiler = self._profiler, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the window's kernels end inside it
        profiler.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # The trace is a diagnostic that can be produced again: a plain write, no fsync.
        profiler.export_chrome_trace(str(self.path))
        sort_by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        self.top_table = profiler.key_averages().table(sort_by=sort_by, row_limit=TOP_OPERATORS)
        log.info(
            "profile of steps %d-%d: %s\ntop %d operators by self time:\n%s",
            self.start,
            self.end,
            self.path,
            TOP_OPERATORS,
            self.top_table,
        )
        return self.path

    def close(self) -> None:
        """Stop a window the run left open (it failed, or ended before ``end``); nothing is
        written then."""
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.__exit__(None, None, None)
            log.warning(
                "the run ended inside the profiler window (steps %d to %d): no trace written",
                self.start,
                self.end,
            )


def build_profiler(
    config: ProfileConfig, output_dir: str | Path, device: torch.device, rank: int, is_main: bool
) -> StepProfiler | None:
    """A profiler for this rank when the ``profile`` section asks for one: rank 0 only unless
    ``profile.all_ranks``; None otherwise."""
    if config.start is None or (not is_main and not config.all_ranks):
        return None
    return StepProfiler(config, output_dir, device, rank)
