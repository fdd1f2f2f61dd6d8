"""A DiLoCo node that is an FSDP group (``parallel.strategy: fsdp``, 2 ranks, torchrun, gloo),
as real processes over a shared directory.

1. With a single-process master: the group trains, the master aggregates its deltas, the group
   installs the globals, and after every step both ranks hold the same full weights (gathered
   from their shards and hashed). Rank 1 never opens the store.
2. An FSDP master alone: its rounds aggregate its own deltas, it scores each new global on an
   unsharded model built from its config (``eval_globals``), and its ranks stay identical.
3. Alone, killed (SIGKILL, the whole process group) after a checkpoint recorded an upload that
   landed later, and resumed from its DCP checkpoint: the store's deltas add up to exactly how
   far its weights moved (nothing sent twice, nothing lost), as for a single-process node
   (tests/e2e/test_diloco_resume_e2e.py).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from diloco_nodes import Node, included, kill_all, wait_all, wait_until, with_plugin, write_config
from test_diloco_ddp_group import config as group_config
from test_diloco_resume_e2e import HELD, INNER, assert_deltas_add_up, stored_deltas
from test_diloco_resume_e2e import config as resume_config

from speedtronic.checkpoint import CheckpointManager

pytestmark = pytest.mark.slow

WAIT = 300

PROBE = """
import hashlib
import json
import os
import time
from pathlib import Path

from speedtronic import hookimpl
from speedtronic.parallel.fsdp import full_model_state

OUT = Path(os.environ["PROBE_DIR"])

if os.environ.get("RANK", "0") != "0":
    from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport

    opened = SharedDirectoryTransport.__init__

    def _recording_init(self, *args, **kwargs):
        (OUT / f"store_opened_rank{os.environ['RANK']}").write_text("opened")
        opened(self, *args, **kwargs)

    SharedDirectoryTransport.__init__ = _recording_init


def digest(model):
    h = hashlib.sha256()
    for name, tensor in sorted(full_model_state(model).items()):  # every rank gathers
        h.update(name.encode())
        h.update(tensor.contiguous().numpy().tobytes())
    return h.hexdigest()


@hookimpl(trylast=True)
def after_optimizer_step(trainer, model, step):
    if os.environ.get("PROBE_HASH") != "1":
        return None
    rank = trainer.parallel.rank
    with open(OUT / f"hashes_rank{rank}.jsonl", "a") as handle:
        handle.write(json.dumps({"step": step, "sha": digest(model)}) + "\\n")
    if step == 6 and rank == 0 and os.environ.get("PROBE_STORE"):
        # Hold until the master has published a global built from our delta, so the next
        # boundary (step 9) installs it (rank 1 waits in the next collective).
        global_file = Path(os.environ["PROBE_STORE"]) / "global" / "step_count.json"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if json.loads(global_file.read_text())["outer_step"] >= 1:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.1)
    return None
