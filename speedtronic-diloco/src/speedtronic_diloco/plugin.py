"""Hook implementations wiring DumbDiLoCo into the Speedtronic trainer.

- ``config_sections``: the ``distributed`` section;
- ``data_seed`` / ``data_rank``: each node's data: its own order keyed by the node id, or
  disjoint slices with ``num_nodes``/``node_rank`` (``data.node_split: none``: neither);
- ``on_load_checkpoint`` (runs before train start): the coordinator state is kept aside and
  handed to the coordinator as its prepared startup state;
- ``on_train_start`` / ``on_train_end``: coordinator start (the master gets an evaluator of its
  globals when the run has eval; a node's left record is deleted first) and, after a run that
  ended normally, ``finish`` (the last delta lands, the master's final round), then the node's
  left record (:mod:`~speedtronic_diloco.membership`) and a bounded stop;
- ``after_optimizer_step``: boundaries, uploads, polls (the run's last step uploads its partial
  inner loop); True when weights were replaced;
- ``on_checkpoint``: coordinator state under the ``diloco`` key;
- ``register_commands``: the ``speedtronic diloco`` command group (``status``, ``rollback``);
  other modules add their subcommands to the same group through :func:`diloco_subcommands`.

Everything the plugin knows about a run lives in that run: ``trainer.plugin_state["diloco"]``
holds a :class:`DiLoCoRun` (its coordinator, and checkpointed state that arrived before train
start), which the trainer drops after ``on_train_end``. Two trainers in one process therefore
never share a coordinator, and the coordinator's metric events go out through its own trainer
(``trainer.emit``), to that run's sinks and ``on_metric`` hooks only.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speedtronic import hookimpl
from speedtronic.errors import PluginError
from speedtronic_diloco.config import DistributedConfig, resolve_state_dir
from speedtronic_diloco.identity import node_data_seed, resolve_node_id

if TYPE_CHECKING:  # the coordinator (torch) loads only when a DiLoCo run starts
    from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator
    from speedtronic_diloco.node.sharded import ShardedGroup

log = logging.getLogger("speedtronic.diloco")

STATE_KEY = "diloco"
"""The key of this plugin in checkpoints (``plugins.diloco``) and in ``trainer.plugin_state``."""


@dataclass
class DiLoCoRun:
    """What the plugin keeps about one run in ``trainer.plugin_state["diloco"]``."""

    coordinator: DumbDiLoCoCoordinator | None = None  # built at train start
    checkpointed: dict[str, Any] | None = None  # coordinator state restored before the start
    follower: bool = False  # a DDP/FSDP rank other than 0: rank 0 runs the node's coordinator
    group: ShardedGroup | None = None  # the node is an FSDP group (parallel.strategy: fsdp)


def _section(config: Any) -> DistributedConfig | None:
    section = config.plugins.get("distributed")
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


def _splits_by_node(config: Any) -> DistributedConfig | None:
    """The ``distributed`` section when DumbDiLoCo is on and ``data.node_split`` is ``auto``
    (``none``: every node reads the same stream)."""
    section = _section(config)
    if section is None or config.data.node_split == "none":
        return None
    return section


@hookimpl
def data_seed(config: Any, seed: int) -> int | None:
    """A seed keyed by the node id when the nodes are not ranked: every built-in source then
    gives this node its own sample order (``data.node_split: auto``)."""
    section = _splits_by_node(config)
    if section is None or section.num_nodes is not None:
        return None  # ranked nodes share the seed and split the samples (data_rank)
    return node_data_seed(seed, resolve_node_id(section.node_id))


@hookimpl
def load_global_state(config: Any, model: Any) -> dict[str, Any] | None:
    """The store's current global weights (``--global`` of eval, export and generate), read
    without joining the run and checked as a node checks a global before installing it
    (:mod:`speedtronic_diloco.global_check`: a forged one is a TransportError, never NaN
    weights); None when DumbDiLoCo is not enabled in ``config``."""
    section = _section(config)
    if section is None:
        return None
    from speedtronic_diloco.global_weights import read_global_state

    return read_global_state(section, model)


@hookimpl
def data_rank(config: Any) -> tuple[int, int] | None:
    """``(node_rank, num_nodes)`` when the config ranks the nodes: every source is then split
    so nodes read disjoint samples (unless ``data.node_split: none``)."""
    section = _splits_by_node(config)
    if section is None or section.num_nodes is None:
        return None
    return (section.node_rank or 0, section.num_nodes)


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
    from speedtronic_diloco.membership import announce_back

    run = _run_for(trainer)
    parallel = trainer.parallel
    if parallel.enabled:
        if section.install_at != "boundary":
            raise PluginError(
                "distributed.install_at: a DiLoCo node that is a DDP or FSDP group installs "
                "globals at its inner-loop boundaries only, where its ranks agree; set it to "
                "boundary"
            )
        check_group_waits(section, trainer.config.parallel.timeout)
        trainer.reset_optimizer_on_weight_replace = section.reset_inner_optimizer
        if trainer.strategy.shards_parameters:
            from speedtronic_diloco.node.sharded import ShardedGroup

            run.group = ShardedGroup(trainer.model, parallel.is_main)  # every rank gathers
        if not parallel.is_main:
            run.follower = True  # rank 0 of the group runs the coordinator for the node
            _weights_from_main(run, trainer.model)  # what rank 0 starts from (maybe a global)
            return
    if run.coordinator is None:
        run.coordinator = DumbDiLoCoCoordinator(
            section,
            _coordinated(run, trainer.model),
            state_dir=state_dir_for(trainer.config, section),
            logger=trainer,
            evaluate=global_evaluator(trainer, section),
        )
    if run.checkpointed is not None:
        run.coordinator.load_state_dict(run.checkpointed)
        run.checkpointed = None
    trainer.reset_optimizer_on_weight_replace = section.reset_inner_optimizer
    coordinator = run.coordinator
    announce_back(coordinator.transport, coordinator.node_id, retry=coordinator.ctx.retry)
    coordinator.start()
    if parallel.enabled:
        _weights_from_main(run, trainer.model)  # the start may have installed the current global


#: Seconds of a group's collective timeout kept for what rank 0 does at a boundary besides
#: waiting for its round (the delta's upload, the global's download).
GROUP_WAIT_MARGIN_S = 60.0


def check_group_waits(section: DistributedConfig, collective_timeout: float) -> None:
    """A node that is a DDP or FSDP group with ``rounds: sync``: rank 0 may wait up to 3 x
    ``round_timeout`` at a boundary (an upload still in flight, then 2 x for the round's
    global; 2 x for the first global at the start) while the other ranks wait in a collective,
    which fails after ``parallel.timeout``. PluginError naming both unless that wait plus
    :data:`GROUP_WAIT_MARGIN_S` fits."""
    from speedtronic_diloco.round_mode import round_mode

    if not round_mode(section.rounds).waits_at_boundary:
        return
    longest = 3 * section.round_timeout + GROUP_WAIT_MARGIN_S
    if longest > collective_timeout:
        raise PluginError(
            f"distributed.round_timeout: {section.round_timeout:g} s is too long for a node that "
            f"is a DDP or FSDP group: with rounds: sync its rank 0 may wait 3 x round_timeout at "
            f"a boundary while the other ranks wait in a collective, which fails after "
            f"parallel.timeout ({collective_timeout:g} s); set round_timeout to at most "
            f"{max(0.0, (collective_timeout - GROUP_WAIT_MARGIN_S) / 3):g} s or raise "
            f"parallel.timeout to at least {longest:g} s"
        )


def _coordinated(run: DiLoCoRun, model: Any) -> Any:
    """The module rank 0's coordinator reads and installs into: the model itself, or the
    whole-tensor view of an FSDP group's shards."""
    if run.group is not None and run.group.view is not None:
        return run.group.view
    return model


