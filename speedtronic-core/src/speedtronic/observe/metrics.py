"""Metric events and their sinks: stdout (rich), a text file, a JSONL file, hooks and plugins.

A metric event is ``(event, payload)``: ``event`` names what happened (``"train_start"``,
``"step"``, ``"checkpoint"``, ``"optimizer_step_skipped"``, ``"train_end"``, plugin events such
as ``"outer_step"``) and ``payload`` is a mapping of JSON-compatible values carrying ``step``
where one applies. A sink that fails is reported once and then skipped: metrics never stop
training.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TextIO

from speedtronic.errors import ConfigError

__all__ = [
    "ConsoleSink",
    "EventSink",
    "JsonlSink",
    "MetricLogger",
    "TextFileSink",
    "ThroughputMeter",
    "as_sink",
    "format_payload",
    "import_hook",
    "json_safe",
    "live_line",
    "process_memory_mb",
]

log = logging.getLogger("speedtronic.metrics")

Hook = Callable[[str, dict[str, Any]], None]


class EventSink(Protocol):
    """Anything with ``on_event(event, payload)``; an optional ``close()`` is called at the end."""

    def on_event(self, event: str, payload: dict[str, Any]) -> None: ...


def format_payload(payload: dict[str, Any]) -> str:
    """``key=value`` pairs with compact numbers; nested values are left out."""
    parts = []
    for key, value in payload.items():
        if isinstance(value, (dict, list, tuple)):
            continue
        if isinstance(value, float):
            text = f"{value:.4g}" if math.isfinite(value) else str(value)
        else:
            text = str(value)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def json_safe(value: Any) -> Any:
    """``value`` with NaN/inf floats replaced by ``None``, so every line is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class _AppendingFileSink:
    """A sink writing lines to a text file, opened for appending on first use and again after
    ``close()``, so one sink can serve several ``fit`` calls."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._handle: TextIO | None = None

    def _write_line(self, line: str) -> None:
        if self._handle is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - see close()
        self._handle.write(line + "\n")
        # Flushed per event: events are rare (log cadence) and a crash should not lose them.
        self._handle.flush()

    def close(self) -> None:
        """Close the file (it reopens if another event arrives)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None


