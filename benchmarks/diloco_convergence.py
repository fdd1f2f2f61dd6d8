"""DumbDiLoCo against synchronous data parallelism on the same number of samples.

Four DiLoCo nodes (one master, three workers; each its own data, ``inner_steps`` H local AdamW
steps per round) train through a real shared-directory store, with the real coordinator and
outer loop. The baseline is one synchronous run whose batch is four times a node's, which is
what per-step data-parallel training on four nodes computes. Both see the same samples in
total; the table compares the held-out loss of the published global model with the
baseline's, and the bytes each DiLoCo node moved through the store with what a ring
all-reduce of the gradient at every step would send per node.

The nodes are stepped in lock-step inside this process (the master's round runs right after
every node has uploaded), so the result is reproducible and isolates the algorithm from
scheduling noise; the asynchronous behaviour is covered by benchmarks/diloco_stall.py.

    python benchmarks/diloco_convergence.py --quick    # a minute or two on two CPU cores
    python benchmarks/diloco_convergence.py            # the figures in docs/diloco.md
"""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
from pathlib import Path
from typing import Any

import torch

from speedtronic.data import SyntheticTokenStream
from speedtronic_diloco.config import DistributedConfig
from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic_diloco.identity import node_data_seed
from speedtronic_diloco.shared_dir import SharedDirectoryTransport
from speedtronic_diloco.transport import DeltaInfo, GlobalMetadata, Transport
from speedtronic_models import ReferenceTransformer

PRESETS: dict[bool, dict[str, Any]] = {
    True: dict(
        model=dict(vocab_size=64, max_seq_len=32, n_layer=1, n_head=2, n_kv_head=1, d_model=32),
        batch=8,
        steps=60,
        inner_steps=10,
    ),
    False: dict(
        model=dict(vocab_size=256, max_seq_len=64, n_layer=2, n_head=4, n_kv_head=2, d_model=64),
        batch=8,
        steps=300,
        inner_steps=25,
    ),
}
NODES = 4
LR = 3e-3
EVAL_SEED = 424_242


