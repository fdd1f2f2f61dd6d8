"""Read back the ``.wandb`` file W&B writes in offline mode, to assert on what was logged.

W&B (0.31) has no public Python reader for its transaction log, so this follows its on-disk
format: a 7-byte header (``:W&B``, magic ``0xBEE1``, version) and then LevelDB-log framing:
32 KiB blocks of chunks, each ``crc32 (4) | length (2, LE) | type (1) | data``, where type 1 is
a whole record and 2/3/4 are the first/middle/last pieces of one. Every record is a
``wandb_internal_pb2.Record`` protobuf.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def raw_records(path: Path) -> list[bytes]:
    """The records of one ``.wandb`` file, reassembled from their chunks."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # block trailer too small for a chunk header: zero padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            records.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            records.append(pending + chunk)
            pending = b""
    return records


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


@dataclass
class WandbRunFile:
    """What one offline W&B run recorded."""

    run_id: str = ""
    name: str = ""
    group: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    exit_code: int | None = None


def read_run(path: Path) -> WandbRunFile:
    """Parse a ``run-<id>.wandb`` file into run facts, config, history rows and summary."""
    from wandb.proto import wandb_internal_pb2

    run = WandbRunFile()
    for raw in raw_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id = record.run.run_id
            run.name = record.run.display_name
            run.group = record.run.run_group
            run.tags = list(record.run.tags)
            for item in record.run.config.update:
                run.config[_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                run.config[_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            run.history.append({_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            for item in record.summary.update:
                run.summary[_key(item)] = json.loads(item.value_json)
        elif kind == "environment" and record.environment.args:
            run.args = list(record.environment.args)
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run


def run_files(root: Path) -> list[Path]:
    """Every offline run's ``.wandb`` file under ``root/wandb``, oldest first."""
    return sorted(root.glob("wandb/offline-run-*/run-*.wandb"))


def finished_runs(root: Path, count: int = 1, timeout: float = 60.0) -> list[WandbRunFile]:
    """The ``count`` offline runs under ``root``, once each has its exit record on disk.

    ``run.finish()`` returns before W&B's service process has necessarily written the tail of
    the transaction log, so readers poll (bounded) instead of reading once.
    """
    deadline = time.monotonic() + timeout
    while True:
        runs = [read_run(path) for path in run_files(root)]
        if len(runs) >= count and all(run.exit_code is not None for run in runs):
            return runs
        if time.monotonic() > deadline:
            states = [(run.run_id, run.exit_code) for run in runs]
            raise AssertionError(f"expected {count} finished W&B runs under {root}: {states}")
        time.sleep(0.1)
