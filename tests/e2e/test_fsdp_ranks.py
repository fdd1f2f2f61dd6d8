"""Sharded data parallel (``parallel.strategy: fsdp``) as real torchrun processes on the CPU.

The ranks start through ``speedtronic train --nproc-per-node 2`` (gloo); rank 0's JSONL metric
file and the DCP checkpoints are read back. A small probe plugin, loaded by every rank with
``--plugin``, exercises the full-state helpers a DiLoCo node uses and can SIGKILL a rank in the
middle of a sharded save. Waits are bounded polls on files the processes write.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from rank_runs import WAIT, probe_environment, train_command, train_ok
from safetensors.torch import load_file

pytestmark = pytest.mark.slow


PROBE = """
import json
import os
import signal
from pathlib import Path

import torch
from safetensors.torch import save_file

from speedtronic import hookimpl
from speedtronic.parallel.fsdp import full_model_state, load_full_model_state

OUT = Path(os.environ["PROBE_DIR"])


@hookimpl
def on_train_start(trainer):
    kill_at = os.environ.get("PROBE_KILL_IN_SAVE")
    if kill_at is None or trainer.parallel.rank != 0:
        return
    import speedtronic.checkpoint.dcp as dcp

    finish = dcp._finish

    def killing_finish(manager, staging, final, step, state):
        # Every rank's shards are in the staging directory; nothing is committed yet.
        if step == int(kill_at):
            (OUT / "killed").write_text(str(staging))
            os.kill(os.getpid(), signal.SIGKILL)
        return finish(manager, staging, final, step, state)

    dcp._finish = killing_finish


@hookimpl
def after_optimizer_step(trainer, step):
    if os.environ.get("PROBE_FULL_STATE") != "1" or step != 2:
        return
    rank = trainer.parallel.rank
    full = full_model_state(trainer.model)
    save_file(full, str(OUT / f"full_rank{rank}.safetensors"))
    # Install something else on every rank's shards, read it back whole, then put the
    # original back: the rest of the run must not notice.
    load_full_model_state(trainer.model, {k: torch.full_like(v, 0.5) for k, v in full.items()})
    halves = full_model_state(trainer.model)
    ok = all(bool((v == 0.5).all()) for v in halves.values())
    main_only = full_model_state(trainer.model, only_main=True)
    ok = ok and (set(main_only) == set(full) if rank == 0 else main_only == {})
    load_full_model_state(trainer.model, full if rank == 0 else {}, from_main=True)
    (OUT / f"installed_rank{rank}.json").write_text(json.dumps({"ok": ok}))
