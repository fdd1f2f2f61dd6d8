"""The profiler window: ``speedtronic train --profile START:END`` and the ``profile`` section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from core.toy_runs import tiny_transformer_run, train

from speedtronic import ConfigError, SpeedtronicConfig
from speedtronic.cli import main


def test_profile_3_5_writes_a_trace_of_those_steps_with_operator_events(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tiny_transformer_run(
        tmp_path / "run", run={"max_steps": 7, "threads": 1}, checkpoint={"interval": 0}
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", "-c", str(path), "--profile", "3:5"]) == 0
    trace = tmp_path / "run" / "profile" / "trace_rank0_step3-5.json"
    events = json.loads(trace.read_text())["traceEvents"]
    operators = {e["name"] for e in events if e.get("ph") == "X" and "name" in e}
    assert "aten::mm" in operators and "aten::embedding" in operators
    # Three optimizer steps in the window, none outside it.
    steps = [e for e in events if str(e.get("name", "")).startswith("Optimizer.step#")]
    assert len(steps) == 3
    printed = capsys.readouterr()
    top = printed.err.split("top 10 operators by self time:", 1)[1]
    assert "Self CPU" in top and "aten::" in top
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r for r in records if r["event"] == "profile"] == [
        {**next(r for r in records if r["event"] == "profile"), "step": 5, "path": str(trace)}
    ]
    assert "profile step=5" in printed.out


def test_the_profile_section_profiles_without_the_flag(tmp_path: Path) -> None:
    config = tiny_transformer_run(
        tmp_path, run={"max_steps": 2}, profile={"start": 2, "record_shapes": True}
    )
    _, recorder, _ = train(config)
    (profile,) = recorder.named("profile")
    assert profile["step"] == 2 and profile["path"].endswith("trace_rank0_step2-2.json")
    events = json.loads(Path(profile["path"]).read_text())["traceEvents"]
    assert any("Input Dims" in e.get("args", {}) for e in events)  # record_shapes


def test_no_trace_without_a_window(tmp_path: Path) -> None:
    _, recorder, _ = train(tiny_transformer_run(tmp_path, run={"max_steps": 2}))
    assert recorder.named("profile") == [] and not (tmp_path / "profile").exists()


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"start": 5, "end": 3}, "profile.end: must be >= start (5), got 3"),
        ({"end": 3}, "profile.end: is set but profile.start is not"),
        ({"start": 0}, "profile.start"),
    ],
)
def test_a_bad_window_is_one_config_error(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeedtronicConfig.from_dict({"profile": section})


@pytest.mark.parametrize("window", ["5:3", "a:b", "0:2"])
def test_a_bad_profile_flag_is_refused(
    window: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_transformer_run(tmp_path)))
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "-c", str(path), "--profile", window])
    assert exit_info.value.code == 2
    assert "argument --profile: expected" in capsys.readouterr().err
