"""``WandbSink`` and ``TensorBoardSink`` as Python objects: given to ``MetricLogger`` or to
``build_runtime``/``train_from_config`` without the YAML sections, read back from their files."""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from run_outputs import read_jsonl, tensorboard_events, tensorboard_hparams, tensorboard_text
from wandb_run_file import finished_runs

from speedtronic import ConfigError, PluginError, hookimpl
from speedtronic.metrics import MetricLogger
from speedtronic.runtime import build_runtime, train_from_config
from speedtronic.schema import build_section
from speedtronic_logging import TensorBoardSink, WandbSink
from speedtronic_logging.config import TensorBoardConfig, WandbConfig

STATUS_SUCCESS, STATUS_FAILURE = 1, 2  # tensorboard.plugins.hparams.api_pb2.Status
CUSTOM = {
    "WandbConfig": {"project": "p", "tags": ["a"], "mode": "offline", "dir": "d"},
    "TensorBoardConfig": {"log_dir": "tb", "flush_secs": 7},
}


class FailAt:
    def __init__(self, step: int) -> None:
        self.step = step

    @hookimpl
    def after_optimizer_step(self, step: int) -> None:
        if step == self.step:
            raise RuntimeError(f"injected failure at step {step}")


def test_tensorboard_sink_in_a_plain_metric_logger(tmp_path: Path) -> None:
    log_dir = tmp_path / "tb"
    sink = TensorBoardSink(log_dir=str(log_dir), flush_secs="5")
    assert sink.settings.flush_secs == 5  # coerced as the section coerces it
    logger = MetricLogger(hooks=[sink])
    logger.emit("step", {"step": 1, "loss": 9.0})  # before train_start: no run, ignored
    assert not log_dir.exists()
    config = {"run": {"name": "by-hand"}, "optimizer": {"lr": 0.5}}
    logger.emit("train_start", {"step": 0, "start_step": 0, "device": "cpu", "config": config})
    for step, loss in [(1, 3.0), (2, 2.5), (3, 2.0)]:
        logger.emit("step", {"step": step, "loss": loss, "lr": 0.1})
    logger.emit("eval", {"step": 3, "loss": 2.2, "split": "val"})
    logger.emit("train_end", {"steps": 3, "final_loss": 2.0, "status": "ok"})
    logger.close()
    logger.close()  # closing again is harmless

    events = tensorboard_events(log_dir)
    assert [(s.step, s.value) for s in events.Scalars("train/loss")] == [
        (1, 3.0),
        (2, 2.5),
        (3, 2.0),
    ]
    assert [(s.step, s.value) for s in events.Scalars("eval/loss")] == [(3, pytest.approx(2.2))]
    assert "eval/split" not in events.Tags()["scalars"]
    assert "name: by-hand" in tensorboard_text(events, "config")[0][1]
    assert "| device | cpu |" in tensorboard_text(events, "run_info")[0][1]
    (summary,) = tensorboard_text(events, "summary")
    assert summary[0] == 3 and "| status | ok |" in summary[1]
    hparams, status = tensorboard_hparams(events)
    assert hparams == {"run.name": "by-hand", "optimizer.lr": 0.5} and status == STATUS_SUCCESS


def test_sinks_given_as_hooks_log_a_run_without_the_sections(tmp_path, tiny_config) -> None:
    out = tmp_path / "run"
    tensorboard = TensorBoardSink()  # default log_dir: <run.output_dir>/tensorboard
    wandb = WandbSink(project="from-python", mode="offline", tags=["py"], group="g")
    config = tiny_config(out)
    assert not config.wandb.enabled and not config.tensorboard.enabled
    result = train_from_config(config, hooks=[tensorboard, wandb], console=False)
    assert result.steps == 6

    steps = [e for e in read_jsonl(out / "metrics.jsonl") if e["event"] == "step"]
    events = tensorboard_events(out / "tensorboard")
    losses = events.Scalars("train/loss")
    assert [s.step for s in losses] == [2, 4, 6]
    assert [s.value for s in losses] == pytest.approx([e["loss"] for e in steps], rel=1e-6)
    hparams, status = tensorboard_hparams(events)
    assert hparams["run.name"] == "tiny" and hparams["model.d_model"] == 16
    assert status == STATUS_SUCCESS

    (run,) = finished_runs(out)  # W&B's default dir is run.output_dir here too
    assert run.run_id == wandb.run_id
    assert (run.name, run.group, run.tags) == ("tiny", "g", ["py"])
    assert run.config["run"]["max_steps"] == 6 and run.config["run_info"]["device"] == "cpu"
    rows = [row for row in run.history if "train/loss" in row]
    assert [row["trainer/step"] for row in rows] == [2, 4, 6]
    assert [row["train/loss"] for row in rows] == pytest.approx([e["loss"] for e in steps])
    assert run.summary["status"] == "ok" and run.summary["steps"] == 6
    assert run.exit_code == 0


def test_a_sink_and_the_section_write_the_same_scalars(tmp_path, tiny_config) -> None:
    out = tmp_path / "run"
    sink = TensorBoardSink(log_dir=str(tmp_path / "mine"))
    config = tiny_config(out, tensorboard={"enabled": True})
    build_runtime(config, hooks=[sink], console=False).trainer.fit()
    from_section = tensorboard_events(out / "tensorboard").Scalars("train/loss")
    from_sink = tensorboard_events(tmp_path / "mine").Scalars("train/loss")
    assert [(s.step, s.value) for s in from_sink] == [(s.step, s.value) for s in from_section]


