"""The real `speedtronic train` processes of a DiLoCo benchmark run: their commands, how they
start (the master first, then each worker after a delay or once the master's global reached an
outer step), a slowed node (``benchmarks/slow_node.py``), and a bounded wait for them all.

Used by ``diloco_quality.py``; every wait here is a bounded poll on a condition.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
SLOW_NODE_PLUGIN = "slow_node"  # benchmarks/slow_node.py
SLOW_FACTOR_ENV = "SPEEDTRONIC_BENCH_SLOW_FACTOR"  # what slow_node.py reads


@dataclass
class Process:
    """One `speedtronic train` process of the run and where its events land."""

    name: str
    command: list[str]
    events: Path
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None
    started: float = 0.0  # time.monotonic() at the start
    started_wall: float = 0.0  # time.time() then: the clock of the events' `time`
    wall_s: float | None = None


def train_process(name: str, config: Path, root: Path, *sets: str) -> Process:
    out = root / name
    events = out / "events.jsonl"
    command = [sys.executable, "-m", "speedtronic", "train", "-c", str(config)]
    command += ["--output-dir", str(out), "--set", f"logging.json_file={events}"]
    for item in sets:
        command += ["--set", item]
    return Process(name, command, events, root / f"{name}.log")


def slow_down(process: Process, factor: float) -> None:
    """Make ``process`` ``factor`` x slower: the ``slow_node`` plugin (benchmarks/ on its path)."""
    process.command += ["--plugin", SLOW_NODE_PLUGIN]
    path = os.pathsep.join(p for p in (str(BENCHMARKS), os.environ.get("PYTHONPATH")) if p)
    process.env.update({"PYTHONPATH": path, SLOW_FACTOR_ENV: str(factor)})


def start(process: Process) -> None:
    process.events.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **process.env)
    log = open(process.log, "w")  # noqa: SIM115 - closed by the child's exit
    process.popen = subprocess.Popen(
        process.command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=process.events.parent
    )
    process.started = time.monotonic()
    process.started_wall = time.time()


def start_delays(nodes: int, stagger: float | None, after_outer: int | None) -> list[float]:
    """Seconds each worker starts after the previous node's start (the first worker: after the
    master's, or after the wait for outer step ``after_outer`` when that is set)."""
    gap = 0.0 if stagger is None else stagger
    first = gap if after_outer is None else 0.0
    if stagger is None and after_outer is None:
        first = 1.0  # "together": only orders the start lines (the master creates the store)
    return [first] + [gap] * (nodes - 2)


def run_finished_exit() -> int | None:
    """The exit status of a worker that found the run finished and stopped; None in a version
    whose workers never do."""
    try:
        from speedtronic_diloco.node.finished import EXIT_RUN_FINISHED
    except ImportError:
        return None
    return EXIT_RUN_FINISHED


def failed_early(processes: list[Process]) -> bool:
    """True when a started process already failed (wait_all then reports it)."""
    done = (None, 0, run_finished_exit())
    return any(p.popen is not None and p.popen.poll() not in done for p in processes)


def hold_until(moment: float, processes: list[Process]) -> None:
    """Wait until ``time.monotonic()`` reaches ``moment``; sooner if a process failed."""
    while time.monotonic() < moment and not failed_early(processes):
        time.sleep(min(0.1, max(0.0, moment - time.monotonic())))


def global_outer_step(store: Path) -> int | None:
    """The outer step of the global the store holds now; None before the first one."""
    from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport

    try:
        metadata = SharedDirectoryTransport(store).read_global_metadata()
    except Exception:  # being replaced right now, or no store yet: look again later
        return None
    return None if metadata is None else int(metadata.outer_step)


def await_outer_step(store: Path, step: int, master: Process, deadline: float) -> int | None:
    """Poll the store until its global reached outer step ``step`` (bounded by ``deadline`` and
    by the master's exit); the outer step found."""
    assert master.popen is not None
    found = global_outer_step(store)
    while (found is None or found < step) and time.monotonic() < deadline:
        if master.popen.poll() is not None:
            return global_outer_step(store)
        time.sleep(0.2)
        found = global_outer_step(store)
    return found


def start_nodes(
    diloco: list[Process],
    store: Path,
    *,
    stagger: float | None,
    after_outer: int | None,
    timeout: float,
) -> dict[str, dict[str, Any]]:
    """Start the master, then each worker as :func:`start_delays` says (after the wait for
    outer step ``after_outer`` when set); per node: seconds after the master's start and the
    store's outer step at that moment."""
    master = diloco[0]
    start(master)
    starts: dict[str, dict[str, Any]] = {
        master.name: {"after_master_s": 0.0, "global_outer_step": None}
    }
    previous = master.started
    if after_outer is not None:
        await_outer_step(store, after_outer, master, time.monotonic() + timeout)
        previous = time.monotonic()
    for process, delay in zip(diloco[1:], start_delays(len(diloco), stagger, after_outer)):
        hold_until(previous + delay, diloco)
        start(process)
        previous = process.started
        starts[process.name] = {
            "after_master_s": round(process.started - master.started, 2),
            "global_outer_step": global_outer_step(store),
        }
    return starts


def wait_all(processes: list[Process], timeout: float, late_ok: bool = False) -> list[str]:
    """Wait for every process (bounded); kill the rest on timeout or on the first failure.
    With ``late_ok``, a DiLoCo worker that started after the master's end and stopped at once
    (exit :func:`run_finished_exit`: its deltas would never be read) is an outcome, not a
    failure; their names are returned."""
    finished_exit = run_finished_exit()
    deadline = time.monotonic() + timeout
    pending = list(processes)
    failed: Process | None = None
    late: list[str] = []
    while pending and failed is None and time.monotonic() < deadline:
        for process in list(pending):
            assert process.popen is not None
            code = process.popen.poll()
            if code is None:
                continue
            process.wall_s = time.monotonic() - process.started
            pending.remove(process)
            if late_ok and code == finished_exit and process is not processes[0]:
                late.append(process.name)
            elif code != 0:
                failed = process
        time.sleep(0.5)
    for process in pending:
        assert process.popen is not None
        process.popen.kill()
        process.popen.wait(timeout=30)
    if failed is not None or pending:
        culprit = failed or pending[0]
        tail = culprit.log.read_text(errors="replace")[-3000:]
        why = "failed" if failed is not None else f"did not finish in {timeout:.0f} s"
        raise SystemExit(f"{culprit.name} {why}; its log ends:\n{tail}")
    return late


def finished(process: Process) -> bool:
    """True when ``process`` already ran to its end (a reused reference)."""
    return any(
        e["event"] == "train_end" and e.get("status") == "ok" for e in read_events(process.events)
    )


def read_events(path: Path) -> list[dict[str, Any]]:
    """The JSONL metric events at ``path`` (none before it exists). A last line that does not
    parse is one the live run is still writing and is left out; any other raises."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    found = [json.loads(line) for line in lines[:-1]]
    if lines:
        try:
            found.append(json.loads(lines[-1]))
        except json.JSONDecodeError:
            pass
    return found
