"""The rooms of speedtronic_diloco (sizes and import cycles: tests/test_layout.py): no former
import path, and the shared helpers (the retry helper, the verified download, the
global cache, the one default state directory)."""

from __future__ import annotations

import hashlib
import importlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from diloco_fakes import MemoryTransport, dist_config, make_net

from speedtronic_diloco.cache import GlobalCache
from speedtronic_diloco.config import DEFAULT_STATE_DIR, resolve_state_dir
from speedtronic_diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.tensors import save_tensors
from speedtronic_diloco.transports import (
    GlobalMetadata,
    IntegrityError,
    PermanentTransportError,
    TransientTransportError,
)
from speedtronic_diloco.transports.base import write_verified


@pytest.mark.parametrize(
    "former",
    ["speedtronic_diloco.transport", "speedtronic_diloco.shared_dir", "speedtronic_diloco.hub"],
)
def test_former_import_paths_are_gone(former: str) -> None:
    # One import path per thing: the transports live in speedtronic_diloco.transports only.
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(former)


# --------------------------------------------------------------------------- retry helper


def test_attempt_logs_one_warning_and_reports_the_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy = RetryPolicy(retries=2, backoff=0.0)
    calls: list[int] = []
    seen: list[Exception] = []

    def flaky() -> int:
        calls.append(1)
        raise TransientTransportError("503")

    with caplog.at_level(logging.INFO, "speedtronic.diloco"):
        result = policy.attempt("reading x", flaky, then="carrying on", on_failure=seen.append)
    assert result == (False, None) and len(calls) == 3 and len(seen) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["reading x failed (503); carrying on"]

    calls.clear()

    def refused() -> int:
        calls.append(1)
        raise PermanentTransportError("403")

    assert policy.attempt("writing x", refused) == (False, None) and len(calls) == 1
    assert policy.attempt("reading y", lambda: None) == (True, None)  # None is a result too
    with pytest.raises(KeyError):  # not a store failure: a bug, and it propagates
        policy.attempt("reading z", lambda: {}["missing"])


# --------------------------------------------------------------------------- verified download


def test_write_verified_leaves_nothing_on_mismatch(tmp_path: Path) -> None:
    data = b"0123456789"
    sha = hashlib.sha256(data).hexdigest()
    dest = tmp_path / "out" / "file.bin"
    assert write_verified([data[:4], data[4:]], dest, where="x", size=10, sha256=sha) == dest
    assert dest.read_bytes() == data
    pulled: list[bytes] = []

    def endless() -> Iterator[bytes]:
        while True:
            pulled.append(b"ab")
            yield b"ab"

    with pytest.raises(IntegrityError, match="more than the expected 10 bytes"):
        write_verified(endless(), dest, where="x", size=10)
    assert len(pulled) == 6  # stopped reading at the first byte too many
    assert not dest.exists()  # the older file is gone too: it must not pass for this one
    for bad in ({"size": 9}, {"sha256": "0" * 64}, {"size": 10, "git_oid": "0" * 40}):
        with pytest.raises(IntegrityError):
            write_verified([data], dest, where="x", **bad)
        assert not dest.exists() and list(dest.parent.iterdir()) == []


# --------------------------------------------------------------------------- global cache


def test_global_cache_verifies_and_keeps_the_newest_versions(tmp_path: Path) -> None:
    cache = GlobalCache(tmp_path / "global", keep=2)
    downloads: list[int] = []

    def publish(step: int) -> tuple[GlobalMetadata, Path]:
        source = save_tensors(tmp_path / f"v{step}.safetensors", {"w": torch.full((2,), step)})
        return GlobalMetadata.for_file(source, step), source

    def download_from(source: Path, step: int) -> Callable[[Path], bool]:
        def download(dest: Path) -> bool:
            downloads.append(step)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(source.read_bytes())
            return True

        return download

    metas = [publish(step) for step in range(4)]
    for step, (meta, source) in enumerate(metas):
        tensors = cache.get(meta, download_from(source, step))
        assert tensors is not None and float(tensors["w"][0]) == step
    assert downloads == [0, 1, 2, 3]
    assert sorted(p.name for p in cache.directory.iterdir()) == [
        cache.path_for(metas[2][0]).name,
        cache.path_for(metas[3][0]).name,
    ]
    meta, source = metas[3]
    assert cache.get(meta, download_from(source, 99)) is not None  # a verified hit
    cache.path_for(meta).write_bytes(b"corrupt")
    assert cache.get(meta, download_from(source, 3)) is not None  # deleted, downloaded again
    assert downloads == [0, 1, 2, 3, 3]
    assert cache.get(metas[0][0], lambda dest: False) is None  # a failed download


# --------------------------------------------------------------------------- state dir


def test_one_default_state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    section = dist_config()
    assert resolve_state_dir(section) == Path(DEFAULT_STATE_DIR)
    assert resolve_state_dir(section, tmp_path / "run") == tmp_path / "run" / DEFAULT_STATE_DIR
    absolute = dist_config(state_dir=str(tmp_path / "elsewhere"))
    assert resolve_state_dir(absolute, tmp_path / "run") == tmp_path / "elsewhere"
    monkeypatch.chdir(tmp_path)
    coordinator = DumbDiLoCoCoordinator(section, make_net(), hub=MemoryTransport())
    assert coordinator.state_root == Path(DEFAULT_STATE_DIR) / "w1"  # by hand: the cwd
