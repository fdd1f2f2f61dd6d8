"""Test doubles for DumbDiLoCo: an in-memory transport with injectable failures and stalls,
tiny models, helpers to drive a coordinator by hand, and the one master factory
(:func:`make_master`)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speedtronic.checkpoint.fileio import atomic_write_bytes
from speedtronic_diloco.aggregation import AggregationRules
from speedtronic_diloco.config import DistributedConfig
from speedtronic_diloco.master.loop import MasterOuterLoop
from speedtronic_diloco.transports import (
    GLOBAL_WEIGHTS,
    DeltaInfo,
    GlobalMetadata,
    IntegrityError,
    Transport,
    delta_path,
    parse_delta_path,
)

SETTLE = 120.0
"""Bound, in seconds, of every wait for another thread in these tests. Generous on purpose:
waits end as soon as their condition holds, and the bound only matters on a loaded machine."""


class MemoryTransport(Transport):
    """A store held in a dict. ``fail(method, exc, times)`` makes the next calls raise;
    ``hold(method)`` returns an Event that the next calls wait on until it is set."""

    description = "memory://test"

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.metadata: GlobalMetadata | None = None
        self.calls: list[str] = []
        self.created: list[bool] = []
        self.granted: list[list[str]] = []
        self.supports_grants = False
        self._failures: dict[str, deque[BaseException]] = defaultdict(deque)
        self._holds: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Event] = defaultdict(threading.Event)
        self._lock = threading.Lock()
        self._version = 0

    # ----------------------------------------------------------------- injection
    def fail(self, method: str, exc: BaseException, times: int = 1) -> None:
        for _ in range(times):
            self._failures[method].append(exc)

    def hold(self, method: str) -> threading.Event:
        event = threading.Event()
        self._holds[method] = event
        return event

    def _enter(self, method: str) -> None:
        with self._lock:
            self.calls.append(method)
        self.entered[method].set()
        hold = self._holds.get(method)
        if hold is not None:
            hold.wait(SETTLE)
        with self._lock:
            if self._failures[method]:
                raise self._failures[method].popleft()

    def count(self, method: str) -> int:
        return self.calls.count(method)

    # ----------------------------------------------------------------- interface
    def create_store(self, *, private: bool = True) -> None:
        self._enter("create_store")
        self.created.append(private)

    def grant_write_access(self, users: Any) -> None:
        self._enter("grant_write_access")
        if not self.supports_grants:
            super().grant_write_access(users)
        self.granted.append(list(users))

    def read_global_metadata(self) -> GlobalMetadata | None:
        self._enter("read_global_metadata")
        return self.metadata

    def download_global(self, metadata: GlobalMetadata, dest: Path) -> Path:
        self._enter("download_global")
        data = self.files[metadata.model_file]
        if hashlib.sha256(data).hexdigest() != metadata.sha256:
            raise IntegrityError("sha256 mismatch")
        atomic_write_bytes(dest, data)
        return dest

    def publish_global(self, weights: Path, metadata: GlobalMetadata) -> GlobalMetadata:
        self._enter("publish_global")
        with self._lock:
            self._version += 1
            self.files[GLOBAL_WEIGHTS] = Path(weights).read_bytes()
            self.metadata = metadata.with_revision(f"rev{self._version}")
            return self.metadata

    def upload_delta(self, node_id: str, local_step: int, source: Path) -> None:
        self._enter("upload_delta")
        self.files[delta_path(node_id, local_step)] = Path(source).read_bytes()

    def list_deltas(self) -> list[DeltaInfo]:
        self._enter("list_deltas")
        out = []
        for path, data in sorted(self.files.items()):
            parsed = parse_delta_path(path)
            if parsed is not None:
                out.append(
                    DeltaInfo(
                        parsed[0], parsed[1], path, len(data), hashlib.sha256(data).hexdigest()
                    )
                )
        return out

    def download_delta(self, info: DeltaInfo, dest: Path) -> Path:
        self._enter("download_delta")
        atomic_write_bytes(dest, self.files[info.path])
        return dest

    # ----------------------------------------------------------------- helpers
    def publish_state(self, state: dict[str, torch.Tensor], outer_step: int, tmp: Path) -> None:
        """Publish ``state`` as the global of ``outer_step`` (as a master would)."""
        from speedtronic_diloco.tensors import save_tensors

        path = save_tensors(tmp / f"pub_{outer_step}.safetensors", state)
        self.files[GLOBAL_WEIGHTS] = path.read_bytes()
        self.metadata = GlobalMetadata.for_file(path, outer_step)

    def deltas(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every stored delta, decoded."""
        from safetensors.torch import load

        return {p: load(d) for p, d in self.files.items() if p.startswith("nodes/")}


class TinyNet(nn.Module):
    """Two linear layers plus an integer buffer (which travels with globals, not deltas)."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, 1)
        self.register_buffer("counter", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def make_net(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def nudge(model: nn.Module, amount: float = 0.01) -> None:
    """Stand-in for an optimizer step: move every parameter by ``amount``."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(amount)


def dist_config(**overrides: Any) -> DistributedConfig:
    """A DistributedConfig for tests: no retry waits, uploads and polls on the training thread,
    and async rounds unless asked otherwise (sync rounds wait at every boundary for a master
    these in-process fixtures do not run)."""
    values: dict[str, Any] = dict(
        enabled=True,
        role="worker",
        node_id="w1",
        repo_id="memory",
        inner_steps=2,
        poll_interval=3600.0,
        outer_lr=1.0,
        outer_momentum=0.0,
        rounds="async",
        async_delta_upload=False,
        async_global_poll=False,
        max_retries=2,
        retry_backoff=0.0,
    )
    values.update(overrides)
    return DistributedConfig(**values)


def wait_for(predicate: Callable[[], bool], timeout: float = SETTLE, what: str = "") -> None:
    """Bounded polling for a condition that another thread makes true."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.01)


def make_master(
    store: Transport,
    tmp_path: Path,
    *,
    lr: float = 0.7,
    momentum: float = 0.0,
    events: list[Any] | None = None,
    start: dict[str, torch.Tensor] | None = None,
    state_dir: Path | None = None,
    cache_dir: Path | None = None,
    rules: dict[str, Any] | None = None,
    **options: Any,
) -> MasterOuterLoop:
    """The master ``m`` over ``store``: state in ``tmp_path/state`` and cache in
    ``tmp_path/cache`` unless given, metric events appended to ``events``, round ``rules``
    (AggregationRules fields); bootstrapped from ``start`` when it loaded no state."""
    loop = MasterOuterLoop(
        store,
        node_id="m",
        state_dir=state_dir or tmp_path / "state",
        cache_dir=cache_dir or tmp_path / "cache",
        outer_lr=lr,
        outer_momentum=momentum,
        emit=(lambda e, p: events.append((e, p))) if events is not None else None,
        rules=AggregationRules(**(rules or {})),
        **options,
    )
    if start is not None and loop.global_state is None:
        loop.keeper.bootstrap(start)
    return loop
