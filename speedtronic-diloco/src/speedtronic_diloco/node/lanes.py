"""A node's background lanes and the upload that runs in one.

A :class:`Lane` is one daemon thread that runs at most one job at a time and refuses a new job
while busy, so the training thread never waits behind slow store I/O (a node has an upload
lane and, for a worker, a poll lane). :func:`upload` is the upload lane's job: write the delta
(encoded with the error feedback's residual, signed), send it, and on success move the
baseline to the uploaded snapshot, unless a global was installed since (the generation
check). A failed upload leaves the baseline, so the next boundary sends the cumulative delta.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from speedtronic_diloco.codecs import CodecError, EncodedDelta
from speedtronic_diloco.node.boundary import OwnProgress, UploadJob
from speedtronic_diloco.node.context import NodeContext
from speedtronic_diloco.signing import sign_file
from speedtronic_diloco.tensors import save_tensors

__all__ = ["CUMULATIVE", "Lane", "Uploads", "clear_pending"]

log = logging.getLogger("speedtronic.diloco")

CUMULATIVE = "the next boundary sends a cumulative delta"


class Lane:
    """One worker thread with a single job slot. ``submit`` never blocks."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._cond = threading.Condition()
        self._job: Callable[[], object] | None = None
        self._busy = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """True from a successful :meth:`submit` until that job has returned."""
        with self._cond:
            return self._busy

    def submit(self, job: Callable[[], object]) -> bool:
        """Queue ``job`` unless the lane is busy or closing; True when it was accepted."""
        with self._cond:
            if self._busy or self._closing:
                return False
            self._busy = True
            self._job = job
            self._cond.notify_all()
            return True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no job is queued or running; True when idle."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._busy, timeout)

    def close(self, timeout: float) -> bool:
        """Let a running job finish, stop the thread; True when it ended within ``timeout``."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(max(0.0, timeout))
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._job is not None or self._closing)
                job = self._job
                if job is None:
                    return
                self._job = None
            try:
                job()
            except Exception:  # a lane must survive a failing job; the job logs its own errors
                log.exception("%s: background job failed", self.name)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


def clear_pending(ctx: NodeContext, job: UploadJob) -> None:
    """``job`` no longer moves the baseline: forget it as the outstanding upload."""
    with ctx.lock:
        pending = ctx.state.pending
        if pending is not None and pending["upload_id"] == job.upload_id:
            ctx.state.pending = None


class Uploads:
    """Sends a node's deltas (the upload lane's job) and keeps what the last ones did."""

    def __init__(self, ctx: NodeContext, own: OwnProgress) -> None:
        self.ctx = ctx
        self.own = own
        self.final_sent: tuple[int, bool] | None = None  # (local step, landed)
        self.bytes_sent = 0

    def upload(self, job: UploadJob) -> bool:
        """Write, sign and send ``job``; True when it landed (see the module docstring)."""
        ctx = self.ctx
        step = job.local_step
        what = f"uploading the delta of step {step}"
        path = ctx.state_root / "outbox" / f"delta_{step}.safetensors"

        def failed(exc: Exception) -> None:
            ctx.queue_event("delta_upload_failed", {"step": step, "error": str(exc)[:200]})

        metadata: dict[str, Any] = {
            "format": "1",
            "kind": "delta",
            "node_id": ctx.node_id,
            "local_step": step,
            "base_outer_step": job.base_outer_step,
            "upload_id": job.upload_id,
        }
        if job.final:
            metadata["final"] = "1"
        metadata.update(ctx.fragments.delta_metadata(job.fragments))
        encoded: EncodedDelta | None = None
        epoch = ctx.feedback_epoch
        try:
            tensors, codec_meta = job.delta, {}
            if ctx.codec.compressed or ctx.feedback.residual:
                encoded = ctx.feedback.encode(job.delta)  # delta + residual, encoded
                tensors, codec_meta = encoded.tensors, encoded.metadata
            save_tensors(path, tensors, {**metadata, **codec_meta})
            if ctx.key is not None:
                sign_file(path, ctx.key)
            size = path.stat().st_size
        except (OSError, CodecError) as exc:  # the outbox (full disk...); a non-finite delta
            log.warning("%s failed (%s); %s", what, exc, CUMULATIVE)
            failed(exc)
            clear_pending(ctx, job)
            if job.final:
                self.final_sent = (step, False)
            return False
        try:
            sent, _ = ctx.retry.attempt(
                what,
                lambda: ctx.transport.upload_delta(ctx.node_id, step, path),
                ctx.stop,
                then=CUMULATIVE,
                on_failure=failed,
            )
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        if job.final:
            self.final_sent = (step, bool(sent))
        if not sent:
            clear_pending(ctx, job)
            with ctx.lock:
                ctx.state.baseline = self.own.unmerge_failed(job, ctx.state.baseline)
            return False
        with ctx.lock:
            state = ctx.state
            state.last_uploaded_step = step
            if job.generation == state.generation:
                state.baseline = ctx.fragments.advanced(state.baseline, job.target, job)
            if encoded is not None and epoch == ctx.feedback_epoch:
                ctx.feedback.commit(encoded)  # the residual this upload leaves
            self.bytes_sent += size
            if state.pending is not None and state.pending["upload_id"] == job.upload_id:
                state.pending = None
        payload: dict[str, Any] = {"step": step, "base_outer_step": job.base_outer_step}
        payload.update(self._metrics(job, size, encoded))
        if job.final:
            payload["final"] = True
        ctx.queue_event("delta_uploaded", payload)
        return True

    def _metrics(self, job: UploadJob, size: int, encoded: EncodedDelta | None) -> dict[str, Any]:
        """The ``delta_uploaded`` payload's byte and codec fields."""
        metrics: dict[str, Any] = {"bytes_sent": size, "codec": self.ctx.codec.codec}
        if encoded is not None:
            metrics["compression_error"] = round(encoded.error, 6)
        metrics.update(self.ctx.fragments.plan.fragment_field(job.fragments))
        return metrics