class TextFileSink(_AppendingFileSink):
    """Appends ``<time> <event> key=value ...`` lines to a file (``logging.file``)."""

    def on_event(self, event: str, payload: dict[str, Any]) -> None:
        """Write one line."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        self._write_line(f"{stamp} {event} {format_payload(payload)}")


class JsonlSink(_AppendingFileSink):
    """Appends one JSON object per event, ``{"event", "time", **payload}``
    (``logging.json_file``)."""

    def on_event(self, event: str, payload: dict[str, Any]) -> None:
        """Write one JSON line."""
        record = json_safe({"event": event, "time": time.time(), **payload})
        self._write_line(json.dumps(record, default=str, allow_nan=False))


class ConsoleSink:
    """stdout: on a terminal, a rich progress bar that moves every optimizer step (steps/s and
    ETA from the first steps) with a live line of the last logged loss, lr and tokens/s under
    it; plain ``event key=value`` lines otherwise (pipes, files, CI logs).

    While the bar is shown, writes to ``sys.stdout``/``sys.stderr`` (log records of the CLI's
    handler included) are printed above it, so lines never splice into the bar.
    """

    def __init__(
        self, total_steps: int | None = None, progress: bool = True, stream: TextIO | None = None
    ) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.total_steps = total_steps
        isatty = getattr(self.stream, "isatty", None)
        self.interactive = bool(progress and callable(isatty) and isatty())
        self._progress: Any = None
        self._task: Any = None

    def on_event(self, event: str, payload: dict[str, Any]) -> None:
        """Start the bar on ``train_start``, refresh the live line on ``step``; print everything
        else as a line."""
        if not self.interactive:
            self.stream.write(f"{event} {format_payload(payload)}\n")
            self.stream.flush()
            return
        if event == "train_start":
            self._start_bar(payload)
        if event == "step" and self._task is not None:
            self._progress.live_line = live_line(payload)
            self._progress.update(self._task, completed=payload.get("step", 0))
        elif self._progress is not None:
            self._progress.console.print(f"{event} {format_payload(payload)}", highlight=False)
        else:
            self.stream.write(f"{event} {format_payload(payload)}\n")
        if event == "train_end":
            self.close()

    def on_progress(self, step: int) -> None:
        """Move the bar to ``step`` (called every optimizer step; no device sync)."""
        if self._task is not None:
            self._progress.update(self._task, completed=step)

    def _start_bar(self, payload: dict[str, Any]) -> None:
        from rich.console import Console

        self.close()
        self._progress = _progress_bar(Console(file=self.stream))
        self._progress.start()
        self._task = self._progress.add_task(
            "train",
            total=payload.get("max_steps", self.total_steps),
            completed=payload.get("start_step", 0),
        )

    def close(self) -> None:
        """Stop the progress bar, leaving its last state on screen."""
        if self._progress is not None:
            self._progress.stop()
        self._progress = None
        self._task = None


def live_line(payload: dict[str, Any]) -> str:
    """The compact line under the bar: loss, lr, tokens/s, TFLOP/s and MFU of the last logged
    step (the last two when the run reports them)."""
    parts = []
    for key, label, spec in (
        ("loss", "loss", ".4f"),
        ("lr", "lr", ".3g"),
        ("tokens_per_sec", "tok/s", ",.0f"),
        ("tflops", "TFLOP/s", ".3g"),
        ("mfu", "MFU", ".1%"),
    ):
        value = payload.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            parts.append(f"{label} {value:{spec}}")
    return "  ".join(parts)


def _progress_bar(console: Any) -> Any:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class StepsPerSecond(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("" if speed is None else f"{speed:.1f} steps/s")

    class BarWithLine(Progress):
        live_line = ""

        def get_renderables(self) -> Any:
            yield self.make_tasks_table(self.tasks)
            if self.live_line:
                yield Text(f"  {self.live_line}")

    return BarWithLine(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        StepsPerSecond(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        speed_estimate_period=60.0,
    )


class _CallableSink:
    def __init__(self, fn: Hook) -> None:
        self.fn = fn

    def on_event(self, event: str, payload: dict[str, Any]) -> None:
        self.fn(event, payload)

    def __repr__(self) -> str:
        return f"hook {getattr(self.fn, '__qualname__', repr(self.fn))}"


def as_sink(hook: Any) -> EventSink:
    """Accept an object with ``on_event`` or a callable ``(event, payload)``."""
    if callable(getattr(hook, "on_event", None)):
        return hook
    if callable(hook):
        return _CallableSink(hook)
    raise TypeError(f"a metric hook must be callable or have on_event(), got {hook!r}")


def import_hook(path: str) -> Any:
    """Resolve a ``module:attribute`` path from ``logging.hooks`` (a class is instantiated)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{path!r} must look like module:attribute", "logging.hooks")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot import metric hook {path!r}: {exc}", "logging.hooks") from None
    return target() if isinstance(target, type) else target


