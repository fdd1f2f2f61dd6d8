"""What the W&B and TensorBoard sinks share: the event routing and the run lifecycle, guarded so
that a failing backend never stops training.

A sink is a metric sink as core defines it (``on_event(event, payload)`` and ``close()``), so it
can be given to ``MetricLogger(hooks=[...])``; the plugin builds its per-run sinks from the same
classes. A sink opens one backend run at each ``train_start`` event (whose payload carries the
redacted config and the start step) and finishes it at ``close()``. A full disk, a dropped
network or a backend bug turns into a single warning, after which that backend receives nothing
more while the other one and the training loop carry on.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

from speedtronic import ConfigError
from speedtronic.schema import build_section

log = logging.getLogger("speedtronic.logging")

# The two events that are not measurements: run facts at the start, the summary at the end.
RUN_INFO_EVENT = "train_start"
SUMMARY_EVENT = "train_end"
# Its scalars are logged as ``train/<key>``; other events' as ``<event>/<key>``.
STEP_EVENT = "step"


def scalars_of(event: str, payload: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of an event as ``<prefix>/<key>`` scalars (``train/`` for steps)."""
    prefix = "train" if event == STEP_EVENT else event
    scalars: dict[str, float] = {}
    for key, value in payload.items():
        if key == "step":
            continue
        if isinstance(value, (int, float)):  # bools too: a flag plots as 0/1
            scalars[f"{prefix}/{key}"] = float(value)
    return scalars


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _step_of(payload: dict[str, Any]) -> int | None:
    step = payload.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def section_settings(section_cls: type, name: str, settings: dict[str, Any]) -> Any:
    """A sink's keyword settings validated as the config section ``name`` (``enabled`` left
    out: a sink object is on by being given), with errors at ``<name>.<key>``."""
    if "enabled" in settings:
        raise ConfigError("a sink object is always enabled; leave `enabled` out", f"{name}.enabled")
    return build_section(section_cls, {**settings, "enabled": True}, name)


def settings_of(section: Any) -> dict[str, Any]:
    """The keyword settings of a sink built from the config section ``section``."""
    return {f.name: getattr(section, f.name) for f in fields(section) if f.name != "enabled"}


@dataclass
class RunStart:
    """What a backend needs to open one run, read from the ``train_start`` event."""

    hyperparameters: dict[str, Any] = field(default_factory=dict)
    start_step: int = 0
    run_name: str | None = None
    output_dir: Path = Path(".")

    @classmethod
    def from_event(cls, payload: dict[str, Any]) -> RunStart:
        """Its ``config`` (the redacted config; optional outside a trainer) and start step."""
        config = payload.get("config")
        config = copy.deepcopy(config) if isinstance(config, dict) else {}
        run = config.get("run") if isinstance(config.get("run"), dict) else {}
        start = payload.get("start_step", _step_of(payload))
        name, output_dir = run.get("name"), run.get("output_dir")
        return cls(
            hyperparameters=config,
            start_step=start if isinstance(start, int) and not isinstance(start, bool) else 0,
            run_name=name if isinstance(name, str) else None,
            output_dir=Path(output_dir) if isinstance(output_dir, str) else Path("."),
        )


class Backend(Protocol):
    """One open run of W&B or TensorBoard; any call may raise."""

    def log_run_info(self, step: int, info: dict[str, Any]) -> None:
        """Record the facts of the ``train_start`` event (device, precision, ...)."""

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """Record named scalars at ``step``."""

    def log_summary(self, step: int, summary: dict[str, Any]) -> None:
        """Record the final summary of the ``train_end`` event."""

    def finish(self, failed: bool) -> None:
        """Flush and close; ``failed`` when training ended with an error."""


class BackendSink:
    """A metric sink over one backend: opens a backend run at ``train_start``, routes every
    event to it and finishes it at :meth:`close`.

    Events outside a run (before the first ``train_start``, after ``close``) are ignored.
    Subclasses set ``label`` and implement :meth:`open_backend`.
    """

    label = "backend"

    def __init__(self) -> None:
        self.backend: Backend | None = None
        self.active = False  # a backend run is open and has not failed
        self.step = 0
        self._failed_run = False
        self._lock = threading.Lock()

    def open_backend(self, run: RunStart) -> Backend:
        """Start one backend run (W&B run, event-file writer)."""
        raise NotImplementedError

    def on_event(self, event: str, payload: dict[str, Any]) -> None:
        """Route one metric event: ``train_start`` opens a run, ``train_end`` is the summary,
        the numeric fields of every other event are scalars."""
        with self._lock:
            if event == RUN_INFO_EVENT:
                # A run left open by a caller that never closed this sink ends here.
                self._finish(failed=self._failed_run)
                self._open(RunStart.from_event(payload))
            if not self.active:
                return
            step = _step_of(payload)
            if step is not None:
                self.step = step
            if event == RUN_INFO_EVENT:
                info = {k: v for k, v in payload.items() if k != "config" and _plain(v)}
                self._call("log_run_info", self.step, info)
            elif event == SUMMARY_EVENT:
                status = payload.get("status")
                self._failed_run = isinstance(status, str) and status != "ok"
                summary = {
                    k: v
                    for k, v in payload.items()
                    if _plain(v) and not (isinstance(v, float) and not math.isfinite(v))
                }
                self._call("log_summary", self.step, summary)
            else:
                scalars = scalars_of(event, payload)
                if scalars:
                    self._call("log_scalars", self.step, scalars)

    def close(self, error: BaseException | None = None) -> None:
        """Finish the open run, as failed when ``error`` is given or the ``train_end`` summary
        said so. Safe to call again; a later ``train_start`` opens a new run."""
        with self._lock:
            self._finish(failed=error is not None or self._failed_run)

    def _open(self, run: RunStart) -> None:
        self.step = run.start_step
        self._failed_run = False
        try:
            self.backend = self.open_backend(run)
        except Exception as exc:
            log.warning(
                "%s logging could not start (%s: %s); training continues without it",
                self.label,
                type(exc).__name__,
                exc,
            )
            return
        self.active = True

    def _call(self, method: str, *args: Any) -> None:
        try:
            getattr(self.backend, method)(*args)
        except Exception as exc:
            self.active = False
            log.warning(
                "%s logging failed (%s: %s); training continues without %s",
                self.label,
                type(exc).__name__,
                exc,
                self.label,
            )

    def _finish(self, failed: bool) -> None:
        """Finish the backend once; also after a failure, so files and processes are released."""
        backend, self.backend = self.backend, None
        was_active, self.active = self.active, False
        if backend is None:
            return
        try:
            backend.finish(failed)
        except Exception as exc:
            if was_active:
                log.warning(
                    "%s could not finish its run cleanly (%s: %s)",
                    self.label,
                    type(exc).__name__,
                    exc,
                )
            else:  # already warned about this backend; a second line says nothing new
                log.debug("%s finish after an earlier failure: %s", self.label, exc)
