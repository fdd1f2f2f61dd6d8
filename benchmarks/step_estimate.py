"""The CPU time-per-step estimate against the step times it estimates.

For each config, one real run (``build_runtime`` and ``Trainer.fit``, as ``speedtronic train``
runs it) with a metric event every step: the wall-clock time of each step after the warm-up
steps (the first steps fill the allocator's caches; a compiled run compiles in its first
step) is one measurement, and the estimate is the one the run made before its first step
(``trainer.step_estimate``: the warning a long run prints), or, for a step too small to be
warned about, the same estimate made for that trainer after the run. Printed per config: the
estimate divided by each measured step (1 is exact; the estimate is meant to be within 2x).

- ``smoke``: ``configs/smoke.yaml`` as shipped, without its evaluation and checkpoints
  (they are not steps): rounds of ``--smoke-steps`` steps, the ratio per round;
- ``reference_small``: ``configs/reference-small.yaml`` as shipped (compiled, fp32 on a CPU);
  ``--quick`` trains one micro-batch of 16 per step instead of four (``data.target_batch_size
  16``: a quarter of the step, estimated alike) so that its steps take about a minute on one
  core rather than four.

    python benchmarks/step_estimate.py --quick     # about 5 minutes on one busy core
    python benchmarks/step_estimate.py             # about 15 minutes
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from results import emit

from speedtronic import SpeedtronicConfig
from speedtronic.engine.runtime import build_runtime
from speedtronic.observe.step_estimate import estimate_run_step

ROOT = Path(__file__).resolve().parents[1]


class StepTimes:
    """A metric sink: the wall-clock time of each optimizer step (``logging.log_every: 1``)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._last: float | None = None

    def on_event(self, event: str, payload: dict[str, Any]) -> None:
        if event == "train_start":
            self._last = time.perf_counter()
        elif event == "step" and self._last is not None:
            now = time.perf_counter()
            self.seconds.append(now - self._last)
            self._last = now


def run(config_file: str, steps: int, threads: int, overrides: list[str]) -> tuple[Any, list]:
    """(the run's estimate, the seconds of each step) of one run of ``steps`` steps."""
    with tempfile.TemporaryDirectory() as out:
        config = SpeedtronicConfig.from_file(ROOT / config_file).with_overrides(
            [
                f"run.max_steps={steps}",
                f"run.output_dir={out}",
                f"run.threads={threads}",
                "checkpoint.interval=0",
                "checkpoint.save_final=false",
                "eval.every=0",
                "logging.log_every=1",
                "logging.progress=false",
                *overrides,
            ]
        )
        times = StepTimes()
        trainer = build_runtime(config, hooks=[times], console=False).trainer
        trainer.fit()
        estimate = trainer.step_estimate or estimate_run_step(trainer, always=True)
    return estimate, times.seconds


def report(name: str, config: str, estimate: Any, measured: list[float], method: str) -> None:
    ratios = [estimate.seconds / seconds for seconds in measured]
    print(
        f"{name}: estimate {estimate.seconds:.4g} s per step ({estimate.describe()}); "
        f"measured {', '.join(f'{s:.4g}' for s in measured)} s; estimate / measured "
        f"{', '.join(f'{r:.2f}' for r in ratios)}",
        flush=True,
    )
    label = f"{config}: estimated / measured seconds per step"
    emit(f"step_estimate.{name}", ratios, unit="x", method=method, label=label)
    label = f"{config}: measured seconds per step"
    emit(f"step_estimate.{name}.seconds", measured, unit="s", method=method, label=label)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of reference-small")
    parser.add_argument("--threads", type=int, default=1, help="run.threads (default 1)")
    parser.add_argument("--smoke-steps", type=int, default=20, help="steps per smoke round")
    parser.add_argument("--rounds", type=int, default=3, help="smoke rounds")
    parser.add_argument("--reference-steps", type=int, default=2, help="timed steps")
    parser.add_argument("--only", choices=("smoke", "reference_small"), help="one config")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override"
    )
    args = parser.parse_args()
    logging.getLogger("speedtronic").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    threads = f"{args.threads} thread{'' if args.threads == 1 else 's'}"

    if args.only in (None, "smoke"):
        warmup, size = 5, args.smoke_steps
        estimate, seconds = run(
            "configs/smoke.yaml", warmup + size * args.rounds, args.threads, args.set
        )
        timed = seconds[warmup:]
        rounds = [sum(timed[i * size : (i + 1) * size]) / size for i in range(args.rounds)]
        method = (
            f"wall-clock time, {args.rounds} rounds of {size} steps after {warmup} warm-up "
            f"steps, one run, cpu, {threads}"
        )
        report("smoke", "configs/smoke.yaml", estimate, rounds, method)

    if args.only in (None, "reference_small"):
        overrides = [*(["data.target_batch_size=16"] if args.quick else []), *args.set]
        warmup = 1
        estimate, seconds = run(
            "configs/reference-small.yaml", warmup + args.reference_steps, args.threads, overrides
        )
        shape = "16 samples per step (quick)" if args.quick else "64 samples per step"
        method = (
            f"wall-clock time of {args.reference_steps} steps after {warmup} warm-up step "
            f"(compiles), one run, cpu, {threads}, {shape}"
        )
        report(
            "reference_small", "configs/reference-small.yaml", estimate, seconds[warmup:], method
        )


if __name__ == "__main__":
    main()
