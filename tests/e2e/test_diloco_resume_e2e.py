"""Exact resume of uploads (issue 18), with a real ``speedtronic train`` process killed with
SIGKILL at the worst moment: a checkpoint was written while the upload of a delta was still
in flight, the upload then landed (or failed), and the process died before its next upload.

The node trains alone (no master, so no global ever replaces its baseline): whatever
happens, the deltas in the store must add up to exactly how far its weights moved, initial
weights minus final weights. Before the fix, the resumed node sent the landed delta's progress
a second time (the reproduced double count); a failed upload must be sent again, once.

The test-only plugin (``diloco_e2e_plugin``) holds the chosen upload back for a few seconds
and slows every step, so the checkpoint surely precedes the landing; every wait is a bounded
poll on a condition.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_diloco_multiprocess import MODEL, WAIT, Node
from test_diloco_rounds_e2e import with_plugin

from speedtronic.checkpoint import CheckpointManager
from speedtronic_models import ReferenceTransformer

pytestmark = pytest.mark.slow

INNER = 5
STEPS = 40
HELD = 10  # the local step whose upload is in flight across checkpoints
STEP_SLEEP = "0.2"  # a boundary every second: time to kill before the next upload


def config(tmp_path: Path) -> Path:
    data = {
        "run": {"name": "resume-e2e", "seed": 0, "device": "cpu", "max_steps": STEPS},
        "model": {"name": "reference_transformer", **MODEL},
        "data": {"micro_batch_size": 8},
        "optimizer": {"lr": 3.0e-3, "weight_decay": 0.0},
        "scheduler": {"name": "constant"},
        "precision": {"mode": "fp32"},
        "checkpoint": {"interval": INNER, "keep_last": 3},  # checkpoints at every boundary
        "logging": {"log_every": 5, "progress": False},
        "distributed": {
            "enabled": True,
            "repo_id": f"file://{tmp_path / 'shared'}",
            "inner_steps": INNER,
            "poll_interval": 0.5,
            "max_retries": 0,
            "retry_backoff": 0.0,
        },
    }
    path = tmp_path / "resume.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def initial_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # the runtime seeds before building the model
    return ReferenceTransformer.from_params(MODEL).state_dict()


def stored_deltas(shared: Path) -> dict[int, dict[str, torch.Tensor]]:
    return {
        int(path.stem.split("_")[1]): load_file(path)
        for path in (shared / "nodes" / "w").glob("delta_*.safetensors")
    }


def kill_when(node: Node, condition, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + WAIT
    while not condition():
        if not node.alive():
            pytest.fail(f"the node exited before {what}:\n{node.tail()}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n{node.tail()}")
        time.sleep(0.01)
    node.signal(signal.SIGKILL)
    node.wait()


def finish_resumed(node: Node) -> None:
    node.extra_env = {
        **node.extra_env,
        "DILOCO_E2E_UPLOAD_STEP": "",
        "DILOCO_E2E_FAIL_UPLOAD_STEP": "",
    }
    node.start(resume=True)
    assert node.wait(WAIT) == 0, node.tail()


def assert_deltas_add_up(tmp_path: Path, node: Node) -> None:
    """The store's deltas sum to initial minus final weights: nothing twice, nothing lost."""
    final = CheckpointManager(node.output / "checkpoints").load_latest()
    assert final is not None and final.step == STEPS
    start, end = initial_weights(), final.state["model"]
    deltas = stored_deltas(tmp_path / "shared")
    assert STEPS in deltas  # the final delta was uploaded and waited for
    for name in deltas[STEPS]:
        total = sum(d[name].double() for d in deltas.values())
        moved = start[name].double() - end[name].double()
        torch.testing.assert_close(total, moved, rtol=1e-4, atol=1e-5, msg=name)


def test_a_delta_that_landed_after_the_checkpoint_is_not_sent_twice(tmp_path: Path) -> None:
    node = Node(tmp_path, config(tmp_path), "worker", "w")
    with_plugin(
        node,
        DILOCO_E2E_STEP_SLEEP=STEP_SLEEP,
        DILOCO_E2E_UPLOAD_STEP=str(HELD),
        DILOCO_E2E_UPLOAD_DELAY="3",
    )
    node.start()
    shared = tmp_path / "shared"
    try:
        kill_when(
            node,
            lambda: (shared / "nodes" / "w" / f"delta_{HELD}.safetensors").exists(),
            f"the held upload of step {HELD} to land",
        )
        landed = set(stored_deltas(shared))
        assert landed == {INNER, HELD}, f"killed too late to test anything: {landed}"
        assert CheckpointManager(node.output / "checkpoints").load_latest().step > HELD
        finish_resumed(node)
    finally:
        if node.alive():
            node.process.kill()
            node.process.wait(30)
    assert "arrived; measuring from its target" in node.log.read_text()
    assert_deltas_add_up(tmp_path, node)


def test_a_failed_upload_in_flight_at_the_checkpoint_is_sent_again(tmp_path: Path) -> None:
    node = Node(tmp_path, config(tmp_path), "worker", "w")
    with_plugin(
        node,
        DILOCO_E2E_STEP_SLEEP=STEP_SLEEP,
        DILOCO_E2E_FAIL_UPLOAD_STEP=str(HELD),
        DILOCO_E2E_UPLOAD_DELAY="3",
    )
    node.start()
    try:
        kill_when(
            node,
            lambda: any(e["step"] == HELD for e in node.events("delta_upload_failed")),
            f"the upload of step {HELD} to fail",
        )
        assert set(stored_deltas(tmp_path / "shared")) == {INNER}
        finish_resumed(node)
    finally:
        if node.alive():
            node.process.kill()
            node.process.wait(30)
    assert "did not arrive" in node.log.read_text()
    assert_deltas_add_up(tmp_path, node)
