"""``speedtronic diloco rollback``: make a stopped master continue from an earlier good global.

The master keeps its last ``distributed.keep_history`` outer states (global weights and outer
momentum) under ``<state_dir>/<node_id>/history/``. ``rollback --to N`` writes the global and
momentum of outer step N into the master's state as a *new* outer step (the current one + 1, so
every node installs it), keeps the ledger (deltas processed since N are not aggregated again)
and clears a halt; the master publishes it when it starts again. ``--list`` shows what is kept.

The master must be stopped: a running master would overwrite its state file.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from speedtronic.cli import add_set_option, load_config
from speedtronic.errors import ConfigError, SpeedtronicError

__all__ = ["add_rollback_command", "cmd_rollback", "master_state_dir"]


def add_rollback_command(commands: Any) -> argparse.ArgumentParser:
    """Add ``rollback`` to the ``speedtronic diloco`` group's sub-parsers."""
    parser = commands.add_parser(
        "rollback",
        help="continue a stopped master from an earlier outer step (or lift a halt)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--state-dir",
        help="the master's state directory (`<run.output_dir>/diloco/<node_id>`, the folder "
        "holding outer_state.safetensors)",
    )
    where.add_argument("--config", "-c", help="the master's config file (YAML or JSON)")
    parser.add_argument("--output-dir", help="override run.output_dir (with --config)")
    add_set_option(parser)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument(
        "--to", type=int, metavar="OUTER_STEP", help="the kept outer step to continue from"
    )
    action.add_argument("--list", action="store_true", help="list the kept outer steps")
    parser.set_defaults(handler=cmd_rollback)
    return parser


def master_state_dir(args: argparse.Namespace) -> Path:
    """The state directory ``--state-dir`` names, or the one the master's config implies."""
    if args.state_dir:
        return Path(args.state_dir)
    from speedtronic_diloco.config import resolve_state_dir
    from speedtronic_diloco.identity import resolve_node_id

    config = load_config(args)  # --config with its --set and --output-dir
    section = config.plugins.get("distributed")
    if section is None or not section.enabled:
        raise ConfigError("the config has no enabled distributed section", "distributed")
    if section.role != "master":
        raise ConfigError(
            "is not `master`: rollback acts on the master's state (add "
            "--set distributed.role=master if the master overrides it on its command line)",
            "distributed.role",
        )
    node = resolve_node_id(section.node_id)
    return resolve_state_dir(section, config.run.output_dir) / node


def cmd_rollback(args: argparse.Namespace) -> int:
    """``speedtronic diloco rollback``."""
    from speedtronic_diloco.master.history import history_steps, roll_back
    from speedtronic_diloco.master.state import STATE_FILE
    from speedtronic_diloco.tensors import TensorFileError, load_tensors

    state_dir = master_state_dir(args)
    state = state_dir / STATE_FILE
    if not state.exists():
        raise SpeedtronicError(f"no master state at {state}")
    if args.list:
        try:
            _, meta = load_tensors(state)
        except TensorFileError as exc:
            raise SpeedtronicError(str(exc)) from None
        print(f"master state {state}: outer step {meta.get('outer_step')}")
        if meta.get("halted"):
            print(f"HALTED: {meta['halted']}")
        kept = history_steps(state_dir)
        print("kept for rollback: " + (", ".join(map(str, kept)) or "none"))
        return 0
    new_step = roll_back(state_dir, args.to)
    print(
        f"rolled back: outer step {new_step} is the global of outer step {args.to}; start the "
        "master (with --resume if it was resumed before) to publish it"
    )
    return 0
