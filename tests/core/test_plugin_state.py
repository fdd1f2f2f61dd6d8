"""Plugins get a per-run home: ``trainer.plugin_state`` and ``on_metric(trainer, ...)``.

Two runs in one process (one after another, or in two threads at once) must each reach only
their own plugin state; a plugin written for the older ``on_metric(event, payload)`` keeps
receiving every event.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from core.toy_runs import Bigram

from speedtronic import SpeedtronicConfig, hookimpl, plugins
from speedtronic.engine.runtime import build_runtime
from speedtronic.registry import register_model, unregister_model

TINY = "core_plugin_state_tiny"
NAME = "core-test-per-run"


class PerRunPlugin:
    """A plugin in the documented shape: what it knows about a run lives in that run."""

    def __init__(self) -> None:
        self.finished: dict[str, list[tuple[str, int | None]]] = {}
        self.seen_at_start: list[Any] = []
        self._lock = threading.Lock()

    @hookimpl
    def on_load_checkpoint(self, trainer: Any, state: dict[str, Any]) -> None:
        trainer.plugin_state[NAME] = {"resumed_at": trainer.step, "events": []}

    @hookimpl
    def on_train_start(self, trainer: Any) -> None:
        state = trainer.plugin_state.get(NAME) or {}
        self.seen_at_start.append({k: v for k, v in state.items() if k != "events"})
        trainer.plugin_state.setdefault(NAME, {"events": []})

    @hookimpl
    def on_metric(self, trainer: Any, event: str, payload: dict[str, Any]) -> None:
        state = trainer.plugin_state.get(NAME)
        if state is not None:
            state["events"].append((event, payload.get("step")))

    @hookimpl
    def on_train_end(self, trainer: Any, error: BaseException | None) -> None:
        with self._lock:
            self.finished[trainer.config.run.name] = trainer.plugin_state[NAME]["events"]


class LegacySink:
    """An ``on_metric`` written before the hook received the run."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self._lock = threading.Lock()

    @hookimpl
    def on_metric(self, event: str, payload: dict[str, Any]) -> None:
        with self._lock:
            self.events.append(event)


@pytest.fixture
def registered() -> Iterator[tuple[PerRunPlugin, LegacySink]]:
    register_model(TINY, Bigram)
    per_run, legacy = PerRunPlugin(), LegacySink()
    names = [plugins.register(per_run, name=NAME), plugins.register(legacy, name="core-legacy")]
    yield per_run, legacy
    for name in names:
        plugins.unregister(name)
    unregister_model(TINY)


def config(tmp_path: Path, name: str, steps: int, **checkpoint: Any) -> SpeedtronicConfig:
    return SpeedtronicConfig.from_dict(
        {
            "run": {"name": name, "device": "cpu", "max_steps": steps, "output_dir": str(tmp_path)},
            "model": {"name": TINY},
            "data": {"micro_batch_size": 2},
            "precision": {"mode": "fp32"},
            "checkpoint": {"save_final": True, **checkpoint},
            "logging": {"log_every": 1, "progress": False},
        }
    )


def steps_of(events: list[tuple[str, int | None]]) -> list[int | None]:
    return [step for event, step in events if event == "step"]


def test_two_runs_one_after_another_each_see_only_their_own_events(
    tmp_path: Path, registered: tuple[PerRunPlugin, LegacySink]
) -> None:
    per_run, legacy = registered
    first = build_runtime(config(tmp_path / "a", "first", 3), console=False).trainer
    second = build_runtime(config(tmp_path / "b", "second", 5), console=False).trainer
    first.fit()
    assert first.plugin_state == {}  # dropped at train end
    second.fit()
    assert steps_of(per_run.finished["first"]) == [1, 2, 3]
    assert steps_of(per_run.finished["second"]) == [1, 2, 3, 4, 5]
    assert per_run.seen_at_start == [{}, {}]  # a fresh home for every run
    # The older signature keeps working: it receives every event of both runs.
    assert legacy.events.count("train_start") == 2 and legacy.events.count("step") == 8


def test_two_runs_in_threads_at_once_each_see_only_their_own_events(
    tmp_path: Path, registered: tuple[PerRunPlugin, LegacySink]
) -> None:
    per_run, _ = registered
    trainers = [
        build_runtime(config(tmp_path / name, name, steps), console=False).trainer
        for name, steps in (("left", 4), ("right", 6))
    ]
    errors: list[BaseException] = []

    def fit(trainer: Any) -> None:
        try:
            trainer.fit()
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=fit, args=(t,)) for t in trainers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert steps_of(per_run.finished["left"]) == [1, 2, 3, 4]
    assert steps_of(per_run.finished["right"]) == [1, 2, 3, 4, 5, 6]


def test_resumed_state_reaches_train_start_and_is_dropped_when_already_finished(
    tmp_path: Path, registered: tuple[PerRunPlugin, LegacySink]
) -> None:
    per_run, _ = registered
    build_runtime(config(tmp_path, "run", 2), console=False).trainer.fit()
    resumed = build_runtime(config(tmp_path, "run", 4, resume=True), console=False).trainer
    resumed.fit()
    assert per_run.seen_at_start[-1] == {"resumed_at": 2}
    assert steps_of(per_run.finished["run"]) == [3, 4]
    assert resumed.plugin_state == {}
    # Nothing left to train: the state a resume loaded is dropped as well.
    done = build_runtime(config(tmp_path, "run", 4, resume=True), console=False).trainer
    result = done.fit()
    assert result.steps == 4 and done.plugin_state == {}
