"""Does a slow store stall training? Step times at DiLoCo boundaries against other steps.

A worker trains the reference transformer through a store whose every request sleeps 2 s (a
shared directory behind a deliberately slow wrapper), while a stand-in master publishes a new
global every few seconds. Each optimizer step is timed together with the coordinator callback.
The table gives p50/p99 of boundary steps (delta upload + poll) and of all other steps, for the
v2 default (asynchronous upload and poll lanes) and, measured in the same run, for synchronous
mode. With the lanes the boundary/other ratio should stay near 1; synchronous mode pays every
request at the boundary.

    python benchmarks/diloco_stall.py --quick    # a tiny model: about a minute
    python benchmarks/diloco_stall.py            # the figures in docs/diloco.md
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from results import emit

from speedtronic.data import SyntheticTokenStream
from speedtronic_diloco.config import DistributedConfig
from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic_diloco.tensors import cpu_state_dict, save_tensors
from speedtronic_diloco.transports import DeltaInfo, GlobalMetadata, Transport
from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport
from speedtronic_models import ReferenceTransformer

MODELS = {
    True: dict(vocab_size=64, max_seq_len=32, n_layer=1, n_head=2, n_kv_head=1, d_model=32),
    False: dict(vocab_size=256, max_seq_len=64, n_layer=2, n_head=4, n_kv_head=2, d_model=64),
}
DELAY = 2.0


class SlowTransport(Transport):
    """Every request waits ``delay`` seconds before reaching the real store."""

    def __init__(self, inner: Transport, delay: float) -> None:
        self.inner = inner
        self.delay = delay
        self.description = f"slow({inner.description})"
        self.requests = 0

    def _wait(self) -> None:
        self.requests += 1
        time.sleep(self.delay)  # the point of this wrapper: a slow network

    def create_store(self, *, private: bool = True) -> None:
        self._wait()
        self.inner.create_store(private=private)

    def read_global_metadata(self) -> GlobalMetadata | None:
        self._wait()
        return self.inner.read_global_metadata()

    def download_global(self, metadata: GlobalMetadata, dest: Path) -> Path:
        self._wait()
        return self.inner.download_global(metadata, dest)

    def publish_global(self, weights: Path, metadata: GlobalMetadata) -> GlobalMetadata:
        self._wait()
        return self.inner.publish_global(weights, metadata)

    def upload_delta(self, node_id: str, local_step: int, source: Path) -> None:
        self._wait()
        self.inner.upload_delta(node_id, local_step, source)

    def list_deltas(self) -> list[DeltaInfo]:
        self._wait()
        return self.inner.list_deltas()

    def download_delta(self, info: DeltaInfo, dest: Path) -> Path:
        self._wait()
        return self.inner.download_delta(info, dest)


class StandInMaster:
    """Publishes a slightly perturbed global every ``interval`` seconds (fast path)."""

    def __init__(
        self, store: SharedDirectoryTransport, root: Path, interval: float, params: dict[str, int]
    ) -> None:
        self.store = store
        self.root = root
        self.interval = interval
        self.step = 0
        self.stop = threading.Event()
        torch.manual_seed(0)
        self.state = cpu_state_dict(ReferenceTransformer.from_params(params).state_dict())
        self.publish()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def publish(self) -> None:
        path = save_tensors(self.root / f"g{self.step}.safetensors", self.state)
        self.store.publish_global(path, GlobalMetadata.for_file(path, self.step))
        path.unlink()

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.step += 1
            self.state = {
                k: v + 1e-4 if v.is_floating_point() else v for k, v in self.state.items()
            }
            self.publish()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def run(mode: str, steps: int, inner: int, root: Path, params: dict[str, int]) -> dict[str, Any]:
    store = SharedDirectoryTransport(root / "store")
    store.create_store()
    master = StandInMaster(store, root, interval=3.0, params=params)
    master.thread.start()
    asynchronous = mode == "async"
    config = DistributedConfig(
        enabled=True,
        role="worker",
        node_id="worker",
        repo_id=str(root / "store"),
        inner_steps=inner,
        poll_interval=3600.0,
        rounds="async",  # a stand-in master on a timer: the worker never waits for it
        async_delta_upload=asynchronous,
        async_global_poll=asynchronous,
        max_retries=0,
    )
    torch.manual_seed(0)
    model = ReferenceTransformer.from_params(params)
    events: list[str] = []
    transport = SlowTransport(store, DELAY)
    coordinator = DumbDiLoCoCoordinator(
        config,
        model,
        hub=transport,
        state_dir=root / mode,
        logger=lambda event, payload: events.append(event),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stream = SyntheticTokenStream(params["vocab_size"], params["max_seq_len"], 8, seed=1)
    coordinator.start()
    boundary, other = [], []
    for step in range(1, steps + 1):
        batch = stream.batch(step)
        started = time.perf_counter()
        model(**batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if coordinator.after_optimizer_step(model, step):
            optimizer.state.clear()
        elapsed = time.perf_counter() - started
        (boundary if step % inner == 0 else other).append(elapsed)
    coordinator.stop()
    master.stop.set()
    master.thread.join()
    return {
        "boundary": boundary,
        "other": other,
        "skipped": events.count("delta_upload_skipped"),
        "uploaded": events.count("delta_uploaded"),
        "loaded": events.count("global_loaded"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    params = MODELS[args.quick]
    inner = 10 if args.quick else 20
    plans = {"async": 60 if args.quick else 400, "sync": 30 if args.quick else 200}
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, steps in plans.items():
            rows[mode] = run(mode, steps, inner, Path(tmp) / mode, params)
    print(f"store latency {DELAY:.0f} s per request, inner_steps {inner}, model {params}")
    header = (
        f"{'mode':6}{'steps':>6}{'bnd p50':>9}{'bnd p99':>9}{'oth p50':>9}{'oth p99':>9}"
        f"{'p50 ratio':>10}{'p99 ratio':>10}  uploads/skipped/globals"
    )
    print(header)
    for mode, row in rows.items():
        b50, b99 = percentile(row["boundary"], 50), percentile(row["boundary"], 99)
        o50, o99 = percentile(row["other"], 50), percentile(row["other"], 99)
        steps = len(row["boundary"]) + len(row["other"])
        print(
            f"{mode:6}{steps:>6}{b50:>9.3f}{b99:>9.3f}{o50:>9.3f}{o99:>9.3f}"
            f"{b50 / o50:>10.2f}{b99 / o99:>10.2f}  {row['uploaded']}/{row['skipped']}/"
            f"{row['loaded']}"
        )
        size = "quick model" if args.quick else "reference transformer d_model 64"
        method = f"wall-clock time per step, {steps} steps, H = {inner}, {size}, 1 run"
        # Every boundary step against the median other step: the median is the p50 ratio.
        emit(
            f"diloco_stall.{mode}.boundary_ratio",
            [b / o50 for b in row["boundary"]],
            unit="x",
            method=method,
            label=f"{mode}: a boundary step / the median other step",
        )
        emit(
            f"diloco_stall.{mode}.boundary_ms",
            [b * 1e3 for b in row["boundary"]],
            unit="ms",
            method=method,
            label=f"{mode}: boundary step time",
        )
        emit(
            f"diloco_stall.{mode}.other_ms",
            [o * 1e3 for o in row["other"]],
            unit="ms",
            method=method,
            label=f"{mode}: other step time",
        )
        emit(
            f"diloco_stall.{mode}.uploads",
            [row["uploaded"]],
            unit="uploads",
            method=method,
            label=f"{mode}: deltas uploaded",
        )
        emit(
            f"diloco_stall.{mode}.skipped",
            [row["skipped"]],
            unit="boundaries",
            method=method,
            label=f"{mode}: boundaries skipped (an upload still in flight)",
        )


if __name__ == "__main__":
    main()
