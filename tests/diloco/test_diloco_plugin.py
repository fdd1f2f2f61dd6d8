"""The plugin's hooks in a real Trainer: the ``distributed`` section, per-node data seeds,
coordinator start/stop, the optimizer-reset switch, checkpointed coordinator state, metrics,
and two runs in one process (one after another, and in two threads) that never share a
coordinator or a metric event.

The coordinator lives in ``trainer.plugin_state``, which the trainer empties after the run, so
tests see it through :class:`RunRecorder`, an in-test plugin that takes it during the run.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_fakes import SETTLE, wait_for
from diloco_runs import tiny_run

import speedtronic
from speedtronic import hookimpl, plugins
from speedtronic.config import SpeedtronicConfig
from speedtronic.errors import ConfigError
from speedtronic.plugins import get_plugin_manager, list_plugins
from speedtronic.runtime import build_runtime
from speedtronic_diloco import DistributedConfig, DumbDiLoCoCoordinator, SyncResult
from speedtronic_diloco.plugin import coordinator_of
from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport, shared_dir_root

DILOCO_EVENTS = {
    "delta_uploaded",
    "delta_upload_skipped",
    "delta_upload_failed",
    "global_loaded",
    "outer_step",
}


class RunRecorder:
    """An in-test plugin. Per trainer: the coordinator of its run (taken at train end, while
    ``plugin_state`` still holds it) and every event its ``on_metric`` received.

    Before each DiLoCo boundary it waits for the previous upload to finish (so no boundary is
    skipped because the machine is slow), and at train end for the lanes to be idle and the
    master's state to be published: bounded polls on conditions, never an assumption about
    speed. ``barrier`` (optional) holds every run at train start until all runs are there.
    """

    def __init__(self, barrier: threading.Barrier | None = None) -> None:
        self.barrier = barrier
        self.coordinators: dict[Any, Any] = {}
        self.events: dict[Any, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
        self._lock = threading.Lock()

    @hookimpl(trylast=True)
    def on_train_start(self, trainer: Any) -> None:
        if self.barrier is not None:
            self.barrier.wait()

    @hookimpl(tryfirst=True)
    def after_optimizer_step(self, trainer: Any, step: int) -> None:
        coordinator = coordinator_of(trainer)
        if coordinator is not None and step % coordinator.config.inner_steps == 0:
            assert coordinator.wait_idle(SETTLE), "an upload did not finish"

    @hookimpl(tryfirst=True)
    def on_train_end(self, trainer: Any) -> None:
        coordinator = coordinator_of(trainer)
        if coordinator is not None:
            outer = coordinator.outer
            wait_for(
                lambda: (
                    coordinator.wait_idle(0.05)
                    and (outer is None or outer.keeper.published_step >= outer.outer_step)
                ),
                timeout=SETTLE,
                what="uploads and publication to settle",
            )
        with self._lock:
            self.coordinators[trainer] = coordinator

    @hookimpl
    def on_metric(self, trainer: Any, event: str, payload: dict[str, Any]) -> None:
        with self._lock:
            self.events[trainer].append((event, dict(payload)))


@pytest.fixture
def recorder() -> Iterator[RunRecorder]:
    recording = RunRecorder()
    name = plugins.register(recording, name="diloco-test-recorder")
    yield recording
    plugins.unregister(name)


def config_dict(tmp_path: Path, **distributed: Any) -> dict[str, Any]:
    return tiny_run(
        tmp_path,
        logging={"log_every": 4},
        checkpoint={"interval": 6},
        distributed=distributed,
    )


def test_public_names_resolve_through_core() -> None:
    assert speedtronic.DumbDiLoCoCoordinator is DumbDiLoCoCoordinator
    assert speedtronic.DumbDiLoCo is DumbDiLoCoCoordinator
    assert speedtronic.SyncResult is SyncResult
    from speedtronic.config import DistributedConfig as seed_era_config
    from speedtronic.distributed import DumbDiLoCo as seed_era_alias
    from speedtronic.distributed import DumbDiLoCoCoordinator as seed_era_coordinator
    from speedtronic.distributed import MasterOuterLoop

    assert seed_era_config is DistributedConfig
    assert seed_era_coordinator is DumbDiLoCoCoordinator is seed_era_alias
    assert MasterOuterLoop.__module__ == "speedtronic_diloco.master.loop"
    assert SyncResult(pushed=True, loaded_global=False, outer_step=3).outer_step == 3
    (row,) = [p for p in list_plugins() if p.name == "diloco"]
    assert {"config_sections", "after_optimizer_step", "on_checkpoint", "data_seed"} <= set(
        row.hooks
    )


def test_distributed_section_is_validated_and_redacted(tmp_path: Path) -> None:
    data = config_dict(tmp_path, token="hf_secret")
    config = SpeedtronicConfig.from_dict(data)
    assert isinstance(config.distributed, DistributedConfig)
    assert config.distributed.async_delta_upload is True  # the v2 default
    assert config.to_dict(redact=True)["distributed"]["token"] == "<redacted>"
    data["distributed"]["bogus"] = 1
    with pytest.raises(ConfigError, match=r"distributed\.bogus"):
        SpeedtronicConfig.from_dict(data)
    for bad in ("..", "a/b", "a\\b", "."):
        with pytest.raises(ConfigError, match=r"distributed\.node_id"):
            SpeedtronicConfig.from_dict(config_dict(tmp_path, node_id=bad))
    with pytest.raises(ConfigError, match=r"distributed\.repo_id"):
        SpeedtronicConfig.from_dict(config_dict(tmp_path, repo_id=None))
    with pytest.raises(ConfigError, match=r"distributed\.outer_momentum"):
        SpeedtronicConfig.from_dict(config_dict(tmp_path, outer_momentum=1.0))


def test_shipped_diloco_config_is_valid_and_uses_a_shared_directory() -> None:
    config = SpeedtronicConfig.from_file(
        Path(__file__).resolve().parents[2] / "configs/diloco.yaml"
    )
    section = config.distributed
    assert isinstance(section, DistributedConfig) and section.enabled
    assert section.mode == "dumb_diloco" and section.role == "worker"
    assert shared_dir_root(section.repo_id or "") == Path("runs/diloco/shared")


def test_each_node_draws_its_own_data(tmp_path: Path) -> None:
    hook = get_plugin_manager().hook.data_seed
    seeds = {
        node: hook(config=SpeedtronicConfig.from_dict(config_dict(tmp_path, node_id=node)), seed=0)
        for node in ("a", "b")
    }
    assert None not in seeds.values() and seeds["a"] != seeds["b"]
    disabled = SpeedtronicConfig.from_dict(config_dict(tmp_path, enabled=False))
    assert hook(config=disabled, seed=0) is None
    batches = []
    for node in ("a", "b"):
        runtime = build_runtime(config_dict(tmp_path, node_id=node), console=False)
        batches.append(next(runtime.data.iterate(0))["input_ids"])
        runtime.metrics.close()
    assert not torch.equal(batches[0], batches[1])


def test_node_split_none_gives_every_node_the_same_stream_and_ranks_split(
    tmp_path: Path,
) -> None:
    hooks = get_plugin_manager().hook

    def loaded(node_split: str, **distributed: Any) -> SpeedtronicConfig:
        raw = config_dict(tmp_path, **distributed)
        raw["data"]["node_split"] = node_split
        return SpeedtronicConfig.from_dict(raw)

    assert hooks.data_seed(config=loaded("none", node_id="a"), seed=0) is None
    ranked = {"node_id": "a", "num_nodes": 3, "node_rank": 2}
    assert hooks.data_rank(config=loaded("auto", **ranked)) == (2, 3)
    assert hooks.data_seed(config=loaded("auto", **ranked), seed=0) is None  # ranks split
    assert hooks.data_rank(config=loaded("none", **ranked)) is None
    with pytest.raises(ConfigError, match=r"data\.node_split"):
        loaded("sometimes")
    splits = {}
    for node_split in ("auto", "none"):
        runtime = build_runtime(
            {**config_dict(tmp_path, node_id="a"), "data": {"node_split": node_split}},
            console=False,
        )
        splits[node_split] = runtime.data.split
        runtime.metrics.close()
    assert splits["auto"].startswith("own order") and splits["none"] == "not split"


def test_master_training_run_through_hooks(tmp_path: Path, recorder: RunRecorder) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    runtime = build_runtime(
        config_dict(tmp_path), console=False, hooks=[lambda e, p: events.append((e, p))]
    )
    trainer = runtime.trainer
    result = trainer.fit()
    assert result.steps == 12
    coordinator = recorder.coordinators[trainer]
    assert coordinator is not None and not coordinator.started  # stopped at train end
    assert coordinator_of(trainer) is None and trainer.plugin_state == {}  # dropped after the run
    assert coordinator.state_root == tmp_path / "run" / "diloco" / "m"
    assert trainer.reset_optimizer_on_weight_replace is False  # reset_inner_optimizer: false
    assert trainer.optimizer.state  # the default keeps the inner AdamW state
    assert trainer.weights_replaced >= 3  # one push per boundary
    store = SharedDirectoryTransport(tmp_path / "store")
    assert store.read_global_metadata() is not None
    # A delta that went into one round with a later one of its node is deleted after it.
    kept = {info.local_step for info in store.list_deltas()}
    assert 12 in kept and kept <= {4, 8, 12}
    uploaded = [p["step"] for e, p in events if e == "delta_uploaded"]
    assert sorted(uploaded) == [4, 8, 12]
    # The coordinator emits through the trainer: the sinks and on_metric get the same events.
    assert [e for e, _ in recorder.events[trainer]] == [e for e, _ in events]
    loaded = trainer.checkpoints.load_latest()
    saved = loaded.state["plugins"]["diloco"]
    assert saved["node_id"] == "m" and saved["local_step"] == 12
    assert "outer" in saved and "baseline" in saved


def test_reset_inner_optimizer_switch_on(tmp_path: Path) -> None:
    runtime = build_runtime(
        config_dict(tmp_path, reset_inner_optimizer=True, role="worker", node_id="w"),
        console=False,
    )
    runtime.trainer.fit()
    assert runtime.trainer.reset_optimizer_on_weight_replace is True


def test_a_node_with_fsdp_on_one_process_uploads_and_checkpoints_its_state(
    tmp_path: Path,
) -> None:
    # One process has nothing to shard: the node trains whole, and its checkpoints are DCP
    # directories whose state.json carries the node's state (the 2-rank group is in
    # tests/e2e/test_diloco_fsdp_group.py).
    config = config_dict(tmp_path, role="worker", node_id="w")
    config["parallel"] = {"strategy": "fsdp"}
    runtime = build_runtime(config, console=False)
    runtime.trainer.fit()
    assert runtime.trainer.step == 12
    store = shared_dir_root(f"file://{tmp_path}/store")
    assert sorted(p.name for p in (store / "nodes" / "w").glob("delta_*.safetensors")) == [
        "delta_12.safetensors",
        "delta_4.safetensors",
        "delta_8.safetensors",
    ]
    loaded = runtime.trainer.checkpoints.load_latest(weights=False)
    assert loaded is not None and (loaded.path / "dcp").is_dir()
    assert loaded.state["plugins"]["diloco"]["local_step"] == 12


def test_resume_hands_checkpoint_state_over_before_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recorder: RunRecorder
) -> None:
    first = build_runtime(config_dict(tmp_path, role="worker", node_id="w"), console=False)
    first.trainer.fit()
    saved = first.trainer.checkpoints.load_latest().state["plugins"]["diloco"]
    order: list[tuple[str, bool]] = []
    real_load = DumbDiLoCoCoordinator.load_state_dict
    real_start = DumbDiLoCoCoordinator.start

    def load(self: DumbDiLoCoCoordinator, state: dict[str, Any]) -> None:
        order.append(("load", self.started))
        real_load(self, state)

    def start(self: DumbDiLoCoCoordinator) -> None:
        order.append(("start", self.started))
        real_start(self)

    monkeypatch.setattr(DumbDiLoCoCoordinator, "load_state_dict", load)
    monkeypatch.setattr(DumbDiLoCoCoordinator, "start", start)
    data = config_dict(tmp_path, role="worker", node_id="w")
    data["run"]["max_steps"] = 16
    data["checkpoint"]["resume"] = True
    second = build_runtime(data, console=False)
    result = second.trainer.fit()
    assert result.resumed_from == 12 and result.steps == 16
    assert order[:2] == [("load", False), ("start", False)]  # prepared startup state
    coordinator = recorder.coordinators[second.trainer]
    assert coordinator is not recorder.coordinators[first.trainer]  # one coordinator per run
    assert coordinator.local_step == 16
    assert coordinator.last_global_step >= saved["last_global_step"]


# --------------------------------------------------------------------------- two runs, one process


def two_runs(tmp_path: Path) -> list[tuple[Any, list[tuple[str, dict[str, Any]]], str]]:
    """A master ``a`` and a worker ``b``, each with its own store, output and metric sink."""
    runs = []
    for node, role in (("a", "master"), ("b", "worker")):
        root = tmp_path / node
        sink: list[tuple[str, dict[str, Any]]] = []
        runtime = build_runtime(
            config_dict(root, node_id=node, role=role),
            console=False,
            hooks=[lambda e, p, sink=sink: sink.append((e, dict(p)))],
        )
        runs.append((runtime.trainer, sink, node))
    return runs


def assert_runs_kept_apart(
    recorder: RunRecorder, runs: list[tuple[Any, list[tuple[str, dict[str, Any]]], str]]
) -> None:
    coordinators = [recorder.coordinators[trainer] for trainer, _, _ in runs]
    assert coordinators[0] is not coordinators[1]
    for (trainer, sink, node), coordinator in zip(runs, coordinators):
        assert coordinator.node_id == node and coordinator.model is trainer.model
        assert not coordinator.started and trainer.plugin_state == {}
        seen = recorder.events[trainer]
        assert [e for e, _ in seen] == [e for e, _ in sink]  # on_metric == this run's sinks
        diloco = [p for e, p in seen if e in DILOCO_EVENTS]
        assert diloco, f"run {node} emitted no DiLoCo event"
        assert {p["node_id"] for p in diloco} == {node}  # never the other run's
        assert {p["node_id"] for e, p in sink if e in DILOCO_EVENTS} == {node}
        uploaded = sorted(p["step"] for e, p in seen if e == "delta_uploaded")
        assert uploaded == [4, 8, 12]
        starts = [p for e, p in seen if e == "train_start"]
        assert len(starts) == 1
    assert set(recorder.events) == {trainer for trainer, _, _ in runs}


def test_two_runs_one_after_another_keep_their_own_coordinator_and_events(
    tmp_path: Path, recorder: RunRecorder
) -> None:
    runs = two_runs(tmp_path)
    for trainer, _, _ in runs:
        assert trainer.fit().steps == 12
    assert_runs_kept_apart(recorder, runs)


def test_two_runs_in_two_threads_keep_their_own_coordinator_and_events(
    tmp_path: Path, recorder: RunRecorder
) -> None:
    runs = two_runs(tmp_path)
    recorder.barrier = threading.Barrier(len(runs), timeout=SETTLE)  # both runs live at once
    errors: list[BaseException] = []

    def fit(trainer: Any) -> None:
        try:
            trainer.fit()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=fit, args=(trainer,)) for trainer, _, _ in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(SETTLE * 3)
    assert not any(thread.is_alive() for thread in threads), "a run did not finish"
    assert errors == []
    assert_runs_kept_apart(recorder, runs)


def test_a_group_nodes_sync_wait_must_fit_its_collective_timeout() -> None:
    """A DDP/FSDP node's rank 0 may wait 2 x round_timeout at a sync boundary while its other
    ranks wait in a collective: a round_timeout that outlasts parallel.timeout is refused,
    naming both and the values that fit; async rounds never wait there."""
    from speedtronic.errors import PluginError
    from speedtronic_diloco.plugin import check_group_waits

    section = DistributedConfig(enabled=True, repo_id="x", rounds="sync", round_timeout=300.0)
    with pytest.raises(PluginError) as caught:
        check_group_waits(section, 600.0)
    message = str(caught.value)
    assert "distributed.round_timeout" in message and "parallel.timeout (600 s)" in message
    assert "at most 180 s" in message and "at least 960 s" in message
    check_group_waits(DistributedConfig(enabled=True, repo_id="x", rounds="sync"), 600.0)
    at_the_edge = DistributedConfig(enabled=True, repo_id="x", rounds="sync", round_timeout=180)
    check_group_waits(at_the_edge, 600.0)
    with pytest.raises(PluginError):
        check_group_waits(at_the_edge, 599.0)
    asynchronous = DistributedConfig(enabled=True, repo_id="x", rounds="async", round_timeout=300)
    check_group_waits(asynchronous, 600.0)