@hookimpl
def after_optimizer_step(trainer: Any, model: Any, step: int) -> bool | None:
    """Forward the step to the coordinator; True when a delta was pushed or a global loaded.
    The run's last step (``run.max_steps``) uploads its partial inner loop."""
    final = step >= trainer.config.run.max_steps
    run = run_of(trainer)
    section = _section(trainer.config)
    group = run.group if run is not None else None
    if group is not None and section is not None and _sync_point(section, step, final):
        group.gather()  # every rank, on the training thread: a collective
    coordinator = coordinator_of(trainer)
    replaced: bool | None = None
    if coordinator is not None and coordinator.started:
        assert run is not None
        replaced = coordinator.after_optimizer_step(_coordinated(run, model), step, final=final)
    if not trainer.parallel.enabled or section is None:
        return replaced
    return _agree_across_ranks(trainer, model, step, final, bool(replaced))


def _sync_point(section: DistributedConfig, step: int, final: bool) -> bool:
    """A step where the node may upload or install: a fragment's boundary, or the last one."""
    from speedtronic_diloco.fragments import FragmentSchedule

    # The same schedule the coordinator follows: fragment j syncs at offsets j * H // K.
    return final or bool(FragmentSchedule(section.inner_steps, section.fragments).due(step))


def _agree_across_ranks(trainer: Any, model: Any, step: int, final: bool, replaced: bool) -> bool:
    """A node that is a DDP or FSDP group: at each sync point (a fragment's boundary, or the
    last step) rank 0 tells the other ranks whether it pushed or installed, and hands its
    weights to them when they changed, so the ranks never diverge. One small collective per sync
    point, none on the steps between."""
    section = _section(trainer.config)
    assert section is not None
    if not _sync_point(section, step, final):
        return False
    run = run_of(trainer)
    assert run is not None
    # A DDP group re-broadcasts after any push or install; an FSDP group's shards need rank
    # 0's view only when a global was installed into it (a push leaves the view as gathered).
    changed = run.group.written if run.group is not None else replaced
    replaced, changed = (bool(v) for v in trainer.parallel.broadcast((replaced, changed)))
    if changed:
        _weights_from_main(run, model)
    return replaced


