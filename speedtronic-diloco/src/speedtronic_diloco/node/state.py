"""A node's state (:class:`NodeState`) and its one codec, the ``diloco`` entry of a trainer
checkpoint.

The live state is held under the node's lock and read by its rooms (only the applier of their
decisions, :func:`~speedtronic_diloco.node.decisions.apply`, writes it): the optimizer step,
the installed global's outer step, the baseline the next delta is measured from (and its
generation: +1 whenever it is replaced, so an upload measured from an older one does not move
it), and the dispatched upload whose effect on the baseline is outstanding. A checkpoint adds
the state of the node's other parts (error feedback, fragment versions, the master's outer
state) as carried sub-states.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from speedtronic_diloco.tensors import TensorDict, cpu_state_dict

__all__ = ["NodeState", "from_checkpoint", "to_checkpoint"]


@dataclass
class NodeState:
    """One node's state (see the module docstring)."""

    node_id: str = ""
    role: str = "worker"
    local_step: int = 0
    last_global_step: int = -1
    last_uploaded_step: int | None = None
    baseline: TensorDict = field(default_factory=dict)
    generation: int = 0
    #: The dispatched upload whose effect on the baseline is outstanding (``local_step``,
    #: ``upload_id``, ``base_outer_step``, ``generation``, with fragments ``fragments``).
    pending: dict[str, Any] | None = None
    # Carried in checkpoints only: the state of the node's other parts.
    error_feedback: dict[str, Any] | None = None
    fragments: dict[str, Any] | None = None
    outer: dict[str, Any] | None = None


def to_checkpoint(state: NodeState) -> dict[str, Any]:
    """The checkpoint form of ``state`` (the ``diloco`` entry)."""
    saved: dict[str, Any] = {
        "node_id": state.node_id,
        "role": state.role,
        "last_global_step": state.last_global_step,
        "last_uploaded_step": state.last_uploaded_step,
        "local_step": state.local_step,
        "baseline": dict(state.baseline),
        "pending_delta": dict(state.pending) if state.pending else None,
        "pending_delta_step": state.pending["local_step"] if state.pending else None,
    }
    for name in ("error_feedback", "fragments", "outer"):
        value = getattr(state, name)
        if value is not None:
            saved[name] = value
    return saved


def from_checkpoint(data: Mapping[str, Any], current: NodeState) -> NodeState:
    """The state :func:`to_checkpoint` wrote (this release or the previous one); entries it
    lacks keep ``current``'s values (the node id and role: empty when absent)."""
    uploaded = data.get("last_uploaded_step")
    pending = data.get("pending_delta")
    baseline = data.get("baseline")
    return NodeState(
        node_id=str(data.get("node_id") or ""),
        role=str(data.get("role") or ""),
        local_step=int(data.get("local_step", current.local_step)),
        last_global_step=int(data.get("last_global_step", -1)),
        last_uploaded_step=None if uploaded is None else int(uploaded),
        baseline=cpu_state_dict(baseline) if baseline else {},
        generation=current.generation,
        pending=dict(pending) if isinstance(pending, dict) and pending.get("upload_id") else None,
        error_feedback=data.get("error_feedback"),
        fragments=data.get("fragments"),
        outer=data.get("outer") or None,
    )
