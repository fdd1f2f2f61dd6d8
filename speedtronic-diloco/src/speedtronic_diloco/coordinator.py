"""DumbDiLoCoCoordinator: one node's side of DumbDiLoCo. It calls the node's rooms
(:mod:`speedtronic_diloco.node`) in the order a delta travels: the boundary
(:mod:`~speedtronic_diloco.node.boundary`) cuts the delta, the upload lane
(:mod:`~speedtronic_diloco.node.lanes`) sends it, and a newer global comes back through
:mod:`~speedtronic_diloco.node.install`; :mod:`~speedtronic_diloco.node.resume` settles an
upload a checkpoint recorded as outstanding, :mod:`~speedtronic_diloco.node.state` is the
node's state and its one codec. The rooms change none of it themselves: each returns a decision
(:mod:`~speedtronic_diloco.node.decisions`) that the coordinator applies under the node's lock
(:meth:`DumbDiLoCoCoordinator.settle`), also for the upload lane's thread.

Every ``inner_steps`` optimizer steps the node uploads its pseudo-gradient (baseline minus
current weights) and polls for newer global weights; between boundaries it polls every
``poll_interval`` seconds. Uploads and polls run in background lanes by default, so the
training thread only copies tensors; global weights are installed by the training thread at
its next callback, never by a lane. The master also runs the outer loop
(:class:`~speedtronic_diloco.master.loop.MasterOuterLoop`) in a thread of its own; which state it
continues from at startup is decided in :mod:`speedtronic_diloco.startup`. Downloaded globals
are kept per version in a :class:`~speedtronic_diloco.cache.GlobalCache`. With streaming
fragments published as files of their own, a node downloads only the files of the fragments it
will install (their version advanced; all of them the first time), each checked as
:mod:`speedtronic_diloco.fragment_files` says, and caches them per fragment.

The baseline (the weights the next delta is measured from) advances only after a successful
upload, to the exact snapshot that was uploaded, and only if no global was installed in the
meantime (the *generation* check). A failed upload therefore leaves the baseline in place and
the next boundary sends the cumulative delta.

With ``install_at: boundary`` (the default) a fetched global waits for the next boundary, so an
inner loop is never cut and the optimizer is reset only there. The last step of a run
(``final=True``) uploads the partial last inner loop; :meth:`DumbDiLoCoCoordinator.finish`
waits (bounded) for it to land and lets the master aggregate what is pending.

**Exact resume of uploads.** Each dispatched upload carries a random ``upload_id``; while its
effect on the baseline is outstanding, checkpoints record it (``pending_delta``: local step,
upload id, base outer step). A resumed node asks the store whether that delta arrived: if it
did, the baseline advances to its target (the checkpointed weights at that step, or baseline
minus the stored delta); if not, it asks once more at the next boundary, right before sending
(an upload whose request left just before the crash may land late), and if it is still not
there the baseline stays and that boundary sends the progress again, cumulatively. Either way
nothing is sent twice and nothing is lost, short of a commit that lands later than that.

**Signed contributions.** With ``signing_key`` (or ``$SPEEDTRONIC_DILOCO_KEY``) every delta is
signed (:mod:`speedtronic_diloco.signing`) and every downloaded global must verify.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torch import nn

from speedtronic_diloco.codecs import CodecSpec, ErrorFeedback
from speedtronic_diloco.config import DistributedConfig, distributed_config, resolve_state_dir
from speedtronic_diloco.fragments import FragmentLayout, FragmentPlan, FragmentSchedule
from speedtronic_diloco.identity import resolve_node_id
from speedtronic_diloco.lease import LeaseHeldError, LeaseKeeper
from speedtronic_diloco.master.loop import MasterOuterLoop
from speedtronic_diloco.node.boundary import cut
from speedtronic_diloco.node.context import NodeContext
from speedtronic_diloco.node.decisions import Decision, Dispatched, NotSent, Stepped, apply
from speedtronic_diloco.node.deltas import OwnProgress
from speedtronic_diloco.node.failover import Failover
from speedtronic_diloco.node.finished import FinishedWatch, finished_interval
from speedtronic_diloco.node.fragments import NodeFragments
from speedtronic_diloco.node.install import Installer
from speedtronic_diloco.node.lanes import Lane, Uploads
from speedtronic_diloco.node.resume import PendingUpload, restore_node_state
from speedtronic_diloco.node.rounds import await_round, join_run
from speedtronic_diloco.node.state import NodeState, from_checkpoint, to_checkpoint
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.round_mode import round_mode
from speedtronic_diloco.signing import resolve_key
from speedtronic_diloco.startup import prepare_master
from speedtronic_diloco.tensors import TensorDict, cpu_state_dict
from speedtronic_diloco.transports import Transport, open_transport

__all__ = ["STOP_TIMEOUT", "DumbDiLoCo", "DumbDiLoCoCoordinator", "SyncResult"]

log = logging.getLogger("speedtronic.diloco")

STOP_TIMEOUT = 10.0


@dataclass(frozen=True)
class SyncResult:
    """What one synchronisation did: a delta pushed, a global loaded, the outer step seen."""

    pushed: bool
    loaded_global: bool
    outer_step: int


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
        evaluate: Callable[[TensorDict], float] | None = None,
    ) -> None:
        self.config: DistributedConfig = distributed_config(config)
        self.node_id = resolve_node_id(self.config.node_id)
        self.role = self.config.role
        self.model = model
        root = Path(state_dir) if state_dir else resolve_state_dir(self.config)
        self.state_root = root / self.node_id
        cache = Path(self.config.cache_dir) / self.node_id if self.config.cache_dir else None
        self.cache_dir = cache or self.state_root / "cache"
        self.transport: Transport = hub if hub is not None else open_transport(self.config)
        self._emit_to = _emitter(logger)
        baseline = cpu_state_dict(model.state_dict())
        codec = CodecSpec.from_config(self.config)
        self.ctx = NodeContext(
            config=self.config,
            node_id=self.node_id,
            transport=self.transport,
            retry=RetryPolicy(self.config.max_retries, self.config.retry_backoff),
            state=NodeState(self.node_id, self.role, baseline=baseline),
            fragments=NodeFragments(
                FragmentPlan(
                    FragmentLayout.build(baseline, self.config.fragments),
                    FragmentSchedule(self.config.inner_steps, self.config.fragments),
                )
            ),
            codec=codec,
            feedback=ErrorFeedback(codec, enabled=self.config.error_feedback),
            state_root=self.state_root,
            cache_dir=self.cache_dir,
            key=resolve_key(self.config.signing_key),
        )
        self.outer: MasterOuterLoop | None = None
        self.failover = Failover(self.ctx, self._master_loop) if self.config.failover else None
        # With sync rounds a node installs the global its delta went into: nothing of its own
        # is missing from it (a node dropped from a round takes the newest global as it is).
        self.round_mode = round_mode(self.config.rounds)
        keep = self.config.keep_own_progress and self.round_mode.keeps_own_progress
        self._own = OwnProgress(
            self.ctx.fragments.own_progress(keep and self.config.install_at == "boundary"),
            self.config.own_progress_scale or min(self.config.outer_lr, 1.0),
        )
        self.uploads = Uploads(self.ctx, self.settle)
        self.installer = Installer(self.ctx, self._own, lambda: self.outer, self.settle)
        self.pending = PendingUpload(self.ctx)
        self._evaluate = evaluate
        self._last_poll = -math.inf
        self._prepared = False
        self._prepared_outer: dict[str, Any] | None = None
        self._started = False
        self._upload_lane: Lane | None = None
        self._poll_lane: Lane | None = None
        self._due: tuple[int, ...] = ()  # the fragments that sync at the current step
        #: Whether this worker's run finished (then it stops, or trains on alone).
        self.finished = FinishedWatch(self.ctx, interval=finished_interval(self.config))

    # ----------------------------------------------------------------- properties
    @property
    def local_step(self) -> int:
        """The last optimizer step seen by :meth:`after_optimizer_step`."""
        return self.ctx.state.local_step

    @property
    def last_global_step(self) -> int:
        """Outer step of the global weights installed last (-1: none yet)."""
        return self.ctx.state.last_global_step

    @property
    def outer_step(self) -> int:
        """The newest outer step this node knows: the master's own, a worker's installed one."""
        if self.outer is not None:
            return self.outer.outer_step
        return max(self.ctx.state.last_global_step, 0)

    @property
    def started(self) -> bool:
        return self._started

    @property
    def bytes_sent(self) -> int:
        return self.uploads.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.installer.bytes_received

    @property
    def _baseline(self) -> TensorDict:
        """The weights the next delta is measured from."""
        return self.ctx.state.baseline

    @property
    def _feedback(self) -> ErrorFeedback:
        return self.ctx.feedback

    @property
    def _ready(self) -> tuple[int, TensorDict] | None:
        """A fetched global waiting for the training thread."""
        return self.installer.ready

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the role's lifecycle (idempotent until :meth:`stop`)."""
        if self._started:
            return
        if self.role != "master" and self.finished.alone_now(now=True):
            self._started = True  # trains alone: no lanes, no uploads
            return
        self._started = True
        self.ctx.stop = threading.Event()
        self.state_root.mkdir(parents=True, exist_ok=True)
        log.info(
            "DumbDiLoCo %s %r on %s (inner_steps %d)",
            self.role,
            self.node_id,
            self.transport.description,
            self.config.inner_steps,
        )
        if not (self.role == "master" and self._start_master()):
            self._start_worker()
        if self._prepared and self.ctx.state.pending is not None:
            self.settle(self.pending.resolve(self.model))
        if self.config.async_delta_upload:
            self._upload_lane = Lane(f"diloco-upload-{self.node_id}")
        if self.config.async_global_poll and self.outer is None:
            self._poll_lane = Lane(f"diloco-poll-{self.node_id}")
            if self._prepared:  # resumed: look for newer remote state right away
                self._poll_lane.submit(self.installer.fetch_newer)
        self._prepared = False
        self._prepared_outer = None
        self._drain_events()

    def _start_worker(self) -> None:
        if self._prepared:
            # A checkpointed model/baseline pair wins; newer state arrives through polling.
            self._last_poll = -math.inf
            return
        self._last_poll = time.monotonic()
        join_run(self.ctx, self.installer, self.model)

    def _start_master(self) -> bool:  # False: another master holds the lease (failover)
        try:
            self.outer = self._master_loop()
        except LeaseHeldError as exc:
            if self.failover is None:
                raise
            log.warning("%s; starting as a worker (standby: distributed.failover)", exc)
            return False
        if not self._prepared:
            snapshot = self.outer.snapshot()
            if snapshot is not None:
                self.installer.install(self.model, *snapshot)
        self.outer.start(self.config.poll_interval)
        return True

    def _master_loop(self, lease: LeaseKeeper | None = None) -> MasterOuterLoop:
        return prepare_master(
            self.transport,
            self.config,
            node_id=self.node_id,
            state_dir=self.state_root,
            cache_dir=self.cache_dir,
            retry=self.ctx.retry,
            stop=self.ctx.stop,
            emit=self.ctx.queue_event,
            fetch_global=lambda metadata: self.installer.fetch(metadata, complete=True),
            current_weights=lambda: cpu_state_dict(self.model.state_dict()),
            checkpointed=self._prepared_outer,
            signing_key=self.ctx.key,
            evaluate=self._evaluate,
            fragments=self.ctx.fragments.plan.layout,
            lease=lease,
        )

    def finish(self) -> None:
        """End of training, before :meth:`stop`: wait (at most ``round_timeout`` s) for the
        last upload (the final partial delta) to land; on the master, stop the outer thread,
        wait as long again for the other nodes' final deltas, aggregate everything pending,
        publish and log ``final global: outer step N, path ...``."""
        if not self._started:
            return
        timeout = self.config.round_timeout
        lane = self._upload_lane
        if lane is not None and not lane.wait_idle(timeout):
            log.warning("the last delta upload is still in flight after %.0f s", timeout)
        if self.uploads.final_sent is not None:
            step, landed = self.uploads.final_sent
            if landed:
                log.info("final delta of step %d landed in %s", step, self.transport.description)
            else:
                log.warning("final delta of step %d did not reach the store", step)
        if self.outer is not None:
            self.outer.stop(STOP_TIMEOUT)
            try:
                self.outer.finish(timeout)
            except Exception:  # the end of a run must not raise from here
                log.exception("the master's final round failed")
        self._drain_events()

    def stop(self) -> None:
        """Stop the lanes and the outer thread without forcing a delta or an outer round;
        waits at most 10 s in all. A later :meth:`start` begins fresh lanes."""
        if not self._started:
            return
        self.ctx.stop.set()
        if self.failover is not None:
            self.failover.stop()
        deadline = time.monotonic() + STOP_TIMEOUT
        stuck = []
        if self.outer is not None and not self.outer.stop(deadline - time.monotonic()):
            stuck.append("outer loop")
        if self.outer is not None and self.outer.lease is not None:
            self.outer.lease.release(max(0.0, deadline - time.monotonic()))
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
        self.installer.ready = None
        self._started = False
        self._drain_events()

    # ----------------------------------------------------------------- training callback
    def after_optimizer_step(self, model: nn.Module, step: int, final: bool = False) -> bool:
        """Called after optimizer step ``step``; True when a delta was pushed (dispatched, with
        async upload) or newer global weights were installed. ``final`` marks the last step of
        the run: its (possibly partial) inner loop is uploaded and nothing is installed."""
        if model is not self.model:
            raise ValueError(
                "DumbDiLoCo: after_optimizer_step got a different model than the coordinator "
                "was built with"
            )
        if self.finished.alone:
            self.settle(Stepped(step))
            return False
        if self.failover is not None:  # may take over, or be fenced and go on as a worker
            self.outer = self.failover.step(self.outer)
        elif self.outer is not None:
            self.outer.raise_if_failed()  # a dead outer thread stops the run, loudly
        self.settle(Stepped(step))
        pushed = loaded = False
        # One fragment: (0,) when step % inner_steps == 0.
        self._due = self.ctx.fragments.plan.due(step)
        boundary = bool(self._due) or final
        if boundary and not final and self.outer is None and self.finished.alone_now():
            return False  # the run finished: this node trains alone from now on
        if boundary:
            base = self.ctx.state.last_global_step
            pushed = self._boundary_upload(step, final)
            if pushed and not final and self.round_mode.waits_at_boundary:
                loaded = await_round(
                    self.ctx,
                    self.installer,
                    self.model,
                    base,
                    self._due,
                    self.outer,
                    self._poll_lane,
                    finished=lambda: self.outer is None and self.finished.look() is not None,
                    wake=self.failover.wake if self.failover is not None else None,
                )
                if self.failover is not None:  # fenced while it waited: a worker from here on
                    self.outer = self.failover.step(self.outer)
                if self.outer is None and self.finished.alone_now():
                    return False  # the master finished while this node waited (stop raised)
        install = not final and (boundary or self.config.install_at == "any")
        if install:
            loaded = self.installer.install_ready(self.model, self._due)
        now = time.monotonic()
        if not final and (boundary or now - self._last_poll >= self.config.poll_interval):
            self._last_poll = now
            loaded = self._poll(install) or loaded
        self._drain_events()
        return pushed or loaded

    def _boundary_upload(self, step: int, final: bool = False) -> bool:
        lane = self._upload_lane
        # The last delta is never skipped, nor any with sync rounds (the round waits for it).
        if lane is not None and lane.busy and (final or self.round_mode.waits_at_boundary):
            lane.wait_idle(self.config.round_timeout)
        if lane is not None and lane.busy:
            log.info("step %d: previous delta upload still in flight; skipping this one", step)
            self.ctx.queue_event("delta_upload_skipped", {"step": step})
            return False
        if self.pending.unresolved:
            self.settle(self.pending.resolve(self.model))
        decision = cut(self.ctx, self.model, step, self._due, final)
        self.settle(decision)
        if not isinstance(decision, Dispatched):
            return False
        job = decision.job
        if lane is None:
            return self.uploads.upload(job)
        if not lane.submit(lambda: self.uploads.upload(job)):
            self.settle(NotSent(job.upload_id))
            self.ctx.queue_event("delta_upload_skipped", {"step": step})
            return False
        return True

    def _poll(self, install: bool = True) -> bool:
        """Master: take the outer loop's newer snapshot. Worker: fetch (sync) or ask the poll
        lane (async) for newer global weights. True when weights were installed now; without
        ``install`` a fetched global waits (``ready``) for the next boundary."""
        if self.outer is not None:
            snapshot = self.outer.snapshot(published=self.config.failover)
            if install and snapshot is not None and snapshot[0] > self.last_global_step:
                return self.installer.install(self.model, *snapshot, due=self._due)
            return False
        if self._poll_lane is not None:
            self._poll_lane.submit(self.installer.fetch_newer)
            return False
        fetched = self.installer.fetch_newer(stash=not install)
        return (
            install
            and fetched is not None
            and self.installer.install(self.model, *fetched, due=self._due)
        )

    # ----------------------------------------------------------------- state
    def settle(self, decision: Decision | None) -> bool:
        """Apply a room's decision (None: nothing to apply) under the node's lock: the one
        way the node's state changes (:func:`~speedtronic_diloco.node.decisions.apply`)."""
        if decision is None:
            return False
        with self.ctx.lock:
            return apply(decision, self.ctx, self._own, self.installer)

    def state_dict(self) -> dict[str, Any]:
        """Counters, baseline and (master) outer state, for trainer checkpoints."""
        ctx = self.ctx
        with ctx.lock:
            snapshot = replace(
                ctx.state,
                baseline=dict(ctx.state.baseline),
                error_feedback=ctx.feedback.state_dict() if ctx.feedback.residual else None,
                fragments=ctx.fragments.state_dict(),
            )
        snapshot.outer = self.outer.state_dict() if self.outer is not None else None
        return to_checkpoint(snapshot)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. Before :meth:`start` this is the prepared startup state:
        the checkpointed model/baseline pair wins, and newer remote state is found by polling.
        After start, a checkpointed baseline older than an installed global is not applied.

        Raises SpeedtronicError when the state was saved by another node id or role."""
        saved = from_checkpoint(state, self.ctx.state)
        self.settle(restore_node_state(self.ctx, saved, started=self._started))
        if saved.outer:
            if self.outer is not None:
                self.outer.load_state_dict(saved.outer)
            else:
                self._prepared_outer = saved.outer
        if not self._started:
            self._prepared = True

    # ----------------------------------------------------------------- events
    def _drain_events(self) -> None:
        while True:
            try:
                event, payload = self.ctx.events.get_nowait()
            except queue.Empty:
                return
            payload.setdefault("step", self.ctx.state.local_step)
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
