"""`speedtronic train --resume` as a real subprocess: SIGKILL at random moments, then resume.

The resumed chain must reproduce the per-step losses of an uninterrupted run, which proves both
that every kill left a loadable checkpoint and that resuming is exact.
"""

from __future__ import annotations

import itertools
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from core.plugin_fixtures import plugin_env, run_cli
from core.toy_runs import metric_events as events
from core.toy_runs import tiny_transformer_run, train

MAX_STEPS = 24
TOL = 1e-6
pytestmark = pytest.mark.slow


def run_config(output_dir: Path) -> dict[str, Any]:
    return tiny_transformer_run(
        output_dir, run={"max_steps": MAX_STEPS}, checkpoint={"interval": 1, "keep_last": 2}
    )


def child_env() -> dict[str, str]:
    """The CLI children load only the reference model and, like this process, train on one
    intra-op thread whatever the suite was started with: their losses must match the
    in-process straight run within TOL."""
    return plugin_env(load="reference_transformer", OMP_NUM_THREADS="1")


def straight_losses(tmp_path: Path) -> dict[int, float]:
    config = run_config(tmp_path / "straight")
    config["checkpoint"]["interval"] = 0
    _, recorder, _ = train(config)
    assert set(recorder.losses) == set(range(1, MAX_STEPS + 1))
    return recorder.losses


def launch(config_file: Path, jsonl: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "speedtronic",
        "train",
        "--config",
        str(config_file),
        "--resume",
        "--set",
        f"logging.json_file={jsonl}",
    ]
    log = open(jsonl.with_suffix(".out"), "wb")  # noqa: SIM115 - closed when the child ends
    try:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=child_env())
    finally:
        log.close()


def last_step(jsonl: Path) -> int:
    return max((e["step"] for e in events(jsonl) if e["event"] == "step"), default=0)


def wait_until(
    condition: Callable[[], bool], process: subprocess.Popen[bytes], timeout: float = 60.0
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            output = Path(process.args[-1].split("=", 1)[1]).with_suffix(".out")  # type: ignore[index]
            pytest.fail(
                f"training exited with {process.returncode} early:\n"
                f"{output.read_text(errors='replace')[-3000:]}"
            )
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("training made no progress within the timeout")
        time.sleep(0.005)


def test_sigkill_at_random_moments_then_resume_reproduces_the_straight_run(
    tmp_path: Path,
) -> None:
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(run_config(tmp_path / "run")))
    expected = straight_losses(tmp_path)
    rng = random.Random(20240611)
    segments: list[Path] = []
    target = 0
    for index in range(4):
        target += rng.randint(2, 4)  # at most 16 of 24: the kill always lands mid-run
        jsonl = tmp_path / f"segment{index}.jsonl"
        segments.append(jsonl)
        process = launch(config_file, jsonl)
        wait_until(lambda j=jsonl, t=target: last_step(j) >= t, process)
        # Where inside the step or the checkpoint write the kill lands is left to chance.
        time.sleep(rng.uniform(0.0, 0.02))
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=30) == -signal.SIGKILL
    final = tmp_path / "final.jsonl"
    segments.append(final)
    process = launch(config_file, final)
    assert process.wait(timeout=120) == 0, final.with_suffix(".out").read_text()

    seen: set[int] = set()
    for previous, current in itertools.pairwise(segments):
        logged = last_step(previous)
        start = next(e for e in events(current) if e["event"] == "train_start")["start_step"]
        # With interval 1, step s is logged only after checkpoint s-1 is durable, and the
        # checkpoint of step s is written only after step s is logged.
        assert logged - 1 <= start <= logged, (previous.name, logged, start)
        resumed = [e["step"] for e in events(current) if e["event"] == "resumed"]
        assert resumed == ([start] if start else [])
    for jsonl in segments:
        for record in events(jsonl):
            if record["event"] == "step":
                step = record["step"]
                seen.add(step)
                assert abs(record["loss"] - expected[step]) <= TOL, (jsonl.name, step)
    assert seen == set(range(1, MAX_STEPS + 1))
    end = [e for e in events(final) if e["event"] == "train_end"]
    assert end and end[0]["status"] == "ok" and end[0]["steps"] == MAX_STEPS

    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "latest.json",
        f"step_{MAX_STEPS - 1:08d}",
        f"step_{MAX_STEPS:08d}",
    ]


def test_cli_finished_run_and_unusable_checkpoints(tmp_path: Path) -> None:
    config = run_config(tmp_path / "run")
    config["run"]["max_steps"] = 3
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(config))
    train(config)

    resume = ("train", "--config", str(config_file), "--resume")
    finished = run_cli(*resume, env=child_env(), timeout=120)
    assert finished.returncode == 0, finished.stderr
    assert "already finished" in finished.stdout + finished.stderr

    for path in (tmp_path / "run" / "checkpoints").glob("step_*"):
        (path / "tensors.safetensors").write_bytes(b"\x00" * 16)
    broken = run_cli(*resume, env=child_env(), timeout=120)
    assert broken.returncode == 2
    assert "Traceback" not in broken.stderr
    last = broken.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no usable checkpoint") and "allow_fresh_start" in last
    assert "step_00000003" in broken.stderr  # the warning names the skipped checkpoint
