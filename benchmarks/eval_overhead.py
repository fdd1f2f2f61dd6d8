"""What held-out evaluation costs a run, measured against the same run without it.

Two runs of the reference transformer on the synthetic stream, identical but for the ``eval``
section (``eval.every=50, eval.batches=8`` against none), in interleaved rounds that alternate
which goes first. For each run this process's CPU time is split into time inside
``Evaluator.evaluate`` and the rest (training). Printed, as medians over rounds:

* the training CPU time per step with eval on, divided by the same without (target <= 1.01:
  evaluation must not slow the steps themselves);
* eval tokens per CPU second divided by training tokens per CPU second (eval has no backward
  and no optimizer step, so expect >= 2.5x).

    python benchmarks/eval_overhead.py --quick    # about a minute on a busy 2-core machine
    python benchmarks/eval_overhead.py
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from typing import Any

import torch
from results import emit

from speedtronic.engine.eval import Evaluator
from speedtronic.engine.runtime import build_runtime

REFERENCE = dict(
    name="reference_transformer",
    vocab_size=2048,
    max_seq_len=64,
    n_layer=2,
    n_head=4,
    n_kv_head=2,
    d_model=128,
)


def config(steps: int, output_dir: str, evaluate: bool) -> dict[str, Any]:
    data: dict[str, Any] = {
        "run": {"device": "cpu", "max_steps": steps, "output_dir": output_dir, "seed": 0},
        "model": dict(REFERENCE),
        "data": {"micro_batch_size": 8},
        "precision": {"mode": "fp32"},
        "checkpoint": {"save_final": False},
        "logging": {"log_every": 50, "progress": False, "level": "WARNING"},
    }
    if evaluate:
        data["eval"] = {"every": 50, "batches": 8, "at_end": False}
    return data


def one_run(steps: int, evaluate: bool) -> dict[str, float]:
    """CPU seconds of training and of evaluation, and the tokens each processed."""
    spent = {"eval_cpu": 0.0, "eval_tokens": 0.0}
    original = Evaluator.evaluate

    def timed(self: Evaluator, model: Any, step: int) -> Any:
        started = time.process_time()
        result = original(self, model, step)
        spent["eval_cpu"] += time.process_time() - started
        spent["eval_tokens"] += result.tokens
        return result

    Evaluator.evaluate = timed  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory() as out:
            trainer = build_runtime(config(steps, out, evaluate), console=False).trainer
            started = time.process_time()
            result = trainer.fit()
            total = time.process_time() - started
    finally:
        Evaluator.evaluate = original  # type: ignore[method-assign]
    return {
        "train_cpu": total - spent["eval_cpu"],
        "train_tokens": float(result.tokens),
        **spent,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    args = parser.parse_args()
    steps, rounds = (100, 3) if args.quick else (200, 7)
    torch.set_num_threads(1)
    logging.getLogger("speedtronic").setLevel(logging.WARNING)
    step_ratios, speed_ratios = [], []
    one_run(20, True)  # warm-up: allocator, kernels, imports
    for index in range(rounds):
        order = (True, False) if index % 2 == 0 else (False, True)
        results = {evaluate: one_run(steps, evaluate) for evaluate in order}
        on, off = results[True], results[False]
        step_ratios.append(on["train_cpu"] / off["train_cpu"])
        speed_ratios.append(
            (on["eval_tokens"] / on["eval_cpu"]) / (on["train_tokens"] / on["train_cpu"])
        )
        print(
            f"round {index + 1}/{rounds}: training CPU/step with eval / without "
            f"{step_ratios[-1]:.3f}, eval tokens/s / training tokens/s {speed_ratios[-1]:.2f}"
        )
    print(
        f"median over {rounds} rounds of {steps} steps: training step time with eval on / off = "
        f"{statistics.median(step_ratios):.3f} (target <= 1.01); eval tokens/s / training "
        f"tokens/s = {statistics.median(speed_ratios):.2f}x (expect >= 2.5x)"
    )
    method = f"CPU time, {rounds} interleaved rounds of {steps} steps, 1 thread(s)"
    emit(
        "eval_overhead.step_ratio",
        step_ratios,
        unit="x",
        method=method,
        label="training CPU time per step, eval on / off",
    )
    emit(
        "eval_overhead.speed_ratio",
        speed_ratios,
        unit="x",
        method=method,
        label="eval tokens per CPU second / training tokens per CPU second",
    )


if __name__ == "__main__":
    main()
