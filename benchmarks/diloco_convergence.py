"""DumbDiLoCo against synchronous data parallelism on the same samples: loss and bytes, for
sync intervals H, delta codecs (``distributed.compression``) and streaming fragments.

Four DiLoCo nodes (one master, three workers; H local AdamW steps per round) train through a
real shared-directory store, with the real coordinator and outer loop. The baseline is one
synchronous run whose batch is four times a node's, which is what per-step data-parallel
training on four nodes computes; the nodes read disjoint quarters of exactly the samples the
baseline reads (rank-split streams), so both see the same samples. For every configuration the
table gives the held-out loss of the published global divided by the baseline's, the payload
bytes each worker moved through the store (deltas up, globals down) against what a ring
all-reduce of the float32 gradient at every step sends per node, and the largest single upload
and the largest download at one sync (with fragments, the files of one global version), the
first install of the initial global excepted (peak bytes in flight at one sync).

Two data sets: the synthetic token stream, and real text: the Python standard library's own
sources on this machine, read as bytes (vocabulary 256; a held-out 2% of the blocks scores the
models). Rows marked in the table ran with several seeds (initial weights and data offset).

The nodes are stepped in lock-step inside this process (the master runs a round right after
every node has uploaded at a sync step; nodes install at their next step, ``install_at: any``),
so the result is reproducible and isolates the algorithm from scheduling noise: this measures
the algorithm, not the asynchronous system (see benchmarks/diloco_stall.py for that).

    python benchmarks/diloco_convergence.py --quick             # about two minutes, 2 cores
    python benchmarks/diloco_convergence.py --jobs 2            # the table in docs/diloco.md

``--async-rows`` instead measures the asynchronous system (issue 23): the same four nodes as
threads with real background lanes, the master's outer thread and its round policy
(``min_deltas: 2``, ``install_at: boundary``, the outer optimizer of the lock-step rows), each
node paced to a fixed step time and one
worker two times slower than the others. It prints the held-out loss of the final global
against the synchronous baseline and the lock-step rounds, the fraction of outer steps that
averaged two or more nodes, and the wall time.

    python benchmarks/diloco_convergence.py --async-rows [--steps 600]
"""

from __future__ import annotations

import argparse
import logging
import re
import statistics
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from results import emit

from speedtronic.data import ByteTextStream, SyntheticTokenStream
from speedtronic_diloco.config import DistributedConfig
from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic_diloco.fragments import FragmentSchedule
from speedtronic_diloco.transports import DeltaInfo, GlobalMetadata, Transport
from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport
from speedtronic_models import ReferenceTransformer

MODEL = dict(vocab_size=256, max_seq_len=32, n_layer=2, n_head=2, n_kv_head=1, d_model=32)
NODES = 4
BATCH = 8  # per node; the synchronous baseline uses NODES * BATCH
LR = 3e-3
EVAL_SEED = 424_242
EVAL_SAMPLES = 256
TEXT_BYTES = 4 << 20


@dataclass(frozen=True)
class Setting:
    """One row: the data set, H, the delta codec, fragments, the global codec, seeds."""

    data: str
    inner_steps: int
    codec: str
    fragments: int
    global_codec: str = "none"
    seeds: tuple[int, ...] = (0,)
    reset: bool = True  # reset_inner_optimizer (False: the inner AdamW state is kept)

    @property
    def label(self) -> str:
        extra = ", bf16 global" if self.global_codec == "bf16" else ""
        kept = ", inner state kept" if not self.reset else ""
        return f"{self.codec}{extra}{kept}"

    @property
    def key(self) -> str:
        return f"{self.data}/{self.inner_steps}/{self.label}/{self.fragments}"

    @property
    def slug(self) -> str:
        """The key as a RESULTS.md row id part: ``text.100.int4_bf16_global.1``."""
        label = re.sub(r"[^a-z0-9]+", "_", self.label.lower()).strip("_")
        return f"{self.data}.{self.inner_steps}.{label}.{self.fragments}"


