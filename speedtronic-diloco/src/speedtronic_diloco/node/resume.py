"""Exact resume of a pending upload. Each dispatched upload carries a random ``upload_id``;
while its effect on the baseline is outstanding, checkpoints record it (``pending_delta``). A
resumed node asks the store whether that delta arrived: if it did, the baseline advances to
its target (the checkpointed weights at that step, or baseline minus the stored delta); if
not, it asks once more at the next boundary, right before sending (an upload whose request
left just before the crash may land late), and if it is still not there the baseline stays
and that boundary sends the progress again, cumulatively.

Both functions here return decisions (:mod:`~speedtronic_diloco.node.decisions`) for the
coordinator to apply: :class:`Restored` for a checkpoint's node state, :class:`Resolved` for
an outstanding upload that is settled."""

from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path

from torch import nn

from speedtronic.errors import SpeedtronicError
from speedtronic_diloco.codecs import CodecError, decode_delta
from speedtronic_diloco.node.context import NodeContext
from speedtronic_diloco.node.decisions import Resolved, Restored
from speedtronic_diloco.node.state import NodeState
from speedtronic_diloco.tensors import TensorDict, TensorFileError, cpu_state_dict, load_tensors

__all__ = ["PendingUpload", "restore_node_state"]

log = logging.getLogger("speedtronic.diloco")


def restore_node_state(ctx: NodeContext, saved: NodeState, *, started: bool) -> Restored:
    """Take a checkpoint's node state (``saved``) into ``ctx``, as a decision: its counters,
    and its baseline (with the pending upload, error feedback and fragment schedule) unless
    this node already installed a newer global (``started``; the applier compares). Raises
    SpeedtronicError when the state was saved by another node id or role."""
    if (saved.node_id and saved.node_id != ctx.node_id) or (
        saved.role and saved.role != ctx.state.role
    ):
        raise SpeedtronicError(
            f"this checkpoint's DumbDiLoCo state belongs to {saved.role} {saved.node_id!r}, "
            f"but this process is {ctx.state.role} {ctx.node_id!r}: resume with the same "
            "distributed.role and distributed.node_id, or start a fresh run (a new "
            "run.output_dir) to join as this node"
        )
    return Restored(saved, started)


class PendingUpload:
    """Resolves the outstanding upload a checkpoint recorded (see the module docstring)."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.unresolved = False  # a resume could not ask the store yet
        self._asks = 0  # how often the store said "not there"

    def resolve(self, model: nn.Module) -> Resolved | None:
        """Did the upload the checkpoint recorded as outstanding arrive? Yes: move the
        baseline to its target. No: ask once more at the next boundary (a late commit may
        still land), then keep the baseline (the next delta includes that progress). Unknown
        (store unreachable): ask again at the next boundary. The :class:`Resolved` decision
        once it is settled, None while it is not (or nothing is outstanding)."""
        ctx = self.ctx
        with ctx.lock:
            ref = ctx.state.pending
        if ref is None:
            self.unresolved = False
            self._asks = 0
            return None
        step, upload_id = int(ref["local_step"]), str(ref["upload_id"])
        read, listing = ctx.retry.attempt(
            f"checking whether the delta of step {step} arrived",
            ctx.transport.list_deltas,
            ctx.stop,
            then="asking again at the next boundary",
        )
        if not read or listing is None:
            self.unresolved = True
            return None
        info = next((i for i in listing if i.key == (ctx.node_id, step)), None)
        stored: TensorDict | None = None
        if info is not None:
            with tempfile.TemporaryDirectory(dir=ctx.state_root) as tmp:
                dest = Path(tmp) / "pending.safetensors"
                done, _ = ctx.retry.attempt(
                    f"downloading {info.path}",
                    lambda: ctx.transport.download_delta(info, dest),
                    ctx.stop,
                    then="asking again at the next boundary",
                )
                if not done:
                    self.unresolved = True
                    return None
                try:
                    tensors, metadata = load_tensors(dest)
                except TensorFileError:
                    tensors, metadata = {}, {}
                if metadata.get("upload_id") == upload_id:
                    with contextlib.suppress(CodecError):  # undecodable: as if it never came
                        stored = decode_delta(tensors, metadata)
        if stored is None and self._asks == 0:
            # Not there at resume. An upload whose request left just before the crash may
            # still land (a Hub commit the server is finishing), so the next boundary asks
            # once more, right before it sends anything, an inner loop later.
            self._asks = 1
            self.unresolved = True
            log.info(
                "the delta of step %d (in flight at the checkpoint) is not in the store; "
                "asking once more at the next boundary before sending that progress again",
                step,
            )
            return None
        self.unresolved = False
        self._asks = 0
        if stored is None:
            log.info(
                "the delta of step %d (in flight at the checkpoint) did not arrive; the next "
                "boundary sends that progress again (cumulative)",
                step,
            )
            return Resolved(step, None)
        log.info(
            "the delta of step %d (in flight at the checkpoint) arrived; measuring from its "
            "target, so it is not sent twice",
            step,
        )
        # Compressed (the residual is kept: baseline minus what was received is exact) or
        # one fragment (the weights would move the others' baselines): the applier subtracts.
        exact = not ctx.codec.compressed and ctx.fragments.exact_target()
        if exact and ctx.state.local_step == step:  # the checkpointed weights are its target
            return Resolved(step, stored, cpu_state_dict(model.state_dict()))
        return Resolved(step, stored)
