"""Fixtures for the DumbDiLoCo end-to-end tests: ``speedtronic train`` processes as master and
workers over a shared store, and the small run they train.

* :func:`write_config`: the run of :data:`MODEL` (a store in ``tmp_path / "shared"``), with
  overrides per section;
* :class:`Node`: one ``speedtronic train`` process (its log, its JSONL events, restarts);
* :func:`master_and_workers`; :func:`with_plugin`, :func:`start_together`,
  :func:`run_together`: the test-only plugin ``diloco_e2e_plugin`` (a slower node, held or
  failing uploads, a start barrier);
* :func:`wait_until` (every wait is a bounded poll on a condition, failing early with the logs
  when a node exits), :func:`wait_all`, :func:`stop_all`, :func:`kill_all`;
* what the processes leave behind: :func:`store_metadata`, :func:`included`, :func:`eval_loss`.

Test modules in ``tests/e2e`` import it by name: pytest puts the folder of a test file (with no
``__init__.py`` here) on ``sys.path`` before importing it, whether one file runs or the suite.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from diloco_runs import tiny_run

from speedtronic.data import SyntheticTokenStream
from speedtronic_models import ReferenceTransformer

HERE = Path(__file__).parent
PLUGIN = "diloco_e2e_plugin"

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
    tmp_path: Path, name: str = "diloco.yaml", **sections: Mapping[str, Any] | None
) -> Path:
    """A small run of MODEL on the CPU whose DiLoCo store is ``tmp_path / "shared"``.

    Each keyword is a config section whose keys are added to (or replace) the defaults'
    (``model={"n_layer": 2}``, ``distributed={"min_deltas": 2}``); None drops a key, or the
    whole section (the run's own defaults then apply)."""
    e2e: dict[str, Mapping[str, Any] | None] = {
        "run": {"name": "diloco-e2e", "max_steps": 1_000_000, "output_dir": None},
        "model": MODEL,
        "data": {"micro_batch_size": 8},
        "optimizer": {"lr": 3.0e-3, "weight_decay": 0.0},
        "scheduler": {"name": "constant"},
        "checkpoint": {"interval": 1000},
        "logging": {"log_every": 10},
        "distributed": {
            "role": None,
            "node_id": None,
            "repo_id": f"file://{tmp_path / 'shared'}",
            "inner_steps": 5,
            "poll_interval": 0.2,
            "outer_lr": 0.7,
            "outer_momentum": 0.5,
            # Most e2e tests stop, kill or restart nodes mid-run: async rounds, so that the
            # others never wait for them (the rounds tests set `rounds: sync` themselves).
            "rounds": "async",
            "momentum_min_nodes": 1,
            "retry_backoff": 0.1,
            "max_retries": None,
        },
    }
    config = tiny_run(tmp_path, **e2e)
    for section, values in sections.items():
        if values is None:
            config.pop(section, None)
        else:
            merged = {**config.get(section, {}), **values}
            config[section] = {k: v for k, v in merged.items() if v is not None}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


class Node:
    """One ``speedtronic train`` process writing to ``tmp_path / node_id``; ``run`` numbers
    its starts (each has its own log and metrics file)."""

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
            *(sys.executable, "-m", "speedtronic", "train", "--config", str(self.config)),
            *("--output-dir", str(self.output)),
            *("--set", f"distributed.role={self.role}"),
            *("--set", f"distributed.node_id={self.node_id}"),
            *("--set", f"logging.json_file={self.metrics}"),
        ]
        if resume:
            command.append("--resume")
        command += self.extra_args
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **self.extra_env}
        env.pop("SPEEDTRONIC_LOAD_PLUGINS", None)
        with open(self.log, "wb") as log:
            # A session of its own: kill() ends what it started too (torchrun's ranks).
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """This run's events called ``name`` (all with None), in order (a line being written
        is skipped)."""
        if not self.metrics.exists():
            return []
        out = []
        for line in self.metrics.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if name is None or record.get("event") == name:
                out.append(record)
        return out

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def wait(self, timeout: float = WAIT) -> int:
        """The exit code; fails the test with the log's tail after ``timeout`` seconds."""
        assert self.process is not None
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.node_id} still running after {timeout:.0f} s:\n{self.tail()}")

    def kill(self) -> None:
        """SIGKILL the process and whatever it started, if it still runs."""
        if self.alive():
            assert self.process is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


