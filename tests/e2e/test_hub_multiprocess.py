"""DumbDiLoCo over a "Hub": ``speedtronic train`` as a master and two workers, syncing through
the real huggingface_hub client talking HTTP to tests/hub_emulator.py in this process.

One scenario: the master creates the repository, outer steps advance with both workers'
deltas; then transient faults (5xx, 429 with Retry-After, a dropped connection) hit commits,
listings and downloads, and the run carries on past them; then the master is SIGKILLed and
restarted and continues without aggregating deltas twice. The emulator requires the token on
every request (one worker has it in its config, the others from HF_TOKEN), and afterwards the
token is nowhere in the logs, metrics, checkpoints, DiLoCo state or ``validate`` output.
Every wait is bounded polling; nothing asserts a duration.
"""

from __future__ import annotations

import hashlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from diloco_nodes import (
    Node,
    included,
    kill_all,
    speedtronic,
    stop_all,
    wait_until,
    write_config,
)
from hub_emulator import HubEmulator

from speedtronic_diloco.transports import GLOBAL_METADATA, GlobalMetadata

pytestmark = pytest.mark.slow

TOKEN = "hf_test_secret_token"
REPO = "org/run"


def hub_config(tmp_path: Path, name: str, **distributed: Any) -> Path:
    """A small run whose store is the Hub repository REPO."""
    return write_config(
        tmp_path,
        name,
        run={"name": "diloco-hub-e2e"},
        checkpoint={"interval": 10, "keep_last": 2},
        distributed={
            "repo_id": REPO,
            "poll_interval": 0.3,
            "max_retries": 4,
            "request_timeout": 10.0,
            **distributed,
        },
    )


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[HubEmulator]:
    """An emulator demanding TOKEN; child processes find it through HF_ENDPOINT / HF_TOKEN."""
    with HubEmulator(require_token=TOKEN) as emulator:
        monkeypatch.setenv("HF_ENDPOINT", emulator.endpoint)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        yield emulator


def published(hub: HubEmulator) -> GlobalMetadata | None:
    try:
        raw = hub.files(REPO).get(GLOBAL_METADATA)
    except KeyError:  # no repository yet
        return None
    return GlobalMetadata.loads(raw) if raw else None


def test_master_and_two_workers_through_the_hub(hub: HubEmulator, tmp_path: Path) -> None:
    shared_config = hub_config(tmp_path, "hub.yaml")
    # w2 names the endpoint and the token in its config instead of the environment.
    w2_config = hub_config(tmp_path, "hub-w2.yaml", endpoint=hub.endpoint, token=TOKEN)
    master = Node(tmp_path, shared_config, "master", "master")
    workers = [
        Node(tmp_path, shared_config, "worker", "w1"),
        Node(tmp_path, w2_config, "worker", "w2"),
    ]
    nodes = [master, *workers]
    try:
        # All at once: a worker that finds no repository yet trains on and polls again.
        for node in nodes:
            node.start()

        # Phase 1: outer steps advance with both workers' deltas.
        def both_workers_in() -> bool:
            meta = published(hub)
            return bool(meta and meta.outer_step >= 2) and {"w1", "w2"} <= {
                node for node, _, _ in meta.processed
            }

        wait_until(both_workers_in, nodes, "outer steps with both workers' deltas")

        # Phase 2: transient faults on every kind of request; the run carries on.
        at_faults = published(hub).outer_step  # type: ignore[union-attr]
        hub.inject("commit", status=503, count=2)
        hub.inject("preupload", status=500)
        hub.inject("tree", status=429, retry_after=1)
        hub.inject_drop("resolve", method="GET")
        wait_until(
            lambda: hub.faults_left() == 0 and published(hub).outer_step > at_faults,  # type: ignore[union-attr]
            nodes,
            "outer steps after the injected faults",
        )

        # Phase 3: SIGKILL the master (maybe mid-commit) and restart it: it carries on from its
        # state without aggregating deltas the store's ledger already counts.
        master.signal(signal.SIGKILL)
        master.wait()
        at_kill = published(hub)
        assert at_kill is not None
        counted = {(node, step) for node, step, _ in at_kill.processed}
        master.start(resume=True)
        first = wait_until(
            lambda: master.events("outer_step"), nodes, "a round of the restarted master"
        )[0]
        assert first["outer_step"] > at_kill.outer_step, master.tail()
        assert not set(included(first)) & counted, "deltas were aggregated twice"
        assert {record.authorization for record in hub.requests} == {f"Bearer {TOKEN}"}
        assert not [r for r in hub.requests if r.status == 401]

        stop_all(nodes)
    finally:
        kill_all(nodes)

    # Every commit pairs its metadata with the weights it describes.
    for sha in hub.history(REPO):
        files = hub.files(REPO, sha)
        if GLOBAL_METADATA in files:
            meta = GlobalMetadata.loads(files[GLOBAL_METADATA])
            assert meta.sha256 == hashlib.sha256(files[meta.model_file]).hexdigest()

    for node in nodes:
        for log in node.output.glob("log-*.txt"):
            text = log.read_text()
            assert "outer round failed" not in text and "Traceback" not in text, text[-3000:]
    assert master.events("outer_step") and workers[0].events("global_loaded")

    # The token is nowhere: logs, metrics, checkpoints, DiLoCo state and caches.
    written_by_us = {shared_config, w2_config}
    scanned = 0
    for path in tmp_path.rglob("*"):
        if path.is_file() and path not in written_by_us:
            scanned += 1
            assert TOKEN.encode() not in path.read_bytes(), f"token leaked into {path}"
    assert scanned > 10
    for fmt in ("yaml", "json"):
        shown = speedtronic("validate", "--config", str(w2_config), "--format", fmt)
        assert TOKEN not in shown.stdout + shown.stderr
        assert "<redacted>" in shown.stdout
