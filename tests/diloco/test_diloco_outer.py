"""The master's outer loop: Nesterov equivalence, rounds, the processed-delta ledger,
persistence, and the startup-selection table (also through the coordinator)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_fakes import (
    SETTLE,
    MemoryTransport,
    dist_config,
    make_master,
    make_net,
    nudge,
    wait_for,
)
from safetensors import safe_open

from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic_diloco.master.loop import MasterOuterLoop
from speedtronic_diloco.master.round import nesterov_step
from speedtronic_diloco.startup import StartupChoice, select_startup_state
from speedtronic_diloco.tensors import cpu_state_dict, save_tensors
from speedtronic_diloco.transports import (
    GlobalMetadata,
    PermanentTransportError,
    TransientTransportError,
)


def make_loop(
    store: MemoryTransport,
    tmp_path: Path,
    lr: float = 0.7,
    momentum: float = 0.9,
    events: list | None = None,
) -> MasterOuterLoop:
    return make_master(store, tmp_path, lr=lr, momentum=momentum, events=events, rules=None)


def upload(
    store: MemoryTransport, tmp_path: Path, node: str, step: int, delta: dict[str, torch.Tensor]
) -> None:
    path = save_tensors(
        tmp_path / "up" / f"{node}_{step}.safetensors", delta, {"node_id": node, "local_step": step}
    )
    store.upload_delta(node, step, path)


def weights() -> dict[str, torch.Tensor]:
    return cpu_state_dict(make_net().state_dict())


def random_delta(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        k: torch.randn(v.shape, generator=generator)
        for k, v in weights().items()
        if v.is_floating_point()
    }


def torch_sgd_reference(
    start: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]], lr: float, momentum: float
) -> dict[str, torch.Tensor]:
    params = {k: torch.nn.Parameter(v.clone()) for k, v in start.items() if v.is_floating_point()}
    # torch only accepts nesterov=True with a non-zero momentum; at 0 both are plain SGD.
    optimizer = torch.optim.SGD(params.values(), lr=lr, momentum=momentum, nesterov=momentum > 0)
    for grad in grads:
        for name, param in params.items():
            param.grad = grad[name].clone()
        optimizer.step()
    return {k: v.detach() for k, v in params.items()}


# --------------------------------------------------------------------------- the math


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
def test_nesterov_step_equals_torch_sgd(momentum: float) -> None:
    start = weights()
    grads = [random_delta(i) for i in range(6)]
    params = {k: v for k, v in start.items() if v.is_floating_point()}
    buffers: dict[str, torch.Tensor] = {}
    for grad in grads:
        params, buffers = nesterov_step(params, grad, buffers, lr=0.7, momentum=momentum)
    expected = torch_sgd_reference(start, grads, lr=0.7, momentum=momentum)
    for name, value in expected.items():
        torch.testing.assert_close(params[name], value, rtol=1e-6, atol=1e-6)


def test_rounds_apply_mean_delta_with_nesterov(tmp_path: Path) -> None:
    store = MemoryTransport()
    events: list = []
    loop = make_loop(store, tmp_path, events=events)
    start = weights()
    loop.keeper.bootstrap(start)
    rounds = [[random_delta(10 * r + n) for n in range(3)] for r in range(3)]
    means = []
    for r, deltas in enumerate(rounds):
        for n, delta in enumerate(deltas):
            upload(store, tmp_path, f"node{n}", (r + 1) * 5, delta)
        result = loop.run_round()
        assert result is not None and result.deltas_included == 3
        means.append({k: sum(d[k] for d in deltas) / 3 for k in deltas[0]})
    expected = torch_sgd_reference(start, means, lr=0.7, momentum=0.9)
    _, published = loop.snapshot()
    for name, value in expected.items():
        torch.testing.assert_close(published[name], value, rtol=1e-5, atol=1e-6)
    assert torch.equal(published["counter"], start["counter"])  # non-floating: untouched
    assert loop.outer_step == 3
    # Published weights and metadata match what the loop holds.
    assert store.metadata is not None and store.metadata.outer_step == 3
    assert store.metadata.deltas_included == 3
    outer_events = [p for e, p in events if e == "outer_step"]
    assert [p["outer_step"] for p in outer_events] == [1, 2, 3]
    assert all(p["deltas_found"] == 3 and p["deltas_included"] == 3 for p in outer_events)


def test_each_delta_is_aggregated_once(tmp_path: Path) -> None:
    store = MemoryTransport()
    loop = make_loop(store, tmp_path)
    loop.keeper.bootstrap(weights())
    upload(store, tmp_path, "a", 5, random_delta(1))
    assert loop.run_round().included == (("a", 5),)
    assert loop.run_round() is None  # nothing new
    upload(store, tmp_path, "b", 5, random_delta(2))  # same step, other node: no collision
    assert loop.run_round().included == (("b", 5),)
    upload(store, tmp_path, "a", 5, random_delta(3))  # a restarted node reused the name
    assert loop.run_round().included == (("a", 5),)
    assert loop.outer_step == 3


def test_bad_deltas_are_logged_and_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryTransport()
    loop = make_loop(store, tmp_path)
    loop.keeper.bootstrap(weights())
    store.files["nodes/bad/delta_5.safetensors"] = b"not safetensors"
    wrong = random_delta(1)
    wrong["a.weight"] = torch.zeros(2, 2)
    upload(store, tmp_path, "shape", 5, wrong)
    nonfinite = random_delta(2)
    nonfinite["b.bias"] = torch.tensor([float("nan")])
    upload(store, tmp_path, "nan", 5, nonfinite)
    upload(store, tmp_path, "good", 5, random_delta(3))
    with caplog.at_level(logging.ERROR, "speedtronic.diloco"):
        result = loop.run_round()
    assert result.included == (("good", 5),)
    assert set(result.rejected) == {("bad", 5), ("shape", 5), ("nan", 5)}
    for name in ("nodes/bad/delta_5", "nodes/shape/delta_5", "nodes/nan/delta_5"):
        assert name in caplog.text
    assert loop.run_round() is None  # rejected files are not downloaded again
    assert store.count("download_delta") == 4


def test_transient_download_failure_retries_next_round(tmp_path: Path) -> None:
    store = MemoryTransport()
    loop = make_loop(store, tmp_path)
    loop.retry = loop.retry.__class__(retries=0, backoff=0)
    loop.keeper.bootstrap(weights())
    upload(store, tmp_path, "a", 5, random_delta(1))

    store.fail("download_delta", TransientTransportError("503"))
    assert loop.run_round() is None
    assert loop.run_round().included == (("a", 5),)


# --------------------------------------------------------------------------- persistence


def test_state_persists_without_pickle_and_reloads(tmp_path: Path) -> None:
    store = MemoryTransport()
    loop = make_loop(store, tmp_path)
    loop.keeper.bootstrap(weights())
    for step in (5, 10):
        upload(store, tmp_path, "a", step, random_delta(step))
        loop.run_round()
    with safe_open(str(loop.keeper.state_path), "pt") as handle:
        meta = handle.metadata()
        keys = set(handle.keys())
    assert meta["outer_step"] == "2"
    etags = {info.local_step: info.etag for info in store.list_deltas()}
    assert json.loads(meta["processed"]) == [["a", 5, etags[5]], ["a", 10, etags[10]]]
    assert {k.split("/")[0] for k in keys} == {"global", "momentum"}
    again = make_loop(store, tmp_path)
    assert again.keeper.has_local_state
    assert again.outer_step == 2
    assert set(again.keeper.processed) == {("a", 5), ("a", 10)}
    for name, value in loop.keeper.momentum.items():
        torch.testing.assert_close(again.keeper.momentum[name], value)
    assert again.run_round() is None  # old deltas are not aggregated again


def test_unreadable_state_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state" / "outer_state.safetensors"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"junk")
    with caplog.at_level(logging.WARNING, "speedtronic.diloco"):
        loop = make_loop(MemoryTransport(), tmp_path)
    assert not loop.keeper.has_local_state
    assert "unreadable" in caplog.text


# --------------------------------------------------------------------------- startup table


def meta(step: int) -> GlobalMetadata:
    return GlobalMetadata(outer_step=step, sha256="0" * 64, size=1)


@pytest.mark.parametrize(
    ("has_local", "local", "remote", "choice"),
    [
        (True, 3, None, StartupChoice.LOCAL),  # L > 0, remote unavailable
        (True, 3, 3, StartupChoice.LOCAL),  # R == L
        (True, 3, 2, StartupChoice.LOCAL),  # R < L
        (True, 3, 5, StartupChoice.REMOTE),  # R > L
        (False, 0, 5, StartupChoice.REMOTE),  # no local state, remote ahead
        (True, 0, 0, StartupChoice.REMOTE_INITIAL),  # L = R = 0
        (False, 0, 0, StartupChoice.REMOTE_INITIAL),
        (False, 0, None, StartupChoice.BOOTSTRAP),  # nothing anywhere
    ],
)
def test_startup_selection_table(
    has_local: bool, local: int, remote: int | None, choice: StartupChoice
) -> None:
    remote_meta = meta(remote) if remote is not None else None
    assert select_startup_state(has_local, local, remote_meta) is choice


def master(
    store: MemoryTransport, tmp_path: Path, model: Any = None, **config: Any
) -> tuple[DumbDiLoCoCoordinator, torch.nn.Module]:
    model = model if model is not None else make_net()
    values = dict(role="master", node_id="m", poll_interval=3600.0)
    values.update(config)
    coordinator = DumbDiLoCoCoordinator(
        dist_config(**values), model, hub=store, state_dir=tmp_path / "state"
    )
    return coordinator, model


def persisted_loop(store: MemoryTransport, tmp_path: Path, rounds: int) -> MasterOuterLoop:
    """A master state directory (``state/m``) that went through ``rounds`` outer steps."""
    loop = make_master(store, tmp_path, momentum=0.9, state_dir=tmp_path / "state" / "m")
    loop.keeper.bootstrap(weights())
    for r in range(rounds):
        upload(store, tmp_path, "w", 10 * (r + 1), random_delta(r))
        loop.run_round()
    return loop


def test_master_bootstrap_publishes_current_model(tmp_path: Path) -> None:
    store = MemoryTransport()
    coordinator, _ = master(store, tmp_path, collaborators=["bob"])
    coordinator.start()
    wait_for(lambda: store.metadata is not None, what="bootstrap publication")
    assert store.created == [True]  # private
    assert store.count("grant_write_access") == 1  # unsupported here: logged, not fatal
    assert store.metadata.outer_step == 0
    assert coordinator.outer_step == 0 and coordinator.last_global_step == 0
    coordinator.stop()


def test_master_local_state_wins_and_is_republished(tmp_path: Path) -> None:
    store = MemoryTransport()
    loop = persisted_loop(store, tmp_path, rounds=2)
    store.metadata = None  # the store lost its global (or publication never happened)
    coordinator, model = master(store, tmp_path)
    coordinator.start()
    _, local = loop.snapshot()
    assert coordinator.outer_step == 2 and coordinator.last_global_step == 2
    for name, value in local.items():
        torch.testing.assert_close(model.state_dict()[name], value)
    wait_for(lambda: store.metadata is not None, what="republication")
    assert store.metadata.outer_step == 2
    coordinator.stop()


def test_master_remote_ahead_wins_and_resets_momentum(tmp_path: Path) -> None:
    store = MemoryTransport()
    loop = persisted_loop(store, tmp_path, rounds=1)
    assert loop.keeper.momentum
    remote = cpu_state_dict(make_net(seed=5).state_dict())
    store.publish_state(remote, 7, tmp_path)
    coordinator, model = master(store, tmp_path)
    coordinator.start()
    assert coordinator.outer_step == 7
    assert coordinator.outer.keeper.momentum == {}
    for name, value in remote.items():
        torch.testing.assert_close(model.state_dict()[name], value)
    coordinator.stop()


def test_master_initial_remote_is_installed(tmp_path: Path) -> None:
    store = MemoryTransport()
    remote = cpu_state_dict(make_net(seed=5).state_dict())
    store.publish_state(remote, 0, tmp_path)
    coordinator, model = master(store, tmp_path)
    coordinator.start()
    for name, value in remote.items():
        torch.testing.assert_close(model.state_dict()[name], value)
    assert coordinator.outer_step == 0
    coordinator.stop()


def test_fresh_master_adopts_the_remote_ledger(tmp_path: Path) -> None:
    store = MemoryTransport()
    persisted_loop(store, tmp_path / "old", rounds=2)  # another master's history
    # That master's state is gone; only the store remembers what it aggregated.
    coordinator, _ = master(store, tmp_path)
    coordinator.start()
    assert coordinator.outer_step == 2
    coordinator.stop()
    assert coordinator.outer.run_round() is None  # the two old deltas are known
    coordinator.stop()


def test_failure_initial_create_and_grant_do_not_stop_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryTransport()
    store.fail("create_store", PermanentTransportError("403"))
    store.fail("grant_write_access", PermanentTransportError("403"))
    coordinator, model = master(store, tmp_path, collaborators=["bob"])
    with caplog.at_level(logging.WARNING, "speedtronic.diloco"):
        coordinator.start()
    assert "creating store" in caplog.text and "granting write access failed" in caplog.text
    nudge(model)
    assert coordinator.after_optimizer_step(model, 2) is True
    coordinator.stop()


def test_crash_between_persist_and_publish_republishes(tmp_path: Path) -> None:
    store = MemoryTransport()
    loop = persisted_loop(store, tmp_path, rounds=1)
    upload(store, tmp_path, "w", 99, random_delta(1))
    store.fail("publish_global", PermanentTransportError("gone"))
    loop.run_round()  # persisted as outer step 2, then "crashed" before publishing it
    assert loop.outer_step == 2 and store.metadata.outer_step == 1
    restarted, _ = master(store, tmp_path)
    restarted.start()
    assert restarted.outer_step == 2
    wait_for(lambda: store.metadata.outer_step == 2, what="republication")
    restarted.stop()
    assert restarted.outer.run_round() is None  # the delta is not aggregated twice


def test_master_installs_its_own_rounds_at_its_next_boundary(tmp_path: Path) -> None:
    store = MemoryTransport()
    coordinator, model = master(store, tmp_path, inner_steps=2)  # poll_interval: an hour
    coordinator.start()
    assert coordinator.outer.stop(SETTLE)  # rounds are driven by hand below
    nudge(model)
    coordinator.after_optimizer_step(model, 2)  # the master is a participant too
    upload(store, tmp_path, "w", 2, random_delta(1))
    coordinator.outer.run_round()
    assert coordinator.outer_step == 1
    assert coordinator.last_global_step == 0
    assert coordinator.after_optimizer_step(model, 3) is False  # no boundary, no poll due
    assert coordinator.last_global_step == 0
    assert coordinator.after_optimizer_step(model, 4) is True  # the boundary installs it
    assert coordinator.last_global_step == 1
    _, published = coordinator.outer.snapshot()
    for name, value in published.items():
        torch.testing.assert_close(model.state_dict()[name], value)
    state = coordinator.state_dict()
    assert state["outer"]["outer_step"] == 1 and set(state["outer"]) >= {"momentum", "global"}
    coordinator.stop()


def test_master_installs_its_own_rounds_at_a_poll_between_boundaries(tmp_path: Path) -> None:
    store = MemoryTransport()
    coordinator, model = master(
        store, tmp_path, inner_steps=100, poll_interval=0.0, install_at="any"
    )
    coordinator.start()
    assert coordinator.outer.stop(SETTLE)
    upload(store, tmp_path, "w", 2, random_delta(1))
    coordinator.outer.run_round()
    assert coordinator.after_optimizer_step(model, 1) is True  # poll_interval (0 s) elapsed
    assert coordinator.last_global_step == 1
    coordinator.stop()


def test_outer_thread_runs_rounds(tmp_path: Path) -> None:
    store = MemoryTransport()
    coordinator, _ = master(store, tmp_path, poll_interval=0.05)
    coordinator.start()
    upload(store, tmp_path, "w", 5, random_delta(1))
    wait_for(lambda: coordinator.outer_step == 1, what="an outer round")
    coordinator.stop()
    assert not coordinator.outer.running