def _weights_from_main(run: DiLoCoRun, model: Any) -> None:
    """Rank 0's weights onto every rank of the group: broadcast in place (DDP), or rank 0's
    view loaded into every rank's shards (FSDP)."""
    if run.group is not None:
        run.group.scatter()
        return
    import torch.distributed as dist

    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)


@hookimpl
def on_checkpoint(trainer: Any, state: dict[str, Any]) -> None:
    """Save the coordinator state under ``diloco``."""
    coordinator = coordinator_of(trainer)
    if coordinator is not None:
        state[STATE_KEY] = coordinator.state_dict()


@hookimpl
def on_train_end(trainer: Any, error: BaseException | None) -> None:
    """After a run that ended normally, let the last delta land and the master aggregate what
    is pending (:meth:`~speedtronic_diloco.coordinator.DumbDiLoCoCoordinator.finish`); then
    stop the coordinator (bounded; never raises). The trainer drops the run's state next."""
    coordinator = coordinator_of(trainer)
    if coordinator is None:
        return
    try:
        if error is None:
            coordinator.finish()
        if coordinator.started:  # the master stops waiting for this node
            from speedtronic_diloco.membership import announce_left, left_reason

            reason = left_reason(error, trainer.step, trainer.config.run.max_steps)
            announce_left(
                coordinator.transport,
                coordinator.node_id,
                coordinator.local_step,
                reason,
                retry=coordinator.ctx.retry,
                stop=coordinator.ctx.stop,
            )
        coordinator.stop()
    except Exception:  # on_train_end must not raise
        log.exception("stopping DumbDiLoCo failed")


COMMAND_GROUP = "diloco"


