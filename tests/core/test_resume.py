"""Trainer checkpoints and resume: exactness, data position, plugins, fallbacks, redaction."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from core.toy_runs import merge_sections, tiny_transformer_run, train
from torch.utils.data import Dataset, IterableDataset

from speedtronic import hookimpl, plugins
from speedtronic.errors import CheckpointError
from speedtronic.schema import Section, option

TOL = 1e-6


def make_config(tmp_path: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """The shared tiny run under ``tmp_path``, with a scheduler horizon that does not depend on
    run.max_steps."""
    config = tiny_transformer_run(tmp_path / "run", scheduler={"total_steps": 16})
    return merge_sections(config, sections)


def assert_same_losses(straight: dict[int, float], resumed: dict[int, float]) -> None:
    assert resumed, "no steps were logged"
    for step, loss in resumed.items():
        assert abs(loss - straight[step]) <= TOL, f"step {step}: {loss} != {straight[step]}"


def weights_match(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(
        torch.allclose(x, y, atol=TOL, rtol=0)
        for x, y in zip(a.state_dict().values(), b.state_dict().values())
    )


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    generator = torch.Generator().manual_seed(0)
    words = ["speed", "tronic", "resume", "exact", "check", "point", "loss", "step", "\n"]
    picks = torch.randint(len(words), (1500,), generator=generator).tolist()
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(words[i] for i in picks), encoding="utf-8")
    return path


@pytest.mark.parametrize("source", ["synthetic", "text"])
def test_eight_steps_then_resume_to_sixteen_matches_sixteen_straight(
    tmp_path: Path, source: str, text_file: Path
) -> None:
    data = {"text_path": str(text_file)} if source == "text" else {}
    straight_result, straight, straight_trainer = train(
        make_config(tmp_path / "straight", data=data)
    )
    assert set(straight.losses) == set(range(1, 17))

    config = make_config(tmp_path / "chain", data=data)
    first, first_events, _ = train(dict(config, run=dict(config["run"], max_steps=8)))
    assert first.steps == 8
    result, resumed, trainer = train(dict(config, checkpoint={"interval": 4, "resume": True}))

    assert result.resumed_from == 8 and result.steps == 16
    assert set(resumed.losses) == set(range(9, 17))  # nothing re-run, nothing skipped
    assert_same_losses(straight.losses, {**first_events.losses, **resumed.losses})
    assert result.samples == straight_result.samples and result.tokens == straight_result.tokens
    assert weights_match(trainer.model, straight_trainer.model)


def test_resume_after_a_crash_between_checkpoints_repeats_the_lost_steps_exactly(
    tmp_path: Path,
) -> None:
    _, straight, _ = train(make_config(tmp_path / "straight"))

    class Crash:
        @hookimpl
        def after_optimizer_step(self, trainer: Any, model: Any, step: int) -> None:
            if step == 11:
                raise RuntimeError("power cut")

    config = make_config(tmp_path / "chain", checkpoint={"interval": 4, "resume": True})
    plugins.register(Crash(), name="test-crash")
    try:
        with pytest.raises(RuntimeError, match="power cut"):
            train(config)
    finally:
        plugins.unregister("test-crash")
    result, resumed, _ = train(config)
    assert result.resumed_from == 8
    assert set(resumed.losses) == set(range(9, 17))
    assert_same_losses(straight.losses, resumed.losses)


class Tokens(Dataset):
    """A small map-style dataset of dict samples (resumes through the index sampler)."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = (torch.arange(17) * (index + 1)) % 256
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}


def test_user_map_dataset_resumes_at_the_same_sample(tmp_path: Path) -> None:
    # Through a real DataLoader, whose iterator draws a seed from the global RNG when created:
    # with dropout on, the losses only match if the resumed RNG is applied after that draw.
    data = {"shuffle": True}
    _, straight, _ = train(make_config(tmp_path / "s", data=data), dataset=Tokens())
    config = make_config(tmp_path / "c", data=data)
    train(dict(config, run=dict(config["run"], max_steps=8)), dataset=Tokens())
    _, resumed, _ = train(
        dict(config, checkpoint={"interval": 4, "resume": True}), dataset=Tokens()
    )
    assert_same_losses(straight.losses, resumed.losses)


