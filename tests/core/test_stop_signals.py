"""Runs that survive preemption: a stop signal finishes the step, saves it, exits 128 + N.

Real ``speedtronic train`` processes, signalled once their JSONL metrics show a given step;
every wait is a bounded poll on a condition.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from core.plugin_fixtures import plugin_env, run_python
from core.toy_runs import TINY_TRANSFORMER, tiny_transformer_run, train
from core.toy_runs import metric_events as events

from speedtronic.checkpoint import CheckpointManager, checkpoint_name, step_of

pytestmark = pytest.mark.slow

# Far more steps than a test waits for: a run is always signalled before it could finish.
ENDLESS = 100_000


def run_config(output_dir: Path, **sections: Any) -> dict[str, Any]:
    # A constant schedule: the losses of a step do not depend on run.max_steps, so a run
    # stopped on its way to ENDLESS and a short straight run can be compared step by step.
    config = tiny_transformer_run(
        output_dir,
        run={"max_steps": ENDLESS, "threads": 1},
        scheduler={"name": "constant", "warmup_steps": 0},
        checkpoint={"interval": 0, "keep_last": 2},
    )
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    return config


def launch(
    config: dict[str, Any], workdir: Path, name: str, *args: str
) -> tuple[subprocess.Popen[bytes], Path]:
    """``speedtronic train`` of ``config`` in the background; its JSONL metrics path."""
    config_file = workdir / f"{name}.yaml"
    config_file.write_text(yaml.safe_dump(config))
    jsonl = workdir / f"{name}.jsonl"
    command = [sys.executable, "-m", "speedtronic", "train", "--config", str(config_file)]
    command += [*args, "--set", f"logging.json_file={jsonl}"]
    out = open(jsonl.with_suffix(".out"), "wb")  # noqa: SIM115 - closed when the child ends
    try:
        env = plugin_env(load="reference_transformer", OMP_NUM_THREADS="1")
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env), jsonl
    finally:
        out.close()


def output(jsonl: Path) -> str:
    return jsonl.with_suffix(".out").read_text(errors="replace")


def pointed_step(checkpoints: Path) -> int:
    """The step ``latest.json`` names, -1 while there is none (replaced atomically)."""
    target = CheckpointManager(checkpoints).pointer_target()
    return -1 if target is None else step_of(target.name) or -1


def losses(jsonl: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events(jsonl, "step")}


def wait_for(
    condition: Callable[[], bool],
    process: subprocess.Popen[bytes],
    jsonl: Path,
    timeout: float = 180.0,
    poll: float = 0.01,
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"exited with {process.returncode} early:\n{output(jsonl)[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"condition not met within {timeout} s:\n{output(jsonl)[-3000:]}")
        time.sleep(poll)


def finish(process: subprocess.Popen[bytes], jsonl: Path, timeout: float = 300.0) -> int:
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"did not exit within {timeout} s:\n{output(jsonl)[-3000:]}")


def resumes_from(config: dict[str, Any], step: int) -> int | None:
    """Resume ``config`` in this process for two more steps; the step it resumed from."""
    resumed = {**config, "run": {**config["run"], "max_steps": step + 2}}
    result, _, _ = train({**resumed, "checkpoint": {**config["checkpoint"], "resume": True}})
    assert result.steps == step + 2
    return result.resumed_from


def last_step(jsonl: Path) -> int:
    return max((e["step"] for e in events(jsonl, "step")), default=0)


@pytest.mark.parametrize(
    ("sig", "async_save"), [(signal.SIGTERM, False), (signal.SIGINT, True)], ids=["TERM", "INT"]
)
def test_a_stop_signal_saves_the_last_step_exits_128_plus_n_and_resumes_exactly(
    tmp_path: Path, sig: signal.Signals, async_save: bool
) -> None:
    directory = tmp_path / "run"
    config = run_config(directory, checkpoint={"interval": 3, "async_save": async_save})
    process, first = launch(config, tmp_path, "first")
    wait_for(lambda: last_step(first) >= 5, process, first)
    process.send_signal(sig)
    assert finish(process, first) == 128 + sig, output(first)[-3000:]

    stopped = events(first, "stopped")
    assert len(stopped) == 1
    step = stopped[0]["step"]
    path = directory / "checkpoints" / checkpoint_name(step)
    stopped[0].pop("time")
    assert stopped[0] == {"event": "stopped", "signal": sig.name, "step": step, "path": str(path)}
    assert last_step(first) == step  # the step in progress was finished, and no other
    assert CheckpointManager(directory / "checkpoints").load_latest().step == step
    line = f"stopped by {sig.name} at step {step}; checkpoint saved to {path}; resume with --resume"
    assert output(first).count(line) == 1, output(first)[-3000:]
    assert events(first, "train_end")[0]["status"] == "stopped"

    target = step + 4
    process, resumed = launch(config, tmp_path, "resumed", "--resume", "--max-steps", str(target))
    assert finish(process, resumed) == 0, output(resumed)[-3000:]
    assert events(resumed, "resumed")[0]["step"] == step
    straight = run_config(tmp_path / "straight", run={"max_steps": target})
    _, recorder, _ = train(straight)
    # Bitwise: the same arithmetic in the same order, with the generators restored exactly.
    assert {**losses(first), **losses(resumed)} == recorder.losses
    assert set(recorder.losses) == set(range(1, target + 1))


def test_a_second_signal_aborts_at_once() -> None:
    code = """
