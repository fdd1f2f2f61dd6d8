"""``checkpoint.async_save`` under ``parallel.strategy: fsdp`` with 2 real torchrun ranks
(gloo, CPU): a run chained through background sharded saves follows a straight synchronous
run's losses, and a SIGKILL while a background write is in flight (every rank's shards written,
nothing committed, training gone on past the save step) leaves the previous checkpoint as the
latest one, from which the run resumes onto the same losses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from core.toy_runs import metric_events
from rank_runs import WAIT, probe_environment, train_command, train_ok
from test_fsdp_ranks import assert_close, curve, records, write_config

from speedtronic.checkpoint import CheckpointManager

pytestmark = pytest.mark.slow

PLUGIN = "fsdp_async_probe"
PROBE = """
import json
import os
import signal
import time
from pathlib import Path

from speedtronic import hookimpl

OUT = Path(os.environ["PROBE_DIR"])


@hookimpl
def on_train_start(trainer):
    kill_at = os.environ.get("PROBE_KILL_IN_BACKGROUND")
    if kill_at is None or trainer.parallel.rank != 0:
        return
    import speedtronic.checkpoint.dcp as dcp

    finish = dcp._finish

    def killing_finish(manager, staging, final, step, encoded):
        if step == int(kill_at):
            # Every rank's shards are in the staging directory, nothing is committed; wait
            # until training has gone on past the save step: the write is off the step.
            deadline = time.monotonic() + 120
            while trainer.step <= step and time.monotonic() < deadline:
                time.sleep(0.01)
            record = {"staging": str(staging), "trainer_step": trainer.step}
            (OUT / "killed.json").write_text(json.dumps(record))
            os.kill(os.getpid(), signal.SIGKILL)
        return finish(manager, staging, final, step, encoded)

    dcp._finish = killing_finish
"""

ASYNC = ("--set", "checkpoint.async_save=true")


def environment(directory: Path, **probe: str) -> dict[str, str]:
    return probe_environment(directory, PLUGIN, PROBE, **probe)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The losses of a straight 6-step run of 2 FSDP ranks with synchronous saves."""
    directory = tmp_path_factory.mktemp("straight")
    train_ok(write_config(directory), 2, PLUGIN, environment(directory))
    return curve(directory)


def test_background_sharded_saves_resume_like_sync_ones(
    straight: dict[int, float], tmp_path: Path
) -> None:
    config, env = write_config(tmp_path), environment(tmp_path)
    train_ok(config, 2, PLUGIN, env, *ASYNC, "--max-steps", "4")
    checkpoints = tmp_path / "run" / "checkpoints"
    assert CheckpointManager(checkpoints).load_latest(weights=False).step == 4
    train_ok(config, 2, PLUGIN, env, *ASYNC, "--resume")
    assert [r["step"] for r in records(tmp_path, "resumed")] == [4]
    assert_close(curve(tmp_path), straight, 1e-6)
    latest = CheckpointManager(checkpoints).load_latest(weights=False)
    assert latest.step == 6 and (latest.path / "dcp" / "__1_0.distcp").is_file()


def test_sigkill_during_a_background_sharded_write_keeps_the_previous_checkpoint(
    straight: dict[int, float], tmp_path: Path
) -> None:
    config = write_config(tmp_path)
    process = subprocess.Popen(
        train_command(config, 2, PLUGIN, *ASYNC),
        env=environment(tmp_path, PROBE_KILL_IN_BACKGROUND="4"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = process.communicate(timeout=WAIT)  # the surviving rank must not hang
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode != 0
    assert "a rank failed" in stderr, stderr[-3000:]
    killed = json.loads((tmp_path / "killed.json").read_text())
    assert killed["trainer_step"] > 4  # training went on while step 4 was being written
    staging = Path(killed["staging"])
    assert staging.name.startswith(".step_00000004.") and (staging / "dcp").is_dir()
    checkpoints = tmp_path / "run" / "checkpoints"
    assert CheckpointManager(checkpoints).load_latest().step == 2
    assert [p.name for p in CheckpointManager(checkpoints).candidates()] == ["step_00000002"]
    train_ok(config, 2, PLUGIN, environment(tmp_path), *ASYNC, "--resume")
    assert CheckpointManager(checkpoints).load_latest().step == 6
    assert not staging.exists()  # the next save cleared the interrupted one away
    # The killed leg may have torn its last metrics line: read the complete ones.
    steps = metric_events(tmp_path / "run" / "metrics.jsonl", "step")
    resumed = {r["step"]: r["loss"] for r in steps if r["step"] > 2}  # the resumed leg's last
    assert_close(resumed, {step: straight[step] for step in resumed}, 1e-6)
