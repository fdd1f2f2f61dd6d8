"""A node's inner-loop boundary: when it syncs (the run's fragment schedule) and what it
sends, the pseudo-gradient (baseline minus current weights) of the fragments due, as an
:class:`~speedtronic_diloco.node.deltas.UploadJob` for the upload lane. :func:`cut` changes
nothing itself: it returns the decision (:mod:`~speedtronic_diloco.node.decisions`) the
coordinator applies, the job :class:`Dispatched` as the outstanding upload, or the baseline
:class:`Rebaselined` where the model no longer matches it."""

from __future__ import annotations

import logging
import uuid

from torch import nn

from speedtronic_diloco.node.context import NodeContext
from speedtronic_diloco.node.decisions import Dispatched, Rebaselined
from speedtronic_diloco.node.deltas import UploadJob
from speedtronic_diloco.tensors import StateMismatchError, compute_pseudo_gradient, cpu_state_dict

__all__ = ["cut"]

log = logging.getLogger("speedtronic.diloco")


def cut(
    ctx: NodeContext, model: nn.Module, step: int, due: tuple[int, ...], final: bool
) -> Dispatched | Rebaselined:
    """The delta of the fragments ``due`` at ``step`` (the final step: all of them), to be
    recorded as the outstanding upload (:class:`Dispatched`); :class:`Rebaselined` (the
    baseline restarts here, nothing is sent) when the model's keys or shapes no longer match
    the baseline."""
    current = cpu_state_dict(model.state_dict())
    with ctx.lock:
        baseline, generation = ctx.state.baseline, ctx.state.generation
        base_outer = ctx.state.last_global_step
    try:
        delta = compute_pseudo_gradient(baseline, current)
    except StateMismatchError as exc:
        log.error("step %d: no delta uploaded: %s; measuring from here on", step, exc)
        return Rebaselined(current)
    book = ctx.fragments
    fragments = book.plan.everything() if final else due
    job = UploadJob(
        step,
        generation,
        current,
        book.plan.select(delta, fragments),
        base_outer,
        uuid.uuid4().hex,
        final,
        fragments,
        tuple(book.generations),
    )
    pending = {
        "local_step": step,
        "upload_id": job.upload_id,
        "base_outer_step": base_outer,
        "generation": generation,
        **book.pending_fields(fragments),
    }
    return Dispatched(job, pending)
