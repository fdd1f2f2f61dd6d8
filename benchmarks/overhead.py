"""Speedtronic's per-step overhead against a minimal hand-written PyTorch training loop.

Both sides train the same model (same initial weights) on the same synthetic token stream, with
the same AdamW parameter groups, gradient clipping, warmup + cosine schedule, and a loss read
once per ``log_every`` steps. The only difference is who runs the loop: ``Trainer.fit`` (data
source, hooks, metrics, accounting) or a dozen lines of plain PyTorch. Both must end on the same
loss, which shows they did the same work.

Two measurements:

* the reference transformer, sized so that one optimizer step takes more than 20 ms on one CPU
  thread: the headline ratio (target <= 1.03);
* a tiny model whose step is about a millisecond: the loop's fixed cost per step in
  microseconds, which is what a ratio on a bigger model hides.

Two more compare Speedtronic with itself:

* the per-step metrics of issue 33 (``tflops`` and ``mfu`` on every step record, the profiler
  check every step): the tiny model logging every step, with a FLOP count and a peak against
  without (the count itself happens once at train start and is timed apart): target <= 1.005;
* the profiler window: the reference transformer with ``profile: {start: 3, end: 5}`` against
  the same run without it, timing the steps after the window only (from the ``step`` record of
  step 10 to the last): it should be within noise of 1.0.

Runs are interleaved in rounds, alternating which side goes first, so machine noise hits both
alike; results are medians over rounds, for wall-clock time and for this process's CPU time. On
a shared machine other tenants inflate wall-clock time at random while CPU time counts only the
work done here, so the CPU figure is the steadier one there.

    python benchmarks/overhead.py --quick     # CPU, about a minute on a busy 2-core machine
    python benchmarks/overhead.py             # the figures in docs/engine.md
"""

from __future__ import annotations

import argparse
import copy
import gc
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from results import emit
from torch import nn

from speedtronic import SpeedtronicConfig
from speedtronic.data import SyntheticTokenStream
from speedtronic.engine import trainer as trainer_module
from speedtronic.engine.runtime import build_runtime
from speedtronic.observe import flops as flops_module
from speedtronic.optim import decay_groups, lr_lambda
from speedtronic_models import ReferenceTransformer

# A CPU-sized reference transformer: about 45 ms per optimizer step on one thread.
REFERENCE = dict(vocab_size=2048, max_seq_len=64, n_layer=2, n_head=4, n_kv_head=2, d_model=128)
MICRO_BATCH = 8
PRESETS = {  # (reference steps per run, rounds, tiny-model steps per run, tiny rounds)
    True: (20, 5, 300, 3),
    False: (20, 21, 1000, 7),  # many short rounds: a steadier median on a noisy machine
}
LOG_EVERY = 10


class TinyModel(nn.Module):
    """Embedding, norm, head: next to no compute, so the loop's own cost shows."""

    def __init__(self, vocab_size: int = 64, max_seq_len: int = 16, width: int = 8) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.embed = nn.Embedding(vocab_size, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.norm(self.embed(input_ids)))
        return {"loss": F.cross_entropy(logits.view(-1, self.vocab_size), labels.reshape(-1))}


def make_config(steps: int, log_every: int = LOG_EVERY) -> SpeedtronicConfig:
    """The run both loops perform (the model is passed in, not built from ``model:``)."""
    return SpeedtronicConfig.from_dict(
        {
            "run": {
                "name": "overhead",
                "seed": 0,
                "device": "cpu",
                "max_steps": steps,
                "output_dir": "/tmp/speedtronic-overhead",
            },
            "data": {"micro_batch_size": MICRO_BATCH},
            "optimizer": {"lr": 1e-3, "weight_decay": 0.1, "grad_clip": 1.0},
            "scheduler": {"name": "cosine", "warmup_steps": 5, "min_lr_ratio": 0.1},
            "precision": {"mode": "fp32"},
            "checkpoint": {"interval": 0, "save_final": False},
            "logging": {"log_every": log_every, "level": "WARNING"},
        }
    )


