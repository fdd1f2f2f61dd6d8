"""``speedtronic plot RUN_DIR [RUN_DIR ...] --out curves.png [--x tokens|step|time]``."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_plot_command", "cmd_plot"]


def cmd_plot(args: argparse.Namespace) -> int:
    """Draw the runs' curves into one PNG and print its path."""
    from speedtronic.observe.plot import plot_runs

    out = plot_runs(args.runs, args.out, x=args.x)
    print(f"wrote {out}")
    return 0


def add_plot_command(sub: Any) -> None:
    """Add ``plot`` to the top-level sub-parsers ``sub``."""
    plot = sub.add_parser(
        "plot",
        help="draw runs' loss, eval loss, lr, tokens/s and MFU into a PNG (needs matplotlib)",
        description="Draw, from each run directory's metrics.jsonl, the training loss "
        "(smoothed, raw faint), eval loss, learning rate, tokens/s and MFU, several runs "
        "overlaid; a DiLoCo master's directory adds the global's held-out loss and the nodes "
        "per round. Needs the extra speedtronic-core[plot] (matplotlib).",
    )
    plot.add_argument(
        "runs", nargs="+", metavar="RUN_DIR", help="run directories (or metrics JSONL files)"
    )
    plot.add_argument("--out", "-o", required=True, help="the PNG to write")
    plot.add_argument(
        "--x",
        choices=("step", "tokens", "time"),
        default="step",
        help="x axis: optimizer step (default), tokens seen, or seconds since the start",
    )
    plot.set_defaults(handler=cmd_plot)