def process_memory_mb(device: Any) -> float:
    """CUDA peak allocated memory on GPU, resident set size of this process elsewhere."""
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/statm") as handle:
            pages = int(handle.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        import resource

        # Peak rather than current RSS here; macOS reports bytes, Linux kilobytes.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (2**20 if sys.platform == "darwin" else 2**10)


class ThroughputMeter:
    """One log window of the loop: the summed loss (kept on the device, read once per window),
    steps, samples and tokens, and the time spent training. Time inside :meth:`paused` (a
    checkpoint save, an evaluation) is not training time and stays out of the rates."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        """Start a new window now."""
        import torch

        self.loss_sum = torch.zeros((), device=self.device)
        self.aux_sums: dict[str, Any] = {}
        self.aux_steps: dict[str, int] = {}
        self.steps = 0
        self.samples = 0
        self.tokens = 0
        self.started = time.perf_counter()

    def count_batch(self, samples: int, tokens: int) -> None:
        """A consumed micro-batch (it counts even when its step is skipped)."""
        self.samples += samples
        self.tokens += tokens

    def count_step(self, loss: Any, aux: dict[str, Any] | None = None) -> None:
        """A completed optimizer step, its loss and the model's extra scalars (device scalars;
        no host sync here)."""
        self.loss_sum += loss
        self.steps += 1
        for key, value in (aux or {}).items():
            previous = self.aux_sums.get(key)
            self.aux_sums[key] = value if previous is None else previous + value
            self.aux_steps[key] = self.aux_steps.get(key, 0) + 1

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside does not count as training time."""
        since = time.perf_counter()
        try:
            yield
        finally:
            self.started += time.perf_counter() - since

    def mean_loss(self, reduce: Callable[[Any], Any] | None = None) -> float:
        """The window's mean step loss (one host sync); ``reduce`` (a mean over data-parallel
        ranks) is applied to the summed loss first."""
        total = self.loss_sum if reduce is None else reduce(self.loss_sum)
        return float(total.item() / max(self.steps, 1))

    def mean_aux(
        self, reduce: Callable[[Any], Any] | None = None, reserved: Iterable[str] = ()
    ) -> dict[str, float]:
        """The window's mean of each model-returned scalar (one host sync each, at the log
        cadence); a name in ``reserved`` is reported as ``model/<name>``."""
        taken = set(reserved)
        means = {}
        for key, total in self.aux_sums.items():
            value = total if reduce is None else reduce(total)
            name = f"model/{key}" if key in taken else key
            means[name] = float(value.item() / self.aux_steps[key])
        return means

    def rates(self) -> dict[str, float]:
        """steps/samples/tokens per second over the window's training time."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        return {
            "steps_per_sec": self.steps / elapsed,
            "samples_per_sec": self.samples / elapsed,
            "tokens_per_sec": self.tokens / elapsed,
        }


class MetricLogger:
    """Fans each metric event out to its sinks: callables ``(event, payload)`` or objects with
    ``on_event`` (and an optional ``close``).

    Every sink is called on its own, so one failing sink never starves the others; a failure is
    warned about once per sink and never reaches the loop. Plugins receive a run's events
    through the ``on_metric`` hook, called by the run itself (:meth:`Trainer.emit
    <speedtronic.engine.trainer.Trainer.emit>`), so a logger used outside a trainer only feeds its
    sinks.
    """

    def __init__(self, hooks: Iterable[Any] = ()) -> None:
        self.sinks: list[EventSink] = [as_sink(h) for h in hooks]
        self._warned: set[str] = set()

    def add(self, sink: Any) -> None:
        """Add one more sink (callable or object with ``on_event``)."""
        self.sinks.append(as_sink(sink))

    def emit(self, event: str, payload: dict[str, Any]) -> None:
        """Deliver one event to every sink."""
        for sink in self.sinks:
            self._deliver(repr(sink), sink.on_event, event, payload)

    def progress(self, step: int) -> None:
        """Tell the sinks that have ``on_progress(step)`` (the progress bar) that an optimizer
        step finished; cheap enough to call every step."""
        for sink in self.sinks:
            on_progress = getattr(sink, "on_progress", None)
            if callable(on_progress):
                self._deliver(repr(sink), on_progress, step)

    def warn_once(self, label: str, exc: BaseException) -> None:
        """Report a failing sink or plugin, once per ``label``."""
        if label not in self._warned:
            self._warned.add(label)
            log.warning(
                "metric sink %s failed (%s: %s); training continues", label, type(exc).__name__, exc
            )

    def _deliver(self, label: str, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            self.warn_once(label, exc)

    def close(self) -> None:
        """Close every sink that has ``close()``; safe to call again (file sinks reopen if
        more events arrive, e.g. from a second ``fit``)."""
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if callable(close):
                self._deliver(f"{sink!r} (close)", close)
