"""DumbDiLoCoCoordinator: one node's side of DumbDiLoCo.

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

import contextlib
import logging
import math
import queue
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from speedtronic.errors import SpeedtronicError
from speedtronic_diloco.cache import GlobalCache
from speedtronic_diloco.codecs import (
    CodecError,
    CodecSpec,
    EncodedDelta,
    ErrorFeedback,
    decode_delta,
    residual_survives,
    restore_dtypes,
)
from speedtronic_diloco.config import DistributedConfig, distributed_config, resolve_state_dir
from speedtronic_diloco.fragment_files import (
    FragmentFileError,
    check_fragment_file,
    check_fragment_metadata,
    check_listed_size,
)
from speedtronic_diloco.fragments import (
    FragmentBook,
    FragmentLayout,
    FragmentSchedule,
    fragment_metadata,
    global_fragment_info,
)
from speedtronic_diloco.identity import resolve_node_id
from speedtronic_diloco.lanes import Lane
from speedtronic_diloco.master.loop import MasterOuterLoop
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.signing import (
    SignatureError,
    read_header,
    resolve_key,
    sign_file,
    verify_file,
)
from speedtronic_diloco.startup import prepare_master
from speedtronic_diloco.tensors import (
    StateMismatchError,
    TensorDict,
    TensorFileError,
    compute_dtype,
    compute_pseudo_gradient,
    cpu_state_dict,
    install_state,
    is_floating,
    load_tensors,
    save_tensors,
)
from speedtronic_diloco.transports import GlobalMetadata, Transport, open_transport

__all__ = ["STOP_TIMEOUT", "DumbDiLoCo", "DumbDiLoCoCoordinator", "SyncResult"]

log = logging.getLogger("speedtronic.diloco")

STOP_TIMEOUT = 10.0
UNMERGED_KEEP = 4  # own deltas remembered until a global shows them aggregated
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
    upload_id: str = ""
    final: bool = False
    fragments: tuple[int, ...] = ()  # with streaming fragments: the ones this delta covers
    fragment_generations: tuple[int, ...] = ()


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
        self._globals = GlobalCache(self.cache_dir / "global", keep=self.config.cache_keep)
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
        self._key = resolve_key(self.config.signing_key)  # bytes; never logged or saved
        self._evaluate = evaluate
        # The dispatched upload whose effect on the baseline is outstanding (checkpointed as
        # ``pending_delta``); ``_unresolved`` when a resume could not ask the store about it.
        self._pending_ref: dict[str, Any] | None = None
        self._unresolved = False
        self._pending_asks = 0  # how often the store said "not there" about _pending_ref
        self._final_sent: tuple[int, bool] | None = None  # (local step, landed)
        # Own deltas not yet seen in a global (install_at: boundary): see _with_own_progress.
        self._unmerged: dict[int, TensorDict] = {}
        self._eager: set[int] = set()  # of those, the ones the installed model already keeps
        self._aggregated_at: dict[int, frozenset[tuple[str, int]]] = {}
        # Fewer bytes per round (issue 17): the delta codec and its error feedback, streaming
        # fragments, byte counters. See codecs.py, fragments.py and docs/diloco.md.
        self._codec = CodecSpec.from_config(self.config)
        self._feedback = ErrorFeedback(self._codec, enabled=self.config.error_feedback)
        self._feedback_epoch = 0  # +1 at every reset: an upload encoded before does not commit
        self._schedule = FragmentSchedule(self.config.inner_steps, self.config.fragments)
        self._fragments: FragmentBook | None = None
        if self.config.fragments > 1:
            layout = FragmentLayout.build(self._baseline, self.config.fragments)
            self._fragments = FragmentBook(layout, self._schedule)
        self._due: tuple[int, ...] = ()  # the fragments that sync at the current step
        self._global_info: dict[int, Any] = {}  # outer step -> fragment info of that global
        self._received: dict[int, int] = {}  # outer step -> bytes of its downloaded global
        self._fragment_caches: dict[int, GlobalCache] = {}  # fragment -> its files' cache
        self._refused: dict[tuple[str, str], None] = {}  # (file, sha256) refused: not again
        self.bytes_sent = 0
        self.bytes_received = 0

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
        if self._prepared and self._pending_ref is not None:
            self._resolve_pending()
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
            fetch_global=lambda metadata: self._fetch_global(metadata, complete=True),
            current_weights=lambda: cpu_state_dict(self.model.state_dict()),
            checkpointed=self._prepared_outer,
            signing_key=self._key,
            evaluate=self._evaluate,
            fragments=self._fragments.layout if self._fragments else None,
        )
        if not self._prepared:
            snapshot = self.outer.snapshot()
            if snapshot is not None:
                self._install(*snapshot)
        self.outer.start(self.config.poll_interval)

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
        if self._final_sent is not None:
            step, landed = self._final_sent
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
        self._stop.set()
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
        self._ready = None
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
        if self.outer is not None:
            self.outer.raise_if_failed()  # a dead outer thread stops the run, loudly
        self._local_step = step
        pushed = loaded = False
        self._due = self._schedule.due(step)  # one fragment: (0,) when step % inner_steps == 0
        boundary = bool(self._due) or final
        if boundary:
            pushed = self._boundary_upload(step, final)
        install = not final and (boundary or self.config.install_at == "any")
        if install:
            loaded = self._install_ready()
        now = time.monotonic()
        if not final and (boundary or now - self._last_poll >= self.config.poll_interval):
            self._last_poll = now
            loaded = self._poll(install) or loaded
        self._drain_events()
        return pushed or loaded

    # ----------------------------------------------------------------- upload
    def _boundary_upload(self, step: int, final: bool = False) -> bool:
        lane = self._upload_lane
        if lane is not None and lane.busy and final:  # the last delta is never skipped
            lane.wait_idle(self.config.round_timeout)
        if lane is not None and lane.busy:
            log.info("step %d: previous delta upload still in flight; skipping this one", step)
            self._queue_event("delta_upload_skipped", {"step": step})
            return False
        if self._unresolved:
            self._resolve_pending()
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
        fragments: tuple[int, ...] = ()
        generations: tuple[int, ...] = ()
        if self._fragments is not None:  # this step's fragment only (the final step: all)
            fragments = tuple(range(self._fragments.layout.count)) if final else self._due
            delta = self._fragments.layout.select(delta, fragments)
            generations = tuple(self._fragments.generations)
        job = _UploadJob(
            step,
            generation,
            current,
            delta,
            base_outer,
            uuid.uuid4().hex,
            final,
            fragments,
            generations,
        )
        with self._lock:
            self._pending_ref = {
                "local_step": step,
                "upload_id": job.upload_id,
                "base_outer_step": base_outer,
                "generation": generation,
            }
            if fragments:
                self._pending_ref["fragments"] = list(fragments)
            if self._keeps_own_progress() and not final:
                self._unmerged[step] = job.delta
                for old in sorted(self._unmerged)[:-UNMERGED_KEEP]:
                    del self._unmerged[old]
        if lane is None:
            return self._upload(job)
        if not lane.submit(lambda: self._upload(job)):
            self._clear_pending(job)
            self._queue_event("delta_upload_skipped", {"step": step})
            return False
        return True

    def _clear_pending(self, job: _UploadJob) -> None:
        with self._lock:
            if self._pending_ref is not None and self._pending_ref["upload_id"] == job.upload_id:
                self._pending_ref = None

    def _upload(self, job: _UploadJob) -> bool:
        step = job.local_step
        what = f"uploading the delta of step {step}"
        path = self.state_root / "outbox" / f"delta_{step}.safetensors"

        def failed(exc: Exception) -> None:
            self._queue_event("delta_upload_failed", {"step": step, "error": str(exc)[:200]})

        metadata = {
            "format": "1",
            "kind": "delta",
            "node_id": self.node_id,
            "local_step": step,
            "base_outer_step": job.base_outer_step,
            "upload_id": job.upload_id,
        }
        if job.final:
            metadata["final"] = "1"
        if self._fragments is not None:
            metadata.update(fragment_metadata(job.fragments, self._fragments.layout))
        encoded: EncodedDelta | None = None
        epoch = self._feedback_epoch
        try:
            tensors, codec_meta = job.delta, {}
            if self._codec.compressed or self._feedback.residual:
                encoded = self._feedback.encode(job.delta)  # delta + residual, encoded
                tensors, codec_meta = encoded.tensors, encoded.metadata
            save_tensors(path, tensors, {**metadata, **codec_meta})
            if self._key is not None:
                sign_file(path, self._key)
            size = path.stat().st_size
        except (OSError, CodecError) as exc:  # the outbox (full disk...); a non-finite delta
            log.warning("%s failed (%s); %s", what, exc, CUMULATIVE)
            failed(exc)
            self._clear_pending(job)
            if job.final:
                self._final_sent = (step, False)
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
        if job.final:
            self._final_sent = (step, bool(sent))
        if not sent:
            self._clear_pending(job)
            self._unmerge_failed(job)
            return False
        with self._lock:
            self._last_uploaded_step = step
            if job.generation == self._generation:
                self._baseline = self._advanced_baseline(job)
            if encoded is not None and epoch == self._feedback_epoch:
                self._feedback.commit(encoded)  # the residual this upload leaves
            self.bytes_sent += size
            if self._pending_ref is not None and self._pending_ref["upload_id"] == job.upload_id:
                self._pending_ref = None
        payload = {"step": step, "base_outer_step": job.base_outer_step}
        payload.update(self._upload_metrics(job, size, encoded))
        if job.final:
            payload["final"] = True
        self._queue_event("delta_uploaded", payload)
        return True

    def _resolve_pending(self) -> None:
        """A resumed node: did the upload the checkpoint recorded as outstanding arrive? Yes:
        move the baseline to its target. No: ask once more at the next boundary (a late
        commit may still land), then keep the baseline (the next delta includes that
        progress). Unknown (store unreachable): ask again at the next boundary."""
        with self._lock:
            ref = self._pending_ref
        if ref is None:
            self._unresolved = False
            self._pending_asks = 0
            return
        step, upload_id = int(ref["local_step"]), str(ref["upload_id"])
        read, listing = self._retry.attempt(
            f"checking whether the delta of step {step} arrived",
            self.transport.list_deltas,
            self._stop,
            then="asking again at the next boundary",
        )
        if not read or listing is None:
            self._unresolved = True
            return
        info = next((i for i in listing if i.key == (self.node_id, step)), None)
        stored: TensorDict | None = None
        if info is not None:
            with tempfile.TemporaryDirectory(dir=self.state_root) as tmp:
                dest = Path(tmp) / "pending.safetensors"
                done, _ = self._retry.attempt(
                    f"downloading {info.path}",
                    lambda: self.transport.download_delta(info, dest),
                    self._stop,
                    then="asking again at the next boundary",
                )
                if not done:
                    self._unresolved = True
                    return
                try:
                    tensors, metadata = load_tensors(dest)
                except TensorFileError:
                    tensors, metadata = {}, {}
                if metadata.get("upload_id") == upload_id:
                    with contextlib.suppress(CodecError):  # undecodable: as if it never came
                        stored = decode_delta(tensors, metadata)
        if stored is None and self._pending_asks == 0:
            # Not there at resume. An upload whose request left just before the crash may
            # still land (a Hub commit the server is finishing), so the next boundary asks
            # once more, right before it sends anything, an inner loop later.
            self._pending_asks = 1
            self._unresolved = True
            log.info(
                "the delta of step %d (in flight at the checkpoint) is not in the store; "
                "asking once more at the next boundary before sending that progress again",
                step,
            )
            return
        self._unresolved = False
        self._pending_asks = 0
        with self._lock:
            self._pending_ref = None
            if stored is None:
                log.info(
                    "the delta of step %d (in flight at the checkpoint) did not arrive; the next "
                    "boundary sends that progress again (cumulative)",
                    step,
                )
                return
            # Compressed (the residual is kept: baseline minus what was received is exact) or
            # one fragment (the weights would move the others' baselines): subtract.
            exact = not self._codec.compressed and self._fragments is None
            if self._local_step == step and exact:  # the checkpointed weights are its target
                target = cpu_state_dict(self.model.state_dict())
            else:
                target = _minus(self._baseline, stored)
            self._baseline = target
            self._generation += 1
            self._last_uploaded_step = step
        log.info(
            "the delta of step %d (in flight at the checkpoint) arrived; measuring from its "
            "target, so it is not sent twice",
            step,
        )

    # ----------------------------------------------------------------- polling
    def _poll(self, install: bool = True) -> bool:
        """Master: take the outer loop's newer snapshot. Worker: fetch (sync) or ask the poll
        lane (async) for newer global weights. True when weights were installed now; without
        ``install`` a fetched global waits (``_ready``) for the next boundary."""
        if self.outer is not None:
            snapshot = self.outer.snapshot()
            if install and snapshot is not None and snapshot[0] > self._last_global_step:
                return self._install(*snapshot)
            return False
        if self._poll_lane is not None:
            self._poll_lane.submit(self._fetch_newer_global)
            return False
        fetched = self._fetch_newer_global(stash=not install)
        return install and fetched is not None and self._install(*fetched)

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
        with self._lock:
            self._aggregated_at = {
                metadata.outer_step: frozenset((str(n), int(s)) for n, s, _ in metadata.processed)
            }
            if stash and (self._ready is None or self._ready[0] < metadata.outer_step):
                self._ready = (metadata.outer_step, tensors)
        return metadata.outer_step, tensors

    def _fetch_global(self, metadata: GlobalMetadata, complete: bool = False) -> TensorDict | None:
        """The weights ``metadata`` describes, from the per-version cache or the store. With
        fragment files, only the fragments this node will install (all with ``complete``)."""
        if metadata.fragment_files:
            return self._fetch_fragment_files(metadata, complete)

        def download(dest: Path) -> bool:
            done, _ = self._retry.attempt(
                f"downloading global outer step {metadata.outer_step}",
                lambda: self.transport.download_global(metadata, dest),
                self._stop,
            )
            if done:
                with contextlib.suppress(OSError):
                    self._count_received(metadata.outer_step, dest.stat().st_size)
            return done

        tensors = self._globals.get(metadata, download)
        if tensors is not None:
            tensors = restore_dtypes(tensors, self._baseline)  # a bf16 global: the model's dtype
            self._note_global(metadata)
        if tensors is None or self._key is None:
            return tensors
        path = self._globals.path_for(metadata)
        try:
            signed = verify_file(path, self._key)
            if signed.get("kind") != "global" or signed.get("outer_step") != str(
                metadata.outer_step
            ):
                raise SignatureError("bad_signature", f"{path}: signed for another outer step")
        except SignatureError as exc:
            log.error(
                "!!! refusing global outer step %d: %s (%s); keeping the current weights",
                metadata.outer_step,
                exc.reason,
                exc,
            )
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            self._queue_event(
                "global_refused", {"outer_step": metadata.outer_step, "reason": exc.reason}
            )
            return None
        return tensors

    def _fetch_fragment_files(self, metadata: GlobalMetadata, complete: bool) -> TensorDict | None:
        """The tensors of the fragment files this node needs from a global published as
        fragment files: every fragment with ``complete``, for a node without fragments (it
        installs the whole global) or the first time; else those whose version advanced.
        None (logged, ``global_refused`` emitted once per file) when a file is refused or not
        fetched."""
        if (metadata.model_file, metadata.sha256) in self._refused:
            return None
        count = len(metadata.fragment_files)
        if self._fragments is not None:
            layout = self._fragments.layout
        else:
            try:
                layout = FragmentLayout.build(self._baseline, count)
            except SpeedtronicError as exc:
                return self._refuse_global(
                    metadata, FragmentFileError(f"{metadata.model_file}: {exc}")
                )
        try:
            versions = check_fragment_metadata(metadata, layout)
        except FragmentFileError as exc:
            return self._refuse_global(metadata, exc)
        if complete or self._fragments is None:
            wanted: tuple[int, ...] = tuple(range(count))
        else:
            wanted = self._fragments.plan((versions, layout.fingerprint))
        tensors: TensorDict = {}
        for j in wanted:
            part = self._fetch_fragment_file(metadata, layout, j)
            if part is None:
                return None
            tensors.update(part)
        self._note_global(metadata)
        return restore_dtypes(tensors, self._baseline)

    def _fetch_fragment_file(
        self, metadata: GlobalMetadata, layout: FragmentLayout, j: int
    ) -> TensorDict | None:
        """Fragment ``j``'s tensors: from its cache or the store, bounded, then checked."""
        view = metadata.fragment_view(j)
        where = view.model_file
        if (where, view.sha256) in self._refused:
            return None
        try:
            check_listed_size(view, layout, j, self._baseline)
        except FragmentFileError as exc:
            return self._refuse_global(view, exc, metadata.outer_step)

        def download(dest: Path) -> bool:
            done, _ = self._retry.attempt(
                f"downloading {where} (fragment {j} of global outer step {metadata.outer_step})",
                lambda: self.transport.download_global(view, dest),
                self._stop,
            )
            if done:
                with contextlib.suppress(OSError):
                    self._count_received(metadata.outer_step, dest.stat().st_size)
            return done

        cache = self._fragment_cache(j)
        tensors = cache.get(view, download)
        if tensors is None:
            return None
        path = cache.path_for(view)
        try:
            header = read_header(path)[1].get("__metadata__") or {}
            check_fragment_file(
                path, where, j, view.outer_step, layout, tensors, header, self._baseline, self._key
            )
        except (SignatureError, FragmentFileError) as exc:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            problem = (
                exc if isinstance(exc, FragmentFileError) else FragmentFileError(f"{where}: {exc}")
            )
            return self._refuse_global(view, problem, metadata.outer_step)
        return tensors

    def _fragment_cache(self, j: int) -> GlobalCache:
        cache = self._fragment_caches.get(j)
        if cache is None:
            directory = self.cache_dir / "global" / f"fragment_{j}"
            cache = self._fragment_caches[j] = GlobalCache(directory, keep=self.config.cache_keep)
        return cache

    def _refuse_global(
        self, refused: GlobalMetadata, exc: FragmentFileError, outer_step: int | None = None
    ) -> None:
        """Log and emit ``global_refused`` for the file ``refused`` names (the metadata's own
        ``model_file`` for a refused metadata), and never fetch that file again."""
        if len(self._refused) >= 64:
            self._refused.pop(next(iter(self._refused)))
        self._refused[(refused.model_file, refused.sha256)] = None
        step = refused.outer_step if outer_step is None else outer_step
        log.error("!!! refusing global outer step %d: %s; keeping the current weights", step, exc)
        self._queue_event(
            "global_refused",
            {"outer_step": step, "reason": "fragment_file", "message": str(exc)[:200]},
        )

    def _install_ready(self) -> bool:
        with self._lock:
            ready, self._ready = self._ready, None
        if ready is None or ready[0] <= self._last_global_step:
            return False
        return self._install(*ready)

    def _install(self, outer_step: int, tensors: TensorDict) -> bool:
        """Load ``tensors`` into the model (training thread only) and re-baseline."""
        if self._fragments is not None:
            return self._install_fragments(outer_step, tensors)
        install_state(self.model, self._with_own_progress(outer_step, tensors))
        with self._lock:
            self._baseline = cpu_state_dict(self.model.state_dict())
            self._generation += 1
            self._reset_residual(self._last_global_step, outer_step)
            self._last_global_step = outer_step
            self._pending_ref = None  # an upload in flight no longer moves the baseline
        log.info("installed global weights of outer step %d", outer_step)
        self._queue_event(
            "global_loaded",
            {
                "step": self._local_step,
                "outer_step": outer_step,
                **self._received_bytes(outer_step),
            },
        )
        return True

    # ----------------------------------------------------------------- own progress
    def _keeps_own_progress(self) -> bool:
        return (
            self.config.keep_own_progress
            and self.config.install_at == "boundary"
            and self._fragments is None
        )

    def _with_own_progress(self, outer_step: int, tensors: TensorDict) -> TensorDict:
        """With ``install_at: boundary``: the global minus this node's own deltas that it does
        not contain yet (uploaded, or in flight, but not aggregated), so a node keeps its own
        last inner loop instead of learning it again from an older state (which would apply
        that progress twice). The baseline becomes the result: those deltas are not resent."""
        with self._lock:
            if not self._unmerged:
                return tensors
            if self.outer is not None:
                aggregated = {
                    (self.node_id, s)
                    for s in self._unmerged
                    if self.outer.has_processed((self.node_id, s))
                }
            else:
                aggregated = set(self._aggregated_at.get(outer_step, frozenset()))
            for step in [s for s in self._unmerged if (self.node_id, s) in aggregated]:
                del self._unmerged[step]
            own = [self._unmerged[s] for s in sorted(self._unmerged)]
            self._eager = set(self._unmerged)
        if not own:
            return tensors
        out = dict(tensors)
        for name, value in tensors.items():
            if not is_floating(value) or name not in own[0]:
                continue
            work = compute_dtype(value.dtype)
            total = value.to(work)
            for delta in own:
                if delta[name].shape == value.shape:
                    total = total - delta[name].to(work)
            out[name] = total.to(value.dtype)
        return out

    def _unmerge_failed(self, job: _UploadJob) -> None:
        """A failed upload whose delta the model already keeps (see
        :meth:`_with_own_progress`): move the baseline back by it, so the next boundary sends
        that progress again (cumulative), as after any failed upload."""
        with self._lock:
            delta = self._unmerged.pop(job.local_step, None)
            if delta is None or job.local_step not in self._eager:
                return
            self._eager.discard(job.local_step)
            self._baseline = {
                name: (
                    value.to(compute_dtype(value.dtype))
                    + delta[name].to(compute_dtype(value.dtype))
                ).to(value.dtype)
                if name in delta and is_floating(value)
                else value
                for name, value in self._baseline.items()
            }

    # ----------------------------------------------------------------- codecs, fragments
    def _install_fragments(self, outer_step: int, tensors: TensorDict) -> bool:
        """Streaming fragments: install the fragments of this global whose version advanced
        (with ``install_at: boundary`` only the one syncing now) and re-baseline just those;
        the others keep their weights and baselines. A global with fragments still to install
        waits in ``_ready`` for their boundaries."""
        fragments = self._fragments
        assert fragments is not None
        if self.outer is not None:
            info = self.outer.fragment_info_at(outer_step)
        else:
            info = self._global_info.get(outer_step)
        boundary_only = self.config.install_at == "boundary" and self._due
        layout = fragments.layout
        plan = tuple(  # a global fetched as fragment files holds only the fragments it needed
            j
            for j in fragments.plan(info, self._due if boundary_only else None)
            if all(name in tensors for name in layout.fragments[j])
        )
        if not plan:
            with self._lock:
                if fragments.pending(info) and (self._ready is None or self._ready[0] < outer_step):
                    self._ready = (outer_step, tensors)
            return False
        chosen = set(layout.keys(plan))
        subset = {k: v for k, v in tensors.items() if k in chosen or not is_floating(v)}
        install_state(self.model, subset)
        now = cpu_state_dict({k: v for k, v in self.model.state_dict().items() if k in subset})
        with self._lock:
            self._baseline = {**self._baseline, **now}
            self._reset_residual(self._last_global_step, outer_step, chosen)
            fragments.mark(plan, info)
            rest = fragments.pending(info)
            if not rest:
                self._last_global_step = max(self._last_global_step, outer_step)
            elif self._ready is None or self._ready[0] < outer_step:
                self._ready = (outer_step, tensors)
            ref = self._pending_ref
            if ref is not None and set(ref.get("fragments", range(layout.count))) & set(plan):
                self._pending_ref = None  # that upload no longer moves its baseline
        log.info("installed fragments %s of global outer step %d", list(plan), outer_step)
        payload = {"step": self._local_step, "outer_step": outer_step}
        payload["fragments"] = ",".join(str(j) for j in plan)
        self._queue_event("global_loaded", {**payload, **self._received_bytes(outer_step)})
        return True

    def _advanced_baseline(self, job: _UploadJob) -> TensorDict:
        """The baseline after ``job`` landed (caller holds the lock): its target; with
        fragments, the target's tensors of each fragment it covers that was not reinstalled
        since, the rest of the baseline unchanged."""
        if self._fragments is None:
            return job.target
        layout, generations = self._fragments.layout, self._fragments.generations
        moved = [j for j in job.fragments if generations[j] == job.fragment_generations[j]]
        return {**self._baseline, **{k: job.target[k] for k in layout.keys(moved)}}

    def _reset_residual(self, previous: int, new: int, names: Any = None) -> None:
        """The error-feedback reset rule (:func:`~speedtronic_diloco.codecs.residual_survives`)
        for installing global ``new`` after ``previous`` (caller holds the lock)."""
        if not self._feedback.residual or residual_survives(
            previous, new, self.config.max_staleness
        ):
            return
        self._feedback.reset(names)
        self._feedback_epoch += 1
        log.info(
            "error feedback: residual dropped (global outer step %d after %d does not continue it)",
            new,
            previous,
        )

    def _note_global(self, metadata: GlobalMetadata) -> None:
        info = global_fragment_info(metadata.extra)
        with self._lock:
            self._global_info[metadata.outer_step] = info
            for old in sorted(self._global_info)[:-8]:
                del self._global_info[old]

    def _count_received(self, outer_step: int, size: int) -> None:
        with self._lock:
            self.bytes_received += size
            self._received[outer_step] = self._received.get(outer_step, 0) + size
            for old in sorted(self._received)[:-8]:
                del self._received[old]

    def _received_bytes(self, outer_step: int) -> dict[str, int]:
        """``bytes_received`` for a ``global_loaded`` event: what downloading that global cost
        (0 from the cache, on the master, or for a later fragment of the same global)."""
        with self._lock:
            return {"bytes_received": self._received.pop(outer_step, 0)}

    def _upload_metrics(
        self, job: _UploadJob, size: int, encoded: EncodedDelta | None
    ) -> dict[str, Any]:
        """The ``delta_uploaded`` payload's byte and codec fields."""
        metrics: dict[str, Any] = {"bytes_sent": size, "codec": self._codec.codec}
        if encoded is not None:
            metrics["compression_error"] = round(encoded.error, 6)
        if job.fragments:
            metrics["fragments"] = ",".join(str(j) for j in job.fragments)
        return metrics

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
                # The upload whose effect on the baseline is outstanding: a resumed node asks
                # the store whether it arrived (see the module docstring).
                "pending_delta": dict(self._pending_ref) if self._pending_ref else None,
                "pending_delta_step": self._pending_ref["local_step"]
                if self._pending_ref
                else None,
            }
            if self._feedback.residual:  # untransmitted progress (see codecs.ErrorFeedback)
                state["error_feedback"] = self._feedback.state_dict()
            if self._fragments is not None:
                state["fragments"] = self._fragments.state_dict()
        if self.outer is not None:
            state["outer"] = self.outer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. Before :meth:`start` this is the prepared startup state:
        the checkpointed model/baseline pair wins, and newer remote state is found by polling.
        After start, a checkpointed baseline older than an installed global is not applied.

        Raises SpeedtronicError when the state was saved by another node id or role."""
        saved_node, saved_role = state.get("node_id"), state.get("role")
        if (saved_node is not None and saved_node != self.node_id) or (
            saved_role is not None and saved_role != self.role
        ):
            raise SpeedtronicError(
                f"this checkpoint's DumbDiLoCo state belongs to {saved_role} {saved_node!r}, "
                f"but this process is {self.role} {self.node_id!r}: resume with the same "
                "distributed.role and distributed.node_id, or start a fresh run (a new "
                "run.output_dir) to join as this node"
            )
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
                pending = state.get("pending_delta")
                if isinstance(pending, dict) and pending.get("upload_id"):
                    self._pending_ref = dict(pending)
                self._feedback.load_state_dict(state.get("error_feedback"))
                if self._fragments is not None:
                    self._fragments.load_state_dict(state.get("fragments"))
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


def _minus(baseline: TensorDict, delta: TensorDict) -> TensorDict:
    """``baseline - delta`` over the delta's floating tensors (the target of an upload)."""
    out = dict(baseline)
    for name, value in delta.items():
        before = baseline.get(name)
        if before is None or not is_floating(before) or before.shape != value.shape:
            continue
        work = compute_dtype(before.dtype)
        out[name] = (before.to(work) - value.to(work)).to(before.dtype)
    return out


def _emitter(logger: Any) -> Callable[[str, dict[str, Any]], None]:
    if logger is None:
        return lambda event, payload: None
    emit = getattr(logger, "emit", None)
    if callable(emit):
        return emit
    if callable(logger):
        return logger
    raise TypeError(f"logger must have emit(event, payload) or be callable, got {logger!r}")
