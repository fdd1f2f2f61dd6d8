"""CPU threads: ``run.threads: auto`` against one thread and torch's default, idle and loaded.

Each measurement is one real ``speedtronic train`` process (a reference transformer on the
synthetic stream, no checkpoints, no eval) with ``run.threads`` set to ``auto``, ``1`` or
``null`` (torch's default: every core, and the OpenMP runtime's default spin-waiting). Its
steps per second come from the run's own ``train_end`` summary (steps / elapsed_s), so process
start-up and model building are not counted.

Two conditions, interleaved round by round so that a change in the machine's other load hits
every variant alike: ``idle`` (nothing started by this script; on a shared machine other
tenants still run) and ``loaded`` (this script starts ``--hogs`` processes that spin
``while True: pass``). With ``--arriving S`` a third, ``arriving``: the hogs start S seconds
after the run's first step began, so ``auto`` has to follow a load that changed while it
trained (its governor looks every 5 s). Within a round the variants run in a rotated order.
The table gives the median steps/s per variant and condition and its ratio to the best variant
of that condition; ``auto`` should be within 10% of the best in the first two.

    python benchmarks/threads.py --quick      # 15-20 minutes on 2 cores under a load of ~15
    python benchmarks/threads.py              # the figures in docs/engine.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from results import emit

VARIANTS = {"auto": "auto", "1": 1, "default": None}
PRESETS = {"quick": (15, 2), "full": (40, 4)}  # (steps per run, rounds)


def config(steps: int, output_dir: str, threads: Any, events: str) -> dict[str, Any]:
    return {
        "run": {
            "device": "cpu",
            "max_steps": steps,
            "output_dir": output_dir,
            "threads": threads,
        },
        "model": {
            "name": "reference_transformer",
            "vocab_size": 256,
            "max_seq_len": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_kv_head": 2,
            "d_model": 128,
        },
        "data": {"micro_batch_size": 16},
        "precision": {"mode": "fp32"},
        "checkpoint": {"interval": 0, "save_final": False},
        "logging": {"log_every": steps, "json_file": events, "progress": False},
    }


def one_run(
    threads: Any, steps: int, workdir: Path, index: int, arriving: tuple[int, float] | None = None
) -> tuple[float, int]:
    """(steps/s, threads at the start) of one `speedtronic train` process. ``arriving``:
    (hogs, seconds): that many hogs start that long after the run's first step began
    (its ``train_start`` event) and stop when it ends."""
    run_dir = workdir / f"run{index}"
    events = run_dir / "events.jsonl"
    run_dir.mkdir()
    path = run_dir / "config.yaml"
    path.write_text(yaml.safe_dump(config(steps, str(run_dir), threads, str(events))))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    process = subprocess.Popen(
        [sys.executable, "-m", "speedtronic", "train", "--config", str(path)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: process.poll() is None and process.kill())
        if arriving is not None:
            deadline = time.monotonic() + 1800
            while '"train_start"' not in (events.read_text() if events.exists() else ""):
                if process.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            time.sleep(arriving[1])
            stack.enter_context(hogs(arriving[0], settle=0.0))
        if process.wait(timeout=1800) != 0:
            raise SystemExit(f"a benchmark run failed (exit {process.returncode}): {path}")
    records = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    end = next(r for r in records if r.get("event") == "train_end")
    start = next(r for r in records if r.get("event") == "train_start")
    return end["steps"] / end["elapsed_s"], int(start["threads"])


@contextmanager
def hogs(count: int, settle: float = 0.5):
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(settle)  # let the scheduler see them
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def main() -> None:
    # A `timeout` or kill -TERM must still stop the hogs (the finally blocks run on SystemExit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument("--hogs", type=int, default=2, help="CPU hogs in the loaded condition")
    parser.add_argument("--rounds", type=int, help="override the preset's rounds")
    parser.add_argument("--steps", type=int, help="override the preset's steps per run")
    parser.add_argument(
        "--arriving",
        type=float,
        help="also the 'arriving' condition: the hogs start this many seconds after each run's "
        "first step (the load changes while it trains)",
    )
    parser.add_argument(
        "--arriving-steps", type=int, default=150, help="steps per run of the arriving condition"
    )
    args = parser.parse_args()
    steps, rounds = PRESETS["quick" if args.quick else "full"]
    rounds = args.rounds or rounds
    steps = args.steps or steps
    names = list(VARIANTS)
    conditions = ["idle", "loaded"] + (["arriving"] if args.arriving is not None else [])
    length_of = {"idle": steps, "loaded": steps, "arriving": args.arriving_steps}
    rates: dict[tuple[str, str], list[float]] = {}
    used: dict[tuple[str, str], int] = {}
    loads: list[float] = []
    counter = 0
    with tempfile.TemporaryDirectory(prefix="threads-bench-") as tmp:
        workdir = Path(tmp)
        for round_ in range(rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for condition in conditions:
                arriving = (args.hogs, args.arriving) if condition == "arriving" else None
                length = length_of[condition]
                with hogs(args.hogs if condition == "loaded" else 0):
                    for name in order:
                        loads.append(os.getloadavg()[0])
                        rate, threads = one_run(VARIANTS[name], length, workdir, counter, arriving)
                        counter += 1
                        rates.setdefault((condition, name), []).append(rate)
                        used[(condition, name)] = threads
                        print(
                            f"round {round_ + 1}/{rounds} {condition:6s} {name:7s} "
                            f"{rate:6.2f} steps/s ({threads} threads)",
                            flush=True,
                        )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print()
    print(
        f"{cores} usable cores; {steps} steps per run, {rounds} rounds, {args.hogs} hogs when "
        f"loaded; 1-min load average seen before runs: min {min(loads):.1f}, "
        f"median {statistics.median(loads):.1f}, max {max(loads):.1f}"
    )
    print(f"{'condition':10s} {'variant':8s} {'threads':>7s} {'steps/s':>8s} {'vs best':>8s}")
    for condition in conditions:
        medians = {name: statistics.median(rates[(condition, name)]) for name in names}
        best = max(medians.values())
        for name in names:
            print(
                f"{condition:10s} {name:8s} {used[(condition, name)]:7d} "
                f"{medians[name]:8.2f} {medians[name] / best:8.2f}"
            )
        print(
            f"{condition:10s} auto / default {medians['auto'] / medians['default']:.2f}, "
            f"auto / 1 {medians['auto'] / medians['1']:.2f}"
        )

    def method(condition: str) -> str:
        return (
            f"steps/s of real train processes (wall time of the run's steps), {rounds} "
            f"interleaved rounds of {length_of[condition]} steps, {cores} cores, 1-min load "
            f"{min(loads):.0f}-{max(loads):.0f}"
        )

    said = {"idle": "no hogs", "loaded": f"{args.hogs} hogs"}
    if args.arriving is not None:
        said["arriving"] = (
            f"{args.hogs} hogs from {args.arriving:g} s into a {args.arriving_steps}-step run"
        )
    for condition in conditions:
        hogs_said = said[condition]
        emit(
            f"threads.{condition}.auto",
            rates[(condition, "auto")],
            unit="steps/s",
            method=method(condition),
            label=f"run.threads: auto, steps/s, {hogs_said}",
        )
        for other in ("1", "default"):
            # Per-round ratios: both runs of a round saw the same machine.
            ratios = [
                a / b
                for a, b in zip(rates[(condition, "auto")], rates[(condition, other)], strict=True)
            ]
            emit(
                f"threads.{condition}.auto_vs_{'one' if other == '1' else other}",
                ratios,
                unit="x",
                method=method(condition),
                label=f"steps/s, run.threads auto / {other}, {hogs_said}",
            )


if __name__ == "__main__":
    main()
