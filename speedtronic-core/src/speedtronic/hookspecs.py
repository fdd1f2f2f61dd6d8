"""The whole plugin contract of Speedtronic.

A plugin is any module or object carrying functions marked with :data:`hookimpl` whose names
match the specs below. Third-party distributions register a module through the entry-point
group ``speedtronic``; implementations may accept any subset of a hook's arguments, by name.
These docstrings are the hook reference: ``docs/hooks.md`` is generated from them.

Every hook called during a run receives the run (``trainer``), typed as the protocol
:class:`speedtronic.engine.run.TrainerLike`: what a plugin may use of it. A plugin keeps what it
knows about a run in ``trainer.plugin_state[<plugin name>]``: a dict that is empty when a run
begins (``on_load_checkpoint`` fills it on resume, before :func:`on_train_start`) and is
emptied after :func:`on_train_end`.
"""

from __future__ import annotations

from typing import Any

import pluggy

from speedtronic.engine.run import TrainerLike

hookspec = pluggy.HookspecMarker("speedtronic")
hookimpl = pluggy.HookimplMarker("speedtronic")

__all__ = [
    "after_optimizer_step",
    "build_model",
    "config_sections",
    "data_rank",
    "data_seed",
    "export_model",
    "hookimpl",
    "hookspec",
    "load_global_state",
    "on_checkpoint",
    "on_load_checkpoint",
    "on_metric",
    "on_train_end",
    "on_train_start",
    "parallel_strategies",
    "register_commands",
]


@hookspec(firstresult=True)
def build_model(name: str, params: dict[str, Any]) -> Any:
    """Build the model called ``name`` from ``params`` (the ``model`` section minus ``name``).

    Return an ``nn.Module`` when this plugin knows ``name``, otherwise ``None`` so the next
    plugin is asked; the first non-``None`` answer wins and no plugin answering is a config
    error. List the names you answer for in a module-level ``MODEL_NAMES`` tuple so that error
    can suggest them. Import heavy dependencies (torch, your model code) inside the function:
    discovering plugins should stay cheap.
    """


@hookspec
def config_sections() -> dict[str, type]:
    """Contribute top-level config sections: return a mapping of section name to dataclass.

    Called whenever a config is validated. Subclass ``speedtronic.schema.Section`` and declare
    fields with ``speedtronic.schema.option(default, help=..., ge=..., secret=...)`` so the
    section is checked as strictly as core's own (types, bounds, unknown keys) and secrets are
    redacted. The validated section is ``config.<name>``. A section in a config file that no
    plugin contributes is an error; so is contributing a core section's name.
    """


@hookspec
def parallel_strategies() -> dict[str, type]:
    """Contribute parallel strategies: return a mapping of ``parallel.strategy`` name to a
    subclass of ``speedtronic.parallel.ParallelStrategy``.

    The class is built once per run as ``cls(parallel)`` with the run's ``ParallelContext``
    and asked to shard, wrap, reduce, clip and checkpoint as the built-in ``none``, ``ddp`` and
    ``fsdp`` are (see docs/architecture.md). A name that is already a built-in or another
    plugin's is an error naming both.
    """


@hookspec
def on_train_start(trainer: TrainerLike) -> None:
    """Called once per ``Trainer.fit``, before the first step, when the model, optimizer and
    any resumed state are ready (after :func:`on_load_checkpoint` on resume). Read your config
    section from ``trainer.config`` and start what you need here; raising aborts the run."""


@hookspec
def on_train_end(trainer: TrainerLike, error: BaseException | None) -> None:
    """Called once when ``Trainer.fit`` finishes: ``error`` is ``None`` after success, or the
    exception that is about to propagate. Release resources here; do not raise."""


@hookspec
def after_optimizer_step(trainer: TrainerLike, model: Any, step: int) -> bool | None:
    """Called after every real optimizer step (a step skipped by the GradScaler does not count)
    with the new global ``step``.

    Return ``True`` when the plugin replaced the model's weights; anything else means "not
    replaced". The trainer then clears the optimizer state, unless a plugin set
    ``trainer.reset_optimizer_on_weight_replace = False`` (for example in
    :func:`on_train_start`).
    """


@hookspec
def on_checkpoint(trainer: TrainerLike, state: dict[str, Any]) -> None:
    """Called while a checkpoint is being assembled. Add this plugin's state under a key of its
    own: ``state["my_plugin"] = {...}``. Values may be tensors, numbers, strings, bools, None,
    and lists/dicts of those; no pickled objects."""


