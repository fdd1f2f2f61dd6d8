"""A DiLoCo node that is a DDP group: a single-process master plus a 2-rank worker group over a
shared directory, as real processes (torchrun, gloo). Rank 0 of the group runs the node's
coordinator; after every sync point the group's ranks hold identical weights (their state dicts
are hashed and compared), including after installing a global."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from diloco_nodes import Node, kill_all, wait_until, with_plugin, write_config

pytestmark = pytest.mark.slow

WAIT = 240

PROBE = """
import hashlib
import json
import os
import time
from pathlib import Path

from speedtronic import hookimpl

OUT = Path(os.environ["PROBE_DIR"])


def digest(model):
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@hookimpl(trylast=True)
def after_optimizer_step(trainer, model, step):
    if trainer.parallel.world_size < 2:
        return None
    rank = trainer.parallel.rank
    with open(OUT / f"hashes_rank{rank}.jsonl", "a") as handle:
        handle.write(json.dumps({"step": step, "sha": digest(model)}) + "\\n")
    if step == 6:
        # Hold until the master has published a global built from our delta, so the next
        # boundary (step 9) installs it: no assumption about how fast anything runs.
        from speedtronic_diloco.transports import open_transport

        store = open_transport(trainer.config.distributed)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            metadata = store.read_global_metadata()
            if metadata is not None and metadata.outer_step >= 1:
                break
            time.sleep(0.1)
    return None
"""


def config(tmp_path: Path, name: str, steps: int) -> Path:
    return write_config(
        tmp_path,
        f"{name}.yaml",
        run={"max_steps": steps, "seed": 1},
        model={"max_seq_len": 16, "n_kv_head": None},
        data={"micro_batch_size": 2, "target_batch_size": 4},
        optimizer=None,  # the run's defaults
        scheduler=None,
        checkpoint={"save_final": False},
        logging={"log_every": 1},
        distributed={
            "inner_steps": 3,
            "min_deltas": 1,
            "round_timeout": 1.0,
            "outer_lr": None,
            "outer_momentum": None,
            "retry_backoff": None,
        },
    )


def test_a_worker_group_keeps_its_ranks_identical_through_installs(tmp_path: Path) -> None:
    (tmp_path / "ddp_group_probe.py").write_text(textwrap.dedent(PROBE))
    master = Node(tmp_path, config(tmp_path, "m", 100_000), "master", "m")
    worker = with_plugin(
        Node(tmp_path, config(tmp_path, "w", 12), "worker", "w"),
        "ddp_group_probe",
        tmp_path,
        PROBE_DIR=str(tmp_path),
    )
    worker.extra_args += ["--nproc-per-node", "2"]
    try:
        master.start()
        worker.start()
        wait_until(lambda: not worker.alive(), [master], "the worker group's run", timeout=WAIT)
        assert worker.wait() == 0, worker.tail()
    finally:
        kill_all([master, worker])
    hashes = [
        [json.loads(line) for line in (tmp_path / f"hashes_rank{r}.jsonl").read_text().splitlines()]
        for r in (0, 1)
    ]
    assert [h["step"] for h in hashes[0]] == list(range(1, 13)) == [h["step"] for h in hashes[1]]
    diverged = [a["step"] for a, b in zip(*hashes) if a["sha"] != b["sha"]]
    assert not diverged, diverged  # never diverged
    events = worker.events()
    names = {e["event"] for e in events}
    assert "delta_uploaded" in names or "delta_upload_dispatched" in names
    installed = [e for e in events if e["event"] in ("global_loaded", "global_installed")]
    assert installed, sorted(names)  # the group installed a global, on both ranks alike
    end = next(e for e in events if e["event"] == "train_end")
    assert end["weights_replaced"] >= 2
