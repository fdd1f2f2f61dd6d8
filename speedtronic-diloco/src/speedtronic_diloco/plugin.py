"""Hook implementations wiring DumbDiLoCo into the Speedtronic trainer.

- ``config_sections``: the ``distributed`` section;
- ``data_seed``: each node draws its own samples (the seed is derived from the node id);
- ``on_load_checkpoint`` (runs before train start): the coordinator state is kept aside and
  handed to the coordinator as its prepared startup state;
- ``on_train_start`` / ``on_train_end``: coordinator start and bounded stop;
- ``after_optimizer_step``: boundaries, uploads, polls; True when weights were replaced;
- ``on_checkpoint``: coordinator state under the ``diloco`` key.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Any

from speedtronic import hookimpl
from speedtronic_diloco.config import DistributedConfig
from speedtronic_diloco.identity import node_data_seed, resolve_node_id

log = logging.getLogger("speedtronic.diloco")

STATE_KEY = "diloco"

# Per trainer (a process may build several): its coordinator and checkpointed state that
# arrived before train start.
_coordinators: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_pending_state: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def _section(config: Any) -> DistributedConfig | None:
    section = getattr(config, "plugins", {}).get("distributed")
    if isinstance(section, DistributedConfig) and section.enabled:
        return section
    return None


def state_dir_for(config: Any, section: DistributedConfig) -> Path:
    """``distributed.state_dir`` resolved under ``run.output_dir`` (default ``diloco``)."""
    configured = Path(section.state_dir or "diloco")
    return configured if configured.is_absolute() else Path(config.run.output_dir) / configured


def coordinator_of(trainer: Any) -> Any:
    """The coordinator attached to ``trainer``, or None."""
    return _coordinators.get(trainer)


@hookimpl
def config_sections() -> dict[str, type]:
    """Contribute the ``distributed`` section."""
    return {"distributed": DistributedConfig}


@hookimpl
def data_seed(config: Any, seed: int) -> int | None:
    """A per-node data seed when DumbDiLoCo is on, so nodes do not train on the same samples."""
    section = _section(config)
    if section is None:
        return None
    return node_data_seed(seed, resolve_node_id(section.node_id))


@hookimpl
def on_load_checkpoint(trainer: Any, state: dict[str, Any]) -> None:
    """Keep the checkpointed coordinator state for :func:`on_train_start`."""
    saved = state.get(STATE_KEY)
    if saved is None or _section(trainer.config) is None:
        return
    coordinator = _coordinators.get(trainer)
    if coordinator is not None and not coordinator.started:
        coordinator.load_state_dict(saved)
    else:
        _pending_state[trainer] = saved


@hookimpl
def on_train_start(trainer: Any) -> None:
    """Build (once per trainer) and start the coordinator."""
    section = _section(trainer.config)
    if section is None:
        return
    from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator

    coordinator = _coordinators.get(trainer)
    if coordinator is None:
        coordinator = DumbDiLoCoCoordinator(
            section,
            trainer.model,
            state_dir=state_dir_for(trainer.config, section),
            logger=trainer,
        )
        _coordinators[trainer] = coordinator
    pending = _pending_state.pop(trainer, None)
    if pending is not None:
        coordinator.load_state_dict(pending)
    trainer.reset_optimizer_on_weight_replace = section.reset_inner_optimizer
    coordinator.start()


@hookimpl
def after_optimizer_step(trainer: Any, model: Any, step: int) -> bool | None:
    """Forward the step to the coordinator; True when a delta was pushed or a global loaded."""
    coordinator = _coordinators.get(trainer)
    if coordinator is None or not coordinator.started:
        return None
    return coordinator.after_optimizer_step(model, step)


@hookimpl
def on_checkpoint(trainer: Any, state: dict[str, Any]) -> None:
    """Save the coordinator state under ``diloco``."""
    coordinator = _coordinators.get(trainer)
    if coordinator is not None:
        state[STATE_KEY] = coordinator.state_dict()


@hookimpl
def on_train_end(trainer: Any, error: BaseException | None) -> None:
    """Stop the coordinator (bounded; never raises)."""
    coordinator = _coordinators.get(trainer)
    if coordinator is None:
        return
    try:
        coordinator.stop()
    except Exception:  # on_train_end must not raise
        log.exception("stopping DumbDiLoCo failed")
