"""Regression tests for the red-team findings in core: each named after what broke.

Checkpoints: an unwritable directory is found before training, a full disk is a
CheckpointError (retried once) with the earlier checkpoints intact, a tampered state or pointer
counts as a corrupt checkpoint. Config: hostile documents give one ConfigError naming the key,
never a traceback, and never echo what may be a secret.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from core.toy_runs import EventRecorder, tiny_transformer_run, train
from safetensors import SafetensorError

import speedtronic.engine.trainer as trainer_module
from speedtronic import SpeedtronicConfig, cli
from speedtronic.checkpoint import CheckpointManager, checkpoint_name
from speedtronic.checkpoint import storage as storage_module
from speedtronic.checkpoint.fileio import manifest_entry
from speedtronic.checkpoint.names import HASH_CHUNK_BYTES
from speedtronic.engine.runtime import build_runtime
from speedtronic.errors import CheckpointError, ConfigError

# ---------------------------------------------------------------- checkpoints


def test_unwritable_checkpoint_directory_is_found_before_the_first_step(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the checkpoint directory should be\n")
    config = tiny_transformer_run(tmp_path, checkpoint={"directory": str(blocker / "ckpt")})
    recorder = EventRecorder()
    runtime = build_runtime(config, hooks=[recorder], console=False)
    with pytest.raises(CheckpointError, match=r"cannot write checkpoints to .*not-a-directory"):
        runtime.trainer.fit()
    assert recorder.named("step") == [] and runtime.trainer.step == 0  # nothing trained, lost


@pytest.mark.slow
def test_unwritable_checkpoint_directory_is_one_clean_cli_error(tmp_path: Path) -> None:
    blocker = tmp_path / "blocked"
    blocker.write_text("x")
    config_file = tmp_path / "run.json"
    config_file.write_text(
        json.dumps(tiny_transformer_run(tmp_path, checkpoint={"directory": str(blocker / "c")}))
    )
    done = subprocess.run(
        [sys.executable, "-m", "speedtronic", "train", "--config", str(config_file)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "error: cannot write checkpoints to" in done.stderr
    assert "step step=" not in done.stdout


@contextlib.contextmanager
def small_filesystem(tmp_path: Path, size_kib: int) -> Iterator[Path | None]:
    """A real tmpfs of ``size_kib`` (root only); None where mounting is not allowed."""
    mount_point = tmp_path / "small-fs"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(mount_point)],
        capture_output=True,
    )
    if mounted.returncode != 0:
        yield None
        return
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def fill(directory: Path) -> Path:
    """Fill the filesystem of ``directory`` up to the last few KiB."""
    filler = directory / "filler"
    with contextlib.suppress(OSError), open(filler, "wb") as handle:
        while True:
            handle.write(b"\0" * 4096)
            handle.flush()
    return filler


def test_disk_full_during_a_save_is_a_checkpoint_error_with_the_free_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tiny_transformer_run(tmp_path, run={"max_steps": 8})
    _, _, trainer = train(config)
    with small_filesystem(tmp_path, 4096) as small:
        if small is None:  # no mount privilege: the same error safetensors raises on a full disk
            directory = tmp_path / "ckpt"

            def full(*args: Any, **kwargs: Any) -> None:
                raise SafetensorError("Error while serializing: No space left on device")

            save_first = CheckpointManager(directory, keep_last=3)
            save_first.save(8, trainer.state_dict())
            monkeypatch.setattr(storage_module, "save_file", full)
        else:
            directory = small / "ckpt"
            save_first = CheckpointManager(directory, keep_last=3)
            save_first.save(8, trainer.state_dict())
            fill(small)
        trainer.checkpoints = CheckpointManager(directory, keep_last=3)
        trainer.config.checkpoint.save_retry_pause = 0.0
        trainer.step = 9
        with pytest.raises(CheckpointError, match=r"step_00000009 .*MiB free") as caught:
            trainer.save_checkpoint()
        assert caught.value.__cause__ is None and caught.value.__context__ is not None
        # The earlier checkpoint is intact and still the latest; the trainer's state is in
        # memory, so once space is freed the same call succeeds.
        assert trainer.checkpoints.load_latest().step == 8
        assert trainer.step == 9
        if small is not None:
            (small / "filler").unlink()
        else:
            monkeypatch.undo()
        assert trainer.save_checkpoint().name == checkpoint_name(9)
        assert trainer.checkpoints.load_latest().step == 9


def test_a_failed_save_is_retried_once_after_the_pause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tiny_transformer_run(tmp_path, run={"max_steps": 4}, checkpoint={"interval": 0})
    _, _, trainer = train(config)
    real_save = storage_module.save_file
    failures = iter([True])

    def flaky(*args: Any, **kwargs: Any) -> None:
        if next(failures, False):
            raise OSError(28, "No space left on device")
        real_save(*args, **kwargs)

    pauses: list[float] = []
    monkeypatch.setattr(storage_module, "save_file", flaky)
    monkeypatch.setattr(trainer_module.time, "sleep", pauses.append)
    trainer.step = 5
    assert trainer.save_checkpoint().name == checkpoint_name(5)
    assert pauses == [trainer.config.checkpoint.save_retry_pause]


def rewrite_consistently(checkpoint: Path, edit: Any) -> None:
    """Tamper with a checkpoint's state.json and fix its manifest, as an attacker could."""
    state_file = checkpoint / "state.json"
    state = json.loads(state_file.read_text())
    edit(state)
    state_file.write_text(json.dumps(state))
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"]["state.json"] = manifest_entry(state_file, HASH_CHUNK_BYTES)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def test_tampered_state_without_rng_counts_as_a_corrupt_checkpoint(tmp_path: Path) -> None:
    config = tiny_transformer_run(tmp_path, run={"max_steps": 8})
    train(config)
    newest = tmp_path / "checkpoints" / checkpoint_name(8)
    rewrite_consistently(newest, lambda state: state.pop("rng"))
    resumed = tiny_transformer_run(tmp_path, run={"max_steps": 10}, checkpoint={"resume": True})
    result, _, _ = train(resumed)
    assert result.resumed_from == 4 and result.steps == 10  # fell back to the older one


