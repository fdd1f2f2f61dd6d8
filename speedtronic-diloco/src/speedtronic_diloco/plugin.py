"""Hook implementations wiring DumbDiLoCo into the Speedtronic trainer.

- ``config_sections``: the ``distributed`` section;
- ``data_seed``: a per-node seed for the synthetic token stream (derived from the node id);
- ``on_load_checkpoint`` (runs before train start): the coordinator state is kept aside and
  handed to the coordinator as its prepared startup state;
- ``on_train_start`` / ``on_train_end``: coordinator start and bounded stop;
- ``after_optimizer_step``: boundaries, uploads, polls; True when weights were replaced;
- ``on_checkpoint``: coordinator state under the ``diloco`` key.

Everything the plugin knows about a run lives in that run: ``trainer.plugin_state["diloco"]``
holds a :class:`DiLoCoRun` (its coordinator, and checkpointed state that arrived before train
start), which the trainer drops after ``on_train_end``. Two trainers in one process therefore
never share a coordinator, and the coordinator's metric events go out through its own trainer
(``trainer.emit``), to that run's sinks and ``on_metric`` hooks only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speedtronic import hookimpl
from speedtronic_diloco.config import DistributedConfig, resolve_state_dir
from speedtronic_diloco.identity import node_data_seed, resolve_node_id

if TYPE_CHECKING:  # the coordinator (torch) loads only when a DiLoCo run starts
    from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator

log = logging.getLogger("speedtronic.diloco")

STATE_KEY = "diloco"
"""The key of this plugin in checkpoints (``plugins.diloco``) and in ``trainer.plugin_state``."""


@dataclass
class DiLoCoRun:
    """What the plugin keeps about one run in ``trainer.plugin_state["diloco"]``."""

    coordinator: DumbDiLoCoCoordinator | None = None  # built at train start
    checkpointed: dict[str, Any] | None = None  # coordinator state restored before the start


def _section(config: Any) -> DistributedConfig | None:
    section = getattr(config, "plugins", {}).get("distributed")
    if isinstance(section, DistributedConfig) and section.enabled:
        return section
    return None


def run_of(trainer: Any) -> DiLoCoRun | None:
    """This plugin's state for the run ``trainer`` is doing, or None outside a DiLoCo run."""
    return trainer.plugin_state.get(STATE_KEY)


def _run_for(trainer: Any) -> DiLoCoRun:
    run = run_of(trainer)
    if run is None:
        run = trainer.plugin_state[STATE_KEY] = DiLoCoRun()
    return run


def coordinator_of(trainer: Any) -> DumbDiLoCoCoordinator | None:
    """The coordinator of the run ``trainer`` is doing, or None (before train start, after
    train end, or without DumbDiLoCo)."""
    run = run_of(trainer)
    return run.coordinator if run is not None else None


def state_dir_for(config: Any, section: DistributedConfig) -> Path:
    """``distributed.state_dir`` resolved under ``run.output_dir`` (default ``diloco``)."""
    return resolve_state_dir(section, config.run.output_dir)


@hookimpl
def config_sections() -> dict[str, type]:
    """Contribute the ``distributed`` section."""
    return {"distributed": DistributedConfig}


@hookimpl
def data_seed(config: Any, seed: int) -> int | None:
    """A per-node data seed when DumbDiLoCo is on. Only the synthetic token stream draws its
    samples from this seed; ``data.text_path`` and user datasets are not split by node."""
    section = _section(config)
    if section is None:
        return None
    return node_data_seed(seed, resolve_node_id(section.node_id))


@hookimpl
def on_load_checkpoint(trainer: Any, state: dict[str, Any]) -> None:
    """Keep the checkpointed coordinator state for :func:`on_train_start` (or hand it to the
    run's coordinator if it already exists)."""
    saved = state.get(STATE_KEY)
    if saved is None or _section(trainer.config) is None:
        return
    run = _run_for(trainer)
    if run.coordinator is not None:
        run.coordinator.load_state_dict(saved)
    else:
        run.checkpointed = saved


@hookimpl
def on_train_start(trainer: Any) -> None:
    """Build this run's coordinator, give it the checkpointed state, and start it."""
    section = _section(trainer.config)
    if section is None:
        return
    from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator

    run = _run_for(trainer)
    if run.coordinator is None:
        run.coordinator = DumbDiLoCoCoordinator(
            section,
            trainer.model,
            state_dir=state_dir_for(trainer.config, section),
            logger=trainer,
        )
    if run.checkpointed is not None:
        run.coordinator.load_state_dict(run.checkpointed)
        run.checkpointed = None
    trainer.reset_optimizer_on_weight_replace = section.reset_inner_optimizer
    run.coordinator.start()


@hookimpl
def after_optimizer_step(trainer: Any, model: Any, step: int) -> bool | None:
    """Forward the step to the coordinator; True when a delta was pushed or a global loaded."""
    coordinator = coordinator_of(trainer)
    if coordinator is None or not coordinator.started:
        return None
    return coordinator.after_optimizer_step(model, step)


@hookimpl
def on_checkpoint(trainer: Any, state: dict[str, Any]) -> None:
    """Save the coordinator state under ``diloco``."""
    coordinator = coordinator_of(trainer)
    if coordinator is not None:
        state[STATE_KEY] = coordinator.state_dict()


@hookimpl
def on_train_end(trainer: Any, error: BaseException | None) -> None:
    """Stop the coordinator (bounded; never raises). The trainer drops the run's state next."""
    coordinator = coordinator_of(trainer)
    if coordinator is None:
        return
    try:
        coordinator.stop()
    except Exception:  # on_train_end must not raise
        log.exception("stopping DumbDiLoCo failed")
