"""Preemption of real runs launched as a user would: ``--nproc-per-node 2`` signalled through its
launcher, and a DumbDiLoCo worker signalled in the middle of its inner loop.

Every wait is a bounded poll on a file the processes write.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from diloco_nodes import Node, kill_all, wait_until, with_plugin
from test_ddp import WAIT, command, environment, write_config
from test_diloco_resume_e2e import INNER, STEP_SLEEP, assert_deltas_add_up, finish_resumed
from test_diloco_resume_e2e import config as diloco_config

from speedtronic.checkpoint import CheckpointManager

pytestmark = pytest.mark.slow

# Loaded by both ranks: each writes the steps it finished and the step it ended at.
RANK_PROBE = """
import json
import os
from pathlib import Path

from speedtronic import hookimpl

OUT = Path(os.environ["PROBE_DIR"])


@hookimpl
def after_optimizer_step(trainer, step):
    with open(OUT / f"steps_rank{trainer.parallel.rank}", "a") as handle:
        handle.write(f"{step}\\n")


@hookimpl
def on_train_end(trainer, error):
    end = {"step": trainer.step, "error": None if error is None else repr(error)}
    (OUT / f"end_rank{trainer.parallel.rank}.json").write_text(json.dumps(end))
"""


def steps_of(directory: Path, rank: int) -> int:
    path = directory / f"steps_rank{rank}"
    return len(path.read_text().splitlines()) if path.exists() else 0


def events(path: Path, kind: str) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["event"] == kind]


def test_a_signal_to_the_launcher_stops_both_ranks_at_one_step_and_resumes_on_two(
    tmp_path: Path,
) -> None:
    config = write_config(
        tmp_path,
        run={"max_steps": 100_000},
        checkpoint={"interval": 0},
        scheduler={"name": "constant"},
    )
    env = environment(tmp_path)
    (tmp_path / "rank_probe.py").write_text(RANK_PROBE)
    out = open(tmp_path / "launcher.out", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        command(config, 2, "--plugin", "rank_probe"),
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    out.close()

    def log() -> str:
        return (tmp_path / "launcher.out").read_text(errors="replace")[-4000:]

    try:
        deadline = time.monotonic() + WAIT
        while min(steps_of(tmp_path, 0), steps_of(tmp_path, 1)) < 3:
            assert process.poll() is None, log()
            assert time.monotonic() < deadline, "the ranks made no progress\n" + log()
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)  # the launcher alone, as a scheduler would
        assert process.wait(timeout=WAIT) == 128 + signal.SIGTERM, log()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    ends = [json.loads((tmp_path / f"end_rank{r}.json").read_text()) for r in (0, 1)]
    step = ends[0]["step"]
    assert ends == [{"step": step, "error": None}] * 2  # one stop step, no error on a rank
    assert steps_of(tmp_path, 0) == steps_of(tmp_path, 1) == step
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert [e["step"] for e in events(metrics, "stopped")] == [step]
    saved = CheckpointManager(tmp_path / "run" / "checkpoints").load_latest()
    assert saved.step == step and len(saved.state["rng_per_rank"]) == 2

    resumed = subprocess.run(
        command(config, 2, "--resume", "--max-steps", str(step + 2)),
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    assert [e["step"] for e in events(metrics, "resumed")] == [step]
    assert events(metrics, "train_end")[-1]["steps"] == step + 2


def test_a_diloco_worker_stopped_mid_inner_loop_resumes_without_sending_a_delta_twice(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, diloco_config(tmp_path), "worker", "w")
    node.extra_args += ["--set", "logging.log_every=1"]
    with_plugin(node, DILOCO_E2E_STEP_SLEEP=STEP_SLEEP)
    node.start()
    try:
        # Signalled just after a boundary: the stop lands inside the next inner loop.
        wait_until(
            lambda: any(
                e["step"] > 2 * INNER and e["step"] % INNER == 1 for e in node.events("step")
            ),
            [node],
            "a step just past the second boundary",
            poll=0.01,
        )
        node.signal(signal.SIGTERM)
        assert node.wait() == 128 + signal.SIGTERM, node.tail()
        stopped = node.events("stopped")
        assert len(stopped) == 1 and stopped[0]["step"] % INNER != 0, stopped
        latest = CheckpointManager(node.output / "checkpoints").load_latest()
        assert latest.step == stopped[0]["step"]
        finish_resumed(node)
    finally:
        kill_all([node])
    assert node.events("resumed")[0]["step"] == stopped[0]["step"]
    assert_deltas_add_up(tmp_path, node)  # every delta once: none twice, none lost
