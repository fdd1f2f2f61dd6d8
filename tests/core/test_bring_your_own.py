"""Bring your own model and data: the contract the engine promises to any nn.Module and any
dataset, exercised through the Python API and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from speedtronic import SpeedtronicConfig, cli, hookimpl, plugins
from speedtronic.data import build_dataloader
from speedtronic.engine.runtime import build_runtime, train_from_config
from speedtronic.errors import ConfigError, DataError
from speedtronic.registry import register_model, unregister_model

NAME = "core_byo_no_limits"


class NoLimits(nn.Module):
    """An embedding and a linear head, without max_seq_len/vocab_size attributes, returning a
    mapping with extra scalars: accuracy, and a `metrics` mapping."""

    def __init__(self, vocab_size: int = 64, max_seq_len: int = 16, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        logits = self.head(self.embed(input_ids))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        correct = (logits.argmax(-1) == labels).float().mean()
        return {"loss": loss, "logits": logits, "accuracy": correct, "metrics": {"lr": 3}}


@pytest.fixture
def no_limits() -> Any:
    register_model(NAME, NoLimits)
    yield NAME
    unregister_model(NAME)


def config(tmp_path: Path, **sections: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "run": {"device": "cpu", "max_steps": 4, "output_dir": str(tmp_path / "run")},
        "model": {"name": NAME, "vocab_size": 64, "max_seq_len": 16},
        "data": {"micro_batch_size": 2, "target_batch_size": 4},
        "checkpoint": {"save_final": False},
        "logging": {"log_every": 2, "progress": False},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return data


def test_the_model_section_supplies_the_limits_a_module_does_not_declare(
    tmp_path: Path, no_limits: str
) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    result = train_from_config(
        config(tmp_path), console=False, hooks=[lambda e, p: events.append((e, p))]
    )
    assert result.steps == 4
    steps = [p for e, p in events if e == "step"]
    # Extra 0-dim outputs and a `metrics` mapping are logged, averaged over the log window;
    # a name the step event already uses is prefixed.
    assert all(0.0 <= p["accuracy"] <= 1.0 for p in steps)
    assert [p["model/lr"] for p in steps] == [3.0, 3.0] and all(p["lr"] != 3.0 for p in steps)


def test_unknown_limits_name_the_keys_to_set(tmp_path: Path, no_limits: str) -> None:
    data = config(tmp_path)
    data["model"] = {"name": NAME}
    with pytest.raises(DataError, match=r"set data\.seq_len, or model\.max_seq_len"):
        train_from_config(data, console=False)


def test_validate_fails_like_train_would(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = {
        "name": "reference_transformer",
        "vocab_size": 64,
        "max_seq_len": 16,
        "n_layer": 1,
        "n_head": 2,
        "d_model": 32,
    }
    cases = {
        "unknown_model": ({"model": {"name": "no_such_model"}}, "model.name: no plugin builds"),
        "missing_text": (
            {"model": dict(model, vocab_size=256), "data": {"text_path": str(tmp_path / "nope")}},
            "nope",
        ),
        "vocab_mismatch": (
            {"model": model, "data": {"vocab_size": 100}},
            "data.vocab_size is 100 but the model's vocab_size is 64",
        ),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        code = cli.main(["validate", "--config", str(path)])
        err = capsys.readouterr().err
        assert code == 2 and message in err, (name, err)
        assert cli.main(["validate", "--config", str(path), "--config-only"]) == 0, name
        capsys.readouterr()


class Counting(Dataset):
    """Sequences counting up from their index: every sample is distinct."""

    def __init__(
        self, size: int = 64, seq_len: int = 16, vocab_size: int = 64, index: bool = True
    ) -> None:
        self.size, self.seq_len, self.vocab, self.index = size, seq_len, vocab_size, index

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = (torch.arange(self.seq_len + 1) + index * 7) % self.vocab
        sample = {"input_ids": tokens[:-1], "labels": tokens[1:]}
        return {**sample, "index": torch.tensor(index)} if self.index else sample


def counting_dataset(size: int, rank: int, num_ranks: int) -> Counting:
    """A `data.dataset` factory; it takes rank/num_ranks, so it is told them (the size shows
    what it was told)."""
    return Counting(size + 1000 * rank + 100 * num_ranks, index=False)


def test_a_dataset_factory_named_in_yaml_trains(tmp_path: Path, no_limits: str) -> None:
    data = config(
        tmp_path,
        data={"dataset": "core.test_bring_your_own:counting_dataset", "dataset_args": {"size": 32}},
    )
    runtime = build_runtime(data, console=False)
    assert "Counting (132 samples)" in runtime.data.description  # rank 0 of 1
    assert runtime.trainer.fit().steps == 4
    bad = config(tmp_path, data={"dataset": "core.test_bring_your_own:nothing_here"})
    with pytest.raises(ConfigError, match=r"^data\.dataset: .* has no attribute"):
        build_runtime(bad, console=False)
    with pytest.raises(ConfigError, match=r"^data\.dataset: must be an import path"):
        SpeedtronicConfig.from_dict({"data": {"dataset": "just a name"}})


def test_map_style_datasets_are_split_disjointly_by_data_rank(tmp_path: Path) -> None:
    class Ranked:
        def __init__(self, rank: int) -> None:
            self.rank = rank

        @hookimpl
        def data_rank(self) -> tuple[int, int]:
            return (self.rank, 2)

    seen = []
    for rank in (0, 1):
        name = plugins.register(Ranked(rank), name=f"core-test-byo-rank-{rank}")
        try:
            runtime = build_runtime(
                config(tmp_path / str(rank), model={"name": "core.toy_runs:Bigram"}),
                dataset=Counting(40),
                console=False,
            )
        finally:
            plugins.unregister(name)
        runtime.metrics.close()
        batches = [b for _, b in zip(range(10), runtime.data.iterate(0))]
        seen.append([int(i) for b in batches for i in b["index"]])
    assert set(seen[0]) == set(range(0, 40, 2)) and set(seen[1]) == set(range(1, 40, 2))


def test_build_dataloader_can_be_iterated_directly() -> None:
    source = build_dataloader(
        SpeedtronicConfig.from_dict({"data": {"micro_batch_size": 3}}), seq_len=8, vocab_size=16
    )
    for batch in source:
        assert batch["input_ids"].shape == (3, 8)
        break


@pytest.mark.slow
def test_a_register_model_without_limits_trains_from_the_cli(tmp_path: Path) -> None:
    (tmp_path / "byo_models.py").write_text(
        "from core.test_bring_your_own import NoLimits\n"
        "from speedtronic import register_model\n"
        "register_model('byo_cli_model', NoLimits)\n"
    )
    path = tmp_path / "run.json"
    data = config(tmp_path)
    data["model"]["name"] = "byo_cli_model"
    path.write_text(json.dumps(data))
    tests_dir = Path(__file__).parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "speedtronic", "train", "-c", str(path), "--plugin", "byo_models"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}:{tests_dir}"},
    )
    assert done.returncode == 0, done.stderr
    assert "accuracy=" in done.stdout and "done: 4 steps" in done.stdout
