"""Fixtures for the W&B/TensorBoard sink tests: a tiny CPU run, offline W&B, in-test plugins,
captured warnings."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from speedtronic import SpeedtronicConfig
from speedtronic.plugins import register, unregister

# Small enough that a run is dominated by start-up, not by training.
TINY_MODEL = {
    "name": "reference_transformer",
    "vocab_size": 64,
    "max_seq_len": 16,
    "n_layer": 1,
    "n_head": 2,
    "n_kv_head": 1,
    "d_model": 16,
}


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B offline, its own caches in tmp_path, and nothing of it read from the user's home."""
    home = tmp_path / "wandb-home"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(home / var.lower()))
    monkeypatch.delenv("WANDB_DIR", raising=False)


def build_tiny_config(output_dir: Path, **sections: Any) -> SpeedtronicConfig:
    data: dict[str, Any] = {
        "run": {"name": "tiny", "device": "cpu", "max_steps": 6, "output_dir": str(output_dir)},
        "model": dict(TINY_MODEL),
        "data": {"micro_batch_size": 2},
        "precision": {"mode": "fp32"},
        "logging": {
            "log_every": 2,
            "json_file": str(output_dir / "metrics.jsonl"),
            "progress": False,
        },
    }
    data.update(sections)
    return SpeedtronicConfig.from_dict(data)


@pytest.fixture
def tiny_config() -> Callable[..., SpeedtronicConfig]:
    """Factory: a 6-step CPU run of a tiny reference transformer logging every 2 steps, plus
    the given top-level sections (``wandb={...}``, ``tensorboard={...}``)."""
    return build_tiny_config


class LogRecords(logging.Handler):
    """Collects records of one logger, whatever the propagation settings of its parents."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def warnings(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= logging.WARNING]


@pytest.fixture
def logging_records() -> Iterator[LogRecords]:
    """Records emitted by the ``speedtronic.logging`` logger during the test."""
    handler = LogRecords()
    logger = logging.getLogger("speedtronic.logging")
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(previous)


@pytest.fixture
def plugins() -> Iterator[Callable[..., None]]:
    """Register in-test plugins for one test: ``plugins(obj, ...)``."""
    names: list[str] = []

    def add(*objects: Any) -> None:
        for obj in objects:
            names.append(register(obj, name=f"test-{type(obj).__name__}-{len(names)}"))

    yield add
    for name in names:
        unregister(name)