@hookspec
def on_load_checkpoint(trainer: TrainerLike, state: dict[str, Any]) -> None:
    """Called on resume, before :func:`on_train_start`, with the mapping that
    :func:`on_checkpoint` filled when the checkpoint was written. Restore your state from your
    own key; a missing key means the checkpoint predates the plugin."""


@hookspec
def on_metric(trainer: TrainerLike, event: str, payload: dict[str, Any]) -> None:
    """Receive one metric event of the run ``trainer``: ``"train_start"``, ``"step"``,
    ``"checkpoint"``, ``"train_end"``, ``"optimizer_step_skipped"``, ``"resumed"``,
    ``"already_finished"``, ``"stopped"``, or a plugin event such as ``"outer_step"``.

    ``payload`` is a mapping of JSON-compatible values that carries ``step`` where one applies;
    do not mutate it. Keep per-run sinks in ``trainer.plugin_state[<your name>]``, so two runs in
    one process never see each other's events. An implementation written as
    ``on_metric(event, payload)`` (without the run) still receives every event. An exception
    here is logged once per plugin and never stops training.
    """


@hookspec
def register_commands(subparsers: Any) -> None:
    """Add subcommands to the ``speedtronic`` CLI. ``subparsers`` is the argparse sub-parser
    action: call ``subparsers.add_parser(...)`` and ``set_defaults(handler=fn)``, where
    ``fn(args)`` returns the exit code. Raise ``SpeedtronicError`` for user errors."""


@hookspec(firstresult=True)
def data_seed(config: Any, seed: int) -> int | None:
    """Return a seed of this participant's own, or ``None`` to keep ``seed``.

    Lets a plugin give each participant of a multi-node run its own sample order (DumbDiLoCo
    derives it from the node id) without touching the user's config: the answer keys every
    built-in source (the synthetic samples, the shards' shuffle, and an order of the byte-level
    and tokenized text and of map-style datasets, which a plain run reads in order). Evaluation
    data is never keyed. The first non-``None`` answer wins.
    """


@hookspec(firstresult=True)
def data_rank(config: Any) -> tuple[int, int] | None:
    """Return ``(rank, count)`` when this process is one of ``count`` participants that must
    read disjoint samples (DumbDiLoCo: a node's rank among the run's nodes), or ``None``.

    Every built-in source (synthetic, byte-level text, token shards, map-style user datasets)
    is split by it: participant ``r`` of ``R`` reads the samples ``i * R + r``. Under DDP each
    participant's share is split further over its ranks. The first non-``None`` answer wins.
    """


@hookspec(firstresult=True)
def export_model(
    model: Any, config: Any, format: str, directory: Any, info: dict[str, Any]
) -> str | None:
    """Write ``model`` (trained weights loaded, cast to the requested dtype, on the CPU) in
    ``format`` (``"hf"``: a folder ``transformers.AutoModelForCausalLM.from_pretrained``
    loads) into ``directory``, an empty staging folder (a ``pathlib.Path``) that
    ``speedtronic export`` renames into place once everything is written.

    Return a short description of what was written (``"LlamaForCausalLM"``) when this plugin
    exports this model to this format, otherwise ``None`` so the next plugin is asked; no
    answer is a clear error. ``info`` holds ``dtype`` (``"float32"``, ``"bfloat16"``,
    ``"float16"``), ``eos_token_id`` and ``bos_token_id`` (``None`` when the run has none) and
    ``tokenizer`` (its kind); the tokenizer files themselves are written by core afterwards.
    """


@hookspec(firstresult=True)
def load_global_state(config: Any, model: Any) -> dict[str, Any] | None:
    """Return the current global weights of a multi-node run as a state dict for ``model``
    (what ``--global`` of ``speedtronic export``, ``generate`` and ``eval`` loads), or ``None``
    when this plugin has nothing to say for ``config``.

    A plugin that owns the shared store (DumbDiLoCo's ``distributed`` section) reads the newest
    published weights there, without joining the run or writing anything, and returns CPU
    tensors under the model's own ``state_dict`` keys; when the store is configured but holds
    no weights yet it raises a ``SpeedtronicError`` saying so. No plugin answering is a clear
    error. The first non-``None`` answer wins.
    """
