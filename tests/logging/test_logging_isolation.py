"""Two trainers in one process, one after another and at the same time: each run's W&B run and
TensorBoard event files hold that run's metrics only."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from run_outputs import read_jsonl, tensorboard_events, tensorboard_hparams, tensorboard_text
from wandb_run_file import finished_runs

from speedtronic import hookimpl
from speedtronic.runtime import Runtime, build_runtime

STATUS_SUCCESS = 1  # tensorboard.plugins.hparams.api_pb2.Status
# name -> (run.seed, run.max_steps): a run's seed marks its events, its length its steps.
RUNS = {"left": (11, 6), "right": (22, 8)}


class WhoAmIPlugin:
    """Emits a ``whoami`` event carrying the run's seed at every step; with a barrier, holds each
    run at step 2 until the other one got there too, so that both runs are open at once."""

    def __init__(self, barrier: threading.Barrier | None = None) -> None:
        self.barrier = barrier

    @hookimpl
    def after_optimizer_step(self, trainer: Any, step: int) -> None:
        if step == 2 and self.barrier is not None:
            self.barrier.wait()  # bounded: the barrier has a timeout
        trainer.emit("whoami", {"step": step, "seed": trainer.config.run.seed})


def build(tmp_path: Path, tiny_config: Any, name: str) -> Runtime:
    seed, max_steps = RUNS[name]
    out = tmp_path / name
    config = tiny_config(
        out,
        run={
            "name": name,
            "device": "cpu",
            "seed": seed,
            "max_steps": max_steps,
            "output_dir": str(out),
        },
        wandb={"enabled": True, "mode": "offline"},  # into <output_dir>/wandb
        tensorboard={"enabled": True},  # into <output_dir>/tensorboard
    )
    return build_runtime(config, console=False)


def assert_only_its_own_metrics(out: Path, name: str) -> None:
    seed, max_steps = RUNS[name]
    steps = [e for e in read_jsonl(out / "metrics.jsonl") if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(2, max_steps + 1, 2))

    events = tensorboard_events(out / "tensorboard")
    losses = events.Scalars("train/loss")
    assert [s.step for s in losses] == [e["step"] for e in steps]
    assert [s.value for s in losses] == pytest.approx([e["loss"] for e in steps], rel=1e-6)
    marks = events.Scalars("whoami/seed")
    assert [s.step for s in marks] == list(range(1, max_steps + 1))
    assert {s.value for s in marks} == {float(seed)}
    (summary,) = tensorboard_text(events, "summary")
    assert summary[0] == max_steps and f"| steps | {max_steps} |" in summary[1]
    hparams, status = tensorboard_hparams(events)
    assert (hparams["run.name"], status) == (name, STATUS_SUCCESS)

    (run,) = finished_runs(out)
    assert run.name == name and run.config["run"]["seed"] == seed
    rows = [row for row in run.history if "train/loss" in row]
    assert [row["trainer/step"] for row in rows] == [e["step"] for e in steps]
    assert [row["train/loss"] for row in rows] == pytest.approx([e["loss"] for e in steps])
    marked = [row for row in run.history if "whoami/seed" in row]
    assert [row["trainer/step"] for row in marked] == list(range(1, max_steps + 1))
    assert {row["whoami/seed"] for row in marked} == {seed}
    assert run.summary["steps"] == max_steps and run.exit_code == 0


def test_two_trainers_one_after_another(tmp_path, tiny_config, plugins) -> None:
    plugins(WhoAmIPlugin())
    # Both exist before either trains: nothing about the first run may linger for the second.
    runtimes = {name: build(tmp_path, tiny_config, name) for name in RUNS}
    for name, runtime in runtimes.items():
        assert runtime.trainer.fit().steps == RUNS[name][1]
        assert runtime.trainer.plugin_state == {}
    for name in RUNS:
        assert_only_its_own_metrics(tmp_path / name, name)


def test_two_trainers_at_the_same_time(tmp_path, tiny_config, plugins) -> None:
    barrier = threading.Barrier(len(RUNS), timeout=120)
    plugins(WhoAmIPlugin(barrier))
    runtimes = {name: build(tmp_path, tiny_config, name) for name in RUNS}
    results: dict[str, Any] = {}

    def fit(name: str) -> None:
        try:
            results[name] = runtimes[name].trainer.fit()
        except BaseException as exc:  # reported by the main thread below
            barrier.abort()
            results[name] = exc

    threads = [threading.Thread(target=fit, args=(name,)) for name in RUNS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a training thread hung"
    for name, (_, max_steps) in RUNS.items():
        result = results[name]
        assert not isinstance(result, BaseException), repr(result)
        assert result.steps == max_steps
    for name in RUNS:
        assert_only_its_own_metrics(tmp_path / name, name)