"""

MODEL = {
    "name": "reference_transformer",
    "vocab_size": 260,
    "max_seq_len": 16,
    "n_layer": 2,
    "n_head": 2,
    "d_model": 32,
}


def write_config(directory: Path, **overrides: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "run": {"device": "cpu", "max_steps": 6, "seed": 3, "output_dir": str(directory / "run")},
        "model": dict(MODEL),
        "data": {"micro_batch_size": 4, "target_batch_size": 8},
        # A small clip threshold: every step is clipped, so a wrong global norm shows.
        "optimizer": {"lr": 3e-3, "grad_clip": 0.3},
        "precision": {"mode": "fp32"},
        # One schedule however --max-steps cuts a run into legs.
        "scheduler": {"total_steps": 6},
        "parallel": {"strategy": "fsdp"},
        "checkpoint": {"interval": 2},
        "logging": {
            "log_every": 1,
            "progress": False,
            "json_file": str(directory / "run" / "metrics.jsonl"),
        },
    }
    for section, values in overrides.items():
        if isinstance(values, dict):
            config.setdefault(section, {}).update(values)
        else:
            config[section] = values
    path = directory / "config.json"
    path.write_text(json.dumps(config))
    return path


def environment(directory: Path, **probe: str) -> dict[str, str]:
    return probe_environment(directory, "fsdp_probe", PROBE, **probe)


def command(config: Path, nproc: int | None, *extra: str) -> list[str]:
    return train_command(config, nproc, "fsdp_probe", *extra)


def run(config: Path, nproc: int | None, env: dict[str, str], *extra: str) -> None:
    train_ok(config, nproc, "fsdp_probe", env, *extra)


def cli(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "speedtronic", *args], capture_output=True, text=True, timeout=WAIT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def records(directory: Path, event: str = "step") -> list[dict[str, Any]]:
    lines = (directory / "run" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


def curve(directory: Path, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in records(directory)}


def assert_close(a: dict[int, float], b: dict[int, float], rel: float) -> None:
    assert set(a) == set(b) and a
    for step in a:
        assert abs(a[step] - b[step]) <= rel * abs(b[step]), (step, a[step], b[step])


# 3 windows of micro-batches of 1 over 2 ranks: rank 0 scores two, rank 1 one (and runs one
# uncounted forward so that the sharded forwards, collectives, stay in step).
UNEVEN_EVAL = {"every": 3, "batches": 3, "micro_batch_size": 1}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One process with the whole global batch, and two FSDP ranks without and with
    accumulation, on the same global batch of 8 samples per step."""
    root = tmp_path_factory.mktemp("fsdp_runs")
    single, sharded, accumulated = root / "single", root / "fsdp", root / "fsdp_accum"
    run(
        write_config(
            single,
            data={"micro_batch_size": 8},
            parallel={"strategy": "none"},
            eval=UNEVEN_EVAL,
        ),
        None,
        environment(single, PROBE_FULL_STATE="1"),
    )
    run(
        write_config(sharded, eval=UNEVEN_EVAL),
        2,
        environment(sharded, PROBE_FULL_STATE="1"),
    )
    run(write_config(accumulated, data={"micro_batch_size": 2}), 2, environment(accumulated))
    return {"single": single, "fsdp": sharded, "accumulated": accumulated}


def test_two_fsdp_ranks_follow_one_process_with_and_without_accumulation(
    runs: dict[str, Path],
) -> None:
    single = curve(runs["single"])
    assert_close(curve(runs["fsdp"]), single, 2e-3)
    assert_close(curve(runs["accumulated"]), single, 2e-3)
    # Clipping saw the norm of the whole gradient, not of one rank's shards.
    assert_close(curve(runs["fsdp"], "grad_norm"), curve(runs["single"], "grad_norm"), 2e-3)
    assert_close(curve(runs["accumulated"], "grad_norm"), curve(runs["single"], "grad_norm"), 2e-3)
    # The FLOP count ran on the copy taken before sharding (not on one rank's shards).
    counts = [records(runs[name], "train_start")[0]["flops_per_token"] for name in runs]
    assert counts[0] and all(c == pytest.approx(counts[0], rel=0.02) for c in counts)
    # The sharded eval scored the windows one process scores, with the same loss.
    evals = {name: records(runs[name], "eval") for name in ("single", "fsdp")}
    assert [r["step"] for r in evals["fsdp"]] == [3, 6]
    for one, sharded in zip(evals["single"], evals["fsdp"], strict=True):
        assert sharded["windows"] == one["windows"] == 3 and sharded["tokens"] == one["tokens"]
        assert abs(sharded["loss"] - one["loss"]) <= 2e-3 * one["loss"]
    # A DCP checkpoint: every rank's shards, the rest, and a manifest listing all of them.
    final = runs["fsdp"] / "run" / "checkpoints" / "step_00000006"
    manifest = json.loads((final / "manifest.json").read_text())
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(manifest["files"])


