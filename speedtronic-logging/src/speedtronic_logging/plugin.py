"""Hook implementations: the ``wandb``/``tensorboard`` sections and the metric sinks behind them.

Everything the plugin knows about a run is one :class:`~speedtronic_logging.run_logging.RunLogging`
in ``trainer.plugin_state["logging"]``: built at train start, fed by ``on_metric``, finished at
train end (after the ``train_end`` summary, which core emits before ``on_train_end``).
"""

from __future__ import annotations

from typing import Any

from speedtronic import hookimpl
from speedtronic_logging.config import SECTIONS
from speedtronic_logging.run_logging import RunLogging

STATE_KEY = "logging"


def run_logging(trainer: Any) -> RunLogging:
    """The plugin's state of the run ``trainer``, created on first use."""
    state = trainer.plugin_state.get(STATE_KEY)
    if state is None:
        state = trainer.plugin_state[STATE_KEY] = RunLogging()
    return state


@hookimpl
def config_sections() -> dict[str, type]:
    """Contribute the ``wandb`` and ``tensorboard`` top-level sections."""
    return dict(SECTIONS)


@hookimpl
def on_train_start(trainer: Any) -> None:
    """Build the sinks the config enables (they open at the ``train_start`` event)."""
    run_logging(trainer).start(trainer.config)


@hookimpl
def on_metric(trainer: Any, event: str, payload: dict[str, Any]) -> None:
    """Send one metric event of ``trainer`` to that run's sinks."""
    state = trainer.plugin_state.get(STATE_KEY)
    if state is not None:
        state.on_event(event, payload)


@hookimpl
def on_train_end(trainer: Any, error: BaseException | None) -> None:
    """Finish the run's sinks, as failed when training raised."""
    state = trainer.plugin_state.pop(STATE_KEY, None)
    if state is not None:
        state.close(error)


@hookimpl
def on_checkpoint(trainer: Any, state: dict[str, Any]) -> None:
    """Keep the W&B run id so that a resumed training continues the same W&B run."""
    current = trainer.plugin_state.get(STATE_KEY)
    run_id = current.wandb_run_id if current is not None else None
    if run_id:
        state[STATE_KEY] = {"wandb_run_id": run_id}


@hookimpl
def on_load_checkpoint(trainer: Any, state: dict[str, Any]) -> None:
    """Pick up the W&B run id saved by :func:`on_checkpoint`, for the coming train start."""
    run_id = (state.get(STATE_KEY) or {}).get("wandb_run_id")
    if isinstance(run_id, str) and run_id:
        run_logging(trainer).resume_wandb_id = run_id
