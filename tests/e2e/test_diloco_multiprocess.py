"""DumbDiLoCo with real processes: ``speedtronic train`` as a master and two workers syncing
through a shared directory.

One scenario, in phases, so the processes start once: outer steps advance with both workers
contributing; the master is SIGKILLed and restarted and continues its outer step, momentum and
ledger without aggregating old deltas again; a worker is SIGKILLed and restarted and rejoins
from the latest global; finally the published global model beats the initial one on held-out
samples. Every wait is bounded polling on files; nothing asserts a duration.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from diloco_nodes import (
    eval_loss,
    included,
    kill_all,
    master_and_workers,
    stop_all,
    store_metadata,
    wait_until,
    write_config,
)
from safetensors import safe_open
from safetensors.torch import load_file

pytestmark = pytest.mark.slow


def master_state(path: Path) -> tuple[int, set[tuple[str, int]], dict[str, torch.Tensor]]:
    with safe_open(str(path), "pt") as handle:
        meta = handle.metadata()
        momentum = {
            k: handle.get_tensor(k)
            for k in handle.keys()  # noqa: SIM118
            if k.startswith("momentum/")
        }
    processed = {(node, step) for node, step, _ in json.loads(meta["processed"])}
    return int(meta["outer_step"]), processed, momentum


def test_master_and_two_workers_recover_and_improve(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        checkpoint={"interval": 10, "keep_last": 2},
        distributed={"poll_interval": 0.3, "max_retries": 2},
    )
    shared = tmp_path / "shared"
    master, *workers = nodes = master_and_workers(tmp_path, config)
    try:
        for node in nodes:
            node.start()

        # Phase 1: outer steps advance, with deltas of both workers aggregated.
        def both_workers_in() -> bool:
            meta = store_metadata(shared)
            if not meta or meta["outer_step"] < 4:
                return False
            return {"w1", "w2"} <= {node for node, _, _ in meta["processed"]}

        wait_until(both_workers_in, nodes, "outer steps with both workers' deltas")
        assert master.events("outer_step"), master.tail()

        # Phase 2: SIGKILL the master; its persisted state carries on after a restart.
        master.signal(signal.SIGKILL)
        master.wait()
        state_file = master.output / "diloco" / "master" / "outer_state.safetensors"
        killed_step, killed_processed, killed_momentum = master_state(state_file)
        assert killed_step >= 4 and killed_momentum
        master.start(resume=True)
        rounds = wait_until(
            lambda: master.events("outer_step"), nodes, "an outer round of the restarted master"
        )
        first = rounds[0]
        assert first["outer_step"] == killed_step + 1, master.tail()
        assert not set(included(first)) & killed_processed, "old deltas were aggregated again"
        log = master.log.read_text()
        assert f"master startup: local state at outer step {killed_step}" in log

        # Phase 3: SIGKILL a worker; restarted, it rejoins from the latest global.
        w2 = workers[1]
        w2.signal(signal.SIGKILL)
        w2.wait()
        at_kill = store_metadata(shared)["outer_step"]
        w2.start(resume=True)
        loaded = wait_until(
            lambda: [e for e in w2.events("global_loaded") if e["outer_step"] >= at_kill],
            nodes,
            "the restarted worker to install the latest global",
        )
        assert loaded
        new_uploads = wait_until(
            lambda: {int(e["step"]) for e in w2.events("delta_uploaded")},
            nodes,
            "a delta from the restarted worker",
        )

        def rejoined() -> bool:
            return any(
                node == "w2" and step in new_uploads
                for event in master.events("outer_step")
                for node, step in included(event)
            )

        wait_until(rejoined, nodes, "the master to aggregate the restarted worker's delta")

        # Phase 4: stop everyone; the published global beats the initial weights.
        stop_all(nodes)
        final = store_metadata(shared)
        assert final["outer_step"] > killed_step + 1
        global_state = load_file(shared / final["model_file"])
        initial, trained = eval_loss(None), eval_loss(global_state)
        assert trained < initial - 0.5, (initial, trained)
    finally:
        kill_all(nodes)
