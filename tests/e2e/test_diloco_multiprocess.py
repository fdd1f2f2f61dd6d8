"""DumbDiLoCo with real processes: ``speedtronic train`` as a master and two workers syncing
through a shared directory.

One scenario, in phases, so the processes start once: outer steps advance with both workers
contributing; the master is SIGKILLed and restarted and continues its outer step, momentum and
ledger without aggregating old deltas again; a worker is SIGKILLed and restarted and rejoins
from the latest global; finally the published global model beats the initial one on held-out
samples. Every wait is bounded polling on files; nothing asserts a duration.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from speedtronic.data import SyntheticTokenStream
from speedtronic_models import ReferenceTransformer

pytestmark = pytest.mark.slow

MODEL = {
    "vocab_size": 64,
    "max_seq_len": 32,
    "n_layer": 1,
    "n_head": 2,
    "n_kv_head": 1,
    "d_model": 32,
}
WAIT = 180.0  # generous: three processes share two contended cores


def write_config(
    tmp_path: Path, name: str = "diloco.yaml", run_name: str = "diloco-e2e", **distributed: Any
) -> Path:
    """A small run of MODEL; ``distributed`` adds to the DiLoCo settings (``repo_id`` at least)."""
    config = {
        "run": {"name": run_name, "seed": 0, "device": "cpu", "max_steps": 1_000_000},
        "model": {"name": "reference_transformer", **MODEL},
        "data": {"micro_batch_size": 8},
        "optimizer": {"lr": 3.0e-3, "weight_decay": 0.0},
        "scheduler": {"name": "constant"},
        "precision": {"mode": "fp32"},
        "checkpoint": {"interval": 10, "keep_last": 2},
        "logging": {"log_every": 10, "progress": False},
        "distributed": {
            "enabled": True,
            "inner_steps": 5,
            "poll_interval": 0.3,
            "outer_lr": 0.7,
            "outer_momentum": 0.5,
            "retry_backoff": 0.1,
            **distributed,
        },
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


class Node:
    """One ``speedtronic train`` process; ``run`` numbers its restarts."""

    def __init__(self, tmp_path: Path, config: Path, role: str, node_id: str) -> None:
        self.tmp_path = tmp_path
        self.config = config
        self.role = role
        self.node_id = node_id
        self.output = tmp_path / node_id
        self.run = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.extra_args: list[str] = []  # more `speedtronic train` arguments
        self.extra_env: dict[str, str] = {}

    @property
    def metrics(self) -> Path:
        return self.output / f"metrics-{self.run}.jsonl"

    @property
    def log(self) -> Path:
        return self.output / f"log-{self.run}.txt"

    def start(self, resume: bool = False) -> None:
        self.run += 1
        self.output.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "speedtronic",
            "train",
            "--config",
            str(self.config),
            "--output-dir",
            str(self.output),
            "--set",
            f"distributed.role={self.role}",
            "--set",
            f"distributed.node_id={self.node_id}",
            "--set",
            f"logging.json_file={self.metrics}",
        ]
        if resume:
            command.append("--resume")
        command += self.extra_args
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **self.extra_env}
        env.pop("SPEEDTRONIC_LOAD_PLUGINS", None)
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    def events(self, name: str) -> list[dict[str, Any]]:
        if not self.metrics.exists():
            return []
        out = []
        for line in self.metrics.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written right now
            if record.get("event") == name:
                out.append(record)
        return out

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def wait(self, timeout: float = WAIT) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


def wait_until(predicate: Callable[[], Any], nodes: list[Node], what: str) -> Any:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for node in nodes:
            if not node.alive():
                pytest.fail(
                    f"{node.node_id} exited ({node.process.returncode}) while waiting "
                    f"for {what}:\n{node.tail()}"
                )
        time.sleep(0.2)
    logs = "\n".join(f"--- {n.node_id}\n{n.tail()}" for n in nodes)
    pytest.fail(f"timed out waiting for {what}\n{logs}")


def store_metadata(shared: Path) -> dict[str, Any] | None:
    try:
        return json.loads((shared / "global" / "step_count.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def master_state(path: Path) -> tuple[int, set[tuple[str, int]], dict[str, torch.Tensor]]:
    with safe_open(str(path), "pt") as handle:
        meta = handle.metadata()
        momentum = {
            k: handle.get_tensor(k)
            for k in handle.keys()  # noqa: SIM118
            if k.startswith("momentum/")
        }
    processed = {(node, step) for node, step, _ in json.loads(meta["processed"])}
    return int(meta["outer_step"]), processed, momentum


def eval_loss(state: dict[str, torch.Tensor] | None) -> float:
    torch.manual_seed(0)  # the runtime seeds before building: this is every node's init
    model = ReferenceTransformer.from_params(MODEL)
    if state is not None:
        model.load_state_dict(state, strict=False)
    model.eval()
    stream = SyntheticTokenStream(MODEL["vocab_size"], MODEL["max_seq_len"], 64, seed=987_654)
    batch = stream.batch(0)
    with torch.no_grad():
        return float(model(**batch)["loss"])


def test_master_and_two_workers_recover_and_improve(tmp_path: Path) -> None:
    config = write_config(tmp_path, repo_id=f"file://{tmp_path / 'shared'}", max_retries=2)
    shared = tmp_path / "shared"
    master = Node(tmp_path, config, "master", "master")
    workers = [Node(tmp_path, config, "worker", f"w{i}") for i in (1, 2)]
    nodes = [master, *workers]
    try:
        for node in nodes:
            node.start()

        # Phase 1: outer steps advance, with deltas of both workers aggregated.
        def both_workers_in() -> bool:
            meta = store_metadata(shared)
            if not meta or meta["outer_step"] < 4:
                return False
            return {"w1", "w2"} <= {node for node, _, _ in meta["processed"]}

        wait_until(both_workers_in, nodes, "outer steps with both workers' deltas")
        assert master.events("outer_step"), master.tail()

        # Phase 2: SIGKILL the master; its persisted state carries on after a restart.
        master.signal(signal.SIGKILL)
        master.wait()
        state_file = master.output / "diloco" / "master" / "outer_state.safetensors"
        killed_step, killed_processed, killed_momentum = master_state(state_file)
        assert killed_step >= 4 and killed_momentum
        master.start(resume=True)
        rounds = wait_until(
            lambda: master.events("outer_step"), nodes, "an outer round of the restarted master"
        )
        first = rounds[0]
        assert first["outer_step"] == killed_step + 1, master.tail()
        included = {
            (n, int(s)) for n, s in (item.split("@") for item in first["included"].split(","))
        }
        assert not included & killed_processed, "old deltas were aggregated again"
        log = master.log.read_text()
        assert f"master startup: local state at outer step {killed_step}" in log

        # Phase 3: SIGKILL a worker; restarted, it rejoins from the latest global.
        w2 = workers[1]
        w2.signal(signal.SIGKILL)
        w2.wait()
        at_kill = store_metadata(shared)["outer_step"]
        w2.start(resume=True)
        loaded = wait_until(
            lambda: [e for e in w2.events("global_loaded") if e["outer_step"] >= at_kill],
            nodes,
            "the restarted worker to install the latest global",
        )
        assert loaded
        new_uploads = wait_until(
            lambda: {int(e["step"]) for e in w2.events("delta_uploaded")},
            nodes,
            "a delta from the restarted worker",
        )

        def rejoined() -> bool:
            for event in master.events("outer_step"):
                steps = {
                    int(item.split("@")[1])
                    for item in event["included"].split(",")
                    if item.startswith("w2@")
                }
                if steps & new_uploads:
                    return True
            return False

        wait_until(rejoined, nodes, "the master to aggregate the restarted worker's delta")

        # Phase 4: stop everyone; the published global beats the initial weights.
        for node in nodes:
            node.signal(signal.SIGINT)
        for node in nodes:
            node.wait()
        final = store_metadata(shared)
        assert final["outer_step"] > killed_step + 1
        global_state = load_file(shared / final["model_file"])
        initial, trained = eval_loss(None), eval_loss(global_state)
        assert trained < initial - 0.5, (initial, trained)
    finally:
        for node in nodes:
            if node.alive():
                node.process.kill()
                node.process.wait(30)
