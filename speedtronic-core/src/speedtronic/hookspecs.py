"""The whole plugin contract of Speedtronic.

A plugin is any module or object carrying functions marked with :data:`hookimpl` whose names
match the specs below. Third-party distributions register a module through the entry-point
group ``speedtronic``; implementations may accept any subset of a hook's arguments.
"""

from __future__ import annotations

from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("speedtronic")
hookimpl = pluggy.HookimplMarker("speedtronic")


@hookspec(firstresult=True)
def build_model(name: str, params: dict[str, Any]) -> Any:
    """Build the model registered as ``name`` from ``params`` (the ``model`` section minus ``name``).

    Return an ``nn.Module`` when this plugin knows ``name``, otherwise ``None`` so the next
    plugin is asked. The first non-``None`` answer wins.
    """


@hookspec
def config_sections() -> dict[str, type]:
    """Contribute top-level config sections: a mapping of section name to a dataclass type.

    Called once when the config schema is assembled. Each dataclass is validated as strictly as
    core's own sections (unknown keys, types, ``__post_init__`` checks). A section given in a
    config that no plugin contributes is an error.
    """


@hookspec
def on_train_start(trainer: Any) -> None:
    """Called once per ``Trainer.fit`` after the model, optimizer and any resumed state are ready
    and before the first step. Plugin state restored through :func:`on_load_checkpoint` has
    already been delivered."""


@hookspec
def on_train_end(trainer: Any, error: BaseException | None) -> None:
    """Called once when ``Trainer.fit`` finishes: ``error`` is ``None`` after success, or the
    exception that is about to propagate. Release resources here; do not raise."""


@hookspec
def after_optimizer_step(trainer: Any, model: Any, step: int) -> bool | None:
    """Called after every real optimizer step (a step skipped by the GradScaler does not count)
    with the new global ``step``.

    Return ``True`` when the plugin replaced the model's weights. The trainer then clears the
    optimizer state, unless a plugin set ``trainer.reset_optimizer_on_weight_replace = False``
    (for example in :func:`on_train_start`).
    """


@hookspec
def on_checkpoint(trainer: Any, state: dict[str, Any]) -> None:
    """Called while a checkpoint is being assembled. Add this plugin's state under a key of its
    own: ``state["my_plugin"] = {...}``. Values may be tensors, numbers, strings, bools, None,
    and lists/dicts of those; no pickled objects."""


@hookspec
def on_load_checkpoint(trainer: Any, state: dict[str, Any]) -> None:
    """Called on resume, before :func:`on_train_start`, with the plugin-state mapping that
    :func:`on_checkpoint` filled when the checkpoint was written. Restore your state from your
    own key; a missing key means the checkpoint predates the plugin."""


@hookspec
def on_metric(event: str, payload: dict[str, Any]) -> None:
    """Receive one metric event (``"train_start"``, ``"step"``, ``"train_end"``,
    ``"optimizer_step_skipped"``, plugin events such as ``"outer_step"``...). ``payload`` is a
    flat mapping of JSON-compatible values and carries ``step`` where one applies. Sinks must not
    mutate it."""


@hookspec
def register_commands(subparsers: Any) -> None:
    """Add subcommands to the ``speedtronic`` CLI. ``subparsers`` is the argparse
    sub-parser action; set ``handler=callable(args) -> int`` with ``set_defaults``."""


@hookspec(firstresult=True)
def data_seed(config: Any, seed: int) -> int | None:
    """Return a replacement seed for the run's data stream, or ``None`` to keep ``seed``.

    Lets a plugin give each participant of a multi-node run its own samples (DumbDiLoCo derives
    it from the node id) without touching the user's config.
    """
