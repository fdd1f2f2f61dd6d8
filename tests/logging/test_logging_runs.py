"""Training runs with the sinks on, in-process: redaction, failures, resume, sequential runs."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import pytest
from run_outputs import (
    files_containing,
    read_jsonl,
    tensorboard_events,
    tensorboard_hparams,
    tensorboard_text,
)
from wandb_run_file import finished_runs

from speedtronic import PluginError, hookimpl
from speedtronic.plugins import register, unregister
from speedtronic.runtime import build_runtime, train_from_config
from speedtronic.schema import REDACTED, Section, option

SECRET = "vault-token-6f1d0c2a9b"
FAKE_API_KEY = "local-fake-wandb-key-9b8a7c6d5e4f3a2b1c0d"
STATUS_SUCCESS, STATUS_FAILURE = 1, 2  # tensorboard.plugins.hparams.api_pb2.Status


@dataclass
class VaultConfig(Section):
    token: str | None = option(None, help="A credential that must never be logged.", secret=True)


class VaultPlugin:
    """Contributes a section with a secret field, as a transport plugin would."""

    @hookimpl
    def config_sections(self) -> dict[str, type]:
        return {"vault": VaultConfig}


class OuterStepPlugin:
    """Emits DiLoCo-style ``outer_step`` events every 3 steps; can fail on a chosen step."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at

    @hookimpl
    def after_optimizer_step(self, trainer: Any, step: int) -> None:
        if step == self.fail_at:
            raise RuntimeError(f"injected failure at step {step}")
        if step % 3 == 0:
            trainer.emit(
                "outer_step",
                {
                    "step": step,
                    "outer_step": step // 3,
                    "deltas_found": 3,
                    "deltas_included": 2,
                    "applied": True,
                    "node": "master",
                },
            )


def train(config: Any) -> Any:
    return train_from_config(config, console=False)


def test_tensorboard_sequential_runs_and_plugin_events(tmp_path, tiny_config, plugins) -> None:
    plugins(OuterStepPlugin())
    for name in ("first", "second"):
        out = tmp_path / name
        result = train(tiny_config(out, tensorboard={"enabled": True}))
        assert result.steps == 6

        events = tensorboard_events(out / "tensorboard")
        steps = [e for e in read_jsonl(out / "metrics.jsonl") if e["event"] == "step"]
        losses = events.Scalars("train/loss")
        assert [s.step for s in losses] == [2, 4, 6]  # this run's steps only, no leftovers
        assert [s.value for s in losses] == pytest.approx([e["loss"] for e in steps], rel=1e-6)
        assert [(s.step, s.value) for s in events.Scalars("outer_step/deltas_found")] == [
            (3, 3.0),
            (6, 3.0),
        ]
        assert [s.value for s in events.Scalars("outer_step/applied")] == [1.0, 1.0]
        assert "outer_step/node" not in events.Tags()["scalars"]  # text fields are not scalars
        (summary,) = tensorboard_text(events, "summary")
        assert summary[0] == 6 and "| status | ok |" in summary[1]
        assert "| device | cpu |" in tensorboard_text(events, "run_info")[0][1]
        assert tensorboard_hparams(events)[1] == STATUS_SUCCESS  # finished when fit returned


def test_one_trainer_fitting_twice_closes_its_sinks_each_time(tmp_path, tiny_config) -> None:
    out = tmp_path / "run"
    runtime = build_runtime(tiny_config(out, tensorboard={"enabled": True}), console=False)
    runtime.trainer.fit()
    assert runtime.trainer.plugin_state == {}  # the run's sinks went with the run
    runtime.trainer.config.run.max_steps = 8  # a longer target for the same trainer
    assert runtime.trainer.fit().steps == 8
    assert runtime.trainer.plugin_state == {}
    events = tensorboard_events(out / "tensorboard")
    assert [s.step for s in events.Scalars("train/loss")] == [2, 4, 6, 8]
    assert len(tensorboard_text(events, "summary")) == 2


def test_secrets_are_redacted_in_logged_hyperparameters(
    tmp_path, tiny_config, plugins, monkeypatch
) -> None:
    plugins(VaultPlugin())
    monkeypatch.setenv("WANDB_API_KEY", FAKE_API_KEY)
    # As if given on the command line: W&B records the process arguments.
    monkeypatch.setattr(sys, "argv", ["speedtronic", "train", "--set", f"vault.token={SECRET}"])
    out = tmp_path / "run"
    config = tiny_config(
        out,
        vault={"token": SECRET},
        wandb={"enabled": True, "mode": "offline"},
        tensorboard={"enabled": True},
    )
    assert config.vault.token == SECRET
    train(config)

    (run,) = finished_runs(out)
    assert run.config["vault"] == {"token": REDACTED}
    assert run.args == ["train", "--set", f"vault.token={REDACTED}"]
    hparams, _ = tensorboard_hparams(tensorboard_events(out / "tensorboard"))
    assert hparams["vault.token"] == REDACTED
    assert (
        "token: <redacted>"
        in tensorboard_text(tensorboard_events(out / "tensorboard"), "config")[0][1]
    )
    assert sys.argv[-1] == f"vault.token={SECRET}"  # the process's own argv is left alone
    # Nowhere on disk: W&B files, event files, checkpoints (their saved config included).
    assert (out / "checkpoints").is_dir()
    assert files_containing(out, SECRET) == []
    assert files_containing(out, FAKE_API_KEY) == []