def baseline_loop(model: Any, config: SpeedtronicConfig) -> float:
    """The same work in plain PyTorch; returns the last logged loss."""
    model.train()
    optimizer = torch.optim.AdamW(
        decay_groups(model, config.optimizer),
        lr=config.optimizer.lr,
        betas=tuple(config.optimizer.betas),
        eps=config.optimizer.eps,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(config.scheduler, config.run.max_steps)
    )
    stream = SyntheticTokenStream(model.vocab_size, model.max_seq_len, MICRO_BATCH, seed=0)
    log_every = config.logging.log_every
    window = torch.zeros(())
    last = float("nan")
    for step in range(config.run.max_steps):
        loss = model(**stream.batch(step))["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        window += loss.detach()
        if (step + 1) % log_every == 0:
            last = window.item() / log_every
            window.zero_()
    return last


@contextmanager
def no_gc() -> Iterator[None]:
    """Collect garbage first and pause the cyclic collector while timing, as ``timeit`` does:
    a full collection over torch's objects takes tens of milliseconds and would land on
    whichever side happened to trigger it."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def timed_baseline(model: nn.Module, config: SpeedtronicConfig) -> tuple[float, float, float]:
    """The baseline loop: (wall seconds, CPU seconds, last logged loss)."""
    with no_gc():
        wall, cpu = time.perf_counter(), time.process_time()
        loss = baseline_loop(model, config)
        return time.perf_counter() - wall, time.process_time() - cpu, loss


def timed_speedtronic(model: nn.Module, config: SpeedtronicConfig) -> tuple[float, float, float]:
    """``Trainer.fit`` on the same model: (wall seconds, CPU seconds, last logged loss). The
    FLOP count a run makes once at train start is made before the clock starts (its cost is
    reported on its own): this compares the loops, step for step."""
    runtime = build_runtime(config, model=model, console=False)
    report = flops_module.measure_run_flops(runtime.trainer)
    saved = trainer_module.measure_run_flops
    trainer_module.measure_run_flops = lambda trainer: report
    try:
        with no_gc():
            wall, cpu = time.perf_counter(), time.process_time()
            result = runtime.trainer.fit()
            return time.perf_counter() - wall, time.process_time() - cpu, float(result.final_loss)
    finally:
        trainer_module.measure_run_flops = saved


def compare(
    name: str, make_model: Callable[[], nn.Module], steps: int, rounds: int
) -> dict[str, float]:
    """Interleaved rounds of both loops; prints per-round ms/step and returns the medians."""
    config = make_config(steps)
    torch.manual_seed(0)
    initial = make_model().state_dict()

    def fresh() -> nn.Module:
        model = make_model()
        model.load_state_dict(copy.deepcopy(initial))
        return model

    # Warm both paths up (allocator, lazy imports, first iterator) outside the timings.
    timed_baseline(fresh(), make_config(3, 1))
    timed_speedtronic(fresh(), make_config(3, 1))

    print(f"\n{name}: {steps} steps per run, {rounds} rounds; ms per optimizer step")
    print(
        f"{'round':>5} {'base wall':>10} {'st wall':>9} {'ratio':>6}   "
        f"{'base cpu':>9} {'st cpu':>8} {'ratio':>6}"
    )
    rows = []
    losses = (float("nan"), float("nan"))
    for index in range(rounds):
        if index % 2 == 0:
            base = timed_baseline(fresh(), config)
            st = timed_speedtronic(fresh(), config)
        else:
            st = timed_speedtronic(fresh(), config)
            base = timed_baseline(fresh(), config)
        losses = (base[2], st[2])
        rows.append((base[0], st[0], base[1], st[1]))
        print(
            f"{index:>5} {base[0] / steps * 1e3:>10.2f} {st[0] / steps * 1e3:>9.2f} "
            f"{st[0] / base[0]:>6.3f}   {base[1] / steps * 1e3:>9.2f} "
            f"{st[1] / steps * 1e3:>8.2f} {st[1] / base[1]:>6.3f}"
        )
    if losses[0] != losses[1]:
        print(f"WARNING: the loops ended on different losses {losses}: not the same work")
    cpu_ratios = [r[3] / r[2] for r in rows]
    quartiles = statistics.quantiles(cpu_ratios, n=4) if len(rows) > 1 else [cpu_ratios[0]] * 3
    result = {
        "wall_ratio": statistics.median(r[1] / r[0] for r in rows),
        "cpu_ratio": statistics.median(cpu_ratios),
        "cpu_ratio_q1": quartiles[0],
        "cpu_ratio_q3": quartiles[2],
        "base_cpu_ms": statistics.median(r[2] for r in rows) / steps * 1e3,
        "extra_cpu_us": statistics.median((r[3] - r[2]) for r in rows) / steps * 1e6,
        "cpu_ratios": cpu_ratios,
        "extra_cpu_us_rounds": [(r[3] - r[2]) / steps * 1e6 for r in rows],
        "base_cpu_ms_rounds": [r[2] / steps * 1e3 for r in rows],
    }
    print(f"final loss: baseline {losses[0]:.5f}, speedtronic {losses[1]:.5f}")
    return result


def timed_fit(
    model: nn.Module, config: SpeedtronicConfig, report: flops_module.FlopsReport, hooks=()
) -> tuple[float, float]:
    """``Trainer.fit`` with ``report`` as the run's FLOP count (no count at start): (wall
    seconds, CPU seconds)."""
    saved = trainer_module.measure_run_flops
    trainer_module.measure_run_flops = lambda trainer: report
    try:
        runtime = build_runtime(config, model=model, console=False, hooks=hooks)
        with no_gc():
            wall, cpu = time.perf_counter(), time.process_time()
            runtime.trainer.fit()
            return time.perf_counter() - wall, time.process_time() - cpu
    finally:
        trainer_module.measure_run_flops = saved


def compare_step_metrics(steps: int, rounds: int) -> dict[str, float]:
    """The tiny model logging every step, with and without tflops/mfu; interleaved rounds."""
    config = make_config(steps, log_every=1)
    torch.manual_seed(0)
    initial = TinyModel().state_dict()

    def fresh() -> nn.Module:
        model = TinyModel()
        model.load_state_dict(copy.deepcopy(initial))
        return model

    trainer = build_runtime(config, model=fresh(), console=False).trainer
    flops_module.measure_run_flops(trainer)  # warm-up: first use loads the counter's code
    count_ms_rounds = []
    for _ in range(3):
        start = time.process_time()
        counted = flops_module.measure_run_flops(trainer)
        count_ms_rounds.append((time.process_time() - start) * 1e3)
    count_ms = statistics.median(count_ms_rounds)
    with_metrics = flops_module.FlopsReport(
        counted.parameters, counted.flops_per_token, peak_tflops=1.0
    )
    without = flops_module.FlopsReport(counted.parameters)
    timed_fit(fresh(), make_config(3, 1), with_metrics)  # warm-up
    print(
        f"\nper-step metrics (tflops, mfu): tiny model, log_every 1, {steps} steps, {rounds} rounds"
    )
    print(f"{'round':>5} {'off cpu ms':>10} {'on cpu ms':>10} {'ratio':>6}")
    rows = []
    for index in range(rounds):
        order = (without, with_metrics) if index % 2 == 0 else (with_metrics, without)
        times = {id(report): timed_fit(fresh(), config, report)[1] for report in order}
        off, on = times[id(without)], times[id(with_metrics)]
        rows.append((off, on))
        print(f"{index:>5} {off / steps * 1e3:>10.3f} {on / steps * 1e3:>10.3f} {on / off:>6.3f}")
    ratios = [on / off for off, on in rows]
    # The same cost measured directly: what the loop adds per step record (the rates) and per
    # step (the profiler check), against the tiny model's step.
    calls, blocks = 20_000, 5
    rates_us_blocks = []
    for _ in range(blocks):
        start = time.process_time()
        for _ in range(calls):
            with_metrics.rates(1.0e6)
        rates_us_blocks.append((time.process_time() - start) / calls * 1e6)
    rates_us = statistics.median(rates_us_blocks)
    step_us = statistics.median(off for off, _ in rows) / steps * 1e6
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {
        "cpu_ratio": statistics.median(ratios),
        "q1": quartiles[0],
        "q3": quartiles[2],
        "extra_cpu_us": statistics.median(on - off for off, on in rows) / steps * 1e6,
        "rates_us": rates_us,
        "direct_ratio": 1 + rates_us / step_us,
        "count_ms": count_ms,
        "count_ms_rounds": count_ms_rounds,
        "ratios": ratios,
        "rates_us_blocks": rates_us_blocks,
    }


class StepClock:
    """A metric hook noting this process's CPU time at each ``step`` record."""

    def __init__(self) -> None:
        self.cpu: dict[int, float] = {}

    def __call__(self, event: str, payload: dict[str, Any]) -> None:
        if event == "step":
            self.cpu[payload["step"]] = time.process_time()


