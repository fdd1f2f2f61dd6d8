"""Data-parallel scaling inside one machine: N ranks against 1, on the reference transformer.

Each side is a real ``speedtronic train`` run (the N-rank side through ``--nproc-per-node``,
torch's elastic launcher) with the same global batch; rank 0's JSONL metrics give the samples
per second of the steady state (the first logged window, which includes warm-up, is dropped).
Rounds alternate which side goes first. Printed: the samples/s ratio N ranks / 1 rank (ideal N)
and the per-step time each side spends beyond the single-process step, which on one machine is
mostly the gradient all-reduce.

    python benchmarks/ddp_scaling.py                       # CPU: 2 ranks x 1 thread vs 1 x 1
    python benchmarks/ddp_scaling.py --device cuda --nproc 8 --config configs/reference-small.yaml

On a GPU machine the same script measures NCCL scaling (each rank on cuda:LOCAL_RANK).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CPU_MODEL = {
    "name": "reference_transformer",
    "vocab_size": 2048,
    "max_seq_len": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_kv_head": 2,
    "d_model": 128,
}


def run_config(args: argparse.Namespace, out: Path) -> Path:
    if args.config:
        import yaml

        data: dict[str, Any] = yaml.safe_load(Path(args.config).read_text())
    else:
        data = {"model": dict(CPU_MODEL), "precision": {"mode": "fp32"}}
    data.setdefault("run", {}).update(
        {"device": args.device, "max_steps": args.steps, "output_dir": str(out)}
    )
    data.setdefault("data", {}).update(
        {"micro_batch_size": args.micro, "target_batch_size": args.micro * args.nproc}
    )
    data["checkpoint"] = {"save_final": False}
    data["eval"] = {}
    data["logging"] = {"log_every": 10, "progress": False, "json_file": str(out / "m.jsonl")}
    path = out / "config.json"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def samples_per_sec(args: argparse.Namespace, nproc: int) -> float:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        config = run_config(args, out)
        command = [sys.executable, "-m", "speedtronic", "train", "-c", str(config)]
        if nproc > 1:
            command += ["--nproc-per-node", str(nproc)]
        else:
            # One rank reads the whole global batch as accumulation steps of the same micro size.
            command += ["--set", f"data.target_batch_size={args.micro * args.nproc}"]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        subprocess.run(command, check=True, env=env, capture_output=True, timeout=1800)
        records = [json.loads(line) for line in (out / "m.jsonl").read_text().splitlines()]
        rates = [r["samples_per_sec"] for r in records if r["event"] == "step"][1:]
        return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--config", help="a config to take the model from (default: CPU-sized)")
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ratios, overheads = [], []
    for index in range(args.rounds):
        order = (1, args.nproc) if index % 2 == 0 else (args.nproc, 1)
        rates = {n: samples_per_sec(args, n) for n in order}
        ratio = rates[args.nproc] / rates[1]
        batch = args.micro * args.nproc
        # Time per optimizer step: one rank does the whole global batch, N ranks share it.
        single_step, ddp_step = batch / rates[1], batch / rates[args.nproc]
        overheads.append((ddp_step - single_step / args.nproc) * 1e3)
        ratios.append(ratio)
        print(
            f"round {index + 1}/{args.rounds}: {args.nproc} ranks {rates[args.nproc]:.1f} "
            f"samples/s, 1 rank {rates[1]:.1f} samples/s, ratio {ratio:.2f}"
        )
    print(
        f"median: samples/s {args.nproc} ranks / 1 rank = {statistics.median(ratios):.2f} "
        f"(ideal {args.nproc}); time per step beyond a perfect split "
        f"{statistics.median(overheads):.1f} ms (communication and launcher overhead)"
    )


if __name__ == "__main__":
    main()
