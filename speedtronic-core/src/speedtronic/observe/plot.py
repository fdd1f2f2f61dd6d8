"""Pictures of runs, drawn from their metrics JSONL (``speedtronic plot``).

:func:`read_run` reads a run directory's ``metrics.jsonl`` (where every run writes its metric
events unless ``logging.json_file`` says otherwise) into a :class:`RunHistory`;
:func:`run_panels` turns runs into :class:`Panel` s (training loss smoothed with the raw values
faint, eval loss, learning rate, tokens/s, MFU; for a DiLoCo master, the global's held-out loss
and the nodes per round); :func:`draw_panels` draws panels into one PNG. Plugins draw their own
pictures with :class:`Panel`, :class:`Line` and :func:`draw_panels`, so matplotlib is imported
in one place, lazily: it is the optional extra ``speedtronic-core[plot]``.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from speedtronic.errors import DataError

__all__ = [
    "METRICS_FILE",
    "PLOT_EXTRA",
    "Line",
    "Panel",
    "RunHistory",
    "draw_panels",
    "plot_runs",
    "read_run",
    "require_matplotlib",
    "run_panels",
    "smooth",
]

METRICS_FILE = "metrics.jsonl"
PLOT_EXTRA = "speedtronic-core[plot]"
XAxis = Literal["step", "tokens", "time"]
X_LABELS = {"step": "optimizer step", "tokens": "tokens", "time": "time (s)"}
# A metrics file is one short line per logged step: anything far larger is not one.
MAX_METRICS_BYTES = 1 << 30


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or a DataError naming the extra."""
    try:
        import matplotlib
    except ImportError:
        raise DataError(
            f"plotting needs matplotlib: pip install '{PLOT_EXTRA}' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg", force=True)  # no display needed, and never a GUI window
    import matplotlib.pyplot as plt

    return plt


@dataclass
class Line:
    """One curve of a panel. ``faint`` draws it thin and light (raw values under a smoothed
    curve) and keeps it out of the legend; ``markers`` marks each point (sparse series)."""

    x: Sequence[float]
    y: Sequence[float]
    label: str | None = None
    faint: bool = False
    markers: bool = False
    dashed: bool = False
    color: str | None = None


@dataclass
class Panel:
    """One set of axes: a title, axis labels and its lines; ``note`` is shown when it has no
    line (what is missing and why)."""

    title: str
    xlabel: str
    ylabel: str
    lines: list[Line] = field(default_factory=list)
    note: str = ""
    log_y: bool = False


@dataclass
class RunHistory:
    """The metric events of one run: the last fresh start (``train_start`` at step 0) and the
    resumes after it, in file order."""

    name: str
    source: Path
    records: list[dict[str, Any]]

    def events(self, event: str) -> list[dict[str, Any]]:
        """The records of one event, in order."""
        return [r for r in self.records if r.get("event") == event]

    def steps(self) -> list[dict[str, Any]]:
        """The ``step`` records, one per step (a step logged again after a resume keeps its
        later record), by step."""
        by_step = {r["step"]: r for r in self.events("step") if _number(r.get("step"))}
        return [by_step[step] for step in sorted(by_step)]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_run(path: str | os.PathLike[str]) -> RunHistory:
    """The run in ``path``: a run directory holding ``metrics.jsonl``, or a JSONL file of
    metric events. Raises DataError naming the path when it is missing, unreadable or holds no
    metric events; a torn last line (a run killed mid-write) is skipped."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"run directory {path} does not exist")
    file = path / METRICS_FILE if path.is_dir() else path
    if not file.is_file():
        raise DataError(
            f"{path} holds no {METRICS_FILE}: a run writes its metrics there (logging.json_file "
            "moves them; pass that file instead)"
        )
    try:
        size = file.stat().st_size
        if size > MAX_METRICS_BYTES:
            raise DataError(f"{file} is larger than {MAX_METRICS_BYTES >> 30} GiB")
        text = file.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise DataError(f"cannot read {file}: {exc.strerror or exc}") from None
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("event"), str):
            records.append(record)
    if not records:
        raise DataError(f"{file} holds no metric events (is it a speedtronic metrics file?)")
    fresh = [
        i for i, r in enumerate(records) if r["event"] == "train_start" and not r.get("start_step")
    ]
    if fresh:
        records = records[fresh[-1] :]
    name = path.name if path.is_dir() else path.stem
    return RunHistory(name=name or str(path), source=file, records=records)


def smooth(values: Sequence[float], weight: float | None = None) -> list[float]:
    """An exponential moving average with TensorBoard's start-up correction (the first
    points are not pulled towards zero). By default its span is a fiftieth of the points: a
    short run's few logged losses (each already a mean over ``log_every`` steps) stay as they
    are, a long run's curve is smoothed over a constant share of it."""
    if weight is None:
        span = max(1.0, len(values) / 50)
        weight = 1 - 2 / (span + 1)
    out, average, norm = [], 0.0, 0.0
    for value in values:
        average = weight * average + (1 - weight) * value
        norm = weight * norm + (1 - weight)
        out.append(average / norm)
    return out