def wait_until(
    predicate: Callable[[], Any],
    nodes: list[Node],
    what: str,
    timeout: float = WAIT,
    poll: float = 0.2,
) -> Any:
    """``predicate()``'s first truthy value, polled every ``poll`` s; fails the test when a
    node of ``nodes`` exits first or after ``timeout`` s, with the logs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for node in nodes:
            if not node.alive():
                code = node.process.returncode if node.process is not None else None
                pytest.fail(
                    f"{node.node_id} exited ({code}) while waiting for {what}:\n{node.tail()}"
                )
        time.sleep(poll)
    logs = "\n".join(f"--- {n.node_id}\n{n.tail()}" for n in nodes)
    pytest.fail(f"timed out waiting for {what}\n{logs}")


def with_plugin(node: Node, plugin: str = PLUGIN, path: Path = HERE, **env: str) -> Node:
    """``node`` loading the test-only ``plugin`` module (found in ``path``) with ``env``;
    calling it again adds settings."""
    if plugin not in node.extra_args:
        node.extra_args += ["--plugin", plugin]
    paths = node.extra_env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    if str(path) not in paths.split(os.pathsep):
        paths = os.pathsep.join(filter(None, [str(path), paths]))
    node.extra_env = {**node.extra_env, "PYTHONPATH": paths, **env}
    return node


def start_together(nodes: list[Node], barrier: Path) -> None:
    """Start the processes, wait (bounded) until each is at train start, then let them all
    train at once (``DILOCO_E2E_BARRIER`` of the test plugin)."""
    barrier.mkdir(parents=True, exist_ok=True)
    # Each process says it is ready under its own name: node ids repeat across the runs of
    # one test (two stores, each with a "master"), and a shared name would let "go" out early.
    names = [f"{index}-{node.node_id}" for index, node in enumerate(nodes)]
    for node, name in zip(nodes, names, strict=True):
        with_plugin(node, DILOCO_E2E_BARRIER=str(barrier), DILOCO_E2E_BARRIER_NAME=name)
        node.start()
    wait_until(
        lambda: all((barrier / f"{name}.ready").exists() for name in names),
        nodes,
        "every node at train start",
    )
    (barrier / "go").write_text("go")


def master_and_workers(tmp_path: Path, config: Path, workers: int = 2) -> list[Node]:
    """A master (``master``) and ``workers`` workers (``w1``, ``w2``...) of one config."""
    master = Node(tmp_path, config, "master", "master")
    return [master, *(Node(tmp_path, config, "worker", f"w{i}") for i in range(1, workers + 1))]


def run_together(nodes: list[Node], barrier: Path) -> None:
    """:func:`start_together`, then every node runs to its end and exits 0 (or is killed)."""
    try:
        start_together(nodes, barrier)
        wait_all(nodes)
    finally:
        kill_all(nodes)


def wait_all(nodes: list[Node], timeout: float = WAIT) -> None:
    """Every node runs to its end and exits 0."""
    for node in nodes:
        assert node.wait(timeout) == 0, node.tail()


def stop_all(nodes: list[Node]) -> None:
    """SIGINT every node (a graceful stop), then wait for each."""
    for node in nodes:
        node.signal(signal.SIGINT)
    for node in nodes:
        node.wait()


def kill_all(nodes: list[Node]) -> None:
    for node in nodes:
        node.kill()


def speedtronic(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``speedtronic ARGS`` as a subprocess that must succeed; its output as text."""
    return subprocess.run(
        [sys.executable, "-m", "speedtronic", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )


def store_metadata(shared: Path) -> dict[str, Any] | None:
    """The store's ``global/step_count.json``, or None before (or while) it is written."""
    try:
        return json.loads((shared / "global" / "step_count.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def included(event: dict[str, Any]) -> list[tuple[str, int]]:
    """The ``(node, local step)`` deltas an ``outer_step`` event aggregated."""
    return [(n, int(s)) for n, s in (item.split("@") for item in event["included"].split(","))]


def eval_loss(state: dict[str, torch.Tensor] | None, params: Mapping[str, Any] = MODEL) -> float:
    """The held-out loss of the model ``params`` with weights ``state`` (None: every node's
    initial weights) on 64 samples no node trains on."""
    torch.manual_seed(0)  # the runtime seeds before building: this is every node's init
    model = ReferenceTransformer.from_params(dict(params))
    if state is not None:
        model.load_state_dict(state, strict=False)
    model.eval()
    stream = SyntheticTokenStream(params["vocab_size"], params["max_seq_len"], 64, seed=987_654)
    with torch.no_grad():
        return float(model(**stream.batch(0))["loss"])
