"""CheckpointManager: layout, verification, fallback, retention, crash safety, no pickle."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import speedtronic.checkpoint.storage as checkpoint_module
from speedtronic.checkpoint import CheckpointManager, checkpoint_name
from speedtronic.checkpoint.fileio import sha256_chunks
from speedtronic.errors import CheckpointError


def state(step: int) -> dict[str, Any]:
    return {"step": step, "weights": torch.full((4, 4), float(step)), "note": f"at {step}"}


def saved(tmp_path: Path, steps: range | list[int], keep_last: int = 10) -> CheckpointManager:
    manager = CheckpointManager(tmp_path / "ckpt", keep_last=keep_last)
    for step in steps:
        manager.save(step, state(step))
    return manager


def visible(manager: CheckpointManager) -> list[str]:
    return sorted(p.name for p in manager.directory.iterdir())


def rewrite_manifest(path: Path) -> None:
    """What an attacker with write access can do: make the manifest match tampered files."""
    manifest = json.loads((path / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        entry["size"] = (path / name).stat().st_size
        entry["sha256"] = sha256_chunks(path / name, entry["chunk_bytes"])
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_layout_and_roundtrip(tmp_path: Path) -> None:
    manager = saved(tmp_path, [5])
    assert visible(manager) == ["latest.json", "step_00000005"]
    assert sorted(os.listdir(manager.directory / "step_00000005")) == [
        "manifest.json",
        "state.json",
        "tensors.safetensors",
    ]
    pointer = json.loads((manager.directory / "latest.json").read_text())
    assert pointer["checkpoint"] == "step_00000005" and pointer["step"] == 5
    manifest = json.loads((manager.directory / "step_00000005" / "manifest.json").read_text())
    assert manifest["step"] == 5 and set(manifest["files"]) == {"state.json", "tensors.safetensors"}
    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 5
    assert torch.equal(loaded.state["weights"], torch.full((4, 4), 5.0))
    assert loaded.state["note"] == "at 5"


def test_empty_or_missing_directory_means_no_checkpoint(tmp_path: Path) -> None:
    assert CheckpointManager(tmp_path / "absent").load_latest() is None
    (tmp_path / "empty").mkdir()
    assert CheckpointManager(tmp_path / "empty").load_latest() is None


def test_retention_keeps_the_newest(tmp_path: Path) -> None:
    manager = saved(tmp_path, range(1, 8), keep_last=3)
    assert visible(manager) == ["latest.json", "step_00000005", "step_00000006", "step_00000007"]
    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 7


def test_retention_leaves_higher_numbered_checkpoints_of_another_run(tmp_path: Path) -> None:
    manager = saved(tmp_path, [100], keep_last=2)
    for step in (1, 2, 3):
        manager.save(step, state(step))
    assert visible(manager) == ["latest.json", "step_00000002", "step_00000003", "step_00000100"]
    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 3  # the pointer, not the highest number


@pytest.mark.parametrize(
    "damage", ["truncate", "flip", "no_manifest", "delete_tensors", "delete_dir", "garbage_state"]
)
def test_corrupt_newest_falls_back_to_the_next_older(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    manager = saved(tmp_path, [1, 2, 3])
    newest = manager.directory / "step_00000003"
    tensors = newest / "tensors.safetensors"
    if damage == "truncate":
        tensors.write_bytes(tensors.read_bytes()[:-7])
    elif damage == "flip":
        data = bytearray(tensors.read_bytes())
        data[-1] ^= 0xFF
        tensors.write_bytes(bytes(data))
    elif damage == "no_manifest":
        (newest / "manifest.json").unlink()
    elif damage == "delete_tensors":
        tensors.unlink()
    elif damage == "delete_dir":
        for file in newest.iterdir():
            file.unlink()
        newest.rmdir()
    elif damage == "garbage_state":
        (newest / "state.json").write_text("{not json")
        rewrite_manifest(newest)  # passes the hashes, fails decoding
    with caplog.at_level(logging.WARNING, logger="speedtronic.checkpoint"):
        loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 2
    assert torch.equal(loaded.state["weights"], torch.full((4, 4), 2.0))
    assert "step_00000003" in caplog.text


def test_no_usable_checkpoint_is_an_error_naming_each(tmp_path: Path) -> None:
    manager = saved(tmp_path, [1, 2])
    for path in manager.candidates():
        (path / "tensors.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no usable checkpoint") as info:
        manager.load_latest()
    assert "step_00000001" in str(info.value) and "step_00000002" in str(info.value)
    assert "allow_fresh_start" in str(info.value)


def test_pointer_to_a_missing_checkpoint_with_nothing_older_is_an_error(tmp_path: Path) -> None:
    manager = saved(tmp_path, [1])
    (manager.directory / "latest.json").write_text(json.dumps({"checkpoint": "step_00000009"}))
    for file in (manager.directory / "step_00000001").iterdir():
        file.unlink()
    (manager.directory / "step_00000001").rmdir()
    with pytest.raises(CheckpointError, match="step_00000009"):
        manager.load_latest()


@pytest.mark.parametrize(
    "name",
    [
        "../x",
        "../step_00000002",
        "/tmp/step_00000002",
        "step_00000002/../../x",
        "step_2",
        "step_00000002 ",
        7,
        None,
    ],
)
def test_pointer_outside_the_naming_pattern_is_never_followed(
    tmp_path: Path, name: Any, caplog: pytest.LogCaptureFixture
) -> None:
    manager = saved(tmp_path, [1])
    # A perfectly valid, newer checkpoint outside the directory: following the pointer would
    # load it (step 2); rejecting the pointer falls back to the directory's own step 1.
    outside = CheckpointManager(tmp_path, keep_last=10)
    outside.save(2, state(2))
    (tmp_path / "x").symlink_to(tmp_path / "step_00000002")
    (manager.directory / "latest.json").write_text(json.dumps({"checkpoint": name}))
    with caplog.at_level(logging.WARNING, logger="speedtronic.checkpoint"):
        loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 1
    assert "not a checkpoint name" in caplog.text


def test_symlinked_checkpoint_directory_is_not_followed(tmp_path: Path) -> None:
    elsewhere = saved(tmp_path / "elsewhere", [9])
    manager = saved(tmp_path, [1])
    (manager.directory / "step_00000009").symlink_to(elsewhere.directory / "step_00000009")
    (manager.directory / "latest.json").write_text(json.dumps({"checkpoint": "step_00000009"}))
    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 1


def test_unreadable_pointer_falls_back_to_scanning(tmp_path: Path) -> None:
    manager = saved(tmp_path, [1, 2])
    (manager.directory / "latest.json").write_text("{torn")
    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 2


class Payload:
    """Unpickling this creates ``marker``: the proof that pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def test_crafted_pickle_payloads_are_never_executed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"model": Payload(marker)}, evil)
    # Control: the payload is live, a pickle-based loader runs it.
    torch.load(evil, weights_only=False)
    assert marker.exists()
    marker.unlink()

    manager = saved(tmp_path, [1, 2, 3])
    directory = manager.directory
    (directory / "step_00000003" / "tensors.safetensors").write_bytes(evil.read_bytes())
    rewrite_manifest(directory / "step_00000003")
    (directory / "step_00000002" / "state.json").write_bytes(evil.read_bytes())
    rewrite_manifest(directory / "step_00000002")
    for extra in ("checkpoint.pt", "step_00000003/model.pt", "step_00000003/optimizer.pt"):
        (directory / extra).write_bytes(evil.read_bytes())
    (directory / "step_00000004").mkdir()
    (directory / "step_00000004" / "model.pt").write_bytes(evil.read_bytes())

    with caplog.at_level(logging.WARNING, logger="speedtronic.checkpoint"):
        loaded = manager.load_latest()
    assert not marker.exists()
    assert loaded is not None and loaded.step == 1
    assert "step_00000003" in caplog.text and "step_00000002" in caplog.text

    for path in manager.candidates():
        if path.name != "step_00000004":
            (path / "tensors.safetensors").write_bytes(evil.read_bytes())
            rewrite_manifest(path)
    with pytest.raises(CheckpointError):
        manager.load_latest()
    assert not marker.exists()


