"""Does a long DumbDiLoCo run stay the same size? Store, metadata and cache bytes over 200 rounds.

A master and two workers (real coordinators and outer loop, in this process, stepped in
lock-step: every node does ``inner_steps`` steps and uploads, then the master runs one outer
round) train a tiny model through a shared-directory store (and, with ``--hub``, through the
Hub emulator of ``tests/hub_emulator``, over HTTP with the real client). After 10, 50 and 200
outer rounds it prints the bytes of the store, of the published ``step_count.json``, of the
master's state file (with its bounded ledger), and of each node's cache directory.

The baseline, measured in the same run, is the same run with ``keep_outer_steps`` so large that
nothing is ever deleted (the behaviour before bounded storage): its store grows with every
round. The ratios ``bytes@200 / bytes@50`` say whether a quantity is flat (about 1.0) or grows.

    python benchmarks/diloco_storage.py            # shared directory, 200 rounds (~1-2 min)
    python benchmarks/diloco_storage.py --hub      # also the Hub emulator (with history squash)
    python benchmarks/diloco_storage.py --rounds 60
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from results import emit

from speedtronic_diloco.config import DistributedConfig
from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic_diloco.transports import GLOBAL_METADATA, Transport
from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport

CHECKPOINTS = (10, 50, 100, 200)
INNER_STEPS = 5
NODES = ("master", "worker-1", "worker-2")
NEVER = 1_000_000  # keep_outer_steps of the baseline: nothing is old enough to delete


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))


def step(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Stand-in for an optimizer step: a small random move of every parameter."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1e-3 * torch.randn(param.shape, generator=generator))


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


@contextlib.contextmanager
def hub_store(root: Path, squash_every: int) -> Iterator[tuple[Any, Any]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from hub_emulator import HubEmulator

    from speedtronic_diloco.transports.hub import HubTransport

    with HubEmulator() as hub:
        yield hub, lambda: HubTransport("bench/run", token="hf_x", endpoint=hub.endpoint)


def run(
    root: Path, rounds: int, keep: int, make_store: Any, squash_every: int = 0
) -> dict[int, dict[str, Any]]:
    """One lock-step run; the measurements at each checkpoint round."""
    coordinators = []
    for node in NODES:
        config = DistributedConfig(
            enabled=True,
            role="master" if node == "master" else "worker",
            node_id=node,
            repo_id=str(root / "store"),
            inner_steps=INNER_STEPS,
            poll_interval=3600.0,
            outer_lr=0.7,
            outer_momentum=0.9,
            rounds="async",  # measured before sync rounds were the default
            momentum_min_nodes=1,
            async_delta_upload=False,
            async_global_poll=False,
            max_retries=0,
            keep_outer_steps=keep,
            squash_history_every=squash_every,
            keep_history=0,
        )
        model = tiny_model()
        coordinator = DumbDiLoCoCoordinator(
            config, model, hub=make_store(), state_dir=root / "state"
        )
        coordinators.append((coordinator, model, torch.Generator().manual_seed(len(coordinators))))
    master = coordinators[0][0]
    for coordinator, _, _ in coordinators:
        coordinator.start()
        if coordinator is master:
            master.outer.stop()  # rounds run in lock-step below instead of on a timer
            master.outer.publish_if_behind()
    measured: dict[int, dict[str, Any]] = {}
    store: Transport = master.transport
    local = 0
    started = time.perf_counter()
    for round_ in range(1, rounds + 1):
        for _ in range(INNER_STEPS):
            local += 1
            for coordinator, model, generator in coordinators:
                step(model, generator)
                coordinator.after_optimizer_step(model, local)
        result = master.outer.run_round()
        assert result is not None, f"round {round_} aggregated nothing"
        if round_ in CHECKPOINTS or round_ == rounds:
            metadata = store.read_global_metadata()
            measured[round_] = {
                "store": store.store_bytes() or 0,
                "metadata": len(metadata.dumps()) if metadata is not None else 0,
                "state": master.outer.keeper.state_path.stat().st_size,
                "ledger": len(master.outer.keeper.processed),
                "caches": {c.node_id: tree_bytes(c.cache_dir) for c, _, _ in coordinators},
                "deltas": len(store.list_deltas()),
                "seconds": time.perf_counter() - started,
            }
    for coordinator, _, _ in coordinators:
        coordinator.stop()
    return measured


def report(
    title: str,
    bounded: dict[int, dict[str, Any]],
    baseline: dict[int, dict[str, Any]],
    figure: str = "",
) -> None:
    """Print the table; with ``figure``, also the RESULT rows of its growth ratios."""
    rounds = sorted(bounded)
    print(f"\n{title}")
    header = f"{'after round':>16}" + "".join(f"{r:>12}" for r in rounds) + f"{'last/50':>10}"
    print(header)

    def row(label: str, values: list[float]) -> None:
        mid = values[rounds.index(50)] if 50 in rounds else values[0]
        ratio = f"{values[-1] / mid:.2f}" if mid else "-"
        print(f"{label:>16}" + "".join(f"{v:>12,.0f}" for v in values) + f"{ratio:>10}")

    row("store", [bounded[r]["store"] for r in rounds])
    row("store, baseline", [baseline[r]["store"] for r in rounds])
    row("step_count.json", [bounded[r]["metadata"] for r in rounds])
    row("master state", [bounded[r]["state"] for r in rounds])
    row("ledger entries", [bounded[r]["ledger"] for r in rounds])
    row("delta files", [bounded[r]["deltas"] for r in rounds])
    row("  baseline", [baseline[r]["deltas"] for r in rounds])
    for node in NODES:
        row(f"cache {node}", [bounded[r]["caches"][node] for r in rounds])
    print(f"{'seconds':>16}" + "".join(f"{bounded[r]['seconds']:>12.1f}" for r in rounds))
    if not figure:
        return
    last, mid = rounds[-1], 50 if 50 in rounds else rounds[0]
    method = f"bytes on disk after rounds {mid} and {last}, one deterministic run, lock-step"
    for key, label, values in (
        ("store", "store", bounded),
        ("store_baseline", "store, never deleting", baseline),
        ("metadata", "step_count.json", bounded),
    ):
        name = "metadata" if key == "metadata" else "store"
        emit(
            f"{figure}.{key}_growth",
            [values[last][name] / values[mid][name]],
            unit="x",
            method=method,
            label=f"{label}: bytes after round {last} / after round {mid}",
        )
    emit(
        f"{figure}.store_bytes",
        [bounded[last]["store"]],
        unit="bytes",
        method=method,
        label=f"store bytes after round {last}, keep_outer_steps 4",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200, help="outer rounds (default 200)")
    parser.add_argument("--hub", action="store_true", help="also run against the Hub emulator")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    params = sum(p.numel() for p in tiny_model().parameters())
    print(
        f"tiny MLP ({params} parameters, {params * 4 / 1024:.0f} KiB), {len(NODES)} nodes, "
        f"inner_steps {INNER_STEPS}, {args.rounds} outer rounds, keep_outer_steps 4"
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)

        def shared(name: str) -> Any:
            return lambda: SharedDirectoryTransport(root / name / "store")

        bounded = run(root / "bounded", args.rounds, 4, shared("bounded"))
        baseline = run(root / "baseline", args.rounds, NEVER, shared("baseline"))
        report("shared directory (bytes)", bounded, baseline, "diloco_storage.shared")
        if args.hub:
            results = {}
            variants = (("bounded", 4, 50), ("no squash", 4, 0), ("baseline", NEVER, 0))
            for name, keep, squash in variants:
                folder = root / f"hub-{name.replace(' ', '-')}"
                with hub_store(folder, squash) as (hub, make):
                    measured = run(folder, args.rounds, keep, make, squash)
                    for values in measured.values():
                        values["head"] = values["store"]
                    results[name] = (measured, hub.stored_bytes("bench/run"))
            report(
                "Hub emulator, files at the head (bytes; bounded run squashes every 50 rounds)",
                results["bounded"][0],
                results["baseline"][0],
                "diloco_storage.hub",
            )
            history = "Hub storage incl. history after the last round"
            for name in ("bounded", "no squash", "baseline"):
                emit(
                    f"diloco_storage.hub.history_mb.{name.replace(' ', '_')}",
                    [results[name][1] / 1e6],
                    unit="MB",
                    method="bytes the Hub emulator stores, one deterministic run",
                    label=f"{history}: {name}",
                )
            print(
                f"Hub storage incl. history after {args.rounds} rounds: deletion + squash every "
                f"50 rounds {results['bounded'][1]:,} B; deletion only "
                f"{results['no squash'][1]:,} B; baseline {results['baseline'][1]:,} B "
                f"({results['baseline'][1] / results['bounded'][1]:.1f}x the first)"
            )
    print(
        f"\n{GLOBAL_METADATA} has a constant size per node; a quantity is flat when 'last/50' "
        "is about 1.0 (the master's state grows until its ledger window, 64 deltas per node, "
        "is full after 64 rounds)"
    )


if __name__ == "__main__":
    main()
