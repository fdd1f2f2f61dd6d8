"""What every ``speedtronic`` command that reads a config shares: ``--set`` overrides, a
plugin's switch that stands for one, and :func:`load_config`, which applies them.

Kept apart from :mod:`speedtronic.cli` so that the modules adding commands to it
(``eval``, ``export``, plugins' own) import these without importing the parser that imports
them.
"""

from __future__ import annotations

import argparse
import json

from speedtronic.config import SpeedtronicConfig

__all__ = ["add_config_flag", "add_set_option", "load_config"]


def load_config(args: argparse.Namespace) -> SpeedtronicConfig:
    """The config a command's ``--config`` names, with its ``--set`` overrides and the
    shorthands ``--max-steps``, ``--output-dir``, ``--resume`` and ``--profile`` applied."""
    config = SpeedtronicConfig.from_file(args.config)
    overrides: list[str] = list(getattr(args, "set", None) or [])
    if getattr(args, "max_steps", None) is not None:
        overrides.append(f"run.max_steps={args.max_steps}")
    if getattr(args, "output_dir", None) is not None:
        overrides.append(f"run.output_dir={json.dumps(args.output_dir)}")
    if getattr(args, "resume", False):
        overrides.append("checkpoint.resume=true")
    if getattr(args, "profile", None) is not None:
        start, end = args.profile
        overrides += [f"profile.start={start}", f"profile.end={end}"]
    return config.with_overrides(overrides) if overrides else config


def add_set_option(parser: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE`` (repeatable), the dotted config override every command that reads a
    config takes; read it back with :func:`load_config`."""
    parser.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a dotted config key, value parsed as YAML (repeatable)",
    )


def add_config_flag(parser: argparse.ArgumentParser, flag: str, override: str, help: str) -> None:
    """A switch ``flag`` on ``parser`` that stands for ``--set override``: a plugin gives
    ``speedtronic train`` a flag for one of its config keys, e.g. ``add_config_flag(
    subparsers.choices["train"], "--take-over", "distributed.take_over=true", ...)`` in its
    ``register_commands`` hook. :func:`load_config` applies it in command-line order with the
    ``--set`` options (the last one of a key wins)."""
    if "=" not in override:
        raise ValueError(f"override {override!r} is not KEY=VALUE")
    parser.add_argument(flag, dest="set", action="append_const", const=override, help=help)
