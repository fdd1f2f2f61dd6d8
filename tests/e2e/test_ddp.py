"""Data parallel inside a node, as real torchrun processes on the CPU (gloo).

Each test starts the ranks through ``speedtronic train --nproc-per-node 2`` (torch's elastic
launcher) and reads back what rank 0 wrote (the JSONL metric file, checkpoints). Waits are
bounded polls on files the processes write, never assumptions about speed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from rank_runs import WAIT, probe_environment, train_command, train_ok

pytestmark = pytest.mark.slow


# Loaded by every rank with --plugin: counts DDP's gradient all-reduces per optimizer step,
# and can stop or kill a rank at a chosen step (set through environment variables).
PROBE = """
import json
import os
import signal
import time
from pathlib import Path

from speedtronic import hookimpl

OUT = Path(os.environ["PROBE_DIR"])
_calls = {"reduce": 0}


@hookimpl
def on_train_start(trainer):
    if trainer.ddp is None or os.environ.get("PROBE_COUNT") != "1":
        return

    def counting(state, bucket):
        _calls["reduce"] += 1
        import torch.distributed as dist

        tensor = bucket.buffer()
        tensor.div_(dist.get_world_size())
        work = dist.all_reduce(tensor, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    trainer.ddp.register_comm_hook(None, counting)


@hookimpl
def after_optimizer_step(trainer, step):
    rank = trainer.parallel.rank
    if os.environ.get("PROBE_COUNT") == "1":
        with open(OUT / f"reduces_rank{rank}.jsonl", "a") as handle:
            handle.write(json.dumps({"step": step, "reduces": _calls["reduce"]}) + "\\n")
        _calls["reduce"] = 0
    if str(step) == os.environ.get("PROBE_KILL_AT") and rank == 1:
        (OUT / "killed").write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    if str(step) == os.environ.get("PROBE_HOLD_AT"):
        (OUT / f"holding_rank{rank}").write_text(str(os.getpid()))
        deadline = time.monotonic() + float(os.environ.get("PROBE_HOLD_S", "240"))
        while time.monotonic() < deadline:  # until the test kills us
            time.sleep(0.05)
"""


def write_config(directory: Path, **overrides: Any) -> Path:
    config: dict[str, Any] = {
        "run": {"device": "cpu", "max_steps": 8, "seed": 3, "output_dir": str(directory / "run")},
        "model": {
            "name": "reference_transformer",
            "vocab_size": 260,
            "max_seq_len": 16,
            "n_layer": 1,
            "n_head": 2,
            "d_model": 32,
        },
        "data": {"micro_batch_size": 4, "target_batch_size": 8},
        "optimizer": {"lr": 3e-3},
        "precision": {"mode": "fp32"},
        "checkpoint": {"interval": 4},
        "logging": {
            "log_every": 1,
            "progress": False,
            "json_file": str(directory / "run" / "metrics.jsonl"),
        },
    }
    for section, values in overrides.items():
        config.setdefault(section, {}).update(values)
    path = directory / "config.json"
    path.write_text(json.dumps(config))
    return path


def environment(directory: Path, **probe: str) -> dict[str, str]:
    return probe_environment(directory, "ddp_probe", PROBE, **probe)


def command(config: Path, nproc: int | None, *extra: str) -> list[str]:
    return train_command(config, nproc, "ddp_probe", *extra)


def run(config: Path, nproc: int | None, env: dict[str, str], *extra: str) -> None:
    train_ok(config, nproc, "ddp_probe", env, *extra)


def losses(directory: Path) -> dict[int, float]:
    lines = (directory / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {r["step"]: r["loss"] for r in records if r["event"] == "step"}


def assert_same_curve(a: dict[int, float], b: dict[int, float]) -> None:
    assert set(a) == set(b) and a
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5, (step, a[step], b[step])


def test_two_ranks_of_micro_4_follow_one_process_of_micro_8(tmp_path: Path) -> None:
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    for directory in (single, ddp):
        directory.mkdir()
    run(
        write_config(single, data={"micro_batch_size": 8, "target_batch_size": 8}),
        None,
        environment(single),
    )
    run(write_config(ddp), 2, environment(ddp))
    assert_same_curve(losses(single), losses(ddp))
    # Rank 0 alone wrote the metrics: one step line per step, global sample counts.
    records = [json.loads(x) for x in (ddp / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 9)) and steps[-1]["samples"] == 64


def test_token_shards_split_over_ranks_follow_one_process(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"document {i}: " + "abcdefgh " * (5 + i) for i in range(60)))
    shards = tmp_path / "shards"
    prepared = subprocess.run(
        [
            *(sys.executable, "-m", "speedtronic", "data", "prepare", str(corpus)),
            *("--out", str(shards), "--blank-line-documents", "--workers", "1", "--no-progress"),
        ],
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert prepared.returncode == 0, prepared.stderr
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    for directory in (single, ddp):
        directory.mkdir()
    data = {"shards": str(shards)}
    run(
        write_config(single, data={**data, "micro_batch_size": 8, "target_batch_size": 8}),
        None,
        environment(single),
    )
    run(write_config(ddp, data=data), 2, environment(ddp))
    assert_same_curve(losses(single), losses(ddp))


def eval_events(directory: Path) -> list[dict[str, Any]]:
    lines = (directory / "run" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == "eval"]


def test_an_evaluation_scores_the_same_windows_with_one_and_two_ranks(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox {i * 7 % 13}\n" for i in range(600)))
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    for directory in (single, ddp):
        directory.mkdir()
    # 3 micro-batches of 4 windows: 12, split 6 and 6 between two ranks (4 + 2 each).
    options = {
        "data": {"text_path": str(corpus)},
        "eval": {"holdout_fraction": 0.2, "batches": 3, "micro_batch_size": 4, "every": 4},
    }
    run(
        write_config(single, **{**options, "data": {**options["data"], "micro_batch_size": 8}}),
        None,
        environment(single),
    )
    run(write_config(ddp, **options), 2, environment(ddp))
    one, two = eval_events(single), eval_events(ddp)
    assert [e["step"] for e in one] == [e["step"] for e in two] == [4, 8]
    for a, b in zip(one, two):
        assert a["tokens"] == b["tokens"] == 12 * 16
        assert a["windows"] == b["windows"] == 12 and a["of_windows"] == b["of_windows"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a, b)


def test_accumulation_all_reduces_once_per_optimizer_step(tmp_path: Path) -> None:
    config = write_config(
        tmp_path, data={"micro_batch_size": 2, "target_batch_size": 16}, run={"max_steps": 3}
    )
    run(config, 2, environment(tmp_path, PROBE_COUNT="1"))
    for rank in (0, 1):
        lines = (tmp_path / f"reduces_rank{rank}.jsonl").read_text().splitlines()
        counts = [json.loads(line)["reduces"] for line in lines]
        assert counts == [1, 1, 1]  # 4 micro-batches per step, one all-reduce (no_sync)


def wait_for(path: Path, process: subprocess.Popen[Any]) -> None:
    deadline = time.monotonic() + WAIT
    while not path.exists():
        assert process.poll() is None, process.communicate()[1][-4000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def test_sigkill_after_a_checkpoint_then_resume_equals_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    straight, chain = tmp_path / "straight", tmp_path / "chain"
    for directory in (straight, chain):
        directory.mkdir()
    run(write_config(straight), 2, environment(straight))
    config = write_config(chain)
    process = subprocess.Popen(
        command(config, 2),
        env=environment(chain, PROBE_HOLD_AT="6"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        for rank in (0, 1):
            wait_for(chain / f"holding_rank{rank}", process)
        assert (chain / "run" / "checkpoints" / "step_00000004").is_dir()
    finally:
        # torchrun starts each rank in a session of its own: SIGKILL the launcher and every
        # rank, as a machine failure would.
        os.killpg(process.pid, signal.SIGKILL)
        for rank in (0, 1):
            marker = chain / f"holding_rank{rank}"
            if marker.exists():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(marker.read_text()), signal.SIGKILL)
        process.communicate(timeout=WAIT)
    run(config, 2, environment(chain), "--resume")
    assert_same_curve(losses(straight), losses(chain))  # steps 5-6 were redone exactly


def test_a_killed_rank_ends_the_run_on_every_rank_and_keeps_the_checkpoint(
    tmp_path: Path,
) -> None:
    config = write_config(tmp_path, run={"max_steps": 40})
    process = subprocess.Popen(
        command(config, 2),
        env=environment(tmp_path, PROBE_KILL_AT="6"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for(tmp_path / "killed", process)
        _, stderr = process.communicate(timeout=60)  # the survivor must not hang
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode != 0
    assert "error: a rank failed" in stderr
    from speedtronic.checkpoint import CheckpointManager

    assert CheckpointManager(tmp_path / "run" / "checkpoints").load_latest().step == 4


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie nobody reaped yet counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_sigkilled_launcher_takes_its_ranks_and_a_live_run_locks_its_directory(
    tmp_path: Path,
) -> None:
    """The launcher of ``--nproc-per-node 2`` is SIGKILLed alone (its ranks run in sessions of
    their own): the ranks die with it. While they lived, a second run in the same checkpoint
    directory was refused, naming the holder; once they are gone it resumes."""
    config = write_config(tmp_path, run={"max_steps": 8})
    process = subprocess.Popen(
        command(config, 2),
        # Held far longer than the test waits for them to die: an orphan cannot finish.
        env=environment(tmp_path, PROBE_HOLD_AT="6", PROBE_HOLD_S="1800"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    ranks: list[int] = []
    try:
        for rank in (0, 1):
            wait_for(tmp_path / f"holding_rank{rank}", process)
            ranks.append(int((tmp_path / f"holding_rank{rank}").read_text()))
        second = subprocess.run(
            command(config, None, "--resume"),
            capture_output=True,
            text=True,
            timeout=WAIT,
            env=environment(tmp_path),
        )
        assert second.returncode == 2, second.stderr[-3000:]
        assert "in use by another live run" in second.stderr
        assert f"pid {ranks[0]}" in second.stderr and "Traceback" not in second.stderr

        process.kill()  # the launcher only
        process.communicate(timeout=WAIT)
        deadline = time.monotonic() + 60
        while any(_alive(pid) for pid in ranks):
            assert time.monotonic() < deadline, "the ranks outlived their launcher"
            time.sleep(0.1)
        assert not (tmp_path / "run" / "checkpoints" / "step_00000008").exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    run(config, None, environment(tmp_path), "--resume")  # the lock died with them
