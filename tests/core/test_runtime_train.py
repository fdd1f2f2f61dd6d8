"""build_runtime / train_from_config: wiring from a config to a finished run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from core.toy_runs import Bigram, ClosingSink
from torch.utils.data import Dataset

from speedtronic import SpeedtronicConfig, SpeedtronicError, hookimpl, plugins
from speedtronic.engine.runtime import build_runtime, train_from_config
from speedtronic.engine.trainer import TrainResult

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"
TINY_MODEL = {
    "name": "reference_transformer",
    "vocab_size": 32,
    "max_seq_len": 8,
    "n_layer": 1,
    "n_head": 2,
    "d_model": 16,
}


def test_the_smoke_config_learns(tmp_path):
    config = SpeedtronicConfig.from_file(SMOKE).with_overrides(
        [
            "run.max_steps=20",
            "data.target_batch_size=8",
            "logging.log_every=5",
            f"run.output_dir={tmp_path}",
            "checkpoint.interval=0",
            "checkpoint.save_final=false",
        ]
    )
    losses: list[float] = []

    def keep_loss(event, payload):
        if event == "step":
            losses.append(payload["loss"])

    result = train_from_config(config, console=False, hooks=[keep_loss])
    assert isinstance(result, TrainResult)
    assert result.steps == 20 and len(losses) == 4
    assert losses[0] > 5.0  # about log(256) at the start
    assert result.final_loss == losses[-1] < losses[0] - 1.0


def test_build_runtime_wires_the_configured_pieces(tmp_path):
    config = {
        "run": {"device": "cpu", "max_steps": 3, "output_dir": str(tmp_path / "out")},
        "model": TINY_MODEL,
        "data": {"micro_batch_size": 2},
        "precision": {"mode": "auto"},
        "checkpoint": {"save_final": False},
        "logging": {
            "log_every": 1,
            "file": str(tmp_path / "metrics.log"),
            "json_file": str(tmp_path / "metrics.jsonl"),
        },
    }
    events: list[str] = []
    runtime = build_runtime(
        config, hooks=[lambda event, payload: events.append(event)], console=False
    )
    assert type(runtime.model).__name__ == "ReferenceTransformer"
    assert runtime.trainer.model is runtime.model
    assert runtime.trainer.metrics is runtime.metrics
    assert runtime.trainer.precision.mode == "fp32"  # auto on CPU
    assert runtime.data.description == "synthetic (vocab 32, seq 8, seed 0)"
    result = runtime.trainer.fit()
    assert (result.steps, result.samples, result.tokens) == (3, 6, 48)
    assert result.elapsed_s > 0 and result.resumed_from is None
    assert result.summary["status"] == "ok"
    assert events.count("step") == 3
    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in jsonl if r["event"] == "step"] == [1, 2, 3]
    assert len((tmp_path / "metrics.log").read_text().splitlines()) == len(jsonl)


class Pairs(Dataset):
    """(inputs, labels) samples with labels = inputs + 1."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int):
        inputs = (torch.arange(6) + index) % 10
        return inputs, (inputs + 1) % 10


def digits_bigram() -> Bigram:
    """A bigram over the ten digits of :class:`Pairs` and the digits text."""
    return Bigram(vocab_size=10, max_seq_len=6)


def test_user_model_dataset_and_tokenizer_are_passed_through(tmp_path):
    base = {
        "run": {"device": "cpu", "max_steps": 30, "output_dir": str(tmp_path)},
        "data": {"micro_batch_size": 4, "shuffle": True},
        "optimizer": {"lr": 0.1},
        "checkpoint": {"save_final": False},
        "logging": {"log_every": 10},
    }
    result = train_from_config(base, model=digits_bigram(), dataset=Pairs(), console=False)
    assert result.steps == 30 and result.samples == 120
    assert result.final_loss < 1.0  # log(10) = 2.3 before training

    text = tmp_path / "digits.txt"
    text.write_text("0123456789\n" * 50)
    tokens: list[str] = []

    def digits(chunk: str) -> list[int]:
        tokens.append(chunk)
        return [int(c) for c in chunk if c.isdigit()]

    with_text = {**base, "data": {"micro_batch_size": 4, "text_path": str(text)}}
    result = train_from_config(with_text, model=digits_bigram(), tokenizer=digits, console=False)
    assert result.steps == 30 and tokens and result.final_loss < 1.0


def test_data_seed_hook_changes_the_stream(tmp_path):
    class Seeder:
        @hookimpl
        def data_seed(self, config, seed):
            return seed + 1000

    config = {
        "run": {"device": "cpu", "max_steps": 1, "output_dir": str(tmp_path)},
        "model": TINY_MODEL,
    }
    name = plugins.register(Seeder(), name="test-runtime-seeder")
    try:
        runtime = build_runtime(config, console=False)
    finally:
        plugins.unregister(name)
    assert "seed 1000" in runtime.data.description


def test_sinks_are_closed_when_the_trainer_cannot_be_built(tmp_path):
    sink = ClosingSink()
    frozen = digits_bigram().requires_grad_(False)
    config = {"run": {"device": "cpu", "output_dir": str(tmp_path)}}
    with pytest.raises(SpeedtronicError, match="no trainable parameters"):
        build_runtime(config, model=frozen, hooks=[sink], console=False)
    assert sink.closes == 1


def test_run_threads_sets_torch_threads_for_the_process(tmp_path):
    config = {
        "run": {"device": "cpu", "max_steps": 1, "output_dir": str(tmp_path), "threads": 2},
        "model": TINY_MODEL,
        "checkpoint": {"save_final": False},
        "logging": {"progress": False},
    }
    before = torch.get_num_threads()
    try:
        build_runtime(config, console=False)
        assert torch.get_num_threads() == 2
        config["run"]["threads"] = None
        build_runtime(config, console=False)
        assert torch.get_num_threads() == 2  # null: left as the process has it
    finally:
        torch.set_num_threads(before)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(SpeedtronicError, match=r"run\.threads"):
            SpeedtronicConfig.load({**config, "run": {**config["run"], "threads": bad}})
