"""Readers of what a run leaves on disk: the JSONL metrics file and TensorBoard event files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The events of a ``logging.json_file``."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tensorboard_events(log_dir: Path) -> Any:
    """An EventAccumulator over ``log_dir`` with nothing sampled away."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def tensorboard_text(events: Any, tag: str) -> list[tuple[int, str]]:
    """``(step, text)`` of a text panel written with ``add_text(tag, ...)``."""
    return [
        (e.step, e.tensor_proto.string_val[0].decode())
        for e in events.Tensors(f"{tag}/text_summary")
    ]


def tensorboard_hparams(events: Any) -> tuple[dict[str, Any], int]:
    """The run's hyperparameters and its HParams end status (api_pb2.Status value)."""
    from tensorboard.plugins.hparams import metadata

    content = events.PluginTagToContent(metadata.PLUGIN_NAME)
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    end = metadata.parse_session_end_info_plugin_data(content[metadata.SESSION_END_INFO_TAG])
    values = {}
    for name, value in start.hparams.items():
        values[name] = getattr(value, value.WhichOneof("kind"))
    return values, end.status


def files_containing(root: Path, needle: str) -> list[Path]:
    """Every file under ``root`` whose bytes contain ``needle``."""
    return [p for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]
