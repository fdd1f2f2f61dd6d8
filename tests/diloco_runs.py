"""The one tiny DiLoCo run config of the test suite (tests/diloco and tests/e2e build theirs
from it): a one-layer reference transformer on the CPU, the master ``m`` of a shared-directory
store at ``tmp_path / "store"``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

TINY_MODEL = {
    "name": "reference_transformer",
    "vocab_size": 32,
    "max_seq_len": 16,
    "n_layer": 1,
    "n_head": 2,
    "n_kv_head": 1,
    "d_model": 16,
}


def tiny_run(tmp_path: Path, **sections: Mapping[str, Any] | None) -> dict[str, Any]:
    """The tiny run's config as a dict. Each keyword is a config section whose keys are added
    to (or replace) the defaults' (``run={"max_steps": 6}``, ``distributed={"fragments":
    2}``); a None value drops a key, a None section the whole section."""
    config: dict[str, dict[str, Any]] = {
        "run": {
            "name": "t",
            "max_steps": 12,
            "device": "cpu",
            "seed": 0,
            "output_dir": str(tmp_path / "run"),
        },
        "model": dict(TINY_MODEL),
        "data": {"micro_batch_size": 4},
        "precision": {"mode": "fp32"},
        "logging": {"progress": False},
        "distributed": {
            "enabled": True,
            "role": "master",
            "node_id": "m",
            "repo_id": f"file://{tmp_path}/store",
            "inner_steps": 4,
            # Async: these runs are often a lone worker or a master whose workers are fakes;
            # with sync rounds (the default) such a node would wait at every boundary.
            "rounds": "async",
            "poll_interval": 0.05,
            "max_retries": 0,
        },
    }
    for section, values in sections.items():
        if values is None:
            config.pop(section, None)
        else:
            merged = {**config.get(section, {}), **values}
            config[section] = {k: v for k, v in merged.items() if v is not None}
    return config
