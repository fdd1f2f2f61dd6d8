"""The ``speedtronic`` command: ``train``, ``validate``, ``plugins`` and plugin subcommands.

User errors (bad config, missing file, bad override) print one readable line and exit 2;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from speedtronic import __version__
from speedtronic.config import SpeedtronicConfig
from speedtronic.errors import SpeedtronicError

log = logging.getLogger("speedtronic.cli")


def _load_config(args: argparse.Namespace) -> SpeedtronicConfig:
    config = SpeedtronicConfig.from_file(args.config)
    overrides: list[str] = list(getattr(args, "set", None) or [])
    if getattr(args, "max_steps", None) is not None:
        overrides.append(f"run.max_steps={args.max_steps}")
    if getattr(args, "output_dir", None) is not None:
        overrides.append(f"run.output_dir={json.dumps(args.output_dir)}")
    if getattr(args, "resume", False):
        overrides.append("checkpoint.resume=true")
    return config.with_overrides(overrides) if overrides else config


def cmd_train(args: argparse.Namespace) -> int:
    from speedtronic.runtime import train_from_config

    config = _load_config(args)
    result = train_from_config(config)
    loss = f"{result.final_loss:.4f}" if result.final_loss is not None else "n/a"
    print(f"done: {result.steps} steps, final loss {loss}, {result.elapsed_s:.1f}s")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    config = _load_config(args)
    if args.format == "json":
        print(config.to_json(redact=True))
    else:
        print(config.to_yaml(redact=True), end="")
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from speedtronic.plugins import failed_plugins, list_plugins

    rows = list_plugins()
    if args.format == "json":
        print(json.dumps([row.__dict__ for row in rows], indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="speedtronic plugins")
    for column in ("plugin", "distribution", "version", "hooks"):
        table.add_column(column)
    for row in rows:
        table.add_row(row.name, row.distribution, row.version, ", ".join(row.hooks))
    console = Console(width=max(120, Console().width))
    console.print(table)
    for name, dist in failed_plugins().items():
        console.print(f"[red]failed to load[/red] {name} ({dist})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speedtronic", description="Be fast, be efficient.")
    parser.add_argument("--version", action="version", version=f"speedtronic {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser("train", help="train from a config file")
    train.add_argument("--config", "-c", required=True, help="YAML or JSON config file")
    train.add_argument("--max-steps", type=int, help="override run.max_steps")
    train.add_argument("--output-dir", help="override run.output_dir")
    train.add_argument("--resume", action="store_true", help="resume from the newest checkpoint")
    train.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="override a dotted config key (repeatable)")
    train.set_defaults(handler=cmd_train)

    validate = sub.add_parser("validate", help="check a config and print it resolved")
    validate.add_argument("--config", "-c", required=True)
    validate.add_argument("--format", choices=("yaml", "json"), default="yaml")
    validate.add_argument("--set", action="append", metavar="KEY=VALUE")
    validate.set_defaults(handler=cmd_validate)

    plugins = sub.add_parser("plugins", help="list discovered plugins")
    plugins.add_argument("--format", choices=("table", "json"), default="table")
    plugins.set_defaults(handler=cmd_plugins)

    from speedtronic.plugins import get_plugin_manager

    get_plugin_manager().hook.register_commands(subparsers=sub)
    return parser


def _setup_logging(debug: bool) -> None:
    from rich.logging import RichHandler

    handler: logging.Handler
    if sys.stderr.isatty():
        handler = RichHandler(show_path=False, rich_tracebacks=debug)
    else:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("speedtronic")
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    root.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``speedtronic`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    _setup_logging(debug)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "handler", None):
            parser.print_help()
            return 2
        return int(args.handler(args) or 0)
    except SpeedtronicError as exc:
        if debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def run() -> Any:
    sys.exit(main())
