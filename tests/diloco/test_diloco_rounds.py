"""Rounds that really average (issue 23) and the node side of issue 18, against an in-memory
store: installs only at boundaries (optimizer resets counted), the final partial delta and
the master's final round, exact resume of an upload in flight at a checkpoint, workers that
refuse unsigned globals; through the trainer: the master evaluates its globals, and the
signing key appears in no file a run writes."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from diloco_fakes import (
    SETTLE,
    MemoryTransport,
    dist_config,
    make_master,
    make_net,
    nudge,
    wait_for,
)
from diloco_runs import tiny_run
from safetensors import safe_open

from speedtronic.cli import main as cli_main
from speedtronic.runtime import build_runtime
from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic_diloco.signing import verify_file
from speedtronic_diloco.tensors import cpu_state_dict
from speedtronic_diloco.transports import PermanentTransportError, delta_path

KEY = "s3cret-diloco-key-for-tests"


def make(
    store: MemoryTransport, tmp_path: Path, events: list | None = None, **config: Any
) -> tuple[DumbDiLoCoCoordinator, torch.nn.Module]:
    model = make_net()
    coordinator = DumbDiLoCoCoordinator(
        dist_config(**config),
        model,
        hub=store,
        state_dir=tmp_path / "state",
        logger=(lambda e, p: events.append((e, p))) if events is not None else None,
    )
    return coordinator, model


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return cpu_state_dict(model.state_dict())


def floats(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in params(model).items() if v.is_floating_point()}


def stored_delta(store: MemoryTransport, node: str, step: int) -> dict[str, torch.Tensor]:
    return store.deltas()[delta_path(node, step)]


# --------------------------------------------------------------------------- install_at


@pytest.mark.parametrize("install_at", ["boundary", "any"])
def test_optimizer_resets_only_at_boundaries(tmp_path: Path, install_at: str) -> None:
    store = MemoryTransport()
    coordinator, model = make(
        store, tmp_path, inner_steps=5, poll_interval=0.0, install_at=install_at
    )
    coordinator.start()
    resets = []
    for step in range(1, 21):
        nudge(model)
        if step in (2, 8, 13):  # globals appear in the middle of inner loops
            store.publish_state(params(make_net(seed=step)), step, tmp_path)
        if coordinator.after_optimizer_step(model, step):
            resets.append(step)
    coordinator.stop()
    off_boundary = [s for s in resets if s % 5]
    if install_at == "boundary":
        assert resets == [5, 10, 15, 20] and off_boundary == []
    else:
        assert off_boundary == [2, 8, 13]
    assert coordinator.last_global_step == 13


def test_boundary_installs_what_arrived_during_the_loop_with_async_poll(tmp_path: Path) -> None:
    store = MemoryTransport()
    coordinator, model = make(
        store, tmp_path, inner_steps=5, poll_interval=0.0, async_global_poll=True
    )
    coordinator.start()
    published = params(make_net(seed=3))
    store.publish_state(published, 1, tmp_path)
    for step in (1, 2, 3):
        nudge(model)
        assert coordinator.after_optimizer_step(model, step) is False
    wait_for(lambda: coordinator._ready is not None, what="the poll lane's fetch")
    assert coordinator.last_global_step == -1  # fetched, waiting for the boundary
    nudge(model)
    assert coordinator.after_optimizer_step(model, 4) is False
    nudge(model)
    assert coordinator.after_optimizer_step(model, 5) is True
    assert coordinator.last_global_step == 1
    own = stored_delta(store, "w1", 5)
    assert set(own) == {"a.weight", "a.bias", "b.weight", "b.bias"}
    # The global does not contain this node's last inner loop yet: the node keeps it.
    for name, value in published.items():
        expected = value - own[name] if name in own else value
        torch.testing.assert_close(model.state_dict()[name], expected)
    # Once a global lists that delta as aggregated, it is installed as is.
    newer = params(make_net(seed=4))
    store.publish_state(newer, 2, tmp_path)
    store.metadata = type(store.metadata)(
        **{**store.metadata.__dict__, "processed": (("w1", 5, None),)}
    )
    for step in range(6, 10):
        nudge(model)
        coordinator.after_optimizer_step(model, step)
    wait_for(lambda: coordinator._ready is not None, what="the second fetch")
    nudge(model)
    assert coordinator.after_optimizer_step(model, 10) is True
    own10 = stored_delta(store, "w1", 10)
    for name, value in newer.items():  # minus delta 10 only: delta 5 is in this global
        expected = value - own10[name] if name in own10 else value
        torch.testing.assert_close(model.state_dict()[name], expected)
    coordinator.stop()


def test_a_failed_upload_that_the_node_kept_is_sent_again(tmp_path: Path) -> None:
    store = MemoryTransport()
    coordinator, model = make(
        store, tmp_path, inner_steps=2, poll_interval=0.0, max_retries=0, async_delta_upload=True
    )
    coordinator.start()
    start = floats(model)
    published = params(make_net(seed=3))
    store.publish_state(published, 1, tmp_path)
    release = store.hold("upload_delta")
    store.fail("upload_delta", PermanentTransportError("read-only"))
    nudge(model)
    before = floats(model)
    coordinator.after_optimizer_step(model, 2)  # dispatched, then the global is installed
    kept = {k: start[k] - before[k] for k in start}  # delta 2, kept by the node
    for name, value in floats(model).items():
        torch.testing.assert_close(value, published[name] - kept[name])
    release.set()
    assert coordinator.wait_idle(SETTLE)  # ...and then the upload failed
    assert delta_path("w1", 2) not in store.files
    installed = floats(model)
    nudge(model)
    coordinator.after_optimizer_step(model, 4)
    assert coordinator.wait_idle(SETTLE)
    resent = stored_delta(store, "w1", 4)
    now = floats(model)
    for name, value in resent.items():  # delta 4 carries the failed inner loop too
        torch.testing.assert_close(value, kept[name] + installed[name] - now[name])
    coordinator.stop()


# --------------------------------------------------------------------------- the end of a run


def test_final_partial_delta_is_uploaded_and_waited_for(tmp_path: Path) -> None:
    store = MemoryTransport()
    coordinator, model = make(store, tmp_path, inner_steps=5, async_delta_upload=True)
    coordinator.start()
    start = floats(model)
    for step in range(1, 8):
        nudge(model)
        coordinator.after_optimizer_step(model, step, final=step == 7)
    coordinator.finish()
    coordinator.stop()
    assert {p for p in store.files if p.startswith("nodes/")} == {
        delta_path("w1", 5),
        delta_path("w1", 7),
    }
    total = {k: stored_delta(store, "w1", 5)[k] + stored_delta(store, "w1", 7)[k] for k in start}
    now = params(model)
    for name, value in total.items():  # nothing lost: the two deltas are all the progress
        torch.testing.assert_close(value, start[name] - now[name])
    path = tmp_path / "d.safetensors"
    path.write_bytes(store.files[delta_path("w1", 7)])
    with safe_open(str(path), "pt") as handle:
        assert handle.metadata()["final"] == "1"


def test_master_aggregates_final_deltas_before_it_stops(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryTransport()
    events: list = []
    master, model = make(
        store,
        tmp_path,
        events,
        role="master",
        node_id="m",
        inner_steps=5,
        poll_interval=3600.0,
        round_timeout=SETTLE,
    )
    master.start()
    worker, worker_model = make(store, tmp_path / "w", inner_steps=5)
    worker.start()
    master.outer.policy.saw("w1")  # the worker has been seen: the master waits for its final
    for step in range(1, 4):
        nudge(model)
        master.after_optimizer_step(model, step, final=step == 3)
    nudge(worker_model)
    with caplog.at_level(logging.INFO, "speedtronic.diloco"):
        finishing = threading.Thread(target=master.finish)
        finishing.start()
        worker.after_optimizer_step(worker_model, 2, final=True)
        finishing.join(SETTLE)
    assert not finishing.is_alive()
    master.stop()
    rounds = [p for e, p in events if e == "outer_step"]
    assert rounds[-1]["reason"] == "final"
    assert set(rounds[-1]["included"].split(",")) == {"m@3", "w1@2"}
    final = store.metadata.outer_step
    assert f"final global: outer step {final}, path memory://test/global/" in caplog.text
    worker.stop()


# --------------------------------------------------------------------------- exact resume


def resume(
    store: MemoryTransport, tmp_path: Path, checkpoint: dict, checkpoint_model: dict
) -> tuple[DumbDiLoCoCoordinator, torch.nn.Module]:
    """A restarted process: a fresh model and coordinator loaded from the checkpoint, started."""
    resumed = make_net(seed=7)
    resumed.load_state_dict(checkpoint_model)
    second = DumbDiLoCoCoordinator(
        dist_config(inner_steps=2), resumed, hub=store, state_dir=tmp_path / "state"
    )
    second.load_state_dict(checkpoint)
    second.start()
    return second, resumed


def assert_deltas_add_up(
    store: MemoryTransport, steps: list[int], start: dict, model: torch.nn.Module
) -> None:
    """The stored deltas of w1 at ``steps`` sum to exactly the progress from ``start``: no
    progress sent twice, none lost."""
    now = params(model)
    for name in start:
        total = sum(stored_delta(store, "w1", step)[name] for step in steps)
        torch.testing.assert_close(total, start[name] - now[name])


def test_resume_after_an_upload_landed_past_the_checkpoint_sends_nothing_twice(
    tmp_path: Path,
) -> None:
    store = MemoryTransport()
    first, model = make(store, tmp_path, inner_steps=2, async_delta_upload=True)
    first.start()
    start = floats(model)
    release = store.hold("upload_delta")
    nudge(model)
    first.after_optimizer_step(model, 1)
    nudge(model)
    first.after_optimizer_step(model, 2)  # dispatched; the upload waits
    checkpoint = first.state_dict()
    checkpoint_model = params(model)
    assert checkpoint["pending_delta_step"] == 2 and checkpoint["pending_delta"]["upload_id"]
    release.set()
    assert first.wait_idle(SETTLE)  # it landed after the checkpoint...
    first.stop()  # ...and the process died
    second, resumed = resume(store, tmp_path, checkpoint, checkpoint_model)
    assert second.state_dict()["pending_delta"] is None
    nudge(resumed, 0.5)
    second.after_optimizer_step(resumed, 4)
    second.stop()
    assert_deltas_add_up(store, [2, 4], start, resumed)


def test_a_delta_that_lands_after_the_resume_asked_is_still_not_sent_twice(
    tmp_path: Path,
) -> None:
    """The store says "not there" at resume (a Hub commit the server was still finishing),
    and the delta lands before the next boundary: that boundary asks again first."""
    store = MemoryTransport()
    first, model = make(store, tmp_path, inner_steps=2, async_delta_upload=True)
    first.start()
    start = floats(model)
    release = store.hold("upload_delta")
    nudge(model)
    first.after_optimizer_step(model, 2)
    checkpoint, checkpoint_model = first.state_dict(), params(model)
    release.set()
    assert first.wait_idle(SETTLE)
    first.stop()
    late = store.files.pop(delta_path("w1", 2))  # not visible yet when the resumed node asks
    second, resumed = resume(store, tmp_path, checkpoint, checkpoint_model)
    assert second.state_dict()["pending_delta"] is not None  # still open: asked once
    store.files[delta_path("w1", 2)] = late  # the late commit lands
    nudge(resumed, 0.5)
    second.after_optimizer_step(resumed, 4)
    second.stop()
    assert_deltas_add_up(store, [2, 4], start, resumed)


def test_resume_after_a_failed_upload_sends_it_again(tmp_path: Path) -> None:
    store = MemoryTransport()
    first, model = make(store, tmp_path, inner_steps=2, async_delta_upload=True, max_retries=0)
    first.start()
    start = floats(model)
    release = store.hold("upload_delta")
    store.fail("upload_delta", PermanentTransportError("store is read-only"))
    nudge(model)
    first.after_optimizer_step(model, 2)
    checkpoint = first.state_dict()
    checkpoint_model = params(model)
    assert checkpoint["pending_delta_step"] == 2
    release.set()
    assert first.wait_idle(SETTLE)
    first.stop()
    assert delta_path("w1", 2) not in store.files
    store._holds.clear()
    second, resumed = resume(store, tmp_path, checkpoint, checkpoint_model)
    nudge(resumed, 0.5)
    second.after_optimizer_step(resumed, 4)
    second.stop()
    assert_deltas_add_up(store, [4], start, resumed)  # cumulative: nothing lost


# --------------------------------------------------------------------------- signed globals


def test_workers_refuse_unsigned_and_wrongly_signed_globals(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryTransport()
    worker, model = make(store, tmp_path, signing_key=KEY, poll_interval=0.0, install_at="any")
    worker.start()
    before = params(model)
    store.publish_state(params(make_net(seed=1)), 1, tmp_path)  # unsigned
    with caplog.at_level(logging.ERROR, "speedtronic.diloco"):
        assert worker.after_optimizer_step(model, 1) is False
    assert "refusing global outer step 1: unsigned" in caplog.text
    for name, value in before.items():
        torch.testing.assert_close(model.state_dict()[name], value)
    # A master with the key publishes signed globals: those are installed.
    loop = make_master(
        store,
        tmp_path,
        state_dir=tmp_path / "m",
        cache_dir=tmp_path / "mc",
        rules={"signing_key": KEY.encode()},
    )
    loop.keeper.bootstrap(params(make_net(seed=2)))
    loop.keeper.outer_step = 2
    loop.publish()
    assert worker.after_optimizer_step(model, 2) is True
    assert worker.last_global_step == 2
    worker.stop()


# --------------------------------------------------------------------------- through the trainer


def run_config(tmp_path: Path, **distributed: Any) -> dict[str, Any]:
    return tiny_run(
        tmp_path,
        run={"max_steps": 10},
        logging={"log_every": 5, "json_file": str(tmp_path / "m.jsonl")},
        checkpoint={"interval": 5},
        eval={"at_end": True, "batches": 2},
        distributed=distributed,
    )


def test_master_evaluates_each_global_it_publishes(tmp_path: Path) -> None:
    events: list = []
    runtime = build_runtime(
        run_config(tmp_path), console=False, hooks=[lambda e, p: events.append((e, dict(p)))]
    )
    runtime.trainer.fit()
    evals = [p for e, p in events if e == "outer_eval"]
    rounds = [p for e, p in events if e == "outer_step"]
    assert evals and [p["outer_step"] for p in evals] == [p["outer_step"] for p in rounds]
    assert all(p["loss"] > 0 and p["ppl"] > 1 for p in evals)
    meta = json.loads((tmp_path / "store" / "global" / "step_count.json").read_text())
    assert meta["extra"]["eval_loss"] == pytest.approx(evals[-1]["loss"])
    assert meta["outer_step"] == rounds[-1]["outer_step"]
    finals = [p for e, p in events if e == "final_global"]
    assert finals and finals[0]["outer_step"] == meta["outer_step"]


@pytest.mark.parametrize("through", ["config", "environment"])
def test_the_signing_key_is_in_no_file_a_run_writes(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    through: str,
) -> None:
    if through == "config":
        config = run_config(tmp_path, signing_key=KEY)
    else:
        monkeypatch.setenv("SPEEDTRONIC_DILOCO_KEY", KEY)
        config = run_config(tmp_path)
    with caplog.at_level(logging.DEBUG):
        # The worker first: a worker started after its master finished uploads nothing.
        worker = build_runtime(
            run_config(tmp_path, role="worker", node_id="w", signing_key=KEY)
            | {"run": {**config["run"], "output_dir": str(tmp_path / "w")}},
            console=False,
        )
        worker.trainer.fit()
        runtime = build_runtime(config, console=False)
        runtime.trainer.fit()
    metadata = (tmp_path / "store" / "global" / "step_count.json").read_text()
    assert '"outer_step"' in metadata
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(config))
    assert cli_main(["validate", "-c", str(config_file)]) == 0
    printed = capsys.readouterr()
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p != config_file]
    assert any(p.suffix == ".safetensors" for p in written)
    assert any("checkpoint" in str(p) or "step_" in p.name for p in written)
    needle = KEY.encode()
    leaks = [str(p) for p in written if needle in p.read_bytes()]
    assert leaks == []
    assert KEY not in printed.out and KEY not in printed.err
    assert KEY not in caplog.text
    # And the key was used: the store's globals verify with it.
    globals_ = list((tmp_path / "store" / "global").glob("v*.safetensors"))
    assert globals_ and all(verify_file(p, needle) for p in globals_)
