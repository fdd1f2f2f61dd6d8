"""One bad node cannot wreck the global (issue 18), with real processes: a master and two
honest workers sign their deltas (``SPEEDTRONIC_DILOCO_KEY``), while a hostile writer with
write access to the shared directory plants deltas next to theirs:

* an insider (who has the key) plants each honest delta multiplied by 1e6, signed;
* an outsider plants unsigned deltas and signed deltas with flipped bytes.

The global's held-out loss still falls and ends within 25% of a run with the honest nodes only
(async rounds vary with timing; only honest deltas are ever aggregated);
every planted delta is rejected with its reason (``delta_rejected``); and the key appears in
no file any process wrote. Every wait is a bounded poll on a condition.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_nodes import (
    WAIT,
    Node,
    eval_loss,
    included,
    master_and_workers,
    run_together,
    store_metadata,
    with_plugin,
    write_config,
)
from safetensors.torch import load_file

from speedtronic_diloco.signing import sign_file
from speedtronic_diloco.tensors import save_tensors

pytestmark = pytest.mark.slow

KEY = "e2e-signing-key-7f3a9c1d"
STEPS = 60
INNER = 5


def config(tmp_path: Path) -> Path:
    return write_config(
        tmp_path,
        "robust.yaml",
        run={"name": "robust-e2e", "max_steps": STEPS},
        checkpoint={"interval": 20, "keep_last": 1},
        distributed={"inner_steps": INNER, "min_deltas": 2, "round_timeout": WAIT / 4},
    )


def run(tmp_path: Path, plant: Any = None) -> tuple[float, Node]:
    """Master + two honest workers to the end; ``plant(shared, stop)`` runs meanwhile.
    Returns the held-out loss of the final global and the master."""
    nodes = master_and_workers(tmp_path, config(tmp_path))
    for node in nodes:
        node.extra_env = {"SPEEDTRONIC_DILOCO_KEY": KEY}
        with_plugin(node, DILOCO_E2E_STEP_SLEEP="0.05")
    stop = threading.Event()
    planter = None
    if plant is not None:  # it plants for every new global, once the nodes have trained
        planter = threading.Thread(target=plant, args=(tmp_path / "shared", stop))
        planter.start()
    try:
        run_together(nodes, tmp_path / "barrier")
    finally:
        stop.set()
        if planter is not None:
            planter.join(WAIT)
    meta = store_metadata(tmp_path / "shared")
    assert meta is not None
    return eval_loss(load_file(tmp_path / "shared" / meta["model_file"])), nodes[0]


@pytest.fixture(scope="module")
def honest_loss(tmp_path_factory: pytest.TempPathFactory) -> float:
    loss, _ = run(tmp_path_factory.mktemp("honest"))
    return loss


def plant_hostile_deltas(shared: Path, stop: threading.Event) -> None:
    """For every new global: w1's newest delta x 1e6 (signed: an insider), an unsigned copy
    and a tampered signed copy (outsiders)."""
    seen = -1
    step = 0
    staging = shared.parent / "planted"
    while not stop.wait(0.1):
        meta = store_metadata(shared)
        honest = sorted((shared / "nodes" / "w1").glob("delta_*.safetensors"))
        if meta is None or meta["outer_step"] == seen or not honest:
            continue
        seen = meta["outer_step"]
        step += INNER
        try:
            tensors = load_file(honest[-1])
        except Exception:  # replaced while being read: next time
            continue
        fields = {"node_id": "evil", "local_step": step, "base_outer_step": seen}
        scaled = {k: v * 1e6 for k, v in tensors.items()}
        for node, data, sign, flip in (
            ("evil", scaled, True, False),
            ("unsigned", tensors, False, False),
            ("tampered", tensors, True, True),
        ):
            path = save_tensors(
                staging / f"{node}_{step}.safetensors", data, {**fields, "node_id": node}
            )
            if sign:
                sign_file(path, KEY.encode())
            if flip:
                raw = bytearray(path.read_bytes())
                raw[-1] ^= 0x40
                path.write_bytes(bytes(raw))
            dest = shared / "nodes" / node / f"delta_{step}.safetensors"
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.tmp")
            tmp.write_bytes(path.read_bytes())
            tmp.replace(dest)


def test_a_hostile_writer_cannot_wreck_the_global(tmp_path: Path, honest_loss: float) -> None:
    torch.manual_seed(0)
    initial = eval_loss(None)
    loss, master = run(tmp_path, plant_hostile_deltas)
    assert loss < initial - 0.5, (initial, loss)  # the held-out loss fell...
    # ...about as far as without the attack. Async rounds depend on timing (which deltas meet in
    # which round, and the master's rejection work adds staleness): with every planted delta
    # rejected, attacked runs ended 7% above their honest run on a loaded machine and 11% above
    # with two CPU hogs beside two test workers, while a 1e6 x delta that got in ends far above
    # the start. That nothing planted was aggregated is checked exactly below.
    assert loss <= 1.25 * honest_loss, (loss, honest_loss)

    rejected = master.events("delta_rejected")
    reasons = {(e["node"], e["reason"]) for e in rejected}
    assert ("evil", "norm_outlier") in reasons, master.tail()
    assert ("unsigned", "unsigned") in reasons
    assert ("tampered", "bad_signature") in reasons
    aggregated = {node for e in master.events("outer_step") for node, _ in included(e)}
    assert aggregated == {"master", "w1", "w2"}
    assert "rejected delta nodes/evil/" in master.log.read_text()

    # The key is in no file any process wrote: logs, metrics, checkpoints, state, the store.
    written = [
        p
        for p in tmp_path.rglob("*")
        if p.is_file() and "planted" not in p.parts and p.suffix != ".yaml"
    ]
    assert any(p.suffix == ".jsonl" for p in written) and any(
        "checkpoints" in p.parts for p in written
    )
    leaks = [str(p) for p in written if KEY.encode() in p.read_bytes()]
    assert leaks == []
