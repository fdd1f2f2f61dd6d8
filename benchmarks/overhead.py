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
from speedtronic.optim import decay_groups, lr_lambda
from speedtronic.runtime import build_runtime
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
    """``Trainer.fit`` on the same model: (wall seconds, CPU seconds, last logged loss)."""
    runtime = build_runtime(config, model=model, console=False)
    with no_gc():
        wall, cpu = time.perf_counter(), time.process_time()
        result = runtime.trainer.fit()
        return time.perf_counter() - wall, time.process_time() - cpu, float(result.final_loss)


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
    }
    print(f"final loss: baseline {losses[0]:.5f}, speedtronic {losses[1]:.5f}")
    return result


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    steps, rounds, tiny_steps, tiny_rounds = PRESETS[args.quick]
    torch.set_num_threads(args.threads)
    logging.getLogger("speedtronic").setLevel(logging.WARNING)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), micro-batch {MICRO_BATCH}, "
        f"loss read every {LOG_EVERY} steps"
    )

    reference = compare(
        f"reference transformer {REFERENCE}",
        lambda: ReferenceTransformer(**REFERENCE),
        steps,
        rounds,
    )
    tiny = compare("tiny model (fixed cost per step)", TinyModel, tiny_steps, tiny_rounds)

    print("\nsummary")
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
    return {"reference": reference, "tiny": tiny}


if __name__ == "__main__":
    main()
