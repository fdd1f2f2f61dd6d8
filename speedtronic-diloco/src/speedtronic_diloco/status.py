"""``speedtronic diloco status``: what a DumbDiLoCo run looks like from its store.

It reads the store and never writes to it: the published metadata (outer step, when and by
whom it was published, the global's eval loss, the per-node summary of the master's ledger),
the lease, the delta listing and the store's size; with streaming fragments published as files
of their own, each fragment's file, outer step and size. Per node it shows the last delta's local
step and age, the outer step it was computed from (its staleness), its norm, how many of the
node's deltas were accepted and rejected and why the last rejection happened; what the store
does not record is shown as ``-``. Nodes that left (a ``left`` record:
:mod:`speedtronic_diloco.membership`) are listed apart, with their last step and why they
ended. A rich table on a terminal, JSON with ``--json``;
``--watch`` refreshes until Ctrl-C (or ``--count`` refreshes).

``--plot out.png`` draws the run's history: the global's held-out loss per outer step, the
nodes and the delta bytes of each round. The store keeps only the latest publication, so the
rounds come from the master's metric events (``outer_step``, ``outer_eval`` in its run
directory's ``metrics.jsonl``, ``--run-dir``), and the store's current outer step and eval loss
are marked on them. Drawn with core's plotting API (:mod:`speedtronic.plot`).

    speedtronic diloco status --config configs/diloco.yaml [--json] [--watch]
    speedtronic diloco status --config configs/diloco.yaml --run-dir runs/diloco/master \
        --plot rounds.png
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speedtronic.cli import add_set_option, load_config
from speedtronic.errors import ConfigError, TransportError
from speedtronic_diloco.round_mode import ROUND_MODES
from speedtronic_diloco.timestamps import format_utc

__all__ = [
    "RunStatus",
    "add_status_command",
    "cmd_status",
    "collect_status",
    "history_panels",
    "plot_history",
    "render_status",
]

DASH = "-"


@dataclass
class RunStatus:
    """One snapshot of a run, as the store shows it (JSON-compatible through :meth:`to_json`)."""

    store: str
    checked_at: float
    outer_step: int | None = None
    published_at: float | None = None
    master: str | None = None
    lease_epoch: int | None = None
    deltas_included: int | None = None
    eval_loss: float | None = None
    lease: dict[str, Any] | None = None
    store_bytes: int | None = None
    fragment_files: list[dict[str, Any]] = field(default_factory=list)
    #: The published global's round: ``mode`` (sync / async), ``nodes``, ``staleness`` (per
    #: included delta), ``reason``, ``momentum`` (the outer momentum it stepped with).
    last_round: dict[str, Any] | None = None
    nodes: list[dict[str, Any]] = field(default_factory=list)
    #: The nodes that left (a left record), apart from ``nodes``: their row plus
    #: ``last_step``, ``reason`` and ``left_at``.
    left: list[dict[str, Any]] = field(default_factory=list)
    #: Standby masters seen (``distributed.failover``): ``node_id``, ``announced_at``.
    standbys: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    #: The master ended after its last step (lease released, left record ``max_steps``).
    finished: bool = False

    @property
    def age_s(self) -> float | None:
        """Seconds since the last publication."""
        if self.published_at is None:
            return None
        return max(0.0, self.checked_at - self.published_at)

    def to_json(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "checked_at": self.checked_at,
            "outer_step": self.outer_step,
            "published_at": self.published_at,
            "publication_age_s": self.age_s,
            "master": self.master,
            "lease_epoch": self.lease_epoch,
            "deltas_included": self.deltas_included,
            "eval_loss": self.eval_loss,
            "lease": self.lease,
            "store_bytes": self.store_bytes,
            "last_round": self.last_round,
            "nodes": self.nodes,
            "left": self.left,
            "standbys": self.standbys,
            "problems": self.problems,
            "finished": self.finished,
            **({"fragment_files": self.fragment_files} if self.fragment_files else {}),
        }


def _attempt(status: RunStatus, what: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except TransportError as exc:
        status.problems.append(f"{what}: {exc}")
        return None


def collect_status(transport: Any, now: float | None = None) -> RunStatus:
    """Read the run's state from ``transport`` (reads only; a part that cannot be read is
    named in ``problems`` and left empty)."""
    from speedtronic_diloco.lease import CLOCK_MARGIN
    from speedtronic_diloco.standby import read_standbys
    from speedtronic_diloco.transports import UnsupportedOperation

    status = RunStatus(transport.description, time.time() if now is None else now)
    metadata = _attempt(status, "global metadata", transport.read_global_metadata)
    if metadata is not None:
        status.outer_step = metadata.outer_step
        status.published_at = metadata.published_at  # a time: GlobalMetadata checked it
        status.master = metadata.master
        status.lease_epoch = metadata.lease_epoch
        status.deltas_included = metadata.deltas_included
        loss = metadata.eval_loss
        if loss is None:
            loss = metadata.extra.get("eval_loss")
        status.eval_loss = _finite(loss)
        status.fragment_files = [entry.to_json() for entry in metadata.fragment_files]
        status.last_round = _last_round(metadata.extra.get("round"))
    try:
        lease = transport.read_lease()
    except UnsupportedOperation:
        lease = None
    except TransportError as exc:
        status.problems.append(f"lease: {exc}")
        lease = None
    if lease is not None:
        if lease.released:
            state = "released"
        else:
            state = "live" if lease.expires_at > status.checked_at else "expired"
        status.lease = {
            "holder": lease.holder,
            "epoch": lease.epoch,
            "state": state,
            "expires_at": lease.expires_at,
            "expires_in_s": lease.expires_at - status.checked_at,
            "renewed_at": lease.renewed_at,
            # when a standby takes it over if it is not renewed (or released) by then
            "lapses_at": None if lease.released else lease.expires_at + CLOCK_MARGIN,
        }
    with tempfile.TemporaryDirectory() as scratch:
        found = _attempt(status, "standbys", lambda: read_standbys(transport, Path(scratch)))
    holder = lease.holder if lease is not None else None
    status.standbys = [r for r in found or () if r["node_id"] != holder]
    listing = _attempt(status, "delta listing", transport.list_deltas) or []
    status.store_bytes = _attempt(status, "store size", transport.store_bytes)
    status.nodes = _node_rows(metadata, listing, status.checked_at)
    _split_left(status, transport, listing)
    done = [row for row in status.left if row["reason"] == "max_steps" and row["node_id"] == holder]
    status.finished = bool(done) and lease is not None and lease.released
    return status


def _split_left(status: RunStatus, transport: Any, listing: list[Any]) -> None:
    """Move the nodes that left (a left record, no delta past its last step) from
    ``status.nodes`` to ``status.left``."""
    from speedtronic_diloco.transports.members import member_records_of

    members = member_records_of(transport)
    if members is None:
        return
    found = _attempt(status, "left records", members.read_left)
    if found is None:
        return
    status.problems.extend(f"left record: {problem}" for problem in found.refused)
    records = {
        node: record
        for node, record in found.records.items()
        if not any(i.node_id == node and i.local_step > record.last_step for i in listing)
    }
    rows = {row["node_id"]: row for row in status.nodes}
    status.nodes = [row for row in status.nodes if row["node_id"] not in records]
    for node, record in sorted(records.items()):
        row = rows.get(node, {"node_id": node})
        status.left.append(
            {
                **row,
                "last_step": record.last_step,
                "reason": record.reason,
                "left_at": record.left_at,
            }
        )


def _node_rows(metadata: Any, listing: list[Any], now: float) -> list[dict[str, Any]]:
    summaries: dict[str, dict[str, Any]] = dict(metadata.nodes) if metadata is not None else {}
    if metadata is not None and not summaries:  # metadata of the older format: triples only
        for node, step, _ in metadata.processed:
            entry = summaries.setdefault(node, {"high": -1})
            entry["high"] = max(entry["high"], step)
    listed: dict[str, list[Any]] = {}
    for info in listing:
        listed.setdefault(info.node_id, []).append(info)
    rows = []
    for node in sorted(set(summaries) | set(listed)):
        summary = summaries.get(node, {})
        files = sorted(listed.get(node, []), key=lambda info: info.local_step)
        high = summary.get("high")
        high = -1 if high is None else int(high)
        pending = [info for info in files if info.local_step > high]
        last_file = files[-1] if files else None
        last_step = summary.get("last_step")
        age = None
        if last_file is not None and (last_step is None or last_file.local_step >= last_step):
            last_step = last_file.local_step
            if last_file.modified is not None:
                age = now - last_file.modified
        if age is None and summary.get("last_at") is not None:
            age = now - float(summary["last_at"])
        rows.append(
            {
                "node_id": node,
                "last_delta_step": last_step,
                "age_s": None if age is None else max(0.0, age),
                "base_outer_step": summary.get("base_outer_step"),
                "staleness": _staleness(metadata, summary.get("base_outer_step")),
                "norm": _finite(summary.get("norm")),
                "accepted": summary.get("accepted"),
                "rejected": summary.get("rejected"),
                "pending": len(pending),
                "in_store": len(files),
                "last_rejection": summary.get("last_reason"),
            }
        )
    return rows


def _last_round(entry: Any) -> dict[str, Any] | None:
    """The published ``round`` entry, checked field by field (the metadata may be forged or
    written by an older master: what does not fit is left out)."""
    if not isinstance(entry, dict):
        return None
    out: dict[str, Any] = {}
    if entry.get("mode") in ROUND_MODES:
        out["mode"] = entry["mode"]
    nodes = entry.get("nodes")
    if isinstance(nodes, list) and all(isinstance(n, str) for n in nodes):
        out["nodes"] = nodes
    staleness = entry.get("staleness")
    if isinstance(staleness, list) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in staleness
    ):
        out["staleness"] = staleness
    if isinstance(entry.get("reason"), str):
        out["reason"] = entry["reason"][:40]
    momentum = _finite(entry.get("momentum"))
    if momentum is not None and not isinstance(entry.get("momentum"), bool):
        out["momentum"] = momentum
    return out or None


def _round_line(entry: dict[str, Any]) -> str:
    nodes = entry.get("nodes")
    staleness = entry.get("staleness")
    parts = [entry.get("mode", DASH)]
    if nodes is not None:
        parts.append(f"{len(nodes)} node{'' if len(nodes) == 1 else 's'}")
    if staleness:
        mean = sum(staleness) / len(staleness)
        parts.append(f"staleness {','.join(map(str, staleness))} (mean {mean:.2g})")
    if "momentum" in entry:
        parts.append(f"momentum {entry['momentum']:.3g}")
    if "reason" in entry:
        parts.append(entry["reason"])
    return ", ".join(parts)


def _staleness(metadata: Any, base: Any) -> int | None:
    if metadata is None or base is None:
        return None
    try:
        return max(0, metadata.outer_step - int(base))
    except (TypeError, ValueError):
        return None


def _finite(value: Any) -> float | None:
    try:
        number = None if value is None else float(value)
    except (TypeError, ValueError):
        return None
    return number if number is not None and math.isfinite(number) else None


# --------------------------------------------------------------------------- rendering


def _age(seconds: float | None) -> str:
    if seconds is None:
        return DASH
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172_800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _size(count: int | None) -> str:
    if count is None:
        return DASH
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"


def _when(moment: float | None) -> str:
    if moment is None:
        return DASH
    return format_utc(moment)  # a forged published_at is shown, not raised


def _cell(value: Any) -> str:
    if value is None:
        return DASH
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


FINISHED = "finished: the master ended after its last step"


def summary_lines(status: RunStatus) -> list[str]:
    """The lines above the node table."""
    lease = status.lease
    if lease is None:
        holder = DASH
    elif lease["state"] == "live":
        lapses = lease["lapses_at"] - status.checked_at
        holder = (
            f"{lease['holder']} (epoch {lease['epoch']}, expires in {_age(lease['expires_in_s'])}"
            f", lapses in {_age(lapses)} unless renewed)"
        )
    else:
        holder = f"{lease['holder']} (epoch {lease['epoch']}, {lease['state']})"
    published = DASH
    if status.published_at is not None:
        published = f"{_when(status.published_at)} ({_age(status.age_s)} ago)"
    by = f" by {status.master}" if status.master else ""
    lines = [
        f"store        {status.store}",
        f"outer step   {_cell(status.outer_step)}{by}",
        f"published    {published}",
        f"eval loss    {_cell(status.eval_loss)}",
        f"last round   {_round_line(status.last_round) if status.last_round else DASH}",
        f"lease        {holder}",
        f"run          {FINISHED if status.finished else 'not finished'}",
        f"standbys     {_standbys(status) or DASH}",
        f"store size   {_size(status.store_bytes)}",
    ]
    if status.fragment_files:
        files = status.fragment_files
        steps = ", ".join(str(entry["outer_step"]) for entry in files)
        total = sum(int(entry["size"]) for entry in files)
        lines.append(f"fragments    {len(files)} files at outer steps {steps}, {_size(total)}")
    return lines


def _standbys(status: RunStatus) -> str:
    return ", ".join(
        f"{r['node_id']} (announced {_age(status.checked_at - r['announced_at'])} ago)"
        for r in status.standbys
    )


COLUMNS = (
    ("node", "node_id"),
    ("last delta", "last_delta_step"),
    ("age", "age_s"),
    ("base outer", "base_outer_step"),
    ("norm", "norm"),
    ("accepted", "accepted"),
    ("rejected", "rejected"),
    ("pending", "pending"),
    ("last rejection", "last_rejection"),
)


def render_status(status: RunStatus, console: Any) -> None:
    """Print ``status`` on a rich ``console``: the summary, then one row per node."""
    from rich.markup import escape
    from rich.table import Table

    for line in summary_lines(status):
        console.print(escape(line), highlight=False)
    table = Table(title=None, show_lines=False)
    for title, key in COLUMNS:
        if key == "last_rejection":
            table.add_column(title, overflow="ellipsis", no_wrap=True, max_width=36)
        elif key == "node_id":
            table.add_column(title, overflow="fold", min_width=6)
        else:
            table.add_column(title, no_wrap=True, justify="right")
    for row in status.nodes:
        cells = []
        for _, key in COLUMNS:
            value = row.get(key)
            if key == "age_s":
                cells.append(_age(value))
            elif key == "base_outer_step" and value is not None:
                stale = row.get("staleness")
                cells.append(f"{value} (-{stale})" if stale else str(value))
            else:
                cells.append(escape(_cell(value)))
        table.add_row(*cells)
    if status.nodes:
        console.print(table)
    elif not status.left:
        console.print("no node has uploaded a delta yet")
    for row in status.left:
        when = "" if row["left_at"] is None else f", {_when(row['left_at'])}"
        line = (
            f"left         {row['node_id']} after step {row['last_step']} ({row['reason']}{when})"
        )
        console.print(escape(line), highlight=False)
    for problem in status.problems:
        console.print(f"[yellow]could not read {escape(problem)}[/yellow]")


# --------------------------------------------------------------------------- the picture


def history_panels(history: Any, status: RunStatus | None = None) -> list[Any]:
    """The panels of a DiLoCo run's history (a :class:`speedtronic.plot.RunHistory` of the
    master's metrics): the global's held-out loss per outer step, nodes and MiB of deltas per
    round; ``status`` (the store now) adds its published outer step and eval loss."""
    from speedtronic.plot import Line, Panel

    def per_round(event: str, key: str, scale: float = 1.0) -> tuple[list[float], list[float]]:
        found = {}
        for record in history.events(event):
            step, value = record.get("outer_step"), _finite(record.get(key))
            if isinstance(step, int) and value is not None:
                found[step] = value * scale
        return [float(s) for s in sorted(found)], [found[s] for s in sorted(found)]

    loss = Panel("global held-out loss", "outer step", "loss")
    x, y = per_round("outer_eval", "loss")
    if y:
        loss.lines.append(Line(x, y, "master's outer_eval", markers=True, color="C0"))
    if status is not None and status.outer_step is not None and status.eval_loss is not None:
        loss.lines.append(
            Line([status.outer_step], [status.eval_loss], "store now", markers=True, color="C3")
        )
    if not loss.lines:
        loss.note = "no evaluation of the global (eval not configured)"
    nodes = Panel("nodes and staleness per round", "outer step", "nodes / outer steps")
    x, y = per_round("outer_step", "nodes_included")
    if y:
        nodes.lines.append(Line(x, y, "nodes included", markers=True, color="C1"))
    stale: dict[int, float] = {}
    for record in history.events("outer_step"):
        step, values = record.get("outer_step"), str(record.get("staleness") or "").split(",")
        if isinstance(step, int) and all(v.isdigit() for v in values):
            stale[step] = sum(int(v) for v in values) / len(values)
    if stale:
        steps = sorted(stale)
        xs, ys = [float(s) for s in steps], [stale[s] for s in steps]
        line = Line(xs, ys, "mean staleness", markers=True, color="C4")
        nodes.lines.append(line)
    received = Panel("delta bytes per round", "outer step", "MiB received")
    x, y = per_round("outer_step", "bytes_received", 1 / 2**20)
    if y:
        received.lines.append(Line(x, y, "bytes received", markers=True, color="C2"))
    return [loss, nodes, received]


def plot_history(
    run_dir: Any, out: Any, status: RunStatus | None = None, title: str | None = None
) -> Any:
    """Draw the history of the DiLoCo run whose master writes its metrics in ``run_dir`` into
    the PNG ``out``; DataError when that directory holds no rounds."""
    from speedtronic.errors import DataError
    from speedtronic.plot import draw_panels, read_run

    history = read_run(run_dir)
    if not history.events("outer_step"):
        raise DataError(
            f"{history.source} holds no outer_step events: pass the master's run directory "
            "(its --output-dir) with --run-dir"
        )
    return draw_panels(history_panels(history, status), out, title=title)


# --------------------------------------------------------------------------- the command


def _transport_from(args: argparse.Namespace) -> Any:
    from speedtronic_diloco.config import distributed_config
    from speedtronic_diloco.transports import open_transport

    section = distributed_config(load_config(args))
    if not section.repo_id:
        raise ConfigError("is not set: status needs the run's store", "distributed.repo_id")
    return open_transport(section)


def cmd_status(args: argparse.Namespace) -> int:
    """``speedtronic diloco status``: print the run's state (reads the store only)."""
    from rich.console import Console

    if args.plot is not None:
        return _cmd_plot(args)
    transport = _transport_from(args)
    console = Console(width=max(120, Console().width))
    count = args.count if args.count is not None else (None if args.watch else 1)
    shown = 0
    try:
        while True:
            status = collect_status(transport)
            if count == 1 and status.outer_step is None and status.problems and not args.json:
                # One look at a store that cannot be read at all: one clean error line.
                raise TransportError("; ".join(status.problems))
            if args.json:
                indent = None if args.watch else 2
                print(json.dumps(status.to_json(), indent=indent), flush=True)
            else:
                if args.watch and console.is_terminal:
                    console.clear()
                elif shown:
                    console.print()
                render_status(status, console)
            shown += 1
            if count is not None and shown >= count:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        transport.close()


