"""Hook implementations: the ``wandb``/``tensorboard`` sections and the metric sinks behind them."""

from __future__ import annotations

from typing import Any

from speedtronic import hookimpl
from speedtronic_logging import session
from speedtronic_logging.config import SECTIONS

STATE_KEY = "logging"


@hookimpl
def config_sections() -> dict[str, type]:
    """Contribute the ``wandb`` and ``tensorboard`` top-level sections."""
    return dict(SECTIONS)


@hookimpl
def on_train_start(trainer: Any) -> None:
    """Open the sinks the config enables and record the redacted config as hyperparameters."""
    session.start_session(trainer)


@hookimpl
def on_metric(event: str, payload: dict[str, Any]) -> None:
    """Send one metric event to the open sinks."""
    session.deliver(event, payload)


@hookimpl
def on_train_end(trainer: Any, error: BaseException | None) -> None:
    """Note success or failure; the sinks finish once the final summary has been logged."""
    session.mark_train_end(trainer, error)


@hookimpl
def on_checkpoint(trainer: Any, state: dict[str, Any]) -> None:
    """Keep the W&B run id so that a resumed training continues the same W&B run."""
    current = session.session_for(trainer)
    backend = current.backend("W&B") if current is not None else None
    run_id = getattr(backend, "run_id", None)
    if run_id:
        state[STATE_KEY] = {"wandb_run_id": run_id}


@hookimpl
def on_load_checkpoint(trainer: Any, state: dict[str, Any]) -> None:
    """Pick up the W&B run id saved by :func:`on_checkpoint`, for the coming train start."""
    run_id = (state.get(STATE_KEY) or {}).get("wandb_run_id")
    if isinstance(run_id, str) and run_id:
        session.remember_resume(trainer, run_id)
