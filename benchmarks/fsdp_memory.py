"""Per-rank training state of FSDP against DDP: parameters + gradients + optimizer state.

For 1, 2 and 4 ranks this starts that many real processes (gloo, on the CPU), builds the
reference transformer of a few hundred million parameters **on the meta device** (no memory is
allocated) and applies Speedtronic's real FSDP sharding to it
(``speedtronic.parallel.fsdp.shard_model``:
``fully_shard`` per transformer block, then the root). What each rank holds is then read off
the model itself:

* parameters: the bytes of each parameter's local shard (``DTensor.to_local()``), measured;
* gradients: FSDP2 keeps each gradient sharded like its parameter, so the same bytes
  (analytic: meta tensors have no backward to run);
* optimizer state: AdamW's two moment buffers are ``zeros_like`` each (sharded) parameter, so
  twice the parameter bytes (analytic).

DDP holds the whole model on every rank: parameters, gradients and both AdamW moments in full
(counted the same way; DDP's gradient buckets, about one more gradient copy, are not included,
which flatters DDP). The target is FSDP <= 1/N + 5% of DDP per rank; the script prints the
ratio and fails (exit 1) when a world size misses it. FSDP also gathers one unit at a time
(plus the root's parameters) during forward and backward: printed as "gathered", not part of
the state.

    python benchmarks/fsdp_memory.py                 # 1, 2, 4 ranks, the 335M model, CPU
    python benchmarks/fsdp_memory.py --quick         # a 30M model
    python benchmarks/fsdp_memory.py --device cuda   # also MFU per rank (needs N GPUs)

With ``--device cuda`` (not runnable on a CPU machine) each world size also trains a few
real bf16 steps under FSDP on ``cuda:LOCAL_RANK`` and reports tokens/s and MFU per rank
(model FLOPs = 6 x parameters x tokens, over ``--peak-tflops``), and the peak allocated CUDA
memory per rank under DDP and FSDP.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from results import emit

MODELS = {
    # 335M parameters: a 24-layer, d_model 1024 decoder with a 32k vocabulary.
    "full": {"vocab_size": 32000, "max_seq_len": 512, "n_layer": 24, "n_head": 16, "d_model": 1024},
    "quick": {"vocab_size": 32000, "max_seq_len": 256, "n_layer": 4, "n_head": 8, "d_model": 512},
}
WORLD_SIZES = (1, 2, 4)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _measure(rank: int, world: int, port: int, params: dict[str, Any], args: Any, out: str):
    import torch.distributed as dist

    from speedtronic import SpeedtronicConfig
    from speedtronic.parallel.fsdp import shard_model
    from speedtronic_models import ReferenceTransformer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    section = SpeedtronicConfig.from_dict({"parallel": {"strategy": "fsdp"}}).parallel.fsdp
    with torch.device("meta"):
        model = ReferenceTransformer(**params)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    # The mesh is on the run's device type; the parameters stay on meta, sharded.
    shard_model(model, section, device=device, world_size=world)
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    units = [m for m in model.modules() if type(m).__name__.endswith("TransformerBlock")]
    unit = max(sum(p.numel() * p.element_size() for p in u.parameters()) for u in units)
    root = full - sum(sum(p.numel() * p.element_size() for p in u.parameters()) for u in units)
    result: dict[str, Any] = {
        "rank": rank,
        "world": world,
        "parameters": sum(p.numel() for p in model.parameters()),
        "ddp": {"params": full, "grads": full, "optimizer": 2 * full},
        "fsdp": {"params": local, "grads": local, "optimizer": 2 * local},
        "gathered": root + 2 * unit,
    }
    if cuda:
        result.update(_train_on_cuda(rank, world, params, args, device))
    Path(out, f"rank{rank}_of{world}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _train_on_cuda(rank: int, world: int, params: dict[str, Any], args: Any, device: Any):
    """A few bf16 steps under FSDP and under DDP: tokens/s, MFU and peak memory per rank."""
    from torch.nn.parallel import DistributedDataParallel

    from speedtronic import SpeedtronicConfig
    from speedtronic.parallel.fsdp import shard_model
    from speedtronic_models import ReferenceTransformer

    section = SpeedtronicConfig.from_dict({"parallel": {"strategy": "fsdp"}}).parallel.fsdp
    out: dict[str, Any] = {}
    batch, seq = args.micro_batch, params["max_seq_len"]
    for strategy in ("ddp", "fsdp"):
        torch.manual_seed(0)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        model = ReferenceTransformer(**params).to(device)
        if strategy == "fsdp":
            shard_model(model, section, device=device, world_size=world,
                        compute_dtype=torch.bfloat16)  # fmt: skip
            forward = model
        else:
            forward = DistributedDataParallel(model, device_ids=[device.index])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        tokens = torch.randint(0, params["vocab_size"], (batch, seq), device=device)
        elapsed = 0.0
        for step in range(args.warmup + args.steps):
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = forward(tokens, labels=tokens)["loss"]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
            if step >= args.warmup:
                elapsed += time.perf_counter() - started
        count = sum(p.numel() for p in model.parameters())
        rate = args.steps * batch * seq / elapsed
        out[f"{strategy}_cuda"] = {
            "tokens_per_s": rate,
            "mfu": 6 * count * rate / (args.peak_tflops * 1e12),
            "peak_bytes": torch.cuda.max_memory_allocated(device),
        }
        del model, forward, optimizer
    return out


def _gib(count: float) -> str:
    return f"{count / 2**30:7.2f} GiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 30M-parameter model")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 peak per GPU")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    params = MODELS["quick" if args.quick else "full"]
    if args.device == "cuda" and torch.cuda.device_count() < max(WORLD_SIZES):
        print(f"--device cuda needs {max(WORLD_SIZES)} GPUs, found {torch.cuda.device_count()}")
        return 2
    worst = 0.0
    with tempfile.TemporaryDirectory() as out:
        for world in WORLD_SIZES:
            mp.spawn(_measure, args=(world, _free_port(), params, args, out), nprocs=world)
        rows = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    print(
        f"reference transformer {json.dumps(params)}: {rows[0]['parameters']:,} parameters, "
        "fp32 master weights, AdamW (2 moments)"
    )
    print("ranks  rank  ddp state    fsdp state   fsdp/ddp  target<=   gathered (transient)")
    for row in sorted(rows, key=lambda r: (r["world"], r["rank"])):
        ddp, fsdp = sum(row["ddp"].values()), sum(row["fsdp"].values())
        target = 1 / row["world"] + 0.05
        ratio = fsdp / ddp
        worst = max(worst, ratio - target)
        print(
            f"{row['world']:5d} {row['rank']:5d} {_gib(ddp)} {_gib(fsdp)}   {ratio:7.4f}  "
            f"{target:7.4f}   {_gib(row['gathered'] if row['world'] > 1 else 0)}"
        )
        for strategy in ("ddp", "fsdp"):
            cuda = row.get(f"{strategy}_cuda")
            if cuda:
                print(
                    f"             {strategy} on cuda: {cuda['tokens_per_s']:,.0f} tokens/s, "
                    f"MFU {cuda['mfu']:.3f}, peak {_gib(cuda['peak_bytes'])}"
                )
    print("params: measured local shards; grads and optimizer: analytic from those shards")
    for world in WORLD_SIZES:
        ratios = [
            sum(r["fsdp"].values()) / sum(r["ddp"].values()) for r in rows if r["world"] == world
        ]
        emit(
            f"fsdp_memory.state_ratio_{world}_ranks",
            ratios,
            unit="x",
            method=f"bytes per rank (one value per rank), {rows[0]['parameters']:,} parameters",
            label=f"FSDP / DDP parameter + gradient + AdamW state per rank, {world} ranks",
        )
    if worst > 0:
        print(f"FAIL: FSDP exceeds 1/N + 5% of DDP by {worst:.4f}")
        return 1
    print("OK: FSDP per-rank state <= 1/N + 5% of DDP's at every world size")
    return 0


if __name__ == "__main__":
    sys.exit(main())