def test_pointer_naming_a_5000_digit_step_is_ignored(tmp_path: Path) -> None:
    config = tiny_transformer_run(tmp_path, run={"max_steps": 8})
    train(config)
    pointer = tmp_path / "checkpoints" / "latest.json"
    pointer.write_text(json.dumps({"checkpoint": "step_" + "9" * 5000, "step": 1}))
    (tmp_path / "checkpoints" / ("step_" + "1" * 200)).mkdir()
    loaded = CheckpointManager(tmp_path / "checkpoints").load_latest()
    assert loaded is not None and loaded.step == 8


# ---------------------------------------------------------------- config


HOSTILE_DOCUMENTS = {
    "section_that_is_a_scalar": ("run: 5\n", r"^run: expected a mapping"),
    "unhashable_yaml_key": ("? [a, b]\n: 1\n", r"a list cannot be a key \(line 1"),
    "5000_deep_nesting": ("a: " + "[" * 5000 + "]" * 5000 + "\n", r"nested too deeply"),
    "integer_past_the_digit_limit": ("run:\n  seed: " + "9" * 5000 + "\n", r"too many digits"),
    "seed_of_2_to_the_100": (f"run:\n  seed: {2**100}\n", r"^run\.seed: is out of range"),
    "non_string_model_parameter_key": ("model:\n  name: x\n  1: 2\n", r"^model: keys must be"),
    "infinite_float_option": ("optimizer:\n  lr: .inf\n", r"^optimizer\.lr: must be a finite"),
    "nan_float_option": ("optimizer:\n  lr: .nan\n", r"^optimizer\.lr: must be a finite"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_DOCUMENTS))
def test_hostile_config_documents_are_one_config_error(name: str) -> None:
    text, message = HOSTILE_DOCUMENTS[name]
    with pytest.raises(ConfigError, match=message):
        SpeedtronicConfig.from_string(text)


def test_non_utf8_config_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"run:\n  name: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"latin1\.yaml is not UTF-8 text \(byte 0xe9"):
        SpeedtronicConfig.from_file(path)


def test_override_that_makes_a_section_a_scalar_is_one_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    smoke = Path(__file__).parents[2] / "configs" / "smoke.yaml"
    code = cli.main(["validate", "--config", str(smoke), "--set", "run=5"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == "error: run: expected a mapping, got int"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("run.device", "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345"),
        ("run.max_steps", "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345"),
        ("data.micro_batch_size", "sk-live-0123456789abcdef0123456789"),
        ("optimizer.betas", ["hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345", 0.9]),
    ],
)
def test_a_token_in_the_wrong_field_is_not_echoed(field: str, value: Any) -> None:
    section, key = field.split(".")
    with pytest.raises(ConfigError) as caught:
        SpeedtronicConfig.from_dict({section: {key: value}})
    secret = value if isinstance(value, str) else value[0]
    assert str(caught.value).startswith(f"{field}: ")
    assert secret not in str(caught.value)
    # Nor kept in the exception chain, where a traceback or a logger would print it.
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_values_that_cannot_be_secrets_are_still_shown() -> None:
    with pytest.raises(ConfigError, match=r"expected an integer, got 'lots'"):
        SpeedtronicConfig.from_dict({"run": {"max_steps": "lots"}})
