"""The coordinator and the outer loop on the Hub transport (built from config, talking HTTP to
the emulator): a tampered global is rejected with a warning and the next one is installed, and
a master that lost a race to another master says so instead of overwriting its work."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from diloco_fakes import dist_config, make_master, make_net, nudge
from hub_emulator import HubEmulator
from hub_fixtures import REPO, TOKEN, hub_fixture, transport  # noqa: F401

from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.tensors import cpu_state_dict, save_tensors
from speedtronic_diloco.transports import GLOBAL_METADATA, GLOBAL_WEIGHTS, GlobalMetadata
from speedtronic_diloco.transports.hub import HubTransport


def _publish_net(
    store: HubTransport, tmp_path: Path, outer_step: int, seed: int, master: str = "node-a"
) -> None:
    path = save_tensors(
        tmp_path / f"net{seed}.safetensors", cpu_state_dict(make_net(seed).state_dict())
    )
    store.publish_global(path, GlobalMetadata.for_file(path, outer_step, master=master))


def _same(model: torch.nn.Module, seed: int) -> bool:
    expected = make_net(seed).state_dict()
    return all(torch.equal(value, expected[name]) for name, value in model.state_dict().items())


def test_worker_skips_a_tampered_global_then_installs_the_next(
    hub: HubEmulator, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hub.add_repo(REPO, private=True)
    master = transport(hub)
    _publish_net(master, tmp_path, 1, seed=1)
    weights = hub.files(REPO)[GLOBAL_WEIGHTS]
    hub.tamper(REPO, GLOBAL_WEIGHTS, weights[:-4] + b"\x00\x00\x80\x7f")  # a NaN, same size

    config = dist_config(
        repo_id=REPO,
        endpoint=hub.endpoint,
        token=TOKEN,
        max_retries=2,
        keep_own_progress=False,  # the installed model is exactly the global
    )
    model = make_net(0)
    worker = DumbDiLoCoCoordinator(config, model, state_dir=tmp_path / "state")
    assert isinstance(worker.transport, HubTransport)
    with caplog.at_level(logging.WARNING):
        worker.start()
    try:
        assert _same(model, 0), "tampered weights were installed"
        assert any("sha256" in r.getMessage() for r in caplog.records), caplog.text
        downloads = [r for r in hub.requests if r.method == "GET" and GLOBAL_WEIGHTS in r.path]
        assert len(downloads) == 3  # downloaded again on each retry, rejected each time
        assert not list((tmp_path / "state").rglob("outer_*.safetensors"))  # nothing cached

        _publish_net(master, tmp_path, 2, seed=2)
        nudge(model)
        assert worker.after_optimizer_step(model, config.inner_steps)  # boundary: poll
        assert worker.last_global_step == 2 and _same(model, 2)
    finally:
        worker.stop()
    assert TOKEN not in caplog.text


def test_master_that_lost_the_race_warns_and_keeps_the_other_global(
    hub: HubEmulator, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hub.add_repo(REPO, private=True)
    loop = make_master(transport(hub), tmp_path, retry=RetryPolicy(retries=3, backoff=0.0))
    loop.keeper.bootstrap(cpu_state_dict(make_net(0).state_dict()))
    assert loop.publish() is not None
    state = make_net(0).state_dict()
    delta = {k: torch.full_like(v, 0.1) for k, v in state.items() if v.is_floating_point()}
    transport(hub).upload_delta("w1", 2, save_tensors(tmp_path / "delta.safetensors", delta))
    # Another master commits outer step 1 just before this master's commit arrives.
    other = transport(hub)
    hub.inject_call("commit", lambda: _publish_net(other, tmp_path, 1, seed=9, master="node-z"))

    with caplog.at_level(logging.WARNING):
        result = loop.run_round()

    assert result is not None and result.outer_step == 1
    assert "Run exactly one master" in caplog.text and "412" in caplog.text
    assert GlobalMetadata.loads(hub.files(REPO)[GLOBAL_METADATA]).master == "node-z"
    commits = [r.status for r in hub.requests if r.kind == "commit"]
    assert commits[-1] == 412  # refused, and not retried: the conflict is permanent
