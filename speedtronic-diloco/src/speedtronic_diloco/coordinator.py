"""DumbDiLoCoCoordinator: one node's side of DumbDiLoCo.

Every ``inner_steps`` optimizer steps the node uploads its pseudo-gradient (baseline minus
current weights) and polls for newer global weights; between boundaries it polls every
``poll_interval`` seconds. Uploads and polls run in background lanes by default, so the
training thread only copies tensors; global weights are installed by the training thread at
its next callback, never by a lane. The master also runs the outer loop
(:class:`~speedtronic_diloco.outer.MasterOuterLoop`) in a thread of its own; which state it
continues from at startup is decided in :mod:`speedtronic_diloco.startup`. Downloaded globals
are kept per version in a :class:`~speedtronic_diloco.cache.GlobalCache`.

The baseline (the weights the next delta is measured from) advances only after a successful
upload, to the exact snapshot that was uploaded, and only if no global was installed in the
meantime (the *generation* check). A failed upload therefore leaves the baseline in place and
the next boundary sends the cumulative delta.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from speedtronic_diloco.cache import GlobalCache
from speedtronic_diloco.config import DistributedConfig, distributed_config, resolve_state_dir
from speedtronic_diloco.identity import resolve_node_id
from speedtronic_diloco.lanes import Lane
from speedtronic_diloco.outer import MasterOuterLoop
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.startup import prepare_master
from speedtronic_diloco.tensors import (
    StateMismatchError,
    TensorDict,
    compute_pseudo_gradient,
    cpu_state_dict,
    install_state,
    save_tensors,
)
from speedtronic_diloco.transports import GlobalMetadata, Transport, open_transport

__all__ = ["STOP_TIMEOUT", "DumbDiLoCo", "DumbDiLoCoCoordinator", "SyncResult"]

log = logging.getLogger("speedtronic.diloco")

STOP_TIMEOUT = 10.0
CUMULATIVE = "the next boundary sends a cumulative delta"


@dataclass(frozen=True)
class SyncResult:
    """What one synchronisation did: a delta pushed, a global loaded, the outer step seen."""

    pushed: bool
    loaded_global: bool
    outer_step: int


@dataclass(frozen=True)
class _UploadJob:
    local_step: int
    generation: int
    target: TensorDict
    delta: TensorDict
    base_outer_step: int


class DumbDiLoCoCoordinator:
    """One node of a DumbDiLoCo run (see the module docstring).

    ``config`` is a DistributedConfig, a SpeedtronicConfig or a root mapping with a
    ``distributed`` section. ``hub`` injects a :class:`~speedtronic_diloco.transports.Transport`
    (default: the one ``repo_id`` selects). State lives under ``<state_dir>/<node_id>/``;
    ``state_dir`` defaults to ``distributed.state_dir``, else ``diloco`` in the working
    directory (the trainer plugin passes ``<run.output_dir>/diloco``). ``logger`` receives
    metric events, always from the thread that calls :meth:`start`,
    :meth:`after_optimizer_step` and :meth:`stop`: an object with ``emit(event, payload)`` (a
    Trainer or a MetricLogger) or a callable ``(event, payload)``.
    """

    def __init__(
        self,
        config: Any,
        model: nn.Module,
        *,
        hub: Transport | None = None,
        state_dir: str | Path | None = None,
        logger: Any = None,
    ) -> None:
        self.config: DistributedConfig = distributed_config(config)
        self.node_id = resolve_node_id(self.config.node_id)
        self.role = self.config.role
        self.model = model
        root = Path(state_dir) if state_dir else resolve_state_dir(self.config)
        self.state_root = root / self.node_id
        cache = Path(self.config.cache_dir) / self.node_id if self.config.cache_dir else None
        self.cache_dir = cache or self.state_root / "cache"
        self._globals = GlobalCache(self.cache_dir / "global")
        self.transport: Transport = hub if hub is not None else open_transport(self.config)
        self._emit_to = _emitter(logger)
        self._events: queue.SimpleQueue[tuple[str, dict[str, Any]]] = queue.SimpleQueue()
        self._retry = RetryPolicy(self.config.max_retries, self.config.retry_backoff)
        self._lock = threading.RLock()
        self._baseline: TensorDict = cpu_state_dict(model.state_dict())
        self._generation = 0
        self._local_step = 0
        self._last_global_step = -1
        self._last_uploaded_step: int | None = None
        self._ready: tuple[int, TensorDict] | None = None
        self._last_poll = -math.inf
        self._prepared = False
        self._prepared_outer: dict[str, Any] | None = None
        self._started = False
        self._stop = threading.Event()
        self._upload_lane: Lane | None = None
        self._poll_lane: Lane | None = None
        self.outer: MasterOuterLoop | None = None

    # ----------------------------------------------------------------- properties
    @property
    def local_step(self) -> int:
        """The last optimizer step seen by :meth:`after_optimizer_step`."""
        return self._local_step

    @property
    def last_global_step(self) -> int:
        """Outer step of the global weights installed last (-1: none yet)."""
        return self._last_global_step

    @property
    def outer_step(self) -> int:
        """The newest outer step this node knows: the master's own, a worker's installed one."""
        if self.outer is not None:
            return self.outer.outer_step
        return max(self._last_global_step, 0)

    @property
    def started(self) -> bool:
        return self._started

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the role's lifecycle (idempotent until :meth:`stop`)."""
        if self._started:
            return
        self._started = True
        self._stop = threading.Event()
        self.state_root.mkdir(parents=True, exist_ok=True)
        log.info(
            "DumbDiLoCo %s %r on %s (inner_steps %d)",
            self.role,
            self.node_id,
            self.transport.description,
            self.config.inner_steps,
        )
        if self.role == "master":
            self._start_master()
        else:
            self._start_worker()
        if self.config.async_delta_upload:
            self._upload_lane = Lane(f"diloco-upload-{self.node_id}")
        if self.config.async_global_poll and self.role == "worker":
            self._poll_lane = Lane(f"diloco-poll-{self.node_id}")
            if self._prepared:  # resumed: look for newer remote state right away
                self._poll_lane.submit(self._fetch_newer_global)
        self._prepared = False
        self._prepared_outer = None
        self._drain_events()

    def _start_worker(self) -> None:
        if self._prepared:
            # A checkpointed model/baseline pair wins; newer state arrives through polling.
            self._last_poll = -math.inf
            return
        self._last_poll = time.monotonic()
        read, metadata = self._retry.attempt(
            f"reading global metadata from {self.transport.description}",
            self.transport.read_global_metadata,
            self._stop,
            then="training on local weights",
        )
        if read and metadata is None:
            log.info("no global weights published yet; training on local weights")
        if metadata is None:
            return
        tensors = self._fetch_global(metadata)
        if tensors is not None:
            self._install(metadata.outer_step, tensors)

    def _start_master(self) -> None:
        self.outer = prepare_master(
            self.transport,
            self.config,
            node_id=self.node_id,
            state_dir=self.state_root,
            cache_dir=self.cache_dir,
            retry=self._retry,
            stop=self._stop,
            emit=self._queue_event,
            fetch_global=self._fetch_global,
            current_weights=lambda: cpu_state_dict(self.model.state_dict()),
            checkpointed=self._prepared_outer,
        )
        if not self._prepared:
            snapshot = self.outer.snapshot()
            if snapshot is not None:
                self._install(*snapshot)
        self.outer.start(self.config.poll_interval)

    def stop(self) -> None:
        """Stop the lanes and the outer thread without forcing a delta or an outer round;
        waits at most 10 s in all. A later :meth:`start` begins fresh lanes."""
        if not self._started:
            return
        self._stop.set()
        deadline = time.monotonic() + STOP_TIMEOUT
        stuck = []
        if self.outer is not None and not self.outer.stop(deadline - time.monotonic()):
            stuck.append("outer loop")
        for lane in (self._upload_lane, self._poll_lane):
            if lane is not None and not lane.close(deadline - time.monotonic()):
                stuck.append(lane.name)
        if stuck:
            log.warning(
                "DumbDiLoCo shutdown: %s still busy after %.0f s; it finishes in the background",
                ", ".join(stuck),
                STOP_TIMEOUT,
            )
        self._upload_lane = self._poll_lane = None
        self._ready = None
        self._started = False
        self._drain_events()

    # ----------------------------------------------------------------- training callback
    def after_optimizer_step(self, model: nn.Module, step: int) -> bool:
        """Called after optimizer step ``step``; True when a delta was pushed (dispatched, with
        async upload) or newer global weights were installed."""
        if model is not self.model:
            raise ValueError(
                "DumbDiLoCo: after_optimizer_step got a different model than the coordinator "
                "was built with"
            )
        self._local_step = step
        pushed = loaded = False
        boundary = step % self.config.inner_steps == 0
        if boundary:
            pushed = self._boundary_upload(step)
        loaded = self._install_ready()
        now = time.monotonic()
        if boundary or now - self._last_poll >= self.config.poll_interval:
            self._last_poll = now
            loaded = self._poll() or loaded
        self._drain_events()
        return pushed or loaded

    # ----------------------------------------------------------------- upload
    def _boundary_upload(self, step: int) -> bool:
        lane = self._upload_lane
        if lane is not None and lane.busy:
            log.info("step %d: previous delta upload still in flight; skipping this one", step)
            self._queue_event("delta_upload_skipped", {"step": step})
            return False
        current = cpu_state_dict(self.model.state_dict())
        with self._lock:
            baseline, generation = self._baseline, self._generation
            base_outer = self._last_global_step
        try:
            delta = compute_pseudo_gradient(baseline, current)
        except StateMismatchError as exc:
            log.error("step %d: no delta uploaded: %s; measuring from here on", step, exc)
            with self._lock:
                self._baseline = current
                self._generation += 1
            return False
        job = _UploadJob(step, generation, current, delta, base_outer)
        if lane is None:
            return self._upload(job)
        if not lane.submit(lambda: self._upload(job)):
            self._queue_event("delta_upload_skipped", {"step": step})
            return False
        return True

    def _upload(self, job: _UploadJob) -> bool:
        step = job.local_step
        what = f"uploading the delta of step {step}"
        path = self.state_root / "outbox" / f"delta_{step}.safetensors"

        def failed(exc: Exception) -> None:
            self._queue_event("delta_upload_failed", {"step": step, "error": str(exc)[:200]})

        try:
            save_tensors(
                path,
                job.delta,
                {
                    "format": "1",
                    "node_id": self.node_id,
                    "local_step": step,
                    "base_outer_step": job.base_outer_step,
                },
            )
        except OSError as exc:  # the local outbox: full disk, permissions
            log.warning("%s failed (%s); %s", what, exc, CUMULATIVE)
            failed(exc)
            return False
        try:
            sent, _ = self._retry.attempt(
                what,
                lambda: self.transport.upload_delta(self.node_id, step, path),
                self._stop,
                then=CUMULATIVE,
                on_failure=failed,
            )
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        if not sent:
            return False
        with self._lock:
            self._last_uploaded_step = step
            if job.generation == self._generation:
                self._baseline = job.target
        self._queue_event("delta_uploaded", {"step": step, "base_outer_step": job.base_outer_step})
        return True

    # ----------------------------------------------------------------- polling
    def _poll(self) -> bool:
        """Master: take the outer loop's newer snapshot. Worker: fetch (sync) or ask the poll
        lane (async) for newer global weights. True when weights were installed now."""
        if self.outer is not None:
            snapshot = self.outer.snapshot()
            if snapshot is not None and snapshot[0] > self._last_global_step:
                return self._install(*snapshot)
            return False
        if self._poll_lane is not None:
            self._poll_lane.submit(self._fetch_newer_global)
            return False
        fetched = self._fetch_newer_global(stash=False)
        return fetched is not None and self._install(*fetched)

    def _fetch_newer_global(self, stash: bool = True) -> tuple[int, TensorDict] | None:
        """Read metadata and fetch the global if it is newer than what is installed or ready.
        With ``stash`` the result waits in ``_ready`` for the training thread."""
        _, metadata = self._retry.attempt(
            f"polling {self.transport.description}",
            self.transport.read_global_metadata,
            self._stop,
            then="keeping the current weights",
        )
        with self._lock:
            known = max(self._last_global_step, self._ready[0] if self._ready else -1)
        if metadata is None or metadata.outer_step <= known:
            return None
        tensors = self._fetch_global(metadata)
        if tensors is None:
            return None
        if stash:
            with self._lock:
                if self._ready is None or self._ready[0] < metadata.outer_step:
                    self._ready = (metadata.outer_step, tensors)
        return metadata.outer_step, tensors

    def _fetch_global(self, metadata: GlobalMetadata) -> TensorDict | None:
        """The weights ``metadata`` describes, from the per-version cache or the store."""

        def download(dest: Path) -> bool:
            done, _ = self._retry.attempt(
                f"downloading global outer step {metadata.outer_step}",
                lambda: self.transport.download_global(metadata, dest),
                self._stop,
            )
            return done

        return self._globals.get(metadata, download)

    def _install_ready(self) -> bool:
        with self._lock:
            ready, self._ready = self._ready, None
        if ready is None or ready[0] <= self._last_global_step:
            return False
        return self._install(*ready)

    def _install(self, outer_step: int, tensors: TensorDict) -> bool:
        """Load ``tensors`` into the model (training thread only) and re-baseline."""
        install_state(self.model, tensors)
        with self._lock:
            self._baseline = cpu_state_dict(self.model.state_dict())
            self._generation += 1
            self._last_global_step = outer_step
        log.info("installed global weights of outer step %d", outer_step)
        self._queue_event("global_loaded", {"step": self._local_step, "outer_step": outer_step})
        return True

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Counters, baseline and (master) outer state, for trainer checkpoints."""
        with self._lock:
            state: dict[str, Any] = {
                "node_id": self.node_id,
                "role": self.role,
                "last_global_step": self._last_global_step,
                "last_uploaded_step": self._last_uploaded_step,
                "local_step": self._local_step,
                "baseline": dict(self._baseline),
                # An in-flight upload is not saved: the baseline has not advanced for it, so
                # the first boundary after a resume sends the cumulative delta instead.
                "pending_delta": None,
                "pending_delta_step": None,
            }
        if self.outer is not None:
            state["outer"] = self.outer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. Before :meth:`start` this is the prepared startup state:
        the checkpointed model/baseline pair wins, and newer remote state is found by polling.
        After start, a checkpointed baseline older than an installed global is not applied."""
        last_global = int(state.get("last_global_step", -1))
        with self._lock:
            self._local_step = int(state.get("local_step", self._local_step))
            uploaded = state.get("last_uploaded_step")
            self._last_uploaded_step = None if uploaded is None else int(uploaded)
            baseline = state.get("baseline")
            if self._started and last_global < self._last_global_step:
                log.info(
                    "checkpointed baseline (outer step %d) is older than the installed "
                    "global (outer step %d); keeping the newer one",
                    last_global,
                    self._last_global_step,
                )
            elif baseline:
                self._baseline = cpu_state_dict(baseline)
                self._generation += 1
                self._last_global_step = last_global
        outer_state = state.get("outer")
        if outer_state:
            if self.outer is not None:
                self.outer.load_state_dict(outer_state)
            else:
                self._prepared_outer = outer_state
        if not self._started:
            self._prepared = True

    # ----------------------------------------------------------------- events
    def _queue_event(self, event: str, payload: dict[str, Any]) -> None:
        self._events.put((event, {"node_id": self.node_id, **payload}))

    def _drain_events(self) -> None:
        while True:
            try:
                event, payload = self._events.get_nowait()
            except queue.Empty:
                return
            payload.setdefault("step", self._local_step)
            self._emit_to(event, payload)

    def wait_idle(self, timeout: float = STOP_TIMEOUT) -> bool:
        """Wait until no upload or poll is in flight (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        for lane in (self._upload_lane, self._poll_lane):
            if lane is not None and not lane.wait_idle(max(0.0, deadline - time.monotonic())):
                return False
        return True


DumbDiLoCo = DumbDiLoCoCoordinator


def _emitter(logger: Any) -> Callable[[str, dict[str, Any]], None]:
    if logger is None:
        return lambda event, payload: None
    emit = getattr(logger, "emit", None)
    if callable(emit):
        return emit
    if callable(logger):
        return logger
    raise TypeError(f"logger must have emit(event, payload) or be callable, got {logger!r}")