import os, signal, sys
from speedtronic.parallel import SINGLE_PROCESS
from speedtronic.engine.stopping import StopRequest, StopSignals
request = StopRequest()
with StopSignals(["SIGTERM"], request):
    os.kill(os.getpid(), signal.SIGTERM)
    assert request.agree(SINGLE_PROCESS) and request.signal == signal.SIGTERM
    print("asked", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    print("still alive", flush=True)
"""
    result = run_python(code, env=plugin_env(load=""))
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert result.stdout == "asked\n"


def test_two_signals_in_a_row_leave_a_usable_checkpoint(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    config = run_config(directory, checkpoint={"interval": 2})
    process, first = launch(config, tmp_path, "first")
    # Signal once latest.json names step 4 or later: a step's metrics line comes before its
    # save, so a second signal arriving in the middle of step 4's save leaves step 2.
    wait_for(lambda: pointed_step(directory / "checkpoints") >= 4, process, first)
    os.kill(process.pid, signal.SIGTERM)
    os.kill(process.pid, signal.SIGTERM)
    # Two signals that arrive before the first is handled count once (POSIX merges them):
    # then the run stops cleanly; otherwise the second one kills it wherever it is.
    assert finish(process, first) in (128 + signal.SIGTERM, -signal.SIGTERM)
    latest = CheckpointManager(directory / "checkpoints").load_latest()
    assert latest is not None and latest.step >= 4
    assert resumes_from(config, latest.step) == latest.step


def test_sigkill_during_a_background_write_leaves_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "run"
    # Big enough that a background write lasts long enough to be caught in the act.
    model = {**TINY_TRANSFORMER, "vocab_size": 8192, "d_model": 128, "max_seq_len": 16}
    config = run_config(directory, model=model, checkpoint={"interval": 2, "async_save": True})
    process, first = launch(config, tmp_path, "first")
    checkpoints = directory / "checkpoints"

    def writing() -> bool:
        # A staging directory while an earlier checkpoint is complete: a write in progress.
        staging = checkpoints.is_dir() and any(checkpoints.glob(".step_*.tmp"))
        return staging and (checkpoints / "latest.json").exists()

    wait_for(writing, process, first, poll=0.0005)
    process.send_signal(signal.SIGKILL)
    assert finish(process, first) == -signal.SIGKILL
    latest = CheckpointManager(checkpoints).load_latest()
    assert latest is not None and latest.step >= 2
    assert resumes_from(config, latest.step) == latest.step