def test_a_failed_run_is_marked_failed_by_the_sinks(tmp_path, tiny_config, plugins) -> None:
    plugins(FailAt(5))
    out = tmp_path / "run"
    sinks = [TensorBoardSink(flush_secs=600), WandbSink(mode="offline")]
    with pytest.raises(RuntimeError, match="injected failure at step 5"):
        train_from_config(tiny_config(out), hooks=sinks, console=False)

    events = tensorboard_events(out / "tensorboard")  # flushed despite flush_secs=600
    assert [s.step for s in events.Scalars("train/loss")] == [2, 4]
    assert "| status | error: RuntimeError |" in tensorboard_text(events, "summary")[0][1]
    assert tensorboard_hparams(events)[1] == STATUS_FAILURE
    (run,) = finished_runs(out)
    assert run.summary["status"] == "error: RuntimeError" and run.exit_code == 1


def test_one_sink_serves_two_fits(tmp_path, tiny_config) -> None:
    out = tmp_path / "run"
    tensorboard, wandb = TensorBoardSink(), WandbSink(mode="offline")
    runtime = build_runtime(tiny_config(out), hooks=[tensorboard, wandb], console=False)
    runtime.trainer.fit()
    first_id = wandb.run_id
    runtime.trainer.config.run.max_steps = 8
    runtime.trainer.fit()

    events = tensorboard_events(out / "tensorboard")
    assert [s.step for s in events.Scalars("train/loss")] == [2, 4, 6, 8]
    assert len(tensorboard_text(events, "summary")) == 2
    assert wandb.run_id != first_id  # each fit is a W&B run of its own
    runs = {run.run_id: run for run in finished_runs(out, count=2)}
    first, second = runs[first_id], runs[wandb.run_id]
    assert [r["trainer/step"] for r in first.history if "train/loss" in r] == [2, 4, 6]
    assert [r["trainer/step"] for r in second.history if "train/loss" in r] == [8]
    assert (first.exit_code, second.exit_code) == (0, 0)


def test_resume_id_continues_a_wandb_run(tmp_path: Path) -> None:
    def one_run(sink: WandbSink, steps: list[int]) -> None:
        config = {"run": {"name": "r", "output_dir": str(tmp_path)}}
        sink.on_event("train_start", {"step": steps[0] - 1, "config": config})
        for step in steps:
            sink.on_event("step", {"step": step, "loss": 1.0 / step})
        sink.close()

    first = WandbSink(mode="offline")
    one_run(first, [1, 2])
    again = WandbSink(mode="offline", resume_id=first.run_id)
    one_run(again, [3, 4])
    assert again.run_id == first.run_id
    runs = finished_runs(tmp_path, count=2)
    assert {run.run_id for run in runs} == {first.run_id}


@pytest.mark.parametrize(
    ("make", "path", "words"),
    [
        (lambda: WandbSink(mode="cloud"), "wandb.mode", "'online', 'offline', 'disabled'"),
        (lambda: WandbSink(projct="p"), "wandb.projct", "did you mean 'project'"),
        (lambda: WandbSink(tags="a,b"), "wandb.tags", "expected a list"),
        (lambda: WandbSink(enabled=True), "wandb.enabled", "always enabled"),
        (lambda: TensorBoardSink(flush_secs=0), "tensorboard.flush_secs", ">= 1"),
        (lambda: TensorBoardSink(logdir="x"), "tensorboard.logdir", "did you mean 'log_dir'"),
    ],
)
def test_sink_settings_are_checked_like_the_sections(make: Any, path: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        make()
    assert caught.value.path == path and words in str(caught.value)


@pytest.mark.parametrize(
    ("sink", "section"), [(WandbSink, WandbConfig), (TensorBoardSink, TensorBoardConfig)]
)
def test_sinks_take_the_settings_of_their_section(sink: type, section: type) -> None:
    # Every option of the section but `enabled` is a keyword of the sink, with its default.
    settings = {f.name: getattr(section(), f.name) for f in fields(section) if f.name != "enabled"}
    assert sink(**settings).settings == section(enabled=True)
    # The plugin builds its sinks from the sections through the same constructor.
    configured = build_section(section, {"enabled": True, **CUSTOM[section.__name__]}, "")
    assert sink.from_section(configured).settings == configured


@pytest.mark.parametrize(
    ("sink", "hidden_module", "extra"),
    [(WandbSink, "wandb", "wandb"), (TensorBoardSink, "torch.utils.tensorboard", "tensorboard")],
)
def test_building_a_sink_without_its_backend_names_the_extra(
    monkeypatch, sink: type, hidden_module: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, hidden_module, None)  # import now raises ImportError
    with pytest.raises(PluginError) as caught:
        sink()
    assert f"pip install 'speedtronic-logging[{extra}]'" in str(caught.value)
    assert sink.__name__ in str(caught.value)


def test_tflops_and_mfu_reach_tensorboard_as_every_step_field(tmp_path, tiny_config) -> None:
    out = tmp_path / "run"
    config = tiny_config(out).with_overrides({"run.peak_tflops": 0.001})
    train_from_config(config, hooks=[TensorBoardSink()], console=False)
    steps = [e for e in read_jsonl(out / "metrics.jsonl") if e["event"] == "step"]
    events = tensorboard_events(out / "tensorboard")
    for key in ("tflops", "mfu"):
        logged = [(s.step, s.value) for s in events.Scalars(f"train/{key}")]
        assert logged == [(e["step"], pytest.approx(e[key], rel=1e-6)) for e in steps]
    assert all(e["mfu"] == e["tflops"] / 0.001 for e in steps)