class TokenStream(IterableDataset):
    """An endless iterable dataset: no index to seek to, so resuming re-reads and skips. With
    the tiny transformer's dropout, the losses only match if re-reading and skipping happen
    before the resumed RNG state is applied."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for index in itertools.count():
            tokens = (torch.arange(17) * (index % 10 + 1)) % 256
            yield {"input_ids": tokens[:-1], "labels": tokens[1:]}


def test_user_iterable_dataset_resumes_by_skipping_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, straight, _ = train(make_config(tmp_path / "s"), dataset=TokenStream())
    config = make_config(tmp_path / "c")
    train(dict(config, run=dict(config["run"], max_steps=8)), dataset=TokenStream())
    with caplog.at_level(logging.WARNING, logger="speedtronic"):
        result, resumed, _ = train(
            dict(config, checkpoint={"interval": 4, "resume": True}), dataset=TokenStream()
        )
    assert result.resumed_from == 8 and set(resumed.losses) == set(range(9, 17))
    assert_same_losses(straight.losses, resumed.losses)
    skip_warnings = [r for r in caplog.records if "skip" in r.message and "consumed" in r.message]
    assert len(skip_warnings) == 1, caplog.text


def test_resuming_a_finished_run_is_a_noop_with_a_message(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(tmp_path, run={"max_steps": 4})
    train(config)
    with caplog.at_level(logging.INFO, logger="speedtronic.trainer"):
        result, events, _ = train(dict(config, checkpoint={"interval": 4, "resume": True}))
    assert result.steps == 4 and result.resumed_from == 4 and result.final_loss is None
    assert events.losses == {}
    assert events.named("already_finished") == [{"step": 4, "max_steps": 4}]
    assert "already finished" in caplog.text and "already finished" in result.summary["message"]


def test_resume_without_any_checkpoint_starts_fresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(tmp_path, run={"max_steps": 3}, checkpoint={"resume": True})
    with caplog.at_level(logging.INFO, logger="speedtronic.trainer"):
        result, events, _ = train(config)
    assert result.resumed_from is None and result.steps == 3
    assert set(events.losses) == {1, 2, 3}
    assert "starting fresh" in caplog.text
    # ...and the same command then continues the run.
    result, events, _ = train(dict(config, run=dict(config["run"], max_steps=5)))
    assert result.resumed_from == 3 and set(events.losses) == {4, 5}


def corrupt_every_checkpoint(directory: Path) -> None:
    for path in directory.glob("step_*"):
        tensors = path / "tensors.safetensors"
        tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])


def test_checkpoints_but_none_usable_stops_unless_a_fresh_start_is_allowed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(tmp_path, run={"max_steps": 4}, checkpoint={"interval": 2})
    train(config)
    corrupt_every_checkpoint(tmp_path / "run" / "checkpoints")
    resume = dict(config, checkpoint={"interval": 2, "resume": True})
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        train(resume)
    with caplog.at_level(logging.WARNING, logger="speedtronic"):
        result, events, _ = train(
            dict(resume, checkpoint=dict(resume["checkpoint"], allow_fresh_start=True))
        )
    assert result.resumed_from is None and set(events.losses) == {1, 2, 3, 4}
    assert "allow_fresh_start" in caplog.text
    assert "step_00000004" in caplog.text  # the unusable checkpoint is named


def test_corrupt_newest_checkpoint_falls_back_and_still_matches(tmp_path: Path) -> None:
    _, straight, _ = train(make_config(tmp_path / "s"))
    config = make_config(tmp_path / "c", run={"max_steps": 12})
    train(config)
    newest = tmp_path / "c" / "run" / "checkpoints" / "step_00000012"
    (newest / "state.json").write_text("{}")
    result, resumed, _ = train(
        make_config(tmp_path / "c", checkpoint={"interval": 4, "resume": True})
    )
    assert result.resumed_from == 8
    assert set(resumed.losses) == set(range(9, 17))
    assert_same_losses(straight.losses, resumed.losses)


def test_final_checkpoint_only_when_the_interval_missed_the_last_step(tmp_path: Path) -> None:
    _, events, _ = train(
        make_config(
            tmp_path / "a", run={"max_steps": 7}, checkpoint={"interval": 3, "keep_last": 5}
        )
    )
    assert [p["step"] for p in events.named("checkpoint")] == [3, 6, 7]
    _, events, _ = train(
        make_config(tmp_path / "b", run={"max_steps": 6}, checkpoint={"interval": 3})
    )
    assert [p["step"] for p in events.named("checkpoint")] == [3, 6]
    _, events, _ = train(
        make_config(tmp_path / "c", run={"max_steps": 5}, checkpoint={"interval": 0})
    )
    assert [p["step"] for p in events.named("checkpoint")] == [5]
    _, events, _ = train(
        make_config(
            tmp_path / "d", run={"max_steps": 5}, checkpoint={"interval": 0, "save_final": False}
        )
    )
    assert events.named("checkpoint") == []
    assert not (tmp_path / "d" / "run" / "checkpoints").exists()


def test_checkpoint_directory_and_retention_from_config(tmp_path: Path) -> None:
    directory = tmp_path / "elsewhere"
    train(
        make_config(
            tmp_path,
            run={"max_steps": 6},
            checkpoint={"interval": 1, "keep_last": 2, "directory": str(directory)},
        )
    )
    # (besides .run.lock, the run lock: speedtronic.checkpoint.runlock)
    assert sorted(p.name for p in directory.iterdir() if p.name != ".run.lock") == [
        "latest.json",
        "step_00000005",
        "step_00000006",
    ]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_checkpoint_holds_the_whole_trainer_state(tmp_path: Path) -> None:
    _, _, trainer = train(make_config(tmp_path, run={"max_steps": 4}))
    loaded = trainer.checkpoints.load_latest()
    assert loaded is not None and loaded.step == 4
    state = loaded.state
    assert {
        "model",
        "optimizer",
        "scheduler",
        "scaler",
        "rng",
        "data",
        "config",
        "plugins",
        "step",
        "samples_seen",
        "tokens_seen",
    } <= set(state)
    assert state["samples_seen"] == 16 and state["tokens_seen"] == 16 * 16
    assert state["data"]["start_sample"] == 16
    assert state["scheduler"]["last_epoch"] == 4
    assert set(state["rng"]) >= {"python", "numpy", "torch"}
    assert state["config"]["run"]["max_steps"] == 4
    assert all(int(s["step"]) == 4 for s in state["optimizer"]["state"].values())
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(state["model"][key], value)


def test_state_that_does_not_fit_the_model_is_a_clear_error(tmp_path: Path) -> None:
    config = make_config(tmp_path, run={"max_steps": 2})
    train(config)
    wider = dict(
        config, model=dict(config["model"], d_model=64), checkpoint={"interval": 4, "resume": True}
    )
    with pytest.raises(CheckpointError, match="does not fit this model") as caught:
        train(wider)
    message = str(caught.value)
    # Each mismatched tensor is named with both shapes: the first few, then a count.
    assert "tok_emb.weight: checkpoint [256, 32] vs model [256, 64]" in message
    assert message.count(" vs model ") == 4 and " more" in message


def test_fresh_start_into_a_directory_with_checkpoints_refuses_to_overwrite(
    tmp_path: Path,
) -> None:
    config = make_config(tmp_path, run={"max_steps": 2})
    train(config)
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "run/checkpoints").iterdir()}
    with pytest.raises(CheckpointError, match=r"already holds checkpoints .*pass --resume"):
        train(config)
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "run/checkpoints").iterdir()}
    assert after == before  # nothing of the earlier run was touched


class StatefulPlugin:
    """Stores a DiLoCo-like nested state and records the order of its hook calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.loaded: dict[str, Any] | None = None

    @hookimpl
    def on_checkpoint(self, trainer: Any, state: dict[str, Any]) -> None:
        state["coordinator"] = {
            "outer_step": trainer.step // 4,
            "node": "node-a",
            "pending": None,
            "baseline": {
                "weights": {k: v.clone() for k, v in list(trainer.model.state_dict().items())[:2]}
            },
            "history": [{"step": trainer.step, "ok": True}],
        }

    @hookimpl
    def on_load_checkpoint(self, trainer: Any, state: dict[str, Any]) -> None:
        self.calls.append("load")
        self.loaded = state.get("coordinator")

    @hookimpl
    def on_train_start(self, trainer: Any) -> None:
        self.calls.append(f"start@{trainer.step}")


