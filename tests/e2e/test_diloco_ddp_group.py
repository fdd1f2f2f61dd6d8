"""A DiLoCo node that is a DDP group: a single-process master plus a 2-rank worker group over a
shared directory, as real processes (torchrun, gloo). Rank 0 of the group runs the node's
coordinator; after every sync point the group's ranks hold identical weights (their state dicts
are hashed and compared), including after installing a global."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

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


def config(tmp_path: Path, name: str, role: str, steps: int) -> Path:
    data: dict[str, Any] = {
        "run": {"device": "cpu", "max_steps": steps, "seed": 1, "output_dir": str(tmp_path / name)},
        "model": {
            "name": "reference_transformer",
            "vocab_size": 64,
            "max_seq_len": 16,
            "n_layer": 1,
            "n_head": 2,
            "d_model": 32,
        },
        "data": {"micro_batch_size": 2, "target_batch_size": 4},
        "precision": {"mode": "fp32"},
        "checkpoint": {"save_final": False},
        "logging": {
            "log_every": 1,
            "progress": False,
            "json_file": str(tmp_path / name / "metrics.jsonl"),
        },
        "distributed": {
            "enabled": True,
            "role": role,
            "node_id": name,
            "repo_id": f"file://{tmp_path / 'store'}",
            "inner_steps": 3,
            "poll_interval": 0.2,
            "min_deltas": 1,
            "round_timeout": 1.0,
        },
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


def test_a_worker_group_keeps_its_ranks_identical_through_installs(tmp_path: Path) -> None:
    (tmp_path / "ddp_group_probe.py").write_text(textwrap.dedent(PROBE))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        "PROBE_DIR": str(tmp_path),
        "OMP_NUM_THREADS": "1",
    }
    master = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "speedtronic",
            "train",
            "-c",
            str(config(tmp_path, "m", "master", 100_000)),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        worker_config = config(tmp_path, "w", "worker", 12)
        worker = subprocess.run(
            [
                *(sys.executable, "-m", "speedtronic", "train", "-c", str(worker_config)),
                *("--plugin", "ddp_group_probe", "--nproc-per-node", "2"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=WAIT,
        )
        assert worker.returncode == 0, worker.stdout[-2000:] + worker.stderr[-4000:]
    finally:
        os.killpg(master.pid, signal.SIGTERM)
        try:
            master.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(master.pid, signal.SIGKILL)
            master.wait(timeout=60)
    hashes = [
        [json.loads(line) for line in (tmp_path / f"hashes_rank{r}.jsonl").read_text().splitlines()]
        for r in (0, 1)
    ]
    assert [h["step"] for h in hashes[0]] == list(range(1, 13)) == [h["step"] for h in hashes[1]]
    diverged = [a["step"] for a, b in zip(*hashes) if a["sha"] != b["sha"]]
    assert not diverged, diverged  # never diverged
    events = [
        json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()
    ]
    names = {e["event"] for e in events}
    assert "delta_uploaded" in names or "delta_upload_dispatched" in names
    installed = [e for e in events if e["event"] in ("global_loaded", "global_installed")]
    assert installed, sorted(names)  # the group installed a global, on both ranks alike
    end = next(e for e in events if e["event"] == "train_end")
    assert end["weights_replaced"] >= 2
