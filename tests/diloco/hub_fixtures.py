"""Shared pieces for the Hub tests: a running emulator, transports bound to it, and the
client's own retry sleeps recorded instead of slept."""

from __future__ import annotations

import time
import types
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
import pytest
from hub_emulator import HubEmulator
from huggingface_hub import constants, file_download
from huggingface_hub.utils import _http as hf_http

from speedtronic_diloco.transports import GlobalMetadata
from speedtronic_diloco.transports.hub import HubTransport

TOKEN = "hf_test_secret_token"
REPO = "speedtronic/diloco-run"
HANG_TIMEOUT = 1.0
"""The request timeout of tests that hang one request on purpose. The requests before it must
still succeed within it, so it is not tiny: a loaded machine answers slower, never faster."""


@pytest.fixture(name="hub")
def hub_fixture(monkeypatch: pytest.MonkeyPatch) -> Iterator[HubEmulator]:
    """A running emulator; the client's shared connections are dropped around it. Import
    ``hub_fixture`` into a test module to get the ``hub`` fixture."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    huggingface_hub.close_session()
    with HubEmulator() as emulator:
        yield emulator
    huggingface_hub.close_session()  # drop pooled connections to the stopped server


@pytest.fixture(name="client_sleeps")
def client_sleeps_fixture(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The sleeps of the client's own backoff, recorded instead of slept (keeps tests fast).
    Import ``client_sleeps_fixture`` to get the ``client_sleeps`` fixture."""
    slept: list[float] = []
    fake_time = types.SimpleNamespace(sleep=slept.append)
    monkeypatch.setattr(hf_http, "time", fake_time)
    monkeypatch.setattr(file_download, "time", fake_time)
    return slept


def transport(hub: HubEmulator, timeout: float = 5.0, token: str = TOKEN) -> HubTransport:
    """A HubTransport on the emulator's REPO."""
    return HubTransport(REPO, token=token, endpoint=hub.endpoint, request_timeout=timeout)


def publish(
    store: HubTransport, tmp_path: Path, outer_step: int, data: bytes, master: str = "node-a"
) -> GlobalMetadata:
    """Publish ``data`` as the global weights of ``outer_step``."""
    path = tmp_path / f"publish-{master}-{outer_step}.safetensors"
    path.write_bytes(data)
    metadata = GlobalMetadata.for_file(
        path, outer_step, published_at=time.time(), master=master, deltas_included=1
    )
    return store.publish_global(path, metadata)


def delta_file(tmp_path: Path, name: str, data: bytes) -> Path:
    """A local file to upload as a delta."""
    path = tmp_path / name
    path.write_bytes(data)
    return path
