"""Does a refactor change what a run computes? The smoke config's losses, bit for bit, from two
checkouts of this repository, on one process, DDP over 2 ranks and FSDP over 2 ranks.

Each checkout's four distributions are put first on ``PYTHONPATH`` and a real
``speedtronic train`` runs (``--nproc-per-node 2`` for the ranked modes, gloo on the CPU), one
thread per rank so the kernels' reduction order is the same in both. Every ``step`` event's loss
(logged at every step) and every ``eval`` event's loss are compared as exact floats::

    python benchmarks/same_losses.py --base /tmp/base --head .
    python benchmarks/same_losses.py --base /tmp/base --head . --modes single ddp

It prints one line per mode (steps compared, first differing step if any) and exits 1 when any
loss differs. No timing is measured: this is a correctness check that happens to be slow.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DISTRIBUTIONS = (
    "speedtronic-core",
    "speedtronic-models",
    "speedtronic-diloco",
    "speedtronic-logging",
)
MODES = {
    "single": [],
    "ddp": ["--nproc-per-node", "2", "--set", "parallel.strategy=ddp"],
    "fsdp": ["--nproc-per-node", "2", "--set", "parallel.strategy=fsdp"],
}


def run_losses(checkout: Path, mode: str, steps: int, out: Path) -> list[tuple[str, int, float]]:
    """The ``(event, step, loss)`` of every step and eval event of one smoke run."""
    paths = [str((checkout / name / "src").resolve()) for name in DISTRIBUTIONS]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}
    imported = subprocess.run(
        [sys.executable, "-c", "import speedtronic; print(speedtronic.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(imported).resolve().is_relative_to(checkout.resolve()):
        raise SystemExit(f"{checkout}: speedtronic imports from {imported}, not this checkout")
    command = [
        sys.executable,
        "-m",
        "speedtronic",
        "train",
        "--config",
        str(checkout / "configs" / "smoke.yaml"),
        "--output-dir",
        str(out),
        "--set",
        "logging.log_every=1",
        "--set",
        "run.threads=1",
        "--set",
        f"run.max_steps={steps}",
        *MODES[mode],
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{checkout} {mode}: exit {done.returncode}\n{done.stderr[-3000:]}")
    losses = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("event") in ("step", "eval") and "loss" in event:
            losses.append((event["event"], int(event["step"]), float(event["loss"])))
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the checkout before the change")
    parser.add_argument("--head", type=Path, default=Path("."), help="the checkout after it")
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=list(MODES))
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            base = run_losses(args.base, mode, args.steps, Path(tmp) / f"base-{mode}")
            head = run_losses(args.head, mode, args.steps, Path(tmp) / f"head-{mode}")
            differ = [(b, h) for b, h in zip(base, head) if b != h]
            same = len(base) == len(head) and not differ
            failed |= not same
            where = "" if same else f"; first difference {differ[0] if differ else 'in length'}"
            print(
                f"{mode}: {len(base)} vs {len(head)} losses (step and eval), "
                f"{'bitwise equal' if same else 'DIFFERENT'}{where}"
            )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
