"""What a node's rooms decide, and the one place where it takes effect.

The rooms (boundary, lanes, install, resume) change nothing the node shares. Each one works out
what should change and returns it as a small frozen decision: a delta :class:`Dispatched`, an
upload :class:`Landed` or :class:`UploadFailed`, a global :class:`Installed`, a checkpoint
:class:`Restored`... The coordinator hands every decision to :func:`apply` while it holds the
node's lock. :func:`apply` is the only code that writes the node's
:class:`~speedtronic_diloco.node.state.NodeState`, along with what has to move in the same step:
the error feedback, the fragment versions, the node's own unaggregated deltas and the global
kept ready for a later boundary.

A room may have looked at the state a while before its decision arrives (an upload runs in a
background lane), so :func:`apply` checks the rules that depend on what changed in between:

* generations: an upload measured from an older baseline generation lands but leaves the
  baseline alone (each fragment also has a generation of its own:
  :meth:`~speedtronic_diloco.node.fragments.NodeFragments.advanced`);
* the feedback epoch: a residual encoded before the last error-feedback reset is not
  committed;
* upload ids: an upload clears the outstanding upload only if it is still that one.

:func:`apply` returns False when one of these rules (or the newer global a checkpoint finds
already installed) turned the decision down in whole or in part.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from speedtronic_diloco.codecs import EncodedDelta
from speedtronic_diloco.node.context import NodeContext
from speedtronic_diloco.node.deltas import OwnProgress, UploadJob
from speedtronic_diloco.node.fragments import FragmentInfo
from speedtronic_diloco.node.state import NodeState
from speedtronic_diloco.tensors import TensorDict, combine

__all__ = [
    "Decision",
    "Deferred",
    "Dispatched",
    "Installed",
    "Landed",
    "NotSent",
    "ReadySlot",
    "Rebaselined",
    "Resolved",
    "Restored",
    "Stepped",
    "UploadFailed",
    "apply",
]

log = logging.getLogger("speedtronic.diloco")


class ReadySlot(Protocol):
    """Where a fetched global waits for the training thread (the installer's ``ready``):
    ``(outer step, tensors)``, or None."""

    ready: tuple[int, TensorDict] | None


# ----------------------------------------------------------------- decisions
@dataclass(frozen=True)
class Stepped:
    """The training thread finished optimizer step ``local_step``."""

    local_step: int


@dataclass(frozen=True)
class Rebaselined:
    """The model's keys or shapes no longer match the baseline: nothing is sent, and the next
    delta is measured from ``baseline`` (a new generation)."""

    baseline: TensorDict


@dataclass(frozen=True)
class Dispatched:
    """``job`` goes to the store. ``pending`` is the record a checkpoint keeps of it while its
    effect on the baseline is outstanding. Its delta is also kept as the node's own progress
    until a global shows it aggregated."""

    job: UploadJob
    pending: dict[str, Any]


@dataclass(frozen=True)
class Landed:
    """``job`` reached the store (``size`` bytes). The baseline moves to its target unless a
    new generation began after it was measured. The residual ``encoded`` leaves is committed
    unless the error feedback was reset after ``feedback_epoch``."""

    job: UploadJob
    encoded: EncodedDelta | None
    feedback_epoch: int
    size: int


@dataclass(frozen=True)
class UploadFailed:
    """``job`` was sent but never landed. It stops being the outstanding upload. If the
    model still holds its delta as own progress, that delta goes back into the baseline, so
    the next boundary sends it again as part of a cumulative delta."""

    job: UploadJob


@dataclass(frozen=True)
class NotSent:
    """Upload ``upload_id`` never left: its file could not be written, or the lane refused
    it. It stops being the outstanding upload."""

    upload_id: str


@dataclass(frozen=True)
class Installed:
    """The ``fragments`` of global ``outer_step`` were loaded into the model. ``info`` is the
    global's fragment info and ``tensors`` the whole global. ``weights`` holds the model's
    weights under those fragments' names, which become their baseline. ``names`` (None:
    every name) are the residual entries dropped if the reset rule says so."""

    outer_step: int
    tensors: TensorDict
    fragments: tuple[int, ...]
    info: FragmentInfo | None
    weights: TensorDict
    names: set[str] | None


@dataclass(frozen=True)
class Deferred:
    """Nothing of global ``outer_step`` installs now. It waits for the boundaries of its
    fragments that are still to install, if any are."""

    outer_step: int
    tensors: TensorDict
    info: FragmentInfo | None


@dataclass(frozen=True)
class Restored:
    """A checkpoint's node state ``saved`` is taken in. Its counters are always taken. Its
    baseline (with the pending upload, error feedback and fragment versions) is taken unless
    the node already started (``started``) and installed a newer global."""

    saved: NodeState
    started: bool


@dataclass(frozen=True)
class Resolved:
    """The upload of step ``step`` that a checkpoint recorded as outstanding is settled. If
    ``delta`` is None it never arrived and the baseline stays. Otherwise the baseline moves
    to the upload's target: ``weights`` (the checkpointed weights at that step, given only
    when they are exactly the target) while the node is still at that step, else the
    baseline minus ``delta``."""

    step: int
    delta: TensorDict | None
    weights: TensorDict | None = None


Decision = (
    Stepped
    | Rebaselined
    | Dispatched
    | Landed
    | UploadFailed
    | NotSent
    | Installed
    | Deferred
    | Restored
    | Resolved
)


# ----------------------------------------------------------------- the applier
def apply(decision: Decision, ctx: NodeContext, own: OwnProgress, slot: ReadySlot) -> bool:
    """Apply ``decision`` to ``ctx``'s state (and what moves with it: ``ctx.feedback``,
    ``ctx.fragments``, ``own``, ``slot.ready``). The caller must hold ``ctx.lock``; False when
    a rule turned the decision down in whole or in part (see the module docstring)."""
    if not ctx.lock._is_owned():  # the RLock's own check (threading.Condition uses it)
        raise RuntimeError("node decisions are applied under the node's lock only")
    state = ctx.state
    if isinstance(decision, Stepped):
        state.local_step = decision.local_step
        return True
    if isinstance(decision, Rebaselined):
        state.baseline = decision.baseline
        state.generation += 1
        return True
    if isinstance(decision, Dispatched):
        state.pending = decision.pending
        own.remember(decision.job)
        return True
    if isinstance(decision, Landed):
        return _landed(decision, ctx)
    if isinstance(decision, UploadFailed):
        cleared = _forget(state, decision.job.upload_id)
        state.baseline = own.unmerge_failed(decision.job, state.baseline)
        return cleared
    if isinstance(decision, NotSent):
        return _forget(state, decision.upload_id)
    if isinstance(decision, Installed):
        _installed(decision, ctx, slot)
        return True
    if isinstance(decision, Deferred):
        # Kept ready only while some of its fragments are still to install.
        pending = bool(ctx.fragments.pending(decision.info))
        return pending and _keep_ready(slot, decision.outer_step, decision.tensors)
    if isinstance(decision, Restored):
        return _restored(decision, ctx)
    return _resolved(decision, state)


def _forget(state: NodeState, upload_id: str) -> bool:
    """Forget the outstanding upload when it is ``upload_id``'s; False when it is not."""
    if state.pending is None or state.pending["upload_id"] != upload_id:
        return False
    state.pending = None
    return True


