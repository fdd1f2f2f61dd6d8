"""``speedtronic eval``: score a saved checkpoint (or a DiLoCo global) on the config's eval data.

By default it scores every window of the held-out split once (``--batches all``; an endless
stream such as the synthetic data takes the config's ``eval.batches``). ``--batches N`` picks
the same spread windows training evaluates with ``eval.batches: N``
(see :mod:`speedtronic.engine.eval`),
so the number printed then matches the run's ``eval`` events for the same weights.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from speedtronic.cli.options import add_set_option, load_config
from speedtronic.errors import CheckpointError, PluginError

__all__ = ["add_eval_command", "cmd_eval"]


def add_eval_command(subparsers: Any) -> None:
    """Register ``speedtronic eval`` on the CLI's sub-parsers."""
    command = subparsers.add_parser(
        "eval", help="evaluate a checkpoint (or a DiLoCo global) on the held-out data"
    )
    command.add_argument("--config", "-c", required=True, help="YAML or JSON config file")
    which = command.add_mutually_exclusive_group()
    which.add_argument(
        "--checkpoint",
        default="latest",
        metavar="latest|best|PATH",
        help="which checkpoint of the run to score (default latest)",
    )
    which.add_argument(
        "--global",
        dest="use_global",
        action="store_true",
        help="score the shared store's current global weights (needs speedtronic-diloco)",
    )
    command.add_argument(
        "--batches",
        type=_batches,
        metavar="N|all",
        help="micro-batches to score, spread over the held-out split (default all: every "
        "window once)",
    )
    command.add_argument(
        "--format", choices=("table", "json"), default="table", help="output format"
    )
    add_set_option(command)
    command.set_defaults(handler=cmd_eval)


def _batches(text: str) -> int | str:
    if text == "all":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'all', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def cmd_eval(args: argparse.Namespace) -> int:
    """Load the weights, evaluate, print loss/ppl/tokens and how many windows were scored."""
    config = load_config(args)
    from speedtronic.engine.preflight import check_before_building

    check_before_building(config, training=False)  # before torch and the model

    from speedtronic.engine.eval import Evaluator, build_eval_source
    from speedtronic.engine.model_limits import model_limits
    from speedtronic.engine.precision import resolve_device, resolve_precision
    from speedtronic.engine.state_checks import state_mismatch
    from speedtronic.inference import read_checkpoint
    from speedtronic.observe.threads import apply_threads
    from speedtronic.plugins import get_plugin_manager
    from speedtronic.registry import build_model_from_hook

    apply_threads(config.run.threads)
    if args.use_global:
        model = build_model_from_hook(config.model.name, **config.model.params)
        weights = get_plugin_manager().hook.load_global_state(config=config, model=model)
        if weights is None:
            raise PluginError(
                "--global: no plugin can read global weights for this config (install "
                "speedtronic-diloco and enable the distributed section)"
            )
        source = "the store's global weights"
    else:
        # As export and generate read it: latest, best, a step_NNNNNNNN directory or a
        # directory holding them, with the trainer state checked.
        loaded = read_checkpoint(config, args.checkpoint)  # a missing one fails before the model
        weights = loaded.state.get("model")
        source = str(loaded.path)
        model = build_model_from_hook(config.model.name, **config.model.params)
    mismatch = state_mismatch(model.state_dict(), weights)
    if mismatch:
        raise CheckpointError(f"{source} does not fit this model ({mismatch})")
    model.load_state_dict(weights)
    device = resolve_device(config.run.device)
    model.to(device)
    from speedtronic.engine.batch import label_mode

    held_out = build_eval_source(config, **model_limits(model, config.model.params))
    batches = args.batches
    if batches is None:
        windows = getattr(held_out, "windows", None)
        finite = windows.count is not None if windows is not None else held_out.epoch_batches
        batches = "all" if finite else config.eval.batches
    evaluator = Evaluator(
        held_out,
        batches,
        device=device,
        precision=resolve_precision(config.precision.mode, device),
        label_mode=label_mode(config.data.labels, model),
    )
    result = evaluator.evaluate(model, step=-1)
    record = {
        "weights": source,
        "data": evaluator.description,
        "loss": result.loss,
        "ppl": result.ppl,
        "tokens": result.tokens,
        "batches": result.batches,
        "windows": result.windows,
        "of_windows": result.of_windows,
        "elapsed_s": result.elapsed_s,
    }
    if args.format == "json":
        # A diverged checkpoint scores NaN (and a huge loss an infinite ppl): JSON has no such
        # numbers, so they are written as null.
        finite = {
            key: None if isinstance(value, float) and not math.isfinite(value) else value
            for key, value in record.items()
        }
        print(json.dumps(finite, allow_nan=False, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="speedtronic eval", show_header=False)
    shown = dict(record)
    of = shown.pop("of_windows")
    shown["windows"] = f"{result.windows} of {of}" if of is not None else str(result.windows)
    for key, value in shown.items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console().print(table)
    return 0
