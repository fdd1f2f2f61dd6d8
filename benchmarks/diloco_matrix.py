"""``diloco_quality.py --matrix``: the quality run under the conditions real swarms meet, in
both round modes, on each corpus, with ``RESULT`` lines for ``run_all.py``.

Cells: {``together`` (the workers 1 s after the master), ``staggered`` (each worker
``--matrix-stagger`` seconds after the previous node), ``slow_node`` (the last worker 2x
slower, ``benchmarks/slow_node.py``)} x {the config's ``distributed.rounds``, the other mode}.
The references (one node, N x batch) do not depend on the cell: they run once per corpus, in
that corpus's workdir, and every later cell reuses them.

Row ids: ``diloco_quality.<corpus>.<condition>.<mode>.<figure>`` with the figures
``final_global``, ``gap_closed``, ``global_over_one_node``, ``time_to_one_node_s``,
``time_to_one_node_ratio`` (``inf``: the global never reached one node's final loss),
``steps_to_one_node_ratio`` (the same in node steps: the wall ratio with a machine per node),
``timeout_wait_share`` (the largest share of a node's wall time in boundary waits that ended
by a timeout: the node's own, or the master's ``round_timeout`` closing the round) and
``wall_s``; per corpus ``diloco_quality.<corpus>.one_node``, ``.n_x_batch``
and ``.one_node_wall_s``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml
from results import emit

SLOW_FACTOR = 2.0
CONDITIONS = ("together", "staggered", "slow_node")
FIGURES = {  # summary key -> (row figure, unit, what it is)
    "final_global": ("final_global", "nats", "final global held-out loss"),
    "gap_closed": ("gap_closed", "fraction", "gap closed towards the N x batch run"),
    "global_over_one_node": ("global_over_one_node", "x", "final global / one node's final"),
    "time_to_one_node_s": ("time_to_one_node_s", "s", "wall s to one node's final loss"),
    "time_to_one_node_ratio": (
        "time_to_one_node_ratio",
        "x",
        "time to one node's final loss / one node's wall time",
    ),
    "steps_to_one_node_ratio": (
        "steps_to_one_node_ratio",
        "x",
        "node steps until the global reached one node's final loss / the run's steps (the wall "
        "ratio with a machine per node)",
    ),
    "timeout_wait_share": (
        "timeout_wait_share",
        "fraction",
        "largest share of a node's wall time in waits ended by a timeout (its or the master's)",
    ),
    "diloco_wall_s": ("wall_s", "s", "wall s of the DiLoCo run"),
}
# None there: never reached (inf)
NEVER = ("time_to_one_node_s", "time_to_one_node_ratio", "steps_to_one_node_ratio")


def round_modes(config: Path) -> tuple[str, str]:
    """The config's ``distributed.rounds`` (this version's default when unset), then the other."""
    from speedtronic_diloco.config import DistributedConfig

    default = next(f.default for f in dataclasses.fields(DistributedConfig) if f.name == "rounds")
    chosen = (yaml.safe_load(config.read_text()).get("distributed") or {}).get("rounds", default)
    return chosen, "sync" if chosen == "async" else "async"


def cell_args(
    args: argparse.Namespace, corpus: Path, condition: str, mode: str, workdir: Path
) -> argparse.Namespace:
    """``args`` for one cell: its corpus, rounds, stagger or slow node, and the corpus's workdir."""
    return argparse.Namespace(
        **{
            **vars(args),
            "corpus": [corpus],
            "rounds": mode,
            "stagger": args.matrix_stagger if condition == "staggered" else None,
            "stagger_after_outer": None,
            "slow_node": SLOW_FACTOR if condition == "slow_node" else None,
            "workdir": workdir,
            "json": None,
            "matrix": False,
        }
    )


def describe(condition: str, args: argparse.Namespace) -> str:
    if condition == "staggered":
        return f"each worker {args.matrix_stagger:g} s after the previous node"
    if condition == "slow_node":
        return (
            f"the last worker {SLOW_FACTOR:g}x slower (a sleep of its own median step time "
            "after each step, benchmarks/slow_node.py)"
        )
    return "the workers 1 s after the master"


