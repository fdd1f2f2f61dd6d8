"""``checkpoint.async_save`` with ``parallel.strategy: fsdp`` in one process (DCP checkpoints,
written in the background): the checkpoints a sync run writes, resumed alike, and a failed
background write retried once then raised at a later step. The 2-rank runs (resume, SIGKILL
during the background write) are in tests/e2e/test_fsdp_async_save.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from core.toy_runs import tiny_transformer_run, train

import speedtronic.checkpoint.dcp as dcp_module
from speedtronic.checkpoint import CheckpointManager
from speedtronic.engine.runtime import build_runtime
from speedtronic.errors import CheckpointError

HORIZON = {"warmup_steps": 2, "total_steps": 8}  # one schedule whatever max_steps is


def sharded(directory: Path, **checkpoint: Any) -> dict[str, Any]:
    return tiny_transformer_run(
        directory,
        run={"max_steps": 8},
        parallel={"strategy": "fsdp"},
        scheduler=HORIZON,
        checkpoint={"interval": 4, **checkpoint},
    )


def test_background_sharded_saves_resume_like_sync_ones(tmp_path: Path) -> None:
    _, sync_events, _ = train(sharded(tmp_path / "sync"))
    first_leg = sharded(tmp_path / "async", async_save=True)
    first_leg["run"]["max_steps"] = 4
    _, leg_events, _ = train(first_leg)
    assert [p["step"] for p in leg_events.named("checkpoint")] == [4]
    step4 = {
        name: CheckpointManager(tmp_path / name / "checkpoints").read(
            tmp_path / name / "checkpoints" / "step_00000004"
        )
        for name in ("sync", "async")
    }
    assert (step4["async"].path / "dcp" / ".metadata").is_file()
    for key, tensor in step4["sync"].state["model"].items():
        assert step4["async"].state["model"][key].equal(tensor), key
    second_leg = sharded(tmp_path / "async", async_save=True, resume=True)
    _, resumed, _ = train(second_leg)
    assert resumed.named("resumed")[0]["step"] == 4
    assert [p["step"] for p in resumed.named("checkpoint")] == [8]
    for step in range(5, 9):
        assert resumed.losses[step] == sync_events.losses[step], step


def test_a_failed_background_sharded_write_is_retried_once_then_raised_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = build_runtime(sharded(tmp_path, interval=2, async_save=True), console=False)
    attempts: list[str] = []

    def full(tensors: Any, filename: str, metadata: Any = None) -> None:
        attempts.append(filename)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp_module, "save_file", full)  # rank 0's commit of the rest
    monkeypatch.setattr(dcp_module.time, "sleep", lambda seconds: None)
    with pytest.raises(CheckpointError, match=r"step_00000002 .*No space left"):
        runtime.trainer.fit()
    assert len(attempts) == 2  # the write and its one retry
    # Raised at a later step boundary, never past the next save (one write in flight).
    assert 2 < runtime.trainer.step <= 4
    checkpoints = tmp_path / "checkpoints"
    assert not list(checkpoints.glob("step_*")) and not list(checkpoints.glob(".step_*"))
