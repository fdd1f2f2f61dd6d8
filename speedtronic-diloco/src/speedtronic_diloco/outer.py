"""The master's outer loop: collect new deltas, average them, take a Nesterov SGD step on the
global weights, persist, publish.

The outer step is exactly ``torch.optim.SGD(lr=outer_lr, momentum=outer_momentum,
nesterov=True)`` applied to the averaged pseudo-gradient::

    buf = g                      (first step)      buf = momentum * buf + g   (later)
    global -= outer_lr * (g + momentum * buf)

State (global weights, momentum, outer step, the ledger of processed deltas) is persisted
under ``state_dir`` as one safetensors file with JSON metadata (no pickle), *before* the new
weights are published: a master that crashes in between finds a local outer step ahead of the
store's on restart and republishes instead of aggregating the same deltas again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.tensors import (
    StateMismatchError,
    TensorDict,
    TensorFileError,
    check_delta,
    compute_dtype,
    floating_only,
    load_tensors,
    save_tensors,
)
from speedtronic_diloco.transports.base import DeltaInfo, GlobalMetadata, Transport

log = logging.getLogger("speedtronic.diloco.outer")

STATE_FILE = "outer_state.safetensors"
STATE_FORMAT = "1"
Ledger = dict[tuple[str, int], "str | None"]
Emit = Callable[[str, dict[str, Any]], None]


def nesterov_step(
    params: TensorDict, grads: TensorDict, momentum_buffers: TensorDict, lr: float, momentum: float
) -> tuple[TensorDict, TensorDict]:
    """One SGD step with Nesterov momentum; returns new ``(params, buffers)`` and leaves the
    inputs untouched (readers may still hold them)."""
    new_params = dict(params)
    new_buffers: TensorDict = {}
    for name, grad in grads.items():
        param = params[name]
        work = compute_dtype(param.dtype)
        g = grad.to(work)
        previous = momentum_buffers.get(name)
        buf = g.clone() if previous is None else previous.to(work) * momentum + g
        update = g + momentum * buf if momentum else g
        new_params[name] = (param.to(work) - lr * update).to(param.dtype)
        new_buffers[name] = buf
    return new_params, new_buffers


@dataclass(frozen=True)
class RoundResult:
    """What one outer round did."""

    outer_step: int
    deltas_found: int
    deltas_included: int
    included: tuple[tuple[str, int], ...]
    rejected: tuple[tuple[str, int], ...]


class MasterOuterLoop:
    """The master's outer optimizer over the store's deltas, with persisted state.

    Constructing it loads ``<state_dir>/outer_state.safetensors`` when present. Public reads
    (:meth:`snapshot`) take a lock and return immutable references: each round builds new
    tensors rather than changing published ones in place.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        node_id: str,
        state_dir: str | Path,
        cache_dir: str | Path,
        outer_lr: float,
        outer_momentum: float,
        retry: RetryPolicy | None = None,
        emit: Emit | None = None,
    ) -> None:
        self.transport = transport
        self.node_id = node_id
        self.state_dir = Path(state_dir)
        self.cache_dir = Path(cache_dir)
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.retry = retry or RetryPolicy()
        self._emit = emit or (lambda event, payload: None)
        self._lock = threading.RLock()
        # Rounds and publications never overlap (the thread and a direct caller share files).
        self._round_lock = threading.RLock()
        self.global_state: TensorDict | None = None
        self.momentum: TensorDict = {}
        self.outer_step = 0
        self.processed: Ledger = {}
        self.published_step = -1
        self.has_local_state = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.load()

    # ----------------------------------------------------------------- state
    @property
    def state_path(self) -> Path:
        return self.state_dir / STATE_FILE

    def load(self) -> bool:
        """Load persisted outer state; False (and a warning if unreadable) when there is none."""
        path = self.state_path
        if not path.exists():
            return False
        try:
            tensors, meta = load_tensors(path)
            if meta.get("format") != STATE_FORMAT:
                raise TensorFileError(f"{path}: unknown format {meta.get('format')!r}")
            outer_step = int(meta["outer_step"])
            processed = _ledger_from(json.loads(meta["processed"]))
            published = int(meta.get("published_step", -1))
        except (TensorFileError, KeyError, ValueError, TypeError) as exc:
            log.warning("master state %s is unreadable (%s); ignoring it", path, exc)
            return False
        with self._lock:
            self.global_state = {
                k[len("global/") :]: v for k, v in tensors.items() if k.startswith("global/")
            }
            self.momentum = {
                k[len("momentum/") :]: v for k, v in tensors.items() if k.startswith("momentum/")
            }
            self.outer_step = outer_step
            self.processed = processed
            self.published_step = published
            self.has_local_state = True
        log.info(
            "master state: outer step %d, %d processed deltas (%s)",
            outer_step,
            len(processed),
            path,
        )
        return True

    def save(self) -> None:
        """Persist global weights, momentum, outer step and ledger in one atomic file."""
        with self._lock:
            if self.global_state is None:
                return
            tensors = {f"global/{k}": v for k, v in self.global_state.items()}
            tensors.update({f"momentum/{k}": v for k, v in self.momentum.items()})
            meta = {
                "format": STATE_FORMAT,
                "node_id": self.node_id,
                "outer_step": str(self.outer_step),
                "published_step": str(self.published_step),
                "processed": json.dumps(_ledger_to(self.processed)),
            }
        save_tensors(self.state_path, tensors, meta)
        self.has_local_state = True

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable copy of the outer state (tensors, numbers, lists)."""
        with self._lock:
            return {
                "outer_step": self.outer_step,
                "global": dict(self.global_state or {}),
                "momentum": dict(self.momentum),
                "processed": _ledger_to(self.processed),
            }

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Adopt checkpointed outer state when it is ahead of what was loaded from disk."""
        step = int(state.get("outer_step", 0))
        if self.has_local_state and step <= self.outer_step:
            return False
        with self._lock:
            self.global_state = dict(state.get("global") or {}) or self.global_state
            self.momentum = dict(state.get("momentum") or {})
            self.outer_step = step
            self.processed = _ledger_from(state.get("processed") or [])
            self.has_local_state = self.global_state is not None
        return True

    def snapshot(self) -> tuple[int, TensorDict] | None:
        """``(outer_step, global weights)`` under the lock, or None before any state exists."""
        with self._lock:
            if self.global_state is None:
                return None
            return self.outer_step, self.global_state

    def bootstrap(self, weights: TensorDict) -> None:
        """Start from ``weights`` at outer step 0 (nothing local, nothing remote)."""
        with self._lock:
            self.global_state = dict(weights)
            self.momentum = {}
            self.outer_step = 0
            self.published_step = -1
        self.save()

    def adopt(
        self,
        outer_step: int,
        weights: TensorDict,
        processed: Iterable[tuple[str, int, str | None]] = (),
    ) -> None:
        """Continue from the store's global at ``outer_step``; momentum restarts from zero and
        the store's ledger joins the local one."""
        with self._lock:
            self.global_state = dict(weights)
            self.momentum = {}
            self.outer_step = outer_step
            self.published_step = outer_step
            for node, step, etag in processed:
                self.processed.setdefault((node, step), etag)
        self.save()

    def continue_after(self, store_step: int) -> None:
        """The store holds ``store_step`` but its weights could not be fetched: keep the local
        weights, do not republish, and number the next outer step after the store's."""
        with self._lock:
            self.outer_step = max(self.outer_step, store_step)
            self.published_step = self.outer_step
        self.save()

    def mark_unpublished(self) -> None:
        """Publish the current state on the next chance (the store is behind)."""
        with self._lock:
            self.published_step = -1

    # ----------------------------------------------------------------- rounds
    def publish(self, deltas_included: int = 0) -> GlobalMetadata | None:
        """Publish the current global weights and metadata; None (with a warning) on failure."""
        with self._lock:
            if self.global_state is None:
                return None
            step, weights = self.outer_step, self.global_state
            ledger = tuple((n, s, e) for (n, s), e in sorted(self.processed.items()))
        path = self.cache_dir / "publish" / f"global_{step:08d}.safetensors"
        with self._round_lock:
            try:
                save_tensors(path, weights, {"outer_step": str(step), "master": self.node_id})
                meta = GlobalMetadata.for_file(
                    path,
                    step,
                    published_at=time.time(),
                    master=self.node_id,
                    deltas_included=deltas_included,
                    processed=ledger,
                )
                done, published = self.retry.attempt(
                    f"publishing outer step {step} to {self.transport.description}",
                    lambda: self.transport.publish_global(path, meta),
                    self._stop,
                    then="will retry next round",
                )
            finally:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        if not done:
            return None
        with self._lock:
            self.published_step = max(self.published_step, step)
        with contextlib.suppress(OSError):
            self.save()
        log.info("published outer step %d to %s", step, self.transport.description)
        return published

    def publish_if_behind(self) -> bool:
        """Publish when the store has not seen the current outer step yet."""
        with self._round_lock:
            with self._lock:
                behind = self.global_state is not None and self.published_step < self.outer_step
            return behind and self.publish() is not None

    def run_round(self, abort: threading.Event | None = None) -> RoundResult | None:
        """Aggregate every new delta into one outer step; None when there was nothing new
        (or ``abort`` was set before the deltas were all fetched)."""
        with self._round_lock:
            return self._run_round(abort)

    def _run_round(self, abort: threading.Event | None) -> RoundResult | None:
        with self._lock:
            if self.global_state is None:
                return None
            reference = self.global_state
        _, listing = self.retry.attempt(
            f"listing deltas on {self.transport.description}",
            self.transport.list_deltas,
            self._stop,
        )
        if listing is None:  # failed (logged)
            return None
        with self._lock:
            new = [info for info in listing if _is_new(info, self.processed)]
        if not new:
            return None
        deltas: list[TensorDict] = []
        included: list[DeltaInfo] = []
        rejected: list[DeltaInfo] = []
        for info in new:
            if abort is not None and abort.is_set():
                return None
            delta = self._fetch_delta(info, reference)
            if delta is None:
                continue
            if delta is _REJECTED:
                rejected.append(info)
            else:
                deltas.append(delta)
                included.append(info)
        with self._lock:
            for info in rejected:
                self.processed[info.key] = info.etag
            if deltas:
                mean = _mean(deltas)
                params, buffers = nesterov_step(
                    floating_only(self.global_state),
                    mean,
                    self.momentum,
                    self.outer_lr,
                    self.outer_momentum,
                )
                self.global_state = {**self.global_state, **params}
                self.momentum = buffers
                self.outer_step += 1
                for info in included:
                    self.processed[info.key] = info.etag
            # Entries whose files left the store can never match again.
            present = {info.key for info in listing}
            self.processed = {k: v for k, v in self.processed.items() if k in present}
            step = self.outer_step
        if not deltas and not rejected:
            return None
        self.save()  # before publishing: see the module docstring
        result = RoundResult(
            step,
            len(new),
            len(included),
            tuple(i.key for i in included),
            tuple(i.key for i in rejected),
        )
        if deltas:
            self.publish(len(included))
            self._emit(
                "outer_step",
                {
                    "outer_step": step,
                    "deltas_found": len(new),
                    "deltas_included": len(included),
                    "deltas_rejected": len(rejected),
                    "included": ",".join(f"{n}@{s}" for n, s in result.included),
                },
            )
        return result

    def _fetch_delta(self, info: DeltaInfo, reference: TensorDict) -> Any:
        dest = self.cache_dir / "deltas" / info.node_id / f"delta_{info.local_step}.safetensors"
        done, _ = self.retry.attempt(
            f"downloading {info.path}",
            lambda: self.transport.download_delta(info, dest),
            self._stop,
            then="trying again next round",
        )
        if not done:
            return None
        try:
            tensors, _ = load_tensors(dest)
            check_delta(tensors, reference)
        except (TensorFileError, StateMismatchError) as exc:
            log.error("skipping delta %s: %s", info.path, exc)
            return _REJECTED
        finally:
            with contextlib.suppress(FileNotFoundError):
                dest.unlink()
        return tensors

    # ----------------------------------------------------------------- thread
    def start(self, interval: float) -> None:
        """Run publish-if-behind and rounds every ``interval`` seconds in a daemon thread."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, args=(interval,), name="diloco-outer", daemon=True
        )
        self._thread.start()

    def _loop(self, interval: float) -> None:
        while not self._stop.is_set():
            try:
                self.publish_if_behind()
                self.run_round(abort=self._stop)
            except Exception:  # the outer thread must outlive one bad round
                log.exception("outer round failed")
            self._stop.wait(max(interval, 0.05))

    def stop(self, timeout: float = 10.0) -> bool:
        """Ask the thread to stop after its current round; True when it ended in time."""
        self._stop.set()
        if self._thread is None:
            return True
        self._thread.join(max(0.0, timeout))
        return not self._thread.is_alive()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


_REJECTED = object()


def _is_new(info: DeltaInfo, ledger: Ledger) -> bool:
    if info.key not in ledger:
        return True
    recorded = ledger[info.key]
    return info.etag is not None and recorded is not None and recorded != info.etag


def _mean(deltas: list[TensorDict]) -> TensorDict:
    out: TensorDict = {}
    for name, first in deltas[0].items():
        work = compute_dtype(first.dtype)
        total = torch.zeros(first.shape, dtype=work)
        for delta in deltas:
            total += delta[name].to(work)
        out[name] = total / len(deltas)
    return out


def _ledger_to(ledger: Ledger) -> list[list[Any]]:
    return [[node, step, etag] for (node, step), etag in sorted(ledger.items())]


def _ledger_from(items: Iterable[Any]) -> Ledger:
    return {
        (str(node), int(step)): (None if etag is None else str(etag)) for node, step, etag in items
    }
