"""Checkpoint save and load time against a bare ``torch.save`` / ``torch.load`` of the same state.

The state is exactly what the trainer checkpoints (``Trainer.state_dict()``): the model, AdamW
with both moment buffers filled, the scheduler, RNG states, the redacted config. The model is
the reference transformer of ``configs/reference-small.yaml`` (40.4M parameters, about 485 MB
of state), or a smaller one with ``--quick``.

Measured per round, interleaved so machine noise hits both sides alike (medians reported):

* save: ``CheckpointManager.save`` (encode, safetensors + JSON, sha256 manifest, fsync of every
  file and directory, atomic rename, pointer, retention) against ``torch.save`` to a path, and
  against ``torch.save`` made durable the same way (temp file, fsync, rename);
* load: ``CheckpointManager.load_latest`` (pointer, size + sha256 verification, safetensors and
  JSON decode, never pickle) against ``torch.load(weights_only=False)``, the pickle-based load
  the previous generation used; both followed by ``Trainer.load_state_dict`` of the result,
  which is what a resume pays. Both read from the page cache after the first round.

    python benchmarks/checkpoint.py --quick     # about a minute on a busy 2-core CPU machine
    python benchmarks/checkpoint.py             # the figures in docs/checkpoints.md

``--stall`` measures instead what a save costs the training loop: real runs (``Trainer.fit``)
of the smoke model and of reference-small, saving every few steps, once with synchronous
saves and once with ``checkpoint.async_save``. Per run: the median step time, the median time
of the steps that carry a save, and their ratio (a step's time is the wall time between its
``step`` event and the previous one, so a save shows up in the step after it). Interleaving is
per run: sync and async of one model run back to back on the same machine.

    python benchmarks/checkpoint.py --stall             # both models (reference-small: CPU
                                                        # runs use 128-token sequences)
    python benchmarks/checkpoint.py --stall --device cuda
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from results import emit

from speedtronic.checkpoint import CheckpointManager
from speedtronic.checkpoint.fileio import atomic_write_with
from speedtronic.engine.runtime import build_runtime
from speedtronic.engine.trainer import Trainer

MODELS = {
    True: {"vocab_size": 8192, "max_seq_len": 256, "n_layer": 4, "n_head": 4, "n_kv_head": 2,
           "d_model": 256},
    False: {"vocab_size": 32768, "max_seq_len": 1024, "n_layer": 8, "n_head": 8, "n_kv_head": 4,
            "d_model": 512},
}  # fmt: skip


def build_trainer(quick: bool, workdir: Path) -> Trainer:
    """A trainer of the reference model after one AdamW step."""
    config = {
        "run": {"device": "cpu", "max_steps": 10, "output_dir": str(workdir / "run")},
        "model": {"name": "reference_transformer", **MODELS[quick]},
        "data": {"micro_batch_size": 1, "seq_len": 16},
        "precision": {"mode": "fp32"},
    }
    trainer = build_runtime(config, console=False).trainer
    # Fake gradients are enough to give AdamW its full state (step, exp_avg, exp_avg_sq).
    for param in trainer.model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.step = 1
    return trainer


def state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


ROOT = Path(__file__).resolve().parents[1]
# (config, steps, save interval, overrides on the CPU)
STALL_RUNS = {
    "smoke": ("configs/smoke.yaml", 60, 6, []),
    "reference-small": (
        "configs/reference-small.yaml",
        20,
        4,
        ["data.micro_batch_size=1", "data.target_batch_size=1", "data.seq_len=128"],
    ),
}


def stall_run(
    name: str, background: bool, device: str, workdir: Path
) -> tuple[list[float], list[float]]:
    """(durations of the plain steps, of the steps that carry a save) of one real run, s."""
    from speedtronic.config import SpeedtronicConfig

    path, steps, interval, cpu_overrides = STALL_RUNS[name]
    overrides = [
        f"run.max_steps={steps}",
        f"run.device={device}",
        f"run.output_dir={workdir / (name + ('-async' if background else '-sync'))}",
        f"checkpoint.interval={interval}",
        "checkpoint.keep_last=2",
        "checkpoint.save_final=false",
        f"checkpoint.async_save={'true' if background else 'false'}",
        "eval.every=0",
        "eval.at_end=false",
        "logging.log_every=1",
        "logging.progress=false",
        "data.num_workers=0",
        "compile.enabled=false",
    ]
    if device == "cpu":
        overrides += cpu_overrides
    config = SpeedtronicConfig.from_file(ROOT / path).with_overrides(overrides)
    stamps: dict[int, float] = {}

    def stamp(event: str, payload: dict[str, Any]) -> None:
        if event == "step":
            if device == "cuda":
                torch.cuda.synchronize()
            stamps[payload["step"]] = time.perf_counter()

    build_runtime(config, hooks=[stamp], console=False).trainer.fit()
    durations = {s: stamps[s] - stamps[s - 1] for s in stamps if s - 1 in stamps and s > 3}
    carrying = [d for s, d in durations.items() if (s - 1) % interval == 0]
    plain = [d for s, d in durations.items() if (s - 1) % interval]
    if not plain or not carrying:
        raise SystemExit(f"{name}: the run logged too few steps to compare ({sorted(stamps)})")
    return plain, carrying


def stall(device: str, names: list[str], workdir: Path) -> None:
    threads = torch.get_num_threads()
    print(f"step-time stall of a save ({device}, {threads} threads)")
    print(f"{'model':16} {'saves':6} {'median step s':>14} {'save step s':>12} {'ratio':>7}")
    for name in names:
        for background in (False, True):
            plain, carrying = stall_run(name, background, device, workdir)
            step = statistics.median(plain)
            mode = "async" if background else "sync"
            save = statistics.median(carrying)
            print(f"{name:16} {mode:6} {step:14.4f} {save:12.4f} {save / step:6.2f}x")
            # Each save step against the run's median plain step: the spread is the saves'.
            emit(
                f"checkpoint_stall.{name}.{mode}",
                [d / step for d in carrying],
                unit="x",
                method=f"wall-clock time of {len(carrying)} save steps / the median of "
                f"{len(plain)} other steps, one Trainer.fit run, {device}, {threads} threads",
                label=f"{name}, {'async' if background else 'synchronous'} save: step that "
                "carries a save / median step",
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stall", action="store_true", help="the step-time stall of a save")
    parser.add_argument("--device", default="cpu", help="with --stall: cpu or cuda")
    parser.add_argument(
        "--models", default="smoke,reference-small", help="with --stall: which runs"
    )
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer rounds")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 3 quick, 5 full)")
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)

    workdir = Path(tempfile.mkdtemp(prefix="speedtronic-ckpt-bench-", dir=args.dir))
    if args.stall:
        try:
            stall(args.device, args.models.split(","), workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return
    try:
        trainer = build_trainer(args.quick, workdir)
        state = trainer.state_dict()
        size_mb = state_bytes(state) / 2**20
        manager = CheckpointManager(workdir / "ours", keep_last=1)
        bare = workdir / "bare.pt"
        durable = workdir / "durable.pt"

        def durable_save() -> None:
            atomic_write_with(durable, lambda tmp: torch.save(state, tmp))

        times: dict[str, list[float]] = {
            k: []
            for k in ("ours_save", "bare_save", "durable_save", "ours_load", "bare_load", "verify")
        }
        step = 1
        for _ in range(rounds + 1):  # the first round warms caches and allocators
            sample = {}
            sample["bare_save"] = timed(lambda: torch.save(state, bare))
            sample["durable_save"] = timed(durable_save)
            sample["ours_save"] = timed(lambda s=step: manager.save(s, state))
            # Loading includes restoring into the trainer: that is what a resume pays, and it
            # is where memory-mapped safetensors pages are finally read.
            sample["bare_load"] = timed(
                lambda: trainer.load_state_dict(torch.load(bare, weights_only=False))
            )
            sample["ours_load"] = timed(
                lambda: trainer.load_state_dict(manager.load_latest().state)
            )
            sample["verify"] = timed(
                lambda s=step: manager.verify(manager.directory / f"step_{s:08d}")
            )
            step += 1
            if step > 2:
                for key, value in sample.items():
                    times[key].append(value)

        median = {k: statistics.median(v) for k, v in times.items()}
        on_disk = sum(f.stat().st_size for f in manager.candidates()[0].iterdir()) / 2**20
        print(
            f"state: {size_mb:.0f} MB of tensors ({'quick' if args.quick else 'reference-small'}"
            f" model), checkpoint on disk {on_disk:.0f} MB, torch.save file "
            f"{bare.stat().st_size / 2**20:.0f} MB; medians of {rounds} rounds, "
            f"{torch.get_num_threads()} threads"
        )
        rows = [
            (
                "save",
                "CheckpointManager.save",
                median["ours_save"],
                "torch.save",
                median["bare_save"],
            ),
            (
                "save",
                "CheckpointManager.save",
                median["ours_save"],
                "torch.save + fsync + rename",
                median["durable_save"],
            ),
            (
                "load",
                "load_latest + restore",
                median["ours_load"],
                "torch.load(pickle) + restore",
                median["bare_load"],
            ),
        ]
        print(f"{'':5} {'speedtronic':32} {'s':>7}   {'baseline':32} {'s':>7}   ratio")
        for kind, ours, ours_s, base, base_s in rows:
            print(
                f"{kind:5} {ours:32} {ours_s:7.3f}   {base:32} {base_s:7.3f}   "
                f"{ours_s / base_s:5.2f}x"
            )
        print(
            f"of the load, size + sha256 verification: {median['verify']:.3f} s "
            f"({median['verify'] / median['ours_load']:.0%}); save throughput "
            f"{on_disk / median['ours_save']:.0f} MB/s, load {on_disk / median['ours_load']:.0f}"
            " MB/s"
        )
        method = f"wall-clock time, {rounds} interleaved rounds, {torch.get_num_threads()} threads"
        for figure, ours, base, label in (
            ("checkpoint.save_vs_torch_save", "ours_save", "bare_save", "save / torch.save"),
            (
                "checkpoint.save_vs_durable",
                "ours_save",
                "durable_save",
                "save / durable torch.save",
            ),
            ("checkpoint.load", "ours_load", "bare_load", "load + restore / torch.load + restore"),
        ):
            ratios = [a / b for a, b in zip(times[ours], times[base], strict=True)]
            emit(figure, ratios, unit="x", method=method, label=f"CheckpointManager {label}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("SPEEDTRONIC_LOAD_PLUGINS", "reference_transformer")
    main()