class CountingTransport(Transport):
    """Wraps a transport and counts the payload bytes one node moves, its largest single
    upload and its largest download of one global version (all of its fragment files). Metadata
    is counted once per new global version (a real node polls on a timer; this benchmark polls
    every step, which would otherwise dominate)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.description = inner.description
        self.supports_fragment_files = inner.supports_fragment_files
        self.sent = 0
        self.received = 0
        self.peak_up = 0
        self.downloads: list[int] = []  # bytes downloaded per global version read
        self._seen = -1

    @property
    def peak_down(self) -> int:
        """The largest download of one global version, the first install excepted (a fresh
        node downloads the whole initial global once, fragments or not)."""
        later = self.downloads[1:] or self.downloads
        return max(later, default=0)

    def create_store(self, *, private: bool = True) -> None:
        self.inner.create_store(private=private)

    def read_global_metadata(self) -> GlobalMetadata | None:
        meta = self.inner.read_global_metadata()
        if meta is not None and meta.outer_step != self._seen:
            self._seen = meta.outer_step
            self.received += len(meta.dumps())
            self.downloads.append(0)
        return meta

    def download_global(self, metadata: GlobalMetadata, dest: Path) -> Path:
        path = self.inner.download_global(metadata, dest)
        size = path.stat().st_size
        self.received += size
        if not self.downloads:
            self.downloads.append(0)
        self.downloads[-1] += size
        return path

    def publish_global(self, weights: Path, metadata: GlobalMetadata) -> GlobalMetadata:
        self.sent += weights.stat().st_size + len(metadata.dumps())
        return self.inner.publish_global(weights, metadata)

    def publish_fragments(self, files: Any, metadata: GlobalMetadata) -> GlobalMetadata:
        self.sent += sum(Path(p).stat().st_size for p in files.values()) + len(metadata.dumps())
        return self.inner.publish_fragments(files, metadata)

    def upload_delta(self, node_id: str, local_step: int, source: Path) -> None:
        size = source.stat().st_size
        self.sent += size
        self.peak_up = max(self.peak_up, size)
        self.inner.upload_delta(node_id, local_step, source)

    def list_deltas(self) -> list[DeltaInfo]:
        return self.inner.list_deltas()

    def download_delta(self, info: DeltaInfo, dest: Path) -> Path:
        path = self.inner.download_delta(info, dest)
        self.received += path.stat().st_size
        return path

    def delete_deltas(self, infos: Any, *, fence: Any = None) -> int:
        return self.inner.delete_deltas(infos, fence=fence)

    def read_lease(self) -> Any:
        return self.inner.read_lease()

    def write_lease(self, lease: Any, expected: Any) -> Any:
        return self.inner.write_lease(lease, expected)


# --------------------------------------------------------------------------- data
def text_file(root: Path) -> Path:
    """The standard library's .py sources (sorted, site-packages excluded), first 4 MiB."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = root / "stdlib.txt"
    written = 0
    with open(out, "wb") as handle:
        for path in sorted(stdlib.rglob("*.py")):
            if "site-packages" in path.parts:
                continue
            data = path.read_bytes()
            handle.write(data[: TEXT_BYTES - written])
            written += min(len(data), TEXT_BYTES - written)
            if written >= TEXT_BYTES:
                break
    return out


