"""Metric events and their sinks: stdout (rich), a text file, a JSONL file, hooks and plugins.

A metric event is ``(event, payload)``: ``event`` names what happened (``"step"``,
``"train_start"``, ``"train_end"``, ``"optimizer_step_skipped"``, plugin events such as
``"outer_step"``) and ``payload`` is a flat mapping of JSON-compatible values. A sink that fails
is reported once and then skipped; metrics never stop training.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("speedtronic.metrics")

Hook = Callable[[str, dict[str, Any]], None]


class EventSink(Protocol):
    def on_event(self, event: str, payload: dict[str, Any]) -> None: ...


def format_payload(payload: dict[str, Any]) -> str:
    """``key=value`` pairs with compact numbers, for human-readable lines."""
    parts = []
    for key, value in payload.items():
        if isinstance(value, float):
            text = f"{value:.4g}" if math.isfinite(value) else str(value)
        elif isinstance(value, (dict, list)):
            continue
        else:
            text = str(value)
        parts.append(f"{key}={text}")
    return " ".join(parts)


class TextFileSink:
    """Appends ``event key=value ...`` lines to a file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def on_event(self, event: str, payload: dict[str, Any]) -> None:
        self._handle.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {event} "
                           f"{format_payload(payload)}\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


class JsonlSink:
    """Appends one JSON object per event: ``{"event": ..., "time": ..., **payload}``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def on_event(self, event: str, payload: dict[str, Any]) -> None:
        record = {"event": event, "time": time.time(), **payload}
        self._handle.write(json.dumps(record, default=str) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


class ConsoleSink:
    """stdout: a rich progress bar with ETA on a terminal, plain lines otherwise."""

    def __init__(self, total_steps: int, progress: bool = True, stream: Any = None) -> None:
        self.stream = stream or sys.stdout
        self.total_steps = total_steps
        self._progress: Any = None
        self._task: Any = None
        if progress and getattr(self.stream, "isatty", lambda: False)():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"), transient=False,
            )

    def on_event(self, event: str, payload: dict[str, Any]) -> None:
        if self._progress is not None:
            if event == "train_start":
                self._progress.start()
                self._task = self._progress.add_task(
                    "train", total=self.total_steps, completed=payload.get("start_step", 0),
                    info="",
                )
            elif event == "step" and self._task is not None:
                self._progress.update(
                    self._task, completed=payload["step"],
                    info=f"loss {payload.get('loss', float('nan')):.4f}",
                )
            elif event not in ("step", "train_start"):
                self._progress.console.print(f"{event} {format_payload(_brief(payload))}")
            return
        print(f"{event} {format_payload(_brief(payload))}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def _brief(payload: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in payload.items() if not isinstance(v, (dict, list))}


class _CallableSink:
    def __init__(self, fn: Hook) -> None:
        self.fn = fn

    def on_event(self, event: str, payload: dict[str, Any]) -> None:
        self.fn(event, payload)


def as_sink(hook: Any) -> EventSink:
    """Accept an object with ``on_event`` or a callable ``(event, payload)``."""
    if hasattr(hook, "on_event"):
        return hook
    if callable(hook):
        return _CallableSink(hook)
    raise TypeError(f"a metric hook must be callable or have on_event(), got {hook!r}")


def import_hook(path: str) -> Any:
    """Resolve a ``module:attribute`` path from ``logging.hooks``."""
    from speedtronic.errors import ConfigError

    module_name, sep, attr = path.partition(":")
    if not sep:
        raise ConfigError(f"{path!r} must look like module:attribute", "logging.hooks")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot import metric hook {path!r}: {exc}", "logging.hooks") from None
    return target() if isinstance(target, type) else target


class MetricLogger:
    """Fans each metric event out to its sinks and to the plugins' ``on_metric`` hook.

    ``hooks`` are extra sinks: callables ``(event, payload)`` or objects with ``on_event``.
    Each plugin implementation is called on its own, so one failing sink never starves the
    others; a failure is warned about once per sink and never reaches the training loop.
    """

    def __init__(self, hooks: Iterable[Any] = (), *, plugin_manager: Any = None) -> None:
        self.sinks: list[EventSink] = [as_sink(h) for h in hooks]
        self.plugin_manager = plugin_manager
        self._warned: set[str] = set()
        self._closed = False

    def add(self, sink: Any) -> None:
        """Add one more sink (callable or object with ``on_event``)."""
        self.sinks.append(as_sink(sink))

    def emit(self, event: str, payload: dict[str, Any]) -> None:
        """Deliver one event to every sink and plugin."""
        for sink in self.sinks:
            self._deliver(repr(sink), sink.on_event, event, payload)
        if self.plugin_manager is not None:
            for impl in self.plugin_manager.hook.on_metric.get_hookimpls():
                kwargs = {"event": event, "payload": payload}
                args = [kwargs[name] for name in impl.argnames]
                self._deliver(f"plugin {impl.plugin_name}", impl.function, *args)

    def _deliver(self, label: str, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            if label not in self._warned:
                self._warned.add(label)
                log.warning("metric sink %s failed (%s: %s); training continues",
                            label, type(exc).__name__, exc)

    def close(self) -> None:
        """Close every sink that has ``close()`` (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                self._deliver(f"{sink!r} (close)", close)
