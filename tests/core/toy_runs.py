"""Tiny models, configs and training runs shared by the core tests: small enough that a run
takes milliseconds on a busy CPU, real enough to train."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from speedtronic import SpeedtronicConfig
from speedtronic.data import build_dataloader
from speedtronic.engine.runtime import build_runtime
from speedtronic.engine.trainer import Trainer, TrainResult
from speedtronic.observe.metrics import MetricLogger

VOCAB = 16
SEQ = 8

# A reference transformer small enough for many short runs, with grouped-query attention and
# dropout (so an exact resume must also restore the RNG).
TINY_TRANSFORMER = {
    "name": "reference_transformer",
    "vocab_size": 256,
    "max_seq_len": 16,
    "n_layer": 1,
    "n_head": 2,
    "n_kv_head": 1,
    "d_model": 32,
    "dropout": 0.1,
}


class Bigram(nn.Module):
    """Logits of the next token from the current one: enough to learn the synthetic rule."""

    def __init__(self, vocab_size: int = VOCAB, max_seq_len: int = SEQ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.table = nn.Embedding(vocab_size, vocab_size)

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.table(input_ids).view(-1, self.vocab_size)
        return F.cross_entropy(logits, labels.reshape(-1))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(input_ids, labels)


def merge_sections(config: dict[str, Any], sections: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with each mapping of ``sections`` merged into the section of that name (any
    other value replaces the key); returns ``config``."""
    for name, values in sections.items():
        if isinstance(values, Mapping):
            config.setdefault(name, {}).update(values)
        else:
            config[name] = values
    return config


def data_config(**data: Any) -> SpeedtronicConfig:
    """A CPU config (run.seed 1) whose ``data`` section is ``data``."""
    return SpeedtronicConfig.from_dict({"run": {"device": "cpu", "seed": 1}, "data": data})


def toy_trainer(
    model: nn.Module, config: SpeedtronicConfig, hooks: Iterable[Any] = (), **kwargs: Any
) -> Trainer:
    """A Trainer of ``model`` whose metric sinks are just ``hooks``; without ``data`` it reads
    the synthetic stream sized to the model's ``max_seq_len`` and ``vocab_size``."""
    if kwargs.get("data") is None:
        kwargs["data"] = build_dataloader(
            config, seq_len=model.max_seq_len, vocab_size=model.vocab_size
        )
    return Trainer(model, config, metric_logger=MetricLogger(hooks), **kwargs)


def tiny_transformer_run(output_dir: Path, **sections: Any) -> dict[str, Any]:
    """A 16-step fp32 CPU run of :data:`TINY_TRANSFORMER` with a checkpoint every 4 steps,
    as a config dict; ``sections`` are merged in per section."""
    config: dict[str, Any] = {
        "run": {"seed": 0, "device": "cpu", "max_steps": 16, "output_dir": str(output_dir)},
        "model": dict(TINY_TRANSFORMER),
        "data": {"micro_batch_size": 2, "target_batch_size": 4, "num_workers": 0},
        "optimizer": {"lr": 3e-3},
        "scheduler": {"warmup_steps": 2},
        "precision": {"mode": "fp32"},
        "checkpoint": {"interval": 4},
        "logging": {"log_every": 1, "progress": False},
    }
    return merge_sections(config, sections)


class EventRecorder:
    """A metric hook collecting events; ``losses`` maps step to loss."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, event: str, payload: dict[str, Any]) -> None:
        self.events.append((event, dict(payload)))

    @property
    def losses(self) -> dict[int, float]:
        return {p["step"]: p["loss"] for e, p in self.events if e == "step"}

    def named(self, event: str) -> list[dict[str, Any]]:
        return [p for e, p in self.events if e == event]


class ClosingSink:
    """A metric sink that only counts its ``close()`` calls."""

    def __init__(self) -> None:
        self.closes = 0

    def on_event(self, event: str, payload: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        self.closes += 1


def train(config: dict[str, Any], **kwargs: Any) -> tuple[TrainResult, EventRecorder, Trainer]:
    """Build the runtime for (a copy of) ``config`` and fit it, recording every metric event."""
    recorder = EventRecorder()
    runtime = build_runtime(copy.deepcopy(config), hooks=[recorder], console=False, **kwargs)
    return runtime.trainer.fit(), recorder, runtime.trainer


def metric_events(jsonl: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The complete JSON lines of a metrics file (a kill may tear the last one), of event
    ``kind`` only when given."""
    if not jsonl.exists():
        return []
    records = []
    for line in jsonl.read_text(encoding="utf-8").splitlines(keepends=True):
        if line.endswith("\n"):
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    return [r for r in records if kind is None or r["event"] == kind]