def compare_profile_window(steps: int, rounds: int) -> dict[str, float]:
    """CPU time of the steps after a profiler window (3..5) against a run without one."""
    plain = make_config(steps, log_every=5)
    profiled = plain.with_overrides({"profile.start": 3, "profile.end": 5})
    torch.manual_seed(0)
    initial = ReferenceTransformer(**REFERENCE).state_dict()
    report = flops_module.FlopsReport(0)

    def after_window(config: SpeedtronicConfig) -> float:
        model = ReferenceTransformer(**REFERENCE)
        model.load_state_dict(copy.deepcopy(initial))
        clock = StepClock()
        timed_fit(model, config, report, hooks=[clock])
        return (clock.cpu[steps] - clock.cpu[10]) / (steps - 10)

    after_window(profiled)  # warm-up: the profiler's first start loads its libraries
    print(
        f"\nprofiler window 3..5: reference transformer, {steps} steps, {rounds} rounds; "
        "CPU ms per step after step 10"
    )
    print(f"{'round':>5} {'plain':>8} {'profiled':>9} {'ratio':>6}")
    ratios = []
    for index in range(rounds):
        if index % 2 == 0:
            base, with_window = after_window(plain), after_window(profiled)
        else:
            with_window, base = after_window(profiled), after_window(plain)
        ratios.append(with_window / base)
        print(f"{index:>5} {base * 1e3:>8.2f} {with_window * 1e3:>9.2f} {ratios[-1]:>6.3f}")
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {
        "cpu_ratio": statistics.median(ratios),
        "q1": quartiles[0],
        "q3": quartiles[2],
        "ratios": ratios,
    }


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument(
        "--only",
        choices=("loop", "metrics", "profile"),
        help="run one comparison: the loop against plain PyTorch, the per-step tflops/mfu, "
        "or the profiler window (default: all)",
    )
    args = parser.parse_args(argv)
    steps, rounds, tiny_steps, tiny_rounds = PRESETS[args.quick]
    torch.set_num_threads(args.threads)
    logging.getLogger("speedtronic").setLevel(logging.WARNING)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), micro-batch {MICRO_BATCH}, "
        f"loss read every {LOG_EVERY} steps"
    )

    results: dict[str, dict[str, float]] = {}
    if args.only in (None, "loop"):
        results["reference"] = compare(
            f"reference transformer {REFERENCE}",
            lambda: ReferenceTransformer(**REFERENCE),
            steps,
            rounds,
        )
        results["tiny"] = compare(
            "tiny model (fixed cost per step)", TinyModel, tiny_steps, tiny_rounds
        )
    if args.only in (None, "metrics"):
        results["metrics"] = compare_step_metrics(tiny_steps, max(tiny_rounds, 7))
    if args.only in (None, "profile"):
        results["profile_window"] = compare_profile_window(steps * 2, rounds)

    print("\nsummary")
    reference, tiny = results.get("reference"), results.get("tiny")
    if reference is not None and tiny is not None:
        print(
            f"  reference transformer: baseline step {reference['base_cpu_ms']:.1f} ms CPU; "
            f"speedtronic/baseline median ratio: CPU {reference['cpu_ratio']:.3f} "
            f"(rounds' interquartile range {reference['cpu_ratio_q1']:.3f}.."
            f"{reference['cpu_ratio_q3']:.3f}), wall {reference['wall_ratio']:.3f} "
            "(target <= 1.03)"
        )
        print(
            f"  tiny model: baseline step {tiny['base_cpu_ms']:.2f} ms CPU; speedtronic adds "
            f"{tiny['extra_cpu_us']:+.0f} us CPU per step (ratio {tiny['cpu_ratio']:.3f}), "
            f"{tiny['extra_cpu_us'] / 20e3 * 100:+.2f}% of a 20 ms step"
        )
        method = f"CPU time, {{}} interleaved rounds of {{}} steps, {args.threads} thread(s)"
        emit(
            "overhead.reference_cpu_ratio",
            reference["cpu_ratios"],
            unit="x",
            method=method.format(rounds, steps),
            label="Trainer.fit / hand-written loop, step CPU time, reference transformer",
        )
        emit(
            "overhead.tiny_extra_us",
            tiny["extra_cpu_us_rounds"],
            unit="us",
            method=method.format(tiny_rounds, tiny_steps),
            label="CPU time Trainer.fit adds per step, tiny model",
        )
        emit(
            "overhead.tiny_step_ms",
            tiny["base_cpu_ms_rounds"],
            unit="ms",
            method=method.format(tiny_rounds, tiny_steps),
            label="tiny model, hand-written loop's step CPU time",
        )
        emit(
            "overhead.reference_step_ms",
            reference["base_cpu_ms_rounds"],
            unit="ms",
            method=method.format(rounds, steps),
            label="reference transformer, hand-written loop's step CPU time",
        )
    metrics = results.get("metrics")
    if metrics is not None:
        print(
            f"  per-step tflops/mfu: CPU ratio with/without {metrics['cpu_ratio']:.4f} "
            f"(interquartile range {metrics['q1']:.3f}..{metrics['q3']:.3f}; target <= 1.005);"
            f" measured directly: {metrics['rates_us']:.2f} us per step record, a ratio of "
            f"{metrics['direct_ratio']:.5f} on the tiny model logging every step; the FLOP "
            f"count at train start took {metrics['count_ms']:.0f} ms CPU once (tiny model)"
        )
        emit(
            "overhead.metrics_cpu_ratio",
            metrics["ratios"],
            unit="x",
            method=f"CPU time, {len(metrics['ratios'])} interleaved rounds of {tiny_steps} "
            f"steps, log_every 1, {args.threads} thread(s)",
            label="tiny model, step CPU time with tflops/mfu / without",
        )
        emit(
            "overhead.metrics_rates_us",
            metrics["rates_us_blocks"],
            unit="us",
            method="CPU time, 5 blocks of 20,000 calls of FlopsReport.rates",
            label="computing tflops and mfu for one step record",
        )
        emit(
            "overhead.metrics_count_ms",
            metrics["count_ms_rounds"],
            unit="ms",
            method="CPU time, 3 repetitions after a warm-up",
            label="the FLOP count at train start, tiny model",
        )
    window = results.get("profile_window")
    if window is not None:
        print(
            f"  profiler window 3..5: CPU per step after it / without it "
            f"{window['cpu_ratio']:.3f} (interquartile range {window['q1']:.3f}.."
            f"{window['q3']:.3f})"
        )
        emit(
            "overhead.profile_window_ratio",
            window["ratios"],
            unit="x",
            method=f"CPU time of steps 11-{steps * 2}, {rounds} interleaved rounds, "
            f"{args.threads} thread(s)",
            label="reference transformer, steps after a profiler window 3..5 / no window",
        )
    return results


if __name__ == "__main__":
    main()
