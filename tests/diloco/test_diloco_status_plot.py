"""``speedtronic diloco status --plot``: the run's history (the global's eval loss per outer
step, nodes and bytes per round) from a real master's events and its store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from speedtronic import DataError
from speedtronic.metrics import JsonlSink
from speedtronic.plot import read_run
from speedtronic_diloco.aggregation import AggregationRules
from speedtronic_diloco.master.loop import MasterOuterLoop
from speedtronic_diloco.status import collect_status, history_panels, plot_history
from speedtronic_diloco.tensors import cpu_state_dict, save_tensors
from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiny() -> dict:
    torch.manual_seed(0)
    return cpu_state_dict(torch.nn.Linear(3, 2).state_dict())


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, Path, SharedDirectoryTransport]:
    """Three rounds of two nodes by a master that evaluates each global and writes its events
    to ``master/metrics.jsonl``, as a master's run does."""
    store = SharedDirectoryTransport(tmp_path / "store")
    store.create_store()
    sink = JsonlSink(tmp_path / "master" / "metrics.jsonl")
    losses = iter([3.0, 2.5, 2.2, 2.0])
    loop = MasterOuterLoop(
        store,
        node_id="m",
        state_dir=tmp_path / "state",
        cache_dir=tmp_path / "cache",
        outer_lr=0.7,
        outer_momentum=0.0,
        emit=sink.on_event,
        rules=AggregationRules(outlier_policy="off", keep_history=0, min_deltas=2),
        evaluate=lambda weights: next(losses),
    )
    loop.keeper.bootstrap(tiny())
    loop.publish()
    for step in (5, 10, 15):
        for node in ("a", "b"):
            delta = {k: torch.full(v.shape, 0.01) for k, v in tiny().items()}
            path = save_tensors(
                tmp_path / f"{node}{step}.safetensors",
                delta,
                {"format": "1", "node_id": node, "local_step": step, "base_outer_step": 0},
            )
            store.upload_delta(node, step, path)
        loop.run_round()
    sink.close()
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"name": "reference_transformer"},
                "distributed": {"enabled": True, "repo_id": str(tmp_path / "store")},
            }
        )
    )
    return config, tmp_path / "master", store


def status(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ}
    env.pop("SPEEDTRONIC_LOAD_PLUGINS", None)
    return subprocess.run(
        [sys.executable, "-m", "speedtronic", "diloco", "status", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )


def test_status_plot_draws_the_rounds_and_the_store_now(run, tmp_path: Path) -> None:
    config, master, store = run
    out = tmp_path / "rounds.png"
    result = status(config, "--run-dir", str(master), "--plot", str(out))
    assert result.returncode == 0, result.stderr
    assert f"wrote {out}" in result.stdout
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000
    loss, nodes, received = history_panels(read_run(master), collect_status(store))
    history, now = loss.lines
    assert history.x == [1.0, 2.0, 3.0] and history.y == [3.0, 2.5, 2.2]
    assert (now.x, now.y) == ([3], [2.2])  # the store's published outer step and eval loss
    assert nodes.lines[0].y == [2.0, 2.0, 2.0]
    assert all(value > 0 for value in received.lines[0].y)


def test_a_directory_without_rounds_is_one_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match=f"^run directory {missing} does not exist$"):
        plot_history(missing, tmp_path / "x.png")
    worker = tmp_path / "worker"  # a worker's run directory: steps, no rounds
    JsonlSink(worker / "metrics.jsonl").on_event("step", {"step": 1, "loss": 1.0})
    with pytest.raises(DataError, match="holds no outer_step events: pass the master's"):
        plot_history(worker, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