def _x_of(run: RunHistory, records: list[dict[str, Any]], x: XAxis) -> list[float]:
    """Each record's position on the x axis; a record without tokens (an eval) is placed by
    its step between the step records around it."""
    if x == "step":
        return [float(r.get("step", math.nan)) for r in records]
    if x == "time":
        starts = run.events("train_start")
        origin = starts[0]["time"] if starts and _number(starts[0].get("time")) else None
        if origin is None:
            times = [r["time"] for r in run.records if _number(r.get("time"))]
            origin = times[0] if times else 0.0
        return [float(r.get("time", math.nan)) - origin for r in records]
    steps = run.steps()
    known = [(r["step"], r["tokens"]) for r in steps if _number(r.get("tokens"))]
    out = []
    for record in records:
        if _number(record.get("tokens")) and record.get("event") == "step":
            out.append(float(record["tokens"]))
        else:
            out.append(_interpolate(known, record.get("step")))
    return out


def _interpolate(points: list[tuple[float, float]], at: Any) -> float:
    if not points or not _number(at):
        return math.nan
    previous = (0.0, 0.0)
    for step, value in points:
        if at <= step:
            span = step - previous[0]
            share = (at - previous[0]) / span if span else 1.0
            return previous[1] + share * (value - previous[1])
        previous = (step, value)
    last_step, last_value = points[-1]
    per_step = last_value / last_step if last_step else 0.0
    return last_value + (at - last_step) * per_step


def _series(
    run: RunHistory, records: list[dict[str, Any]], key: str, x: XAxis, scale: float = 1.0
) -> tuple[list[float], list[float]]:
    xs = _x_of(run, records, x)
    pairs = [
        (px, float(r[key]) * scale)
        for px, r in zip(xs, records)
        if _number(r.get(key)) and not math.isnan(px)
    ]
    return [p[0] for p in pairs], [p[1] for p in pairs]


COLORS = ("C0", "C1", "C2", "C3", "C4", "C5", "C6", "C7", "C8", "C9")


def run_panels(runs: Sequence[RunHistory], x: XAxis = "step") -> list[Panel]:
    """The panels of ``runs`` overlaid, one colour per run: training loss (smoothed, raw
    faint) with eval loss, learning rate, tokens/s and MFU (TFLOP/s per device when no run
    knows its peak) against ``x``; with DiLoCo events (``outer_eval``, ``outer_step``) also the
    global's held-out loss and the nodes per round against the outer step."""
    xlabel = X_LABELS[x]
    loss = Panel("loss", xlabel, "loss")
    lr = Panel("learning rate", xlabel, "lr")
    speed = Panel("throughput", xlabel, "tokens/s")
    has_mfu = any(_number(r.get("mfu")) for run in runs for r in run.steps())
    efficiency = (
        Panel("model FLOPs utilisation", xlabel, "MFU (%)")
        if has_mfu
        else Panel("achieved model TFLOP/s", xlabel, "TFLOP/s per device")
    )
    outer_loss = Panel("DiLoCo global: held-out loss", "outer step", "loss")
    nodes = Panel("DiLoCo: nodes per round", "outer step", "nodes")
    for index, run in enumerate(runs):
        color = COLORS[index % len(COLORS)]
        steps = run.steps()
        sx, sy = _series(run, steps, "loss", x)
        if sy:
            loss.lines.append(Line(sx, sy, faint=True, color=color))
            loss.lines.append(Line(sx, smooth(sy), f"{run.name} train", color=color))
        ex, ey = _series(run, run.events("eval"), "loss", x)
        if ey:
            loss.lines.append(
                Line(ex, ey, f"{run.name} eval", markers=True, dashed=True, color=color)
            )
        for panel, key, scale in (
            (lr, "lr", 1.0),
            (speed, "tokens_per_sec", 1.0),
            (efficiency, "mfu" if has_mfu else "tflops", 100.0 if has_mfu else 1.0),
        ):
            px, py = _series(run, steps, key, x, scale)
            if py:
                panel.lines.append(Line(px, py, run.name, color=color))
        ox, oy = _outer(run.events("outer_eval"), "loss")
        if oy:
            outer_loss.lines.append(Line(ox, oy, run.name, markers=True, color=color))
        nx, ny = _outer(run.events("outer_step"), "nodes_included")
        if ny:
            nodes.lines.append(Line(nx, ny, run.name, markers=True, color=color))
    if not efficiency.lines:
        efficiency.note = "no FLOP count in these runs"
    panels = [loss, lr, speed, efficiency]
    panels += [panel for panel in (outer_loss, nodes) if panel.lines]
    return panels