def test_plugin_state_is_restored_before_train_start(tmp_path: Path) -> None:
    config = make_config(tmp_path, run={"max_steps": 8})
    plugin = StatefulPlugin()
    plugins.register(plugin, name="test-stateful")
    try:
        _, _, trainer = train(config)
        saved_baseline = {k: v.clone() for k, v in list(trainer.model.state_dict().items())[:2]}
        plugin.calls.clear()
        train(
            dict(
                config,
                run=dict(config["run"], max_steps=10),
                checkpoint={"interval": 4, "resume": True},
            )
        )
    finally:
        plugins.unregister("test-stateful")
    assert plugin.calls == ["load", "start@8"]
    assert plugin.loaded is not None
    assert plugin.loaded["outer_step"] == 2 and plugin.loaded["node"] == "node-a"
    assert plugin.loaded["pending"] is None
    assert plugin.loaded["history"] == [{"step": 8, "ok": True}]
    for key, value in saved_baseline.items():
        assert torch.equal(plugin.loaded["baseline"]["weights"][key], value)


@dataclasses.dataclass
class VaultSection(Section):
    """An in-test plugin section with a secret."""

    token: str | None = option(None, help="A credential.", secret=True)
    repo: str = option("me/repo", help="Not secret.")


class VaultPlugin:
    @hookimpl
    def config_sections(self) -> dict[str, type]:
        return {"vault": VaultSection}


def test_secrets_are_redacted_in_the_stored_config(tmp_path: Path) -> None:
    secret = "hf_SECRET_do_not_store_1234"
    plugins.register(VaultPlugin(), name="test-vault")
    try:
        config = make_config(tmp_path, run={"max_steps": 2})
        config["vault"] = {"token": secret, "repo": "team/model"}
        _, _, trainer = train(config)
    finally:
        plugins.unregister("test-vault")
    assert trainer.config.plugins["vault"].token == secret  # the live config keeps it
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["config"]["vault"] == {"token": "<redacted>", "repo": "team/model"}
    for file in checkpoint.parent.rglob("*"):
        if file.is_file():
            assert secret.encode() not in file.read_bytes(), file