def _landed(decision: Landed, ctx: NodeContext) -> bool:
    state, book, job = ctx.state, ctx.fragments, decision.job
    state.last_uploaded_step = job.local_step
    # A new generation since it was measured (a resume, a re-baseline): the baseline stays.
    # A fragment installed again since: that fragment's baseline stays (``advanced``).
    current = job.generation == state.generation
    if current:
        state.baseline = book.advanced(state.baseline, job.target, job)
    if decision.encoded is not None and decision.feedback_epoch == ctx.feedback_epoch:
        ctx.feedback.commit(decision.encoded)  # the residual this upload leaves
    _forget(state, job.upload_id)
    reinstalled = any(book.generations[j] != job.fragment_generations[j] for j in job.fragments)
    return current and not reinstalled


def _installed(decision: Installed, ctx: NodeContext, slot: ReadySlot) -> None:
    state, book = ctx.state, ctx.fragments
    state.baseline = {**state.baseline, **decision.weights}
    ctx.reset_residual(state.last_global_step, decision.outer_step, decision.names)
    book.mark(decision.fragments, decision.info)
    if not book.pending(decision.info):
        state.last_global_step = max(state.last_global_step, decision.outer_step)
    else:
        _keep_ready(slot, decision.outer_step, decision.tensors)
    ref = state.pending
    if ref is not None and set(ref.get("fragments", book.plan.everything())) & set(
        decision.fragments
    ):
        state.pending = None  # that upload no longer moves its baseline


def _keep_ready(slot: ReadySlot, outer_step: int, tensors: TensorDict) -> bool:
    """Keep global ``outer_step`` ready unless a newer one already is."""
    if slot.ready is not None and slot.ready[0] >= outer_step:
        return False
    slot.ready = (outer_step, tensors)
    return True


def _restored(decision: Restored, ctx: NodeContext) -> bool:
    live, saved = ctx.state, decision.saved
    live.local_step = saved.local_step
    live.last_uploaded_step = saved.last_uploaded_step
    if decision.started and saved.last_global_step < live.last_global_step:
        log.info(
            "checkpointed baseline (outer step %d) is older than the installed "
            "global (outer step %d); keeping the newer one",
            saved.last_global_step,
            live.last_global_step,
        )
        return False
    if saved.baseline:
        live.baseline = saved.baseline
        live.generation += 1
        live.last_global_step = saved.last_global_step
        if saved.pending is not None:
            live.pending = saved.pending
        ctx.feedback.load_state_dict(saved.error_feedback)
        ctx.fragments.load_state_dict(saved.fragments)
    return True


def _resolved(decision: Resolved, state: NodeState) -> bool:
    state.pending = None
    if decision.delta is None:
        return True
    if decision.weights is not None and state.local_step == decision.step:
        state.baseline = decision.weights  # the checkpointed weights are its target
    else:
        state.baseline = combine(state.baseline, decision.delta, sign=-1)
    state.generation += 1
    state.last_uploaded_step = decision.step
    return True