def diloco_subcommands(subparsers: Any) -> Any:
    """The sub-parsers of the ``speedtronic diloco`` command group on the CLI's ``subparsers``,
    creating the group on first use: every caller (``status``, ``rollback``...) gets the same
    group, whoever registers first."""
    group = subparsers.choices.get(COMMAND_GROUP)
    if group is None:
        group = subparsers.add_parser(
            COMMAND_GROUP, help="inspect and manage a DumbDiLoCo run (`status`, ...)"
        )
        group.set_defaults(handler=lambda args: _group_help(group))
    commands = getattr(group, "diloco_commands", None)
    if commands is None:
        commands = group.add_subparsers(dest="diloco_command", metavar="COMMAND")
        group.diloco_commands = commands
    return commands


def _group_help(group: argparse.ArgumentParser) -> int:
    group.print_help()
    return 2


@hookimpl
def register_commands(subparsers: Any) -> None:
    """``speedtronic diloco status`` / ``rollback`` (and the group other DiLoCo commands
    join), and ``speedtronic train --take-over`` (``distributed.take_over=true``)."""
    from speedtronic.cli import add_config_flag

    train = subparsers.choices.get("train")
    if train is not None:
        add_config_flag(
            train,
            "--take-over",
            "distributed.take_over=true",
            help="DiLoCo master: take over the lease of a master that stopped renewing it, once "
            "it has expired (same as --set distributed.take_over=true)",
        )
    from speedtronic_diloco.status import add_status_command

    add_status_command(diloco_subcommands(subparsers))
    from speedtronic_diloco.rollback import add_rollback_command

    add_rollback_command(diloco_subcommands(subparsers))


def global_evaluator(trainer: Any, section: DistributedConfig) -> Any:
    """``evaluate(global weights) -> loss`` for a master (or a standby) whose run has an evaluator
    (``distributed.eval_globals``, default on with eval), else None.

    The outer thread calls it on a CPU copy of the model (``copy.deepcopy`` once, here) over
    the evaluator's held-out micro-batches, read here on the training thread with the random
    generators restored afterwards, so training is not disturbed."""
    if section.role != "master" and not section.failover:  # a standby may become the master
        return None
    evaluator = trainer.evaluator
    wanted = section.eval_globals if section.eval_globals is not None else evaluator is not None
    if not wanted:
        return None
    if evaluator is None:
        log.warning("distributed.eval_globals is set but the run has no eval; not evaluating")
        return None
    import threading

    import torch

    from speedtronic.batch import batch_size_and_tokens, call_model, loss_of, move_to
    from speedtronic.checkpoint import rng_state, set_rng_state
    from speedtronic_diloco.tensors import install_state

    cpu = torch.device("cpu")
    saved = rng_state()
    try:
        # The windows the run's evaluation scores, those of every rank of a DDP group.
        batches = [move_to(b, cpu) for b in evaluator.held_out_batches(every_rank=True)]
        model = _unsharded_copy(trainer).to(cpu).eval()
    except Exception as exc:  # evaluation is an extra: a failure leaves training alone
        log.warning("not evaluating globals: %s: %s", type(exc).__name__, exc)
        return None
    finally:
        set_rng_state(saved)
    if not batches:
        return None
    lock = threading.Lock()

    def evaluate(weights: Any) -> float:
        with lock, torch.no_grad():
            install_state(model, weights)
            total = 0.0
            tokens = 0
            for batch in batches:
                count = batch_size_and_tokens(batch)[1]
                total += float(loss_of(call_model(model, batch)).double()) * count
                tokens += count
            return total / tokens  # per token, as the run's evaluation weighs it

    return evaluate


def _unsharded_copy(trainer: Any) -> Any:
    """A model of the run's own to score globals on in another thread: a copy of the model, or
    under FSDP (whose forward is a collective of the group) a fresh one built from the config
    (``evaluate`` installs every global whole before it scores)."""
    if not trainer.strategy.shards_parameters:
        import copy

        return copy.deepcopy(trainer.model)
    from speedtronic import build_model

    model_section = trainer.config.model
    return build_model(model_section.name, **model_section.params)
