"""A node's background lanes and the upload that runs in one.

A :class:`Lane` is one daemon thread that runs at most one job at a time and refuses a new job
while busy, so the training thread never waits behind slow store I/O (a node has an upload
lane and, for a worker, a poll lane). :meth:`Uploads.upload` is the upload lane's job:
:meth:`Uploads.send` writes the delta (encoded with the error feedback's residual, signed),
sends it and returns what came of it (:mod:`~speedtronic_diloco.node.decisions`): it
:class:`Landed`, so the baseline moves to the uploaded snapshot unless a global was installed
since (the generation check); it :class:`UploadFailed`, so the baseline stays and the next
boundary sends the cumulative delta; or it was :class:`NotSent`. The coordinator's applier,
handed in as ``settle``, puts that into effect.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from speedtronic_diloco.codecs import CodecError, EncodedDelta
from speedtronic_diloco.node.context import NodeContext
from speedtronic_diloco.node.decisions import Decision, Landed, NotSent, UploadFailed
from speedtronic_diloco.node.deltas import UploadJob
from speedtronic_diloco.signing import sign_file
from speedtronic_diloco.tensors import save_tensors

__all__ = ["CUMULATIVE", "Lane", "Uploads"]

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


class Uploads:
    """Sends a node's deltas (the upload lane's job) and keeps what the last ones did.
    ``settle`` applies a decision under the node's lock (the coordinator's applier)."""

    def __init__(self, ctx: NodeContext, settle: Callable[[Decision], bool]) -> None:
        self.ctx = ctx
        self._settle = settle
        self.final_sent: tuple[int, bool] | None = None  # (local step, landed)
        self.bytes_sent = 0

    def upload(self, job: UploadJob) -> bool:
        """Send ``job`` (:meth:`send`), apply what came of it; True when it landed."""
        outcome = self.send(job)
        self._settle(outcome)
        if not isinstance(outcome, Landed):
            return False
        self.bytes_sent += outcome.size
        payload: dict[str, Any] = {"step": job.local_step, "base_outer_step": job.base_outer_step}
        payload.update(self._metrics(job, outcome.size, outcome.encoded))
        if job.final:
            payload["final"] = True
        self.ctx.queue_event("delta_uploaded", payload)
        return True

    def send(self, job: UploadJob) -> Landed | UploadFailed | NotSent:
        """Write, sign and send ``job``; what came of it (see the module docstring). Changes
        no node state: only :attr:`final_sent`, and ``delta_upload_failed`` events."""
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
            if job.final:
                self.final_sent = (step, False)
            return NotSent(job.upload_id)
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
            return UploadFailed(job)
        return Landed(job, encoded, epoch, size)

    def _metrics(self, job: UploadJob, size: int, encoded: EncodedDelta | None) -> dict[str, Any]:
        """The ``delta_uploaded`` payload's byte and codec fields."""
        metrics: dict[str, Any] = {"bytes_sent": size, "codec": self.ctx.codec.codec}
        if encoded is not None:
            metrics["compression_error"] = round(encoded.error, 6)
        metrics.update(self.ctx.fragments.plan.fragment_field(job.fragments))
        return metrics