def stream(
    data: str, batch: int, seed: int, rank: int = 0, ranks: int = 1, text: Path | None = None
):
    seq = MODEL["max_seq_len"]
    if data == "synthetic":
        return SyntheticTokenStream(
            MODEL["vocab_size"], seq, batch, seed, rank=rank, num_ranks=ranks
        )
    assert text is not None
    # Another seed reads from another place in the file; the nodes' local sample i is global
    # sample i * ranks + rank, so the baseline starts NODES times further (the same samples).
    offset = seed * 100_000 * (NODES // ranks)
    return ByteTextStream(
        text, seq, batch, offset, rank=rank, num_ranks=ranks, holdout_fraction=0.02
    )


def eval_loss(model: torch.nn.Module, data: str, text: Path | None) -> float:
    if data == "synthetic":
        held_out = SyntheticTokenStream(
            MODEL["vocab_size"], MODEL["max_seq_len"], EVAL_SAMPLES, EVAL_SEED
        )
    else:
        assert text is not None
        held_out = ByteTextStream(
            text, MODEL["max_seq_len"], EVAL_SAMPLES, holdout_fraction=0.02, held_out=True
        )
    model.eval()
    with torch.no_grad():
        loss = float(model(**held_out.batch(0))["loss"])
    model.train()
    return loss


def build_model(seed: int) -> ReferenceTransformer:
    torch.manual_seed(seed)  # every node and the baseline start from the same weights
    return ReferenceTransformer.from_params(MODEL)


# --------------------------------------------------------------------------- runs
def train_sync(data: str, seed: int, steps: int, text: Path | None) -> float:
    model = build_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    source = stream(data, BATCH * NODES, seed, text=text)
    for step in range(steps):
        loss = model(**source.batch(step))["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return eval_loss(model, data, text)


def train_diloco(setting: Setting, seed: int, steps: int, root: Path, text: Path | None) -> dict:
    nodes = []
    events: list[tuple[str, dict]] = []

    class errors:  # the coordinators' metric events
        @staticmethod
        def append(event: str, payload: dict) -> None:
            events.append((event, payload))

    for index in range(NODES):
        node_id = "master" if index == 0 else f"worker-{index}"
        config = DistributedConfig(
            enabled=True,
            role="master" if index == 0 else "worker",
            node_id=node_id,
            repo_id=str(root / "store"),
            inner_steps=setting.inner_steps,
            poll_interval=0.0,
            outer_lr=0.7,
            outer_momentum=0.9,
            rounds="async",  # measured before sync rounds were the default
            momentum_min_nodes=1,
            async_delta_upload=False,
            async_global_poll=False,
            max_retries=0,
            install_at="any",
            compression=setting.codec,
            fragments=setting.fragments,
            global_compression=setting.global_codec,
            keep_history=0,
            max_norm_ratio=1e6,  # every node is honest here; keep rounds identical to plain DiLoCo
        )
        model = build_model(seed)
        transport = CountingTransport(SharedDirectoryTransport(root / "store"))
        coordinator = DumbDiLoCoCoordinator(
            config, model, hub=transport, state_dir=root / "state", logger=errors.append
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        source = stream(setting.data, BATCH, seed, index, NODES, text)
        nodes.append((model, optimizer, source, coordinator, transport))
    master = nodes[0][3]
    master.start()
    assert master.outer is not None
    master.outer.stop()  # rounds run in lock-step below instead of on a timer
    master.outer.publish_if_behind()
    for node in nodes[1:]:
        node[3].start()
    schedule = FragmentSchedule(setting.inner_steps, setting.fragments)
    for step in range(1, steps + 1):
        for model, optimizer, source, coordinator, _ in nodes:
            loss = model(**source.batch(step - 1))["loss"]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if coordinator.after_optimizer_step(model, step) and setting.reset:
                optimizer.state.clear()  # reset_inner_optimizer, as the trainer does
        if schedule.due(step):
            master.outer.run_round()
    for node in nodes:
        node[3].stop()
    final = build_model(seed)
    snapshot = master.outer.snapshot()
    assert snapshot is not None
    final.load_state_dict(snapshot[1], strict=False)
    workers = [node[4] for node in nodes[1:]]
    return {
        "loss": eval_loss(final, setting.data, text),
        "bytes": sum(t.sent + t.received for t in workers) / len(workers),
        "peak_up": max(t.peak_up for t in workers),
        "peak_down": max(t.peak_down for t in workers),
        "outer_steps": master.outer_step,
        "error": statistics.mean(
            [p.get("compression_error", 0.0) for e, p in events if e == "delta_uploaded"] or [0.0]
        ),
    }


def run_one(task: tuple[Setting, int, int, str | None]) -> tuple[Setting, int, dict]:
    setting, seed, steps, text = task
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("speedtronic").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        result = train_diloco(setting, seed, steps, Path(tmp), Path(text) if text else None)
    return setting, seed, result


def run_sync(task: tuple[str, int, int, str | None]) -> tuple[str, int, float]:
    data, seed, steps, text = task
    torch.set_num_threads(1)
    return data, seed, train_sync(data, seed, steps, Path(text) if text else None)


def train_async(
    seed: int,
    steps: int,
    inner: int,
    root: Path,
    pace: float,
    slow: float = 2.0,
    momentum: float = 0.9,
) -> dict:
    """The four nodes as threads, asynchronously: step ``i`` of a node ends no earlier than
    ``i * pace`` seconds after the start (``slow * pace`` for ``worker-3``), so the fast
    nodes run ``steps`` steps and the slow one ``steps / slow`` in the same wall time."""
    events: list[tuple[str, dict]] = []
    lock = threading.Lock()

    def record(event: str, payload: dict) -> None:
        with lock:
            events.append((event, dict(payload)))

    nodes = []
    for index in range(NODES):
        node_id = "master" if index == 0 else f"worker-{index}"
        config = DistributedConfig(
            enabled=True,
            role="master" if index == 0 else "worker",
            node_id=node_id,
            repo_id=str(root / "store"),
            inner_steps=inner,
            poll_interval=0.05,
            outer_lr=0.7,
            outer_momentum=momentum,
            rounds="async",  # measured before sync rounds were the default
            momentum_min_nodes=1,
            min_deltas=2,
            round_timeout=30.0,
            install_at="boundary",
            max_retries=0,
            keep_history=0,
        )
        model = build_model(seed)
        coordinator = DumbDiLoCoCoordinator(
            config,
            model,
            hub=SharedDirectoryTransport(root / "store"),
            state_dir=root / "state",
            logger=record,
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        nodes.append(
            (node_id, model, optimizer, stream("synthetic", BATCH, seed, index, NODES), coordinator)
        )
    nodes[0][4].start()  # the master publishes outer step 0 first
    for node in nodes[1:]:
        node[4].start()
    errors: list[BaseException] = []
    started = time.monotonic()

    def train(node_id: str, model: Any, optimizer: Any, source: Any, coordinator: Any) -> None:
        try:
            torch.set_num_threads(1)
            step_time = pace * (slow if node_id == f"worker-{NODES - 1}" else 1.0)
            count = int(steps * pace / step_time)
            for step in range(1, count + 1):
                loss = model(**source.batch(step - 1))["loss"]
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                time.sleep(max(0.0, started + step * step_time - time.monotonic()))
                if coordinator.after_optimizer_step(model, step, final=step == count):
                    optimizer.state.clear()
            coordinator.finish()
            coordinator.stop()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=train, args=node) for node in nodes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - started
    if errors:
        raise errors[0]
    master = nodes[0][4]
    final = build_model(seed)
    snapshot = master.outer.snapshot()
    final.load_state_dict(snapshot[1], strict=False)
    rounds = [p for e, p in events if e == "outer_step"]
    return {
        "loss": eval_loss(final, "synthetic", None),
        "rounds": len(rounds),
        "multi": sum(1 for p in rounds if p["nodes_included"] >= 2),
        "wall": wall,
        "samples": BATCH
        * sum(
            int(steps * pace / (pace * (slow if n[0] == f"worker-{NODES - 1}" else 1.0)))
            for n in nodes
        ),
    }


def async_rows(steps: int, inner: int, pace: float, momentum: float) -> None:
    """The asynchronous comparison (``--async-rows``)."""
    torch.set_num_threads(1)
    logging.getLogger("speedtronic").setLevel(logging.ERROR)
    sync = train_sync("synthetic", 0, steps, None)
    with tempfile.TemporaryDirectory() as tmp:
        lockstep = train_diloco(Setting("synthetic", inner, "none", 1), 0, steps, Path(tmp), None)
    with tempfile.TemporaryDirectory() as tmp:
        result = train_async(0, steps, inner, Path(tmp), pace, momentum=momentum)
    print(
        f"reference transformer {MODEL}, {NODES} nodes x batch {BATCH}, H = {inner}, "
        f"{steps} steps per fast node, {pace * 1000:.0f} ms per step (worker-3: 2x slower)"
    )
    print("| run | samples | held-out loss | loss / sync | multi-node outer steps | wall s |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(
        f"| synchronous data parallel, batch {NODES * BATCH} | {NODES * BATCH * steps} "
        f"| {sync:.3f} | 1.000 | | |"
    )
    print(
        f"| DiLoCo, lock-step rounds, equal speeds | {NODES * BATCH * steps} "
        f"| {lockstep['loss']:.3f} | {lockstep['loss'] / sync:.3f} "
        f"| {lockstep['outer_steps']} of {lockstep['outer_steps']} | |"
    )
    share = 100 * result["multi"] / max(1, result["rounds"])
    print(
        f"| DiLoCo, asynchronous, one node 2x slower | {result['samples']} "
        f"| {result['loss']:.3f} | {result['loss'] / sync:.3f} "
        f"| {result['multi']} of {result['rounds']} ({share:.0f}%) "
        f"| {result['wall']:.1f} |"
    )
    print(
        f"(lock-step rounds with that straggler would wait for it every round: at least "
        f"{steps * pace * 2:.1f} s for the same {steps} steps per node)"
    )
    method = (
        f"{NODES} nodes as threads with the real lanes, H = {inner}, {steps} steps per fast "
        f"node, {pace * 1000:.0f} ms per step (worker-3 2x slower), 1 seed"
    )
    for figure, value, unit, label in (
        ("sync_loss", sync, "nats", "held-out loss, synchronous data parallel"),
        ("lockstep_ratio", lockstep["loss"] / sync, "x", "held-out loss, lock-step / sync"),
        ("async_ratio", result["loss"] / sync, "x", "held-out loss, async, one slow node / sync"),
        ("async_multi_share", share, "%", "async outer steps averaging two or more nodes"),
        ("async_wall_s", result["wall"], "s", "wall time of the asynchronous run"),
    ):
        emit(f"diloco_convergence_async.{figure}", [value], unit=unit, method=method, label=label)


# --------------------------------------------------------------------------- the table
def settings(quick: bool, seeds: int) -> list[Setting]:
    many = tuple(range(seeds))
    if quick:
        grid = [
            Setting("synthetic", h, codec, k)
            for h in (25, 100)
            for codec in ("none", "int8", "int4")
            for k in (1, 4)
        ]
        return [*grid, Setting("text", 100, "int8", 1), Setting("text", 100, "none", 1)]
    grid = [
        Setting("synthetic", h, codec, k, seeds=many if (h, k) == (100, 1) else (0,))
        for h in (25, 100, 250)
        for codec in ("none", "bf16", "int8", "int4")
        for k in (1, 4)
    ]
    text = [
        Setting("text", h, codec, k, seeds=many)
        for h, codec, k in [
            (25, "none", 1),
            (100, "none", 1),
            (100, "int8", 1),
            (100, "int4", 1),
            (100, "int8", 4),
            (250, "int4", 1),
        ]
    ]
    extra = [
        Setting(data, h, "int4", 1, "bf16", seeds=many)
        for data, h in [("synthetic", 100), ("synthetic", 250), ("text", 100), ("text", 250)]
    ]
    # reset_inner_optimizer: false. With fragments the trainer resets the inner optimizer at
    # every fragment sync (K times per H steps): these rows show what that costs.
    kept = [
        Setting("synthetic", h, "int8", k, reset=False) for h in (25, 100, 250) for k in (1, 4)
    ] + [Setting("text", 100, "int8", k, seeds=many, reset=False) for k in (1, 4)]
    return grid + text + extra + kept


def summarise(values: Iterable[float]) -> str:
    values = list(values)
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller grid, fewer steps")
    parser.add_argument("--jobs", type=int, default=1, help="processes (one CPU thread each)")
    parser.add_argument("--seeds", type=int, default=2, help="seeds of the headline rows")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per node")
    parser.add_argument(
        "--select",
        default="",
        help="only the rows whose data/H/codec/K key contains one of these comma-separated "
        "strings (e.g. 'inner state kept', 'text/100')",
    )
    parser.add_argument(
        "--rows-id",
        default="",
        help="the RESULTS.md row prefix of each row's figures (default diloco_convergence, "
        "with .quick for --quick); the docs' table is run with --rows-id diloco_grid",
    )
    parser.add_argument(
        "--async-rows",
        action="store_true",
        help="only the asynchronous comparison (threads, one node 2x slower)",
    )
    parser.add_argument("--inner-steps", type=int, default=25, help="H of --async-rows")
    parser.add_argument("--pace", type=float, default=0.05, help="seconds per step, --async-rows")
    parser.add_argument(
        "--outer-momentum", type=float, default=0.9, help="outer momentum of --async-rows"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    if args.async_rows:
        async_rows(args.steps or 600, args.inner_steps, args.pace, args.outer_momentum)
        return
    steps = args.steps or (200 if args.quick else 1000)
    rows = settings(args.quick, args.seeds)
    if args.select:
        wanted = [part.strip() for part in args.select.split(",") if part.strip()]
        rows = [row for row in rows if any(part in row.key for part in wanted)]
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        text = str(text_file(Path(tmp)))
        datasets = sorted({(r.data, s) for r in rows for s in r.seeds})
        tasks = [(r, s, steps, text) for r in rows for s in r.seeds]
        with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            sync = {
                (d, s): loss
                for d, s, loss in pool.map(run_sync, [(*k, steps, text) for k in datasets])
            }
            results: dict[Setting, dict[int, dict]] = {}
            for setting, seed, result in pool.map(run_one, tasks):
                results.setdefault(setting, {})[seed] = result
    model = build_model(0)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ring_per_step = 2 * (NODES - 1) / NODES * param_bytes  # ring all-reduce, sent per node
    dp_bytes = ring_per_step * steps
    print(
        f"reference transformer {MODEL} ({param_bytes / 1024:.0f} KiB of float32 weights), "
        f"{NODES} nodes x batch {BATCH}, {steps} steps per node; synchronous baseline: batch "
        f"{NODES * BATCH}, same samples. Per-step ring all-reduce: {ring_per_step / 1024:.0f} "
        f"KiB sent per node per step, {dp_bytes / 2**20:.1f} MiB in all."
    )
    for data in ("synthetic", "text"):
        base = [loss for (d, _), loss in sync.items() if d == data]
        if base:
            print(f"synchronous held-out loss, {data}: {summarise(base)}")
            if args.rows_id:
                emit(
                    f"{args.rows_id}.sync.{data}",
                    base,
                    unit="nats",
                    method=f"one process, {steps} steps, {len(base)} seed(s)",
                    label=f"held-out loss of the synchronous 4x-batch run, {data}",
                )
    print()
    header = (
        "| data | H | codec | K | seeds | held-out loss | loss DiLoCo / sync | MiB per worker "
        "| x fewer bytes than all-reduce | peak up KiB | peak down KiB | compression error |"
    )
    print(header)
    print("|" + " --- |" * 12)
    for setting in rows:
        per_seed = results[setting]
        ratios = [per_seed[s]["loss"] / sync[(setting.data, s)] for s in setting.seeds]
        moved = statistics.mean(per_seed[s]["bytes"] for s in setting.seeds)
        up = max(per_seed[s]["peak_up"] for s in setting.seeds)
        down = max(per_seed[s]["peak_down"] for s in setting.seeds)
        print(
            f"| {setting.data} | {setting.inner_steps} | {setting.label} | {setting.fragments} "
            f"| {len(setting.seeds)} | {summarise(per_seed[s]['loss'] for s in setting.seeds)} "
            f"| {summarise(ratios)} | {moved / 2**20:.2f} "
            f"| {dp_bytes / moved:.0f} | {up / 1024:.1f} | {down / 1024:.1f} "
            f"| {statistics.mean(per_seed[s]['error'] for s in setting.seeds):.4f} |"
        )
        if ratios:
            method = (
                f"lock-step simulation in one process, {steps} steps per node, "
                f"{len(ratios)} seed(s) (spread over seeds)"
            )
            if args.rows_id:
                row = f"{args.rows_id}.{setting.slug}"
                fewer = [dp_bytes / per_seed[s]["bytes"] for s in setting.seeds]
                emit(
                    f"{row}.fewer_bytes",
                    fewer,
                    unit="x",
                    method=method,
                    label=(
                        f"{setting.key}: bytes of a per-step ring all-reduce / bytes per worker"
                    ),
                )
                for peak, what in (
                    ("peak_up", "largest upload"),
                    ("peak_down", "largest download of one global version"),
                ):
                    sizes = [per_seed[s][peak] / 1024 for s in setting.seeds]
                    emit(
                        f"{row}.{peak}",
                        sizes,
                        unit="KiB",
                        method=method,
                        label=f"{setting.key}: {what}",
                    )
            else:
                row = f"diloco_convergence.{setting.key.replace('/', '.')}"
                row += ".quick" if args.quick else ""
            emit(
                row,
                ratios,
                unit="x",
                method=method,
                label=f"{setting.key}: held-out loss, DiLoCo global / synchronous 4x batch",
            )
    print(f"\n({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
