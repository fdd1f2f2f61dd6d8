"""When the master dies: the timeline of a fail-over with real processes.

Per round: a master and two standbys (``distributed.failover: true``) train the tiny reference
transformer as three ``speedtronic train`` processes on a shared-directory store (``lease_ttl``
3 s, ``poll_interval`` 0.2 s). Once the master made a few outer steps it is SIGKILLed, and the
script reads the timeline from the store and the processes' metric events: kill -> the old
lease's expiry -> ``master_takeover`` (a standby took the lease) -> the successor's first outer
step -> its first publication. The baseline, measured in the same run, is the master's own
median interval between outer steps before the kill: the ratio says how many ordinary rounds a
fail-over costs. The second reference is ``lease_ttl`` + two polls, the bound fail-over aims at.

    python benchmarks/diloco_failover.py --quick   # one round
    python benchmarks/diloco_failover.py           # the figures in docs/diloco.md (3 rounds)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from results import emit

from speedtronic_diloco.transports import GlobalMetadata, Lease
from speedtronic_diloco.transports.base import GLOBAL_METADATA, LEASE_FILE

TTL = 3.0
POLL = 0.2
WAIT = 300.0
MODEL = dict(
    name="reference_transformer",
    vocab_size=32,
    max_seq_len=16,
    n_layer=1,
    n_head=2,
    n_kv_head=1,
    d_model=16,
)


def config(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    data = {
        "run": {"name": "failover", "max_steps": 1_000_000, "device": "cpu", "seed": 0},
        "model": MODEL,
        "data": {"micro_batch_size": 2},
        "precision": {"mode": "fp32"},
        "optimizer": {"lr": 1e-3},
        "scheduler": {"name": "constant"},
        "checkpoint": {"interval": 0},
        "logging": {"progress": False, "log_every": 1000},
        "distributed": {
            "enabled": True,
            "role": "worker",
            "repo_id": str(root / "store"),
            "inner_steps": 5,
            "poll_interval": POLL,
            "round_timeout": 1.0,
            "lease_ttl": TTL,
            "failover": True,
            "retry_backoff": 0.05,
            "max_retries": 2,
        },
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Node:
    """One ``speedtronic train`` process and its metric events."""

    def __init__(self, root: Path, config: Path, node: str, role: str) -> None:
        self.name = node
        self.out = root / node
        self.out.mkdir(parents=True)
        self.metrics = self.out / "metrics.jsonl"
        command = [
            sys.executable,
            "-m",
            "speedtronic",
            "train",
            "--config",
            str(config),
            "--output-dir",
            str(self.out),
            "--set",
            f"distributed.node_id={node}",
            "--set",
            f"distributed.role={role}",
            "--set",
            f"logging.json_file={self.metrics}",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with open(self.out / "log.txt", "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    def events(self, name: str) -> list[dict[str, Any]]:
        found = []
        if self.metrics.exists():
            for line in self.metrics.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if record.get("event") == name:
                    found.append(record)
        return found

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(WAIT)


def read(root: Path, path: str) -> bytes | None:
    try:
        return (root / "store" / path).read_bytes()
    except FileNotFoundError:
        return None


def metadata(root: Path) -> GlobalMetadata | None:
    raw = read(root, GLOBAL_METADATA)
    try:
        return GlobalMetadata.loads(raw) if raw else None
    except Exception:  # being replaced right now
        return None


def until(predicate: Any, what: str) -> Any:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise SystemExit(f"timed out waiting for {what}")


def one_round(root: Path) -> dict[str, float]:
    path = config(root)
    master = Node(root, path, "m1", "master")
    standbys: list[Node] = []
    try:
        until(lambda: metadata(root) is not None, "the master's first global")
        standbys = [Node(root, path, name, "worker") for name in ("w1", "w2")]
        until(lambda: all(s.events("delta_uploaded") for s in standbys), "the standbys' deltas")
        before = len(master.events("outer_step"))
        until(lambda: len(master.events("outer_step")) >= before + 4, "four more outer steps")
        times = [e["time"] for e in master.events("outer_step")[before:]]
        interval = statistics.median(b - a for a, b in itertools.pairwise(times))
        lease = Lease.loads(read(root, LEASE_FILE) or b"")
        killed_at = time.time()
        master.process.send_signal(signal.SIGKILL)
        master.process.wait(WAIT)
        winner = until(
            lambda: next((s for s in standbys if s.events("outer_step")), None),
            "the successor's first outer step",
        )
        published = until(
            lambda: (m := metadata(root)) is not None and m.master == winner.name and time.time(),
            "the successor's first publication",
        )
        takeover = winner.events("master_takeover")[0]
        first = winner.events("outer_step")[0]
        return {
            "interval": interval,
            "expiry": lease.expires_at - killed_at,
            "takeover": takeover["time"] - killed_at,
            "outer_step": first["time"] - killed_at,
            "published": published - killed_at,
            "winners": sum(1 for s in standbys if s.events("master_takeover")),
            "deltas": first["deltas_included"],
            "usual": statistics.median(e["deltas_included"] for e in master.events("outer_step")),
        }
    finally:
        for node in (master, *standbys):
            node.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(rounds):
            rows.append(one_round(Path(tmp) / f"round{index}"))
    bound = TTL + 2 * POLL
    print(f"lease_ttl {TTL:g} s, poll_interval {POLL:g} s, 1 master + 2 standbys, shared dir")
    print(
        f"{'round':>5}{'kill>expiry':>12}{'kill>takeover':>14}{'kill>outer':>11}"
        f"{'kill>published':>15}{'outer interval':>15}{'/interval':>10}{'/bound':>8}{'winners':>8}"
        f"{'deltas':>7}{'usual':>6}"
    )
    for index, row in enumerate(rows):
        print(
            f"{index:>5}{row['expiry']:>12.2f}{row['takeover']:>14.2f}{row['outer_step']:>11.2f}"
            f"{row['published']:>15.2f}{row['interval']:>15.2f}"
            f"{row['published'] / row['interval']:>10.1f}{row['takeover'] / bound:>8.2f}"
            f"{row['winners']:>8}{row['deltas']:>7}{row['usual']:>6.0f}"
        )
    method = f"wall-clock seconds from SIGKILL, {rounds} rounds, lease_ttl {TTL:g} s, poll {POLL} s"
    for key, label in (
        ("takeover", "kill -> master_takeover"),
        ("outer_step", "kill -> the successor's first outer step"),
        ("published", "kill -> the successor's first publication"),
    ):
        emit(
            f"diloco_failover.{key}_s", [r[key] for r in rows], unit="s", method=method, label=label
        )
    emit(
        "diloco_failover.published_per_interval",
        [r["published"] / r["interval"] for r in rows],
        unit="x",
        method=method,
        label="kill -> publication / the dead master's median outer-step interval",
    )


if __name__ == "__main__":
    main()
