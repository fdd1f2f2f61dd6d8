"""The sinks of the runs training in this process, from train start until their metrics close.

``on_metric`` carries no trainer, so the sinks a run opened are kept here, keyed by its
trainer. A session is closed when the trainer closes its metric logger, which happens after the
final ``train_end`` event; that event therefore still reaches W&B and TensorBoard, and a run
that raised is finished as failed rather than left open.
"""

from __future__ import annotations

import atexit
import logging
import math
import threading
import weakref
from collections.abc import Callable
from typing import Any

from speedtronic_logging import tensorboard_sink, wandb_sink
from speedtronic_logging.config import SECTIONS, is_customised
from speedtronic_logging.sink import Backend, GuardedSink

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


class LoggingSession:
    """The enabled sinks of one training run."""

    def __init__(self, sinks: list[GuardedSink], start_step: int) -> None:
        self.sinks = sinks
        self.step = start_step
        self.error: BaseException | None = None
        self.closed = False
        self._lock = threading.Lock()

    def on_event(self, event: str, payload: dict[str, Any]) -> None:
        """Route one metric event to every sink that is still working."""
        with self._lock:
            if self.closed:
                return
            step = payload.get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                self.step = step
            if event == RUN_INFO_EVENT:
                info = {k: v for k, v in payload.items() if k != "config" and _plain(v)}
                self._call("log_run_info", self.step, info)
            elif event == SUMMARY_EVENT:
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

    def _call(self, method: str, *args: Any) -> None:
        for sink in self.sinks:
            sink.call(method, *args)

    def close(self) -> None:
        """Finish every sink (failed ones too, so their files and processes are released)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for sink in self.sinks:
            sink.finish(self.error)

    def backend(self, label: str) -> Any:
        """The backend called ``label`` ("W&B", "TensorBoard"), if this session has it."""
        return next((s.backend for s in self.sinks if s.label == label), None)


class _CloseWithMetrics:
    """Added to the trainer's metric logger: its ``close()`` ends our session, right after the
    final ``train_end`` event has been delivered."""

    def __init__(self, trainer_key: int) -> None:
        self.trainer_key = trainer_key

    def on_event(self, event: str, payload: dict[str, Any]) -> None:
        """Events reach the session through the ``on_metric`` hook, not through here."""

    def close(self) -> None:
        end_session(self.trainer_key)


_lock = threading.Lock()
_sessions: dict[int, LoggingSession] = {}
# Weak: a trainer that resumed but never started (already finished) must not leave an id behind
# that a later trainer at the same address would pick up.
_resume_ids: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_atexit_registered = False


def active_sessions() -> list[LoggingSession]:
    """Sessions started and not yet closed (empty between runs)."""
    with _lock:
        return list(_sessions.values())


def session_for(trainer: Any) -> LoggingSession | None:
    """The open session of ``trainer``, if it logs anywhere."""
    with _lock:
        return _sessions.get(id(trainer))


def remember_resume(trainer: Any, wandb_run_id: str) -> None:
    """Keep the W&B run id of a checkpoint being resumed, for the coming train start."""
    with _lock:
        _resume_ids[trainer] = wandb_run_id


def start_session(trainer: Any) -> LoggingSession | None:
    """Open the sinks that ``trainer.config`` enables; ``None`` when it enables none.

    A missing backend package is the user's config asking for something not installed: one
    PluginError naming the extra. Any other failure to start a backend is a sink failure: a
    warning, and training goes on without that backend.
    """
    global _atexit_registered
    key = id(trainer)
    with _lock:
        resume_id = _resume_ids.pop(trainer, None)
        stale = _sessions.pop(key, None)
    if stale is not None:
        stale.close()
    config = trainer.config
    wandb_settings = config.plugins.get("wandb")
    tensorboard_settings = config.plugins.get("tensorboard")
    for name in SECTIONS:
        section = config.plugins.get(name)
        if section is not None and not section.enabled and is_customised(section):
            log.info(
                "the %s section is configured but %s.enabled is false; not logging to it",
                name,
                name,
            )
    # Every requested backend is imported before any starts: a missing package fails the run
    # before a W&B run or an event file exists.
    starters: list[tuple[str, Callable[[], Backend]]] = []
    if wandb_settings is not None and wandb_settings.enabled:
        wandb_sink.load()
        starters.append(("W&B", lambda: wandb_sink.WandbBackend(wandb_settings, config, resume_id)))
    if tensorboard_settings is not None and tensorboard_settings.enabled:
        tensorboard_sink.load()
        starters.append(
            (
                "TensorBoard",
                lambda: tensorboard_sink.TensorBoardBackend(
                    tensorboard_settings, config, trainer.step
                ),
            )
        )
    if not starters:
        return None
    sinks: list[GuardedSink] = []
    try:
        for label, start in starters:
            try:
                sinks.append(GuardedSink(start()))
            except Exception as exc:
                log.warning(
                    "%s logging could not start (%s: %s); training continues without it",
                    label,
                    type(exc).__name__,
                    exc,
                )
    except BaseException:  # interrupted while starting: release what already started
        for sink in sinks:
            sink.finish(None)
        raise
    if not sinks:
        return None
    session = LoggingSession(sinks, trainer.step)
    with _lock:
        others = len(_sessions)
        _sessions[key] = session
        if not _atexit_registered:
            # Registered after the backends started, so it runs before their own exit
            # handlers: a run left open (fit never returned) is still finished properly.
            atexit.register(close_all)
            _atexit_registered = True
    if others:
        log.warning(
            "another training run in this process is also logging to W&B/TensorBoard; "
            "metric events cannot be told apart and reach both runs"
        )
    add = getattr(trainer.metrics, "add", None)
    sinks_of_logger = getattr(trainer.metrics, "sinks", [])
    if callable(add) and not any(
        isinstance(s, _CloseWithMetrics) and s.trainer_key == key for s in sinks_of_logger
    ):  # once per logger: a trainer that fits again reuses its logger and our closer
        add(_CloseWithMetrics(key))
    return session


def deliver(event: str, payload: dict[str, Any]) -> None:
    """Route a metric event to every open session."""
    for session in active_sessions():
        session.on_event(event, payload)


def mark_train_end(trainer: Any, error: BaseException | None) -> None:
    """Note how training ended; the session closes when the trainer's metrics close."""
    session = session_for(trainer)
    if session is None:
        return
    session.error = error
    if not callable(getattr(trainer.metrics, "add", None)):
        # No metric logger to close us later: close now (the train_end summary is lost).
        end_session(id(trainer))


def end_session(trainer_key: int) -> None:
    """Close and forget the session of a trainer."""
    with _lock:
        session = _sessions.pop(trainer_key, None)
    if session is not None:
        session.close()


def close_all() -> None:
    """Close every open session (interpreter exit, or a caller cleaning up)."""
    with _lock:
        keys = list(_sessions)
    for key in keys:
        end_session(key)