def emit_cell(
    corpus: str, condition: str, mode: str, default: bool, summary: dict[str, Any], how: str
) -> None:
    """The RESULT lines of one cell (a figure that could not be measured is left out)."""
    for key, (figure, unit, what) in FIGURES.items():
        value = summary.get(key)
        if value is None and key in NEVER and summary.get("one_node") is not None:
            value = math.inf
        if value is None:
            continue
        emit(
            f"diloco_quality.{corpus}.{condition}.{mode}.{figure}",
            [float(value)],
            unit=unit,
            label=f"DiLoCo on {corpus}, {condition}, rounds {mode}"
            f"{' (config default)' if default else ''}: {what}",
            method=how,
        )


def emit_references(corpus: str, summary: dict[str, Any], how: str) -> None:
    for key, unit, what in (
        ("one_node", "nats", "one node alone: final held-out loss"),
        ("n_x_batch", "nats", "one node with N x the batch: final held-out loss"),
        ("one_node_wall_s", "s", "one node alone: wall s"),
    ):
        if summary.get(key) is not None:
            emit(
                f"diloco_quality.{corpus}.{key}",
                [float(summary[key])],
                unit=unit,
                label=f"{corpus}: {what}",
                method=how,
            )


def run_matrix(args: argparse.Namespace, quality: ModuleType) -> int:
    """Every cell on every ``args.corpus``, run and reported by ``quality`` (the
    ``diloco_quality`` module that parsed ``args``)."""
    default, other = round_modes(args.config)
    cells: list[dict[str, Any]] = []
    for corpus in args.corpus:
        name = quality.corpus_name(corpus)
        keep = args.workdir is not None
        workdir = (args.workdir / name) if keep else Path(tempfile.mkdtemp(prefix=f"dq_{name}_"))
        references_told = False
        try:
            for condition in CONDITIONS:
                for mode in (default, other):
                    print(f"\n## {name}: {condition}, rounds {mode}", flush=True)
                    cell = {"corpus": name, "condition": condition, "mode": mode}
                    try:
                        result = quality.run(cell_args(args, corpus, condition, mode, workdir))
                    except SystemExit as exc:  # a failed process: the other cells still run
                        print(f"cell failed: {exc}", flush=True)
                        cells.append({**cell, "error": str(exc)[-2000:], "summary": {}})
                        continue
                    quality.report(result)
                    how = (
                        f"1 run; {args.nodes} `speedtronic train` nodes on a shared directory, "
                        f"H {args.inner_steps}, {args.steps} steps x batch {args.batch}, "
                        f"{args.threads} thread(s) each; {describe(condition, args)}"
                    )
                    emit_cell(name, condition, mode, mode == default, result.summary, how)
                    if not references_told and result.summary.get("one_node") is not None:
                        emit_references(name, result.summary, how.split(";")[0])
                        references_told = True
                    cells.append({**cell, **vars(result)})
        finally:
            if not keep:
                shutil.rmtree(workdir, ignore_errors=True)
    print_table(cells)
    if args.json is not None:
        args.json.write_text(json.dumps(cells, indent=2, default=str))
        print(f"matrix written to {args.json}")
    failed = [f"{c['corpus']}/{c['condition']}/{c['mode']}" for c in cells if "error" in c]
    if failed:
        print(f"failed cells (no RESULT lines): {', '.join(failed)}")
    return 1 if failed else 0


def print_table(cells: list[dict[str, Any]]) -> None:
    """One line per cell: the figures the issue's criteria read."""
    print(
        "\ncorpus                    condition  rounds  final  one node  gap closed  "
        "to one node (x)  in steps (x)  timeout share  wall s"
    )
    for cell in cells:
        m = cell["summary"]

        def show(key: str, width: int, m: dict[str, Any] = m) -> str:
            value = m.get(key)
            return f"{value:{width}.3f}" if isinstance(value, float) else f"{'-':>{width}}"

        print(
            f"{cell['corpus']:<25} {cell['condition']:>9}  {cell['mode']:>6}  "
            f"{show('final_global', 5)}  {show('one_node', 8)}  {show('gap_closed', 10)}  "
            f"{show('time_to_one_node_ratio', 15)}  {show('steps_to_one_node_ratio', 12)}  "
            f"{show('timeout_wait_share', 13)}  "
            f"{m.get('diloco_wall_s')!s:>6}{'  FAILED' if 'error' in cell else ''}"
        )
