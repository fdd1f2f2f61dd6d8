"""What the ranks' per-step stop agreement costs: one all-reduce of one integer, against a step.

Under data parallel, every rank asks at every step boundary whether any rank was told to stop
(``StopRequest.agree``: ``ParallelContext.max_each``, one ``all_reduce`` of an int64). This
starts two gloo ranks on this machine and times, interleaved in the same run, that agreement
and a full DDP optimizer step of the smoke model (``configs/smoke.yaml``: forward, backward with
the gradient all-reduce, AdamW), reporting medians and their ratio.

    python benchmarks/stop_agreement.py            # 2 ranks, CPU, gloo, 60 rounds
    python benchmarks/stop_agreement.py --quick    # 20 rounds
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from results import emit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rank_main(rank: int, world: int, port: int, rounds: int, queue: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    from torch.nn.parallel import DistributedDataParallel

    from speedtronic.engine.stopping import StopRequest
    from speedtronic.parallel import ParallelContext
    from speedtronic_models import ReferenceTransformer

    with open(os.path.join(ROOT, "configs", "smoke.yaml")) as handle:
        smoke = yaml.safe_load(handle)
    params = {k: v for k, v in smoke["model"].items() if k != "name"}
    torch.manual_seed(0)
    model = DistributedDataParallel(ReferenceTransformer.from_params(params))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = smoke["data"]["micro_batch_size"]
    ids = torch.randint(0, params["vocab_size"], (batch, params["max_seq_len"]))
    context = ParallelContext(rank=rank, world_size=world, backend="gloo")
    request = StopRequest()

    def step() -> None:
        loss = model(input_ids=ids, labels=ids)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    steps, agreements = [], []
    for index in range(rounds + 3):
        started = time.perf_counter()
        step()
        middle = time.perf_counter()
        request.agree(context)
        ended = time.perf_counter()
        if index >= 3:  # warm-up rounds
            steps.append(middle - started)
            agreements.append(ended - middle)
    if rank == 0:
        queue.put((steps, agreements))  # type: ignore[attr-defined]
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, help="timed rounds (default 60, 20 with --quick)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args()
    args.rounds = args.rounds or (20 if args.quick else 60)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    mp.start_processes(
        rank_main, args=(2, port, args.rounds, queue), nprocs=2, start_method="spawn"
    )
    steps, agreements = queue.get(timeout=60)
    step, agreement = statistics.median(steps), statistics.median(agreements)
    print(f"2 gloo ranks on the CPU, 1 thread each, medians of {args.rounds} rounds")
    print(f"DDP step of the smoke model   {step * 1e3:9.3f} ms")
    print(f"stop agreement (1 all_reduce) {agreement * 1e3:9.3f} ms   {agreement / step:6.2%}")
    method = f"wall-clock time on rank 0, {args.rounds} rounds, 2 gloo ranks, 1 thread each"
    emit(
        "stop_agreement.step_ms",
        [s * 1e3 for s in steps],
        unit="ms",
        method=method,
        label="DDP optimizer step of the smoke model",
    )
    emit(
        "stop_agreement.agree_ms",
        [a * 1e3 for a in agreements],
        unit="ms",
        method=method,
        label="stop agreement (one all_reduce of an int64)",
    )
    emit(
        "stop_agreement.share",
        [100 * a / s for a, s in zip(agreements, steps, strict=True)],
        unit="% of the step",
        method=method + ", per round",
        label="stop agreement / DDP step",
    )


if __name__ == "__main__":
    main()