def test_compile_and_activation_checkpointing_per_unit_keep_the_curve(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    config = write_config(
        tmp_path,
        eval={"every": 3, "batches": 2, "micro_batch_size": 4},
        compile={"enabled": True, "backend": "eager"},
        gradient_checkpointing=True,
    )
    done = subprocess.run(
        command(config, 2), capture_output=True, text=True, timeout=WAIT, env=environment(tmp_path)
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "torch.compile failed" not in done.stderr  # no silent fall back to eager
    (start,) = records(tmp_path, "train_start")
    assert start["compiled"] is True
    assert_close(curve(tmp_path), curve(runs["fsdp"]), 2e-3)


def test_full_state_helpers_gather_and_install_on_every_rank(runs: dict[str, Path]) -> None:
    reference = load_file(str(runs["single"] / "full_rank0.safetensors"))
    for rank in (0, 1):
        gathered = load_file(str(runs["fsdp"] / f"full_rank{rank}.safetensors"))
        assert set(gathered) == set(reference)
        for name, tensor in reference.items():
            assert gathered[name].shape == tensor.shape
            assert torch.allclose(gathered[name], tensor, atol=1e-5), name
        installed = json.loads((runs["fsdp"] / f"installed_rank{rank}.json").read_text())
        assert installed == {"ok": True}
    # The run continued from the re-installed weights exactly (see the curve test above).


def test_export_eval_and_generate_read_an_fsdp_checkpoint(runs: dict[str, Path]) -> None:
    scores, exports, samples = {}, {}, {}
    for name in ("single", "fsdp"):
        config = str(runs[name] / "config.json")
        out = cli("eval", "-c", config, "--format", "json", "--batches", "2")
        scores[name] = json.loads(out)["loss"]
        cli("export", "-c", config, "--out", str(runs[name] / "export"))
        exports[name] = load_file(str(runs[name] / "export" / "model.safetensors"))
        samples[name] = cli(
            "generate", "-c", config, "--prompt", "ab", "--max-new-tokens", "6",
            "--temperature", "0",
        )  # fmt: skip
    assert abs(scores["fsdp"] - scores["single"]) <= 1e-3 * abs(scores["single"])
    assert set(exports["fsdp"]) == set(exports["single"])
    for key, tensor in exports["single"].items():
        assert torch.allclose(exports["fsdp"][key], tensor, atol=1e-3), key
    assert samples["fsdp"] == samples["single"]


def test_fsdp_checkpoint_resumes_on_one_process_ddp_and_two_fsdp_ranks(tmp_path: Path) -> None:
    straight, chain = tmp_path / "straight", tmp_path / "chain"
    run(write_config(straight), 2, environment(straight))
    config = write_config(chain)
    env = environment(chain)
    run(config, 2, env, "--max-steps", "2")  # 2 FSDP ranks write step 2 (DCP)
    run(config, None, env, "--resume", "--max-steps", "4")  # 1 process reads it, writes 4
    ddp = ("--set", "parallel.strategy=ddp")
    run(config, 2, env, "--resume", "--max-steps", "5", *ddp)  # DDP reads DCP, writes plain
    run(config, 2, env, "--resume")  # 2 FSDP ranks read DDP's checkpoint
    assert_close(curve(chain), curve(straight), 5e-3)  # each leg's steps, 1 to 6
    lines = (chain / "run" / "metrics.jsonl").read_text().splitlines()
    resumed = [r["step"] for r in map(json.loads, lines) if r["event"] == "resumed"]
    assert resumed == [2, 4, 5]
    full = {}
    for directory in (straight, chain):
        step6 = directory / "run" / "checkpoints" / "step_00000006"
        assert (step6 / "dcp" / ".metadata").is_file()
        from speedtronic.checkpoint import CheckpointManager

        full[directory.name] = CheckpointManager(step6.parent).read(step6).state["model"]
    for key, tensor in full["straight"].items():
        assert torch.allclose(full["chain"][key], tensor, atol=5e-3), key


def test_sigkill_during_a_sharded_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    process = subprocess.Popen(
        command(config, 2),
        env=environment(tmp_path, PROBE_KILL_IN_SAVE="4"),
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
    staging = Path((tmp_path / "killed").read_text())
    assert staging.name.startswith(".step_00000004.") and (staging / "dcp").is_dir()
    from speedtronic.checkpoint import CheckpointManager

    checkpoints = tmp_path / "run" / "checkpoints"
    assert CheckpointManager(checkpoints).load_latest().step == 2
    assert [p.name for p in CheckpointManager(checkpoints).candidates()] == ["step_00000002"]
    run(config, 2, environment(tmp_path), "--resume")
    assert CheckpointManager(checkpoints).load_latest().step == 6
    assert not staging.exists()  # the next save cleared the interrupted one away
