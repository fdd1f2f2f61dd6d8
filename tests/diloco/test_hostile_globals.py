"""A forged whole-file global (issue 34, H1/H2): anyone with write access to an unsigned store
can put weights and a ``step_count.json`` with a matching sha256 and size there. Every reader
checks the values themselves (speedtronic_diloco.global_check): a fresh worker, a master
adopting the store's global, and ``--global`` of eval/export/generate. A refused global is one
log line and one ``global_refused`` event; the node keeps its weights, and the next good global
is installed. Real files: the shared-directory store."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_fakes import dist_config, make_net
from diloco_runs import tiny_run

from speedtronic import SpeedtronicConfig, cli
from speedtronic.errors import TransportError
from speedtronic.registry import build_model_from_hook
from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic_diloco.global_check import GlobalRefusedError, checked_global
from speedtronic_diloco.global_weights import read_global_state
from speedtronic_diloco.tensors import TensorDict, cpu_state_dict, save_tensors
from speedtronic_diloco.transports import GLOBAL_METADATA, GlobalMetadata, SharedDirectoryTransport

Forge = Callable[[TensorDict], TensorDict]


def floating(weights: TensorDict, change: Callable[[torch.Tensor], torch.Tensor]) -> TensorDict:
    return {k: change(v) if v.is_floating_point() else v for k, v in weights.items()}


def one_nan(weights: TensorDict) -> TensorDict:
    name = next(k for k, v in weights.items() if v.is_floating_point())
    poisoned = weights[name].clone()
    poisoned.view(-1)[0] = float("nan")
    return {**weights, name: poisoned}


def one_inf(weights: TensorDict) -> TensorDict:
    name = [k for k, v in weights.items() if v.is_floating_point()][-1]
    poisoned = weights[name].clone()
    poisoned.view(-1)[-1] = float("-inf")
    return {**weights, name: poisoned}


#: fault -> (what the forger writes, the refusal's reason, words of its message)
FAULTS: dict[str, tuple[Forge, str, str]] = {
    "a NaN in one tensor": (one_nan, "non_finite", "has NaN or infinite values in torch.float32"),
    "-inf in one tensor": (one_inf, "non_finite", "has NaN or infinite values in torch.float32"),
    "float64 1e300 everywhere": (
        lambda w: floating(w, lambda v: torch.full(v.shape, 1e300, dtype=torch.float64)),
        "dtype",
        "is torch.float64, the model's is torch.float32",
    ),
    "float64 of the very weights": (
        lambda w: floating(w, lambda v: v.to(torch.float64)),
        "dtype",
        "is torch.float64, the model's is torch.float32",
    ),
    "float32 1e30 everywhere": (
        lambda w: floating(w, lambda v: torch.full_like(v, 1e30)),
        "update_too_large",
        "more than max_update_ratio 10 x their norm",
    ),
    "weights 1000 x as large": (
        lambda w: floating(w, lambda v: v * 1000.0),
        "update_too_large",
        "more than max_update_ratio",
    ),
    "bfloat16 without the bf16 codec": (
        lambda w: floating(w, lambda v: v.to(torch.bfloat16)),
        "dtype",
        "is torch.bfloat16, the model's is torch.float32",
    ),
    "integer weights": (
        lambda w: floating(w, lambda v: v.to(torch.int32)),
        "dtype",
        "is torch.int32, the model's is torch.float32",
    ),
    "an extra tensor larger than the model": (
        lambda w: {**w, "padding": torch.zeros(200_000)},
        "too_large",
        "bytes listed, more than this model's weights can take",
    ),
    "complex64 weights": (
        lambda w: floating(w, lambda v: v.to(torch.complex64)),
        "dtype",
        "is torch.complex64, the model's is torch.float32",
    ),
    "a float buffer for an integer one": (
        lambda w: {**w, "counter": torch.tensor(0.5)},
        "dtype",
        "counter is torch.float32, the model's is torch.int64",
    ),
}


def shared(tmp_path: Path) -> SharedDirectoryTransport:
    store = SharedDirectoryTransport(tmp_path / "store")
    store.create_store()
    return store


def forge(
    tmp_path: Path, tensors: TensorDict, outer_step: int, header: dict[str, str] | None = None
) -> str:
    """Write ``tensors`` as the store's global of ``outer_step`` with matching metadata, as
    a writer without the key can; returns its store path."""
    name = f"global/forged-{outer_step}.safetensors"
    path = save_tensors(
        tmp_path / "store" / name, tensors, {"outer_step": str(outer_step), **(header or {})}
    )
    metadata = GlobalMetadata.for_file(path, outer_step, model_file=name)
    (tmp_path / "store" / GLOBAL_METADATA).write_bytes(metadata.dumps())
    return name


def worker_on(
    store: SharedDirectoryTransport, tmp_path: Path, **overrides: Any
) -> tuple[DumbDiLoCoCoordinator, list[tuple[str, dict[str, Any]]]]:
    events: list[tuple[str, dict[str, Any]]] = []
    worker = DumbDiLoCoCoordinator(
        dist_config(repo_id=str(tmp_path / "store"), poll_interval=0.0, **overrides),
        make_net(seed=3),
        hub=store,
        state_dir=tmp_path / "nodes",
        logger=lambda event, payload: events.append((event, payload)),
    )
    return worker, events


def refusals(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [payload for event, payload in events if event == "global_refused"]


def refusal_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refusing global" in r.getMessage()]


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fresh_worker_refuses_a_forged_global_and_keeps_its_weights(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    make, reason, words = FAULTS[fault]
    store = shared(tmp_path)
    good = cpu_state_dict(make_net(seed=1).state_dict())
    name = forge(tmp_path, make(good), 1)
    worker, events = worker_on(store, tmp_path)
    before = cpu_state_dict(worker.model.state_dict())
    with caplog.at_level(logging.ERROR, "speedtronic.diloco"):
        worker.start()  # a fresh worker installs the store's global at start...
        worker.after_optimizer_step(worker.model, 1)  # ...and polls again at each step
    (refused,) = refusals(events)  # once, not once per poll
    assert refused["reason"] == reason and refused["outer_step"] == 1
    assert refused["message"].startswith(f"{name}: ") and words in refused["message"]
    (line,) = refusal_lines(caplog)
    assert name in line and words in line and "keeping the current weights" in line
    assert str(tmp_path) not in line  # store paths, never the local cache's
    state = worker.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in before.items())
    assert worker.last_global_step == -1 and not any(e == "global_loaded" for e, _ in events)
    if reason == "too_large":  # refused from the listed size: never downloaded
        assert worker.bytes_received == 0
    # The next good global is installed as usual.
    forge(tmp_path, good, 2)
    worker.after_optimizer_step(worker.model, 2)
    assert worker.last_global_step == 2
    state = worker.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in good.items())
    worker.stop()


def test_a_truncated_global_with_matching_metadata_is_refused_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = shared(tmp_path)
    name = forge(tmp_path, cpu_state_dict(make_net(seed=1).state_dict()), 1)
    path = tmp_path / "store" / name
    path.write_bytes(path.read_bytes()[:-20])
    metadata = GlobalMetadata.for_file(path, 1, model_file=name)
    (tmp_path / "store" / GLOBAL_METADATA).write_bytes(metadata.dumps())
    worker, events = worker_on(store, tmp_path)
    with caplog.at_level(logging.ERROR, "speedtronic.diloco"):
        worker.start()
        worker.after_optimizer_step(worker.model, 1)
    (refused,) = refusals(events)
    assert refused["reason"] == "unreadable" and refused["message"].startswith(name)
    assert len(refusal_lines(caplog)) == 1 and str(tmp_path) not in refusal_lines(caplog)[0]
    assert worker.last_global_step == -1
    worker.stop()


def test_bf16_is_accepted_where_the_file_declares_the_bf16_codec(tmp_path: Path) -> None:
    good = cpu_state_dict(make_net(seed=1).state_dict())
    halved = floating(good, lambda v: v.to(torch.bfloat16))
    out = checked_global(halved, good, "g", codec="bf16", max_update_ratio=10.0)
    assert all(out[k].dtype == v.dtype for k, v in good.items())
    with pytest.raises(GlobalRefusedError, match=r"g: a\.weight is torch\.float16") as refused:
        checked_global(
            floating(good, lambda v: v.to(torch.float16)),
            good,
            "g",
            codec="bf16",
            max_update_ratio=10.0,
        )
    assert refused.value.reason == "dtype"


def test_a_nan_under_the_declared_bf16_codec_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = shared(tmp_path)
    poisoned = floating(
        one_nan(cpu_state_dict(make_net(seed=1).state_dict())), torch.Tensor.bfloat16
    )
    name = forge(tmp_path, poisoned, 1, {"codec": "bf16"})
    worker, events = worker_on(store, tmp_path)
    worker.start()
    (refused,) = refusals(events)
    assert refused["reason"] == "non_finite" and refused["message"].startswith(name)
    assert worker.last_global_step == -1
    worker.stop()


def test_a_master_does_not_adopt_a_forged_global(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = shared(tmp_path)
    forge(tmp_path, one_nan(cpu_state_dict(make_net(seed=1).state_dict())), 4)
    master, events = worker_on(store, tmp_path, role="master", node_id="m")
    own = cpu_state_dict(master.model.state_dict())
    with caplog.at_level(logging.ERROR, "speedtronic.diloco"):
        master.start()
    try:
        assert [p["reason"] for p in refusals(events)] == ["non_finite"]
        assert master.outer is not None and not master.outer.halted
        # Its own weights, numbered after the store's: never the forged ones.
        assert master.outer.outer_step >= 4
        kept = master.outer.global_state
        assert all(torch.equal(kept[k], v) for k, v in own.items())
        state = master.model.state_dict()
        assert all(torch.equal(state[k], v) for k, v in own.items())
    finally:
        master.stop()


# --------------------------------------------------------------------------- --global
MODEL = {"vocab_size": 64, "d_model": 32, "n_kv_head": None}


def global_config(tmp_path: Path) -> dict[str, Any]:
    return tiny_run(
        tmp_path,
        model=MODEL,
        data={"micro_batch_size": 2},
        precision=None,
        eval={"batches": 2},
        distributed={"node_id": "reader", "role": "worker", "repo_id": str(tmp_path / "store")},
    )


@pytest.mark.parametrize(
    "fault",
    ["a NaN in one tensor", "float64 1e300 everywhere", "an extra tensor larger than the model"],
)
def test_global_readers_refuse_a_forged_global_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fault: str
) -> None:
    make, reason, words = FAULTS[fault]
    data = global_config(tmp_path)
    config = SpeedtronicConfig.from_dict(data)
    model = build_model_from_hook(config.model.name, **config.model.params)
    shared(tmp_path)
    name = forge(tmp_path, make(cpu_state_dict(model.state_dict())), 3)
    with pytest.raises(GlobalRefusedError) as refused:
        read_global_state(config.distributed, model)
    assert refused.value.reason == reason
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data))
    base = ["--config", str(path), "--global"]
    generate = ["generate", *base, "--prompt", "hi", "--max-new-tokens", "2"]
    for command in (["eval", *base], ["export", *base, "--out", str(tmp_path / "hf")], generate):
        assert cli.main(command) != 0, command
        err = capsys.readouterr().err
        (line,) = [x for x in err.splitlines() if x.startswith("error:")]
        assert "Traceback" not in err
        assert re.search(f"refusing the global of outer step 3: {re.escape(name)}: ", line)
        assert words in line
    assert not (tmp_path / "hf").exists()


def test_global_readers_still_read_a_good_global(tmp_path: Path) -> None:
    config = SpeedtronicConfig.from_dict(global_config(tmp_path))
    model = build_model_from_hook(config.model.name, **config.model.params)
    shared(tmp_path)
    torch.manual_seed(5)
    other = build_model_from_hook(config.model.name, **config.model.params)
    forge(tmp_path, cpu_state_dict(other.state_dict()), 3)
    weights = read_global_state(config.distributed, model)
    assert all(torch.equal(weights[k], v) for k, v in other.state_dict().items())
    with pytest.raises(TransportError, match="no global weights published yet"):
        read_global_state(
            SpeedtronicConfig.from_dict(global_config(tmp_path / "empty")).distributed, model
        )


@pytest.mark.slow
def test_a_real_worker_trains_on_its_own_weights_past_a_forged_global(tmp_path: Path) -> None:
    """H1 as it was found: a fresh ``speedtronic train`` worker on an unsigned store holding a
    NaN global with matching metadata used to install it, train on NaN and exit 0."""
    data = tiny_run(
        tmp_path,
        run={"max_steps": 8, "threads": 1},
        checkpoint={"save_final": False},
        logging={"json_file": str(tmp_path / "metrics.jsonl"), "log_every": 1},
        distributed={"role": "worker", "node_id": "w1", "poll_interval": 0.0, "max_retries": 0},
    )
    config = SpeedtronicConfig.from_dict(data)
    model = build_model_from_hook(config.model.name, **config.model.params)
    shared(tmp_path)
    name = forge(tmp_path, one_nan(cpu_state_dict(model.state_dict())), 1)
    path = tmp_path / "worker.json"
    path.write_text(json.dumps(data))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("SPEEDTRONIC_LOAD_PLUGINS", None)
    command = [sys.executable, "-m", "speedtronic", "train", "--config", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert output.count("refusing global outer step 1") == 1, output[-3000:]
    assert name in output and "Traceback" not in output
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r.get("event") == "step" and "loss" in r]
    assert len(losses) == 8 and all(math.isfinite(loss) for loss in losses), losses
    refused = [r for r in records if r.get("event") == "global_refused"]
    assert len(refused) == 1 and refused[0]["reason"] == "non_finite"
