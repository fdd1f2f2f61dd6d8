"""When a run saves: ``maybe_save`` after the policy, on a clock, in the background, on a stop."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from core.toy_runs import EventRecorder, tiny_transformer_run, train

import speedtronic.checkpoint.manager as manager_module
import speedtronic.checkpoint.storage as storage_module
from speedtronic.checkpoint import CheckpointManager, SavePolicy
from speedtronic.engine.runtime import build_runtime
from speedtronic.errors import CheckpointError


class Clock:
    """A clock that moves only when told: ``every_seconds`` tested without timing."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_every_seconds_saves_when_that_much_time_passed_since_the_last_save(
    tmp_path: Path,
) -> None:
    config = tiny_transformer_run(
        tmp_path, run={"max_steps": 10}, checkpoint={"interval": 0, "every_seconds": 1.0}
    )
    recorder = EventRecorder()
    clock = Clock()

    def tick(event: str, payload: dict[str, Any]) -> None:
        if event == "step":  # every step "takes" 0.4 s
            clock.now += 0.4

    runtime = build_runtime(config, hooks=[recorder, tick], console=False)
    runtime.trainer.checkpoints.clock = clock
    runtime.trainer.fit()
    # 1.2 s after the start, 1.2 s after that, ..., and the final save.
    assert [p["step"] for p in recorder.named("checkpoint")] == [3, 6, 9, 10]


def test_request_stop_stops_after_the_step_with_a_checkpoint(tmp_path: Path) -> None:
    config = tiny_transformer_run(tmp_path, run={"max_steps": 50}, checkpoint={"interval": 0})
    recorder = EventRecorder()
    runs: list[Any] = []

    def stop_at_five(event: str, payload: dict[str, Any]) -> None:
        if event == "step" and payload["step"] == 5:
            runs[0].request_stop()

    runtime = build_runtime(config, hooks=[recorder, stop_at_five], console=False)
    runs.append(runtime.trainer)
    result = runtime.trainer.fit()
    assert result.stopped and result.stop_signal is None and result.steps == 5
    path = str(tmp_path / "checkpoints" / "step_00000005")
    assert recorder.named("stopped") == [{"signal": None, "step": 5, "path": path}]
    assert recorder.named("train_end")[0]["status"] == "stopped"
    assert CheckpointManager(tmp_path / "checkpoints").load_latest().step == 5


def test_async_saves_are_the_checkpoints_sync_saves_are(tmp_path: Path) -> None:
    sync = tiny_transformer_run(tmp_path / "sync", run={"max_steps": 8})
    background = copy.deepcopy(sync)
    background["run"]["output_dir"] = str(tmp_path / "async")
    background["checkpoint"]["async_save"] = True
    _, sync_events, _ = train(sync)
    _, async_events, _ = train(background)
    assert [p["step"] for p in async_events.named("checkpoint")] == [4, 8]
    assert sync_events.losses == async_events.losses
    for step in (4, 8):
        name = f"step_{step:08d}"
        expected = CheckpointManager(tmp_path / "sync" / "checkpoints").load(
            str(tmp_path / "sync" / "checkpoints" / name)
        )
        written = CheckpointManager(tmp_path / "async" / "checkpoints").load(
            str(tmp_path / "async" / "checkpoints" / name)
        )
        for key in ("model", "optimizer"):
            assert _flat(written.state[key]) == _flat(expected.state[key])


def _flat(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {key: _flat(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_flat(value) for value in tree]
    return tree.tolist() if hasattr(tree, "tolist") else tree


def test_a_failed_background_write_is_retried_once_then_raised_at_the_next_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tiny_transformer_run(
        tmp_path, run={"max_steps": 8}, checkpoint={"interval": 2, "async_save": True}
    )
    runtime = build_runtime(config, console=False)
    attempts: list[str] = []

    def full(tensors: Any, filename: str, metadata: Any = None) -> None:
        attempts.append(filename)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage_module, "save_file", full)
    monkeypatch.setattr(manager_module.time, "sleep", lambda seconds: None)
    with pytest.raises(CheckpointError, match=r"step_00000002 .*No space left"):
        runtime.trainer.fit()
    assert len(attempts) == 2  # the write and its one retry
    # Raised at a later step boundary, never past the next save (one write in flight).
    assert 2 < runtime.trainer.step <= 4
    assert not list((tmp_path / "checkpoints").glob("step_*"))


def test_a_manager_without_a_policy_saves_only_when_told(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    assert manager.policy == SavePolicy()
    assert [s.step for s in manager.maybe_save(3, lambda: {"x": 1})] == []
    assert [s.step for s in manager.maybe_save(3, lambda: {"x": 1}, final=True)] == [3]
    assert manager.maybe_save(3, lambda: {"x": 2}, force=True) == []  # step 3 is saved
    assert manager.load_latest().state == {"x": 1}