def test_an_exception_in_training_leaves_finished_readable_runs(
    tmp_path, tiny_config, plugins
) -> None:
    plugins(OuterStepPlugin(fail_at=5))
    out = tmp_path / "run"
    config = tiny_config(
        out,
        wandb={"enabled": True, "mode": "offline"},
        tensorboard={"enabled": True, "flush_secs": 600},
    )
    with pytest.raises(RuntimeError, match="injected failure at step 5"):
        train(config)

    events = tensorboard_events(out / "tensorboard")  # flushed despite flush_secs=600
    assert [s.step for s in events.Scalars("train/loss")] == [2, 4]
    assert "| status | error: RuntimeError |" in tensorboard_text(events, "summary")[0][1]
    assert tensorboard_hparams(events)[1] == STATUS_FAILURE

    (run,) = finished_runs(out)
    assert [row["trainer/step"] for row in run.history if "train/loss" in row] == [2, 4]
    assert run.summary["status"] == "error: RuntimeError"
    assert run.exit_code == 1


def test_failing_sinks_warn_once_and_training_continues(
    tmp_path, tiny_config, plugins, monkeypatch, logging_records
) -> None:
    import torch.utils.tensorboard
    import wandb

    calls: list[str] = []

    def disk_full(self: Any, tag: str, *args: Any, **kwargs: Any) -> None:
        calls.append(tag)
        raise OSError(28, "No space left on device")

    def unreachable(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("api.wandb.ai unreachable")

    monkeypatch.setattr(torch.utils.tensorboard.SummaryWriter, "add_scalar", disk_full)
    monkeypatch.setattr(wandb, "init", unreachable)
    plugins(OuterStepPlugin())
    out = tmp_path / "run"
    result = train(tiny_config(out, wandb={"enabled": True}, tensorboard={"enabled": True}))

    assert result.steps == 6 and result.final_loss is not None
    assert len(calls) == 1  # the failed backend got nothing after its first error
    warnings = logging_records.warnings()
    assert len(warnings) == 2, warnings
    assert any("W&B" in w and "unreachable" in w for w in warnings)
    assert any("TensorBoard" in w and "No space left" in w for w in warnings)
    # The failed writer was still closed: the text written before the failure is readable.
    assert tensorboard_text(tensorboard_events(out / "tensorboard"), "config")


@pytest.mark.parametrize(
    ("hidden_module", "extra", "other"),
    [("wandb", "wandb", "tensorboard"), ("torch.utils.tensorboard", "tensorboard", "wandb")],
)
def test_missing_backend_names_the_extra(
    tmp_path, tiny_config, monkeypatch, hidden_module, extra, other
) -> None:
    monkeypatch.setitem(sys.modules, hidden_module, None)  # import now raises ImportError
    out = tmp_path / "run"
    config = tiny_config(
        out, wandb={"enabled": True, "mode": "offline"}, tensorboard={"enabled": True}
    )
    with pytest.raises(PluginError) as caught:
        train(config)
    assert f"pip install 'speedtronic-logging[{extra}]'" in str(caught.value)
    # Checked before anything starts: the other backend wrote nothing either.
    assert not (out / "tensorboard").exists() and not (out / "wandb").exists()


def test_resume_after_a_crash_continues_the_same_runs(tmp_path, tiny_config) -> None:
    out = tmp_path / "run"
    sections = {
        "run": {"name": "r", "device": "cpu", "max_steps": 8, "output_dir": str(out)},
        "checkpoint": {"interval": 4},
        "wandb": {"enabled": True, "mode": "offline"},
        "tensorboard": {"enabled": True},
    }
    crash = register(OuterStepPlugin(fail_at=7), name="test-crash-at-7")
    try:
        with pytest.raises(RuntimeError):  # logged steps 2, 4, 6; last checkpoint at 4
            train(tiny_config(out, **sections))
    finally:
        unregister(crash)
    sections["checkpoint"] = {"interval": 4, "resume": True}
    resumed = train(tiny_config(out, **sections))
    assert resumed.resumed_from == 4 and resumed.steps == 8

    first, second = finished_runs(out, count=2)
    assert second.run_id == first.run_id  # W&B shows one run, continued
    assert (first.exit_code, second.exit_code) == (1, 0)
    assert second.config["checkpoint"]["resume"] is True  # the resumed config replaced the old
    assert [row["trainer/step"] for row in second.history if "train/loss" in row] == [6, 8]
    # TensorBoard drops the crashed run's step 6 in favour of the resumed one's.
    steps = [e for e in read_jsonl(out / "metrics.jsonl") if e["event"] == "step"]
    scalars = tensorboard_events(out / "tensorboard").Scalars("train/loss")
    assert [s.step for s in scalars] == [2, 4, 6, 8]
    assert scalars[2].value == pytest.approx(steps[3]["loss"], rel=1e-6)  # the resumed step 6


def test_a_wandb_run_started_by_the_user_is_used_and_left_open(tmp_path, tiny_config) -> None:
    import wandb

    out = tmp_path / "run"
    user_run = wandb.init(
        mode="offline", dir=str(tmp_path), project="mine", config={"note": "set by me"}
    )
    try:
        train(tiny_config(out, wandb={"enabled": True, "mode": "offline"}))
        assert wandb.run is user_run  # not finished by Speedtronic
        user_run.log({"after/eval": 1.0})
    finally:
        user_run.finish()
    assert not (out / "wandb").exists()  # no second run was created
    (run,) = finished_runs(tmp_path)
    assert run.config["note"] == "set by me" and run.config["run"]["name"] == "tiny"
    assert [row["trainer/step"] for row in run.history if "train/loss" in row] == [2, 4, 6]
    assert any("after/eval" in row for row in run.history)