def _cmd_plot(args: argparse.Namespace) -> int:
    from speedtronic.plot import require_matplotlib

    require_matplotlib()  # before reading the store: a missing extra is the first error
    config = load_config(args)
    run_dir = args.run_dir if args.run_dir is not None else config.run.output_dir
    transport = _transport_from(args)
    try:
        status = collect_status(transport)
    finally:
        transport.close()
    title = f"{status.store}: outer step {_cell(status.outer_step)}"
    out = plot_history(run_dir, args.plot, status, title=title)
    print(f"wrote {out}")
    for problem in status.problems:
        print(f"could not read {problem}")
    return 0


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or not 0.1 <= value <= 86_400:
        raise argparse.ArgumentTypeError(f"must be between 0.1 and 86400 seconds, got {text}")
    return value


def _positive_count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_status_command(commands: Any) -> None:
    """Add ``status`` to the ``speedtronic diloco`` sub-parsers ``commands``."""
    status = commands.add_parser(
        "status",
        help="show a run's outer step, lease and per-node contributions (reads the store only)",
        description="Read a DumbDiLoCo run's store (never writing to it) and show its outer "
        "step, last publication, eval loss, lease holder, store size and, per node, the last "
        "delta, its staleness and norm and the accepted/rejected counts.",
    )
    status.add_argument("--config", "-c", required=True, help="the run's YAML or JSON config")
    add_set_option(status)
    status.add_argument("--json", action="store_true", help="print JSON (one document per look)")
    status.add_argument(
        "--watch", action="store_true", help="refresh until Ctrl-C (or --count looks)"
    )
    status.add_argument(
        "--interval",
        type=_positive_seconds,
        default=5.0,
        metavar="SECONDS",
        help="seconds between refreshes with --watch (default 5)",
    )
    status.add_argument(
        "--count", type=_positive_count, default=None, metavar="N", help="stop after N looks"
    )
    status.add_argument(
        "--plot",
        metavar="PNG",
        help="draw the run's history (global eval loss per outer step, nodes and bytes per "
        "round) into this PNG (needs speedtronic-core[plot])",
    )
    status.add_argument(
        "--run-dir",
        metavar="DIR",
        help="with --plot: the master's run directory, whose metrics.jsonl holds the rounds "
        "(default: run.output_dir of the config)",
    )
    status.set_defaults(handler=cmd_status)