def test_a_failed_save_leaves_the_previous_checkpoint_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = saved(tmp_path, [1])

    def crash(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    for target in ("save_file", "atomic_write_text", "fsync_dir"):
        with monkeypatch.context() as patch:
            patch.setattr(checkpoint_module, target, crash)
            with pytest.raises(CheckpointError, match="disk full"):
                manager.save(2, state(2))
        loaded = manager.load_latest()
        assert loaded is not None
        # Before the pointer moves the old checkpoint stays latest; a crash in fsync_dir
        # after the rename may leave step 2 complete but unreferenced, which is also fine.
        assert loaded.step == 1
    assert not [p for p in manager.directory.iterdir() if p.name.startswith(".")]
    manager.save(2, state(2))
    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 2


def test_unserialisable_state_is_a_checkpoint_error(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match=r"plugins\.mine"):
        manager.save(1, {"plugins": {"mine": object()}})
    assert manager.load_latest() is None


def test_leftovers_of_an_interrupted_save_are_ignored_then_cleaned(tmp_path: Path) -> None:
    manager = saved(tmp_path, [1])
    staging = manager.directory / ".step_00000002.abc.tmp"
    staging.mkdir()
    save_file({"w": torch.zeros(1)}, str(staging / "tensors.safetensors"))
    complete_but_unpointed = manager.directory / "step_00000002"
    complete_but_unpointed.mkdir()  # renamed into place, crash before the pointer: no manifest
    torn_pointer = manager.directory / ".latest.json.k1ll3d.tmp"  # killed mid pointer update
    torn_pointer.write_text('{"checkpoint": "step_000')
    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 1
    manager.save(2, state(2))  # re-saving the step replaces the torn directory
    assert visible(manager) == ["latest.json", "step_00000001", "step_00000002"]
    everything = sorted(p.name for p in manager.directory.iterdir())
    assert everything == ["latest.json", "step_00000001", "step_00000002"]
    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 2


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    manager = saved(tmp_path, [1, 2])
    manager.save(2, {"step": 2, "weights": torch.ones(1), "note": "again"})
    loaded = manager.load_latest()
    assert loaded is not None and loaded.state["note"] == "again"
    assert visible(manager) == ["latest.json", "step_00000001", "step_00000002"]


def test_checkpoint_names() -> None:
    assert checkpoint_name(0) == "step_00000000"
    assert checkpoint_name(123456789) == "step_123456789"
    with pytest.raises(ValueError):
        checkpoint_name(-1)


def test_sha256_chunks_hash_each_slice(tmp_path: Path) -> None:
    data = os.urandom(3 * (1 << 20) + 5)
    path = tmp_path / "blob"
    path.write_bytes(data)
    size = 1 << 20
    expected = [hashlib.sha256(data[i : i + size]).hexdigest() for i in range(0, len(data), size)]
    assert sha256_chunks(path, size, workers=3) == expected
    assert sha256_chunks(path, size, workers=1) == expected
    (tmp_path / "empty").write_bytes(b"")
    assert sha256_chunks(tmp_path / "empty") == [hashlib.sha256(b"").hexdigest()]


def test_manifest_with_absurd_hash_slices_is_rejected(tmp_path: Path) -> None:
    manager = saved(tmp_path, [1, 2])
    newest = manager.directory / "step_00000002"
    manifest = json.loads((newest / "manifest.json").read_text())
    entry = manifest["files"]["tensors.safetensors"]
    entry["chunk_bytes"] = 1  # would mean one hash per byte
    data = (newest / "tensors.safetensors").read_bytes()
    entry["sha256"] = [hashlib.sha256(data[i : i + 1]).hexdigest() for i in range(len(data))]
    (newest / "manifest.json").write_text(json.dumps(manifest))
    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 1