def _outer(records: Iterable[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    by_step = {
        r["outer_step"]: float(r[key])
        for r in records
        if _number(r.get("outer_step")) and _number(r.get(key))
    }
    steps = sorted(by_step)
    return [float(s) for s in steps], [by_step[s] for s in steps]


def draw_panels(
    panels: Sequence[Panel], out: str | os.PathLike[str], title: str | None = None
) -> Path:
    """Draw ``panels`` in a grid (up to three a row) into the PNG ``out``, written whole or
    not at all (a temporary file renamed over it); returns its path."""
    if not panels:
        raise DataError("nothing to plot")
    plt = require_matplotlib()
    columns = 2 if len(panels) == 4 else min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(
        rows, columns, figsize=(5.2 * columns, 3.8 * rows), squeeze=False, layout="constrained"
    )
    for index, axis in enumerate(axes.flat):
        if index >= len(panels):
            axis.set_visible(False)
            continue
        _draw(axis, panels[index])
    if title:
        figure.suptitle(title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            figure.savefig(stream, format="png", dpi=100)
        os.chmod(temporary, 0o666 & ~_umask())  # mkstemp's 0600 is for secrets, not pictures
        os.replace(temporary, out)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    finally:
        plt.close(figure)
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _draw(axis: Any, panel: Panel) -> None:
    axis.set_title(panel.title)
    axis.set_xlabel(panel.xlabel)
    axis.set_ylabel(panel.ylabel)
    axis.grid(True, alpha=0.3)
    for line in panel.lines:
        style = {
            "color": line.color,
            "linestyle": "--" if line.dashed else "-",
            "marker": "o" if line.markers else None,
            "markersize": 4,
        }
        if line.faint:
            axis.plot(line.x, line.y, alpha=0.25, linewidth=0.8, **style)
        else:
            axis.plot(line.x, line.y, label=line.label, linewidth=1.6, **style)
    if panel.log_y:
        axis.set_yscale("log")
    if any(line.label and not line.faint for line in panel.lines):
        axis.legend(fontsize="small")
    if not panel.lines and panel.note:
        axis.text(0.5, 0.5, panel.note, ha="center", va="center", transform=axis.transAxes)


def plot_runs(
    paths: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str], x: XAxis = "step"
) -> Path:
    """Read each run of ``paths`` and draw them overlaid into the PNG ``out``."""
    if x not in X_LABELS:
        raise DataError(f"--x must be one of {', '.join(X_LABELS)}, got {x!r}")
    runs = [read_run(path) for path in paths]
    names = [run.name for run in runs]
    if len(set(names)) < len(names):  # two runs of the same folder name: tell them apart
        for run, path in zip(runs, paths):
            run.name = str(path)
    if not any(run.steps() for run in runs):
        raise DataError(f"no step records in {', '.join(str(run.source) for run in runs)}")
    return draw_panels(run_panels(runs, x), out, title=", ".join(run.name for run in runs))
