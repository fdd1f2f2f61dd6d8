"""Exact resume of uploads (issue 18), with a real ``speedtronic train`` process killed with
SIGKILL at the worst moment: a checkpoint was written while the upload of a delta was still
in flight, the upload then landed (or failed), and the process died before its next upload.

The node trains alone (no master, so no global ever replaces its baseline): whatever
happens, the deltas in the store must add up to exactly how far its weights moved, initial
weights minus final weights. Before the fix, the resumed node sent the landed delta's progress
a second time (the reproduced double count); a failed upload must be sent again, once.

The test-only plugin (``diloco_e2e_plugin``) holds the chosen upload back until the checkpoint
of a later boundary exists, so the checkpoint surely precedes the landing, and holds every later
upload, so the node surely dies before one lands, however fast or slow it trains; every wait is
a bounded poll on a condition.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from diloco_nodes import MODEL, Node, kill_all, wait_all, wait_until, with_plugin, write_config
from safetensors.torch import load_file

from speedtronic.checkpoint import CheckpointManager
from speedtronic_models import ReferenceTransformer

pytestmark = pytest.mark.slow

INNER = 5
STEPS = 40
HELD = 10  # the local step whose upload is in flight across checkpoints
STEP_SLEEP = "0.2"  # a boundary every second: time to kill long before the run's end


def config(tmp_path: Path, name: str = "resume-e2e") -> Path:
    """The resume scenario's node config: a checkpoint at every boundary, no upload retries."""
    return write_config(
        tmp_path,
        "resume.yaml",
        run={"name": name, "max_steps": STEPS},
        checkpoint={"interval": INNER, "keep_last": 3},  # checkpoints at every boundary
        logging={"log_every": 5},
        distributed={
            "inner_steps": INNER,
            "poll_interval": 0.5,
            "max_retries": 0,
            "retry_backoff": 0.0,
        },
    )


def initial_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # the runtime seeds before building the model
    return ReferenceTransformer.from_params(MODEL).state_dict()


def stored_deltas(shared: Path) -> dict[int, dict[str, torch.Tensor]]:
    return {
        int(path.stem.split("_")[1]): load_file(path)
        for path in (shared / "nodes" / "w").glob("delta_*.safetensors")
    }


def hold_upload(node: Node, **env: str) -> None:
    """The upload of step HELD (``env`` chooses how it ends) waits for the checkpoint of the
    next boundary; every later upload is held back (until the node is killed)."""
    after = node.output / "checkpoints" / f"step_{HELD + INNER:08d}"
    with_plugin(
        node,
        DILOCO_E2E_STEP_SLEEP=STEP_SLEEP,
        DILOCO_E2E_UPLOAD_AFTER=str(after),
        DILOCO_E2E_HOLD_LATER="1",
        **env,
    )


def kill_when(node: Node, condition: Callable[[], bool], what: str) -> None:
    """SIGKILL ``node`` as soon as ``condition`` holds (polled often: the moment matters)."""
    wait_until(condition, [node], what, poll=0.01)
    node.signal(signal.SIGKILL)
    node.wait()


def finish_resumed(node: Node) -> None:
    node.extra_env = {
        **node.extra_env,
        "DILOCO_E2E_UPLOAD_STEP": "",
        "DILOCO_E2E_FAIL_UPLOAD_STEP": "",
        "DILOCO_E2E_HOLD_LATER": "",
    }
    node.start(resume=True)
    wait_all([node])


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
    hold_upload(node, DILOCO_E2E_UPLOAD_STEP=str(HELD))
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
        kill_all([node])
    assert "arrived; measuring from its target" in node.log.read_text()
    assert_deltas_add_up(tmp_path, node)


def test_a_failed_upload_in_flight_at_the_checkpoint_is_sent_again(tmp_path: Path) -> None:
    node = Node(tmp_path, config(tmp_path), "worker", "w")
    hold_upload(node, DILOCO_E2E_FAIL_UPLOAD_STEP=str(HELD))
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
        kill_all([node])
    assert "did not arrive" in node.log.read_text()
    assert_deltas_add_up(tmp_path, node)
