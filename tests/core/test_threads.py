"""``run.threads``: ``auto`` (the default) from the cores this process may use, the processes
sharing the machine and the other work on its cores (at start and, through the governor, while
training), and every command honouring the setting."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from toy_runs import EventRecorder, tiny_transformer_run

from speedtronic import ConfigError, SpeedtronicConfig
from speedtronic.engine.runtime import build_runtime
from speedtronic.observe.cpu_load import busy_elsewhere
from speedtronic.observe.threads import (
    LOCAL_PROCESSES_ENV,
    RECHECK_S,
    ThreadGovernor,
    auto_threads,
    local_processes,
    physical_cores,
    usable_cores,
)

CPUINFO_HYPERTHREADS = "\n\n".join(
    f"processor\t: {cpu}\nphysical id\t: 0\ncore id\t\t: {cpu % 2}\nsiblings\t: 4"
    for cpu in range(4)
)


def env_without_threads(**extra: str) -> dict[str, str]:
    drop = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "LOCAL_WORLD_SIZE", LOCAL_PROCESSES_ENV)
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def python(code: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_auto_is_the_default_and_numbers_and_null_still_parse() -> None:
    assert SpeedtronicConfig.from_dict({}).run.threads == "auto"
    assert SpeedtronicConfig.from_dict({"run": {"threads": "3"}}).run.threads == 3
    assert SpeedtronicConfig.from_dict({"run": {"threads": None}}).run.threads is None
    with pytest.raises(ConfigError, match=r"^run\.threads"):
        SpeedtronicConfig.from_dict({"run": {"threads": "many"}})
    with pytest.raises(ConfigError, match=r"^run\.threads"):
        SpeedtronicConfig.from_dict({"run": {"threads": 0}})


def test_auto_divides_the_usable_cores_between_the_processes_of_the_run() -> None:
    cores = min(usable_cores(), physical_cores() or usable_cores())
    for busy in (0, None):  # an idle machine, or one whose load cannot be seen
        assert auto_threads({}, busy=busy) == cores
        assert auto_threads({"LOCAL_WORLD_SIZE": "2"}, busy=busy) == max(1, cores // 2)
        assert auto_threads({LOCAL_PROCESSES_ENV: "3"}, busy=busy) == max(1, cores // 3)
        assert auto_threads({LOCAL_PROCESSES_ENV: str(cores * 4)}, busy=busy) == 1  # never 0
    assert auto_threads({"OMP_NUM_THREADS": "5", "LOCAL_WORLD_SIZE": "2"}) == 5  # the user's
    assert local_processes({"LOCAL_WORLD_SIZE": "x", LOCAL_PROCESSES_ENV: "2"}) == 2


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_auto_follows_the_cpu_affinity_of_the_process() -> None:
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from speedtronic.observe.threads import auto_threads; print(auto_threads())"
    )
    assert python(code, env_without_threads()) == "1"


def test_hyperthread_siblings_count_once() -> None:
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(4))
    expected = len({cpu % 2 for cpu in range(4) if cpu in allowed})
    assert physical_cores(CPUINFO_HYPERTHREADS) == (expected or None)


def test_auto_leaves_the_cores_other_work_keeps_busy() -> None:
    cores = usable_cores()
    static = min(cores, physical_cores() or cores)
    assert auto_threads({}, busy=cores) == 1  # every core busy: one thread, never 0
    assert auto_threads({}, busy=cores * 5) == 1
    assert auto_threads({}, busy=max(0, cores - 1)) == 1  # one core free
    assert auto_threads({"OMP_NUM_THREADS": "3"}, busy=cores * 5) == 3  # the user's, as set
    # Two local processes of a run: the other one's threads are not "other work".
    two = {LOCAL_PROCESSES_ENV: "2"}
    assert auto_threads(two, busy=max(1, static // 2)) == max(1, static // 2)


@pytest.mark.skipif(not Path("/proc/loadavg").exists(), reason="needs Linux /proc")
def test_real_busy_processes_are_seen_and_auto_gives_them_their_cores() -> None:
    cores = usable_cores()
    if busy_elsewhere(cores) is None:
        pytest.skip("this process may not use every CPU of the machine: no load figure")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        deadline = time.monotonic() + 120
        while (busy_elsewhere(cores) or 0) < cores:  # the hogs started and are runnable
            assert time.monotonic() < deadline, "the hogs were never seen"
            time.sleep(0.05)
        assert auto_threads({}) == 1
        code = "from speedtronic.observe.threads import auto_threads; print(auto_threads())"
        assert python(code, env_without_threads()) == "1"  # a fresh process sees them too
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait(60)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_governor_cuts_threads_at_once_and_adds_them_when_two_readings_agree() -> None:
    readings = iter([4, 0, 4, 0, 0, None, 3, 0])
    applied: list[int] = []
    clock = Clock()
    governor = ThreadGovernor(
        2, applied.append, environ={}, interval=5.0, busy=lambda: next(readings), clock=clock
    )
    governor.cores, governor.cap = 2, 2  # a 2-core machine, whatever this one is
    assert governor.tick() is None  # not yet time: no reading taken
    changes = []
    for _ in range(7):
        clock.now += 5.0
        changes.append(governor.tick())
    # 4 busy: down to 1 at once; 0 then 4: no agreement to go up; 0, 0: back to 2; None: the
    # load could not be read, nothing changes; 3 busy: down at once again.
    assert changes == [
        {"threads": 1, "previous": 2, "busy": 4},
        None,
        None,
        None,
        {"threads": 2, "previous": 1, "busy": 0},
        None,
        {"threads": 1, "previous": 2, "busy": 3},
    ]
    assert applied == [1, 2, 1] and governor.threads == 1
    assert RECHECK_S == 5.0  # the interval docs/engine.md and run.threads' help state
    assert next(readings) == 0  # a reading per interval, not per tick


@pytest.mark.skipif(usable_cores() < 2, reason="one core: one thread whatever the load")
def test_a_cpu_run_with_auto_drops_to_one_thread_when_hogs_take_the_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cores = usable_cores()
    if busy_elsewhere(cores) is None:
        pytest.skip("this process may not use every CPU of the machine: no load figure")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("speedtronic.observe.threads.RECHECK_S", 0.01)
    recorder = EventRecorder()
    config = tiny_transformer_run(
        tmp_path, run={"max_steps": 300}, checkpoint={"interval": 0, "save_final": False}
    )
    runtime = build_runtime(config, hooks=[recorder], console=False)
    before = torch.get_num_threads()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        deadline = time.monotonic() + 120
        while (busy_elsewhere(cores) or 0) < cores:
            assert time.monotonic() < deadline, "the hogs were never seen"
            time.sleep(0.05)
        torch.set_num_threads(cores)  # as on an idle machine at start
        runtime.trainer.fit()
        assert torch.get_num_threads() == 1
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait(60)
        torch.set_num_threads(before)
    start = recorder.named("train_start")[0]
    changed = recorder.named("threads_changed")
    assert start["threads"] == cores and changed, recorder.events[-3:]
    assert changed[0]["previous"] == cores and changed[0]["threads"] == 1
    assert changed[0]["busy"] >= cores and changed[0]["step"] >= 1


def test_no_governor_for_fixed_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert ThreadGovernor.for_setting(3, 3, lambda n: None) is None
    assert ThreadGovernor.for_setting(None, 2, lambda n: None) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert ThreadGovernor.for_setting("auto", 2, lambda n: None) is None


def test_validate_config_only_does_not_import_torch_nor_touch_openmp(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"run": {"device": "cpu", "output_dir": str(tmp_path)}}))
    code = (
        "import os, sys\n"
        "from speedtronic.cli import main\n"
        f"main(['validate', '--config-only', '--config', {str(config)!r}])\n"
        "print('torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'))\n"
    )
    assert python(code, env_without_threads()).splitlines()[-1] == "False None"


def run_cli(*args: str, threads: str = "3") -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "speedtronic", *args, "--set", f"run.threads={threads}"]
    done = subprocess.run(
        command, env=env_without_threads(), capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.slow
def test_every_command_uses_run_threads(tmp_path: Path) -> None:
    """train, validate, eval, export and generate each log the thread count torch uses, and
    the train_start event carries it."""
    events = tmp_path / "events.jsonl"
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run": {"device": "cpu", "max_steps": 2, "output_dir": str(tmp_path / "run")},
                "model": {
                    "name": "reference_transformer",
                    "vocab_size": 256,
                    "max_seq_len": 16,
                    "n_layer": 1,
                    "n_head": 2,
                    "d_model": 32,
                },
                "data": {"micro_batch_size": 2},
                "eval": {"batches": 1, "at_end": False},
                "logging": {"json_file": str(events), "progress": False},
            }
        )
    )
    c = str(config)
    outputs = {
        "train": run_cli("train", "--config", c),
        "validate": run_cli("validate", "--config", c),
        "eval": run_cli("eval", "--config", c),
        "export": run_cli("export", "--config", c, "--out", str(tmp_path / "hf")),
        "generate": run_cli(
            "generate", "--config", c, "--prompt", "ab", "--max-new-tokens", "2", threads="2"
        ),
    }
    for command, done in outputs.items():
        expected = "2" if command == "generate" else "3"
        assert f"threads: {expected} (run.threads: {expected})" in done.stderr, command
    assert '"threads": 3' in events.read_text()  # the train_start event
    assert "threads:" not in outputs["generate"].stdout  # logs never mix into the text
