"""Metric events: what a run logs, at which cadence, and the stdout/file/JSONL/hook sinks."""

from __future__ import annotations

import io
import json
import logging
from typing import Any

import pytest
import torch
from core.toy_runs import Bigram, toy_trainer

from speedtronic import SpeedtronicConfig, hookimpl, plugins
from speedtronic.engine.trainer import Trainer
from speedtronic.observe.metrics import (
    ConsoleSink,
    JsonlSink,
    MetricLogger,
    TextFileSink,
    process_memory_mb,
)

STEP_KEYS = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "steps_per_sec",
    "samples_per_sec",
    "tokens_per_sec",
    "memory_mb",
}


class Exploding(Bigram):
    """Raises on its ``fail_at``-th forward call."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.calls = 0

    def forward(self, input_ids, labels):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("model exploded")
        return super().forward(input_ids, labels)


def run(tmp_path, hooks=(), model=None, **logging_section: Any) -> Trainer:
    config = SpeedtronicConfig.from_dict(
        {
            "run": {"device": "cpu", "max_steps": 7, "output_dir": str(tmp_path)},
            "data": {"micro_batch_size": 2, "target_batch_size": 4},
            "precision": {"mode": "fp32"},
            "checkpoint": {"save_final": False},
            "logging": {"log_every": 3, **logging_section},
        }
    )
    trainer = toy_trainer(model or Bigram(), config, hooks)
    trainer.fit()
    return trainer


def test_a_run_logs_every_metric_at_the_log_cadence(tmp_path):
    events: list[tuple[str, dict]] = []
    run(tmp_path, hooks=[lambda event, payload: events.append((event, dict(payload)))])
    names = [event for event, _ in events]
    assert names[0] == "train_start" and names[-1] == "train_end"
    steps = [payload for event, payload in events if event == "step"]
    assert [s["step"] for s in steps] == [3, 6, 7]  # every 3 steps, and the last one
    for payload in steps:
        assert set(payload) >= STEP_KEYS
        assert all(isinstance(payload[key], float) for key in STEP_KEYS - {"step"})
        assert payload["samples_per_sec"] == pytest.approx(4 * payload["steps_per_sec"])
        assert payload["tokens_per_sec"] == pytest.approx(8 * payload["samples_per_sec"])
        assert payload["memory_mb"] > 0
    assert steps[-1]["samples"] == 28 and steps[-1]["tokens"] == 28 * 8
    start = events[0][1]
    assert start["accumulation_steps"] == 2 and start["precision"] == "fp32"


def test_cpu_memory_is_the_process_resident_set():
    with open("/proc/self/status") as status:
        rss_kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))
    assert process_memory_mb(torch.device("cpu")) == pytest.approx(rss_kb / 1024, rel=0.2)


def test_file_and_jsonl_sinks_receive_every_event(tmp_path):
    text, jsonl = tmp_path / "logs" / "metrics.log", tmp_path / "logs" / "metrics.jsonl"
    run(tmp_path, hooks=[TextFileSink(text), JsonlSink(jsonl)])
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["event"] for r in records] == ["train_start", "step", "step", "step", "train_end"]
    assert [r["step"] for r in records if r["event"] == "step"] == [3, 6, 7]
    assert all(set(r) >= STEP_KEYS for r in records if r["event"] == "step")
    lines = text.read_text().splitlines()
    assert len(lines) == 5 and " step step=3 loss=" in lines[1]


def test_jsonl_lines_stay_strict_json_for_non_finite_values(tmp_path):
    sink = JsonlSink(tmp_path / "m.jsonl")
    sink.on_event("step", {"step": 1, "loss": float("nan"), "grad_norm": float("inf")})
    sink.close()

    def reject(constant):
        raise ValueError(constant)

    record = json.loads((tmp_path / "m.jsonl").read_text(), parse_constant=reject)
    assert record["loss"] is None and record["grad_norm"] is None and record["step"] == 1


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_prints_plain_lines_when_not_a_terminal():
    stream = io.StringIO()
    sink = ConsoleSink(10, stream=stream)
    sink.on_event("step", {"step": 5, "loss": 1.23456, "config": {"nested": 1}})
    assert stream.getvalue() == "step step=5 loss=1.235\n"


def test_console_shows_a_progress_bar_with_eta_on_a_terminal():
    stream = TTY()
    sink = ConsoleSink(10, stream=stream)
    sink.on_event("train_start", {"step": 0, "start_step": 0, "max_steps": 10})
    for step in range(1, 11):
        sink.on_event("step", {"step": step, "loss": 1.0 / step, "tokens_per_sec": 1234.0})
    sink.on_event("train_end", {"steps": 10})
    output = stream.getvalue()
    assert "10/10" in output and "eta" in output and "steps/s" in output
    assert "loss 0.1000" in output and "tok/s 1,234" in output  # the live line
    assert "step step=" not in output  # steps drive the bar instead of printing lines
    assert "train_end steps=10" in output


def test_the_bar_moves_every_optimizer_step_between_logged_steps(tmp_path):
    """With log_every 50, a step event arrives only at step 50; the bar still sees every step."""
    seen: list[int] = []

    class ProgressProbe:
        def on_event(self, event, payload):
            pass

        def on_progress(self, step):
            seen.append(step)

    config = SpeedtronicConfig.from_dict(
        {
            "run": {"device": "cpu", "max_steps": 12, "output_dir": str(tmp_path)},
            "data": {"micro_batch_size": 2},
            "checkpoint": {"save_final": False},
            "logging": {"log_every": 50},
        }
    )
    toy_trainer(Bigram(), config, [ProgressProbe()]).fit()
    assert seen == list(range(1, 13))


def test_hooks_may_be_callables_or_objects_and_a_failing_sink_is_isolated(caplog):
    calls: list[str] = []

    class Obj:
        def on_event(self, event, payload):
            calls.append(f"obj:{event}")

    def broken(event, payload):
        raise OSError("disk full")

    # `hooks=` is the documented keyword name (public contract).
    logger = MetricLogger(hooks=[broken, lambda e, p: calls.append(f"fn:{e}"), Obj()])
    with caplog.at_level(logging.WARNING, logger="speedtronic.metrics"):
        logger.emit("a", {})
        logger.emit("b", {})
    assert calls == ["fn:a", "obj:a", "fn:b", "obj:b"]
    warnings = [r for r in caplog.records if "disk full" in r.getMessage()]
    assert len(warnings) == 1
    with pytest.raises(TypeError):
        MetricLogger([42])


def test_sinks_are_closed_at_the_end_also_on_error(tmp_path):
    closed: list[str] = []

    class Closing:
        def __init__(self, name):
            self.name = name

        def on_event(self, event, payload):
            pass

        def close(self):
            closed.append(self.name)

    jsonl = tmp_path / "m.jsonl"
    json_sink = JsonlSink(jsonl)
    run(tmp_path, hooks=[Closing("ok"), json_sink])
    assert closed == ["ok"] and json_sink._handle is None
    with pytest.raises(RuntimeError, match="model exploded"):
        run(tmp_path, hooks=[Closing("failed"), json_sink], model=Exploding(fail_at=5))
    assert closed == ["ok", "failed"] and json_sink._handle is None
    last = json.loads(jsonl.read_text().splitlines()[-1])
    assert last["event"] == "train_end" and last["status"] == "error: RuntimeError"


def test_plugins_get_every_event_and_one_failing_plugin_does_not_starve_another(tmp_path):
    class Good:
        def __init__(self):
            self.events: list[str] = []

        @hookimpl
        def on_metric(self, event, payload):
            self.events.append(event)

    class Bad:
        @hookimpl
        def on_metric(self, event):
            raise RuntimeError("plugin bug")

    good = Good()
    names = [
        plugins.register(Bad(), name="test-metrics-bad"),
        plugins.register(good, name="test-metrics-good"),
    ]
    try:
        seen: list[str] = []
        run(tmp_path, hooks=[lambda event, payload: seen.append(event)])
    finally:
        for name in names:
            plugins.unregister(name)
    assert good.events == seen and "step" in seen
