"""`--global`: the store's current global weights, read without joining the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_runs import tiny_run

from speedtronic import SpeedtronicConfig, cli
from speedtronic.errors import TransportError
from speedtronic.registry import build_model_from_hook
from speedtronic.runtime import train_from_config
from speedtronic_diloco.global_weights import read_global_state
from speedtronic_diloco.tensors import load_tensors
from speedtronic_diloco.transports import open_transport

MODEL = {"vocab_size": 64, "d_model": 32, "n_kv_head": None}  # of the tiny run's


def master_config(tmp_path: Path, **distributed: Any) -> dict[str, Any]:
    return tiny_run(
        tmp_path,
        run={"name": None, "seed": None, "max_steps": 6, "output_dir": str(tmp_path / "master")},
        model=MODEL,
        data={"micro_batch_size": 2},
        precision=None,
        checkpoint={"save_final": False},
        eval={"batches": 2},
        distributed={
            "node_id": "master",
            "repo_id": f"file://{tmp_path / 'store'}",
            "inner_steps": 3,
            "poll_interval": None,
            "max_retries": None,
            **distributed,
        },
    )


def test_the_global_weights_are_read_exactly_and_scored_by_eval(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = master_config(tmp_path)
    config = SpeedtronicConfig.from_dict(data)
    model = build_model_from_hook(config.model.name, **config.model.params)
    with pytest.raises(TransportError, match="no global weights published yet"):
        read_global_state(config.distributed, model)
    train_from_config(data, console=False)
    weights = read_global_state(config.distributed, model)
    store = open_transport(config.distributed)
    metadata = store.read_global_metadata()
    published, _ = load_tensors(store.download_global(metadata, tmp_path / "copy.safetensors"))
    assert set(weights) == set(model.state_dict())
    assert all(torch.equal(weights[name], published[name]) for name in weights)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data))
    assert cli.main(["eval", "--config", str(path), "--global", "--format", "json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["weights"] == "the store's global weights" and record["loss"] > 0


def test_an_unsigned_global_is_refused_when_a_key_is_set(tmp_path: Path) -> None:
    train_from_config(master_config(tmp_path), console=False)  # publishes unsigned globals
    keyed = SpeedtronicConfig.from_dict(master_config(tmp_path, signing_key="k" * 32))
    model = build_model_from_hook(keyed.model.name, **keyed.model.params)
    with pytest.raises(TransportError, match="not signed") as refused:
        read_global_state(keyed.distributed, model)
    assert "global/v" in str(refused.value) and "speedtronic-global-" not in str(refused.value)