class CountingTransport(Transport):
    """Wraps a transport and counts the payload bytes each node moves."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.description = inner.description
        self.sent = 0
        self.received = 0

    def create_store(self, *, private: bool = True) -> None:
        self.inner.create_store(private=private)

    def read_global_metadata(self) -> GlobalMetadata | None:
        meta = self.inner.read_global_metadata()
        self.received += len(meta.dumps()) if meta is not None else 0
        return meta

    def download_global(self, metadata: GlobalMetadata, dest: Path) -> Path:
        path = self.inner.download_global(metadata, dest)
        self.received += path.stat().st_size
        return path

    def publish_global(self, weights: Path, metadata: GlobalMetadata) -> GlobalMetadata:
        self.sent += weights.stat().st_size + len(metadata.dumps())
        return self.inner.publish_global(weights, metadata)

    def upload_delta(self, node_id: str, local_step: int, source: Path) -> None:
        self.sent += source.stat().st_size
        self.inner.upload_delta(node_id, local_step, source)

    def list_deltas(self) -> list[DeltaInfo]:
        return self.inner.list_deltas()

    def download_delta(self, info: DeltaInfo, dest: Path) -> Path:
        path = self.inner.download_delta(info, dest)
        self.received += path.stat().st_size
        return path


def build_model(params: dict[str, int]) -> ReferenceTransformer:
    torch.manual_seed(0)  # every node and the baseline start from the same weights
    return ReferenceTransformer.from_params(params)


def eval_loss(model: torch.nn.Module, params: dict[str, int]) -> float:
    stream = SyntheticTokenStream(params["vocab_size"], params["max_seq_len"], 128, EVAL_SEED)
    model.eval()
    with torch.no_grad():
        loss = float(model(**stream.batch(0))["loss"])
    model.train()
    return loss


def train_sync(preset: dict[str, Any]) -> float:
    params, steps = preset["model"], preset["steps"]
    model = build_model(params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    stream = SyntheticTokenStream(
        params["vocab_size"], params["max_seq_len"], preset["batch"] * NODES, seed=0
    )
    for step in range(steps):
        loss = model(**stream.batch(step))["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return eval_loss(model, params)


def train_diloco(preset: dict[str, Any], root: Path) -> tuple[float, list[CountingTransport], int]:
    params, steps, inner = preset["model"], preset["steps"], preset["inner_steps"]
    nodes = []
    for index in range(NODES):
        node_id = "master" if index == 0 else f"worker-{index}"
        config = DistributedConfig(
            enabled=True,
            role="master" if index == 0 else "worker",
            node_id=node_id,
            repo_id=str(root / "store"),
            inner_steps=inner,
            poll_interval=0.0,
            outer_lr=0.7,
            outer_momentum=0.9,
            async_delta_upload=False,
            async_global_poll=False,
            max_retries=0,
        )
        model = build_model(params)
        transport = CountingTransport(SharedDirectoryTransport(root / "store"))
        coordinator = DumbDiLoCoCoordinator(config, model, hub=transport, state_dir=root / "state")
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        stream = SyntheticTokenStream(
            params["vocab_size"],
            params["max_seq_len"],
            preset["batch"],
            seed=node_data_seed(0, node_id),
        )
        nodes.append((model, optimizer, stream, coordinator, transport))
    master = nodes[0][3]
    master.start()
    master.outer.stop()  # rounds run in lock-step below instead of on a timer
    master.outer.publish_if_behind()
    for node in nodes[1:]:
        node[3].start()
    for step in range(1, steps + 1):
        for model, optimizer, stream, coordinator, _ in nodes:
            loss = model(**stream.batch(step - 1))["loss"]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if coordinator.after_optimizer_step(model, step):
                optimizer.state.clear()  # reset_inner_optimizer, as the trainer does
        if step % inner == 0:
            master.outer.run_round()
    for node in nodes:
        node[3].stop()
    final = build_model(params)
    snapshot = master.outer.snapshot()
    assert snapshot is not None
    final.load_state_dict(snapshot[1], strict=False)
    return eval_loss(final, params), [node[4] for node in nodes], master.outer_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, fewer steps")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    preset = PRESETS[args.quick]
    params = preset["model"]
    steps, inner, batch = preset["steps"], preset["inner_steps"], preset["batch"]
    initial = eval_loss(build_model(params), params)
    sync_loss = train_sync(preset)
    with tempfile.TemporaryDirectory() as tmp:
        diloco_loss, transports, outer_steps = train_diloco(preset, Path(tmp))
    model = build_model(params)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ring_per_step = 2 * (NODES - 1) / NODES * param_bytes  # ring all-reduce, per node
    dp_bytes = ring_per_step * steps
    workers = transports[1:]
    diloco_bytes = sum(t.sent + t.received for t in workers) / len(workers)
    master_bytes = transports[0].sent + transports[0].received
    samples = NODES * batch * steps
    print(
        f"model {params}, {NODES} nodes, H={inner}, {steps} steps/node, {samples} samples in total"
    )
    print(f"{'':28}{'eval loss':>10}")
    print(f"{'initial weights':28}{initial:>10.4f}")
    print(f"{'synchronous, batch x4':28}{sync_loss:>10.4f}")
    print(f"{'DumbDiLoCo global':28}{diloco_loss:>10.4f}   ({outer_steps} outer steps)")
    print(
        f"loss ratio DiLoCo / synchronous: {diloco_loss / sync_loss:.3f} "
        f"(perplexity ratio {math.exp(diloco_loss - sync_loss):.3f})"
    )
    print(
        f"bytes per worker: DiLoCo {diloco_bytes / 2**20:.2f} MiB vs data-parallel "
        f"all-reduce {dp_bytes / 2**20:.2f} MiB -> {dp_bytes / diloco_bytes:.1f}x less "
        f"(master incl. publishing: {master_bytes / 2**20:.2f} MiB)"
    )


if __name__ == "__main__":
    main()