"""


def fsdp_worker(node: Node, tmp_path: Path, **env: str) -> Node:
    (tmp_path / "fsdp_group_probe.py").write_text(textwrap.dedent(PROBE))
    with_plugin(node, "fsdp_group_probe", tmp_path, PROBE_DIR=str(tmp_path), **env)
    node.extra_args += ["--nproc-per-node", "2", "--set", "parallel.strategy=fsdp"]
    return node


def test_an_fsdp_worker_group_trains_and_keeps_its_ranks_identical(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    master = Node(tmp_path, group_config(tmp_path, "m", 100_000), "master", "m")
    worker = fsdp_worker(
        Node(tmp_path, group_config(tmp_path, "w", 12), "worker", "w"),
        tmp_path,
        PROBE_HASH="1",
        PROBE_STORE=str(shared),
    )
    try:
        master.start()
        worker.start()
        wait_until(lambda: not worker.alive(), [master], "the worker group's run", timeout=WAIT)
        assert worker.wait() == 0, worker.tail()
        # The master aggregates the group's deltas (min_deltas 1): wait for the last one.
        wait_until(
            lambda: ("w", 12) in {d for e in master.events("outer_step") for d in included(e)},
            [master],
            "the master to aggregate the group's final delta",
            timeout=WAIT,
        )
    finally:
        kill_all([master, worker])
    hashes = read_hashes(tmp_path)
    assert [h["step"] for h in hashes[0]] == list(range(1, 13)) == [h["step"] for h in hashes[1]]
    diverged = [a["step"] for a, b in zip(*hashes) if a["sha"] != b["sha"]]
    assert not diverged, diverged
    accepted = {d for e in master.events("outer_step") for d in included(e)}
    assert {("w", 3), ("w", 12)} <= accepted, sorted(accepted)
    events = worker.events()
    names = {e["event"] for e in events}
    installed = [e for e in events if e["event"] in ("global_loaded", "global_installed")]
    assert installed, sorted(names)  # the group installed a global, on both ranks alike
    end = next(e for e in events if e["event"] == "train_end")
    assert end["weights_replaced"] >= 2
    assert not list(tmp_path.glob("store_opened_rank*"))  # only rank 0 touched the store


def read_hashes(tmp_path: Path) -> list[list[dict[str, object]]]:
    return [
        [json.loads(line) for line in (tmp_path / f"hashes_rank{r}.jsonl").read_text().splitlines()]
        for r in (0, 1)
    ]


def test_an_fsdp_master_scores_its_globals_and_keeps_its_ranks_identical(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        "master.yaml",
        run={"max_steps": 9, "seed": 1},
        model={"max_seq_len": 16, "n_kv_head": None},
        data={"micro_batch_size": 2, "target_batch_size": 4},
        eval={"at_end": True, "batches": 2},
        checkpoint={"save_final": False},
        logging={"log_every": 1},
        distributed={"inner_steps": 3, "min_deltas": 1, "round_timeout": 5.0},
    )
    master = fsdp_worker(Node(tmp_path, config, "master", "m"), tmp_path, PROBE_HASH="1")
    try:
        master.start()
        assert master.wait(WAIT) == 0, master.tail()
    finally:
        kill_all([master])
    rounds, scored = master.events("outer_step"), master.events("outer_eval")
    assert rounds and [e["outer_step"] for e in scored] == [r["outer_step"] for r in rounds]
    assert all(e["loss"] > 0 for e in scored)
    assert ("m", 3) in {d for r in rounds for d in included(r)}
    hashes = read_hashes(tmp_path)
    assert [h["step"] for h in hashes[0]] == list(range(1, 10)) == [h["step"] for h in hashes[1]]
    diverged = [a["step"] for a, b in zip(*hashes) if a["sha"] != b["sha"]]
    assert not diverged, diverged
    assert not list(tmp_path.glob("store_opened_rank*"))


def test_an_fsdp_group_resumed_from_its_dcp_checkpoint_sends_nothing_twice(
    tmp_path: Path,
) -> None:
    node = fsdp_worker(
        Node(tmp_path, resume_config(tmp_path, "fsdp-resume"), "worker", "w"), tmp_path
    )
    # The upload of step HELD waits for the checkpoint of the next boundary; later ones are
    # held back until the group is killed.
    after = node.output / "checkpoints" / f"step_{HELD + INNER:08d}"
    with_plugin(
        node,
        DILOCO_E2E_STEP_SLEEP="0.2",
        DILOCO_E2E_UPLOAD_STEP=str(HELD),
        DILOCO_E2E_UPLOAD_AFTER=str(after),
        DILOCO_E2E_HOLD_LATER="1",
    )
    shared = tmp_path / "shared"
    node.start()
    try:
        wait_until(
            lambda: (shared / "nodes" / "w" / f"delta_{HELD}.safetensors").exists(),
            [node],
            f"the held upload of step {HELD} to land",
            poll=0.01,
        )
        node.kill()  # every rank and the launcher
        landed = set(stored_deltas(shared))
        assert landed == {INNER, HELD}, f"killed too late to test anything: {landed}"
        checkpoint = CheckpointManager(node.output / "checkpoints").load_latest(weights=False)
        assert checkpoint is not None and checkpoint.step > HELD
        node.extra_env = {
            **node.extra_env,
            "DILOCO_E2E_UPLOAD_STEP": "",
            "DILOCO_E2E_HOLD_LATER": "",
        }
        node.start(resume=True)
        wait_all([node], timeout=WAIT)
    finally:
        kill_all([node])
    assert "arrived; measuring from its target" in node.log.read_text()
    assert_deltas_add_up(tmp_path, node)
    assert not list(tmp_path.glob("store_opened_rank*"))
