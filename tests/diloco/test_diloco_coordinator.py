"""DumbDiLoCoCoordinator against an in-memory transport: startup, polling, uploads and the
baseline rules, the async lanes, state, stop, and every row of the failure-semantics table."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_fakes import SETTLE, MemoryTransport, dist_config, make_net, nudge, wait_for
from safetensors.torch import load

from speedtronic.errors import ConfigError
from speedtronic_diloco import coordinator as coordinator_module
from speedtronic_diloco.coordinator import DumbDiLoCo, DumbDiLoCoCoordinator
from speedtronic_diloco.tensors import cpu_state_dict
from speedtronic_diloco.transports import PermanentTransportError, TransientTransportError


@pytest.fixture
def store() -> MemoryTransport:
    return MemoryTransport()


def make(
    store: MemoryTransport,
    tmp_path: Path,
    model: Any = None,
    events: list | None = None,
    **config: Any,
) -> tuple[DumbDiLoCoCoordinator, torch.nn.Module]:
    model = model if model is not None else make_net()
    logger = (
        (lambda event, payload: events.append((event, payload))) if events is not None else None
    )
    coordinator = DumbDiLoCoCoordinator(
        dist_config(**config), model, hub=store, state_dir=tmp_path / "state", logger=logger
    )
    return coordinator, model


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return cpu_state_dict(model.state_dict())


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def only_delta(store: MemoryTransport) -> dict[str, torch.Tensor]:
    (delta,) = store.deltas().values()
    return delta


# --------------------------------------------------------------------------- construction


def test_alias_and_config_forms(store: MemoryTransport, tmp_path: Path) -> None:
    assert DumbDiLoCo is DumbDiLoCoCoordinator
    from speedtronic.config import SpeedtronicConfig

    root = {"distributed": {"enabled": True, "node_id": "n1", "repo_id": "/abs/store"}}
    for config in (root, SpeedtronicConfig.from_dict(root), dist_config(node_id="n1")):
        coordinator = DumbDiLoCoCoordinator(config, make_net(), hub=store, state_dir=tmp_path)
        assert coordinator.node_id == "n1"
        assert coordinator.state_root == tmp_path / "n1"


def test_node_id_from_environment_is_validated(
    store: MemoryTransport, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_USERNAME", "../evil")
    with pytest.raises(ConfigError, match="HF_USERNAME"):
        DumbDiLoCoCoordinator(dist_config(node_id=None), make_net(), hub=store, state_dir=tmp_path)
    monkeypatch.delenv("HF_USERNAME")
    monkeypatch.setenv("USER", "alice")
    assert (
        DumbDiLoCoCoordinator(
            dist_config(node_id=None), make_net(), hub=store, state_dir=tmp_path
        ).node_id
        == "alice"
    )
    monkeypatch.delenv("USER")
    assert (
        DumbDiLoCoCoordinator(
            dist_config(node_id=None), make_net(), hub=store, state_dir=tmp_path
        ).node_id
        == "local"
    )


def test_caches_are_keyed_by_node_id(store: MemoryTransport, tmp_path: Path) -> None:
    shared = str(tmp_path / "cache")
    a, _ = make(store, tmp_path, node_id="a", cache_dir=shared)
    b, _ = make(store, tmp_path, node_id="b", cache_dir=shared)
    assert a.cache_dir != b.cache_dir
    assert a.cache_dir.name == "a" and b.cache_dir.name == "b"


# --------------------------------------------------------------------------- worker startup


def test_worker_start_installs_the_published_global(store: MemoryTransport, tmp_path: Path) -> None:
    published = params(make_net(seed=1))
    published["counter"] = torch.tensor(7)
    store.publish_state(published, 3, tmp_path)
    coordinator, model = make(store, tmp_path)
    coordinator.start()
    assert_same(params(model), published)  # integer buffers travel with globals
    assert coordinator.last_global_step == 3
    assert coordinator.outer_step == 3
    coordinator.stop()


def test_worker_start_without_global_keeps_local_weights(
    store: MemoryTransport, tmp_path: Path
) -> None:
    coordinator, model = make(store, tmp_path)
    before = params(model)
    coordinator.start()
    assert_same(params(model), before)
    assert coordinator.last_global_step == -1
    coordinator.stop()


@pytest.mark.parametrize(
    "error", [TransientTransportError("timeout"), PermanentTransportError("401")]
)
def test_failure_initial_worker_read_warns_and_keeps_weights(
    store: MemoryTransport, tmp_path: Path, caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    store.publish_state(params(make_net(seed=1)), 2, tmp_path)
    store.fail("read_global_metadata", error, times=5)
    coordinator, model = make(store, tmp_path)
    before = params(model)
    with caplog.at_level(logging.WARNING, "speedtronic.diloco"):
        coordinator.start()
    assert_same(params(model), before)
    assert "training on local weights" in caplog.text
    expected_calls = 3 if isinstance(error, TransientTransportError) else 1  # max_retries=2
    assert store.count("read_global_metadata") == expected_calls
    coordinator.stop()


def test_installation_is_shape_filtered(store: MemoryTransport, tmp_path: Path) -> None:
    incoming = params(make_net(seed=1))
    incoming.pop("b.bias")  # missing key: kept
    incoming["a.weight"] = torch.zeros(3, 3)  # other shape: ignored
    incoming["extra.weight"] = torch.ones(2)  # unknown key: ignored
    store.publish_state(incoming, 1, tmp_path)
    coordinator, model = make(store, tmp_path)
    before = params(model)
    coordinator.start()
    after = params(model)
    torch.testing.assert_close(after["a.bias"], incoming["a.bias"])
    torch.testing.assert_close(after["b.weight"], incoming["b.weight"])
    torch.testing.assert_close(after["a.weight"], before["a.weight"])
    torch.testing.assert_close(after["b.bias"], before["b.bias"])
    # The whole local model, not just the installed part, is the new baseline.
    nudge(model)
    coordinator.after_optimizer_step(model, 2)
    torch.testing.assert_close(only_delta(store)["a.weight"], torch.full((4, 4), -0.01))
    coordinator.stop()


# --------------------------------------------------------------------------- polling


def test_boundary_uploads_delta_and_polls(store: MemoryTransport, tmp_path: Path) -> None:
    coordinator, model = make(store, tmp_path, inner_steps=3)
    coordinator.start()
    start = params(model)
    reads = store.count("read_global_metadata")
    for step in (1, 2):
        nudge(model)
        assert coordinator.after_optimizer_step(model, step) is False
    assert store.count("upload_delta") == 0
    assert store.count("read_global_metadata") == reads  # poll_interval not elapsed
    nudge(model)
    assert coordinator.after_optimizer_step(model, 3) is True
    assert store.count("read_global_metadata") == reads + 1
    delta = store.deltas()["nodes/w1/delta_3.safetensors"]
    assert "counter" not in delta  # non-floating buffers never travel in deltas
    now = params(model)
    for key, value in delta.items():
        torch.testing.assert_close(value, start[key] - now[key])
    assert coordinator.local_step == 3
    coordinator.stop()


def test_poll_interval_polls_between_boundaries(store: MemoryTransport, tmp_path: Path) -> None:
    coordinator, model = make(store, tmp_path, inner_steps=100, poll_interval=0.0, install_at="any")
    coordinator.start()
    reads = store.count("read_global_metadata")
    store.publish_state(params(make_net(seed=1)), 1, tmp_path)
    assert coordinator.after_optimizer_step(model, 1) is True  # loaded mid inner loop
    assert store.count("read_global_metadata") == reads + 1
    assert coordinator.last_global_step == 1
    assert coordinator.after_optimizer_step(model, 2) is False  # same version: ignored
    assert store.count("download_global") == 1
    coordinator.stop()


def test_failure_poll_warns_and_leaves_model(
    store: MemoryTransport, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    coordinator, model = make(store, tmp_path, poll_interval=0.0, inner_steps=100, install_at="any")
    coordinator.start()
    store.publish_state(params(make_net(seed=1)), 1, tmp_path)
    store.fail("download_global", TransientTransportError("503"), times=3)
    before = params(model)
    with caplog.at_level(logging.WARNING, "speedtronic.diloco"):
        assert coordinator.after_optimizer_step(model, 1) is False
    assert_same(params(model), before)
    assert "downloading global outer step 1 failed" in caplog.text
    assert coordinator.after_optimizer_step(model, 2) is True  # the next poll recovers
    coordinator.stop()


def test_failure_corrupt_cache_entry_is_deleted_and_downloaded_again(
    store: MemoryTransport, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    published = params(make_net(seed=1))
    store.publish_state(published, 4, tmp_path)
    first, _ = make(store, tmp_path)
    first.start()
    first.stop()
    assert store.count("download_global") == 1
    # A valid cache entry is used without downloading.
    second, model = make(store, tmp_path)
    second.start()
    second.stop()
    assert store.count("download_global") == 1
    assert_same(params(model), published)
    (cached,) = (first.cache_dir / "global").glob("outer_*.safetensors")
    cached.write_bytes(b"garbage")
    third, model = make(store, tmp_path)
    with caplog.at_level(logging.WARNING, "speedtronic.diloco"):
        third.start()
    assert "corrupt" in caplog.text
    assert store.count("download_global") == 2
    assert_same(params(model), published)
    third.stop()


# --------------------------------------------------------------------------- uploads


def test_failure_upload_keeps_baseline_then_sends_cumulative_delta(
    store: MemoryTransport, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    events: list = []
    coordinator, model = make(store, tmp_path, events=events)
    coordinator.start()
    start = params(model)
    store.fail("upload_delta", PermanentTransportError("403"))
    nudge(model)
    coordinator.after_optimizer_step(model, 1)
    nudge(model)
    with caplog.at_level(logging.WARNING, "speedtronic.diloco"):
        assert coordinator.after_optimizer_step(model, 2) is False
    assert "cumulative" in caplog.text
    assert store.deltas() == {}
    assert [e for e, _ in events].count("delta_upload_failed") == 1
    nudge(model)
    coordinator.after_optimizer_step(model, 3)
    nudge(model)
    assert coordinator.after_optimizer_step(model, 4) is True
    now = params(model)
    delta = store.deltas()["nodes/w1/delta_4.safetensors"]
    for key, value in delta.items():  # four steps' worth: measured from the old baseline
        torch.testing.assert_close(value, start[key] - now[key])
    coordinator.stop()


def test_transient_upload_failure_is_retried(store: MemoryTransport, tmp_path: Path) -> None:
    coordinator, model = make(store, tmp_path)
    coordinator.start()
    store.fail("upload_delta", TransientTransportError("reset"), times=2)
    nudge(model)
    assert coordinator.after_optimizer_step(model, 2) is True
    assert store.count("upload_delta") == 3
    coordinator.stop()


def test_successful_upload_advances_baseline(store: MemoryTransport, tmp_path: Path) -> None:
    coordinator, model = make(store, tmp_path)
    coordinator.start()
    nudge(model)
    coordinator.after_optimizer_step(model, 2)
    after_first = params(model)
    nudge(model, 0.5)
    coordinator.after_optimizer_step(model, 4)
    delta = store.deltas()["nodes/w1/delta_4.safetensors"]
    now = params(model)
    for key, value in delta.items():
        torch.testing.assert_close(value, after_first[key] - now[key])
    coordinator.stop()


def test_failure_key_or_shape_mismatch_logs_error_and_uploads_nothing(
    store: MemoryTransport, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    coordinator, model = make(store, tmp_path)
    coordinator.start()
    model.a = torch.nn.Linear(4, 5)  # the model changed shape behind the coordinator's back
    model.b = torch.nn.Linear(5, 1)
    with caplog.at_level(logging.ERROR, "speedtronic.diloco"):
        assert coordinator.after_optimizer_step(model, 2) is False
    assert "no delta uploaded" in caplog.text
    assert store.count("upload_delta") == 0
    nudge(model)
    coordinator.after_optimizer_step(model, 4)  # measured from the new shapes from here on
    assert store.count("upload_delta") == 1
    coordinator.stop()


def test_failure_wrong_model_raises_value_error(store: MemoryTransport, tmp_path: Path) -> None:
    coordinator, _ = make(store, tmp_path)
    coordinator.start()
    with pytest.raises(ValueError, match="different model"):
        coordinator.after_optimizer_step(make_net(), 1)
    coordinator.stop()


# --------------------------------------------------------------------------- async lanes


def test_async_upload_does_not_block_and_skips_while_busy(
    store: MemoryTransport, tmp_path: Path
) -> None:
    events: list = []
    coordinator, model = make(store, tmp_path, events=events, async_delta_upload=True)
    coordinator.start()
    release = store.hold("upload_delta")
    nudge(model)
    assert coordinator.after_optimizer_step(model, 2) is True  # dispatched, not waited for
    assert not release.is_set()
    assert store.entered["upload_delta"].wait(SETTLE)
    nudge(model)
    assert coordinator.after_optimizer_step(model, 4) is False
    assert [e for e, _ in events].count("delta_upload_skipped") == 1
    release.set()
    assert coordinator.wait_idle(SETTLE)
    assert list(store.deltas()) == ["nodes/w1/delta_2.safetensors"]
    # The baseline advanced to the uploaded snapshot (step 2), so step 6 covers steps 3-6.
    nudge(model)
    coordinator.after_optimizer_step(model, 6)
    assert coordinator.wait_idle(SETTLE)
    torch.testing.assert_close(
        store.deltas()["nodes/w1/delta_6.safetensors"]["a.bias"], torch.full((4,), -0.02)
    )
    coordinator.stop()


def test_async_generation_guard_keeps_newer_baseline(
    store: MemoryTransport, tmp_path: Path
) -> None:
    coordinator, model = make(store, tmp_path, async_delta_upload=True, inner_steps=2)
    coordinator.start()
    release = store.hold("upload_delta")
    nudge(model)
    coordinator.after_optimizer_step(model, 2)  # upload in flight, holding the step-2 snapshot
    assert store.entered["upload_delta"].wait(SETTLE)
    published = params(make_net(seed=1))
    store.publish_state(published, 5, tmp_path)
    nudge(model)
    assert coordinator.after_optimizer_step(model, 4) is True  # polled and installed
    assert coordinator.last_global_step == 5
    release.set()
    assert coordinator.wait_idle(SETTLE)
    # The old completion must not move the baseline back to its step-2 snapshot.
    nudge(model, 0.25)
    coordinator.after_optimizer_step(model, 6)
    assert coordinator.wait_idle(SETTLE)
    delta = store.deltas()["nodes/w1/delta_6.safetensors"]
    torch.testing.assert_close(delta["a.weight"], torch.full((4, 4), -0.25))
    assert delta.keys() == {"a.weight", "a.bias", "b.weight", "b.bias"}
    coordinator.stop()


def test_async_upload_failure_leaves_baseline(store: MemoryTransport, tmp_path: Path) -> None:
    coordinator, model = make(store, tmp_path, async_delta_upload=True)
    coordinator.start()
    store.fail("upload_delta", PermanentTransportError("403"))
    nudge(model)
    assert coordinator.after_optimizer_step(model, 2) is True
    assert coordinator.wait_idle(SETTLE)
    assert store.deltas() == {}
    nudge(model)
    coordinator.after_optimizer_step(model, 4)
    assert coordinator.wait_idle(SETTLE)
    torch.testing.assert_close(
        store.deltas()["nodes/w1/delta_4.safetensors"]["b.bias"], torch.full((1,), -0.02)
    )
    coordinator.stop()


def test_async_poll_never_touches_the_live_model(store: MemoryTransport, tmp_path: Path) -> None:
    coordinator, model = make(
        store,
        tmp_path,
        async_global_poll=True,
        inner_steps=100,
        poll_interval=0.0,
        install_at="any",
    )
    coordinator.start()
    published = params(make_net(seed=1))
    store.publish_state(published, 1, tmp_path)
    before = params(model)
    release = store.hold("download_global")
    assert coordinator.after_optimizer_step(model, 2) is False  # the poll was only requested
    assert store.entered["download_global"].wait(SETTLE)
    release.set()
    assert coordinator.wait_idle(SETTLE)
    assert_same(params(model), before)  # fetched, but not installed by the lane
    assert coordinator.last_global_step == -1
    assert coordinator.after_optimizer_step(model, 3) is True  # installed by the callback
    assert_same(params(model), published)
    coordinator.stop()


# --------------------------------------------------------------------------- state, stop


def test_state_dict_fields(store: MemoryTransport, tmp_path: Path) -> None:
    coordinator, model = make(store, tmp_path)
    coordinator.start()
    nudge(model)
    coordinator.after_optimizer_step(model, 2)
    state = coordinator.state_dict()
    assert {
        "node_id",
        "role",
        "last_global_step",
        "last_uploaded_step",
        "local_step",
        "baseline",
        "pending_delta",
        "pending_delta_step",
    } <= state.keys()
    assert "outer" not in state
    assert state["local_step"] == 2 and state["last_uploaded_step"] == 2
    assert_same(state["baseline"], params(model))
    coordinator.stop()


def test_prepared_startup_state_wins_then_poll_finds_newer(
    store: MemoryTransport, tmp_path: Path
) -> None:
    store.publish_state(params(make_net(seed=1)), 1, tmp_path)
    first, model = make(store, tmp_path)
    first.start()
    nudge(model)
    first.after_optimizer_step(model, 1)
    saved = first.state_dict()
    checkpoint_model = params(model)
    first.stop()
    newer = params(make_net(seed=2))
    store.publish_state(newer, 2, tmp_path)
    # A resumed process: model weights from the checkpoint, then coordinator state, then start.
    resumed_model = make_net(seed=3)
    resumed_model.load_state_dict(checkpoint_model)
    second, _ = make(store, tmp_path, model=resumed_model, keep_own_progress=False)
    second.load_state_dict(saved)
    second.start()
    assert_same(params(resumed_model), checkpoint_model)  # no install during startup
    assert second.last_global_step == 1
    assert second.local_step == 1
    assert second.after_optimizer_step(resumed_model, 2) is True  # the first poll finds v2
    assert_same(params(resumed_model), newer)
    second.stop()


def test_load_after_start_keeps_a_newer_installed_baseline(
    store: MemoryTransport, tmp_path: Path
) -> None:
    old_state = {
        "last_global_step": 1,
        "local_step": 5,
        "last_uploaded_step": None,
        "baseline": params(make_net(seed=9)),
    }
    store.publish_state(params(make_net(seed=1)), 4, tmp_path)
    coordinator, model = make(store, tmp_path)
    coordinator.start()
    coordinator.load_state_dict(old_state)
    assert coordinator.last_global_step == 4
    nudge(model)
    coordinator.after_optimizer_step(model, 6)
    torch.testing.assert_close(only_delta(store)["a.bias"], torch.full((4,), -0.01))
    coordinator.stop()


def test_stop_is_bounded_does_not_force_a_delta_and_restarts(
    store: MemoryTransport,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(coordinator_module, "STOP_TIMEOUT", 0.2)
    coordinator, model = make(store, tmp_path, async_delta_upload=True, inner_steps=3)
    coordinator.start()
    nudge(model)
    coordinator.after_optimizer_step(model, 1)
    coordinator.stop()  # mid inner loop: nothing is uploaded
    assert store.count("upload_delta") == 0
    assert not coordinator.started
    coordinator.start()
    release = store.hold("upload_delta")
    nudge(model)
    coordinator.after_optimizer_step(model, 3)
    assert store.entered["upload_delta"].wait(SETTLE)
    with caplog.at_level(logging.WARNING, "speedtronic.diloco"):
        coordinator.stop()  # the stuck upload outlives the bounded wait
    assert "still busy" in caplog.text
    release.set()
    wait_for(lambda: "nodes/w1/delta_3.safetensors" in store.files, what="late upload")
    coordinator.start()
    nudge(model)
    assert coordinator.after_optimizer_step(model, 6) is True
    assert coordinator.wait_idle(SETTLE)
    assert "nodes/w1/delta_6.safetensors" in store.files
    coordinator.stop()


# --------------------------------------------------------------------------- reset signal


def test_reset_signal_is_pushed_or_loaded(store: MemoryTransport, tmp_path: Path) -> None:
    coordinator, model = make(store, tmp_path, inner_steps=2, poll_interval=0.0, install_at="any")
    coordinator.start()
    assert coordinator.after_optimizer_step(model, 1) is False  # nothing new
    store.publish_state(params(make_net(seed=1)), 1, tmp_path)
    assert coordinator.after_optimizer_step(model, 3) is True  # loaded mid inner loop
    store.fail("read_global_metadata", PermanentTransportError("x"))
    nudge(model)
    assert coordinator.after_optimizer_step(model, 4) is True  # pushed
    coordinator.stop()


def test_delta_file_metadata(store: MemoryTransport, tmp_path: Path) -> None:
    store.publish_state(params(make_net(seed=1)), 3, tmp_path)
    coordinator, model = make(store, tmp_path, node_id="node-7")
    coordinator.start()
    nudge(model)
    coordinator.after_optimizer_step(model, 2)
    from safetensors import safe_open

    path = tmp_path / "d.safetensors"
    path.write_bytes(store.files["nodes/node-7/delta_2.safetensors"])
    with safe_open(str(path), "pt") as handle:
        meta = handle.metadata()
    assert meta["node_id"] == "node-7"
    assert meta["local_step"] == "2"
    assert meta["base_outer_step"] == "3"
    assert load(path.read_bytes()).keys() == {"a.weight", "a.bias", "b.weight", "b.bias"}
    coordinator.stop()
