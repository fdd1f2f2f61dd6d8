"""``run.threads``: ``auto`` (the default) from the cores this process may use and the
processes sharing the machine, the OpenMP settings the CLI gives before torch loads, and every
command honouring the setting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from speedtronic import ConfigError, SpeedtronicConfig
from speedtronic.threads import (
    LOCAL_PROCESSES_ENV,
    auto_threads,
    local_processes,
    physical_cores,
    prepare_threads,
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
    assert auto_threads({}) == cores
    assert auto_threads({"LOCAL_WORLD_SIZE": "2"}) == max(1, cores // 2)
    assert auto_threads({LOCAL_PROCESSES_ENV: "3"}) == max(1, cores // 3)
    assert auto_threads({LOCAL_PROCESSES_ENV: str(cores * 4)}) == 1  # never 0
    assert auto_threads({"OMP_NUM_THREADS": "5", "LOCAL_WORLD_SIZE": "2"}) == 5  # the user's
    assert local_processes({"LOCAL_WORLD_SIZE": "x", LOCAL_PROCESSES_ENV: "2"}) == 2


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_auto_follows_the_cpu_affinity_of_the_process() -> None:
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from speedtronic.threads import auto_threads; print(auto_threads())"
    )
    assert python(code, env_without_threads()) == "1"


def test_hyperthread_siblings_count_once() -> None:
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(4))
    expected = len({cpu % 2 for cpu in range(4) if cpu in allowed})
    assert physical_cores(CPUINFO_HYPERTHREADS) == (expected or None)


def test_openmp_is_told_not_to_spin_unless_the_user_said_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    prepare_threads(None)  # torch's defaults: hands off
    assert "OMP_WAIT_POLICY" not in os.environ
    prepare_threads("auto")
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    prepare_threads(2)
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_the_cli_sets_the_wait_policy_before_torch_is_imported(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"run": {"device": "cpu", "output_dir": str(tmp_path)}}))
    code = (
        "import os, sys\n"
        "from speedtronic.cli import main\n"
        f"main(['validate', '--config-only', '--config', {str(config)!r}])\n"
        "print('torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'))\n"
    )
    assert python(code, env_without_threads()).splitlines()[-1] == "False PASSIVE"


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
