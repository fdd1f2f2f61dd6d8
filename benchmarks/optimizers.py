"""AdamW against Muon and AdamW + cautious masking on the smoke-size reference model.

Each optimizer trains the model of ``configs/smoke.yaml`` (2 layers, d_model 64, byte-sized
vocabulary, 16 sequences of 64 tokens per step) from the same seed for N steps, once on the
synthetic stream and once on a real text file, through the ordinary runtime. The table shows
the training loss after N steps (the mean of the last 10 steps: every batch is unseen data, so
this is also a held-out loss) and the median step time (the median of the rounds, which
interleave the variants) as a ratio to AdamW's in the same run.
On CPU the step time is this process's CPU time with one torch thread, which a busy shared
machine disturbs far less than wall-clock time; on CUDA it is wall-clock time (the loss is read
every step, which synchronises).

Without ``--text`` the text is a deterministic corpus: the Python standard library's own
``.py`` files (sorted, concatenated) written to a temporary directory.

    python benchmarks/optimizers.py --quick          # CPU: a minute or two
    python benchmarks/optimizers.py                  # the table in docs/optimizers.md
    python benchmarks/optimizers.py --device cuda --steps 500
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from results import emit

from speedtronic.config import SpeedtronicConfig
from speedtronic.engine.runtime import build_runtime

REPO = Path(__file__).resolve().parent.parent
VARIANTS: dict[str, list[str]] = {
    "adamw": ["optimizer.name=adamw", "optimizer.cautious=false"],
    "muon": ["optimizer.name=muon", "optimizer.cautious=false"],
    "adamw+cautious": ["optimizer.name=adamw", "optimizer.cautious=true"],
}
LAST = 10  # steps averaged for the reported loss
WARMUP = 5  # steps left out of the step-time median (allocations, first-call overheads)


def stdlib_corpus(directory: Path, max_bytes: int = 4_000_000) -> Path:
    """Concatenate the standard library's .py files (sorted by path) up to ``max_bytes``."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = directory / "stdlib.txt"
    written = 0
    with open(out, "wb") as handle:
        for source in sorted(stdlib.glob("*.py")):
            data = source.read_bytes()
            handle.write(data)
            written += len(data)
            if written >= max_bytes:
                break
    return out


def run_once(
    base: SpeedtronicConfig, overrides: list[str], cpu_time: bool
) -> tuple[list[float], list[float]]:
    """Per-step losses and per-step seconds (CPU or wall-clock) of one training run."""
    losses: list[float] = []
    seconds: list[float] = []
    last = [time.process_time()]

    def hook(event: str, payload: dict[str, Any]) -> None:
        if event == "step":
            losses.append(payload["loss"])
            if cpu_time:
                now = time.process_time()
                seconds.append(now - last[0])
                last[0] = now
            else:
                seconds.append(1.0 / payload["steps_per_sec"])

    runtime = build_runtime(base.with_overrides(overrides), hooks=[hook], console=False)
    runtime.trainer.fit()
    return losses, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, one round")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default 200, quick 25)")
    parser.add_argument("--rounds", type=int, help="runs per variant (default 3, quick 1)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--text", type=Path, help="text file (default: stdlib sources)")
    parser.add_argument("--muon-lr", type=float, help="optimizer.muon.lr (default: the config's)")
    args = parser.parse_args()
    steps = args.steps or (25 if args.quick else 200)
    rounds = args.rounds or (1 if args.quick else 3)
    cpu_time = args.device == "cpu"
    if cpu_time:
        torch.set_num_threads(1)
    if steps <= WARMUP + 1:
        parser.error(f"--steps must be more than {WARMUP + 1}")

    with tempfile.TemporaryDirectory() as tmp:
        text = args.text or stdlib_corpus(Path(tmp))
        common = [
            f"run.device={args.device}",
            f"run.max_steps={steps}",
            f"run.output_dir={tmp}/run",
            f"scheduler.total_steps={steps}",
            "checkpoint.interval=0",
            "checkpoint.save_final=false",
            "logging.log_every=1",
            "logging.level=WARNING",
            # Training loss only: no held-out eval (text runs would need a held-out split).
            "eval.every=0",
            "eval.at_end=false",
        ]
        if args.muon_lr:
            common.append(f"optimizer.muon.lr={args.muon_lr}")
        base = SpeedtronicConfig.from_file(REPO / "configs" / "smoke.yaml").with_overrides(common)
        datasets = {"synthetic": [], f"text ({Path(text).name})": [f"data.text_path={text}"]}
        clock = "CPU time, 1 thread" if cpu_time else "wall-clock time"
        print(
            f"smoke model, {steps} steps, {rounds} round(s), device {args.device} ({clock}); "
            f"text: {text} ({Path(text).stat().st_size} bytes)"
        )

        rows = []
        started = time.perf_counter()
        for data_name, data_overrides in datasets.items():
            losses: dict[str, list[float]] = {}
            times: dict[str, list[float]] = {name: [] for name in VARIANTS}
            # Rounds interleave the variants so machine noise hits them alike.
            for _ in range(rounds):
                for name, variant in VARIANTS.items():
                    run_losses, run_seconds = run_once(base, data_overrides + variant, cpu_time)
                    losses[name] = run_losses  # same seed: identical in every round
                    times[name].append(statistics.median(run_seconds[WARMUP:]))
            baseline_loss = statistics.fmean(losses["adamw"][-LAST:])
            baseline_time = statistics.median(times["adamw"])
            for name in VARIANTS:
                loss = statistics.fmean(losses[name][-LAST:])
                step_time = statistics.median(times[name])
                key = f"optimizers.{data_name.split()[0]}.{name.replace('+', '_')}"
                emit(
                    f"{key}.loss",
                    [loss],
                    unit="nats",
                    method=f"mean training loss of steps {steps - LAST + 1}-{steps}, one seed "
                    "(identical in every round)",
                    label=f"{name}, {data_name}, loss after {steps} steps",
                )
                if name != "adamw":
                    # Per round: both variants of a round ran back to back.
                    emit(
                        f"{key}.step_ratio",
                        [t / b for t, b in zip(times[name], times["adamw"], strict=True)],
                        unit="x",
                        method=f"{clock}, median step of steps {WARMUP + 1}-{steps}, {rounds} "
                        "interleaved rounds",
                        label=f"{name} / adamw step time, {data_name}",
                    )
                rows.append(
                    (
                        data_name,
                        name,
                        loss,
                        loss - baseline_loss,
                        step_time * 1e3,
                        step_time / baseline_time,
                    )
                )
        elapsed = time.perf_counter() - started

    print()
    print(f"| data | optimizer | loss @ {steps} | vs AdamW | step ms | step time vs AdamW |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for data_name, name, loss, delta, ms, ratio in rows:
        print(f"| {data_name} | {name} | {loss:.3f} | {delta:+.3f} | {ms:.1f} | {ratio:.2f}x |")
    print(
        f"\n({elapsed:.0f} s; loss = mean training loss of the last {LAST} steps; step time = "
        f"median over steps {WARMUP + 1}..{steps}, median of {rounds} round(s))"
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    main()
